"""Random ops on ``_StridedShard`` layouts (FSDP over TP: ``(_StridedShard(d, sf=tp), Shard(d))``), 4 gloo ranks.

torchtitan initialises such parameters in place (``normal_``, ``uniform_``, ``trunc_normal_``) after
``fully_shard``.  Our random engine draws per *shard stream* (README, "Random ops"): a strided mesh dim
picks the stream by its coordinate like a ``Shard`` one.  What must hold, as for plain shards: no
communication, the placements kept, ranks holding the same piece draw equal values, different pieces
different ones, generators in step, the same seed reproduces the values; and where the strided layout
is the plain one (its mesh dim has size 1), exactly the plain layout's values.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops._shard_rng import _largest_shard_numel
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, _StridedShard
from shardwise.testing import multi_rank

FILLS: dict[str, Callable[[torch.Tensor], object]] = {
    "normal_": lambda t: t.normal_(0.0, 0.02),
    "uniform_": lambda t: t.uniform_(-1.0, 1.0),
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02, a=-0.04, b=0.04),
}


def gather(value: object) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def dt(value: object) -> DTensor:
    assert isinstance(value, DTensor), f"expected a DTensor, got {type(value).__name__}"
    return value


def generator_states_agree() -> bool:
    states = gather(torch.default_generator.get_state())
    return all(torch.equal(states[0], s) for s in states[1:])


def piece_key(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """Which piece this rank holds: its coordinate along the mesh dims of size > 1 that cut the tensor."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    return tuple(
        coordinate[d]
        for d, p in enumerate(placements)
        if isinstance(p, (Shard, _StridedShard)) and mesh.shape[d] > 1
    )


def check_per_piece_values(local: torch.Tensor, key: tuple[int, ...], what: str) -> None:
    """Equal values on ranks holding the same piece, different values on different (non-empty) pieces."""
    entries = gather((key, local.clone()))
    for key_a, values_a in entries:
        for key_b, values_b in entries:
            if key_a == key_b:
                assert torch.equal(values_a, values_b), f"{what}: replicas of piece {key_a} differ"
            elif values_a.numel() and values_b.numel():
                common = min(values_a.numel(), values_b.numel())
                assert not torch.equal(values_a.flatten()[:common], values_b.flatten()[:common]), (
                    f"{what}: pieces {key_a} and {key_b} got the same stream"
                )


def fsdp_tp(mesh_shape: tuple[int, int], dim: int) -> tuple[Placement, ...]:
    return (_StridedShard(dim, split_factor=mesh_shape[1]), Shard(dim))


LAYOUTS = [
    ((2, 2), 0, (7, 5)),
    ((2, 2), 1, (3, 9)),
    ((1, 4), 0, (10, 3)),
    ((1, 4), 1, (2, 7)),
]


@pytest.mark.parametrize("fill", sorted(FILLS))
@pytest.mark.parametrize("mesh_shape,dim,shape", LAYOUTS)
@multi_rank(world_size=4)
def test_inplace_fills_on_fsdp_tp_layouts(
    fill: str, mesh_shape: tuple[int, int], dim: int, shape: tuple[int, int]
) -> None:
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = fsdp_tp(mesh_shape, dim)
    draw = FILLS[fill]

    def drawn(seed: int, layout: tuple[Placement, ...]) -> DTensor:
        parameter = dt(distribute_tensor(torch.zeros(shape), mesh, layout))
        torch.manual_seed(seed)
        comm_mode = CommDebugMode()
        with torch.no_grad(), comm_mode:
            draw(parameter)
        if fill == "trunc_normal_":
            # Its rejection loop asks `mask.any()` of the whole tensor: all-reduces of one flag, no data moved.
            counts = comm_mode.get_comm_counts()
            assert all("all_reduce" in str(op) for op in counts), f"{fill} on {layout}: {counts}"
        else:
            assert comm_mode.get_total_counts() == 0, f"{fill} on {layout} communicated"
        return parameter

    parameter = drawn(5, placements)
    assert parameter.placements == placements
    local = parameter.to_local()
    assert local.abs().sum() > 0, f"{fill} left a zero piece"
    if fill == "trunc_normal_":
        assert bool(((local >= -0.04) & (local <= 0.04)).all())
    assert generator_states_agree(), f"generators out of step after {fill}"
    check_per_piece_values(local, piece_key(mesh, placements), f"{fill} on {placements}")

    # The same seed gives the same values (run to run, the stream of a piece is fixed).
    again = drawn(5, placements)
    assert torch.equal(again.to_local(), local)
    assert not torch.equal(drawn(6, placements).to_local(), local) or local.numel() == 0

    # Through FSDP x TP on one data-parallel rank the layout is TP's alone: the values are TP's too.
    if mesh_shape[0] == 1:
        plain = drawn(5, (Replicate(), Shard(dim)))
        assert torch.equal(parameter.full_tensor(), plain.full_tensor())


