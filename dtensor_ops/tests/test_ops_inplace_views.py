"""In-place view ops on DTensors: squeeze_, unsqueeze_, t_, transpose_; and tril_/triu_ (rank threads, 1-D mesh of 4).

The DTensor keeps its identity and data, takes the shape plain torch gives the full tensor, and its
placements follow the moved dims; no collective runs. Squeezing a dim that is sharded raises the
in-place error before any collective. Uneven shards (5 rows on 4 ranks: one rank holds a single
row, one none) must not lose a dim that is only locally of size 1.
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

_STEPS: dict[str, Callable[[torch.Tensor], object]] = {
    "squeeze_dim": lambda t: t.squeeze_(1),
    "squeeze_all": lambda t: t.squeeze_(),
    "squeeze_dims": lambda t: t.squeeze_((1, 3)),
    "squeeze_not_singleton": lambda t: t.squeeze_(0),
    "unsqueeze_front": lambda t: t.unsqueeze_(0),
    "unsqueeze_back": lambda t: t.unsqueeze_(-1),
    "transpose": lambda t: t.transpose_(0, 2),
}


def _apply_and_compare(step: str, placements: tuple[Placement, ...]) -> None:
    mesh = DeviceMesh("cpu", list(range(_WORLD)))
    full = torch.arange(5 * 1 * 3 * 1, dtype=torch.float32).reshape(5, 1, 3, 1)
    expected = full.clone()
    _STEPS[step](expected)
    dtensor = distribute_tensor(full, mesh, list(placements))
    with CommDebugMode() as comm:
        returned = _STEPS[step](dtensor)
    assert returned is dtensor
    assert comm.get_total_counts() == 0
    assert dtensor.shape == expected.shape and dtensor.stride() == expected.stride()
    torch.testing.assert_close(dtensor.full_tensor(), expected)
    # Shards stay where they were: the shard's rows are the same data, under the moved dim index.
    if placements[0].is_shard():
        moved = {"transpose": {0: 2, 2: 0}}.get(step, {})
        original_dim = placements[0].dim  # type: ignore[attr-defined]
        assert dtensor.placements[0].is_shard()
        if step.startswith("squeeze") and step != "squeeze_not_singleton":
            assert dtensor.placements[0].dim < original_dim or original_dim == 0  # type: ignore[attr-defined]
        elif step == "unsqueeze_front":
            assert dtensor.placements[0].dim == original_dim + 1  # type: ignore[attr-defined]
        else:
            assert dtensor.placements[0].dim == moved.get(original_dim, original_dim)  # type: ignore[attr-defined]


@pytest.mark.parametrize("placements", [(Replicate(),), (Shard(0),), (Shard(2),)], ids=str)
@pytest.mark.parametrize("step", sorted(_STEPS))
def test_inplace_view_ops_change_the_dtensor_in_place(step: str, placements: tuple[Placement, ...]) -> None:
    run_on_threads(_apply_and_compare, step, placements, world_size=_WORLD)


def _t_and_chains_and_errors() -> None:
    mesh = DeviceMesh("cpu", list(range(_WORLD)))
    matrix = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    dtensor = distribute_tensor(matrix, mesh, [Shard(1)])
    dtensor.t_()
    assert dtensor.placements == (Shard(0),) and dtensor.shape == (6, 5)
    dtensor.unsqueeze_(1).squeeze_(1)
    torch.testing.assert_close(dtensor.full_tensor(), matrix.t())

    # A sharded singleton dim: one rank holds the element, three hold nothing; no placement of the
    # squeezed tensor says that, and an in-place op cannot move the data.
    row = distribute_tensor(torch.ones(1, 4), mesh, [Shard(0)])
    with CommDebugMode() as comm:
        with pytest.raises(RuntimeError, match=r"squeeze_\.dim.*in-place operations that require placement changes"):
            row.squeeze_(0)
    assert comm.get_total_counts() == 0
    assert row.shape == (1, 4) and row.placements == (Shard(0),)

    # Autograd: the gradient flows through the in-place view as through plain torch's.
    source = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]).requires_grad_(True)
    scaled = source * 3.0
    scaled.unsqueeze_(0)
    weights = torch.arange(24, dtype=torch.float32).reshape(1, 4, 6)
    (scaled.full_tensor() * weights).sum().backward()
    assert isinstance(source.grad, DTensor)
    torch.testing.assert_close(source.grad.full_tensor(), 3.0 * weights[0])


def test_t_chains_sharded_singletons_and_autograd() -> None:
    run_on_threads(_t_and_chains_and_errors, world_size=_WORLD)


# --------------------------------------------------------------------------- tril_ / triu_ (in place)


def _triangles_in_place(placements: tuple[Placement, ...]) -> None:
    mesh = DeviceMesh("cpu", list(range(_WORLD)))
    # 7 x 6: uneven row and column shards, so each rank's piece needs its own diagonal shift.
    full = torch.arange(42, dtype=torch.float32).reshape(7, 6) + 1.0
    for diagonal in (-2, 0, 1, 4):
        for name in ("tril", "triu"):
            dtensor = distribute_tensor(full, mesh, list(placements))
            source = distribute_tensor(full, mesh, list(placements))
            with CommDebugMode() as comm:
                returned = getattr(dtensor, f"{name}_")(diagonal)
                out_of_place = getattr(torch, name)(source, diagonal)
            assert returned is dtensor and dtensor.placements == placements
            assert comm.get_total_counts() == 0
            expected = getattr(torch, name)(full, diagonal)
            torch.testing.assert_close(dtensor.full_tensor(), expected)
            torch.testing.assert_close(out_of_place.full_tensor(), expected)


@pytest.mark.parametrize("placements", [(Replicate(),), (Shard(0),), (Shard(1),)], ids=str)
def test_tril_and_triu_in_place_shift_the_diagonal_per_shard(placements: tuple[Placement, ...]) -> None:
    run_on_threads(_triangles_in_place, placements, world_size=_WORLD)
