"""What a traced model is made of, as the automatic planner sees it.

From one fake forward (``_auto_trace``) this finds:

* **tensor-parallel regions**: linears ``E`` (the entries) that read one tensor ``X`` and whose
  outputs reach a single linear ``B`` (the exit) through ops that keep working when every entry's
  output is cut into ``tp`` blocks of its feature dim (views that split it into heads, transposes,
  pointwise ops, attention over heads, splits and cats along other dims). Such a region runs with
  the entries column-wise and the exit row-wise: Megatron's attention and MLP blocks are found
  this way, not by name. Each region's feasibility is proven by propagating the shard through
  the region's ops (``_propagate``), with the sizes of the trace: a view that would cut a head
  in two, or an op outside that list, rules the region out.
* **the residual stream's per-position modules** (norms): modules with parameters that read the
  stream between regions; sequence parallelism is possible when each of them keeps working with
  the sequence dim cut (the same propagation, starting on dim 1).
* embeddings, the output head (the linear whose output is the model's), weights shared between
  modules, repeated blocks (children of a ``ModuleList`` with the same structure and sizes),
  attention calls (for context parallelism), and ops that read the local sequence length
  (``arange``), which rule context parallelism out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from ._auto_trace import ModelTrace, TensorId, TracedCall, TracedOp

__all__ = ["ModelStructure", "Region", "analyse_structure"]

aten = torch.ops.aten

_SAME_DIMS = {
    aten.clone.default,
    aten.contiguous.default,
    aten._to_copy.default,
    aten.detach.default,
    aten.alias.default,
    aten.native_dropout.default,
    aten.lift_fresh.default,
}
_SEQUENCE_DIM = 1  # activations are (batch, sequence, features)
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.narrow.default, aten.select.int}


def _is_attention(func: Any) -> bool:
    return "scaled_dot_product" in str(func)


class _Refused(Exception):
    """The shard cannot pass this op; the message says why."""


def _view_target(in_shape: tuple[int, ...], out_shape: tuple[int, ...], dim: int, parts: int) -> int:
    """The output dim that carries input dim ``dim``'s ``parts`` blocks through a view, or _Refused."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        ins, outs = [i], [j]
        left, right = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while left != right:
            if left < right:
                if i >= len(in_shape):
                    raise _Refused(f"view {in_shape} -> {out_shape}")
                ins.append(i)
                left *= in_shape[i]
                i += 1
            else:
                if j >= len(out_shape):
                    raise _Refused(f"view {in_shape} -> {out_shape}")
                outs.append(j)
                right *= out_shape[j]
                j += 1
        groups.append((ins, outs))
    if not groups:
        raise _Refused(f"view {in_shape} -> {out_shape}")
    groups[-1][0].extend(range(i, len(in_shape)))
    groups[-1][1].extend(range(j, len(out_shape)))
    for ins, outs in groups:
        if dim not in ins:
            continue
        big_in = [k for k in ins if in_shape[k] != 1]
        big_out = [k for k in outs if out_shape[k] != 1]
        if not big_out or (big_in and big_in[0] != dim):
            raise _Refused(f"view {in_shape} -> {out_shape} moves the cut dim {dim} inside another")
        target = big_out[0]
        if len(big_in) <= 1 and out_shape[target] % parts:
            raise _Refused(f"view {in_shape} -> {out_shape}: {out_shape[target]} does not split into {parts} (a head would be cut)")
        if len(big_in) > 1 and len(big_out) > 1:
            raise _Refused(f"view {in_shape} -> {out_shape} regroups the cut dim")
        return target
    raise _Refused(f"view {in_shape} -> {out_shape}")


