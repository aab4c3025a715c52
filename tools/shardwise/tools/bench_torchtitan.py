"""torchtitan 0.3.0's training step on shardwise vs on PyTorch's DTensor, as ratios from one run.

    python -m shardwise.tools.bench_torchtitan [--steps 8] [--out DIR]

Runs ``shardwise.tools.torchtitan_run`` under torchrun (4 gloo CPU ranks) in a virtual environment with the
switch's ``.pth`` (``shardwise.torch_switch.switched_environment``): once with ``SHARDWISE_AS_TORCH`` unset
(PyTorch's own DTensor, mesh and FSDP2) and once with it set (shardwise), alternating per backend, on the
configurations both stacks train on CPU (``--configs`` names others, e.g. ``spmd_types/fsdp2_tp2`` or
``partial_dtensor/moe_ep2_fsdp4``, which PyTorch cannot run here: their shardwise times are printed alone). Prints each configuration's median step time (the first step,
which includes one-time work, left out) on both and the ratio shardwise/PyTorch, and whether the losses
agree. Configurations PyTorch cannot run on CPU are reported with its error, not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from shardwise.torch_switch import ENVIRONMENT_VARIABLE, switched_environment

# backend -> configurations of shardwise.tools.torchtitan_run.CONFIGS timed on both stacks.
TIMED: dict[str, list[str]] = {
    "full_dtensor": ["tp4", "fsdp2_tp2", "hsdp2x2"],
    "partial_dtensor": ["tp4", "fsdp2_tp2", "hsdp2x2"],
}


def _launch(python: str, out_dir: pathlib.Path, ranks: int, backend: str, configs: list[str], shardwise: bool,
            steps: int) -> dict[str, dict]:
    out_json = out_dir / f"{backend}_{'_'.join(configs)}_{'shardwise' if shardwise else 'torch'}_{ranks}.json"
    env = dict(os.environ)
    env.pop(ENVIRONMENT_VARIABLE, None)
    if shardwise:
        env[ENVIRONMENT_VARIABLE] = "1"
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env["SHARDWISE_TITAN_STEPS"] = str(steps)
    subprocess.run(
        [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         "-m", "shardwise.tools.torchtitan_run", str(out_json), backend, *configs],
        env=env, cwd=out_dir, capture_output=True, text=True, timeout=3600,
    )
    if not out_json.exists():
        return {name: {"error": "no result (torchrun failed before writing one)"} for name in configs}
    results: dict[str, dict] = json.loads(out_json.read_text())
    return results


def _median_step(result: dict) -> float | None:
    steps = result.get("step_seconds") or []
    return statistics.median(steps[1:]) if len(steps) > 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None, help="folder for the runs' files (default: a temporary one)")
    parser.add_argument("--configs", nargs="*", default=None,
                        help="backend/config pairs to time (default: every pair of TIMED)")
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out or tempfile.mkdtemp(prefix="bench_torchtitan_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    python = switched_environment(str(out_dir / "venv"))
    _launch(python, out_dir, 1, "full_dtensor", ["seed"], shardwise=False, steps=args.steps)
    print(f"torchtitan 0.3.0, Llama 3 debug model (2 layers), 4 gloo CPU ranks, {args.steps} steps, median step "
          "time without the first")
    print(f"{'backend/config':28s} {'PyTorch s':>10s} {'shardwise s':>12s} {'ratio':>7s}  losses")
    chosen = [tuple(pair.split("/")) for pair in args.configs] if args.configs else [
        (backend, name) for backend, names in TIMED.items() for name in names
    ]
    if any(name.startswith("moe_") for _, name in chosen):  # deepseek_v3's seed checkpoint
        _launch(python, out_dir, 1, "full_dtensor", ["moe_seed"], shardwise=False, steps=args.steps)
    for backend, name in chosen:
        # One launch per configuration and stack: PyTorch's DeviceMesh keeps state across process groups
        # that makes a second Trainer in one process fail.
        theirs = _launch(python, out_dir, 4, backend, [name], shardwise=False, steps=args.steps)
        ours = _launch(python, out_dir, 4, backend, [name], shardwise=True, steps=args.steps)
        their_step, our_step = _median_step(theirs.get(name, {})), _median_step(ours.get(name, {}))
        label = f"{backend}/{name}"
        if their_step is None and our_step is not None:
            print(f"{label:28s} {'-':>10s} {our_step:12.3f} {'-':>7s}  "
                  f"PyTorch: {theirs.get(name, {}).get('error', 'ran')[:90]}")
            continue
        if their_step is None or our_step is None:
            print(f"{label:28s} {'-' if their_step is None else f'{their_step:.3f}':>10s} "
                  f"{'-' if our_step is None else f'{our_step:.3f}':>12s} {'-':>7s}  "
                  f"PyTorch: {theirs.get(name, {}).get('error', 'ran')[:90]}; "
                  f"shardwise: {ours.get(name, {}).get('error', 'ran')[:90]}")
            continue
        agree = max(abs(a - b) / abs(b) for a, b in zip(ours[name]["losses"], theirs[name]["losses"]))
        print(f"{label:28s} {their_step:10.3f} {our_step:12.3f} {our_step / their_step:7.2f}  "
              f"max relative difference {agree:.1e}")


if __name__ == "__main__":
    main()
