"""Random ops on DTensors, on 4 rank processes (each with its own generators, as in a real run).

What must hold: ranks holding the same shard draw the same values, different shards
draw different ones; every rank's generator advances alike (uneven and empty shards
included); seeding every rank alike reproduces a run; dropout masks of replicated
activations agree across ranks and the backward pass uses the forward's mask.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops import random as dtensor_random
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement
from shardwise.testing import multi_rank

RandomOp = Callable[[DTensor], torch.Tensor]


def gather(value: object) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def dt(value: object) -> DTensor:
    assert isinstance(value, DTensor), f"expected a DTensor, got {type(value).__name__}"
    return value


def generator_fingerprint() -> str:
    return hashlib.sha1(torch.default_generator.get_state().numpy().tobytes()).hexdigest()


def assert_generators_in_step(what: str) -> None:
    fingerprints = gather(generator_fingerprint())
    assert len(set(fingerprints)) == 1, f"after {what}: default generators differ across ranks"


def shard_key(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """Which shard this rank holds: its coordinate along the mesh dims that shard the tensor."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    return tuple(coordinate[d] for d, p in enumerate(placements) if isinstance(p, Shard) and mesh.shape[d] > 1)


# Each op gets a fresh DTensor laid out as asked (its global values: `source`) and returns the random result.
# The plain version is the same op on the plain global tensor.
RANDOM_OPS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], bool]]] = {
    "uniform_": (lambda t: t.uniform_(-1.0, 1.0), lambda v: bool(((v >= -1) & (v < 1)).all())),
    "normal_": (lambda t: t.normal_(2.0, 0.5), lambda v: bool(torch.isfinite(v).all())),
    "bernoulli_": (lambda t: t.bernoulli_(0.3), lambda v: bool(((v == 0) | (v == 1)).all())),
    "exponential_": (lambda t: t.exponential_(), lambda v: bool((v >= 0).all())),
    "bernoulli.p": (lambda t: torch.bernoulli(t, 0.5), lambda v: bool(((v == 0) | (v == 1)).all())),
    "bernoulli(probabilities)": (lambda t: torch.bernoulli(t.fill_(0.5)), lambda v: bool(((v == 0) | (v == 1)).all())),
    "rand_like": (torch.rand_like, lambda v: bool(((v >= 0) & (v < 1)).all())),
    "randn_like": (torch.randn_like, lambda v: bool(torch.isfinite(v).all())),
    "randint_like": (lambda t: torch.randint_like(t, 1000), lambda v: bool(((v >= 0) & (v < 1000)).all())),
    "dropout": (
        lambda t: F.dropout(t.fill_(1.0), 0.5, True),
        lambda v: bool(((v == 0) | (v == 2)).all()),
    ),
    "native_dropout": (
        lambda t: torch.native_dropout(t.fill_(1.0), 0.5, True)[0],
        lambda v: bool(((v == 0) | (v == 2)).all()),
    ),
}

LAYOUTS: tuple[tuple[tuple[int, int] | tuple[int], tuple[Placement, ...]], ...] = (
    ((4,), (Replicate(),)),
    ((4,), (Shard(0),)),
    ((4,), (Shard(1),)),
    ((2, 2), (Replicate(), Replicate())),
    ((2, 2), (Shard(0), Replicate())),
    ((2, 2), (Replicate(), Shard(1))),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 2), (Shard(1), Shard(1))),
)