class _Propagation:
    """Which dim of each tensor is cut into ``parts`` blocks, op by op (see the module doc)."""

    def __init__(self, trace: ModelTrace, parts: int, seeds: dict[TensorId, int]) -> None:
        self.trace = trace
        self.parts = parts
        self.cut: dict[TensorId, int] = dict(seeds)
        self.needs_global_views = False  # a view names the cut dim's size: the tensors must stay DTensors

    def _dim(self, op: TracedOp, position: int) -> int:
        value = op.args[position]
        return int(value)

    def step(self, op: TracedOp) -> None:
        """Propagates through ``op`` (which reads at least one cut tensor), or raises _Refused."""
        trace, func = self.trace, op.func
        if not op.outputs:
            return  # a metadata query (prim.device, sym sizes): nothing is computed
        cut_inputs = [t for t in op.inputs if t in self.cut]
        first = cut_inputs[0]
        dim = self.cut[first]
        shape_in = trace.shapes[first]
        outputs = [t for t in op.outputs if t != first]
        if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            out = op.outputs[0]
            target = _view_target(shape_in, trace.shapes[out], dim, self.parts)
            sizes = op.args[1]
            if isinstance(sizes, (list, tuple)) and target < len(sizes) and sizes[target] != -1:
                self.needs_global_views = True
            self.cut[out] = target
            return
        if func in (aten.transpose.int,):
            a, b = (d % len(shape_in) for d in (int(op.args[1]), int(op.args[2])))
            self.cut[op.outputs[0]] = b if dim == a else a if dim == b else dim
            return
        if func is aten.t.default:
            self.cut[op.outputs[0]] = 1 - dim if len(shape_in) == 2 else dim
            return
        if func is aten.permute.default:
            order = [int(d) % len(shape_in) for d in op.args[1]]
            self.cut[op.outputs[0]] = order.index(dim)
            return
        if func is aten.unsqueeze.default:
            at = int(op.args[1]) % (len(shape_in) + 1)
            self.cut[op.outputs[0]] = dim + 1 if at <= dim else dim
            return
        if func in (aten.squeeze.dim, aten.squeeze.dims):
            dims = op.args[1] if isinstance(op.args[1], (list, tuple)) else [op.args[1]]
            removed = [int(d) % len(shape_in) for d in dims if shape_in[int(d) % len(shape_in)] == 1]
            self.cut[op.outputs[0]] = dim - sum(1 for d in removed if d < dim)
            return
        if func is aten.expand.default:
            self.cut[op.outputs[0]] = dim + len(trace.shapes[op.outputs[0]]) - len(shape_in)
            return
        if func in _SPLITS:
            along = int(op.args[1]) % len(shape_in) if len(op.args) > 1 else 0
            if along == dim:
                raise _Refused(f"{func} along the cut dim {dim}")
            for out in outputs or op.outputs:
                self.cut[out] = dim if func is not aten.select.int or along > dim else dim - 1
            return
        if func is aten.cat.default:
            along = int(op.args[1]) % len(shape_in) if len(op.args) > 1 else 0
            if along == dim or any(t not in self.cut or self.cut[t] != dim for t in op.inputs):
                raise _Refused("cat of cut and whole tensors, or along the cut dim")
            self.cut[op.outputs[0]] = dim
            return
        if _is_attention(func):
            if any(self.cut.get(t) != 1 for t in op.inputs[:3]):
                raise _Refused("attention whose query, key and value are not all cut by heads")
            for out in op.outputs:
                if len(trace.shapes[out]) >= 3:
                    self.cut[out] = 1
            return
        if func in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction):
            reduced = op.args[1] if len(op.args) > 1 and op.args[1] is not None else list(range(len(shape_in)))
            reduced = [int(d) % len(shape_in) for d in (reduced if isinstance(reduced, (list, tuple)) else [reduced])]
            if dim in reduced:
                raise _Refused(f"{func} reduces the cut dim")
            keep = len(trace.shapes[op.outputs[0]]) == len(shape_in)
            self.cut[op.outputs[0]] = dim if keep else dim - sum(1 for d in reduced if d < dim)
            return
        if func is aten.native_layer_norm.default:
            normalized = len(op.args[1])
            if dim >= len(shape_in) - normalized:
                raise _Refused("layer norm over the cut dim")
            for out in op.outputs:
                if len(trace.shapes[out]) == len(shape_in):
                    self.cut[out] = dim
            return
        if func in _SAME_DIMS or torch.Tag.pointwise in func.tags:
            out_rank = max(len(trace.shapes[t]) for t in op.outputs) if op.outputs else len(shape_in)
            aligned = dim + out_rank - len(shape_in)
            for tensor in op.inputs:
                rank = len(trace.shapes[tensor])
                local = aligned - (out_rank - rank)
                if tensor in self.cut:
                    if local != self.cut[tensor]:
                        raise _Refused(f"{func} on tensors cut along different dims")
                elif 0 <= local < rank and trace.shapes[tensor][local] != 1:
                    raise _Refused(f"{func} of a cut tensor with a whole one of size {trace.shapes[tensor][local]} on the cut dim")
            for out in op.outputs:
                if len(trace.shapes[out]) == out_rank:
                    self.cut[out] = aligned
            return
        raise _Refused(f"{func} is not known to keep working on cut tensors")


