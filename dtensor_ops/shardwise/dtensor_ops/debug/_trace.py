"""What CommDebugMode records per op, and how much of it each noise level shows.

Noise levels (the same scale as PyTorch's ``CommDebugMode``):

* 0: collective counts per module and pass;
* 1: also each module's class and DTensor parameters, every collective call with
  its input shapes, and DTensor ops that compute something (with global input
  shapes, placements and mesh);
* 2: also the plain-tensor ops that compute something (e.g. the local op a DTensor
  op runs on its shards);
* 3: everything, including metadata-only ops that do no arithmetic: views,
  ``detach``, ``t``, same-valued copies, and any op on meta tensors (shape inference).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch._ops import OpOverload

__all__ = [
    "EventKind",
    "TraceEvent",
    "MAX_NOISE_LEVEL",
    "check_noise_level",
    "describe_tensor_args",
    "is_visible",
    "is_metadata_only_op",
]

MAX_NOISE_LEVEL = 3

_METADATA_ONLY_OPS = frozenset(
    {
        "aten::_to_copy",
        "aten::clone",
        "aten::lift_fresh",
        "aten::empty_like",
        "aten::empty",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)
_METADATA_ONLY_CACHE: dict[OpOverload, bool] = {}
_META_DEVICE = torch.device("meta")


def is_metadata_only_op(op: OpOverload) -> bool:
    """True for ops that only create views, aliases or same-valued copies (no arithmetic)."""
    cached = _METADATA_ONLY_CACHE.get(op)
    if cached is not None:
        return cached
    schema = op._schema
    returns_view = any(ret.alias_info is not None and not ret.alias_info.is_write for ret in schema.returns)
    result = returns_view or schema.name in _METADATA_ONLY_OPS
    _METADATA_ONLY_CACHE[op] = result
    return result


class EventKind(enum.Enum):
    COLLECTIVE = "collective"
    DTENSOR_OP = "dtensor_op"
    TENSOR_OP = "tensor_op"


@dataclass(frozen=True)
class TraceEvent:
    """One op seen by the mode, attributed to the innermost running module."""

    module_fqn: str
    op: OpOverload
    kind: EventKind
    is_backward: bool
    is_recompute: bool
    metadata_only: bool
    input_shapes: tuple[torch.Size, ...]
    # Set for DTensor ops only: one placement tuple per DTensor input, and the mesh.
    input_placements: tuple[tuple[object, ...], ...] = ()
    device_mesh: object | None = None

    @property
    def name(self) -> str:
        return str(self.op)

    def detail_lines(self) -> list[str]:
        lines = [f"shape: {list(self.input_shapes)}"]
        if self.kind is EventKind.DTENSOR_OP:
            lines.append(f"sharding: {list(self.input_placements)}")
            lines.append(f"device mesh: {self.device_mesh}")
        return lines

    def to_json(self) -> dict[str, object]:
        entry: dict[str, object] = {
            "name": self.name,
            "kind": self.kind.value,
            "input_shape": [list(shape) for shape in self.input_shapes],
            "is_bw": self.is_backward,
            "is_activation_checkpointing": self.is_recompute,
        }
        if self.kind is EventKind.DTENSOR_OP:
            entry["input_sharding"] = [str(placements) for placements in self.input_placements]
            entry["device_mesh"] = str(self.device_mesh)
        return entry


def check_noise_level(noise_level: int) -> int:
    if isinstance(noise_level, bool) or not isinstance(noise_level, int) or not 0 <= noise_level <= MAX_NOISE_LEVEL:
        raise ValueError(f"noise_level must be an int in [0, {MAX_NOISE_LEVEL}]; got {noise_level!r}")
    return noise_level


def is_visible(event: TraceEvent, noise_level: int) -> bool:
    if noise_level >= MAX_NOISE_LEVEL:
        return True
    if noise_level == 0:
        return False
    if event.kind is EventKind.COLLECTIVE:
        return True
    if event.metadata_only:
        return False
    if event.kind is EventKind.TENSOR_OP:
        return noise_level >= 2
    return True


def describe_tensor_args(args: Iterable[object], kwargs: Mapping[str, object]) -> tuple[tuple[torch.Size, ...], bool]:
    """Shapes of the tensors among an op's arguments (one level of list nesting), in order,
    and whether the op works on the meta device only (shape inference, no data)."""
    shapes: list[torch.Size] = []
    on_meta_only = bool(kwargs) and kwargs.get("device") == _META_DEVICE
    saw_data = False
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor):
                shapes.append(item.shape)
                if item.is_meta:
                    on_meta_only = True
                else:
                    saw_data = True
    return tuple(shapes), on_meta_only and not saw_data
