"""Cost profiles without processes: pricing rules, precedence, node spans, JSON, selection."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from shardwise.mesh import MeshError
from shardwise.mesh._cost_profile import (
    BUILTIN_PROFILES,
    COLLECTIVE_KINDS,
    COST_PROFILE_ENV_VAR,
    CollectiveCost,
    CostProfile,
    active_cost_profile,
    load_cost_profile,
)


@dataclass
class GridMesh:
    """A mesh double: its grid of global ranks, names and this rank's coordinate."""

    grid: torch.Tensor
    names: tuple[str, ...] | None
    coordinate: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.grid.shape)

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self.names

    @property
    def mesh(self) -> torch.Tensor:
        return self.grid

    def get_coordinate(self) -> tuple[int, ...]:
        return self.coordinate


def _uniform(alpha: float, beta: float, per_peer: float = 0.0) -> dict[str, CollectiveCost]:
    return {kind: CollectiveCost(alpha_s=alpha, beta_bytes_per_s=beta, alpha_per_peer_s=per_peer) for kind in COLLECTIVE_KINDS}


# (dp=2, tp=4) over 8 ranks; with 4 ranks per node, tp stays in a node and dp crosses nodes.
TWO_NODES = GridMesh(torch.arange(8).reshape(2, 4), ("dp", "tp"), (1, 2))


def test_time_is_alpha_plus_bytes_over_beta_and_alpha_grows_per_peer() -> None:
    cost = CollectiveCost(alpha_s=10e-6, beta_bytes_per_s=1e9, alpha_per_peer_s=2e-6)
    assert cost.alpha(1) == pytest.approx(10e-6) and cost.alpha(4) == pytest.approx(16e-6)
    assert cost.time(1e6, 4) == pytest.approx(16e-6 + 1e-3)
    with pytest.raises(MeshError, match="beta_bytes_per_s > 0"):
        CollectiveCost(alpha_s=1e-6, beta_bytes_per_s=0.0)
    with pytest.raises(MeshError, match="alpha_s >= 0"):
        CollectiveCost(alpha_s=-1e-6, beta_bytes_per_s=1.0)


def test_calibrated_dims_win_then_inter_node_costs_then_the_defaults() -> None:
    profile = CostProfile(
        name="t",
        source="test",
        costs=_uniform(1e-6, 100e9),
        inter_node_costs=_uniform(20e-6, 10e9),
        dim_costs={"tp": {"all_gather": CollectiveCost(alpha_s=3e-6, beta_bytes_per_s=300e9)}, "1": _uniform(9e-6, 9e9)},
        ranks_per_node=4,
    )
    # tp by name beats its index "1"; kinds the name's table lacks fall to the index table.
    assert profile.beta("all_gather", TWO_NODES, 1) == 300e9
    assert profile.beta("all_reduce", TWO_NODES, 1) == 9e9
    # dp spans the two nodes: inter-node costs; the joint (dp, tp) group does too.
    assert profile.beta("all_gather", TWO_NODES, 0) == 10e9
    assert profile.cost("all_to_all", TWO_NODES, (0, 1)) == (profile.inter_node_costs["all_to_all"], 8)  # type: ignore[index]
    within_a_node = CostProfile(name="t2", source="", costs=_uniform(1e-6, 100e9), inter_node_costs=_uniform(20e-6, 10e9), ranks_per_node=8)
    assert within_a_node.beta("all_gather", TWO_NODES, 0) == 100e9
    with pytest.raises(MeshError, match="unknown collective kind 'broadcast'"):
        profile.cost("broadcast", TWO_NODES, 0)
    with pytest.raises(MeshError, match="mesh dim 2 is out of range"):
        profile.cost("all_gather", TWO_NODES, 2)


def test_node_span_comes_from_local_world_size_when_the_profile_does_not_say(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = CostProfile(name="t", source="", costs=_uniform(1e-6, 100e9), inter_node_costs=_uniform(20e-6, 10e9))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert profile.beta("all_gather", TWO_NODES, 0) == 100e9  # unknown layout: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert profile.beta("all_gather", TWO_NODES, 0) == 10e9
    assert profile.beta("all_gather", TWO_NODES, 1) == 100e9


def test_profiles_need_every_kind_and_only_known_kinds() -> None:
    with pytest.raises(MeshError, match=r"costs lacks \['local_copy'\]"):
        CostProfile(name="t", source="", costs={k: v for k, v in _uniform(1e-6, 1e9).items() if k != "local_copy"})
    with pytest.raises(MeshError, match=r"dim_costs\['tp'\] names unknown kinds \['gather'\]"):
        CostProfile(name="t", source="", costs=_uniform(1e-6, 1e9), dim_costs={"tp": {"gather": CollectiveCost(1e-6, 1e9)}})


def test_json_round_trip_and_loading_by_name_or_path(tmp_path: Path) -> None:
    profile = CostProfile(
        name="mine", source="unit test", costs=_uniform(2e-6, 5e9, 1e-6), dim_costs={"tp": _uniform(3e-6, 7e9)}, ranks_per_node=8
    )
    path = tmp_path / "profile.json"
    profile.save(path)
    assert load_cost_profile(str(path)) == profile
    assert load_cost_profile("nccl") is BUILTIN_PROFILES["nccl"]
    with pytest.raises(MeshError, match="neither a built-in profile"):
        load_cost_profile(str(tmp_path / "missing.json"))
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(MeshError, match="not a shardwise cost profile"):
        load_cost_profile(str(tmp_path / "other.json"))
    broken = profile.to_json()
    del broken["costs"]["all_reduce"]["beta_bytes_per_s"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(MeshError, match="costs is malformed"):
        load_cost_profile(str(tmp_path / "broken.json"))


def test_selection_argument_then_environment_then_backend_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COST_PROFILE_ENV_VAR, raising=False)
    assert active_cost_profile(backend="nccl").name == "nccl"
    assert active_cost_profile(backend="gloo").name == "gloo-loopback"
    assert active_cost_profile().name == "gloo-loopback"
    path = tmp_path / "env.json"
    CostProfile(name="from-env", source="", costs=_uniform(1e-6, 1e9)).save(path)
    monkeypatch.setenv(COST_PROFILE_ENV_VAR, str(path))
    assert active_cost_profile(backend="nccl").name == "from-env"
    assert active_cost_profile("nccl-inter-node", backend="gloo").name == "nccl-inter-node"
    explicit = CostProfile(name="explicit", source="", costs=_uniform(1e-6, 1e9))
    assert active_cost_profile(explicit) is explicit


def test_builtin_profiles_are_complete_and_state_their_source() -> None:
    assert set(BUILTIN_PROFILES) == {"gloo-loopback", "nccl", "nccl-intra-node", "nccl-inter-node"}
    for profile in BUILTIN_PROFILES.values():
        assert profile.source and set(profile.costs) == set(COLLECTIVE_KINDS)
    # NVLink moves bytes an order of magnitude faster than InfiniBand, which beats gloo on loopback.
    line = GridMesh(torch.arange(8), None, (0,))
    intra, inter, gloo = (BUILTIN_PROFILES[name] for name in ("nccl-intra-node", "nccl-inter-node", "gloo-loopback"))
    assert intra.beta("all_gather", line, 0) > 5 * inter.beta("all_gather", line, 0) > 5 * gloo.beta("all_gather", line, 0)