@dataclasses.dataclass(frozen=True)
class Region:
    """Entries column-wise, exit row-wise (see the module doc)."""

    entries: tuple[str, ...]
    exit: str
    parent: str | None  # the module whose input X is and that holds the entries: its input is laid out once
    parent_input_index: int  # X's place among the parent's tensor inputs
    input: TensorId
    output: TensorId
    flops: int
    parameter_numel: int
    needs_global_views: bool
    op_count: int  # ops between the entries and the exit (they run on local tensors when TP)
    exit_bias_numel: int  # the exit's bias stays whole on every tensor-parallel rank (row-wise)
    input_takes_gradient: bool  # False for a model input: backward then reduces no input gradient


@dataclasses.dataclass(frozen=True)
class Block:
    """One child of a ``ModuleList`` that holds regions; blocks of one ``kind`` are interchangeable."""

    fqn: str
    kind: str
    regions: tuple[Region, ...]


@dataclasses.dataclass(frozen=True)
class ModelStructure:
    regions: tuple[Region, ...]
    blocks: tuple[Block, ...]
    embeddings: tuple[str, ...]
    head: str | None  # the linear whose output is the model's output
    stream_modules: tuple[str, ...]  # per-position modules with parameters on the residual stream (norms)
    sequence_parallel_refused: str | None
    embedding_cut_dims: dict[str, int]  # under sequence parallelism: the dim each embedding's output is cut on
    tied: tuple[tuple[str, ...], ...]  # parameter names that are one tensor
    replicated_modules: tuple[str, ...]  # modules with parameters no style takes (kept whole, with a warning)
    attention_modules: tuple[str, ...]  # modules whose own forward calls SDPA
    context_parallel_refused: str | None
    parameter_numel: dict[str, int]  # module FQN -> numel of its own parameters (a tied tensor at its first module)


def _calls_by_fqn(trace: ModelTrace) -> dict[str, TracedCall]:
    first: dict[str, TracedCall] = {}
    for call in trace.calls:
        first.setdefault(call.fqn, call)
    return first


def _inside(trace: ModelTrace, op: TracedOp, call: TracedCall) -> bool:
    return call.first_op <= op.index < call.end_op


def _upstream(trace: ModelTrace, start: TensorId, stop: Callable[[TensorId], bool]) -> Iterator[TensorId]:
    """``start`` and the tensors it is computed from, depth first, not going past those ``stop`` accepts."""
    seen: set[TensorId] = set()
    stack = [start]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        yield current
        producer = trace.producer.get(current)
        if producer is not None and not stop(current):
            stack.extend(trace.ops[producer].inputs)


def _linear_ancestors(trace: ModelTrace, tensor: TensorId, linear_of_output: dict[TensorId, TracedCall]) -> set[str] | None:
    """The linears whose outputs ``tensor`` is computed from without passing another linear; None if it
    also depends on an embedding (then it is no region's exit input)."""
    found: set[str] = set()
    for current in _upstream(trace, tensor, lambda t: t in linear_of_output):
        call = linear_of_output.get(current)
        if call is not None:
            found.add(call.fqn)
        elif current in trace.producer and trace.ops[trace.producer[current]].func is aten.embedding.default:
            return None
    return found


