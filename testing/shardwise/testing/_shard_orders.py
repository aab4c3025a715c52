"""Shard-order helpers with PyTorch's ``common_dtensor`` names (distribute and redistribute in a given order).

A shard order (``ShardOrderEntry(tensor_dim, mesh_dims)``) says in which order several mesh dims cut
one tensor dim; see ``shardwise.placement._shard_order``. These helpers build DTensors whose spec
carries an explicit order, for tests that compare layouts across orders.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Mapping, Sequence

import torch

from shardwise.dtensor_ops import DTensor, distribute_tensor
from shardwise.dtensor_ops._plan_executor import redistribute_local_tensor
from shardwise.placement import DTensorSpec, Placement, Replicate, Shard, ShardOrder, ShardOrderEntry

__all__ = [
    "_convert_shard_order_dict_to_ShardOrder",
    "generate_shard_orders",
    "patched_distribute_tensor",
    "redistribute",
    "shard_order_to_placement",
]


def _convert_shard_order_dict_to_ShardOrder(shard_order: Mapping[int, Sequence[int]]) -> ShardOrder:
    """``{tensor_dim: mesh dims in order}`` -> a ShardOrder (entries in the mapping's order)."""
    return tuple(ShardOrderEntry(tensor_dim, tuple(mesh_dims)) for tensor_dim, mesh_dims in shard_order.items())


def shard_order_to_placement(shard_order: ShardOrder | None, mesh: Any) -> tuple[Placement, ...]:
    """The ``Shard``/``Replicate`` placements a shard order implies (every unnamed mesh dim replicates)."""
    placements: list[Placement] = [Replicate() for _ in range(mesh.ndim)]
    for tensor_dim, mesh_dims in shard_order or ():
        for mesh_dim in mesh_dims:
            placements[mesh_dim] = Shard(tensor_dim)
    return tuple(placements)


def generate_shard_orders(mesh: Any, tensor_rank: int) -> Iterator[ShardOrder]:
    """Every shard order that cuts the tensor by all of ``mesh``'s dims: each mesh dim given to a tensor dim, in any order."""
    mesh_dims = range(mesh.ndim)
    for owners in itertools.product(range(tensor_rank), repeat=mesh.ndim):
        groups = [[m for m in mesh_dims if owners[m] == tensor_dim] for tensor_dim in range(tensor_rank)]
        used = [(tensor_dim, group) for tensor_dim, group in enumerate(groups) if group]
        for orders in itertools.product(*(itertools.permutations(group) for _, group in used)):
            yield tuple(ShardOrderEntry(tensor_dim, order) for (tensor_dim, _), order in zip(used, orders))


def _spec_for(dtensor: DTensor, mesh: Any, placements: Sequence[Placement] | None, shard_order: ShardOrder | None) -> DTensorSpec[Any]:
    if placements is None:
        placements = shard_order_to_placement(shard_order, mesh)
    return DTensorSpec(mesh, tuple(placements), dtensor._spec.tensor_meta, shard_order=shard_order or None)


def redistribute(
    dtensor_input: DTensor,
    device_mesh: Any,
    placements: Sequence[Placement] | None,
    shard_order: ShardOrder | None,
    use_graph_based_transform: bool = True,
) -> DTensor:
    """``dtensor_input`` laid out as ``placements`` cut in ``shard_order`` (forward only; ``()``/None: the default order)."""
    target = _spec_for(dtensor_input, device_mesh, placements, shard_order)
    if target == dtensor_input._spec:
        return dtensor_input
    local = redistribute_local_tensor(dtensor_input.to_local(), dtensor_input._spec, target)
    return DTensor(local, target, requires_grad=dtensor_input.requires_grad)


def patched_distribute_tensor(
    input_tensor: torch.Tensor,
    device_mesh: Any,
    placements: Sequence[Placement] | None,
    shard_order: ShardOrder | None,
    use_graph_based_transform: bool = True,
    src_data_rank: int | None = 0,
) -> DTensor:
    """``distribute_tensor`` with the tensor dims cut in ``shard_order`` (scattered straight into that layout)."""
    if placements is None:
        placements = shard_order_to_placement(shard_order, device_mesh)
    placements = tuple(placements)
    spec_order = shard_order or None
    layout = DTensorSpec(device_mesh, placements, None, shard_order=spec_order).layout_placements
    laid_out = distribute_tensor(input_tensor, device_mesh, layout, src_data_rank=src_data_rank)
    target = DTensorSpec(device_mesh, placements, laid_out._spec.tensor_meta, shard_order=spec_order)
    return DTensor(laid_out.to_local(), target, requires_grad=input_tensor.requires_grad)
