"""Convolution with a sharded spatial dim: a halo exchange, then a local convolution.

PyTorch's DTensor convolves each spatial shard alone (wrong values at the shard edges); the
convolution rule (``_ops/spatial.py``) replicates the input instead (right, but every rank then
holds the whole input). This handler keeps the spatial dim sharded: the output is laid out as
``Shard(d)`` over the same mesh dim (``torch.chunk`` layout of the output length); each rank
needs the input rows its output rows read (its window, ``(k - 1) * dilation`` rows wider than
its share times the stride), and ONE ``all_to_all_single`` over that mesh dim moves exactly the
rows each rank needs from each rank that holds them (uneven shards, windows wider than a
neighbour's shard and empty shards included). Rows outside the input are the zero padding, added
locally; the local convolution then runs with no padding on that dim.

Handled: a non-transposed ``convolution`` whose input has exactly one ``Shard`` placement, on a
spatial dim (2 or later, batched input), every other placement of every argument ``Replicate``
(weight and bias are never sharded here). Anything else goes to the rule (``NotImplemented``).
The backward runs through ``convolution_backward``'s rule.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.mesh import DeviceMesh
from shardwise.mesh._simulation import run_for_each_simulated_rank
from shardwise.placement import DTensorSpec, Replicate, Shard, TensorMeta, contiguous_strides

from .._collectives import launch_all_to_all_exact, mesh_dim_group_name, wait
from .._dtensor import DTensor, new_dtensor
from .._op_handlers import OpHandler

__all__ = ["CONV_HALO_HANDLERS"]

aten = torch.ops.aten


def _chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of ``torch.chunk``'s pieces of ``length`` rows in ``parts`` (trailing ones may be empty)."""
    size = -(-length // parts) if length else 0
    return [(min(index * size, length), min((index + 1) * size, length)) for index in range(parts)]


def _replicated(spec: DTensorSpec[DeviceMesh]) -> bool:
    return all(placement.is_replicate() for placement in spec.placements)


def _sharded_spatial_dim(x: DTensor) -> tuple[int, int] | None:
    """(tensor dim, mesh dim) of the input's one spatial shard, or None when the call is not the handled case."""
    shards = [(mesh_dim, p) for mesh_dim, p in enumerate(x._spec.placements) if not p.is_replicate()]
    if len(shards) != 1:
        return None
    mesh_dim, placement = shards[0]
    # Exactly Shard (a _StridedShard's rows are not contiguous ranges).
    if type(placement) is not Shard:
        return None
    dim = placement.dim % x.ndim
    return (dim, mesh_dim) if dim >= 2 else None


def _halo_convolution(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if kwargs or len(args) != 9:
        return NotImplemented
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args
    if transposed or not isinstance(x, DTensor) or not isinstance(weight, DTensor) or x.ndim != weight.ndim:
        return NotImplemented
    if not _replicated(weight._spec) or (bias is not None and not (isinstance(bias, DTensor) and _replicated(bias._spec))):
        return NotImplemented
    where = _sharded_spatial_dim(x)
    if where is None:
        return NotImplemented
    dim, mesh_dim = where
    mesh = x._spec.mesh
    spatial = dim - 2
    step, pad, spread = int(stride[spatial]), int(padding[spatial]), int(dilation[spatial])
    kernel = weight.shape[dim]
    length = x.shape[dim]

    # The global output shape (and torch's argument errors) from a meta run, before any collective.
    def meta(t: DTensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    global_out = aten.convolution.default(
        meta(x), meta(weight), None if bias is None else meta(bias), stride, padding, dilation, False, output_padding, groups
    )
    out_length = global_out.shape[dim]

    parts = mesh.size(mesh_dim)
    held = _chunk_bounds(length, parts)
    produced = _chunk_bounds(out_length, parts)
    reach = spread * (kernel - 1)

    def window(rank: int) -> tuple[int, int]:
        """The input rows (before padding: may start below 0 or end past ``length``) rank's output reads."""
        first, last = produced[rank]
        if first == last:
            return (0, 0)
        return (first * step - pad, (last - 1) * step - pad + reach + 1)

    def needed(rank: int) -> tuple[int, int]:
        low, high = window(rank)
        return (max(low, 0), min(high, length)) if high > low else (0, 0)

    def my_index() -> int:
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "a rank outside the mesh holds no shard to convolve"
        return coordinate[mesh_dim]

    def send_buffer(x_local: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """The rows this rank sends each member, and the all-to-all's element counts."""
        me = my_index()
        local = x_local.movedim(dim, 0)
        inner = int(torch.Size(local.shape[1:]).numel())
        send_pieces: list[torch.Tensor] = []
        input_splits: list[int] = []
        output_splits: list[int] = []
        my_start, my_end = held[me]
        my_low, my_high = needed(me)
        for rank in range(parts):
            low, high = needed(rank)
            first, last = max(my_start, low), min(my_end, high)
            rows = max(last - first, 0)
            send_pieces.append(local[first - my_start : first - my_start + rows].reshape(-1))
            input_splits.append(rows * inner)
            their_start, their_end = held[rank]
            output_splits.append(max(min(their_end, my_high) - max(their_start, my_low), 0) * inner)
        flat = torch.cat(send_pieces) if send_pieces else local.reshape(-1)[:0]
        return flat, input_splits, output_splits

    def convolve(
        received: torch.Tensor, x_local: torch.Tensor, weight_local: torch.Tensor, bias_local: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's output rows from the window rows it received."""
        me = my_index()
        local = x_local.movedim(dim, 0)
        my_low, my_high = needed(me)
        out_shape = list(global_out.shape)
        first_out, last_out = produced[me]
        out_shape[dim] = last_out - first_out
        if first_out == last_out:
            return torch.zeros(out_shape, dtype=global_out.dtype, device=x_local.device)
        window_rows = received.reshape(my_high - my_low, *local.shape[1:])
        low, high = window(me)
        before, after = my_low - low, high - my_high
        if before or after:
            # The zero padding of the whole input, where this rank's window reaches past its ends.
            zeros = [window_rows.new_zeros((count, *window_rows.shape[1:])) for count in (before, after)]
            window_rows = torch.cat([zeros[0], window_rows, zeros[1]])
        piece = window_rows.movedim(0, dim)
        local_padding = list(padding)
        local_padding[spatial] = 0
        convolved: torch.Tensor = aten.convolution.default(
            piece, weight_local, bias_local, stride, local_padding, dilation, False, output_padding, groups
        )
        return convolved.contiguous()

    # Per simulated rank under torch's LocalTensorMode (each rank's rows, one all-to-all for all); plain calls otherwise.
    flat, input_splits, output_splits = run_for_each_simulated_rank(send_buffer, x._local_tensor)
    received = wait(launch_all_to_all_exact(flat, output_splits, input_splits, mesh_dim_group_name(mesh, mesh_dim)))
    result = run_for_each_simulated_rank(
        convolve, received, x._local_tensor, weight._local_tensor, None if bias is None else bias._local_tensor
    )
    spec = DTensorSpec(
        mesh,
        tuple(Shard(dim) if index == mesh_dim else Replicate() for index in range(mesh.ndim)),
        TensorMeta(global_out.shape, contiguous_strides(global_out.shape), global_out.dtype),
    )
    return new_dtensor(result, spec)


CONV_HALO_HANDLERS: dict[torch._ops.OpOverload, OpHandler] = {aten.convolution.default: _halo_convolution}
