"""Random ops: where their results land (sharding rules) and how a shard's stream is derived.

Placements and shapes are checked on 4 rank threads (fast; torch's generator is
shared by the threads, so the *values* of random ops are checked on processes in
test_random.py).  The stream derivation is checked without ranks.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, cast

import pytest
import torch
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops._shard_rng import (
    default_generator_for,
    is_random_op,
    plan_for_spec,
    random_ops,
    run_in_shard_stream,
    shard_seed,
)
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import DTensorSpec, Placement, TensorMeta
from shardwise.testing import DTensorOpTestBase, FakeMesh

aten = torch.ops.aten


# ------------------------------------------------------------------------------------ pure: streams


def spec_on(mesh: FakeMesh, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> DTensorSpec[Any]:
    strides = tuple(int(torch.empty(shape).stride(d)) for d in range(len(shape)))
    return DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), strides, torch.float32))


def coordinates(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(extent) for extent in shape)))


def test_shard_seeds_are_distinct_in_the_32_bits_torch_keeps() -> None:
    for base in (0, 1, 2**31, 2**32 - 1):
        seeds = {shard_seed(base, index) for index in range(4096)}
        assert len(seeds) == 4096 and all(0 <= seed < 2**32 for seed in seeds)


def test_plan_counts_only_sharding_mesh_dims() -> None:
    shape = (8, 12)
    layouts = {
        (Shard(0), Replicate()): lambda c: (c[0], 2),
        (Replicate(), Shard(1)): lambda c: (c[1], 2),
        (Shard(0), Shard(1)): lambda c: (c[0] * 2 + c[1], 4),
        (Shard(1), Shard(1)): lambda c: (c[0] * 2 + c[1], 4),  # nested: both mesh dims cut dim 1
        (Partial(), Shard(0)): lambda c: (c[1], 2),
    }
    for placements, expected in layouts.items():
        for coordinate in coordinates((2, 2)):
            plan = plan_for_spec(spec_on(FakeMesh((2, 2), coordinate), placements, shape))
            assert (plan.shard_index, plan.num_shards) == expected(coordinate), (placements, coordinate)
            assert not plan.holds_zeros
    for placements in [(Replicate(), Replicate()), (Partial(), Replicate()), (Replicate(), Partial("avg"))]:
        plan = plan_for_spec(spec_on(FakeMesh((2, 2), (1, 1)), placements, shape))
        assert plan.shard_index is None and plan.num_shards == 1  # same values everywhere: run as it is
    # A mesh dim of size 1 shards nothing; a rank outside the mesh draws as it is.
    assert plan_for_spec(spec_on(FakeMesh((1, 4), (0, 2)), (Shard(0), Replicate()), shape)).shard_index is None
    assert plan_for_spec(spec_on(FakeMesh((4,), None), (Shard(0),), shape)).shard_index is None


def test_plan_marks_the_zero_parts_of_partial_sum_fills() -> None:
    placements = (Shard(0), Partial())
    for coordinate in coordinates((2, 2)):
        plan = plan_for_spec(spec_on(FakeMesh((2, 2), coordinate), placements, (4, 4)), zeros_off_root_of_partial_sum=True)
        assert plan.holds_zeros == (coordinate[1] != 0)
    for reduce_op in ("avg", "max", "min"):
        plan = plan_for_spec(spec_on(FakeMesh((4,), (3,)), (Partial(reduce_op),), (4,)), zeros_off_root_of_partial_sum=True)
        assert not plan.holds_zeros


def test_offset_stride_covers_the_largest_shard() -> None:
    # 10 rows on 4 ranks: 3, 3, 3, 1; the first shard (3 x 5 = 15 elements) is the largest.
    plan = plan_for_spec(spec_on(FakeMesh((4,), (3,)), (Shard(0),), (10, 5)))
    assert plan.cuda_offset_stride % 4 == 0 and plan.cuda_offset_stride >= 2 * 15 + 4


def test_cpu_shard_streams_advance_alike_and_differ_per_shard() -> None:
    """Every shard's stream advances its generator by one draw, whatever it samples; shards differ."""
    states = []
    values = []
    for rank, rows in enumerate((3, 3, 3, 1)):
        plan = plan_for_spec(spec_on(FakeMesh((4,), (rank,)), (Shard(0),), (10, 3)))
        generator = torch.Generator().manual_seed(11)

        def sample(g: torch.Generator = generator, n: int = rows) -> torch.Tensor:
            return torch.rand(n, 3, generator=g)

        values.append(run_in_shard_stream(plan, generator, sample))
        states.append(generator.get_state())
    assert all(torch.equal(states[0], state) for state in states[1:])
    assert len({tuple(v[0].tolist()) for v in values}) == 4
    # The same shard from the same generator state gives the same values.
    plan = plan_for_spec(spec_on(FakeMesh((4,), (1,)), (Shard(0),), (10, 3)))
    first = run_in_shard_stream(plan, g1 := torch.Generator().manual_seed(5), lambda: torch.rand(4, generator=g1))
    second = run_in_shard_stream(plan, g2 := torch.Generator().manual_seed(5), lambda: torch.rand(4, generator=g2))
    assert torch.equal(first, second)


