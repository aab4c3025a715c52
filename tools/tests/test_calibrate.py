"""shardwise.tools.calibrate: the fit, the size parser, and one real run on 2 spawned gloo ranks."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from shardwise.mesh._cost_profile import COLLECTIVE_KINDS, load_cost_profile
from shardwise.tools.calibrate import fit_alpha_beta, main, parse_args, parse_size


def test_the_fit_recovers_alpha_and_beta_of_exact_points() -> None:
    alpha, beta = 250e-6, 2.5e9
    sizes = [1e3, 1e5, 1e6, 8e6]
    cost = fit_alpha_beta(sizes, [alpha + size / beta for size in sizes])
    assert cost.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert cost.beta_bytes_per_s == pytest.approx(beta, rel=1e-6)


def test_a_flat_line_means_no_bandwidth_limit_not_a_negative_one() -> None:
    cost = fit_alpha_beta([1e3, 1e6], [5e-3, 4e-3])
    assert cost.beta_bytes_per_s >= 1e15 and cost.alpha_s == pytest.approx(5e-3, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        fit_alpha_beta([1e3], [1e-3])


def test_sizes_and_flags_are_checked_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_size("4K") == 4096 and parse_size("1M") == 1 << 20 and parse_size("512") == 512 and parse_size("2MB") == 2 << 20
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte count"):
        parse_size("lots")
    monkeypatch.delenv("RANK", raising=False)
    config, world = parse_args(["--nproc", "4", "--mesh", "2x2", "--dim-names", "dp,tp"])
    assert world == 4 and config.mesh_shape == (2, 2) and config.dim_names == ("dp", "tp")
    for bad in (["--nproc", "4", "--mesh", "2x3"], ["--nproc", "4", "--dim-names", "a,b"], ["--sizes", "4K"], ["--nproc", "1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_calibrating_two_gloo_ranks_writes_a_profile_that_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    output = tmp_path / "profile.json"
    assert main(["--nproc", "2", "--dim-names", "tp", "--sizes", "1K,64K", "--iters", "2", "--output", str(output)]) == 0
    profile = load_cost_profile(str(output))
    assert set(profile.costs) == set(COLLECTIVE_KINDS)
    assert set(profile.dim_costs) == {"0", "tp"}
    for cost in profile.dim_costs["tp"].values():
        assert cost.alpha_s >= 0 and cost.beta_bytes_per_s > 0
    assert "2 ranks, backend gloo" in profile.source
