"""Ring attention on plain local tensors: the engine under ``context_parallel``.

Every rank holds its queries and one block of keys/values (per :class:`SequenceLayout`).  In ``W``
steps each rank meets every key/value block: step ``i`` uses the block of rank ``(r - i) mod W``,
handed on around the ring (all-to-all rotation: one ``all_to_all_single`` per step, launched before
the step's compute so it can overlap; all-gather rotation: one ``all_gather_into_tensor`` up front).
Partial outputs are merged with their log-sum-exp in float32 whatever the input dtype (float64
inputs keep float64), and gradients accumulate and travel in the same dtype.

Backward runs the same ring with the final output and log-sum-exp: each block's gradient comes
from the kernel's own backward; query gradients stay home, key/value gradients travel with the
ring (one ``all_to_all_single`` per step, the last one bringing each block's sum home).  So the
all-to-all rotation issues ``W - 1`` collectives forward and ``2W - 1`` backward (PyTorch's
``3W - 2`` in all), the all-gather rotation one all-gather forward, one all-gather and ``W``
all-to-alls backward.

Under torch's ``LocalTensorMode`` (every rank simulated in one process) ``spec.rank`` is a per-rank
SymInt and the tensors are ``LocalTensor``s: what depends on the rank (which block a step sees,
its kernel calls, the split sizes of a hand-on) runs once per simulated rank through
:func:`on_each_rank`, and each collective runs once on every rank's buffer.

Causal masks follow the layout: a query segment sees the keys of earlier segments whole, its own
segment under SDPA's causal triangle and later segments not at all, so a step with nothing to see
computes nothing.  Grouped-query attention rotates the compact key/value heads and expands them
per block; their gradients are summed back per group before they travel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

import torch

from shardwise.mesh._simulation import run_for_each_simulated_rank

from .. import _collectives
from ._cp_kernels import BlockKernel, accumulation_dtype
from ._cp_layout import SequenceLayout

__all__ = ["BlockCall", "RingSpec", "block_calls", "on_each_rank", "ring_attention", "ring_forward", "ring_backward"]

_R = TypeVar("_R")


def on_each_rank(rank: int, function: Callable[..., _R], *args: Any) -> _R:
    """``function(rank, *args)``: a plain call on a real rank.

    Under ``LocalTensorMode`` ``rank`` is a per-rank SymInt: ``function`` then runs once per simulated
    rank with that rank's int and its piece of every ``LocalTensor`` argument, and the results are
    joined back (tensors into ``LocalTensor``s, ints into per-rank SymInts; anything else must agree).
    ``function`` must not communicate.
    """
    if isinstance(rank, int):
        return function(rank, *args)
    return run_for_each_simulated_rank(function, rank, *args)


@dataclass(frozen=True)
class RingSpec:
    """Everything one ring attention call needs besides its tensors (the same on every rank but ``rank``)."""

    group_name: str
    rank: int
    world_size: int
    query_layout: SequenceLayout
    kv_layout: SequenceLayout
    is_causal: bool
    scale: float
    query_heads_per_kv_head: int
    kernel: BlockKernel
    rotate_method: str  # "alltoall" | "allgather" ("ulysses" calls go to _cp_ulysses instead)

    def of_rank(self, rank: int) -> RingSpec:
        """This spec as rank ``rank`` holds it (``rank`` an int; under ``LocalTensorMode`` ``self.rank`` is every rank's)."""
        if isinstance(self.rank, int) and self.rank == rank:
            return self
        return replace(self, rank=rank)

    def source(self, step: int) -> int:
        """The rank whose key/value block this rank meets at ``step`` (an int rank only)."""
        return (self.rank - step) % self.world_size


@dataclass(frozen=True)
class BlockCall:
    """One kernel call: local query rows ``[q_start, q_stop)`` against key rows ``[kv_start, kv_stop)``."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool


def block_calls(spec: RingSpec, source: int) -> tuple[BlockCall, ...]:
    """The kernel calls of this rank's queries against ``source``'s key/value block."""
    q_len = spec.query_layout.local_length(spec.rank)
    kv_len = spec.kv_layout.local_length(source)
    if q_len == 0 or kv_len == 0:
        return ()
    if not spec.is_causal:
        return (BlockCall(0, q_len, 0, kv_len, False),)
    if source == spec.rank:
        # Positions increase along the local order, so "key position <= query position" is j <= i.
        return (BlockCall(0, q_len, 0, kv_len, True),)
    kv_segments = spec.kv_layout.segments[source]
    calls: list[BlockCall] = []
    q_offset = 0
    for q_start, q_stop in spec.query_layout.segments[spec.rank]:
        visible = 0
        for kv_start, kv_stop in kv_segments:
            if kv_stop <= q_start:
                visible += kv_stop - kv_start  # an earlier segment: seen whole (a prefix, positions increase)
            elif kv_start < q_stop:
                raise AssertionError(
                    f"causal ring attention: rank {spec.rank}'s positions [{q_start}, {q_stop}) overlap rank {source}'s "
                    f"[{kv_start}, {kv_stop}); the query and key layouts disagree"
                )
        rows = q_stop - q_start
        if visible:
            last = calls[-1] if calls else None
            if last is not None and last.q_stop == q_offset and last.kv_stop == visible:
                calls[-1] = BlockCall(last.q_start, q_offset + rows, 0, visible, False)
            else:
                calls.append(BlockCall(q_offset, q_offset + rows, 0, visible, False))
        q_offset += rows
    return tuple(calls)


def _expand_heads(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    # SDPA's enable_gqa: query head h reads key/value head h // groups.
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=1)


def _sum_head_groups(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    return tensor if groups == 1 else tensor.unflatten(1, (tensor.size(1) // groups, groups)).sum(2)


def _pack(first: torch.Tensor, second: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """``first`` and ``second`` as one flat buffer, zero-padded to ``numel`` elements when given."""
    flat = torch.cat([first.reshape(-1), second.reshape(-1)])
    if numel is not None and numel > flat.numel():
        flat = torch.nn.functional.pad(flat, (0, numel - flat.numel()))
    return flat


def _unpack(
    flat: torch.Tensor, first_shape: tuple[int, ...], second_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    first_numel = 1
    for extent in first_shape:
        first_numel *= extent
    return flat[:first_numel].reshape(first_shape), flat[first_numel:].reshape(second_shape)


class _BlockShapes:
    """The key and value shapes of every rank's block (sequence lengths differ on uneven layouts)."""

    def __init__(self, spec: RingSpec, key: torch.Tensor, value: torch.Tensor) -> None:
        batch, heads = key.shape[0], key.shape[1]
        self.key = [(batch, heads, length, key.shape[3]) for length in spec.kv_layout.local_lengths()]
        self.value = [(batch, heads, length, value.shape[3]) for length in spec.kv_layout.local_lengths()]

    def numel(self, rank: int) -> int:
        return self.key[rank][0] * self.key[rank][1] * self.key[rank][2] * (self.key[rank][3] + self.value[rank][3])


def _hand_on_splits(rank: int, spec: RingSpec, shapes: _BlockShapes, step: int) -> tuple[list[int], list[int]]:
    """Input and output splits of step ``step``'s hand-on: the block of step ``step`` goes to rank ``r + 1``,
    the block of step ``step + 1`` comes from rank ``r - 1``."""
    spec = spec.of_rank(rank)
    input_splits = [0] * spec.world_size
    output_splits = [0] * spec.world_size
    input_splits[(rank + 1) % spec.world_size] = shapes.numel(spec.source(step))
    output_splits[(rank - 1) % spec.world_size] = shapes.numel(spec.source(step + 1))
    return input_splits, output_splits


def _send_to_next(spec: RingSpec, shapes: _BlockShapes, flat: torch.Tensor, step: int) -> torch.Tensor:
    """Launch (unwaited) step ``step``'s hand-on of ``flat`` (one all-to-all; the same in forward and backward)."""
    input_splits, output_splits = on_each_rank(spec.rank, _hand_on_splits, spec, shapes, step)
    return _collectives.launch_all_to_all_exact(flat, output_splits, input_splits, spec.group_name)


def _block_of(rank: int, spec: RingSpec, shapes: _BlockShapes, flat: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value of step ``step``'s block (rank ``r - step``'s) from its flat buffer."""
    source = spec.of_rank(rank).source(step)
    return _unpack(flat, shapes.key[source], shapes.value[source])


def _gathered_block(rank: int, spec: RingSpec, shapes: _BlockShapes, gathered: torch.Tensor, widest: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value of step ``step``'s block, read from the all-gathered blocks (each padded to ``widest``)."""
    source = spec.of_rank(rank).source(step)
    start = source * widest
    return _unpack(gathered[start : start + shapes.numel(source)], shapes.key[source], shapes.value[source])


class _KeyValueRing:
    """Hands out the key/value block of step ``i`` (rank ``(r - i) mod W``'s), fetching the next one early."""

    def __init__(self, spec: RingSpec, key: torch.Tensor, value: torch.Tensor) -> None:
        self._spec = spec
        self.shapes = _BlockShapes(spec, key, value)
        self._current = (key, value)
        # The current block as one flat buffer, once it exists: a received block is handed on as it
        # arrived, without packing it again (one shard-sized copy less per step).
        self._current_flat: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None
        self._received: torch.Tensor | None = None  # a hand-on waited for early by settle()
        self._gathered: torch.Tensor | None = None
        self._widest = max(self.shapes.numel(rank) for rank in range(spec.world_size))

    def block(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self._spec
        if spec.rotate_method == "allgather":
            if step == 0:
                if spec.world_size > 1 and self._gathered is None:
                    # Pieces of every size travel padded to the widest (each rank pads its own).
                    padded = on_each_rank(spec.rank, lambda _rank, key, value: _pack(key, value, self._widest), *self._current)
                    self._pending = _collectives.launch_all_gather(padded, spec.world_size, spec.group_name)
                return self._current
            self.settle()
            assert self._gathered is not None
            return on_each_rank(spec.rank, _gathered_block, spec, self.shapes, self._gathered, self._widest, step)
        if step > 0:
            self.settle()
            received = self._received
            assert received is not None
            self._received = None
            self._current_flat = received
            self._current = on_each_rank(spec.rank, _block_of, spec, self.shapes, received, step)
        if step < spec.world_size - 1:
            # Launch the hand-on before this step's compute so that the two may overlap.
            flat = self._current_flat if self._current_flat is not None else _pack(*self._current)
            self._pending = _send_to_next(spec, self.shapes, flat, step)
        return self._current


    def settle(self) -> None:
        """Waits for the key/value transfer in flight, if any (the next ``block`` then uses what arrived).

        The backward calls it before handing its gradient block on, so that on CPU (gloo) a rank never
        has two collectives of one group in flight at once: a rank crashed in ``wait_tensor`` once when
        the gradient's hand-on was waited for while the key/value one was still running.
        """
        if self._pending is None:
            return
        arrived = _collectives.wait(self._pending)
        self._pending = None
        if self._spec.rotate_method == "allgather":
            self._gathered = arrived
        else:
            self._received = arrived


def _merge(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, call: BlockCall, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    rows = slice(call.q_start, call.q_stop)
    old_lse = lse_acc[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    # Rows seen for the first time have old_lse = -inf: their old weight exp(-inf) is 0.
    out_acc[:, :, rows] = out_acc[:, :, rows] * torch.exp(old_lse - new_lse).unsqueeze(-1) + block_out.to(out_acc.dtype) * torch.exp(
        block_lse - new_lse
    ).unsqueeze(-1)
    lse_acc[:, :, rows] = new_lse


def _forward_step(
    rank: int,
    spec: RingSpec,
    step: int,
    query: torch.Tensor,
    block_key: torch.Tensor,
    block_value: torch.Tensor,
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step`` of the forward on this rank: its kernel calls against the step's block, merged in place."""
    spec = spec.of_rank(rank)
    groups = spec.query_heads_per_kv_head
    for call in block_calls(spec, spec.source(step)):
        block_out, block_lse = spec.kernel.forward(
            query[:, :, call.q_start : call.q_stop],
            _expand_heads(block_key[:, :, call.kv_start : call.kv_stop], groups),
            _expand_heads(block_value[:, :, call.kv_start : call.kv_stop], groups),
            call.causal,
            spec.scale,
        )
        _merge(out_acc, lse_acc, call, block_out, block_lse)
    return out_acc, lse_acc


def ring_forward(
    spec: RingSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output (query dtype) and log-sum-exp ``(B, H, Lq)`` (float32; float64 for float64 inputs)."""
    batch, heads, q_len, _ = query.shape
    accumulate = accumulation_dtype(query.dtype)
    out_acc = torch.zeros(batch, heads, q_len, value.shape[3], dtype=accumulate, device=query.device)
    lse_acc = torch.full((batch, heads, q_len), float("-inf"), dtype=accumulate, device=query.device)
    ring = _KeyValueRing(spec, key, value)
    for step in range(spec.world_size):
        block_key, block_value = ring.block(step)
        out_acc, lse_acc = on_each_rank(spec.rank, _forward_step, spec, step, query, block_key, block_value, out_acc, lse_acc)
    return out_acc.to(query.dtype), lse_acc


def _backward_step(
    rank: int,
    spec: RingSpec,
    shapes: _BlockShapes,
    step: int,
    tensors: tuple[torch.Tensor, ...],
    block_key: torch.Tensor,
    block_value: torch.Tensor,
    grad_query: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step`` of the backward on this rank: ``grad_query`` (added to in place) and the step's block's
    key and value gradients in one flat buffer (the one that travels on)."""
    spec = spec.of_rank(rank)
    grad_out, query, out, lse = tensors
    groups = spec.query_heads_per_kv_head
    source = spec.source(step)
    grad_flat = torch.zeros(shapes.numel(source), dtype=grad_query.dtype, device=grad_query.device)
    grad_key, grad_value = _unpack(grad_flat, shapes.key[source], shapes.value[source])
    for call in block_calls(spec, source):
        rows = slice(call.q_start, call.q_stop)
        columns = slice(call.kv_start, call.kv_stop)
        block_grad_query, block_grad_key, block_grad_value = spec.kernel.backward(
            grad_out[:, :, rows],
            query[:, :, rows],
            _expand_heads(block_key[:, :, columns], groups),
            _expand_heads(block_value[:, :, columns], groups),
            out[:, :, rows],
            lse[:, :, rows],
            call.causal,
            spec.scale,
        )
        grad_query[:, :, rows] += block_grad_query.to(grad_query.dtype)
        grad_key[:, :, columns] += _sum_head_groups(block_grad_key.to(grad_query.dtype), groups)
        grad_value[:, :, columns] += _sum_head_groups(block_grad_value.to(grad_query.dtype), groups)
    return grad_query, grad_flat


def ring_backward(
    spec: RingSpec,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this rank's pieces, in their input dtypes."""
    accumulate = accumulation_dtype(query.dtype)
    grad_query = torch.zeros(query.shape, dtype=accumulate, device=query.device)
    ring = _KeyValueRing(spec, key, value)
    shapes = ring.shapes
    # On CPU (gloo) one collective of the group is in flight at a time: the key/value transfer is waited for
    # before the gradient's hand-on starts, and that one before the next key/value transfer (see settle()).
    one_at_a_time = grad_query.device.type == "cpu"
    pending: torch.Tensor | None = None
    grad_flat: torch.Tensor | None = None
    for step in range(spec.world_size):
        block_key, block_value = ring.block(step)
        grad_query, grad_flat = on_each_rank(
            spec.rank, _backward_step, spec, shapes, step, (grad_out, query, out, lse), block_key, block_value, grad_query
        )
        if spec.world_size == 1:
            break
        if one_at_a_time:
            ring.settle()
        if pending is not None:
            # What earlier ranks added to this block's gradient, handed on with the ring.
            grad_flat += _collectives.wait(pending)
        pending = _send_to_next(spec, shapes, grad_flat, step)
        if one_at_a_time:
            pending = _collectives.wait(pending)  # waiting again on a waited tensor returns it as it is
    # After W hand-ons the block that arrives is this rank's own, summed over every rank (W = 1: it never left).
    own_flat = _collectives.wait(pending) if pending is not None else grad_flat
    assert own_flat is not None
    own_key, own_value = on_each_rank(spec.rank, _block_of, spec, shapes, own_flat, 0)
    return grad_query.to(query.dtype), own_key.to(key.dtype), own_value.to(value.dtype)


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spec: RingSpec) -> torch.Tensor:
        out, lse = ring_forward(spec, query, key, value)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        query, key, value, out, lse = ctx.saved_tensors
        grad_query, grad_key, grad_value = ring_backward(ctx.spec, grad_out, query, key, value, out, lse)
        return grad_query, grad_key, grad_value, None


def ring_attention(spec: RingSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Differentiable ring attention of this rank's ``(B, H, L, D)`` pieces (checked by the caller)."""
    # Self-attention on one tensor passes it three times; dynamo traces an autograd.Function only
    # with distinct inputs, and a view is a distinct tensor whose gradient flows to the same place.
    if key is query:
        key = key.view_as(key)
    if value is query or value is key:
        value = value.view_as(value)
    out: torch.Tensor = _RingAttentionFunction.apply(query, key, value, spec)
    return out
