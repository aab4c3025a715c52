"""as_strided, as_strided_copy and as_strided_scatter on DTensors (rank threads, 1-D mesh of 4).

The identity is an alias on any placements (no collective); replicated row-major DTensors run the
plain op locally (no collective); sharded row-major ones are gathered once (one all-gather) and give
plain torch's values on the full tensor. A gathered as_strided is a view of a copy: an in-place write
into it raises. A non-row-major sharded DTensor raises before any collective.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement
from shardwise.testing import run_on_threads

_WORLD = 4
_funcol = torch.ops._c10d_functional


def _full() -> torch.Tensor:
    return torch.arange(35, dtype=torch.float32).reshape(7, 5)


def _windows(placements: tuple[Placement, ...]) -> None:
    mesh = DeviceMesh("cpu", list(range(_WORLD)))
    full = _full()
    calls = [
        ((3, 4), (5, 2), 1),  # overlapping windows, an offset
        ((2, 2, 3), (10, 1, 5), 0),
        ((35,), (1,), 0),
    ]
    gathers_expected = 0 if placements[0].is_replicate() else 1
    for size, stride, offset in calls:
        dtensor = distribute_tensor(full, mesh, list(placements))
        with CommDebugMode() as comm:
            view = dtensor.as_strided(size, stride, offset)
            copied = torch.as_strided_copy(dtensor, size, stride, offset)
        assert isinstance(view, DTensor) and view.placements == (Replicate(),)
        torch.testing.assert_close(view.to_local(), full.as_strided(size, stride, offset))
        torch.testing.assert_close(copied.full_tensor(), full.as_strided(size, stride, offset))
        assert comm.get_comm_counts().get(_funcol.all_gather_into_tensor, 0) == 2 * gathers_expected
        assert comm.get_total_counts() == 2 * gathers_expected

    # The identity: an alias, no collective, the same placements.
    dtensor = distribute_tensor(full, mesh, list(placements))
    with CommDebugMode() as comm:
        same = dtensor.as_strided(dtensor.shape, dtensor.stride(), 0)
    assert comm.get_total_counts() == 0 and same.placements == dtensor.placements
    torch.testing.assert_close(same.full_tensor(), full)

    # scatter: src written into the storage positions of the whole tensor.
    source = distribute_tensor(torch.full((3, 4), -1.0), mesh, [Replicate()])
    scattered = torch.as_strided_scatter(dtensor, source, (3, 4), (5, 2), 1)
    torch.testing.assert_close(
        scattered.full_tensor(), torch.as_strided_scatter(full, torch.full((3, 4), -1.0), (3, 4), (5, 2), 1)
    )


@pytest.mark.parametrize("placements", [(Replicate(),), (Shard(0),), (Shard(1),)], ids=str)
def test_as_strided_family_matches_plain_torch(placements: tuple[Placement, ...]) -> None:
    run_on_threads(_windows, placements, world_size=_WORLD)


def _writes_and_layout_errors() -> None:
    mesh = DeviceMesh("cpu", list(range(_WORLD)))
    sharded = distribute_tensor(_full(), mesh, [Shard(0)])
    view = sharded.as_strided((3, 4), (5, 2), 1)
    with pytest.raises(RuntimeError, match="view of a DTensor whose view op had to redistribute its input"):
        view.fill_(0.0)

    transposed = distribute_tensor(_full(), mesh, [Shard(0)]).t()
    with CommDebugMode() as comm:
        with pytest.raises(RuntimeError, match="not row-major"):
            transposed.as_strided((2, 2), (1, 2), 0)
    assert comm.get_total_counts() == 0

    # Backward through a gathered window: overlapping elements collect every use, as in plain torch.
    leaf = distribute_tensor(_full(), mesh, [Shard(1)]).requires_grad_(True)
    window = leaf.as_strided((3, 4), (5, 2), 1)
    weights = distribute_tensor(torch.arange(12, dtype=torch.float32).reshape(3, 4), mesh, [Replicate()])
    (window * weights).sum().backward()
    reference = _full().requires_grad_(True)
    (reference.as_strided((3, 4), (5, 2), 1) * torch.arange(12, dtype=torch.float32).reshape(3, 4)).sum().backward()
    assert isinstance(leaf.grad, DTensor)
    torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)


def test_writes_into_a_gathered_window_raise_and_non_row_major_is_refused() -> None:
    run_on_threads(_writes_and_layout_errors, world_size=_WORLD)
