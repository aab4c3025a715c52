"""torchtitan 0.3.0, unmodified, trains on shardwise: its Llama 3 debug model (2 layers) through its own Trainer,
ParallelDims and parallelize code on 4 gloo CPU ranks, torch's DTensor paths resolved to shardwise by the switch.

Every configuration starts from one seed checkpoint and must give the losses of one process on the same global
batch (relative 1e-5). The
runs share processes: one torchrun launch per SPMD backend trains all of that backend's configurations
(shardwise.tools.torchtitan_run); each launch starts interpreters of a virtual environment with the switch's .pth installed,
with ``SHARDWISE_AS_TORCH=1``, as a user's torchrun would.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from shardwise.tools import torchtitan_run
from shardwise.torch_switch import ENVIRONMENT_VARIABLE, switched_environment

# backend -> the configurations (torchtitan_run.CONFIGS) that train on shardwise in it.
BACKENDS: dict[str, list[str]] = {
    # moe_ep2_fsdp4: deepseek_v3's debug MoE, expert parallel 2 inside FSDP 4 (spmd_types' own uneven all_to_all
    # is a list all_to_all of unequal tensors, which gloo refuses, so that backend's MoE needs NCCL).
    # tp4_compile: torchtitan's per-block compile (aot_eager) of TP blocks, each also an FSDP unit.
    "full_dtensor": ["tp4", "fsdp2_tp2", "hsdp2x2", "moe_ep2_fsdp4", "tp4_compile"],
    "partial_dtensor": ["tp4", "fsdp2_tp2", "hsdp2x2", "cp2_tp2", "moe_ep2_fsdp4", "tp4_compile"],
    # torchtitan's default: plain typed tensors in compute, fully_shard(dp_mesh_dims=...) on annotated plain
    # parameters (torch 2.13's fully_shard refuses them).
    "spmd_types": ["tp4", "fsdp2_tp2", "hsdp2x2"],
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("titan")


@pytest.fixture(scope="module")
def python(run_dir: pathlib.Path) -> str:
    return switched_environment(str(run_dir / "venv"))


def _launch(
    python: str, run_dir: pathlib.Path, ranks: int, backend: str, configs: list[str], switch: bool = True,
    tag: str = "",
) -> dict[str, dict]:
    out_json = run_dir / f"{backend}_{ranks}{tag}.json"
    env = dict(os.environ)
    env.pop(ENVIRONMENT_VARIABLE, None)
    if switch:
        env[ENVIRONMENT_VARIABLE] = "1"
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         "-m", "shardwise.tools.torchtitan_run", str(out_json), backend, *configs],
        env=env, cwd=run_dir, capture_output=True, text=True, timeout=1800,
    )
    assert out_json.exists(), f"torchrun exited {done.returncode} before any result\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    results: dict[str, dict] = json.loads(out_json.read_text())
    failed = {name: result["error"] for name, result in results.items() if "error" in result}
    assert not failed, f"{failed}\n{done.stderr[-8000:]}"
    assert done.returncode == 0, done.stderr[-8000:]
    return results


REFERENCES = ["single", "single_x2", "single_x4", "moe_single_x4"]
SEEDS = {"single": "seed", "moe_single_x4": "moe_seed"}  # the launch that writes a model's seed checkpoint


@pytest.fixture(scope="module")
def one_process(python: str, run_dir: pathlib.Path) -> dict[str, list[float]]:
    """Writes the seed checkpoints (Llama 3, deepseek_v3) and trains them on one process (torch's own modules, the switch off) on the global
    batch of 1, 2 and 4 data-parallel ranks: the losses each configuration must give."""
    # One launch each: PyTorch's DeviceMesh keeps state across process groups that makes a second Trainer in
    # the same process fail ("Expected param's DTensor mesh to be the same mesh passed to fully_shard").
    references = {}
    for name in REFERENCES:
        results = _launch(python, run_dir, 1, "full_dtensor", [SEEDS[name], name] if name in SEEDS else [name],
                          switch=False, tag=name)
        references[name] = results[name]["losses"]
    for losses in references.values():
        assert len(losses) == torchtitan_run.STEPS and all(math.isfinite(loss) for loss in losses)
    return references


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_torchtitan_trains_on_shardwise_like_one_process(
    backend: str, python: str, run_dir: pathlib.Path, one_process: dict[str, list[float]]
) -> None:
    results = _launch(python, run_dir, 4, backend, BACKENDS[backend])
    for name in BACKENDS[backend]:
        losses, expected = results[name]["losses"], one_process[torchtitan_run.reference_for(name)]
        assert len(losses) == len(expected), (name, losses)
        for step, (ours, reference) in enumerate(zip(losses, expected), start=1):
            assert abs(ours - reference) <= 1e-5 * abs(reference), (
                f"{backend}/{name} step {step}: loss {ours} on shardwise, {reference} on one process"
            )
