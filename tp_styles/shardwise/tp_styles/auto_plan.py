"""``auto_plan`` / ``auto_parallelize``: the whole parallel plan of a model for a mesh, chosen by estimated step time.

How (one pass, no collective, no real compute):

1. **Trace** the forward once on fake tensors (``_auto_trace``): every aten op with its shapes and
   FLOPs, every module call.
2. **Find the structure** (``_auto_structure``): tensor-parallel regions (entries column-wise, exit
   row-wise), proven by propagating the cut through the region's ops; the per-position modules of
   the residual stream; embeddings, head, tied weights, repeated blocks, attention calls.
3. **Enumerate** every consistent combination of per-layer choices: each region kind column/row-wise
   or replicated, the stream replicated or sequence-cut (sequence parallelism), each embedding cut by
   vocabulary, by feature or replicated, the head cut by vocabulary with the loss parallel, with the
   logits gathered, or replicated, FSDP units (one per block, or the root alone) and
   ``reshard_after_forward`` on a ``dp`` dim, context parallelism on a ``cp`` dim. Blocks of one kind
   (same modules and sizes) share their choices and are priced once times their count, so the number
   of candidates and the time to price each do not grow with depth.
4. **Price** each candidate's step (``_auto_cost``): every layout change the plan makes, priced by
   dtensor_ops (``_pricing``: the planner's plan for the move at the cost model's prices), the layouts
   ops produce taken from the decisions dispatch takes for them (each styled module's traced ops
   replayed on specs); FLOPs and per-op dispatch; peak memory per rank. This module names no
   collective. The solve is exact over this space (every candidate is priced); the best one within
   the memory budget wins.

Mesh dims are read by name: ``tp`` (tensor and sequence parallelism), ``dp`` (FSDP), ``cp`` (context
parallelism); a 1-D mesh without names is ``tp``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Replicate, Shard

from ._auto_errors import AutoPlanError, DataDependentControlFlowError, ExampleInputMismatchError, UnsupportedModelError
from shardwise.dtensor_ops._pricing import NO_MOVEMENT, Movement, decide
from shardwise.placement import DTensorSpec, Partial

from ._auto_cost import ComputeProfile, Estimate, LayoutPricer, Ledger, default_compute_profile
from ._auto_structure import ModelStructure, Region, analyse_structure
from ._auto_trace import ModelTrace, TensorId, TracedCall, trace_forward
from .style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

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

# What planning reads from a mesh: shape, ndim, mesh_dim_names, device_type (a DeviceMesh, or shardwise.testing's
# FakeMesh to plan for a mesh this process is not part of); applying a plan needs a DeviceMesh.
PlanningMesh = Any

_STYLE_CLASSES: dict[str, type[ParallelStyle]] = {
    "ColwiseParallel": ColwiseParallel,
    "RowwiseParallel": RowwiseParallel,
    "SequenceParallel": SequenceParallel,
    "PrepareModuleInput": PrepareModuleInput,
}
_SEQUENCE_DIM = 1
_LOSS_PARALLEL_OPS = 12  # its forward ops on DTensors (log-softmax pieces, gather, mean)
_OPTIMIZER_STATES = 2
# Cross-entropy forward and backward per logit (max, exp, sum, log, subtract, its gradient): not in the traced
# forward, and cut by tp only under loss parallel.
_LOSS_FLOPS_PER_LOGIT = 8  # Adam's moments, per parameter


def _placement_source(placement: Placement | None) -> str:
    if placement is None:
        return "None"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    return repr(placement)


def _value_source(value: Any) -> str:
    if isinstance(value, tuple):
        inner = ", ".join(_value_source(item) for item in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, Placement):
        return _placement_source(value)
    return repr(value)


@dataclasses.dataclass(frozen=True)
class StyleSpec:
    """A parallel style as data: it builds the style and prints as the Python that builds it."""

    name: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def build(self) -> ParallelStyle:
        return _STYLE_CLASSES[self.name](**dict(self.kwargs))

    def source(self) -> str:
        arguments = ", ".join(f"{key}={_value_source(value)}" for key, value in self.kwargs)
        return f"{self.name}({arguments})"


@dataclasses.dataclass(frozen=True)
class PlanChoice:
    """One candidate: every decision the planner makes (see the module doc)."""

    sequence_parallel: bool
    region_modes: tuple[tuple[str, str], ...]  # (region kind, "tensor_parallel" | "replicate")
    embedding_modes: tuple[tuple[str, str], ...]  # (embedding FQN, "vocabulary" | "feature" | "replicate")
    head_mode: str  # "loss_parallel" | "gathered" | "replicate" | "none"
    prepare_region_inputs: bool = True  # lay a region's input out once at its parent module, not per entry
    fsdp_units: str = "none"  # "none" | "blocks" | "root"
    reshard_after_forward: bool = True
    context_parallel: bool = False

    def describe(self) -> str:
        parts = [f"sequence parallel {'on' if self.sequence_parallel else 'off'}"]
        modes: dict[str, list[str]] = {}
        for kind, mode in self.region_modes:
            modes.setdefault(mode, []).append(kind)
        parts += [f"{mode.replace('_', ' ')}: {', '.join(kinds)}" for mode, kinds in modes.items()]
        parts += [f"{name} by {mode}" if mode != "replicate" else f"{name} replicated" for name, mode in self.embedding_modes]
        parts.append({"loss_parallel": "head by vocabulary, loss parallel", "gathered": "head by vocabulary, logits gathered",
                      "replicate": "head replicated", "none": "no head"}[self.head_mode])
        if not self.prepare_region_inputs:
            parts.append("region inputs laid out per entry")
        if self.fsdp_units != "none":
            parts.append(f"FSDP units: {self.fsdp_units}, reshard_after_forward={self.reshard_after_forward}")
        if self.context_parallel:
            parts.append("context parallel attention")
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class _MeshDims:
    mesh: Any
    tp: int | None
    dp: int | None
    cp: int | None

    def size(self, dim: int | None) -> int:
        return 1 if dim is None else int(self.mesh.shape[dim])

    def sub_mesh(self, dim: int | None) -> Any:
        if dim is None:
            return None
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names
        return self.mesh[names[dim]]


def _mesh_dims(mesh: PlanningMesh) -> _MeshDims:
    # Planning reads the mesh's shape, dim names and device type only (a FakeMesh plans too); applying slices it.
    if not all(hasattr(mesh, attribute) for attribute in ("shape", "ndim", "mesh_dim_names", "device_type")):
        raise TypeError(f"auto_plan: mesh must be a shardwise DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        if mesh.ndim != 1:
            raise ValueError(
                f"auto_plan: a {mesh.ndim}-D mesh needs dim names among 'dp' (FSDP), 'cp' (context parallel) and "
                "'tp' (tensor parallel)"
            )
        return _MeshDims(mesh, 0, None, None)
    unknown = [name for name in names if name not in ("dp", "cp", "tp")]
    if unknown:
        raise ValueError(
            f"auto_plan: mesh dims {names}: {unknown} unknown; name each dim 'dp' (FSDP), 'cp' (context parallel) "
            "or 'tp' (tensor parallel)"
        )
    return _MeshDims(mesh, *(names.index(name) if name in names else None for name in ("tp", "dp", "cp")))


def _block_index_pattern(name: str, structure: ModelStructure) -> str:
    """``layers.3.attention.wo`` -> ``layers.*.attention.wo`` when every block of that list is of one kind."""
    for block in structure.blocks:
        if name == block.fqn or name.startswith(block.fqn + "."):
            list_name = block.fqn.rsplit(".", 1)[0]
            siblings = [b for b in structure.blocks if b.fqn.rsplit(".", 1)[0] == list_name]
            if len({b.kind for b in siblings}) == 1:
                return f"{list_name}.*{name[len(block.fqn):]}"
            return name
    return name


def _region_kind(region: Region, structure: ModelStructure) -> str:
    return _block_index_pattern(region.exit, structure).rsplit(".", 1)[0] or region.exit


@dataclasses.dataclass(frozen=True)
class _Problem:
    model_name: str
    trace: ModelTrace
    structure: ModelStructure
    dims: _MeshDims
    compute: ComputeProfile
    loss_parallel_allowed: bool
    cost_profile: Any
    parameter_itemsize: int
    attention_key_value_bytes: tuple[tuple[str, int], ...]  # per attention module: its first call's key + value bytes
    pricer: LayoutPricer
    parameter_dtype: torch.dtype
    # What a styled layer moves depends on the layer and a few choices only: priced once per planning.
    memo: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def tp_size(self) -> int:
        return self.dims.size(self.dims.tp)

    @functools.cached_property
    def regions_by_kind(self) -> dict[str, list[Region]]:
        """Regions grouped by kind (blocks of one kind share their choices), in call order."""
        kinds: dict[str, list[Region]] = {}
        for region in self.structure.regions:
            kinds.setdefault(_region_kind(region, self.structure), []).append(region)
        return kinds


def _embedding_size(problem: _Problem, name: str) -> tuple[int, int]:
    weight = problem.trace.calls_of(name)[0].module.get_parameter("weight")
    return int(weight.shape[0]), int(weight.shape[1])


def _candidates(problem: _Problem) -> Iterable[PlanChoice]:
    structure, tp = problem.structure, problem.tp_size
    kinds = sorted(problem.regions_by_kind)
    sp_options = [False]
    if tp > 1 and structure.sequence_parallel_refused is None:
        sp_options.append(True)
    embedding_options: list[list[str]] = []
    for name in structure.embeddings:
        vocabulary, width = _embedding_size(problem, name)
        options = ["replicate"]
        if tp > 1 and vocabulary % tp == 0:
            options.append("vocabulary")
        if tp > 1 and width % tp == 0:
            options.append("feature")
        embedding_options.append(options)
    head_options = ["none"]
    if structure.head is not None:
        out_features = int(problem.trace.calls_of(structure.head)[0].module.get_parameter("weight").shape[0])
        head_options = ["replicate"]
        if tp > 1 and out_features % tp == 0:
            head_options.append("gathered")
            if problem.loss_parallel_allowed:
                head_options.append("loss_parallel")
    fsdp_options: list[tuple[str, bool]] = [("none", True)]
    if problem.dims.dp is not None and problem.dims.size(problem.dims.dp) > 1:
        fsdp_options = [("root", False)] + ([("blocks", True), ("blocks", False)] if structure.blocks else [])
    context_parallel = problem.dims.cp is not None and problem.dims.size(problem.dims.cp) > 1
    tied_heads = _tied_embeddings(problem)
    for sp in sp_options:
        mode_sets = [["tensor_parallel"]] * len(kinds) if sp else [(["tensor_parallel", "replicate"] if tp > 1 else ["replicate"])] * len(kinds)
        for modes in itertools.product(*mode_sets):
            for embedding_modes in itertools.product(*embedding_options):
                for head_mode in head_options:
                    if sp and (head_mode == "replicate" or any(mode == "replicate" for mode in embedding_modes)):
                        continue  # a whole layer on a sequence-cut stream needs its own gathers; not a candidate
                    if not _tying_holds(structure, embedding_modes, head_mode, tied_heads):
                        continue
                    for units, reshard in fsdp_options:
                        yield PlanChoice(
                            sequence_parallel=sp,
                            region_modes=tuple(zip(kinds, modes)),
                            embedding_modes=tuple(zip(structure.embeddings, embedding_modes)),
                            head_mode=head_mode,
                            fsdp_units=units,
                            reshard_after_forward=reshard,
                            context_parallel=context_parallel,
                        )


def _tied_embeddings(problem: _Problem) -> set[str]:
    """Embeddings whose weight is the head's: both must be cut the same way (by vocabulary) or both whole."""
    head = problem.structure.head
    tied: set[str] = set()
    if head is None:
        return tied
    for names in problem.structure.tied:
        owners = {name.rsplit(".", 1)[0] for name in names}
        if head in owners:
            tied |= owners & set(problem.structure.embeddings)
    return tied


