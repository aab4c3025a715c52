"""What a run leaves behind: the loss-curve PNG, summary.json and the closing text summary."""

from __future__ import annotations

import json
import pathlib
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from ._config import TrainConfig
from ._loop import PHASES, StepRecord
from ._parity import ParityResult

__all__ = [
    "PLOT_FILE_NAME",
    "SUMMARY_FILE_NAME",
    "RunTimes",
    "collectives_per_step",
    "format_collectives",
    "format_summary",
    "plot_losses",
    "summary_dict",
    "throughput",
    "write_summary",
]

PLOT_FILE_NAME = "loss_curve.png"
SUMMARY_FILE_NAME = "summary.json"


@dataclass
class RunTimes:
    total_seconds: float  # every step, counted ones included
    timed_steps: int  # steps that the throughput figures are taken from
    median_step_seconds: float
    tokens_per_second: float


def throughput(records: Sequence[StepRecord], tokens_per_step: int) -> RunTimes:
    """Steady-state speed: without the first step (caches warm up) and without the steps whose
    collectives were counted (CommDebugMode slows them), unless nothing else is left."""
    timed = [record for record in records if record.step > 1 and record.collectives is None]
    if not timed:
        timed = [record for record in records if record.collectives is None] or list(records)
    seconds = [record.seconds for record in timed]
    total_timed = sum(seconds)
    return RunTimes(
        total_seconds=sum(record.seconds for record in records),
        timed_steps=len(timed),
        median_step_seconds=statistics.median(seconds),
        tokens_per_second=tokens_per_step * len(timed) / total_timed if total_timed > 0 else 0.0,
    )


def collectives_per_step(records: Sequence[StepRecord]) -> dict[str, Any]:
    """The counts of the last counted step, and whether every counted step had the same counts."""
    counted = [record for record in records if record.collectives is not None]
    if not counted:
        return {"counted_steps": [], "per_phase": {}, "total": 0, "same_every_counted_step": True}
    last = counted[-1]
    assert last.collectives is not None
    return {
        "counted_steps": [record.step for record in counted],
        "per_phase": {phase: dict(last.collectives.get(phase, {})) for phase in PHASES},
        "total": last.total_collectives,
        "same_every_counted_step": all(record.collectives == last.collectives for record in counted),
        "first_counted_step": counted[0].collectives,
        "bytes_received": last.bytes_received,
    }


def format_collectives(collectives: dict[str, dict[str, int]]) -> str:
    parts = []
    for phase in PHASES:
        counts = collectives.get(phase, {})
        described = ", ".join(f"{name} x{count}" for name, count in counts.items()) or "none"
        parts.append(f"{phase}: {described}")
    return "; ".join(parts)