def _propagate_region(
    trace: ModelTrace, entries: list[TracedCall], exit_call: TracedCall, parts: int, skip: list[TracedCall]
) -> _Propagation:
    seeds = {call.outputs[0]: len(trace.shapes[call.outputs[0]]) - 1 for call in entries}
    for call in entries:
        if trace.shapes[call.outputs[0]][-1] % parts:
            raise _Refused(f"{call.fqn}'s {trace.shapes[call.outputs[0]][-1]} outputs do not split into {parts}")
    propagation = _Propagation(trace, parts, seeds)
    start = min(call.end_op for call in entries)
    for op in trace.ops[start : exit_call.first_op]:
        if not any(t in propagation.cut for t in op.inputs):
            continue
        if any(_inside(trace, op, call) for call in skip):
            raise _Refused(f"a cut tensor reaches {trace.ops[op.index].func} inside another module with weights")
        propagation.step(op)
    if propagation.cut.get(exit_call.inputs[0]) != len(trace.shapes[exit_call.inputs[0]]) - 1:
        raise _Refused(f"{exit_call.fqn} does not read the entries' outputs cut on its input features")
    # Nothing cut may be read after the exit starts, except by the exit.
    for tensor in propagation.cut:
        for consumer in trace.consumers.get(tensor, ()):
            if consumer >= exit_call.end_op or (consumer >= exit_call.first_op and tensor != exit_call.inputs[0]):
                raise _Refused(f"a cut tensor is read outside the region (by {trace.ops[consumer].func})")
    return propagation


def _find_regions(trace: ModelTrace, parts: int, linear_calls: list[TracedCall]) -> tuple[list[Region], dict[str, str]]:
    linear_of_output = {call.outputs[0]: call for call in linear_calls}
    by_fqn = {call.fqn: call for call in linear_calls}
    regions: list[Region] = []
    refusals: dict[str, str] = {}
    taken: set[str] = set()
    carrying = trace.carries_gradient()
    for exit_call in linear_calls:
        ancestors = _linear_ancestors(trace, exit_call.inputs[0], linear_of_output)
        if not ancestors or exit_call.fqn in ancestors or ancestors & taken:
            continue
        entries = sorted((by_fqn[name] for name in ancestors), key=lambda call: call.index)
        region_input = entries[0].inputs[0]
        if any(call.inputs[0] != region_input for call in entries):
            continue  # entries reading different tensors: not one region (e.g. the head behind the residual stream)
        others = [call for call in linear_calls if call.fqn not in ancestors and call is not exit_call]
        try:
            propagation = _propagate_region(trace, entries, exit_call, parts, others)
        except _Refused as why:
            refusals[exit_call.fqn] = str(why)
            continue
        parent, index = _region_parent(trace, entries, region_input)
        numel = sum(_own_numel(call.module) for call in (*entries, exit_call))
        flops = sum(trace.flops_within(call) for call in (*entries, exit_call)) + sum(
            op.flops for op in trace.ops[entries[-1].end_op : exit_call.first_op]
        )
        regions.append(
            Region(
                entries=tuple(call.fqn for call in entries),
                exit=exit_call.fqn,
                parent=parent,
                parent_input_index=index,
                input=region_input,
                output=exit_call.outputs[0],
                flops=flops,
                parameter_numel=numel,
                needs_global_views=propagation.needs_global_views,
                op_count=exit_call.first_op - entries[0].end_op,
                exit_bias_numel=_bias_numel(exit_call.module),
                input_takes_gradient=region_input in carrying,
            )
        )
        taken |= ancestors | {exit_call.fqn}
    return regions, refusals