class FakePhiloxGenerator:
    """The offset bookkeeping of a CUDA generator, so the CUDA path is checked on CPU-only machines too."""

    device = torch.device("cuda", 0)

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        assert offset % 4 == 0, "CUDA generators take offsets that are multiples of 4"
        self.offset = offset


def test_cuda_shard_streams_take_disjoint_offset_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    shape = (10, 5)  # rows 3, 3, 3, 1
    seen: list[tuple[int, int]] = []
    ends = set()
    for rank, rows in enumerate((3, 3, 3, 1)):
        plan = plan_for_spec(spec_on(FakeMesh((4,), (rank,)), (Shard(0),), shape))
        generator = FakePhiloxGenerator(offset=40)

        def sample(g: FakePhiloxGenerator = generator, n: int = rows * 5) -> int:
            start = g.offset
            g.offset += (n + 3) // 4 * 4  # what a float kernel consumes
            return start

        start = run_in_shard_stream(plan, cast(torch.Generator, generator), sample)
        seen.append((start, generator.offset))
        ends.add(generator.offset)
    assert len(ends) == 1 and ends == {40 + 4 * plan.cuda_offset_stride}
    for (start_i, _), (start_j, _) in itertools.combinations(seen, 2):
        assert abs(start_i - start_j) >= plan.cuda_offset_stride  # the ranges never overlap
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        run_in_shard_stream(plan, cast(torch.Generator, FakePhiloxGenerator(0)), lambda: None)


def test_replicated_plans_leave_the_generator_to_the_op() -> None:
    plan = plan_for_spec(spec_on(FakeMesh((4,), (2,)), (Replicate(),), (6,)))
    generator = torch.Generator().manual_seed(3)
    drawn = run_in_shard_stream(plan, generator, lambda: torch.rand(6, generator=generator))
    assert torch.equal(drawn, torch.rand(6, generator=torch.Generator().manual_seed(3)))


def test_random_op_set() -> None:
    for op in (aten.native_dropout.default, aten.bernoulli_.float, aten.uniform_.default, aten.rand_like.default):
        assert is_random_op(op)
    for op in (aten.add.Tensor, aten.empty_like.default, aten.native_dropout_backward.default):
        assert not is_random_op(op)
    # out= forms draw only where their rule writes the out tensor in its own shard stream.
    out_forms = (aten.rand_like.out, aten.randn_like.out, aten.multinomial.out, aten.rrelu_with_noise.out)
    assert all(not op._overloadname.endswith("out") or op in out_forms for op in random_ops())
    assert default_generator_for(torch.device("cpu")) is torch.default_generator
    assert default_generator_for(torch.device("meta")) is None


# ------------------------------------------------------------------------------------ threads: placements


def full_like_layout(mesh: DeviceMesh, shape: tuple[int, ...], layout: tuple[Placement, ...], value: float) -> DTensor:
    if any(isinstance(p, Partial) for p in layout):
        # Every Partial part holds value / parts for sum and avg, the value itself for max.
        local_layout = [Replicate() if isinstance(p, Partial) else p for p in layout]
        local = distribute_tensor(torch.full(shape, value), mesh, local_layout, src_data_rank=None).to_local()
        parts = 1
        for mesh_dim, p in enumerate(layout):
            if isinstance(p, Partial) and p.reduce_op == "sum":
                parts *= mesh.size(mesh_dim)
        return DTensor.from_local(local / parts, mesh, list(layout), shape=torch.Size(shape), stride=torch.empty(shape).stride())
    return distribute_tensor(torch.full(shape, value), mesh, list(layout), src_data_rank=None)