def plot_losses(
    path: pathlib.Path,
    tp_losses: Sequence[float],
    reference_losses: Sequence[float],
    *,
    title: str,
) -> None:
    """Both loss curves on one axis, and their absolute difference below on a log scale."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    steps = list(range(1, len(tp_losses) + 1))
    figure, (loss_axis, diff_axis) = plt.subplots(
        2, 1, figsize=(7.5, 6.0), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
    )
    try:
        loss_axis.plot(
            steps, tp_losses, marker="o", markersize=3, linewidth=1.8, label="tensor parallel (shardwise DTensor)"
        )
        loss_axis.plot(
            list(range(1, len(reference_losses) + 1)), reference_losses, linestyle="--", linewidth=1.4, color="black",
            label="single process (plain torch)",
        )
        loss_axis.set_ylabel("training loss (cross-entropy, nats)")
        loss_axis.set_title(title, fontsize=10)
        loss_axis.grid(True, alpha=0.3)
        loss_axis.legend()
        count = min(len(tp_losses), len(reference_losses))
        differences = [abs(tp_losses[i] - reference_losses[i]) for i in range(count)]
        # A zero has no place on a log axis: zeros are drawn a decade below the smallest difference.
        nonzero = [difference for difference in differences if difference > 0]
        floor = min(nonzero) / 10 if nonzero else 1e-16
        drawn = [max(difference, floor) for difference in differences]
        diff_axis.semilogy(steps[:count], drawn, marker=".", color="tab:red")
        diff_axis.set_ylabel("|loss difference|" if nonzero else "|loss difference| (all 0)")
        diff_axis.set_xlabel("step")
        diff_axis.grid(True, which="both", alpha=0.3)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)


def summary_dict(
    config: TrainConfig,
    *,
    world_size: int,
    mesh_shape: Sequence[int],
    vocab_size: int,
    corpus_characters: int,
    parameter_count: int,
    tp_records: Sequence[StepRecord],
    reference_records: Sequence[StepRecord],
    parity: ParityResult,
    plot_path: pathlib.Path | None,
    plot_error: str | None,
) -> dict[str, Any]:
    times = throughput(tp_records, config.tokens_per_step)
    reference_times = throughput(reference_records, config.tokens_per_step)
    return {
        "config": config.as_dict(),
        "world_size": world_size,
        "mesh": {"shape": list(mesh_shape), "dim_names": [name for name, _ in config.mesh_dims]},
        "model": {"parameters": parameter_count, "vocab_size": vocab_size},
        "corpus_characters": corpus_characters,
        "steps": len(tp_records),
        "tokens_per_step": config.tokens_per_step,
        "final_loss": tp_records[-1].loss if tp_records else None,
        "losses": [record.loss for record in tp_records],
        "reference_losses": [record.loss for record in reference_records],
        "time_seconds": times.total_seconds,
        "median_step_seconds": times.median_step_seconds,
        "tokens_per_second": times.tokens_per_second,
        "timed_steps": times.timed_steps,
        "reference_time_seconds": reference_times.total_seconds,
        "reference_tokens_per_second": reference_times.tokens_per_second,
        "collectives_per_step": collectives_per_step(tp_records),
        "parity": parity.as_dict(),
        "plot": str(plot_path) if plot_path is not None else None,
        "plot_error": plot_error,
    }


def write_summary(path: pathlib.Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


def format_summary(summary: dict[str, Any], summary_path: pathlib.Path) -> str:
    parity = summary["parity"]
    collectives = summary["collectives_per_step"]
    per_phase = collectives["per_phase"]
    lines = [
        "",
        "=" * 72,
        "summary",
        f"  steps            {summary['steps']} x {summary['tokens_per_step']} tokens, "
        f"{summary['world_size']} ranks, mesh "
        + " x ".join(f"{name}={size}" for name, size in zip(summary["mesh"]["dim_names"], summary["mesh"]["shape"])),
        f"  final loss       {summary['final_loss']:.4f}" if summary["final_loss"] is not None else "  final loss       -",
        f"  time             {summary['time_seconds']:.2f} s  (median step {summary['median_step_seconds'] * 1e3:.1f} ms)",
        f"  tokens/s         {summary['tokens_per_second']:,.0f}  "
        f"(single process: {summary['reference_tokens_per_second']:,.0f})",
        (
            "  collectives/step not counted (--compile)"
            if summary.get("config", {}).get("compile")
            else f"  collectives/step {collectives['total']}  ({format_collectives(per_phase)}); "
            f"{(collectives.get('bytes_received') or 0) / 1e3:,.1f} KB received per rank"
        ),
        f"  parity           {parity['verdict']}  (max |loss diff| {parity['max_abs_loss_diff']:.3g}, "
        f"max |param diff| {parity['max_abs_param_diff']:.3g} in {parity['worst_parameter'] or '-'}; "
        f"rtol {parity['rtol']:g}, atol {parity['atol']:g})",
    ]
    lines += [f"                   - {problem}" for problem in parity["problems"]]
    if not collectives["same_every_counted_step"]:
        lines.append(f"  note             collectives differ between counted steps {collectives['counted_steps']}")
    if summary["plot"] is not None:
        lines.append(f"  loss plot        {summary['plot']}")
    else:
        lines.append(f"  loss plot        not written: {summary['plot_error']}")
    lines.append(f"  summary json     {summary_path}")
    lines.append("=" * 72)
    return "\n".join(lines)