def _tying_holds(structure: ModelStructure, embedding_modes: Sequence[str], head_mode: str, tied: set[str]) -> bool:
    for name, mode in zip(structure.embeddings, embedding_modes):
        if name in tied:
            head_cut = head_mode in ("loss_parallel", "gathered")
            if head_cut != (mode == "vocabulary") or (not head_cut and mode != "replicate"):
                return False
    return True


def _parameters_read(trace: ModelTrace, call: TracedCall) -> tuple[TensorId | None, TensorId | None]:
    """The (weight, bias) a linear or embedding call reads: the 2-D and the 1-D parameter among its ops' inputs."""
    weight = bias = None
    for op in trace.ops_within(call):
        for tensor in op.inputs:
            if tensor in trace.parameter_names:
                if len(trace.shapes[tensor]) == 2 and weight is None:
                    weight = tensor
                elif len(trace.shapes[tensor]) == 1 and bias is None:
                    bias = tensor
    return weight, bias


@dataclasses.dataclass(frozen=True)
class _Layer:
    """What a styled layer moves, as the engine prices it: forward and backward, once per call."""

    movement: Movement
    output: DTensorSpec[Any] | None = None


def _memo(problem: _Problem, key: tuple[Any, ...], compute: Callable[[], _Layer]) -> _Layer:
    found = problem.memo.get(key)
    if found is None:
        found = problem.memo[key] = compute()
    return found