def dt(value: object) -> DTensor:
    assert isinstance(value, DTensor), f"expected a DTensor, got {type(value).__name__}"
    return value


def no_partial(layout: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in layout)


# (name, op on a DTensor of ones * 0.5, expected output layout from the input layout, reads the values)
Case = tuple[str, Callable[[DTensor], torch.Tensor], Callable[[tuple[Placement, ...]], tuple[Placement, ...]]]
CASES: list[Case] = [
    ("uniform_", lambda t: t.uniform_(), lambda layout: layout),
    ("normal_", lambda t: t.normal_(), lambda layout: layout),
    ("bernoulli_(float)", lambda t: t.bernoulli_(0.5), lambda layout: layout),
    ("exponential_", lambda t: t.exponential_(), lambda layout: layout),
    ("log_normal_", lambda t: t.log_normal_(), lambda layout: layout),
    ("geometric_", lambda t: t.geometric_(0.5), lambda layout: layout),
    ("cauchy_", lambda t: t.cauchy_(), lambda layout: layout),
    ("random_", lambda t: t.random_(0, 7), lambda layout: layout),
    ("bernoulli.p", lambda t: torch.bernoulli(t, 0.25), no_partial),
    ("rand_like", torch.rand_like, no_partial),
    ("randn_like(generator)", lambda t: torch.randn_like(t, generator=torch.Generator().manual_seed(1)), no_partial),
    ("randint_like", lambda t: torch.randint_like(t, 2, 5), no_partial),
    ("uniform (functional)", lambda t: aten.uniform.default(t, 0.0, 2.0), no_partial),
    ("native_dropout(train=False)", lambda t: torch.native_dropout(t, 0.5, False)[0], lambda layout: layout),
]


