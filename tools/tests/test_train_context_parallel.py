"""The demo trainer with context parallelism (--model llama --cp N): parity with one process, the mesh, the counts.

Started as a user would (``python -m shardwise.tools.train``); ~25 s per run on 2 cores.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

TINY_LLAMA = [
    "--model", "llama", "--steps", "3", "--dim", "16", "--n-layers", "1", "--n-heads", "4", "--batch-size", "2",
]  # fmt: skip


def _run_trainer(flags: list[str], output_dir: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("BUILD_WORKING_DIRECTORY", None)
    return subprocess.run(
        [sys.executable, "-m", "shardwise.tools.train", *flags, "--output-dir", str(output_dir)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def _passed(result: subprocess.CompletedProcess[str], output_dir: pathlib.Path) -> dict[str, object]:
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert re.search(r"parity\s+PASS", result.stdout), result.stdout[-3000:]
    summary: dict[str, object] = json.loads((output_dir / "summary.json").read_text())
    parity = summary["parity"]
    assert isinstance(parity, dict) and parity["max_abs_param_diff"] < 1e-9
    return summary


def test_data_parallel_times_context_parallel_with_an_uneven_sequence(tmp_path: pathlib.Path) -> None:
    # 10 tokens per sequence on 2 cp ranks: head-tail chunks of 3, 2, 2, 3 (10 is not a multiple of 2 * cp).
    result = _run_trainer([*TINY_LLAMA, "--dp", "2", "--cp", "2", "--seq-len", "10"], tmp_path)
    summary = _passed(result, tmp_path)
    assert summary["world_size"] == 4
    assert summary["mesh"] == {"shape": [2, 2, 1], "dim_names": ["dp", "cp", "tp"]}
    assert "cp=2 (context parallel, ring attention)" in result.stdout
    # Each token counted once: batch x sequence, not times the cp ranks that share a sequence.
    assert summary["tokens_per_step"] == 2 * 10


def test_context_parallel_times_tensor_parallel_with_grouped_query_attention(tmp_path: pathlib.Path) -> None:
    result = _run_trainer([*TINY_LLAMA, "--cp", "2", "--tp", "2", "--n-kv-heads", "2", "--seq-len", "12"], tmp_path)
    summary = _passed(result, tmp_path)
    assert summary["mesh"] == {"shape": [2, 2], "dim_names": ["cp", "tp"]}
    collectives = summary["collectives_per_step"]
    assert isinstance(collectives, dict)
    per_phase = collectives["per_phase"]
    # The ring (default all-gather rotation, one layer): one all-gather of key/value forward and one
    # backward, key/value gradients handed on twice (cp = 2); the cp gradients summed in one all-reduce.
    assert per_phase["backward"]["all_to_all_single"] == 2
    assert per_phase["optimizer"]["allreduce_"] == 1
    assert per_phase["forward"]["all_gather_into_tensor"] == 1 + 1  # ring + the gathered logits


def test_context_parallel_needs_the_llama_model(tmp_path: pathlib.Path) -> None:
    result = _run_trainer(["--cp", "2", "--tp", "2"], tmp_path)
    assert result.returncode == 2
    assert "--cp 2 needs --model llama" in result.stderr


def test_automatic_plan_on_a_context_and_tensor_parallel_mesh(tmp_path: pathlib.Path) -> None:
    result = _run_trainer([*TINY_LLAMA, "--plan", "auto", "--cp", "2", "--tp", "2", "--seq-len", "12"], tmp_path)
    summary = _passed(result, tmp_path)
    assert summary["mesh"] == {"shape": [2, 2], "dim_names": ["cp", "tp"]}
    assert "--plan auto: the plan auto_parallelize chose" in result.stdout
    assert "context parallel attention" in result.stdout  # the plan puts the cp dim to context parallelism
    # The planner's estimate counts the collectives the step then issues.
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
