"""``AutoPlan``: what ``auto_plan`` returns; ``print(plan)`` is the plan as Python, ``plan.apply`` lays it onto
the model (styles, tied weights, sequence-length check, context parallelism, FSDP units)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn

from shardwise.mesh import DeviceMesh

from ._auto_candidates import PlanChoice, StyleSpec, read_mesh_dims
from ._auto_cost import Estimate
from ._auto_structure import _SEQUENCE_DIM
from .style import ParallelStyle

__all__ = ["AutoPlan"]


@dataclasses.dataclass
class AutoPlan:
    """What ``auto_plan`` chose; ``print(plan)`` shows it as Python to paste and edit."""

    model_name: str
    choice: PlanChoice
    parallelize_plan_specs: dict[str, StyleSpec]
    loss_parallel: bool
    fsdp_units: tuple[str, ...]  # module FQNs, "" for the root; FSDP on the dp dim, applied in this order
    reshard_after_forward: bool
    context_parallel_modules: tuple[str, ...]
    tied_parameters: tuple[tuple[str, ...], ...]
    sequence_length_multiple: int | None  # sequence parallelism needs the sequence length to be a multiple of this
    estimate: Estimate
    runner_up: tuple[PlanChoice, Estimate] | None
    notes: tuple[str, ...]
    candidates_priced: int
    solve_seconds: float
    mesh_dim_names: tuple[str | None, str | None, str | None]  # the names of the tp, dp and cp dims

    @property
    def parallelize_plan(self) -> dict[str, ParallelStyle]:
        """The dict ``parallelize_module(model, tp_mesh, ...)`` takes."""
        return {path: spec.build() for path, spec in self.parallelize_plan_specs.items()}

    def __str__(self) -> str:
        tp_name, dp_name, cp_name = self.mesh_dim_names
        mesh_of = (lambda name: f'mesh["{name}"]' if name else "mesh")
        lines = [
            f"# shardwise auto_plan for {self.model_name}: {self.choice.describe()}",
            f"# estimated step per rank: {self.estimate.summary()}",
        ]
        if self.runner_up is not None:
            choice, estimate = self.runner_up
            lines += [f"# runner-up: {choice.describe()}", f"#   {estimate.summary()}"]
        lines += [f"# {note}" for note in self.notes]
        lines.append(f"# {self.candidates_priced} candidates priced in {self.solve_seconds:.2f} s")
        lines += [
            "from shardwise.placement import Replicate, Shard",
            "from shardwise.tp_styles import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module",
        ]
        if self.parallelize_plan_specs:
            lines.append("tp_plan = {")
            lines += [f"    {path!r}: {spec.source()}," for path, spec in self.parallelize_plan_specs.items()]
            lines.append("}")
            lines.append(f"parallelize_module(model, {mesh_of(tp_name)}, tp_plan)")
        for names in self.tied_parameters:
            first, *others = names
            lines += [f"model.{other} = model.{first}  # one weight, shared again after the styles distributed it" for other in others]
        if self.context_parallel_modules:
            lines += [
                "from shardwise.dtensor_ops.experimental._attention import _ContextParallel",
                f"for name in {list(self.context_parallel_modules)!r}:",
                f"    parallelize_module(model.get_submodule(name), {mesh_of(cp_name)}, "
                "_ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))",
                "# shard the inputs (tokens, positions, labels) with context_parallel / _context_parallel_shard",
            ]
        if self.fsdp_units:
            lines.append("from shardwise.fsdp_ext import fully_shard")
            for unit in self.fsdp_units:
                target = f"model.get_submodule({unit!r})" if unit else "model"
                flag = self.reshard_after_forward if unit else False
                lines.append(f"fully_shard({target}, mesh={mesh_of(dp_name)}, reshard_after_forward={flag})")
        if self.loss_parallel:
            lines.append("# logits stay cut by vocabulary: run forward, loss and backward inside `with loss_parallel():`")
        return "\n".join(lines)

    def apply(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        *,
        fully_shard: Callable[..., Any] | None = None,
        context_parallel: bool = True,
    ) -> nn.Module:
        """Applies the plan to ``model`` in place (the model the plan was made for) and returns it.

        ``fully_shard``: ``shardwise.fsdp_ext.fully_shard``, needed when the plan has FSDP units (this
        package sits beside ``fsdp_ext`` in shardwise's layers and does not import it). ``context_parallel``:
        register ``_ContextParallel`` on the attention modules (False when the caller runs the whole
        forward inside ``context_parallel(...)``, which already makes every attention ring attention).
        """
        dims = read_mesh_dims(mesh)
        if self.fsdp_units and fully_shard is None:
            raise ValueError(
                "AutoPlan.apply: the plan has FSDP units on the dp dim; pass fully_shard=shardwise.fsdp_ext.fully_shard"
            )
        self._check_model_has_every_target(model)
        from .api import parallelize_module

        if self.parallelize_plan_specs:
            parallelize_module(model, dims.sub_mesh(dims.tp), self.parallelize_plan)
        for names in self.tied_parameters:
            first, *others = names
            shared = model.get_parameter(first)
            for other in others:
                owner, _, attribute = other.rpartition(".")
                setattr(model.get_submodule(owner), attribute, shared)
        if self.sequence_length_multiple:
            model.register_forward_pre_hook(_SequenceLengthCheck(self.sequence_length_multiple))
        if self.context_parallel_modules and context_parallel:
            from shardwise.dtensor_ops.experimental._attention import _ContextParallel

            for name in self.context_parallel_modules:
                parallelize_module(
                    model.get_submodule(name),
                    dims.sub_mesh(dims.cp),
                    _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA),  # type: ignore[arg-type]
                )
        if self.fsdp_units and fully_shard is not None:
            dp_mesh = dims.sub_mesh(dims.dp)
            for unit in self.fsdp_units:
                if unit:
                    fully_shard(model.get_submodule(unit), mesh=dp_mesh, reshard_after_forward=self.reshard_after_forward)
                else:
                    fully_shard(model, mesh=dp_mesh)
        return model


    def _check_model_has_every_target(self, model: nn.Module) -> None:
        """Every module and parameter the plan names must exist in ``model``: checked before the first change, so
        a plan applied to another model than the one it was made for fails with the model untouched."""
        missing: list[str] = []
        for unit in [*self.fsdp_units, *self.context_parallel_modules]:
            try:
                model.get_submodule(unit)
            except AttributeError:
                missing.append(f"module {unit!r}")
        for names in self.tied_parameters:
            for name in names:
                try:
                    model.get_parameter(name)
                except AttributeError:
                    missing.append(f"parameter {name!r}")
        for path in self.parallelize_plan_specs:
            if not _path_matches_a_module(model, path):
                missing.append(f"module path {path!r}")
        if missing:
            raise ValueError(
                f"AutoPlan.apply: the plan was made for {self.model_name}, and {type(model).__name__} has no "
                f"{', '.join(missing)}; apply a plan to the model it was made for (nothing was changed)"
            )


def _path_matches_a_module(model: nn.Module, path: str) -> bool:
    """Whether the plan path (dotted, each segment an fnmatch pattern over named_children) matches a module."""
    import fnmatch

    if not path:
        return True
    current = [model]
    for segment in path.split("."):
        current = [child for module in current for name, child in module.named_children() if fnmatch.fnmatchcase(name, segment)]
        if not current:
            return False
    return True


class _SequenceLengthCheck:
    """Forward pre-hook under sequence parallelism: the tokens' sequence must cut evenly over the tp ranks."""

    def __init__(self, multiple: int) -> None:
        self.multiple = multiple

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        tokens = args[0] if args else None
        if isinstance(tokens, torch.Tensor) and tokens.ndim >= 2 and tokens.size(_SEQUENCE_DIM) % self.multiple:
            raise ValueError(
                f"{type(module).__name__} (auto plan, sequence parallel over {self.multiple} ranks): the sequence length "
                f"{tokens.size(_SEQUENCE_DIM)} of the input {tuple(tokens.shape)} must be a multiple of {self.multiple}"
            )