class RandomOpPlacementsTest(DTensorOpTestBase):
    def _check(self, mesh: DeviceMesh, layouts: list[tuple[Placement, ...]]) -> None:
        comm_mode = CommDebugMode()
        for name, op, expected in CASES:
            for layout in layouts:
                if name == "native_dropout(train=False)" and any(
                    isinstance(p, Partial) and p.reduce_op == "max" for p in layout
                ):
                    continue  # dropout is linear: only sum/avg partials pass through
                source = full_like_layout(mesh, (5, 6), layout, 0.5)
                with comm_mode:
                    result = op(source)
                case = f"{name} on {layout}"
                assert isinstance(result, DTensor), case
                assert comm_mode.get_total_counts() == 0, f"{case} communicated"
                assert result.placements == expected(layout), f"{case}: got {result.placements}"
                assert result.shape == (5, 6) and result.to_local().shape == result._spec.local_shape(), case
                if name.endswith("_"):
                    assert result is source, case

    def test_placements_on_1d_mesh(self) -> None:
        mesh = DeviceMesh("cpu", list(range(4)))
        self._check(
            mesh,
            [(Replicate(),), (Shard(0),), (Shard(1),), (Partial(),), (Partial("avg"),), (Partial("max"),)],
        )

    def test_placements_on_2d_mesh(self) -> None:
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
        self._check(
            mesh,
            [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Shard(1)), (Shard(1), Shard(1)), (Partial(), Shard(0))],
        )

    def test_bernoulli_of_probabilities_and_of_a_p_tensor(self) -> None:
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
        comm_mode = CommDebugMode()
        for layout in [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Replicate(), Replicate())]:
            probabilities = full_like_layout(mesh, (4, 6), layout, 0.5)
            with comm_mode:
                drawn = dt(torch.bernoulli(probabilities))
            assert comm_mode.get_total_counts() == 0 and drawn.placements == layout
        # p follows self's shards like a broadcast operand: a row of p is replicated along the sharded rows.
        p_row = distribute_tensor(torch.full((6,), 0.5), mesh, [Replicate(), Shard(0)], src_data_rank=None)
        target = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0), Shard(1)], src_data_rank=None)
        with comm_mode:
            target.bernoulli_(p_row)
        assert comm_mode.get_total_counts() == 0 and target.placements == (Shard(0), Shard(1))
        values = target.to_local()
        assert bool(((values == 0) | (values == 1)).all())
        functional = aten.bernoulli.Tensor(
            full_like_layout(mesh, (4, 6), (Partial(), Shard(0)), 0.0), p_row.redistribute(mesh, [Replicate(), Replicate()])
        )
        assert functional.placements == (Replicate(), Shard(0))

    def test_dropout_rule_placements(self) -> None:
        mesh = DeviceMesh("cpu", list(range(4)))
        comm_mode = CommDebugMode()
        for layout, mask_layout in [
            ((Shard(0),), (Shard(0),)),
            ((Shard(2),), (Shard(2),)),
            ((Replicate(),), (Replicate(),)),
            ((Partial(),), (Replicate(),)),
            ((Partial("avg"),), (Replicate(),)),
        ]:
            x = full_like_layout(mesh, (3, 4, 6), layout, 1.0)
            with comm_mode:
                raw_out, raw_mask = torch.native_dropout(x, 0.25, True)
            out, mask = dt(raw_out), dt(raw_mask)
            assert comm_mode.get_total_counts() == 0
            assert out.placements == layout and mask.placements == mask_layout and mask.dtype == torch.bool
            # Kept elements are scaled by 1 / (1 - p), dropped ones are zero, on every shard.
            torch.testing.assert_close(out.to_local(), x.to_local() * mask.to_local() / 0.75)

    def test_native_dropout_backward_against_plain_torch(self) -> None:
        grad = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
        mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(3)) > 0.4
        for mesh in (DeviceMesh("cpu", list(range(4))), DeviceMesh("cpu", torch.arange(4).reshape(2, 2))):
            self._test_op(mesh, aten.native_dropout_backward.default, grad, mask, 2.5)
        # Uneven shards and a Partial gradient with a replicated mask.
        mesh = DeviceMesh("cpu", list(range(4)))
        uneven_grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(4))
        uneven_mask = torch.rand(5, 3, generator=torch.Generator().manual_seed(5)) > 0.5
        expected = aten.native_dropout_backward.default(uneven_grad, uneven_mask, 2.0)
        for layout in ([Shard(0)], [Shard(1)]):
            result = aten.native_dropout_backward.default(
                distribute_tensor(uneven_grad, mesh, layout), distribute_tensor(uneven_mask, mesh, layout), 2.0
            )
            assert result.placements == tuple(layout)
            torch.testing.assert_close(result.full_tensor(), expected)
        partial_grad = DTensor.from_local(uneven_grad / 4, mesh, [Partial()])
        replicated_mask = distribute_tensor(uneven_mask, mesh, [Replicate()])
        comm_mode = CommDebugMode()
        with comm_mode:
            result = aten.native_dropout_backward.default(partial_grad, replicated_mask, 2.0)
        assert comm_mode.get_total_counts() == 0 and result.placements == (Partial(),)
        torch.testing.assert_close(result.full_tensor(), expected)

    def test_dropout_forward_and_backward_use_one_mask(self) -> None:
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
        for layout in ([Shard(0), Shard(1)], [Replicate(), Shard(1)], [Shard(1), Replicate()]):
            x = dt(distribute_tensor(torch.rand(4, 6) + 1.0, mesh, layout).requires_grad_())
            out = dt(F.dropout(x, 0.4, True))
            out.backward(torch.ones_like(out))
            grad = dt(x.grad)
            assert out.placements == tuple(layout) and grad.placements == tuple(layout)
            kept = out.to_local() != 0
            torch.testing.assert_close(grad.to_local(), kept.to(torch.float32) / 0.6)

    def test_random_op_without_a_rule_names_the_op_and_placements(self) -> None:
        mesh = DeviceMesh("cpu", list(range(4)))
        rates = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        with pytest.raises(NotImplementedError, match=r"aten\.poisson\.default.*Shard\(dim=0\)"):
            torch.poisson(rates)
