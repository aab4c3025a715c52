"""The automatic plan against the hand-written one: measured step time, collectives, estimates, parity; solve time by depth.

For each model (the model zoo's Transformer at the trainer's default sizes, its Llama at torchtitan's
debugmodel sizes: dim 256, 6 layers, 16 heads, feed-forward 768) and each mesh (tp=4, dp=2 x tp=2,
cp=2 x tp=2), the demo trainer runs twice with the same data and seed: ``--plan manual`` (the model
zoo's hand plan: Megatron TP, for the Transformer with sequence and loss parallelism, FSDP per block)
and ``--plan auto`` (``auto_parallelize``, with ``--budget-ratio`` (default 1.5) times the hand plan's estimated peak memory
per rank as its ``--memory-budget-mb``). Each run is checked against one process (parity) and
reports its median step time, the collectives it counted (CommDebugMode, first and last step) and
the bytes one rank received in them (the trainer's ``CollectiveBytes``, the cost model's convention).
The estimates (time, bytes received, collectives, peak memory per rank) of both plans come from the
planner's own pricing (``price_plan_choice`` for the hand plan stated as a ``PlanChoice``).

Then ``auto_plan`` is timed on 2, 8 and 32 layers of both models (trace, structure, pricing: the
whole solve), with the number of candidates priced.

    python -m shardwise.tools.bench_auto_plan [--steps 8] [--budget-ratio 1.5] [--only transformer|llama] [--skip-runs]

One run of both plans per configuration, side by side: ratios compare runs of one invocation only.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from shardwise.testing import Llama, LlamaArgs, ModelArgs, Transformer
from shardwise.testing._fake_mesh import FakeMesh
from shardwise.tp_styles import auto_plan
from shardwise.tp_styles.auto_plan import PlanChoice, price_plan_choice

MESHES = {"tp=4": ((4,), None, []), "dp=2 x tp=2": ((2, 2), ("dp", "tp"), ["--dp", "2", "--tp", "2"]),
          "cp=2 x tp=2": ((2, 2), ("cp", "tp"), ["--cp", "2", "--tp", "2"])}  # fmt: skip
MODELS = {
    "transformer": ["--model", "transformer", "--dim", "64", "--n-layers", "2", "--n-heads", "4"],
    "llama": ["--model", "llama", "--dim", "256", "--n-layers", "6", "--n-heads", "16"],
}
BATCH, SEQ, VOCAB = 8, 32, 64  # the trainer's defaults; its corpus has 63 characters, padded to 64


def _run(flags: list[str]) -> tuple[dict[str, Any] | None, str]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        result = subprocess.run(
            [sys.executable, "-m", "shardwise.tools.train", *flags, "--output-dir", out],
            env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        path = pathlib.Path(out) / "summary.json"
        if result.returncode != 0 or not path.exists():
            return None, (result.stdout + result.stderr)[-1500:]
        return json.loads(path.read_text()), result.stdout


def _model(name: str, layers: int | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "transformer":
        return Transformer(ModelArgs(n_layers=layers or 2, vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_heads=4, dropout_p=0.0))
    return Llama(LlamaArgs(dim=256, n_layers=layers or 6, n_heads=16, vocab_size=VOCAB, ffn_hidden_dim=768))


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return (tokens,) if name == "transformer" else (tokens, torch.arange(SEQ))


def _hand_choice(name: str, mesh_names: tuple[str, ...] | None) -> PlanChoice:
    """The model zoo's hand plans (Transformer.parallelize, Llama.parallelize, FSDP per block) as planner choices."""
    fsdp = "blocks" if mesh_names and "dp" in mesh_names else "none"
    cp = bool(mesh_names and "cp" in mesh_names)
    if name == "transformer":
        return PlanChoice(
            sequence_parallel=True,
            region_modes=(("layers.*.attention", "tensor_parallel"), ("layers.*.feed_forward", "tensor_parallel")),
            embedding_modes=(("tok_embeddings", "vocabulary"), ("pos_embeddings", "feature")),
            head_mode="loss_parallel", prepare_region_inputs=True, fsdp_units=fsdp, context_parallel=cp,
        )  # fmt: skip
    return PlanChoice(
        sequence_parallel=False,
        region_modes=(("layers.*.attention", "tensor_parallel"), ("layers.*.feed_forward", "tensor_parallel")),
        embedding_modes=(("tok_embeddings", "vocabulary"),),
        head_mode="gathered", prepare_region_inputs=False, fsdp_units=fsdp, context_parallel=cp,
    )  # fmt: skip


def _collectives(summary: dict[str, Any]) -> int:
    return int(summary["collectives_per_step"]["total"])