@multi_rank
def test_values_are_per_shard_and_generators_stay_in_step() -> None:
    meshes: dict[tuple[int, ...], DeviceMesh] = {shape: init_device_mesh("cpu", shape) for shape in ((4,), (2, 2))}
    # Per case: which shard this rank holds, its values, its generator state afterwards (one gather at the end).
    cases: list[tuple[str, tuple[int, ...], torch.Tensor, str]] = []
    for name, (op, in_domain) in RANDOM_OPS.items():
        for mesh_shape, placements in LAYOUTS:
            mesh = meshes[mesh_shape]
            case = f"{name} on mesh {mesh_shape} with {placements}"
            torch.manual_seed(1234)
            plain = op(torch.zeros(8, 12))
            torch.manual_seed(1234)
            result = op(distribute_tensor(torch.zeros(8, 12), mesh, list(placements)))
            assert isinstance(result, DTensor), case
            assert result.placements == placements, f"{case}: output placements {result.placements}"
            local = result.to_local()
            assert in_domain(local), f"{case}: values outside the distribution's range"
            if all(not isinstance(p, Shard) for p in placements):
                # Replicated values run the op on the generator as it is: plain torch's values for the seed.
                assert torch.equal(local, plain), f"{case}: differs from plain torch with the same seed"
            cases.append((case, shard_key(mesh, placements), local, generator_fingerprint()))
    failures: list[str] = []
    by_rank = gather(cases)
    for index, (case, _, _, _) in enumerate(cases):
        entries = [rank_cases[index] for rank_cases in by_rank]
        if len({fingerprint for _, _, _, fingerprint in entries}) != 1:
            failures.append(f"{case}: default generators differ across ranks afterwards")
        for i, (_, key_i, local_i, _) in enumerate(entries):
            for _, key_j, local_j, _ in entries[i + 1 :]:
                same = torch.equal(local_i, local_j)
                if key_i == key_j and not same:
                    failures.append(f"{case}: ranks holding shard {key_i} drew different values")
                if key_i != key_j and same:
                    failures.append(f"{case}: shards {key_i} and {key_j} drew the same values")
    assert not failures, "\n".join(failures)


def _draw_sequence_on_uneven_shards(mesh: DeviceMesh, placements: list[Placement]) -> None:
    """Random ops on shards of sizes such as 2, 2, 1, 0: afterwards the generators must still agree."""
    ones = distribute_tensor(torch.ones(5, 3), mesh, placements)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("uniform_", lambda: distribute_tensor(torch.empty(5, 3), mesh, placements).uniform_()),
        ("normal_", lambda: distribute_tensor(torch.empty(5, 3), mesh, placements).normal_()),
        ("dropout", lambda: F.dropout(ones, 0.25, True)),
        ("native_dropout", lambda: torch.native_dropout(ones, 0.25, True)),
        ("bernoulli", lambda: torch.bernoulli(ones * 0.5)),
        ("rand_like", lambda: torch.rand_like(ones)),
        ("randn_like", lambda: torch.randn_like(ones, dtype=torch.float64)),
        ("randint_like", lambda: torch.randint_like(ones, 3, 9)),
    ]
    for name, step in steps:
        step()
        assert_generators_in_step(f"{name} with {placements} on {mesh}")
    # The next replicated draw therefore agrees everywhere.
    follow_up = dt(distribute_tensor(torch.empty(4), mesh, [Replicate()] * mesh.ndim).uniform_()).to_local()
    assert len({tuple(v.tolist()) for v in gather(follow_up)}) == 1


@multi_rank
def test_generators_stay_in_step_on_uneven_and_empty_shards() -> None:
    torch.manual_seed(7)
    mesh = init_device_mesh("cpu", (4,))
    _draw_sequence_on_uneven_shards(mesh, [Shard(0)])  # rows 2, 2, 1, 0
    _draw_sequence_on_uneven_shards(mesh, [Shard(1)])  # columns 1, 1, 1, 0
    mesh_2d = init_device_mesh("cpu", (2, 2))
    _draw_sequence_on_uneven_shards(mesh_2d, [Shard(0), Shard(0)])  # nested: rows 2, 1, 1, 1
    _draw_sequence_on_uneven_shards(mesh_2d, [Shard(1), Replicate()])


def _run_of_random_ops(mesh: DeviceMesh) -> list[torch.Tensor]:
    x = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
    return [
        dt(distribute_tensor(torch.empty(6, 4), mesh, [Shard(1)]).normal_()).full_tensor(),
        dt(F.dropout(x, 0.5, True)).full_tensor(),
        dt(torch.rand_like(distribute_tensor(torch.empty(3, 3), mesh, [Replicate()]))).full_tensor(),
        dt(torch.bernoulli(x * 0.5)).full_tensor(),
    ]