def _styled_linear(problem: _Problem, name: str, specs: dict[TensorId, DTensorSpec[Any]], weight_tp: Placement,
                   bias_tp: Placement) -> tuple[Movement, DTensorSpec[Any], DTensorSpec[Any] | None]:
    """Replays one styled linear (or embedding) call on specs: its parameters laid out as the style lays them out,
    its input as ``specs`` says. Returns the moves its ops' decisions plan, its output's spec and its weight's."""
    pricer, trace = problem.pricer, problem.trace
    call = trace.calls_of(name)[0]
    weight, bias = _parameters_read(trace, call)
    weight_spec = None
    if weight is not None:
        weight_spec = specs[weight] = pricer.whole(weight, weight_tp)
    if bias is not None:
        specs[bias] = pricer.whole(bias, bias_tp)
    moves = pricer.replay(trace.ops_within(call), specs)
    return moves, specs[call.outputs[0]], weight_spec


def _region_layer(problem: _Problem, region: Region, sequence_parallel: bool, prepared: bool) -> _Layer:
    """A tensor-parallel region, per call: its input laid out replicated (once at the parent, or per entry), the
    entries column-wise, the exit row-wise, its output laid out as the stream; and the gradients back."""

    def compute() -> _Layer:
        pricer, trace = problem.pricer, problem.trace
        stream: Placement = Shard(_SEQUENCE_DIM) if sequence_parallel else Replicate()
        arriving = pricer.activation(region.input, stream)
        wanted = pricer.on_tp(arriving, Replicate())
        layouts = len(region.entries) if not prepared else 1
        total = pricer.move(arriving, wanted).times(layouts)
        specs: dict[TensorId, DTensorSpec[Any]] = {region.input: wanted}
        entry_gradients: list[Movement] = []
        for entry in region.entries:
            moves, output, weight = _styled_linear(problem, entry, specs, Shard(0), Shard(0))
            total = total + moves
            if weight is not None:
                entry_gradients.append(pricer.linear_input_gradient(output, weight, arriving))
        if region.input_takes_gradient and entry_gradients:
            # Laid out at the parent, the entries' input gradients (one layout) add up before the one change back.
            for gradient in entry_gradients if not prepared else entry_gradients[-1:]:
                total = total + gradient
        exit_call = trace.calls_of(region.exit)[0]
        if region.needs_global_views:
            first = trace.calls_of(region.entries[0])[0].end_op
            total = total + pricer.replay(trace.ops[first : exit_call.first_op], specs)
        else:
            # Between the entries and the exit the pieces are plain local tensors; the exit takes its input as
            # declared (cut on the features).
            specs[exit_call.inputs[0]] = pricer.activation(exit_call.inputs[0], Shard(-1))
        exit_input = specs[exit_call.inputs[0]]
        moves, produced, weight = _styled_linear(problem, region.exit, specs, Shard(1), Replicate())
        laid_out = pricer.on_tp(produced, stream)
        total = total + moves + pricer.round_trip(produced, laid_out)
        if weight is not None:
            total = total + pricer.linear_input_gradient(pricer.on_tp(produced, Replicate()), weight, exit_input)
        return _Layer(total, laid_out)

    return _memo(problem, ("region", region.exit, sequence_parallel, prepared), compute)


