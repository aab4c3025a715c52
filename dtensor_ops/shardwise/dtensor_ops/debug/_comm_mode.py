"""CommDebugMode: counts and traces the collectives issued inside a ``with`` block.

It is a ``TorchDispatchMode``.  Modes see an op before tensor subclasses do, so
for an op with DTensor arguments the mode records it and returns
``NotImplemented``: DTensor's own ``__torch_dispatch__`` then runs with the mode
still active, and the collectives it issues on plain local tensors come back
through the mode and are counted.  Ops on plain tensors are run directly.

Counts are kept in total, per module and per pass (forward / backward); a
module's counts include its submodules', and ``"Global"`` holds everything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode

from .._dtensor import DTensor
from ._comm_keys import CommCounts, comm_key_for_op
from ._module_tracker import GLOBAL_MODULE_NAME, Attribution, ModuleTracker
from ._report import build_module_tree, render_json, render_table
from ._trace import EventKind, TraceEvent, check_noise_level, describe_tensor_args, is_metadata_only_op

__all__ = ["CommDebugMode"]


@dataclass(frozen=True)
class ModuleSummary:
    """What ``CommDebugMode.advanced_module_tracker`` answers (PyTorch's attribute, read as a summary)."""

    module_helper_dict: dict[str, dict[str, Any]]


class CommDebugMode(TorchDispatchMode):
    """Context manager counting the collectives (functional and c10d) run inside it.

    Entering resets everything recorded by a previous ``with`` block.  Results stay
    readable after exit::

        comm_mode = CommDebugMode()
        with comm_mode:
            model(inputs).sum().backward()
        comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
        print(comm_mode.generate_comm_debug_tracing_table(noise_level=1))

    Module names are fully qualified from the outermost module called, which is
    named by its class: ``"MLP"``, ``"MLP.net1"``.  ``"Global"`` covers the whole block.
    """

    def __init__(self) -> None:
        super().__init__()
        self.comm_counts = CommCounts()
        self.comm_module_counts: dict[str, dict[str, CommCounts]] = {}
        self._events: list[TraceEvent] = []
        self._dtensor_parameters: dict[str, dict[str, torch.Tensor]] = {}
        self._module_types: dict[str, type[nn.Module]] = {}
        self._dtensor_class: type[torch.Tensor] | None = DTensor
        self._tracker = ModuleTracker(on_module_call=self._on_module_call)
        self._active = False

    # ------------------------------------------------------------------ context
    def __enter__(self) -> CommDebugMode:
        if self._active:
            raise RuntimeError(
                "this CommDebugMode is already active: it cannot be entered again inside its own with block "
                "(that would reset what it has counted so far); use a second CommDebugMode to nest"
            )
        self.comm_counts = CommCounts()
        self.comm_module_counts = {GLOBAL_MODULE_NAME: self._empty_pass_counts()}
        self._events = []
        self._dtensor_parameters = {}
        self._module_types = {}
        self._tracker.start()
        try:
            super().__enter__()
        except BaseException:
            self._tracker.stop()
            raise
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            self._tracker.stop()
            self._active = False

    # ----------------------------------------------------------------- dispatch
    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        dtensor_class = self._dtensor_class
        where = self._tracker.current()
        if dtensor_class is not None and any(issubclass(t, dtensor_class) for t in types):
            # DTensor's dispatch runs next with this mode still active; the collectives
            # it issues on local tensors are counted then, so this op itself is not.
            self._events.append(self._dtensor_event(func, args, kwargs, dtensor_class, where))
            return NotImplemented
        comm_key = comm_key_for_op(func)
        if comm_key is not None:
            self._count(comm_key, where)
        shapes, on_meta_only = describe_tensor_args(args, kwargs)
        self._events.append(
            TraceEvent(
                module_fqn=where.chain[-1] if where.chain else GLOBAL_MODULE_NAME,
                op=func,
                kind=EventKind.COLLECTIVE if comm_key is not None else EventKind.TENSOR_OP,
                is_backward=where.is_backward,
                is_recompute=where.is_recompute,
                metadata_only=on_meta_only or is_metadata_only_op(func),
                input_shapes=shapes,
            )
        )
        return func(*args, **kwargs)

    def _dtensor_event(
        self,
        func: OpOverload,
        args: Sequence[object],
        kwargs: Mapping[str, object],
        dtensor_class: type[torch.Tensor],
        where: Attribution,
    ) -> TraceEvent:
        shapes: list[torch.Size] = []
        placements: list[tuple[object, ...]] = []
        mesh: object | None = None
        for value in (*args, *kwargs.values()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, dtensor_class):
                    shapes.append(item.shape)
                    placements.append(tuple(getattr(item, "placements")))
                    if mesh is None:
                        mesh = getattr(item, "device_mesh")
        return TraceEvent(
            module_fqn=where.chain[-1] if where.chain else GLOBAL_MODULE_NAME,
            op=func,
            kind=EventKind.DTENSOR_OP,
            is_backward=where.is_backward,
            is_recompute=where.is_recompute,
            metadata_only=is_metadata_only_op(func),
            input_shapes=tuple(shapes),
            input_placements=tuple(placements),
            device_mesh=mesh,
        )

    def _count(self, comm_key: OpOverloadPacket, where: Attribution) -> None:
        self.comm_counts.add(comm_key)
        phase = "backward" if where.is_backward else "forward"
        for fqn in dict.fromkeys((GLOBAL_MODULE_NAME, *where.chain)):
            per_module = self.comm_module_counts.get(fqn)
            if per_module is None:
                per_module = self.comm_module_counts[fqn] = self._empty_pass_counts()
            per_module[phase].add(comm_key)

    @staticmethod
    def _empty_pass_counts() -> dict[str, CommCounts]:
        return {"forward": CommCounts(), "backward": CommCounts()}

    def _on_module_call(self, module: nn.Module, fqn: str) -> None:
        if fqn not in self.comm_module_counts:
            self.comm_module_counts[fqn] = self._empty_pass_counts()
        self._module_types.setdefault(fqn, type(module))
        dtensor_class = self._dtensor_class
        if dtensor_class is None:
            return
        for name, param in module.named_parameters(recurse=False):
            if isinstance(param, dtensor_class):
                self._dtensor_parameters.setdefault(fqn, {})[name] = param

    # ------------------------------------------------------------------ results
    @property
    def advanced_module_tracker(self) -> ModuleSummary:
        """PyTorch's view of the modules seen: ``module_helper_dict[fqn]`` holds ``module_type``, ``depth``
        (``"Global"`` is 0, each dot one deeper) and, for DTensor parameters, ``parameters`` (their placements)."""
        helper: dict[str, dict[str, Any]] = {GLOBAL_MODULE_NAME: {"depth": 0}}
        for fqn, module_type in self._module_types.items():
            entry: dict[str, Any] = {
                "module_type": str(module_type).replace("<", "").replace(">", ""),
                "depth": fqn.count(".") + 1,
            }
            parameters = self._dtensor_parameters.get(fqn)
            if parameters:
                entry["parameters"] = {name: str(getattr(param, "placements")) for name, param in parameters.items()}
            helper[fqn] = entry
        return ModuleSummary(helper)

    def get_total_counts(self) -> int:
        """Number of collectives issued in the last ``with`` block."""
        return self.comm_counts.total()

    def get_comm_counts(self) -> CommCounts:
        """Collective counts by op (a snapshot).

        Read with either spelling: ``torch.ops.c10d_functional.X`` or ``torch.ops._c10d_functional.X``.
        """
        return self.comm_counts.copy()

    def get_per_module_comm_counts(self) -> dict[str, dict[str, CommCounts]]:
        """``{module fqn: {"forward": counts, "backward": counts}}``, ``"Global"`` first.

        Every module called in the block appears, in first-call order; a module's
        counts include those of the modules it called.
        """
        return {
            fqn: {phase: counts.copy() for phase, counts in per_pass.items()}
            for fqn, per_pass in self.comm_module_counts.items()
        }

    def get_parameter_info(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{module fqn: {parameter name: DTensor parameter}}`` for modules called in the block."""
        return {fqn: dict(params) for fqn, params in self._dtensor_parameters.items()}

    def get_sharding_info(self) -> dict[str, tuple[object, ...]]:
        """``{"<module fqn>.<parameter name>": placements}`` for every DTensor parameter seen."""
        return {
            f"{fqn}.{name}": tuple(getattr(param, "placements"))
            for fqn, params in self._dtensor_parameters.items()
            for name, param in params.items()
        }

    def _parameter_placements(self) -> dict[str, dict[str, object]]:
        return {
            fqn: {name: tuple(getattr(param, "placements")) for name, param in params.items()}
            for fqn, params in self._dtensor_parameters.items()
        }

    def _module_tree_json(self, noise_level: int) -> dict[str, object]:
        tree = build_module_tree(
            self._tracker.modules, self.comm_module_counts, self._parameter_placements(), self._events
        )
        return render_json(tree, noise_level)

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """The per-module report as text.

        ``noise_level`` 0: collective counts per module and pass; 1: also module
        classes, DTensor parameters, each collective with its input shapes and the
        DTensor ops (shapes, placements, mesh); 2: also plain-tensor ops;
        3: also metadata-only ops (views, detach, ...).
        """
        check_noise_level(noise_level)
        tree = build_module_tree(
            self._tracker.modules, self.comm_module_counts, self._parameter_placements(), self._events
        )
        return render_table(tree, noise_level)

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: int = 3) -> None:
        """Write the per-module report as JSON (same content and levels as the table)."""
        check_noise_level(noise_level)
        with open(file_name, "w", encoding="utf-8") as json_file:
            json.dump(self._module_tree_json(noise_level), json_file, indent=4)

    def log_comm_debug_tracing_table_to_file(
        self, file_name: str = "comm_mode_log.txt", noise_level: int = 3
    ) -> None:
        """Write :meth:`generate_comm_debug_tracing_table` to ``file_name``."""
        table = self.generate_comm_debug_tracing_table(noise_level)
        with open(file_name, "w", encoding="utf-8") as log_file:
            log_file.write(table)