@multi_rank(world_size=4)
def test_replicas_of_a_strided_piece_draw_alike() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    placements: tuple[Placement, ...] = (_StridedShard(0, split_factor=3), Replicate())
    parameter = dt(distribute_tensor(torch.zeros(11, 2), mesh, placements))
    torch.manual_seed(8)
    with torch.no_grad():
        parameter.normal_()
    assert parameter.placements == placements
    check_per_piece_values(parameter.to_local(), piece_key(mesh, placements), "normal_ on (_S(0, 3), R)")
    assert generator_states_agree()


@multi_rank(world_size=4)
def test_out_of_place_random_ops_keep_strided_layouts() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    placements = fsdp_tp((2, 2), 0)
    source = torch.rand(9, 4) + 0.5  # no zeros: a zero after dropout is a dropped element
    activations = dt(distribute_tensor(source, mesh, placements))
    key = piece_key(mesh, placements)
    row_probabilities = distribute_tensor(torch.full((4,), 0.5), mesh, (Replicate(), Replicate()))
    ops: dict[str, Callable[[DTensor], object]] = {
        "rand_like": torch.rand_like,
        "randn_like": torch.randn_like,
        "dropout": lambda t: F.dropout(t, 0.5, training=True),
        "bernoulli": lambda t: torch.bernoulli(t * 0.5),
        "uniform": lambda t: torch.ops.aten.uniform.default(t, 0.0, 1.0),
        "randint_like": lambda t: torch.randint_like(t, 1000),
        "exponential_": lambda t: torch.empty_like(t).exponential_(),
        "bernoulli_(p tensor)": lambda t: torch.zeros_like(t).bernoulli_(t * 0.5),
        "bernoulli_(broadcast p)": lambda t: torch.zeros_like(t).bernoulli_(row_probabilities),
        "rrelu": lambda t: F.rrelu(t - 1.0, training=True),
        "multinomial": lambda t: torch.multinomial(t, 2),
    }
    for name, op in ops.items():
        torch.manual_seed(13)
        comm_mode = CommDebugMode()
        with comm_mode:
            out = dt(op(activations))
        assert comm_mode.get_total_counts() == 0, f"{name} on {placements} communicated"
        assert out.placements == placements, f"{name}: {out.placements}"
        if name != "multinomial":  # 2 of 4 categories per row: pieces may well draw the same indices
            assert out.to_local().shape == activations.to_local().shape
            check_per_piece_values(out.to_local(), key, name)
        assert generator_states_agree(), f"generators out of step after {name}"
        torch.manual_seed(13)
        assert torch.equal(dt(op(activations)).to_local(), out.to_local()), f"{name} is not reproducible"
    torch.manual_seed(13)
    dropped = dt(F.dropout(activations, 0.5, training=True)).to_local()
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], 2 * activations.to_local()[kept])


def test_cuda_offset_stride_covers_the_largest_strided_piece() -> None:
    # A strided cut of an uneven extent is not largest at coordinate 0: (7 rows; Shard(0) then _S(0, 3)) puts
    # 2 rows at (0, 0) and 3 at (1, 0).  The Philox stride must cover the largest piece, or shards would overlap.
    assert _largest_shard_numel((7, 2), (2, 2), (Shard(0), _StridedShard(0, split_factor=3))) == 6
    assert _largest_shard_numel((7, 2), (2, 2), (Shard(0), Shard(0))) == 4
    assert _largest_shard_numel((9, 1), (1, 4), (_StridedShard(0, split_factor=4), Shard(0))) == 3
