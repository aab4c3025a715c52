"""A lower bound on the bytes any algorithm must move for a redistribution (what plans are measured against)."""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from shardwise.placement import Partial, Placement, compute_local_shape_and_global_offset, holds_same_values

from .steps import _LINEAR_REDUCE_OPS, Placements, _all_coordinates, _check_problem

def _partials_compatible(src: Placement, dst: Placement) -> bool:
    """Whether ``src`` Partial values can become ``dst`` Partial values without talking to anyone.

    Same op: nothing to do.  sum <-> avg: scale by the mesh dim size.  (The planner does
    not take the second route — it changes a Partial's op only through Replicate or
    Shard — but a lower bound must hold for any algorithm.)
    """
    return (
        isinstance(src, Partial)
        and isinstance(dst, Partial)
        and (holds_same_values(src, dst) or (src.reduce_op in _LINEAR_REDUCE_OPS and dst.reduce_op in _LINEAR_REDUCE_OPS))
    )


def lower_bound_bytes_per_rank(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
) -> int:
    """A lower bound on the bytes that the most loaded rank must receive, for any algorithm.

    Mesh dims that are Partial in both ``src`` and ``dst`` with compatible ops (equal, or
    sum/avg) need no reduction and split the problem into independent slices.  In a
    slice, every element of the global tensor has ``k`` distinct contributions (the
    product of the sizes of the other source Partial dims) and must reach ``m`` *target
    groups*: the ranks whose target shard contains it, grouped by their coordinates off
    the target's Partial dims (a group only needs the element as a decomposition over
    its members, so one copy inside the group is enough).  Then:

    * with ``k == 1``, every group that has no member already holding it receives it once;
    * with ``k > 1``, combining the contributions takes ``k - 1`` transfers and handing
      the result to the other groups ``m - 1`` more.

    The bound is ``max(total transfers / number of ranks, max over ranks of the elements
    it needs alone and does not hold in final form) * itemsize``, where "alone" means
    the rank's target group is just itself.  It is exact for the basic 1-D transitions
    with even shapes (all-gather, reduce-scatter, all-reduce, all-to-all) and a floor
    for everything else.
    """
    src, dst = tuple(src), tuple(dst)
    _check_problem(global_shape, mesh_shape, src, dst, itemsize)
    mesh_dims = range(len(mesh_shape))
    kept_partial = [d for d in mesh_dims if _partials_compatible(src[d], dst[d])]
    reduced_partial = [d for d in mesh_dims if isinstance(src[d], Partial) and d not in kept_partial]
    target_partial = [d for d in mesh_dims if isinstance(dst[d], Partial) and d not in kept_partial]
    group_coordinate_dims = [d for d in mesh_dims if d not in kept_partial and d not in target_partial]
    contributions = math.prod(mesh_shape[d] for d in reduced_partial)
    target_group_size = math.prod(mesh_shape[d] for d in target_partial)

    coordinates = _all_coordinates(mesh_shape)
    src_boxes = [compute_local_shape_and_global_offset(global_shape, mesh_shape, c, src) for c in coordinates]
    dst_boxes = [compute_local_shape_and_global_offset(global_shape, mesh_shape, c, dst) for c in coordinates]

    # Cut every tensor dim at every shard boundary: inside a cell, who holds and who
    # needs an element does not change.
    cuts: list[list[int]] = []
    for tensor_dim, extent in enumerate(global_shape):
        points = {0, extent}
        for shape, offset in src_boxes + dst_boxes:
            if shape[tensor_dim] > 0:
                points.update((offset[tensor_dim], offset[tensor_dim] + shape[tensor_dim]))
        cuts.append(sorted(points))
    cells_per_dim = [[(a, b) for a, b in zip(points, points[1:]) if b > a] for points in cuts]

    def contains(box: tuple[tuple[int, ...], tuple[int, ...]], cell: Sequence[tuple[int, int]]) -> bool:
        shape, offset = box
        return all(offset[d] <= start and end <= offset[d] + shape[d] for d, (start, end) in enumerate(cell))

    total_transfers = 0
    missing_per_rank = [0] * len(coordinates)
    for cell in itertools.product(*cells_per_dim):
        elements = math.prod(end - start for start, end in cell)
        # slice -> target group -> (members, whether a member holds the element)
        slices: dict[tuple[int, ...], dict[tuple[int, ...], tuple[list[int], list[bool]]]] = {}
        for rank, coordinate in enumerate(coordinates):
            if not contains(dst_boxes[rank], cell):
                continue
            groups = slices.setdefault(tuple(coordinate[d] for d in kept_partial), {})
            members, holds = groups.setdefault(tuple(coordinate[d] for d in group_coordinate_dims), ([], [False]))
            members.append(rank)
            if contributions == 1 and contains(src_boxes[rank], cell):
                holds[0] = True
        for groups in slices.values():
            if contributions > 1:
                total_transfers += elements * (contributions - 1 + len(groups) - 1)
                needy = [members for members, _ in groups.values()]
            else:
                needy = [members for members, holds in groups.values() if not holds[0]]
                total_transfers += elements * len(needy)
            if target_group_size == 1:
                for members in needy:
                    for rank in members:
                        missing_per_rank[rank] += elements
    average = -(-total_transfers // len(coordinates))
    return max(average, max(missing_per_rank, default=0)) * itemsize

