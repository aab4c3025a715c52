"""visualize_sharding: which rank holds which region of a 1-D or 2-D DTensor.

Every rank's region is computed locally from the layout rule
(:func:`shardwise.placement.compute_local_shape_and_global_offset`) for every
mesh coordinate, so nothing is communicated and every rank computes the same
table; the mesh's first rank prints it.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from shardwise.placement import Placement, compute_local_shape_and_global_offset

__all__ = ["visualize_sharding", "format_sharding_table"]

_Range = tuple[int, int]  # inclusive start and end of a region along one dim


def _range_label(prefix: str, span: _Range) -> str:
    return f"{prefix} {span[0]}-{span[1]}"


def _render_grid(header_row: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    rows = [list(header_row), *[list(row) for row in body]]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header_row))]
    border = "+" + "+".join("-" * (width + 2) for width in widths) + "+"

    def line(row: Sequence[str]) -> str:
        return "|" + "|".join(f" {cell:<{width}} " for cell, width in zip(row, widths)) + "|"

    return [border, line(rows[0]), border, *(line(row) for row in rows[1:]), border]


def format_sharding_table(
    global_shape: Sequence[int],
    mesh_ranks: torch.Tensor,
    placements: Sequence[Placement],
    device_type: str,
) -> str:
    """The sharding table for a tensor of ``global_shape`` laid out by ``placements``.

    ``mesh_ranks`` is the mesh as a tensor of global ranks (``DeviceMesh.mesh``).
    Rows and columns are inclusive index ranges of the global tensor (a 1-D tensor
    is one row); each cell lists the devices (``"<device_type>:<rank>"``) holding
    that region.  Ranks whose shard is empty are listed under the table.
    """
    ndim = len(global_shape)
    if ndim not in (1, 2):
        raise ValueError(
            f"visualize_sharding shows 1-D and 2-D tensors only; got a {ndim}-D tensor of shape {tuple(global_shape)}"
        )
    mesh_shape = tuple(mesh_ranks.shape)
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"got {len(placements)} placements {tuple(placements)} for a {len(mesh_shape)}-D mesh of shape "
            f"{mesh_shape}; expected one placement per mesh dim"
        )
    if any(size == 0 for size in global_shape):
        return f"(empty tensor of shape {tuple(global_shape)}: no elements to show)\n"

    holders: dict[tuple[_Range, _Range], list[int]] = {}
    empty_holders: list[int] = []
    for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
        local_shape, offset = compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)
        rank = int(mesh_ranks[coordinate].item())
        if any(size == 0 for size in local_shape):
            empty_holders.append(rank)
            continue
        spans = [(start, start + size - 1) for start, size in zip(offset, local_shape)]
        region = (spans[0], spans[1]) if ndim == 2 else ((0, 0), spans[0])
        holders.setdefault(region, []).append(rank)

    def devices(ranks: Sequence[int]) -> str:
        return ", ".join(f"{device_type}:{rank}" for rank in sorted(ranks))

    row_spans = sorted({rows for rows, _ in holders})
    col_spans = sorted({cols for _, cols in holders})
    header_row = ["", *(_range_label("Col", cols) for cols in col_spans)]
    body = [
        [_range_label("Row", rows), *(devices(holders.get((rows, cols), [])) for cols in col_spans)]
        for rows in row_spans
    ]
    lines = _render_grid(header_row, body)
    partial_dims = [str(mesh_dim) for mesh_dim, placement in enumerate(placements) if placement.is_partial()]
    if partial_dims:
        lines.append(
            f"values are partial over mesh dim(s) {', '.join(partial_dims)}: each device listed in a cell "
            f"holds one term of that region's reduction"
        )
    if empty_holders:
        lines.append(f"holding no elements: {devices(empty_holders)}")
    return "\n".join(lines) + "\n"


def visualize_sharding(dtensor: torch.Tensor, header: str = "") -> None:
    """Print which device holds which region of a 1-D or 2-D DTensor.

    Printed once, by the first rank of the DTensor's mesh (``header`` first, when
    given); ranks outside the mesh print nothing.  No collectives are issued.
    """
    mesh = getattr(dtensor, "device_mesh", None)
    placements = getattr(dtensor, "placements", None)
    if mesh is None or placements is None:
        raise TypeError(
            f"visualize_sharding expects a DTensor (with device_mesh and placements); got {type(dtensor).__name__}"
        )
    mesh_ranks: torch.Tensor = mesh.mesh
    table = format_sharding_table(tuple(dtensor.shape), mesh_ranks, tuple(placements), str(mesh.device_type))
    if mesh.get_coordinate() is None:
        return
    first_rank = int(mesh_ranks.flatten()[0].item())
    rank = mesh.get_rank()
    # Under torch's LocalTensorMode the rank is every simulated rank (a SymInt): print once.
    if isinstance(rank, int) and rank != first_rank:
        return
    if header:
        print(header)
    print(table, end="")