def _embedding_layer(problem: _Problem, name: str, mode: str, layout: Placement) -> _Layer:
    """An embedding cut by vocabulary (row-wise) or by feature (column-wise), its output laid out ``layout``."""

    def compute() -> _Layer:
        pricer, trace = problem.pricer, problem.trace
        call = trace.calls_of(name)[0]
        specs = {call.inputs[0]: pricer.activation(call.inputs[0], Replicate())}
        cut = Shard(0) if mode == "vocabulary" else Shard(1)
        moves, produced, _ = _styled_linear(problem, name, specs, cut, Replicate())
        return _Layer(moves + pricer.round_trip(produced, pricer.on_tp(produced, layout)), produced)

    return _memo(problem, ("embedding", name, mode, str(layout)), compute)


def _head_layer(problem: _Problem, mode: str, sequence_parallel: bool) -> _Layer:
    """The head: its input gathered from the stream; cut by vocabulary (column-wise) with the logits gathered or
    left cut for loss parallel (whose cross-entropy reduces over the classes: a max, a sum and the target's
    logit, each as the engine decides the reduction of a class-cut tensor), or whole."""

    def compute() -> _Layer:
        pricer, trace = problem.pricer, problem.trace
        assert problem.structure.head is not None
        call = trace.calls_of(problem.structure.head)[0]
        stream: Placement = Shard(_SEQUENCE_DIM) if sequence_parallel else Replicate()
        arriving = pricer.activation(call.inputs[0], stream)
        wanted = pricer.on_tp(arriving, Replicate())
        if mode not in ("loss_parallel", "gathered"):
            return _Layer(pricer.round_trip(arriving, wanted))
        total = pricer.move(arriving, wanted)
        specs = {call.inputs[0]: wanted}
        moves, logits, weight = _styled_linear(problem, problem.structure.head, specs, Shard(0), Shard(0))
        total = total + moves
        if weight is not None:
            total = total + pricer.linear_input_gradient(logits, weight, arriving)
        if mode == "gathered":
            return _Layer(total + pricer.round_trip(logits, pricer.on_tp(logits, Replicate())))
        assert logits.tensor_meta is not None
        shape = logits.tensor_meta.shape
        rows = 1
        for extent in shape[:-1]:
            rows *= int(extent)
        flat = pricer.activation_of((rows, int(shape[-1])), logits.tensor_meta.dtype, Shard(1))
        targets = pricer.activation_of((rows, 1), torch.int64, Replicate())
        aten = torch.ops.aten
        for op, args in (
            (aten.amax.default, (flat, [-1], True)),
            (aten.sum.dim_IntList, (flat, [-1], True)),
            (aten.gather.default, (flat, 1, targets)),
        ):
            decision, moves = pricer.decided(op, args)
            reduced = decision.output_specs
            assert isinstance(reduced, DTensorSpec)
            total = total + moves + pricer.move(reduced, pricer.on_tp(reduced, Replicate()))
        return _Layer(total)

    return _memo(problem, ("head", mode, sequence_parallel), compute)


