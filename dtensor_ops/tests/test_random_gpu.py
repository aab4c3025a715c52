"""Random ops on CUDA: per-shard Philox offsets (GPU target; every test skips without CUDA).

On CUDA a sharded random op keeps the generator's seed and runs shard ``k`` of
``n`` at offset ``start + k * stride``; afterwards every rank's offset is
``start + n * stride``. Checked here: the offset bookkeeping, that ``stride``
covers what the kernels really consume (so shards never share counters), distinct
values per shard, plain torch's values for replicated draws, and (with two GPUs)
the same on a 2-rank NCCL mesh.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.placement import DTensorSpec, Placement, Replicate, Shard, TensorMeta
from shardwise.testing import FakeMesh, multi_rank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def spec_on(mesh: FakeMesh, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> DTensorSpec[Any]:
    strides = tuple(int(torch.empty(shape).stride(d)) for d in range(len(shape)))
    return DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), strides, torch.float32))


def cuda_generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cuda")
    generator.manual_seed(seed)
    return generator


SAMPLERS: dict[str, Callable[[int, torch.Generator], torch.Tensor]] = {
    "rand float32": lambda n, g: torch.rand(n, device="cuda", generator=g),
    "rand float64": lambda n, g: torch.rand(n, device="cuda", dtype=torch.float64, generator=g),
    "randn float32": lambda n, g: torch.randn(n, device="cuda", generator=g),
    "randn float64": lambda n, g: torch.randn(n, device="cuda", dtype=torch.float64, generator=g),
    "bernoulli_": lambda n, g: torch.empty(n, device="cuda").bernoulli_(0.5, generator=g),
    "uniform_ half": lambda n, g: torch.empty(n, device="cuda", dtype=torch.float16).uniform_(generator=g),
}


def test_offset_stride_covers_what_the_kernels_consume() -> None:
    from shardwise.dtensor_ops._shard_rng import plan_for_spec

    for numel in (1, 7, 1000, 65537, (1 << 20) + 3):
        plan = plan_for_spec(spec_on(FakeMesh((2,), (1,)), (Shard(0),), (2 * numel,)))
        for name, sample in SAMPLERS.items():
            generator = cuda_generator(0)
            before = generator.get_offset()
            sample(numel, generator)
            consumed = generator.get_offset() - before
            assert 0 < consumed <= plan.cuda_offset_stride, f"{name} on {numel} elements consumed {consumed}"


def test_shard_streams_use_disjoint_offsets_and_end_alike() -> None:
    from shardwise.dtensor_ops._shard_rng import plan_for_spec, run_in_shard_stream

    shape = (10, 33)  # rows 3, 3, 3, 1 on 4 shards
    rows = (3, 3, 3, 1)
    draws = []
    ends = []
    for rank in range(4):
        plan = plan_for_spec(spec_on(FakeMesh((4,), (rank,)), (Shard(0),), shape))
        generator = cuda_generator(17)
        start = generator.get_offset()

        def sample(g: torch.Generator = generator, r: int = rows[rank]) -> torch.Tensor:
            return torch.rand(r, 33, device="cuda", generator=g)

        draw = run_in_shard_stream(plan, generator, sample)
        assert plan.shard_index is not None
        ends.append(generator.get_offset())
        assert ends[-1] == start + 4 * plan.cuda_offset_stride
        assert generator.initial_seed() == 17  # the seed is kept; only the offset moves
        draws.append(draw.cpu())
    assert len(set(ends)) == 1
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(draws[i][:1], draws[j][:1]), f"shards {i} and {j} drew the same values"
    # Reproducible: the same shard from the same state draws the same values.
    plan = plan_for_spec(spec_on(FakeMesh((4,), (2,)), (Shard(0),), shape))
    again_generator = cuda_generator(17)
    again = run_in_shard_stream(plan, again_generator, lambda: torch.rand(3, 33, device="cuda", generator=again_generator))
    assert torch.equal(again.cpu(), draws[2])


def test_replicated_draws_are_plain_torch_values() -> None:
    from shardwise.dtensor_ops._shard_rng import plan_for_spec, run_in_shard_stream

    plan = plan_for_spec(spec_on(FakeMesh((4,), (3,)), (Replicate(),), (64,)))
    generator = cuda_generator(5)
    drawn = run_in_shard_stream(plan, generator, lambda: torch.randn(64, device="cuda", generator=generator))
    reference_generator = cuda_generator(5)
    expected = torch.randn(64, device="cuda", generator=reference_generator)
    assert torch.equal(drawn, expected)
    assert generator.get_offset() == reference_generator.get_offset()


def test_default_cuda_generator_is_used_and_kept_in_step() -> None:
    from shardwise.dtensor_ops._shard_rng import default_generator_for, plan_random_op

    device = torch.device("cuda", torch.cuda.current_device())
    generator = default_generator_for(device)
    assert generator is torch.cuda.default_generators[device.index]

    from shardwise.dtensor_ops._sharding_prop import OpDecision

    spec = spec_on(FakeMesh((4,), (1,)), (Shard(0),), (8, 8))
    decision = OpDecision(output_specs=(spec, spec), input_specs=(spec,), needs_redistribute=False)
    plan = plan_random_op(torch.ops.aten.native_dropout.default, decision)
    assert plan is not None and plan.shard_index == 1
    from shardwise.dtensor_ops._shard_rng import run_random_op

    torch.manual_seed(3)
    start = generator.get_offset()
    output, mask = run_random_op(plan, torch.ops.aten.native_dropout.default, [torch.ones(2, 8, device="cuda"), 0.5, True], {})
    assert mask.dtype == torch.bool and output.shape == (2, 8)
    assert generator.get_offset() == start + 4 * plan.cuda_offset_stride


@multi_rank(world_size=2, backend="nccl")
def test_dtensor_random_ops_on_two_gpus() -> None:
    from shardwise.dtensor_ops import DTensor, distribute_tensor, init_device_mesh
    from shardwise.dtensor_ops import random as dtensor_random

    mesh = init_device_mesh("cuda", (2,))
    assert dtensor_random.is_rng_supported_mesh(mesh)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]

    def gathered(value: object) -> list[object]:
        out: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out

    def run(seed: int) -> list[torch.Tensor]:
        dtensor_random.manual_seed(seed, mesh)
        activations = torch.ones(4, 6, device="cuda")
        replicated = F.dropout(distribute_tensor(activations, mesh, [Replicate()]), 0.5, True)
        sharded = F.dropout(distribute_tensor(activations, mesh, [Shard(0)]), 0.5, True)
        uneven = distribute_tensor(torch.empty(3, 5, device="cuda"), mesh, [Shard(0)]).uniform_()
        assert isinstance(replicated, DTensor) and isinstance(sharded, DTensor) and isinstance(uneven, DTensor)
        offsets = gathered(generator.get_offset())
        assert offsets[0] == offsets[1], f"CUDA generator offsets differ across ranks: {offsets}"
        locals_replicated = gathered(replicated.to_local().cpu())
        assert torch.equal(locals_replicated[0], locals_replicated[1])  # type: ignore[arg-type]
        locals_sharded = gathered(sharded.to_local().cpu())
        assert not torch.equal(locals_sharded[0], locals_sharded[1])  # type: ignore[arg-type]
        return [replicated.full_tensor().cpu(), sharded.full_tensor().cpu(), uneven.full_tensor().cpu()]

    first, again = run(11), run(11)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    # A replicated draw is plain torch's draw for the seed.
    torch.manual_seed(11)
    expected = F.dropout(torch.ones(4, 6, device="cuda"), 0.5, True).cpu()
    assert torch.equal(first[0], expected)
