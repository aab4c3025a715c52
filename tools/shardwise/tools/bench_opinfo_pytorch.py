"""PyTorch's own DTensor as a backend of the OpInfo sweep: the comparison figure (coverage and sweep time).

Used by ``python -m shardwise.tools.opinfo_sweep --torch``. The calls, shardings and expected
outputs are the same plan the shardwise sweep runs (``shardwise.testing._opinfo_sweep``); only
the DTensor implementation differs: PyTorch's ``DeviceMesh`` over the same threaded world, its
``DTensorConverter`` (``torch.testing._internal.distributed._tensor.common_dtensor``), its
``distribute_tensor`` and ``full_tensor``. As PyTorch's own ``DTensorOpTestBase`` does, its
sharding propagator's fake-mode lock is made a real lock while rank threads share the process.

PyTorch's DTensor is imported here only as the comparison (a benchmark of coverage); the
``bench_`` name keeps it out of product code for the layer checker.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed.tensor as torch_dtensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from shardwise.placement import Placement, Replicate, Shard
from shardwise.testing._opinfo_sweep import ConverterLike

__all__ = ["PyTorchBackend"]

_NO_STRATEGY_MARK = "does not have a sharding strategy registered"


class PyTorchBackend:
    """``SweepBackend`` for ``torch.distributed.tensor``."""

    name = "pytorch"

    def world_context(self) -> AbstractContextManager[object]:
        return _thread_safe_sharding_propagation()

    def build_mesh(self, mesh_shape: tuple[int, ...]) -> Any:
        return init_device_mesh("cpu", mesh_shape)

    def new_converter(self, mesh: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ConverterLike:
        # Imported late: torch's test utilities are heavy and need `expecttest`.
        from torch.testing._internal.distributed._tensor.common_dtensor import DTensorConverter

        converter: ConverterLike = DTensorConverter(mesh, args, kwargs)
        return converter

    def placements(self, ours: tuple[Placement, ...]) -> list[Any]:
        return [_to_torch_placement(placement) for placement in ours]

    def is_dtensor(self, value: object) -> bool:
        return isinstance(value, torch_dtensor.DTensor)

    def full_tensor(self, value: Any) -> torch.Tensor:
        full: torch.Tensor = value.full_tensor()
        return full

    def missing_rule(self, error: BaseException) -> str | None:
        message = str(error)
        if not isinstance(error, NotImplementedError) or _NO_STRATEGY_MARK not in message:
            return None
        # "Operator aten.foo.default does not have a sharding strategy registered."
        before = message.split(_NO_STRATEGY_MARK, 1)[0].split()
        return before[-1] if before else "?"


def _to_torch_placement(placement: Placement) -> Any:
    if isinstance(placement, Shard):
        return torch_dtensor.Shard(placement.dim)
    if isinstance(placement, Replicate):
        return torch_dtensor.Replicate()
    raise ValueError(f"the sweep only lays tensors out as Shard or Replicate, got {placement!r}")


@contextmanager
def _thread_safe_sharding_propagation() -> Iterator[None]:
    original = ShardingPropagator._fake_mode_lock
    # Re-entrant: a propagation that propagates again on the same thread must not deadlock.
    ShardingPropagator._fake_mode_lock = threading.RLock()  # type: ignore[assignment]
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = original
