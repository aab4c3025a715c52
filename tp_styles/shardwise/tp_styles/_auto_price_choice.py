"""The estimated training step of one candidate plan (``price_choice``): every layer, FSDP unit and attention
call the candidate lays out differently, entered into ``_auto_cost``'s ``Ledger``.

A styled layer's traced ops are replayed on specs through dtensor_ops' decisions and every layout change is
priced by dtensor_ops (``_auto_cost.LayoutPricer`` over ``shardwise.dtensor_ops._pricing``): this module states
layouts and names no collective. What a layer moves depends on the layer and a few choices only, so each is
priced once per planning (``PlanningProblem.memo``) and blocks of one kind are counted, not priced again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from shardwise.dtensor_ops._pricing import NO_MOVEMENT, Movement, decide
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard

from ._auto_candidates import PlanChoice, PlanningProblem, embedding_layout, prepared_at_parent, region_kind
from ._auto_cost import Estimate, Ledger
from ._auto_structure import _SEQUENCE_DIM, ModelStructure, Region
from ._auto_trace import ModelTrace, TensorId, TracedCall

__all__ = ["price_choice"]

_LOSS_PARALLEL_OPS = 12  # its forward ops on DTensors (log-softmax pieces, gather, mean)
_OPTIMIZER_STATES = 2  # Adam's moments, per parameter
# Cross-entropy forward and backward per logit (max, exp, sum, log, subtract, its gradient): not in the traced
# forward, and cut by tp only under loss parallel.
_LOSS_FLOPS_PER_LOGIT = 8


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


def _memo(problem: PlanningProblem, key: tuple[Any, ...], compute: Callable[[], _Layer]) -> _Layer:
    found = problem.memo.get(key)
    if found is None:
        found = problem.memo[key] = compute()
    return found


def _styled_linear(problem: PlanningProblem, name: str, specs: dict[TensorId, DTensorSpec[Any]], weight_tp: Placement,
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


def _region_layer(problem: PlanningProblem, region: Region, sequence_parallel: bool, prepared: bool) -> _Layer:
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


def _embedding_layer(problem: PlanningProblem, name: str, mode: str, layout: Placement) -> _Layer:
    """An embedding cut by vocabulary (row-wise) or by feature (column-wise), its output laid out ``layout``."""

    def compute() -> _Layer:
        pricer, trace = problem.pricer, problem.trace
        call = trace.calls_of(name)[0]
        specs = {call.inputs[0]: pricer.activation(call.inputs[0], Replicate())}
        cut = Shard(0) if mode == "vocabulary" else Shard(1)
        moves, produced, _ = _styled_linear(problem, name, specs, cut, Replicate())
        return _Layer(moves + pricer.round_trip(produced, pricer.on_tp(produced, layout)), produced)

    return _memo(problem, ("embedding", name, mode, str(layout)), compute)


def _head_layer(problem: PlanningProblem, mode: str, sequence_parallel: bool) -> _Layer:
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


def _partial_sum_over(problem: PlanningProblem, spec: DTensorSpec[Any], dims: list[int]) -> Placement:
    """The tp placement the engine gives a sum of ``spec`` over ``dims`` (a parameter's gradient summed over the
    positions it was applied to, a norm's partial sums)."""
    decision = decide(torch.ops.aten.sum.dim_IntList, (spec, dims), {})
    produced = decision.output_specs
    assert isinstance(produced, DTensorSpec)
    return problem.pricer.tp_placement(produced)


def _reduced_bucket(problem: PlanningProblem, numel: float, dtype: torch.dtype, mesh_dim: int | None, placement: Placement) -> Movement:
    """A flat bucket of ``numel`` elements laid out ``placement`` on ``mesh_dim``, made whole there."""
    if mesh_dim is None or problem.dims.size(mesh_dim) <= 1 or numel <= 0:
        return NO_MOVEMENT
    key = ("bucket", int(numel), dtype, mesh_dim, placement)
    found = problem.memo.get(key)
    if found is None:
        pricer = problem.pricer
        found = problem.memo[key] = pricer.move(pricer.flat(int(numel), dtype, {mesh_dim: placement}), pricer.flat(int(numel), dtype, {}))
    return found


def _norm_reduction(problem: PlanningProblem, mesh_dim: int | None) -> Movement:
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


def _fsdp_unit(problem: PlanningProblem, unit_bytes: float) -> tuple[Movement, Movement]:
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


def _context_parallel_attention(problem: PlanningProblem, numel: int) -> Movement:
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


def price_choice(problem: PlanningProblem, choice: PlanChoice) -> Estimate:
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
            prepared = prepared_at_parent(choice, region)
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
            ledger.move(_embedding_layer(problem, name, mode, embedding_layout(problem, name, choice)).movement)
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



def _units_holding(structure: ModelStructure, choice: PlanChoice, modules: Sequence[str]) -> int:
    """How many FSDP units hold parameters of ``modules`` (blocks by prefix; the rest belongs to the root)."""
    if choice.fsdp_units == "root":
        return 1 if modules else 0
    units = set()
    for name in modules:
        owner = next((block.fqn for block in structure.blocks if name.startswith(block.fqn + ".")), "")
        units.add(owner)
    return len(units)


def _kind_of_attention(problem: PlanningProblem, attention_module: str) -> str:
    for kind, regions in problem.regions_by_kind.items():
        if any(region.exit.startswith(attention_module + ".") for region in regions):
            return kind
    return ""


def _fsdp_unit_bytes(problem: PlanningProblem, choice: PlanChoice, *, sharded_numel_total: float) -> list[float]:
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
        cut = sum(r.parameter_numel for r in block.regions if modes.get(region_kind(r, structure)) == "tensor_parallel")
        units.append(((numel - cut) + cut / T) * itemsize)
        in_blocks += numel
    rest = sum(structure.parameter_numel.values()) - in_blocks
    units.append(rest * itemsize)
    return units

