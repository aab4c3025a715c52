"""The time cost model (not wired into the planner yet): pricing, step kinds, profiles, the crossover."""

from __future__ import annotations

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
from shardwise.mesh._cost_profile import COLLECTIVE_KINDS, COST_PROFILE_ENV_VAR, CollectiveCost, CostProfile
from shardwise.placement import Partial, Replicate, Shard


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
    from shardwise.dtensor_ops._redistribute_plan import find_cheapest_plan

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
    # No argument, no variable, no process group: gloo's measured default.
    gloo = collective_time("all_gather", 0, ShapeMesh((4,)), 0)
    assert gloo == pytest.approx(3 * 1411e-6)


def test_crossover_table_lists_alpha_times_beta_per_kind_and_group_size() -> None:
    rows = crossover_table(_profile(alpha=10e-6, beta=1e9, per_peer=10e-6), [2, 8])
    assert ("all_gather", 2, pytest.approx(20e3)) in rows
    assert ("all_reduce", 8, pytest.approx(80e3)) in rows
    assert {kind for kind, _, _ in rows} == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}


def test_the_pricer_cache_key_changes_with_the_profile() -> None:
    assert StepPricer(MESH_2X4, _profile(beta=1e9)).cache_key != StepPricer(MESH_2X4, _profile(beta=2e9)).cache_key
    assert StepPricer(MESH_2X4, _profile()).cache_key == StepPricer(MESH_2X4, _profile()).cache_key