def _partial_sum_over(problem: _Problem, spec: DTensorSpec[Any], dims: list[int]) -> Placement:
    """The tp placement the engine gives a sum of ``spec`` over ``dims`` (a parameter's gradient summed over the
    positions it was applied to, a norm's partial sums)."""
    decision = decide(torch.ops.aten.sum.dim_IntList, (spec, dims), {})
    produced = decision.output_specs
    assert isinstance(produced, DTensorSpec)
    return problem.pricer.tp_placement(produced)


def _reduced_bucket(problem: _Problem, numel: float, dtype: torch.dtype, mesh_dim: int | None, placement: Placement) -> Movement:
    """A flat bucket of ``numel`` elements laid out ``placement`` on ``mesh_dim``, made whole there."""
    if mesh_dim is None or problem.dims.size(mesh_dim) <= 1 or numel <= 0:
        return NO_MOVEMENT
    key = ("bucket", int(numel), dtype, mesh_dim, placement)
    found = problem.memo.get(key)
    if found is None:
        pricer = problem.pricer
        found = problem.memo[key] = pricer.move(pricer.flat(int(numel), dtype, {mesh_dim: placement}), pricer.flat(int(numel), dtype, {}))
    return found


def _norm_reduction(problem: _Problem, mesh_dim: int | None) -> Movement:
    """Clipping's gradient norm over ``mesh_dim``: each rank's partial sum of squares made whole."""
    if mesh_dim is None or problem.dims.size(mesh_dim) <= 1:
        return NO_MOVEMENT

    def compute() -> _Layer:
        pricer = problem.pricer
        pieces = pricer.flat(problem.dims.size(mesh_dim), torch.float64, {mesh_dim: Shard(0)})
        decision, moves = pricer.decided(torch.ops.aten.sum.dim_IntList, (pieces, [0], True))
        produced = decision.output_specs
        assert isinstance(produced, DTensorSpec)
        return _Layer(moves + pricer.move(produced, pricer.flat(1, torch.float64, {})))

    return _memo(problem, ("norm", mesh_dim), compute).movement


