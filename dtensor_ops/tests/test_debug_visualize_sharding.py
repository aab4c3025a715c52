"""visualize_sharding: the layout table (pure, no processes) and what ranks print (4 ranks)."""

from __future__ import annotations

import contextlib
import io
from typing import Sequence

import pytest
import torch
import torch.distributed as dist

from shardwise.dtensor_ops import distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import format_sharding_table, visualize_sharding
from shardwise.placement import Partial, Placement, Replicate, Shard
from shardwise.testing import multi_rank

RANKS_1D = torch.arange(4)
RANKS_2X2 = torch.arange(4).reshape(2, 2)


def _table(shape: Sequence[int], ranks: torch.Tensor, placements: Sequence[Placement], device: str = "cpu") -> str:
    return format_sharding_table(shape, ranks, placements, device)


def test_rows_sharded_over_four_ranks() -> None:
    assert _table((8, 4), RANKS_1D, [Shard(0)]) == (
        "+---------+---------+\n"
        "|         | Col 0-3 |\n"
        "+---------+---------+\n"
        "| Row 0-1 | cpu:0   |\n"
        "| Row 2-3 | cpu:1   |\n"
        "| Row 4-5 | cpu:2   |\n"
        "| Row 6-7 | cpu:3   |\n"
        "+---------+---------+\n"
    )


def test_columns_sharded_over_four_ranks() -> None:
    assert _table((4, 8), RANKS_1D, [Shard(1)]) == (
        "+---------+---------+---------+---------+---------+\n"
        "|         | Col 0-1 | Col 2-3 | Col 4-5 | Col 6-7 |\n"
        "+---------+---------+---------+---------+---------+\n"
        "| Row 0-3 | cpu:0   | cpu:1   | cpu:2   | cpu:3   |\n"
        "+---------+---------+---------+---------+---------+\n"
    )


def test_negative_shard_dim_counts_from_the_end() -> None:
    assert _table((4, 8), RANKS_1D, [Shard(-1)]) == _table((4, 8), RANKS_1D, [Shard(1)])


def test_replicated_tensor_is_one_cell_held_by_every_rank() -> None:
    assert _table((4, 4), RANKS_1D, [Replicate()]) == (
        "+---------+----------------------------+\n"
        "|         | Col 0-3                    |\n"
        "+---------+----------------------------+\n"
        "| Row 0-3 | cpu:0, cpu:1, cpu:2, cpu:3 |\n"
        "+---------+----------------------------+\n"
    )


def test_two_dim_mesh_sharding_both_tensor_dims() -> None:
    assert _table((4, 4), RANKS_2X2, [Shard(0), Shard(1)]) == (
        "+---------+---------+---------+\n"
        "|         | Col 0-1 | Col 2-3 |\n"
        "+---------+---------+---------+\n"
        "| Row 0-1 | cpu:0   | cpu:1   |\n"
        "| Row 2-3 | cpu:2   | cpu:3   |\n"
        "+---------+---------+---------+\n"
    )


def test_two_dim_mesh_replicated_on_the_first_dim() -> None:
    # Mesh dim 0 replicates, mesh dim 1 shards rows: ranks 0 and 2 (mesh column 0) share rows 0-1.
    assert _table((4, 6), RANKS_2X2, [Replicate(), Shard(0)]) == (
        "+---------+--------------+\n"
        "|         | Col 0-5      |\n"
        "+---------+--------------+\n"
        "| Row 0-1 | cpu:0, cpu:2 |\n"
        "| Row 2-3 | cpu:1, cpu:3 |\n"
        "+---------+--------------+\n"
    )


def test_two_mesh_dims_sharding_one_tensor_dim_nest_left_to_right() -> None:
    assert _table((4, 4), RANKS_2X2, [Shard(0), Shard(0)]) == (
        "+---------+---------+\n"
        "|         | Col 0-3 |\n"
        "+---------+---------+\n"
        "| Row 0-0 | cpu:0   |\n"
        "| Row 1-1 | cpu:1   |\n"
        "| Row 2-2 | cpu:2   |\n"
        "| Row 3-3 | cpu:3   |\n"
        "+---------+---------+\n"
    )


def test_mesh_ranks_in_any_order_are_placed_by_coordinate() -> None:
    permuted = torch.tensor([[3, 1], [2, 0]])
    assert _table((4, 4), permuted, [Shard(0), Shard(1)], device="cuda") == (
        "+---------+---------+---------+\n"
        "|         | Col 0-1 | Col 2-3 |\n"
        "+---------+---------+---------+\n"
        "| Row 0-1 | cuda:3  | cuda:1  |\n"
        "| Row 2-3 | cuda:2  | cuda:0  |\n"
        "+---------+---------+---------+\n"
    )


def test_one_dim_tensor_is_a_single_row() -> None:
    assert _table((8,), RANKS_1D, [Shard(0)]) == (
        "+---------+---------+---------+---------+---------+\n"
        "|         | Col 0-1 | Col 2-3 | Col 4-5 | Col 6-7 |\n"
        "+---------+---------+---------+---------+---------+\n"
        "| Row 0-0 | cpu:0   | cpu:1   | cpu:2   | cpu:3   |\n"
        "+---------+---------+---------+---------+---------+\n"
    )