def _received(summary: dict[str, Any]) -> float:
    """Bytes one rank received in the last counted step's collectives (the trainer's CollectiveBytes)."""
    return float(summary["collectives_per_step"].get("bytes_received") or 0.0)


def compare_plans(steps: int, only: str | None, budget_ratio: float) -> None:
    print("| model | mesh | step ms hand | auto | auto/hand | collectives hand / auto | KB received hand / auto | "
          "estimated ms hand / auto | estimated KB hand / auto | estimated collectives hand / auto | estimated peak MB hand / auto "
          "(budget) | parity hand / auto |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model_name, model_flags in MODELS.items():
        if only and model_name != only:
            continue
        for mesh_label, (shape, names, mesh_flags) in MESHES.items():
            mesh = FakeMesh(shape, dim_names=names)
            loss_fn = F.cross_entropy
            try:
                hand = price_plan_choice(_model(model_name), mesh, _inputs(model_name), _hand_choice(model_name, names), loss_fn=loss_fn)
                # The automatic plan's budget: a multiple of the hand plan's estimated peak memory per rank.
                budget = budget_ratio * hand.peak_memory_bytes
                plan = auto_plan(_model(model_name), mesh, _inputs(model_name), loss_fn=loss_fn, memory_budget_bytes=budget)
            except ValueError as refused:
                print(f"| {model_name} | {mesh_label} | - | - | - | - | - | - | - | - | - | auto_plan refuses: {refused} |")
                continue
            common = [*model_flags, *mesh_flags, "--steps", str(steps), "--dtype", "float32", "--log-every", str(steps)]
            runs: dict[str, dict[str, Any] | None] = {}
            for plan_flag in ("manual", "auto"):
                budget_flags = ["--memory-budget-mb", f"{budget / 1e6:.6f}"] if plan_flag == "auto" else []
                summary, log = _run([*common, "--plan", plan_flag, *budget_flags])
                if summary is None:
                    runs[plan_flag] = summary
                    print(f"<!-- {model_name} {mesh_label} --plan {plan_flag} failed: {log!r} -->")
                else:
                    runs[plan_flag] = summary
            manual, auto = runs["manual"], runs["auto"]
            if manual is None or auto is None:
                print(f"| {model_name} | {mesh_label} | {'failed' if manual is None else ''} | {'failed' if auto is None else ''} | | | | | | | | |")
                continue
            hand_ms, auto_ms = manual["median_step_seconds"] * 1e3, auto["median_step_seconds"] * 1e3
            print(
                f"| {model_name} | {mesh_label} | {hand_ms:.1f} | {auto_ms:.1f} | {auto_ms / hand_ms:.2f} | "
                f"{_collectives(manual)} / {_collectives(auto)} | {_received(manual) / 1e3:.0f} / {_received(auto) / 1e3:.0f} | "
                f"{hand.seconds * 1e3:.1f} / {plan.estimate.seconds * 1e3:.1f} | "
                f"{hand.bytes_received / 1e3:.0f} / {plan.estimate.bytes_received / 1e3:.0f} | "
                f"{hand.collectives} / {plan.estimate.collectives} | {hand.peak_memory_bytes / 1e6:.1f} / "
                f"{plan.estimate.peak_memory_bytes / 1e6:.1f} ({budget / 1e6:.1f}) | {manual['parity']['verdict']} / {auto['parity']['verdict']} |",
                flush=True,
            )
            print(f"<!-- {model_name} {mesh_label} auto: {plan.choice.describe()} -->", flush=True)


def solve_times() -> None:
    print("\n| model | layers | mesh | solve s (trace + structure + pricing) | candidates priced |")
    print("|---|---|---|---|---|")
    for model_name in MODELS:
        for layers in (2, 8, 32):
            for mesh_label, (shape, names, _) in MESHES.items():
                if model_name == "transformer" and names and "cp" in names:
                    continue
                model = _model(model_name, layers)
                started = time.perf_counter()
                plan = auto_plan(model, FakeMesh(shape, dim_names=names), _inputs(model_name), loss_fn=F.cross_entropy)
                elapsed = time.perf_counter() - started
                print(f"| {model_name} | {layers} | {mesh_label} | {elapsed:.2f} | {plan.candidates_priced} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the median excludes the first and the counted ones)")
    parser.add_argument("--only", choices=sorted(MODELS), default=None)
    parser.add_argument("--skip-runs", action="store_true", help="only the solve-time table")
    parser.add_argument(
        "--budget-ratio", type=float, default=1.5,
        help="the automatic plan's --memory-budget-mb: this times the hand plan's estimated peak memory per rank",
    )
    args = parser.parse_args(argv)
    if not args.skip_runs:
        compare_plans(args.steps, args.only, args.budget_ratio)
    solve_times()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