@multi_rank
def test_manual_seed_reproduces_a_run() -> None:
    mesh = init_device_mesh("cpu", (4,))
    assert dtensor_random.is_rng_supported_mesh(mesh)
    dtensor_random.manual_seed(5, mesh)
    first = _run_of_random_ops(mesh)
    dtensor_random.manual_seed(5, mesh)
    again = _run_of_random_ops(mesh)
    torch.manual_seed(5)  # plain torch.manual_seed on every rank is the same thing
    plain_seeded = _run_of_random_ops(mesh)
    dtensor_random.manual_seed(6, mesh)
    other = _run_of_random_ops(mesh)
    for index, (a, b, c, d) in enumerate(zip(first, again, plain_seeded, other)):
        assert torch.equal(a, b) and torch.equal(a, c), f"op {index} not reproduced by the same seed"
        assert not torch.equal(a, d), f"op {index} gave the same values for seeds 5 and 6"
    # Consecutive ops draw new values.
    assert not torch.equal(first[0], _run_of_random_ops(mesh)[0])


@multi_rank
def test_manual_seed_rejects_bad_arguments() -> None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    with pytest.raises(TypeError, match="seed must be an int"):
        dtensor_random.manual_seed("3", mesh)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be an int"):
        dtensor_random.manual_seed(True, mesh)
    with pytest.raises(TypeError, match="device_mesh must be a DeviceMesh"):
        dtensor_random.manual_seed(3, "cpu")  # type: ignore[arg-type]
    first_half = DeviceMesh("cpu", [0, 1])
    if rank < 2:
        dtensor_random.manual_seed(3, first_half)
    else:
        with pytest.raises(RuntimeError, match="calling rank to be part of the device mesh"):
            dtensor_random.manual_seed(3, first_half)


@multi_rank
def test_dropout_masks_and_backward() -> None:
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(21)
    activations = torch.rand(2, 8, 6) + 0.5  # no zeros: a zero output means a dropped element
    dropout = nn.Dropout(0.5)
    comm_mode = CommDebugMode()
    activation_layouts: list[list[Placement]] = [[Replicate()], [Shard(1)], [Shard(2)]]
    for placements in activation_layouts:
        leaf = dt(distribute_tensor(activations, mesh, placements).requires_grad_())
        torch.manual_seed(99)
        with comm_mode:
            out = dt(dropout(leaf))
            (out * 3).sum().backward()
        assert comm_mode.get_total_counts() == 0, f"{placements}: dropout communicated"
        assert isinstance(out, DTensor) and out.placements == tuple(placements)
        grad = dt(leaf.grad)
        assert grad.placements == tuple(placements)
        kept = out.to_local() != 0
        torch.testing.assert_close(out.to_local()[kept], 2 * leaf.to_local()[kept])
        # The backward pass scales by the forward's mask.
        torch.testing.assert_close(grad.to_local(), 6.0 * kept.to(torch.float32))
        masks = gather(kept)
        if placements == [Replicate()]:
            assert all(torch.equal(masks[0], m) for m in masks[1:]), "replicated activations got different masks"
            torch.manual_seed(99)
            reference = activations.clone().requires_grad_()
            expected = dropout(reference)
            torch.testing.assert_close(out.full_tensor(), expected)
        else:
            assert not any(torch.equal(masks[0], m) for m in masks[1:]), "shards got the same mask"

    # Activation checkpointing recomputes the forward in the backward pass: torch restores the generator
    # state first, so the recomputed masks are the forward's (gradient zero exactly where the output is).
    for placements in activation_layouts:
        leaf = dt(distribute_tensor(activations, mesh, placements).requires_grad_())
        out = dt(checkpoint(lambda t: dropout(t) * 1.0, leaf, use_reentrant=False))
        torch.rand(3)  # the generator moves on before the backward pass
        out.sum().backward()
        kept = (out.to_local() != 0).to(torch.float32)
        torch.testing.assert_close(dt(leaf.grad).to_local(), 2 * kept)

    # native_dropout returns the mask; its backward (native_dropout_backward) scales by it.
    native_layouts: list[list[Placement]] = [[Replicate()], [Shard(0)], [Partial()]]
    for placements in native_layouts:
        if placements == [Partial()]:
            leaf = dt(DTensor.from_local(activations / 4, mesh, placements).detach().requires_grad_())
        else:
            leaf = dt(distribute_tensor(activations, mesh, placements).requires_grad_())
        with comm_mode:
            raw_out, raw_mask = torch.native_dropout(leaf, 0.5, True)
            out, mask = dt(raw_out), dt(raw_mask)
            out.backward(torch.ones_like(out))
        assert comm_mode.get_total_counts() == 0, f"native_dropout on {placements} communicated"
        expected_out_placements = tuple(placements)
        expected_mask_placements = (Replicate(),) if placements == [Partial()] else tuple(placements)
        assert out.placements == expected_out_placements and mask.placements == expected_mask_placements
        full_mask = mask.full_tensor()
        torch.testing.assert_close(out.full_tensor(), activations * full_mask * 2)
        torch.testing.assert_close(dt(leaf.grad).full_tensor(), full_mask.to(torch.float32) * 2)