def test_uneven_shards_list_the_ranks_holding_nothing() -> None:
    # torch.chunk rule: 3 rows over 4 ranks gives 1, 1, 1 and an empty last shard.
    assert _table((3, 4), RANKS_1D, [Shard(0)]) == (
        "+---------+---------+\n"
        "|         | Col 0-3 |\n"
        "+---------+---------+\n"
        "| Row 0-0 | cpu:0   |\n"
        "| Row 1-1 | cpu:1   |\n"
        "| Row 2-2 | cpu:2   |\n"
        "+---------+---------+\n"
        "holding no elements: cpu:3\n"
    )


def test_partial_placement_is_called_out() -> None:
    table = _table((2, 2), RANKS_2X2, [Partial(), Shard(1)])
    assert table.splitlines()[3] == "| Row 0-1 | cpu:0, cpu:2 | cpu:1, cpu:3 |"
    assert table.splitlines()[-1].startswith("values are partial over mesh dim(s) 0:")


def test_empty_tensor_has_nothing_to_show() -> None:
    assert _table((0, 2), RANKS_1D, [Shard(0)]) == "(empty tensor of shape (0, 2): no elements to show)\n"


def test_more_than_two_dims_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"1-D and 2-D tensors only; got a 3-D tensor of shape \(2, 2, 2\)"):
        _table((2, 2, 2), RANKS_1D, [Shard(0)])


def test_placements_must_match_the_mesh() -> None:
    with pytest.raises(ValueError, match=r"got 1 placements .* for a 2-D mesh of shape \(2, 2\)"):
        _table((4, 4), RANKS_2X2, [Shard(0)])


def test_visualize_sharding_rejects_a_plain_tensor() -> None:
    with pytest.raises(TypeError, match="expects a DTensor .* got Tensor"):
        visualize_sharding(torch.ones(2, 2))


# ------------------------------------------------------------------ on ranks


def _printed(dtensor: torch.Tensor, header: str = "") -> str:
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        visualize_sharding(dtensor, header=header)
    return captured.getvalue()


@multi_rank(world_size=4)
def test_first_mesh_rank_prints_header_and_table() -> None:
    mesh = init_device_mesh("cpu", (4,))
    for placements, shape in (([Shard(0)], (8, 4)), ([Shard(1)], (4, 8)), ([Replicate()], (4, 4))):
        dtensor = distribute_tensor(torch.zeros(shape), mesh, placements)
        printed = _printed(dtensor, header=f"{placements}")
        if dist.get_rank() == 0:
            assert printed == f"{placements}\n" + _table(shape, RANKS_1D, placements)
        else:
            assert printed == ""


def _cells(table: str) -> dict[int, tuple[slice, slice]]:
    """Parse a printed table into {rank: (row slice, column slice)} for single-rank cells."""
    lines = [line for line in table.splitlines() if line.startswith("|")]

    def spans(cells: list[str], prefix: str) -> list[slice]:
        bounds = [cell.removeprefix(prefix).split("-") for cell in cells]
        return [slice(int(start), int(end) + 1) for start, end in bounds]

    header, *body = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    columns = spans(header[1:], "Col ")
    regions: dict[int, tuple[slice, slice]] = {}
    for row in body:
        (rows,) = spans(row[:1], "Row ")
        for cols, holder in zip(columns, row[1:]):
            regions[int(holder.removeprefix("cpu:"))] = (rows, cols)
    return regions


@multi_rank(world_size=4)
def test_two_dim_mesh_table_matches_what_each_rank_holds() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(24.0).reshape(4, 6)
    dtensor = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    printed = _printed(dtensor)
    locals_by_rank: list[torch.Tensor | None] = [None] * 4
    dist.all_gather_object(locals_by_rank, dtensor.to_local())
    if dist.get_rank() != 0:
        assert printed == ""
        return
    assert printed == _table((4, 6), RANKS_2X2, [Shard(0), Shard(1)])
    regions = _cells(printed)
    assert sorted(regions) == [0, 1, 2, 3]
    for rank, (rows, cols) in regions.items():
        local = locals_by_rank[rank]
        assert local is not None
        assert torch.equal(local, full[rows, cols]), rank


@multi_rank(world_size=4)
def test_sub_mesh_is_printed_by_its_own_first_rank() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_mesh = mesh["tp"]  # ranks [0, 1] or [2, 3]
    dtensor = distribute_tensor(torch.zeros(2, 4), tp_mesh, [Shard(1)])
    printed = _printed(dtensor, header="tp")
    rank = dist.get_rank()
    first = 2 * (rank // 2)
    if rank == first:
        assert printed == "tp\n" + _table((2, 4), torch.tensor([first, first + 1]), [Shard(1)])
    else:
        assert printed == ""