def _fsdp_unit(problem: _Problem, unit_bytes: float) -> tuple[Movement, Movement]:
    """One FSDP unit's parameters gathered over dp (sharded -> whole) and its gradients reduced back to the
    shards (partial -> sharded)."""
    numel = max(1, int(unit_bytes // problem.parameter_itemsize))
    found = problem.memo.get(("fsdp unit", numel))
    if found is None:
        pricer, dp, dtype = problem.pricer, problem.dims.dp, problem.parameter_dtype
        sharded, whole = pricer.flat(numel, dtype, {dp: Shard(0)}), pricer.flat(numel, dtype, {})
        found = problem.memo[("fsdp unit", numel)] = (
            pricer.move(sharded, whole), pricer.move(pricer.flat(numel, dtype, {dp: Partial()}), sharded)
        )
    return found


def _context_parallel_attention(problem: _Problem, numel: int) -> Movement:
    """One attention call under context parallelism, its key and value ``numel`` elements on this rank."""

    def compute() -> _Layer:
        pricer, dtype, cp = problem.pricer, problem.parameter_dtype, problem.dims.cp
        # Key and value gathered together along the sequence, in forward and again in backward ...
        gathered = pricer.move(pricer.flat(numel, dtype, {cp: Shard(0)}), pricer.flat(numel, dtype, {})).times(2)
        # ... and each one's gradient, summed over the ranks that attended to it, handed back to its owner.
        half = max(1, numel // 2)
        handed_back = pricer.move(pricer.flat(half, dtype, {cp: Partial()}), pricer.flat(half, dtype, {cp: Shard(0)})).times(2)
        return _Layer(gathered + handed_back)

    return _memo(problem, ("context parallel attention", numel), compute).movement


def _price(problem: _Problem, choice: PlanChoice) -> Estimate:
    trace, structure, dims = problem.trace, problem.structure, problem.dims
    ledger = Ledger(dims.mesh, problem.compute, problem.cost_profile)
    tp, dp, cp = dims.tp, dims.dp, dims.cp
    T, D, C = dims.size(tp), dims.size(dp), dims.size(cp)
    data_split = D * C  # every activation is this rank's share of the batch (dp) and of the sequence (cp)
    sp = choice.sequence_parallel
    stream_cut = T if sp else 1
    itemsize = problem.parameter_itemsize
    sharded_numel = 0.0
    total_numel = sum(problem.structure.parameter_numel.values())
    activations = 0.0
    dtensor_ops = 0
    plain_ops = len(trace.ops)

    def act(tensor: int) -> float:
        return trace.nbytes(tensor) / data_split

    def call_ops(name: str) -> int:
        return len(trace.ops_within(trace.calls_of(name)[0]))

    modes = dict(choice.region_modes)
    for kind, regions in problem.regions_by_kind.items():
        region, count = regions[0], len(regions)
        outputs = sum(trace.nbytes(t) for op in trace.ops[trace.calls_of(region.entries[0])[0].first_op : trace.calls_of(region.exit)[0].end_op] for t in op.outputs)
        if modes[kind] == "tensor_parallel":
            prepared = _prepared_at_parent(choice, region)
            entries = 1 if prepared else len(region.entries)
            # Blocks of one kind move the same; only whether the region's input takes a gradient differs.
            with_gradient = sum(1 for r in regions if r.input_takes_gradient)
            taking = next((r for r in regions if r.input_takes_gradient), None)
            not_taking = next((r for r in regions if not r.input_takes_gradient), None)
            if taking is not None:
                ledger.move(_region_layer(problem, taking, sp, prepared).movement, with_gradient)
            if not_taking is not None:
                ledger.move(_region_layer(problem, not_taking, sp, prepared).movement, count - with_gradient)
            ledger.flops(count * region.flops / (T * data_split))
            sharded_numel += count * region.parameter_numel
            linear_ops = sum(call_ops(name) for name in (*region.entries, region.exit))
            dtensor_ops += count * (linear_ops + (region.op_count if region.needs_global_views else 0) + 2 * entries)
            activations += count * outputs / (T * data_split)
        else:
            ledger.flops(count * region.flops / data_split)
            activations += count * outputs / data_split

    # The stream: per-position modules (norms) and everything outside regions, embeddings and head.
    head_flops = trace.flops_within(trace.calls_of(structure.head)[0]) if structure.head is not None else 0
    stream_flops = sum(op.flops for op in trace.ops) - sum(r.flops for r in structure.regions) - head_flops
    if sp and structure.stream_modules:
        stream_params = sum(structure.parameter_numel[name] for name in structure.stream_modules)
        norm_call = trace.calls_of(structure.stream_modules[0])[0]
        partial = _partial_sum_over(problem, problem.pricer.activation(norm_call.outputs[0], Shard(_SEQUENCE_DIM)), [0, 1])
        bucket = _reduced_bucket(problem, stream_params, problem.parameter_dtype, tp, partial)
        if choice.fsdp_units == "none":
            # Their partial gradients, reduced together after backward.
            ledger.move(bucket, optimizer=True)
        else:
            # FSDP reduces them in backward, once per unit that holds any.
            ledger.move(bucket, _units_holding(structure, choice, structure.stream_modules))
        dtensor_ops += sum(call_ops(name) for name in structure.stream_modules)
    ledger.flops(stream_flops / (stream_cut * data_split))

    for name, mode in choice.embedding_modes:
        output = trace.calls_of(name)[0].outputs[0]
        e = act(output)
        if mode != "replicate":
            ledger.move(_embedding_layer(problem, name, mode, _embedding_layout(problem, name, choice)).movement)
            sharded_numel += structure.parameter_numel[name]
            dtensor_ops += call_ops(name) + 3
        activations += e / (stream_cut if mode != "replicate" or sp else 1)

    if structure.head is not None and choice.head_mode != "none":
        head_call = trace.calls_of(structure.head)[0]
        logits = act(head_call.outputs[0])
        # Cross-entropy over the logits, not in the traced forward: cut by tp only under loss parallel.
        loss_flops = _LOSS_FLOPS_PER_LOGIT * logits / trace.itemsize[head_call.outputs[0]] / 3
        ledger.move(_head_layer(problem, choice.head_mode, sp).movement)
        if choice.head_mode in ("loss_parallel", "gathered"):
            ledger.flops(trace.flops_within(head_call) / (T * data_split))
            sharded_numel += structure.parameter_numel[structure.head]  # 0 when tied: counted at the embedding
            dtensor_ops += call_ops(structure.head)
            if choice.head_mode == "gathered":
                ledger.flops(loss_flops)
                activations += logits
            else:
                ledger.flops(loss_flops / T)
                dtensor_ops += _LOSS_PARALLEL_OPS
                activations += logits / T
        else:
            ledger.flops(trace.flops_within(head_call) / data_split)
            ledger.flops(loss_flops)
            activations += logits

    # Clipping's gradient norm, per mesh of DTensor gradients: on tp one reduction; under FSDP, on dp one for
    # the parameters no style cut, on (dp, tp) one per dim, and one more when tp-cut gradients share that mesh
    # with tp-replicated ones (row-wise biases, SP norms), whose norms are summed differently.
    whole_on_tp = sum(
        len(regions) * regions[0].exit_bias_numel
        for kind, regions in problem.regions_by_kind.items()
        if modes[kind] == "tensor_parallel"
    ) + (sum(structure.parameter_numel[name] for name in structure.stream_modules) if sp else 0)
    on_tp_mesh = sharded_numel > 0 or whole_on_tp > 0
    if choice.fsdp_units != "none":
        if total_numel - sharded_numel - whole_on_tp > 0:
            ledger.move(_norm_reduction(problem, dp), optimizer=True)
        if on_tp_mesh:
            ledger.move(_norm_reduction(problem, dp), optimizer=True)
            ledger.move(_norm_reduction(problem, tp), 1 + int(sharded_numel > 0 and whole_on_tp > 0), optimizer=True)
    elif on_tp_mesh:
        ledger.move(_norm_reduction(problem, tp), optimizer=True)

    replicated_numel = total_numel - sharded_numel
    per_rank_params = (sharded_numel / T + replicated_numel) * itemsize
    fsdp_extra = 0.0
    if choice.fsdp_units != "none" and dp is not None and D > 1:
        units = _fsdp_unit_bytes(problem, choice, sharded_numel_total=sharded_numel)
        for index, unit_bytes in enumerate(units):
            is_root = index == len(units) - 1
            gather, reduce = _fsdp_unit(problem, unit_bytes)
            ledger.move(gather)
            if choice.reshard_after_forward and not is_root:
                ledger.move(gather)
            ledger.move(reduce)
        if choice.reshard_after_forward and len(units) > 1:
            fsdp_extra = units[-1] + 2 * max(units[:-1])
        else:
            fsdp_extra = sum(units)
        per_rank_params /= D
    if choice.context_parallel and cp is not None:
        for name, key_value_bytes in problem.attention_key_value_bytes:
            cut = T if modes.get(_kind_of_attention(problem, name)) == "tensor_parallel" else 1
            ledger.move(_context_parallel_attention(problem, int(key_value_bytes / (D * cut) // itemsize)))
        # The gradients' sum over cp.
        ledger.move(_reduced_bucket(problem, per_rank_params / itemsize, problem.parameter_dtype, cp, Partial()), optimizer=True)
    ledger.ops(plain_ops, on_dtensors=False)
    ledger.ops(dtensor_ops, on_dtensors=True)
    ledger.memory(per_rank_params * (2 + _OPTIMIZER_STATES) + activations)
    return ledger.finish(fsdp_extra)


def _prepared_at_parent(choice: PlanChoice, region: Region) -> bool:
    """Whether the region's input is laid out once at its parent module (several entries read it) rather than
    by each entry's own style (one entry: the same collectives, without the parent's extra DTensor)."""
    return choice.prepare_region_inputs and region.parent is not None and len(region.entries) > 1


def _units_holding(structure: ModelStructure, choice: PlanChoice, modules: Sequence[str]) -> int:
    """How many FSDP units hold parameters of ``modules`` (blocks by prefix; the rest belongs to the root)."""
    if choice.fsdp_units == "root":
        return 1 if modules else 0
    units = set()
    for name in modules:
        owner = next((block.fqn for block in structure.blocks if name.startswith(block.fqn + ".")), "")
        units.add(owner)
    return len(units)


def _kind_of_attention(problem: _Problem, attention_module: str) -> str:
    for kind, regions in problem.regions_by_kind.items():
        if any(region.exit.startswith(attention_module + ".") for region in regions):
            return kind
    return ""


def _fsdp_unit_bytes(problem: _Problem, choice: PlanChoice, *, sharded_numel_total: float) -> list[float]:
    """Each FSDP unit's parameter bytes on one tensor-parallel rank (gathered size), blocks first, the root last."""
    T = problem.tp_size
    itemsize = problem.parameter_itemsize
    modes = dict(choice.region_modes)
    structure = problem.structure
    if choice.fsdp_units == "root":
        total = sum(structure.parameter_numel.values())
        return [((total - sharded_numel_total) + sharded_numel_total / T) * itemsize]
    units: list[float] = []
    in_blocks = 0.0
    for block in structure.blocks:
        numel = sum(value for name, value in structure.parameter_numel.items() if name.startswith(block.fqn + "."))
        cut = sum(r.parameter_numel for r in block.regions if modes.get(_region_kind(r, structure)) == "tensor_parallel")
        units.append(((numel - cut) + cut / T) * itemsize)
        in_blocks += numel
    rest = sum(structure.parameter_numel.values()) - in_blocks
    units.append(rest * itemsize)
    return units


# ----------------------------------------------------------------------------------------- the plan


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
        dims = _mesh_dims(mesh)
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


def _style_specs(problem: _Problem, choice: PlanChoice) -> dict[str, StyleSpec]:
    structure = problem.structure
    stream: Placement = Shard(_SEQUENCE_DIM) if choice.sequence_parallel else Replicate()
    specs: dict[str, StyleSpec] = {}

    def put(name: str, spec: StyleSpec) -> None:
        specs.setdefault(_block_index_pattern(name, structure), spec)

    for name, mode in choice.embedding_modes:
        if mode == "vocabulary":
            put(name, StyleSpec("RowwiseParallel", (("input_layouts", Replicate()), ("output_layouts", _embedding_layout(problem, name, choice)))))
        elif mode == "feature":
            put(name, StyleSpec("ColwiseParallel", (("input_layouts", Replicate()), ("output_layouts", _embedding_layout(problem, name, choice)))))
    modes = dict(choice.region_modes)
    for region in structure.regions:
        if modes[_region_kind(region, structure)] != "tensor_parallel":
            continue
        prepared = _prepared_at_parent(choice, region)
        if prepared:
            assert region.parent is not None
            call = problem.trace.calls_of(region.parent)[0]
            layouts = tuple(stream if index == region.parent_input_index else None for index in range(len(call.inputs)))
            desired = tuple(Replicate() if index == region.parent_input_index else None for index in range(len(call.inputs)))
            put(region.parent, StyleSpec("PrepareModuleInput", (("input_layouts", layouts), ("desired_input_layouts", desired))))
        for entry in region.entries:
            kwargs: tuple[tuple[str, Any], ...] = ()
            if not prepared and choice.sequence_parallel:
                kwargs += (("input_layouts", stream),)
            if region.needs_global_views:
                kwargs += (("use_local_output", False),)
            put(entry, StyleSpec("ColwiseParallel", kwargs))
        put(region.exit, StyleSpec("RowwiseParallel", (("output_layouts", stream),) if choice.sequence_parallel else ()))
    if choice.sequence_parallel:
        for name in structure.stream_modules:
            put(name, StyleSpec("SequenceParallel"))
    if structure.head is not None and choice.head_mode in ("loss_parallel", "gathered"):
        kwargs = (("input_layouts", stream),) if choice.sequence_parallel else ()
        if choice.head_mode == "loss_parallel":
            kwargs += (("output_layouts", Shard(-1)), ("use_local_output", False))
        else:
            kwargs += (("output_layouts", Replicate()),)
        put(structure.head, StyleSpec("ColwiseParallel", kwargs))
    return specs


def _embedding_layout(problem: _Problem, name: str, choice: PlanChoice) -> Placement:
    if not choice.sequence_parallel:
        return Replicate()
    return Shard(problem.structure.embedding_cut_dims[name])


def _build_problem(
    model: nn.Module,
    mesh: PlanningMesh,
    example_inputs: tuple[Any, ...],
    loss_fn: Any,
    compute_profile: ComputeProfile | None,
    cost_profile: Any,
) -> _Problem:
    dims = _mesh_dims(mesh)
    if loss_fn not in (None, "cross_entropy", F.cross_entropy):
        raise ValueError(
            f"auto_plan: loss_fn {loss_fn!r}: expected None (the logits are returned whole) or F.cross_entropy / "
            "'cross_entropy' (then the logits may stay cut by vocabulary under loss_parallel)"
        )
    trace = trace_forward(model, example_inputs)
    structure = analyse_structure(model, trace, dims.size(dims.tp))
    if dims.cp is not None and dims.size(dims.cp) > 1 and structure.context_parallel_refused:
        raise ValueError(f"auto_plan: the mesh has a 'cp' dim but context parallelism cannot apply: {structure.context_parallel_refused}")
    parameters = list(model.parameters())
    itemsize = parameters[0].element_size() if parameters else 4
    parameter_dtype = parameters[0].dtype if parameters else torch.float32
    key_value: dict[str, int] = {}
    for op in trace.ops:
        if "scaled_dot_product" in str(op.func) and op.call is not None:
            key_value.setdefault(trace.calls[op.call].fqn, trace.nbytes(op.inputs[1]) + trace.nbytes(op.inputs[2]))
    return _Problem(
        model_name=type(model).__name__,
        trace=trace,
        structure=structure,
        dims=dims,
        compute=compute_profile or default_compute_profile(str(mesh.device_type)),
        loss_parallel_allowed=loss_fn is not None,
        cost_profile=cost_profile,
        parameter_itemsize=itemsize,
        attention_key_value_bytes=tuple(key_value.items()),
        pricer=LayoutPricer(mesh, dims.tp, dims.dp, dims.cp, trace, cost_profile),
        parameter_dtype=parameter_dtype,
    )


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
    return _price(_build_problem(model, mesh, example_inputs, loss_fn, compute_profile, cost_profile), choice)


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
    problem = _build_problem(model, mesh, example_inputs, loss_fn, compute_profile, cost_profile)
    structure = problem.structure
    if structure.replicated_modules:
        warnings.warn(
            f"auto_plan: no parallel style takes {', '.join(structure.replicated_modules)}; they stay replicated",
            stacklevel=2,
        )
    priced = [(choice, _price(problem, choice)) for choice in _candidates(problem)]

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
        parallelize_plan_specs=_style_specs(problem, best_choice),
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


def _notes(problem: _Problem, choice: PlanChoice, estimate: Estimate, priced: list[tuple[PlanChoice, Estimate]]) -> tuple[str, ...]:
    structure = problem.structure
    notes = [
        f"regions found (entries column-wise -> exit row-wise): "
        + "; ".join(f"{', '.join(_block_index_pattern(e, structure) for e in r.entries)} -> {_block_index_pattern(r.exit, structure)}"
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
    problem: _Problem, priced: list[tuple[PlanChoice, Estimate]], best: PlanChoice, best_estimate: Estimate
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


def _unique_regions(problem: _Problem) -> list[Region]:
    seen: dict[str, Region] = {}
    for region in problem.structure.regions:
        seen.setdefault(_region_kind(region, problem.structure), region)
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