@multi_rank
def test_random_fills_of_partial_tensors() -> None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    comm_mode = CommDebugMode()
    for reduce_op in ("sum", "avg", "max"):
        partial = DTensor.from_local(torch.full((3, 4), float(rank + 1)), mesh, [Partial(reduce_op)])
        torch.manual_seed(3)
        expected = torch.empty(3, 4).uniform_()
        torch.manual_seed(3)
        with comm_mode:
            result = dt(partial.uniform_())
        assert comm_mode.get_total_counts() == 0
        assert result is partial and result.placements == (Partial(reduce_op),)
        # The reduced value is one draw, as for a replicated tensor.
        torch.testing.assert_close(result.full_tensor(), expected)
        if reduce_op == "sum":
            assert torch.equal(result.to_local(), expected if rank == 0 else torch.zeros(3, 4))
        else:
            assert torch.equal(result.to_local(), expected)

    mesh_2d = init_device_mesh("cpu", (2, 2))
    mixed = DTensor.from_local(torch.ones(2, 4), mesh_2d, [Shard(0), Partial()])
    mixed.normal_()
    coordinate = mesh_2d.get_coordinate()
    assert coordinate is not None
    entries = gather((tuple(coordinate), mixed.to_local()))
    by_coordinate = {key: value for key, value in entries}
    assert torch.equal(by_coordinate[(0, 1)], torch.zeros(2, 4)) and torch.equal(by_coordinate[(1, 1)], torch.zeros(2, 4))
    assert not torch.equal(by_coordinate[(0, 0)], by_coordinate[(1, 0)])
    assert mixed.full_tensor().shape == (4, 4)

    # Out-of-place ops that ignore the values give replicated results without communication;
    # bernoulli(probabilities) reads them, so a Partial input is reduced first (one all_reduce).
    probabilities = DTensor.from_local(torch.full((4, 4), 0.125), mesh, [Partial()])
    with comm_mode:
        like = dt(torch.rand_like(probabilities))
        coin = dt(torch.bernoulli(probabilities, 0.5))
    assert comm_mode.get_total_counts() == 0
    assert like.placements == (Replicate(),) and coin.placements == (Replicate(),)
    assert len({tuple(v.flatten().tolist()) for v in gather(like.to_local())}) == 1
    with comm_mode:
        drawn = dt(torch.bernoulli(probabilities))
    # One reduction (the engine picks the cheapest: a reduce-scatter to a Shard, or an all-reduce).
    assert comm_mode.get_total_counts() == 1
    assert not any(isinstance(p, Partial) for p in drawn.placements)
    assert bool(((drawn.full_tensor() == 0) | (drawn.full_tensor() == 1)).all())
    # Dropout is linear, not max-preserving: a Partial(max) input is reduced first.
    maxima = DTensor.from_local(torch.full((4, 4), float(rank)), mesh, [Partial("max")])
    with comm_mode:
        dropped = dt(torch.native_dropout(maxima, 0.5, True)[0])
    assert comm_mode.get_total_counts() == 1 and not any(isinstance(p, Partial) for p in dropped.placements)
    assert bool(((dropped.full_tensor() == 0) | (dropped.full_tensor() == 6)).all())