def _region_parent(trace: ModelTrace, entries: list[TracedCall], region_input: TensorId) -> tuple[str | None, int]:
    """The innermost module call that takes X as an input and contains every entry (None if it is the root)."""
    candidate = entries[0].parent
    while candidate is not None:
        call = trace.calls[candidate]
        if all(call.first_op <= entry.first_op and entry.end_op <= call.end_op for entry in entries) and region_input in call.inputs:
            if call.parent is None:
                return None, 0
            return call.fqn, call.inputs.index(region_input)
        candidate = call.parent
    return None, 0


def _numel_once(model: nn.Module) -> dict[str, int]:
    """Each module's own parameters' numel, a tensor shared by several modules (tied weights) counted at its first."""
    seen: set[int] = set()
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        own = [parameter for parameter in module.parameters(recurse=False) if id(parameter) not in seen]
        seen.update(id(parameter) for parameter in own)
        counts[name] = sum(parameter.numel() for parameter in own)
    return counts


def _bias_numel(module: nn.Module) -> int:
    bias = getattr(module, "bias", None)
    return int(bias.numel()) if isinstance(bias, torch.Tensor) else 0


def _own_numel(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters(recurse=False))


def _stream_check(trace: ModelTrace, parts: int, stream_calls: list[TracedCall], seq_dim: int) -> str | None:
    """None if every per-position module keeps working with its input cut on the sequence dim."""
    for call in stream_calls:
        tensor = call.inputs[0]
        if len(trace.shapes[tensor]) <= seq_dim or trace.shapes[tensor][seq_dim] % parts:
            return f"{call.fqn}'s input {trace.shapes[tensor]} does not cut into {parts} on the sequence dim {seq_dim}"
        propagation = _Propagation(trace, parts, {tensor: seq_dim})
        try:
            for op in trace.ops_within(call):
                if any(t in propagation.cut for t in op.inputs):
                    propagation.step(op)
        except _Refused as why:
            return f"{call.fqn}: {why}"
        if propagation.cut.get(call.outputs[0]) != seq_dim:
            return f"{call.fqn}'s output is not cut on the sequence dim"
    return None


def _embedding_cut_dims(trace: ModelTrace, embeddings: list[TracedCall], seq_dim: int) -> tuple[dict[str, int], str | None]:
    """Under sequence parallelism each embedding's output is cut where it meets the stream (dim ``seq_dim``
    of a (batch, seq, dim) lookup, dim 0 of a (seq, dim) one added to it by broadcasting)."""
    dims: dict[str, int] = {}
    for call in embeddings:
        shape = trace.shapes[call.outputs[0]]
        if len(shape) == 3:
            dims[call.fqn] = seq_dim
        elif len(shape) == 2:
            dims[call.fqn] = 0
        else:
            return {}, f"embedding {call.fqn} gives a {len(shape)}-D output"
    return dims, None


def _kind_of_block(module: nn.Module) -> str:
    """Blocks with equal kinds get one choice: the module types and parameter shapes, in order."""
    parts = [f"{name}:{type(child).__name__}" for name, child in module.named_modules()]
    parts += [f"{name}{tuple(parameter.shape)}" for name, parameter in module.named_parameters()]
    return "|".join(parts)


