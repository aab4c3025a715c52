"""Factory functions: each rank allocates its own shard; random ones are consistent where replicated."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.dtensor_ops import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    empty,
    full,
    init_device_mesh,
    ones,
    rand,
    randn,
    zeros,
)
from shardwise.placement import Placement
from shardwise.testing import multi_rank


def chunk_oracle(full_tensor: torch.Tensor, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Placement, ...]) -> torch.Tensor:
    """The shard at ``coordinate``: torch.chunk per sharding mesh dim, left to right, empty trailing pieces."""
    piece = full_tensor
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            count = mesh_shape[mesh_dim]
            chunks = list(torch.chunk(piece, count, dim=placement.dim))
            while len(chunks) < count:
                chunks.append(piece.narrow(placement.dim, piece.size(placement.dim), 0))
            piece = chunks[coordinate[mesh_dim]]
    return piece


def all_gather_objects(value: object) -> list[object]:
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@multi_rank
def test_deterministic_factories_on_1d_and_2d_meshes() -> None:
    for mesh_shape, layouts in (
        ((4,), [(Shard(0),), (Shard(1),), (Replicate(),)]),
        ((2, 2), [(Shard(0), Shard(1)), (Shard(0), Shard(0)), (Replicate(), Shard(1)), (Replicate(), Replicate())]),
    ):
        mesh = init_device_mesh("cpu", mesh_shape)
        coordinate = tuple(mesh.get_coordinate() or ())
        for shape in ((8, 4), (9, 5), (3, 2)):
            for placements in layouts:
                reference = torch.empty(shape)
                expected_local_shape = chunk_oracle(reference, mesh_shape, coordinate, placements).shape
                cases = [
                    (zeros(*shape, device_mesh=mesh, placements=placements), torch.zeros(shape)),
                    (ones(shape, device_mesh=mesh, placements=placements), torch.ones(shape)),
                    (full(shape, 2.5, device_mesh=mesh, placements=placements), torch.full(shape, 2.5)),
                    (zeros(list(shape), dtype=torch.int32, device_mesh=mesh, placements=placements), torch.zeros(shape, dtype=torch.int32)),
                ]
                for dt, expected in cases:
                    assert isinstance(dt, DTensor)
                    assert dt.shape == expected.shape and dt.dtype == expected.dtype, (shape, placements)
                    assert dt.stride() == expected.stride() and dt.placements == placements
                    assert dt.to_local().shape == expected_local_shape, (shape, placements)
                    assert torch.equal(dt.full_tensor(), expected), (shape, placements)
                uninitialised = empty(shape, device_mesh=mesh, placements=placements)
                assert uninitialised.shape == shape and uninitialised.to_local().shape == expected_local_shape


@multi_rank
def test_factory_options() -> None:
    mesh = init_device_mesh("cpu", (4,))
    leaf = ones(4, 4, requires_grad=True, device_mesh=mesh, placements=[Shard(0)])
    assert leaf.requires_grad and leaf.is_leaf
    assert not leaf._local_tensor.requires_grad
    assert full((2,), 7, device_mesh=mesh).dtype == torch.int64  # as torch.full
    assert full((2,), True, device_mesh=mesh).dtype == torch.bool
    assert zeros(torch.Size([3]), device_mesh=mesh).shape == (3,)
    assert zeros((), device_mesh=mesh).shape == ()
    assert ones(2, dtype=torch.float64, device_mesh=mesh).dtype == torch.float64
    # Partial: the reduction gives the requested value.
    assert ones(3, device_mesh=mesh, placements=[Partial()]).full_tensor().tolist() == [1.0, 1.0, 1.0]
    assert full((2,), 5.0, device_mesh=mesh, placements=[Partial("max")]).full_tensor().tolist() == [5.0, 5.0]
    with mesh:
        assert zeros(2, 2).device_mesh == mesh
    if dist.get_rank() == 0:
        with pytest.raises(ValueError, match="same length"):
            zeros(4, device_mesh=mesh, placements=[Shard(0), Shard(0)])
        with pytest.raises(ValueError, match="out of range"):
            zeros(4, device_mesh=mesh, placements=[Shard(1)])
        with pytest.raises(TypeError, match="size must be ints"):
            zeros(2.5, device_mesh=mesh)
        with pytest.raises(ValueError, match="non-negative"):
            ones(-1, device_mesh=mesh)
        with pytest.raises(RuntimeError, match="no device_mesh"):
            zeros(2)
    dist.barrier()


@multi_rank
def test_random_factories() -> None:
    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    for factory in (rand, randn):
        # Ranks seeded differently still agree: the first rank's seed wins.
        torch.manual_seed(rank)
        replicated = factory(6, 3, device_mesh=mesh, placements=[Replicate()])
        locals_ = all_gather_objects(replicated.to_local())
        assert all(torch.equal(locals_[0], other) for other in locals_[1:])  # type: ignore[arg-type]

        sharded = factory(8, 3, device_mesh=mesh, placements=[Shard(0)])
        shards = all_gather_objects(sharded.to_local())
        for i in range(4):
            for j in range(i + 1, 4):
                assert not torch.equal(shards[i], shards[j])  # type: ignore[arg-type]
        # Consecutive calls differ; torch.manual_seed makes them reproducible.
        torch.manual_seed(42)
        first = factory(8, 3, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
        second = factory(8, 3, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
        torch.manual_seed(42)
        again = factory(8, 3, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
        assert not torch.equal(first, second) and torch.equal(first, again)
        if factory is rand:
            assert bool((first >= 0).all()) and bool((first < 1).all())

    # 2-D mesh: equal along the replicated mesh dim, different along the sharded one.
    mesh_2d = init_device_mesh("cpu", (2, 2))
    coordinate = mesh_2d.get_coordinate()
    assert coordinate is not None
    mixed = rand(6, 2, device_mesh=mesh_2d, placements=[Replicate(), Shard(0)])
    by_rank = all_gather_objects((tuple(coordinate), mixed.to_local()))
    table: dict[tuple[int, ...], torch.Tensor] = {}
    for entry in by_rank:
        assert isinstance(entry, tuple)
        table[entry[0]] = entry[1]
    assert torch.equal(table[(0, 0)], table[(1, 0)]) and torch.equal(table[(0, 1)], table[(1, 1)])
    assert not torch.equal(table[(0, 0)], table[(0, 1)])
    uneven = randn(5, device_mesh=mesh, placements=[Shard(0)], requires_grad=True)
    assert uneven.requires_grad and uneven.to_local().shape == chunk_oracle(torch.empty(5), (4,), (rank,), (Shard(0),)).shape
