"""multinomial, rrelu and the channel dropouts on DTensors, on 4 rank processes (each with its own generators).

What must hold, as for every random op: ranks holding the same shard draw the same values,
ranks holding different shards draw different ones, every rank's generator advances alike, and
replicated values are plain torch's values for the same seed.  Besides: multinomial samples of a
row-sharded probability matrix stay row-sharded, rrelu's backward uses the slopes of its forward,
and a channel dropout zeroes whole channels.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement
from shardwise.testing import multi_rank


def _gather(value: object) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _generator_fingerprint() -> str:
    return hashlib.sha1(torch.default_generator.get_state().numpy().tobytes()).hexdigest()


def _shard_key(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, ...]:
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    return tuple(coordinate[d] for d, p in enumerate(placements) if isinstance(p, Shard) and mesh.shape[d] > 1)


def _multinomial(t: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(t, 6, replacement=True)


def _rrelu(t: torch.Tensor) -> torch.Tensor:
    # On negative inputs rrelu returns input * slope, one slope per element drawn from [lower, upper).
    return F.rrelu(-t, lower=0.1, upper=0.3, training=True)


def _dropout2d(t: torch.Tensor) -> torch.Tensor:
    return F.dropout2d(t, 0.5, True)


def _feature_alpha_dropout(t: torch.Tensor) -> torch.Tensor:
    return F.feature_alpha_dropout(t, 0.5, True)


def _channels_constant(v: torch.Tensor) -> bool:
    flat = v.flatten(2)
    return bool((flat == flat[..., :1]).all())


# name -> (op on a tensor of the given global shape holding positive values, value check, global shape)
CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], bool], tuple[int, ...]]] = {
    "multinomial": (_multinomial, lambda v: v.dtype == torch.int64 and bool(((v >= 0) & (v < 10)).all()), (8, 10)),
    "rrelu": (_rrelu, lambda v: bool(((v >= -0.3) & (v <= -0.1)).all()), (8, 12)),
    "dropout2d": (_dropout2d, lambda v: _channels_constant(v) and bool(((v == 0) | (v == 2)).all()), (8, 16, 2, 2)),
    "feature_alpha_dropout": (_feature_alpha_dropout, _channels_constant, (8, 16, 2, 2)),
}

LAYOUTS: tuple[tuple[tuple[int, ...], tuple[Placement, ...]], ...] = (
    ((4,), (Replicate(),)),
    ((4,), (Shard(0),)),
    ((2, 2), (Shard(0), Replicate())),
    ((2, 2), (Replicate(), Shard(0))),
    ((2, 2), (Shard(0), Shard(0))),
)


@multi_rank
def test_values_are_per_shard_and_generators_stay_in_step() -> None:
    meshes = {shape: init_device_mesh("cpu", shape) for shape in ((4,), (2, 2))}
    cases: list[tuple[str, tuple[int, ...], torch.Tensor, str]] = []
    for name, (op, in_domain, shape) in CASES.items():
        for mesh_shape, placements in LAYOUTS:
            mesh = meshes[mesh_shape]
            case = f"{name} on mesh {mesh_shape} with {placements}"
            source = torch.ones(shape)
            torch.manual_seed(99)
            plain = op(source)
            torch.manual_seed(99)
            result = op(distribute_tensor(source, mesh, list(placements)))
            assert isinstance(result, DTensor), case
            assert result.placements == placements, f"{case}: output placements {result.placements}"
            assert result.shape == plain.shape, f"{case}: global shape {tuple(result.shape)}"
            local = result.to_local()
            assert in_domain(local), f"{case}: values outside the op's range: {local}"
            if all(not isinstance(p, Shard) for p in placements):
                assert torch.equal(local, plain), f"{case}: differs from plain torch with the same seed"
            cases.append((case, _shard_key(mesh, placements), local, _generator_fingerprint()))
    failures: list[str] = []
    by_rank = _gather(cases)
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


@multi_rank
def test_uneven_shards_rrelu_backward_and_bad_input() -> None:
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(3)
    # Uneven and empty row shards (3 rows over 4 ranks): generators still advance alike.
    probabilities = distribute_tensor(torch.rand(3, 5), mesh, [Shard(0)])
    samples = torch.multinomial(probabilities, 2)
    assert isinstance(samples, DTensor) and samples.placements == (Shard(0),)
    assert tuple(samples.to_local().shape) == ((1, 2) if dist.get_rank() < 3 else (0, 2))
    inputs = distribute_tensor(-torch.ones(5, 3), mesh, [Shard(0)]).requires_grad_()
    output = F.rrelu(inputs, lower=0.1, upper=0.3, training=True)
    assert len(set(_gather(_generator_fingerprint()))) == 1, "generators differ after uneven draws"
    # rrelu on -1 gives -slope; its gradient is the slope of each element, the forward's draw.
    output.sum().backward()
    assert isinstance(inputs.grad, DTensor)
    assert torch.equal(inputs.grad.full_tensor(), -output.detach().full_tensor())
    # A 1-D probability vector is one row: it runs replicated, gathered first.
    vector = distribute_tensor(torch.tensor([0.0, 1.0, 0.0, 0.0]), mesh, [Shard(0)])
    picked = torch.multinomial(vector, 3, replacement=True)
    assert picked.placements == (Replicate(),) and torch.equal(picked.to_local(), torch.ones(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="cannot sample n_sample > prob_dist"):
        torch.multinomial(distribute_tensor(torch.rand(4, 3), mesh, [Shard(0)]), 5)
