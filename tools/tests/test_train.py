"""The demo trainer end to end: launcher, tensor-parallel workers, reference run, parity, report.

Each test starts the trainer as a user would (``python -m shardwise.tools.train``), which
starts its ranks through torch.distributed.run, so these take ~20 s each on 2 cores.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
import subprocess
import sys

import pytest

TINY_MODEL = ["--steps", "3", "--dim", "16", "--n-layers", "1", "--n-heads", "4", "--seq-len", "8", "--batch-size", "2"]
SUMMARY_FIELDS = {
    "config", "world_size", "mesh", "model", "steps", "tokens_per_step", "final_loss", "losses", "reference_losses",
    "time_seconds", "tokens_per_second", "collectives_per_step", "parity", "plot",
}


def _run_trainer(flags: list[str], output_dir: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # The trainer and its ranks import shardwise from wherever this test does (runfiles under Bazel).
    env["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("BUILD_WORKING_DIRECTORY", None)
    return subprocess.run(
        [sys.executable, "-m", "shardwise.tools.train", *flags, "--output-dir", str(output_dir)],
        env=env, capture_output=True, text=True, timeout=240,
    )


def _png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    return width, height


def _check_outputs(
    result: subprocess.CompletedProcess[str], output_dir: pathlib.Path, steps: int, counted: bool = True
) -> dict[str, object]:
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert re.search(r"parity\s+PASS", result.stdout), result.stdout[-3000:]
    collectives_line = r"collectives/step\s+\d+\s+\(forward: " if counted else r"collectives/step\s+not counted \(--compile\)"
    assert re.search(collectives_line, result.stdout), result.stdout[-3000:]
    assert f"step {steps}/{steps}" in result.stdout

    summary = json.loads((output_dir / "summary.json").read_text())
    assert SUMMARY_FIELDS <= set(summary), SUMMARY_FIELDS - set(summary)
    assert summary["steps"] == steps
    assert len(summary["losses"]) == len(summary["reference_losses"]) == steps
    assert summary["parity"]["verdict"] == "PASS" and summary["parity"]["max_abs_param_diff"] < 1e-9
    assert summary["tokens_per_second"] > 0
    plot = pathlib.Path(summary["plot"])
    assert plot == output_dir / "loss_curve.png"
    width, height = _png_size(plot)
    assert width > 300 and height > 300
    return summary


def test_default_run_with_sequence_and_loss_parallel(tmp_path: pathlib.Path) -> None:
    result = _run_trainer(TINY_MODEL, tmp_path)
    summary = _check_outputs(result, tmp_path, steps=3)
    assert summary["world_size"] == 4
    collectives = summary["collectives_per_step"]
    assert isinstance(collectives, dict)
    assert collectives["counted_steps"] == [1, 3] and collectives["same_every_counted_step"]
    # One Transformer block with sequence parallelism: an all-gather before attention, before the
    # feed-forward and before the output projection; a reduce-scatter after the token embedding,
    # attention and the feed-forward; an all-to-all moving the position embeddings from
    # feature shards to sequence shards; loss_parallel's 3 all-reduces. Backward mirrors the
    # forward layout changes.
    assert collectives["per_phase"]["forward"] == {
        "all_gather_into_tensor": 3, "all_reduce": 3, "all_to_all_single": 1, "reduce_scatter_tensor": 3,
    }
    assert collectives["per_phase"]["backward"] == {
        "all_gather_into_tensor": 3, "all_to_all_single": 1, "reduce_scatter_tensor": 3,
    }
    # The 3 sequence-parallel LayerNorms' weights and biases have Partial gradients, reduced together
    # by one all-reduce (redistribute_together); gradient clipping sums the squares of all sharded
    # gradients in one more all-reduce.
    assert collectives["per_phase"]["optimizer"] == {"all_reduce": 2}


def test_a_rank_failing_mid_step_ends_the_job_with_its_traceback_first(tmp_path: pathlib.Path) -> None:
    """--fail-at-step 2 --fail-rank 1: rank 1 raises after its forward while the others run the backward's
    collectives. The job ends (no rank left running: the launcher reports every rank's exit), exit status 1,
    rank 1's traceback is the first one printed and the launcher names it first. Timing is not asserted
    (a loaded machine); bench_fault_exit measures it."""
    result = _run_trainer([*TINY_MODEL, "--steps", "4", "--fail-at-step", "2", "--fail-rank", "1"], tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode == 1, log[-6000:]
    first_traceback = re.search(r"\[rank(\d)\]: Traceback \(most recent call last\)", log)
    assert first_traceback is not None and first_traceback.group(1) == "1", log[-6000:]
    assert "InjectedFault: injected fault (--fail-at-step 2 --fail-rank 1): rank 1 raises in step 2" in log
    summary_line = next(line for line in log.splitlines() if line.startswith("training failed: "))
    assert summary_line.startswith("training failed: rank 1 exit code 1 (InjectedFault"), summary_line
    assert all(f"rank {rank} exit code" in summary_line for rank in range(4)), summary_line
    assert "step 3/4" not in log  # no rank trained past the failed step
    assert not (tmp_path / "summary.json").exists()


def test_fault_injection_flags_are_checked() -> None:
    from shardwise.tools.train import parse_config

    with pytest.raises(SystemExit):
        parse_config(["--fail-at-step", "2", "--fail-rank", "4"])  # 4 ranks: 0..3
    assert parse_config(["--fail-at-step", "2", "--fail-rank", "3"]).fail_rank == 3


def test_plain_tensor_parallel_on_two_ranks(tmp_path: pathlib.Path) -> None:
    result = _run_trainer([*TINY_MODEL, "--tp", "2", "--no-seq-parallel", "--no-loss-parallel"], tmp_path)
    summary = _check_outputs(result, tmp_path, steps=3)
    assert summary["world_size"] == 2
    collectives = summary["collectives_per_step"]
    assert isinstance(collectives, dict)
    # Without sequence parallelism each row-parallel layer (token embedding, attention output,
    # feed-forward output) all-reduces its output; the position embeddings (split by feature)
    # and the logits are all-gathered.
    assert collectives["per_phase"]["forward"] == {"all_gather_into_tensor": 2, "all_reduce": 3}
    assert collectives["per_phase"]["optimizer"] == {"all_reduce": 1}  # the gradient norm for clipping


def test_fsdp_times_tensor_parallel_on_a_2x2_mesh_then_resumed_on_another_layout(tmp_path: pathlib.Path) -> None:
    """FSDP x TP 2x2 trains steps 1-3 (its collectives checked) and writes a checkpoint; TP over 4 ranks resumes
    it for steps 4-6, and the resumed losses and final parameters match an uninterrupted single-process run of
    6 steps. (One launch serves both: each launch starts 4 fresh interpreters.)"""
    model = [flag for flag in TINY_MODEL if flag not in ("--steps", "3", "--batch-size", "2")] + ["--batch-size", "4"]
    checkpoint = tmp_path / "checkpoint"
    result = _run_trainer([*model, "--steps", "3", "--dp", "2", "--tp", "2", "--checkpoint-dir", str(checkpoint)],
                          tmp_path / "first")
    summary = _check_outputs(result, tmp_path / "first", steps=3)
    assert summary["world_size"] == 4
    assert summary["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "tp"]}
    assert "mesh dp=2 x tp=2" in result.stdout
    per_phase = summary["collectives_per_step"]["per_phase"]
    # Tensor parallelism's collectives as in the default run, plus FSDP's: two units (the block
    # and the root), one all-gather each in forward, the block's again in backward, and one
    # reduce-scatter each. The SP norms' Partial gradients (3 norms, weight and bias) are reduced
    # over tp in backward, where FSDP needs true gradients, together per unit (one all-reduce for
    # the block's two norms, one for the root's); clipping reduces the norm over dp and tp (the
    # norms' parameters are sharded over dp only: one more all-reduce).
    assert per_phase["forward"] == {
        "all_gather_into_tensor": 3 + 2, "all_reduce": 3, "all_to_all_single": 1, "reduce_scatter_tensor": 3,
    }
    assert per_phase["backward"] == {
        "all_gather_into_tensor": 3 + 1, "all_reduce": 2, "all_to_all_single": 1, "reduce_scatter_tensor": 3 + 2,
    }
    assert per_phase["optimizer"] == {"all_reduce": 3}

    assert (checkpoint / ".metadata").is_file()
    resumed = _run_trainer([*model, "--steps", "6", "--tp", "4", "--resume", "--checkpoint-dir", str(checkpoint)],
                           tmp_path / "resumed")
    assert f"resumed from {checkpoint} at step 3" in resumed.stdout
    assert "step 4/6" in resumed.stdout and "step 3/6" not in resumed.stdout.split("single-process reference")[0]
    resumed_summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert resumed.returncode == 0 and resumed_summary["parity"]["verdict"] == "PASS", resumed.stdout[-3000:]
    assert len(resumed_summary["losses"]) == 3 and resumed_summary["mesh"]["shape"] == [4]


def test_fsdp_times_tensor_parallel_compiled_whole(tmp_path: pathlib.Path) -> None:
    """--compile with --dp: forward and loss, fully_shard's gathers included, as one graph; parity as in eager."""
    result = _run_trainer([*TINY_MODEL, "--dp", "2", "--tp", "2", "--compile", "--compile-backend", "aot_eager"], tmp_path)
    summary = _check_outputs(result, tmp_path, steps=3, counted=False)
    assert summary["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "tp"]}
    assert "torch.compile(fullgraph=True, backend='aot_eager')" in result.stdout


def test_automatic_plan_on_a_data_and_tensor_parallel_mesh(tmp_path: pathlib.Path) -> None:
    result = _run_trainer([*TINY_MODEL, "--plan", "auto", "--dp", "2", "--tp", "2"], tmp_path)
    summary = _check_outputs(result, tmp_path, steps=3)
    assert "--plan auto: the plan auto_parallelize chose" in result.stdout
    assert "fully_shard(model" in result.stdout  # the dp dim is FSDP's
    estimated = re.search(r"# estimated step per rank: .*?; (\d+) collectives", result.stdout)
    assert estimated is not None, result.stdout[-3000:]
    collectives = summary["collectives_per_step"]
    assert isinstance(collectives, dict)
    assert int(estimated.group(1)) == collectives["total"], result.stdout[-4000:]
    # And the bytes one rank receives in them, to FSDP's padding.
    assert abs(_estimated_bytes(result.stdout) - collectives["bytes_received"]) <= 0.1 * collectives["bytes_received"]


def _estimated_bytes(stdout: str) -> float:
    found = re.search(r"# estimated step per rank: .*?; ([\d.]+) (B|KB|MB|GB) received;", stdout)
    assert found is not None, stdout[-3000:]
    return float(found.group(1)) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[found.group(2)]
