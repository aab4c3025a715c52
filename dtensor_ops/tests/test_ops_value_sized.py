"""Ops whose output size depends on the values (rank threads, 1-D mesh of 4): nonzero, masked_select,
unique, repeat_interleave with tensor repeats, boolean-mask indexing and index_put with a mask.

They run on the whole tensors: each sharded input is gathered once (one all-gather per sharded
input, counted), the result is replicated and equals plain torch's on the full tensors. A mask
write into a sharded DTensor raises before any collective; into a replicated one it writes in place.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement
from shardwise.testing import run_on_threads

_WORLD = 4
_funcol = torch.ops._c10d_functional


def _values() -> torch.Tensor:
    # 7 rows: uneven on 4 ranks (2, 2, 2, 1); zeros, repeats and negatives for nonzero/unique/masks.
    return torch.tensor([[0.0, 1.5, -2.0], [3.0, 0.0, 3.0], [1.5, 1.5, 0.0], [-2.0, 4.0, 5.0],
                         [0.0, 0.0, 0.0], [7.0, -1.0, 1.5], [2.0, 2.0, 0.0]])  # fmt: skip


_CASES: dict[str, Callable[[torch.Tensor], object]] = {
    "nonzero": lambda t: torch.nonzero(t),
    "masked_select": lambda t: torch.masked_select(t, t > 1.0),
    "mask_getitem": lambda t: t[t[:, 0] > 0.5],
    "unique": lambda t: torch.unique(t, return_inverse=True, return_counts=True),
    "unique_dim": lambda t: torch.unique(t, dim=1),
    "unique_consecutive": lambda t: torch.unique_consecutive(t.flatten(), return_counts=True),
    "repeat_interleave": lambda t: torch.repeat_interleave(t, (t[:, 0].abs() % 3).long(), dim=0),
    # One value through a mask is elementwise (the indexing rule's case); a 1-element vector is broadcast
    # over the selected places, in mask order (this handler's case).
    "index_put_mask_scalar": lambda t: torch.index_put(t, (t > 2.0,), torch.tensor(-9.0)),
    "index_put_mask_vector": lambda t: torch.index_put(t, (t > 2.0,), torch.tensor([-9.0])),
    # residuals only for a full-rank input: value-sized
    "lstsq_full_rank": lambda t: torch.linalg.lstsq(t, t[:, :2] * 2.0 + 1.0, driver="gelsd"),
    "lstsq_rank_deficient": lambda t: torch.linalg.lstsq(t[:, :2].repeat(1, 2), t[:, 2:], driver="gelsd"),
}


def _flat(value: object) -> list[torch.Tensor]:
    return list(value) if isinstance(value, tuple) else [value]  # type: ignore[list-item]


def _compare(case: str, placements: tuple[Placement, ...]) -> None:
    mesh = DeviceMesh("cpu", list(range(_WORLD)))
    expected = _flat(_CASES[case](_values()))
    source = distribute_tensor(_values(), mesh, list(placements))
    with CommDebugMode() as comm:
        actual = _flat(_CASES[case](source))
    for got, want in zip(actual, expected, strict=True):
        assert isinstance(got, DTensor)
        torch.testing.assert_close(got.full_tensor(), want)
    if placements[0].is_replicate():
        assert comm.get_total_counts() == 0
    elif case in _DIRECT:
        # The value-sized op itself: replicated outputs, and only gathers (of the input and, for
        # masked_select / index_put, of the mask made from it by a pointwise op that keeps it sharded).
        assert all(got.placements == (Replicate(),) for got in actual)  # type: ignore[union-attr]
        gathers = comm.get_comm_counts().get(_funcol.all_gather_into_tensor, 0)
        assert gathers == _DIRECT[case] and comm.get_total_counts() == gathers


# Cases that are the value-sized op itself (the others reach it through torch's decompositions, whose
# other ops may choose other layouts): the number of all-gathers of a sharded input.
_DIRECT = {"nonzero": 1, "masked_select": 2, "unique": 1, "unique_dim": 1, "index_put_mask_vector": 2}


@pytest.mark.parametrize("placements", [(Replicate(),), (Shard(0),), (Shard(1),)], ids=str)
@pytest.mark.parametrize("case", sorted(_CASES))
def test_value_sized_ops_run_on_the_whole_tensors(case: str, placements: tuple[Placement, ...]) -> None:
    run_on_threads(_compare, case, placements, world_size=_WORLD)


def _exact_gathers_and_writes() -> None:
    mesh = DeviceMesh("cpu", list(range(_WORLD)))
    values = _values()
    source = distribute_tensor(values, mesh, [Shard(0)])
    mask = distribute_tensor(values > 1.0, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        selected = torch.masked_select(source, mask)
    assert comm.get_comm_counts() == {_funcol.all_gather_into_tensor: 2}
    torch.testing.assert_close(selected.full_tensor(), torch.masked_select(values, values > 1.0))

    # Writing a vector through a mask (consumed in mask order) into a sharded DTensor: refused before any
    # collective. (A single value through a mask is elementwise and stays sharded: the indexing rule's case.)
    selects = int((values > 2.0).sum())
    new_values = distribute_tensor(-torch.arange(selects, dtype=torch.float32), mesh, [Replicate()])
    with CommDebugMode() as comm:
        with pytest.raises(RuntimeError, match="boolean .mask. index writes into a DTensor with placements"):
            source[source > 2.0] = new_values
    assert comm.get_total_counts() == 0
    torch.testing.assert_close(source.full_tensor(), values)

    # Into a replicated one: written in place on every rank.
    replicated = distribute_tensor(values, mesh, [Replicate()])
    replicated[replicated > 2.0] = new_values
    expected = values.clone()
    expected[expected > 2.0] = -torch.arange(selects, dtype=torch.float32)
    torch.testing.assert_close(replicated.to_local(), expected)

    # A mask of the wrong shape: torch's error, before the gather.
    wrong_mask = distribute_tensor(values[:3] > 1.0, mesh, [Replicate()])
    with CommDebugMode() as comm:
        with pytest.raises(IndexError, match="shape of the mask"):
            source[wrong_mask]
    assert comm.get_total_counts() == 0

    # Backward through a mask read: the gradient lands at the selected places, with the input's shape.
    leaf = distribute_tensor(values, mesh, [Shard(0)]).requires_grad_(True)
    picked = torch.masked_select(leaf, mask)
    weights = distribute_tensor(torch.arange(picked.shape[0], dtype=torch.float32), mesh, [Replicate()])
    (picked * weights).sum().backward()
    reference = values.clone().requires_grad_(True)
    picked_ref = torch.masked_select(reference, values > 1.0)
    (picked_ref * torch.arange(picked_ref.shape[0], dtype=torch.float32)).sum().backward()
    assert isinstance(leaf.grad, DTensor)
    torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)


def test_exact_gathers_mask_writes_and_backward() -> None:
    run_on_threads(_exact_gathers_and_writes, world_size=_WORLD)
