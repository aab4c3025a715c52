"""The demo trainer on CUDA: `--device cuda` with TP alone and FSDP x TP.

Started as a user would (``python -m shardwise.tools.train --device cuda``; the launcher starts its
ranks through torch.distributed.run). ``--dtype auto`` trains in float32 on cuda (the fused attention
kernels take no float64), checked against the single-GPU plain-torch run with the trainer's float32
tolerances. The checkpoint and the plot go to this test's temporary directory.

With 4 GPUs the ranks run NCCL, one GPU each (Bazel: tagged gpu, gpu-count=4). With 1 to 3 GPUs they
share them over gloo with CUDA tensors (``--backend gloo``): the same CUDA kernels, gloo's transport.
Skips without CUDA, with the reason.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from shardwise.compile_support import compile_refusal

WORLD = 4
TINY_MODEL = ["--steps", "6", "--dim", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16", "--batch-size", "4"]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _backend_flags() -> list[str]:
    """NCCL when every rank has a GPU of its own; else the ranks share the GPUs over gloo."""
    return [] if torch.cuda.device_count() >= WORLD else ["--backend", "gloo"]


def _run_trainer(flags: list[str], output_dir: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    env.pop("BUILD_WORKING_DIRECTORY", None)
    return subprocess.run(
        [sys.executable, "-m", "shardwise.tools.train", "--device", "cuda", *_backend_flags(), *TINY_MODEL, *flags,
         "--output-dir", str(output_dir)],
        env=env, capture_output=True, text=True, timeout=900,
    )


def _summary(result: subprocess.CompletedProcess[str], output_dir: pathlib.Path) -> dict[str, object]:
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert re.search(r"parity\s+PASS", result.stdout), result.stdout[-3000:]
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["parity"]["verdict"] == "PASS", summary["parity"]
    return summary


@pytest.mark.parametrize("layout", [["--tp", "4"], ["--dp", "2", "--tp", "2"]], ids=["tp4", "dp2_tp2"])
def test_trainer_on_cuda_keeps_parity_with_one_gpu(layout: list[str], tmp_path: pathlib.Path) -> None:
    summary = _summary(_run_trainer(layout, tmp_path), tmp_path)
    assert summary["world_size"] == WORLD
    assert (tmp_path / "loss_curve.png").exists()


def test_trainer_on_cuda_resumes_from_its_checkpoint(tmp_path: pathlib.Path) -> None:
    layout = ["--dp", "2", "--tp", "2", "--checkpoint-dir", str(tmp_path / "checkpoint")]
    _summary(_run_trainer([*layout, "--steps", "3"], tmp_path / "first"), tmp_path / "first")
    _summary(_run_trainer([*layout, "--resume"], tmp_path / "resumed"), tmp_path / "resumed")


@pytest.mark.skipif(compile_refusal() is not None, reason=f"torch.compile of DTensor code: {compile_refusal()}")
def test_trainer_compiled_on_cuda_keeps_parity(tmp_path: pathlib.Path) -> None:
    _summary(_run_trainer(["--dp", "2", "--tp", "2", "--compile"], tmp_path), tmp_path)
