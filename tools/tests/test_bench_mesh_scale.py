"""bench_mesh_scale on the smallest worlds: both stacks measured, figures consistent, a PNG written."""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.tools.bench_mesh_scale import main


def test_a_small_run_reports_both_stacks_and_writes_the_plot(tmp_path: Path) -> None:
    figures, plot = tmp_path / "scale.json", tmp_path / "scale.png"
    argv = ["--ndims", "1,3", "--max-ranks", "64", "--repeats", "1", "--plan-repeats", "1"]
    assert main([*argv, "--json", str(figures), "--png", str(plot)]) == 0
    data = json.loads(figures.read_text())
    shapes = [tuple(row["shape"]) for row in data["init"]]
    assert shapes == [(64,), (4, 4, 4)]
    three_d = data["init"][1]
    # shardwise creates this rank's 3 groups only; PyTorch's DeviceMesh calls c10d for all 48 sub-groups.
    assert three_d["shardwise_group_calls"] == 3 and three_d["torch_group_calls"] == 48
    assert three_d["shardwise_groups_held"] == three_d["torch_groups_held"] == 3
    assert all(row["shardwise_cold_us"] > 0 and row["torch_cold_us"] > 0 for row in data["planning"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