def analyse_structure(model: nn.Module, trace: ModelTrace, parts: int) -> ModelStructure:
    """The model's structure for a tensor-parallel dim of ``parts`` ranks (see the module doc)."""
    calls = _calls_by_fqn(trace)
    root = trace.calls[0]
    linear_calls = [call for call in calls.values() if isinstance(call.module, nn.Linear)]
    embedding_calls = [call for call in calls.values() if isinstance(call.module, nn.Embedding)]
    regions, _refusals = _find_regions(trace, parts, linear_calls)
    in_region = {name for region in regions for name in (*region.entries, region.exit)}

    # The head: the linear outside every region whose output the model's output is computed from last.
    head: str | None = None
    linear_of_output = {call.outputs[0]: call for call in linear_calls}

    def past_head(tensor: TensorId) -> bool:
        producer = trace.producer.get(tensor)
        return tensor in linear_of_output or (
            producer is not None and trace.ops[producer].func in (aten.mm.default, aten.addmm.default, aten.bmm.default)
        )

    if root.outputs:
        for current in _upstream(trace, root.outputs[0], past_head):
            found = linear_of_output.get(current)
            if found is not None:
                head = found.fqn if found.fqn not in in_region else None
                break

    # Per-position modules with parameters on the stream: called with a tensor input, outside regions.
    handled = in_region | {call.fqn for call in embedding_calls} | ({head} if head else set())
    stream_calls: list[TracedCall] = []
    replicated: list[str] = []
    for name, module in model.named_modules():
        if not name or name in handled or _own_numel(module) == 0:
            continue
        module_call = calls.get(name)
        if module_call is None:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)) or any(c.fqn.startswith(name + ".") and c.fqn in handled for c in calls.values()):
            replicated.append(name)
            continue
        if any(isinstance(child, (nn.Linear, nn.Embedding)) for child in module.modules()):
            replicated.append(name)
            continue
        if _stream_check(trace, 1, [module_call], _SEQUENCE_DIM) is not None:
            replicated.append(name)  # not per position (a convolution over the sequence, ...): kept whole
            continue
        stream_calls.append(module_call)
    sequence_dim = _SEQUENCE_DIM
    refusal = None if regions else "no tensor-parallel region was found"
    flat = [region.exit for region in regions if len(trace.shapes[region.input]) < 3]
    if refusal is None and flat:
        refusal = f"the input of {flat[0]} is not (batch, sequence, features): there is no sequence dim to cut"
    if refusal is None and replicated:
        refusal = f"modules kept whole ({', '.join(replicated)}) cannot read a sequence-cut stream"
    if refusal is None:
        refusal = _stream_check(trace, parts, stream_calls, sequence_dim)
    cut_dims, embedding_refusal = _embedding_cut_dims(trace, embedding_calls, sequence_dim)
    refusal = refusal or embedding_refusal

    # Blocks: children of ModuleLists that hold regions.
    blocks: list[Block] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        for index, child in enumerate(module):
            prefix = f"{name}.{index}"
            held = tuple(region for region in regions if region.exit.startswith(prefix + "."))
            if held:
                blocks.append(Block(prefix, _kind_of_block(child), held))

    tied: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    attention = sorted({trace.calls[op.call].fqn for op in trace.ops if _is_attention(op.func) and op.call is not None})
    tokens = trace.model_inputs[0] if trace.model_inputs else None
    token_shape = trace.shapes.get(tokens) if tokens is not None else None
    sequence_length = token_shape[1] if token_shape and len(token_shape) > 1 else None
    arange = [
        op
        for op in trace.ops
        if op.func in (aten.arange.default, aten.arange.start, aten.arange.start_step)
        and trace.shapes[op.outputs[0]] == (sequence_length,)
    ]
    cp_refusal: str | None = None
    if not attention:
        cp_refusal = "the model calls no scaled_dot_product_attention"
    elif arange:
        where = trace.calls[arange[0].call].fqn if arange[0].call is not None else "the root"
        cp_refusal = (
            f"{where or type(model).__name__} builds positions with arange from the local sequence length; under context "
            "parallelism each rank holds a permuted part of the sequence, so positions must be passed in (as Llama's forward takes them)"
        )
    return ModelStructure(
        regions=tuple(regions),
        blocks=tuple(blocks),
        embeddings=tuple(call.fqn for call in embedding_calls),
        head=head,
        stream_modules=tuple(call.fqn for call in stream_calls),
        sequence_parallel_refused=refusal,
        embedding_cut_dims=cut_dims,
        tied=tuple(tuple(names) for names in tied.values() if len(names) > 1),
        replicated_modules=tuple(replicated),
        attention_modules=tuple(attention),
        context_parallel_refused=cp_refusal,
        parameter_numel=_numel_once(model),
    )
