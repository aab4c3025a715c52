"""The time cost model: pricing, step kinds, profiles, the crossover, and how it chooses plans and strategies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardwise.dtensor_ops._cost_model import (
    StepPricer,
    bytes_worth_one_collective,
    collective_time,
    crossover_table,
    plan_time,
    priced_kind,
)
import torch

from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.dtensor_ops._options import current_options, use_options
from shardwise.dtensor_ops._planner import StepKind, find_cheapest_plan, plan_bytes_per_rank, plan_redistribute
from shardwise.dtensor_ops._torch_compat.collective_utils import redistribute_cost
from shardwise.mesh._cost_profile import BUILTIN_PROFILES, COLLECTIVE_KINDS, COST_PROFILE_ENV_VAR, CollectiveCost, CostProfile
from shardwise.placement import DTensorSpec, Partial, Replicate, Shard, TensorMeta
from shardwise.testing import FakeMesh


@dataclass(frozen=True)
class ShapeMesh:
    shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None = None


def _profile(alpha: float = 10e-6, beta: float = 1e9, per_peer: float = 0.0, name: str = "t") -> CostProfile:
    return CostProfile(
        name=name,
        source="test",
        costs={kind: CollectiveCost(alpha_s=alpha, beta_bytes_per_s=beta, alpha_per_peer_s=per_peer) for kind in COLLECTIVE_KINDS},
    )


@dataclass(frozen=True)
class Step:
    kind: str
    mesh_dim: int
    bytes_per_rank: int
    mesh_dims: tuple[int, ...] = ()


MESH_2X4 = ShapeMesh((2, 4), ("dp", "tp"))


def test_a_collective_costs_its_latency_plus_its_bytes_over_the_bandwidth() -> None:
    profile = _profile(alpha=10e-6, beta=1e9, per_peer=1e-6)
    # tp has 4 ranks: alpha = 10 + 3 * 1 us; 1 MB at 1 GB/s = 1 ms.
    assert collective_time("all_gather", 1e6, MESH_2X4, 1, profile=profile) == pytest.approx(13e-6 + 1e-3)
    assert collective_time("all_reduce", 0, MESH_2X4, 0, profile=profile) == pytest.approx(11e-6)
    # Several dims jointly: one collective over 8 ranks.
    assert collective_time("joint_all_to_all", 8e6, MESH_2X4, (0, 1), profile=profile) == pytest.approx(17e-6 + 8e-3)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        collective_time("all_gather", -1, MESH_2X4, 0, profile=profile)


def test_step_kinds_are_priced_as_the_collective_that_runs_them() -> None:
    assert priced_kind("joint_reduce_scatter") == "reduce_scatter"
    assert priced_kind("joint_all_to_all_reduce") == "all_to_all"
    assert priced_kind("local_chunk") == priced_kind("shard_to_partial") == "local_copy"
    assert priced_kind("relabel") is None
    with pytest.raises(ValueError, match="no price for step kind 'broadcast'"):
        priced_kind("broadcast")
    profile = _profile()
    assert collective_time("relabel", 1e6, MESH_2X4, 0, profile=profile) == 0.0
    # A group of one rank moves nothing; a local copy still costs.
    assert collective_time("all_gather", 1e6, ShapeMesh((1, 4)), 0, profile=profile) == 0.0
    assert collective_time("local_chunk", 1e6, ShapeMesh((1, 4)), 0, profile=profile) == pytest.approx(10e-6 + 1e-3)


def test_plans_from_the_planner_are_priced_step_by_step() -> None:
    from shardwise.dtensor_ops._planner import find_cheapest_plan

    plan = find_cheapest_plan((64, 64), (2, 4), (Shard(0), Partial()), (Replicate(), Replicate()), 4)
    profile = _profile(alpha=50e-6, beta=2e9)
    pricer = StepPricer.for_mesh(MESH_2X4, profile)
    expected = sum(pricer.step_time(step.kind, (step.mesh_dim,), step.bytes_per_rank) for step in plan)
    collectives = sum(1 for step in plan if step.kind.is_collective)
    assert collectives == 2
    assert plan_time(plan, MESH_2X4, profile=profile) == pytest.approx(expected)
    assert expected == pytest.approx(collectives * 50e-6 + sum(step.bytes_per_rank for step in plan) / 2e9)


def test_fewer_bytes_win_exactly_when_the_saved_bytes_exceed_alpha_times_beta_per_extra_collective() -> None:
    profile = _profile(alpha=100e-6, beta=1e9)  # alpha * beta = 100 kB
    worth = bytes_worth_one_collective("all_gather", ShapeMesh((4,)), 0, profile=profile)
    assert worth == pytest.approx(100e3)
    # Plan A: two collectives moving B bytes; plan B: one collective moving B + saved bytes.
    for saved, a_faster in ((50e3, False), (150e3, True)):
        plan_a = [Step("all_to_all", 0, 100_000), Step("all_gather", 0, 100_000)]
        plan_b = [Step("all_gather", 0, int(200_000 + saved))]
        time_a = plan_time(plan_a, ShapeMesh((4,)), profile=profile)
        time_b = plan_time(plan_b, ShapeMesh((4,)), profile=profile)
        assert (time_a < time_b) is a_faster, (saved, time_a, time_b)


def test_the_profile_comes_from_the_argument_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "slow.json"
    _profile(alpha=1.0, beta=1.0, name="slow").save(path)
    monkeypatch.setenv(COST_PROFILE_ENV_VAR, str(path))
    assert collective_time("all_gather", 2.0, MESH_2X4, 0) == pytest.approx(3.0)
    assert collective_time("all_gather", 2.0, MESH_2X4, 0, profile=_profile(alpha=0.0, beta=2.0)) == pytest.approx(1.0)
    monkeypatch.delenv(COST_PROFILE_ENV_VAR)
    # No argument, no variable, no process group: gloo's measured default (a latency per collective).
    assert collective_time("all_gather", 0, ShapeMesh((4,)), 0) == pytest.approx(487e-6)
    assert collective_time("all_gather", 0, ShapeMesh((8,)), 0) == pytest.approx(487e-6)


def test_crossover_table_lists_alpha_times_beta_per_kind_and_group_size() -> None:
    rows = crossover_table(_profile(alpha=10e-6, beta=1e9, per_peer=10e-6), [2, 8])
    assert ("all_gather", 2, pytest.approx(20e3)) in rows
    assert ("all_reduce", 8, pytest.approx(80e3)) in rows
    assert {kind for kind, _, _ in rows} == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}


def test_the_pricer_cache_key_changes_with_the_profile() -> None:
    assert StepPricer(MESH_2X4, _profile(beta=1e9)).cache_key != StepPricer(MESH_2X4, _profile(beta=2e9)).cache_key
    assert StepPricer(MESH_2X4, _profile()).cache_key == StepPricer(MESH_2X4, _profile()).cache_key


# -- the planner and strategy choice priced by time ---------------------------------------------------

GLOO = BUILTIN_PROFILES["gloo-loopback"]


def _kinds(plan: tuple[object, ...]) -> list[str]:
    return [step.kind.value for step in plan]  # type: ignore[attr-defined]


def test_latency_bound_plans_take_fewer_collectives_than_the_fewest_bytes() -> None:
    # Uneven Shard(1) -> Replicate, 5 columns over 4 ranks: by bytes an all-to-all first evens the
    # pieces out (then an all-gather); by time one all-gather of the padded pieces is faster.
    src, dst = (Shard(1),), (Replicate(),)
    by_bytes = find_cheapest_plan((8, 5), (4,), src, dst, 4)
    by_time = find_cheapest_plan((8, 5), (4,), src, dst, 4, step_price=StepPricer(ShapeMesh((4,)), GLOO).step_picoseconds)
    assert _kinds(by_bytes) == ["all_to_all", "all_gather"]
    assert _kinds(by_time) == ["all_gather"]
    assert plan_bytes_per_rank(by_time) > plan_bytes_per_rank(by_bytes)


def test_bandwidth_bound_plans_keep_the_bytes_lower_bound() -> None:
    # The same move of a 2**20 x 5 tensor: the 3 MB the all-to-all saves outweigh its latency.
    src, dst = (Shard(1),), (Replicate(),)
    priced = StepPricer(ShapeMesh((4,)), GLOO).step_picoseconds
    by_time = find_cheapest_plan((2**20, 5), (4,), src, dst, 4, step_price=priced)
    assert _kinds(by_time) == ["all_to_all", "all_gather"]
    assert by_time == find_cheapest_plan((2**20, 5), (4,), src, dst, 4)


def test_equal_times_go_to_fewer_collectives() -> None:
    # A profile where every collective costs only its latency: S(0) -> S(1) is one all-to-all, never
    # an all-gather and a local chunk (same time, but the chunk is one more step).
    flat = _profile(alpha=10e-6, beta=1e30)
    plan = find_cheapest_plan((8, 8), (4,), (Shard(0),), (Shard(1),), 4, step_price=StepPricer(ShapeMesh((4,)), flat).step_picoseconds)
    assert _kinds(plan) == ["all_to_all"]


def test_specs_are_planned_under_the_cost_profile_option(tmp_path: Path) -> None:
    mesh = FakeMesh((4,))
    meta = TensorMeta(torch.Size([8, 5]), (5, 1), torch.float32)
    src, dst = DTensorSpec(mesh, (Shard(1),), meta), DTensorSpec(mesh, (Replicate(),), meta)
    bandwidth_only = tmp_path / "bandwidth_only.json"
    _profile(alpha=0.0, beta=1e9, name="bandwidth-only").save(bandwidth_only)
    clear_all_caches()
    try:
        with use_options(cost_profile="gloo-loopback"):
            on_gloo = plan_redistribute(src, dst)
            gloo_cost = redistribute_cost(src, dst)
        with use_options(cost_profile=str(bandwidth_only)):
            on_bandwidth = plan_redistribute(src, dst)
            bandwidth_cost = redistribute_cost(src, dst)
    finally:
        clear_all_caches()
    # The plan cached under one setting is not handed out under the other.
    assert _kinds(on_gloo) == ["all_gather"] and _kinds(on_bandwidth) == ["all_to_all", "all_gather"]
    # redistribute_cost is PyTorch's unit: an estimated time in microseconds. gloo: one all-gather's
    # 487 us latency and 192 B at 0.48 GB/s, plus its local copies (the 5 columns are uneven over 4
    # ranks: pad 64 B, regroup 256 B, trim 160 B) at 2.5 us + 480 B / 37 GB/s; bandwidth only: 168 B
    # received and 168 B copied, at 1 GB/s each.
    assert [step.local_copy_bytes for step in on_gloo] == [480]
    assert sum(step.bytes_per_rank for step in on_bandwidth) == 168
    assert sum(step.local_copy_bytes for step in on_bandwidth) == 168
    assert gloo_cost == pytest.approx(487 + 0.4 + 2.513, rel=0.001)
    assert bandwidth_cost == pytest.approx(0.336, rel=0.001)


def test_the_cost_profile_option_reads_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COST_PROFILE_ENV_VAR, "nccl")
    assert current_options().cost_profile == "nccl"
    monkeypatch.delenv(COST_PROFILE_ENV_VAR)
    assert current_options().cost_profile is None


def test_measured_alphas_win_for_their_group_size_and_survive_json(tmp_path: Path) -> None:
    cost = CollectiveCost(alpha_s=0.0, alpha_per_peer_s=1e-3, beta_bytes_per_s=1e9, measured_alpha_s=((4, 9e-3),))
    assert cost.alpha(4) == pytest.approx(9e-3) and cost.alpha(3) == pytest.approx(2e-3)
    profile = CostProfile(name="m", source="test", costs={kind: cost for kind in COLLECTIVE_KINDS})
    path = tmp_path / "m.json"
    profile.save(path)
    loaded = CostProfile.from_json(json.loads(path.read_text()))
    assert loaded.costs["all_gather"] == cost
