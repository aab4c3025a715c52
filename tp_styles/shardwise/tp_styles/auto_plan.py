"""``auto_plan`` / ``auto_parallelize``: the whole parallel plan of a model for a mesh, chosen by estimated step time.

How (one pass, no collective, no real compute):

1. **Trace** the forward once on fake tensors (``_auto_trace``): every aten op with its shapes and
   FLOPs, every module call.
2. **Find the structure** (``_auto_structure``): tensor-parallel regions (entries column-wise, exit
   row-wise), proven by propagating the cut through the region's ops; the per-position modules of
   the residual stream; embeddings, head, tied weights, repeated blocks, attention calls.
3. **Enumerate** every consistent combination of per-layer choices (``_auto_candidates``): each region
   kind column/row-wise or replicated, the stream replicated or sequence-cut (sequence parallelism), each
   embedding cut by vocabulary, by feature or replicated, the head cut by vocabulary with the loss
   parallel, with the logits gathered, or replicated, FSDP units (one per block, or the root alone) and
   ``reshard_after_forward`` on a ``dp`` dim, context parallelism on a ``cp`` dim. Blocks of one kind
   (same modules and sizes) share their choices and are priced once times their count, so the number
   of candidates and the time to price each do not grow with depth.
4. **Price** each candidate's step (``_auto_price_choice``, on ``_auto_cost``): every layout change the
   plan makes, priced by dtensor_ops (``_pricing``: the planner's plan for the move at the cost model's
   prices), the layouts ops produce taken from the decisions dispatch takes for them (each styled
   module's traced ops replayed on specs); FLOPs and per-op dispatch; peak memory per rank. The planner
   names no collective. The solve is exact over this space (every candidate is priced); the best one
   within the memory budget wins, returned as an ``AutoPlan`` (``_auto_result``) with notes on what was
   found and how it compares with the standard Megatron / torchtitan plan (here).

Mesh dims are read by name: ``tp`` (tensor and sequence parallelism), ``dp`` (FSDP), ``cp`` (context
parallelism); a 1-D mesh without names is ``tp``.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch.nn as nn

from ._auto_candidates import (
    PlanChoice,
    PlanningMesh,
    PlanningProblem,
    StyleSpec,
    block_index_pattern,
    build_problem,
    enumerate_candidates,
    region_kind,
    style_specs,
)
from ._auto_cost import ComputeProfile, Estimate
from ._auto_errors import AutoPlanError, DataDependentControlFlowError, ExampleInputMismatchError, UnsupportedModelError
from ._auto_price_choice import price_choice
from ._auto_result import AutoPlan
from ._auto_structure import Region

__all__ = [
    "AutoPlan",
    "AutoPlanError",
    "DataDependentControlFlowError",
    "ExampleInputMismatchError",
    "PlanChoice",
    "StyleSpec",
    "UnsupportedModelError",
    "auto_parallelize",
    "auto_plan",
    "price_plan_choice",
]


def price_plan_choice(
    model: nn.Module,
    mesh: PlanningMesh,
    example_inputs: tuple[Any, ...],
    choice: PlanChoice,
    *,
    loss_fn: Any = None,
    compute_profile: ComputeProfile | None = None,
    cost_profile: Any = None,
) -> Estimate:
    """The estimate ``auto_plan`` gives ``choice`` (e.g. a hand-written plan stated as a choice), for comparison."""
    return price_choice(build_problem(model, mesh, example_inputs, loss_fn, compute_profile, cost_profile), choice)


def auto_plan(
    model: nn.Module,
    mesh: PlanningMesh,
    example_inputs: tuple[Any, ...],
    *,
    memory_budget_bytes: float | None = None,
    objective: str = "time",
    loss_fn: Any = None,
    compute_profile: ComputeProfile | None = None,
    cost_profile: Any = None,
) -> AutoPlan:
    """Chooses the parallel plan of ``model`` on ``mesh`` (see the module doc); changes nothing.

    ``example_inputs``: a tuple of the forward's positional arguments, a whole batch as one process
    would run it (only shapes and dtypes are read; nothing is computed). ``objective``: ``"time"``
    (fastest estimated step within the budget) or ``"memory"`` (smallest peak memory, then time).
    ``loss_fn``: ``F.cross_entropy`` if the logits feed a cross-entropy (loss parallel becomes a
    candidate), None to keep the logits whole. ``compute_profile`` / ``cost_profile``: the compute
    estimate's rates and the collective cost profile (default: the mesh's backend's).
    Modules with parameters that no style takes are replicated, with a warning naming them; a budget
    that no plan meets raises ``ValueError`` naming the smallest plan found.
    """
    if objective not in ("time", "memory"):
        raise ValueError(f"auto_plan: objective must be 'time' or 'memory', got {objective!r}")
    started = time.perf_counter()
    problem = build_problem(model, mesh, example_inputs, loss_fn, compute_profile, cost_profile)
    structure = problem.structure
    if structure.replicated_modules:
        warnings.warn(
            f"auto_plan: no parallel style takes {', '.join(structure.replicated_modules)}; they stay replicated",
            stacklevel=2,
        )
    priced = [(choice, price_choice(problem, choice)) for choice in enumerate_candidates(problem)]

    def rank(item: tuple[PlanChoice, Estimate]) -> tuple[float, ...]:
        estimate = item[1]
        if objective == "memory":
            return (estimate.peak_memory_bytes, estimate.seconds, estimate.collectives)
        return (estimate.seconds, estimate.collectives, estimate.peak_memory_bytes)

    fitting = [item for item in priced if memory_budget_bytes is None or item[1].peak_memory_bytes <= memory_budget_bytes]
    if not fitting:
        smallest = min(priced, key=lambda item: (item[1].peak_memory_bytes, item[1].seconds))
        raise ValueError(
            f"auto_plan: no plan of {problem.model_name} fits memory_budget_bytes={memory_budget_bytes:,.0f}; the smallest "
            f"found needs {smallest[1].peak_memory_bytes:,.0f} bytes per rank: {smallest[0].describe()}"
        )
    fitting.sort(key=rank)
    best_choice, best_estimate = fitting[0]
    runner_up = fitting[1] if len(fitting) > 1 else None
    notes = _notes(problem, best_choice, best_estimate, priced) + _against_megatron(problem, priced, best_choice, best_estimate)
    dims = problem.dims
    names = tuple(mesh.mesh_dim_names or ())
    dim_name = (lambda dim: names[dim] if dim is not None and names and mesh.ndim > 1 else None)
    units: tuple[str, ...] = ()
    if best_choice.fsdp_units == "blocks":
        units = tuple(block.fqn for block in structure.blocks) + ("",)
    elif best_choice.fsdp_units == "root":
        units = ("",)
    return AutoPlan(
        model_name=problem.model_name,
        choice=best_choice,
        parallelize_plan_specs=style_specs(problem, best_choice),
        loss_parallel=best_choice.head_mode == "loss_parallel",
        fsdp_units=units,
        reshard_after_forward=best_choice.reshard_after_forward,
        context_parallel_modules=structure.attention_modules if best_choice.context_parallel else (),
        tied_parameters=tuple(names_ for names_ in structure.tied if _tie_needs_restoring(best_choice)),
        sequence_length_multiple=problem.tp_size if best_choice.sequence_parallel else None,
        estimate=best_estimate,
        runner_up=runner_up,
        notes=notes,
        candidates_priced=len(priced),
        solve_seconds=time.perf_counter() - started,
        mesh_dim_names=(dim_name(dims.tp), dim_name(dims.dp), dim_name(dims.cp)),
    )


def _tie_needs_restoring(choice: PlanChoice) -> bool:
    return choice.head_mode in ("loss_parallel", "gathered")


def _kinds(estimate: Estimate) -> str:
    return ", ".join(f"{kind} x{count}" for kind, count in sorted(estimate.by_kind.items())) or "none"


def _notes(problem: PlanningProblem, choice: PlanChoice, estimate: Estimate, priced: list[tuple[PlanChoice, Estimate]]) -> tuple[str, ...]:
    structure = problem.structure
    notes = [
        f"regions found (entries column-wise -> exit row-wise): "
        + "; ".join(f"{', '.join(block_index_pattern(e, structure) for e in r.entries)} -> {block_index_pattern(r.exit, structure)}"
                    for r in _unique_regions(problem))
    ]
    if structure.sequence_parallel_refused:
        notes.append(f"sequence parallelism not a candidate: {structure.sequence_parallel_refused}")
    elif not choice.sequence_parallel and problem.tp_size > 1:
        with_sp = [item for item in priced if item[0].sequence_parallel]
        if with_sp:
            sp_choice, sp_estimate = min(with_sp, key=lambda item: item[1].seconds)
            notes.append(
                f"sequence parallelism priced and not chosen: its best plan is estimated at {sp_estimate.seconds * 1e3:.2f} ms "
                f"with {sp_estimate.collectives} collectives ({_kinds(sp_estimate)}) against this plan's "
                f"{estimate.seconds * 1e3:.2f} ms with {estimate.collectives} ({_kinds(estimate)}), and runs the norms on DTensors"
            )
    if any(r.parent is not None and len(r.entries) > 1 for r in structure.regions):
        notes.append("each region's input is laid out once at its parent module: one gradient reduction per region, not one per entry")
    if problem.pricer.undecided:
        undecided = sorted(set(problem.pricer.undecided))
        notes.append(
            f"priced as moving nothing (dtensor_ops decides them only on DTensors, by a handler, or not at all): "
            f"{'; '.join(undecided[:5])}{' ...' if len(undecided) > 5 else ''}"
        )
    if structure.context_parallel_refused and problem.dims.cp is None:
        notes.append(f"context parallelism would not apply: {structure.context_parallel_refused}")
    return tuple(notes)


def _against_megatron(
    problem: PlanningProblem, priced: list[tuple[PlanChoice, Estimate]], best: PlanChoice, best_estimate: Estimate
) -> tuple[str, ...]:
    """Where the chosen plan differs from the standard Megatron / torchtitan plan, and by how much (estimated).

    The standard plan: every region column/row-wise, the token embedding (the first one called) by vocabulary,
    the head by vocabulary with loss parallel (when the loss allows); among such plans, the fastest estimated
    (sequence parallelism and other embeddings either way, as Megatron-LM and torchtitan let users choose).
    """
    if problem.tp_size <= 1:
        return ()
    token_embedding = problem.structure.embeddings[0] if problem.structure.embeddings else None

    def standard_rank(choice: PlanChoice) -> tuple[int, ...]:
        return (
            sum(mode != "tensor_parallel" for _, mode in choice.region_modes),
            sum(mode != "vocabulary" for name, mode in choice.embedding_modes if name == token_embedding),
            {"loss_parallel": 0, "gathered": 1}.get(choice.head_mode, 2),
        )

    same_rest = [
        item for item in priced
        if (item[0].fsdp_units, item[0].reshard_after_forward, item[0].context_parallel)
        == (best.fsdp_units, best.reshard_after_forward, best.context_parallel)
    ]  # fmt: skip
    standard, estimate = min(same_rest, key=lambda item: (standard_rank(item[0]), item[1].seconds))
    if standard == best:
        return ("this is the standard Megatron / torchtitan plan (every region, the token embedding and the head cut)",)
    differences = [part for part in best.describe().split("; ") if part not in standard.describe().split("; ")]
    return (
        f"differs from the standard Megatron / torchtitan plan ({standard.describe()}), estimated at "
        f"{estimate.seconds * 1e3:.2f} ms with {estimate.collectives} collectives against this plan's "
        f"{best_estimate.seconds * 1e3:.2f} ms with {best_estimate.collectives}: {'; '.join(differences)}",
    )


def _unique_regions(problem: PlanningProblem) -> list[Region]:
    seen: dict[str, Region] = {}
    for region in problem.structure.regions:
        seen.setdefault(region_kind(region, problem.structure), region)
    return list(seen.values())


def auto_parallelize(
    model: nn.Module,
    mesh: PlanningMesh,
    example_inputs: tuple[Any, ...],
    *,
    memory_budget_bytes: float | None = None,
    objective: str = "time",
    loss_fn: Any = None,
    fully_shard: Callable[..., Any] | None = None,
    context_parallel: bool = True,
    compute_profile: ComputeProfile | None = None,
    cost_profile: Any = None,
) -> AutoPlan:
    """``auto_plan(...)`` then ``plan.apply(model, mesh, ...)``: parallelizes ``model`` in place and returns the plan."""
    plan = auto_plan(
        model,
        mesh,
        example_inputs,
        memory_budget_bytes=memory_budget_bytes,
        objective=objective,
        loss_fn=loss_fn,
        compute_profile=compute_profile,
        cost_profile=cost_profile,
    )
    plan.apply(model, mesh, fully_shard=fully_shard, context_parallel=context_parallel)
    return plan
