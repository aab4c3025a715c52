"""How fast a job ends when one rank raises mid-step: shardwise and PyTorch's DTensor, one run, as ratios.

Run (from the repository root)::

    PYTHONPATH=mesh:placement:dtensor_ops:testing:tp_styles:tools:fsdp_ext:compile_support:torch_switch \\
        python -m shardwise.tools.bench_fault_exit [--repeats 3] [--fail-step 3] [--fail-rank 1] [--json out.json]

Each job is launched with ``python -m torch.distributed.run --nproc-per-node 4`` (gloo on CPU) and runs
the same trainer-like loop on one stack's public API: a 2-block MLP laid out with
``ColwiseParallel``/``RowwiseParallel`` on a 1-D mesh of 4 ranks, SGD, ``--steps`` steps; in step
``--fail-step`` rank ``--fail-rank`` raises between its forward and its backward, while the other ranks
go on into the backward's collectives with it. The raising rank writes the wall-clock time of the raise;
the driver notes when torchrun logs that it saw a rank fail (it then stops the others) and when the
launcher process ends. Reported per variant, medians over ``--repeats``:

- ``raise -> launcher saw it``: from the raise to torchrun's "Sending process ... closing signal" line;
- ``raise -> job end``: from the raise to the launcher's exit;
- whether the failing rank's traceback was the first one printed, and whether every rank had ended.

Variants (``--variants``, default all, interleaved run by run so machine load falls on all alike):

- ``shardwise``: shardwise's stack with the trainer's failure path
  (``shardwise.tools.train._worker.leave_at_once_after_failure``: traceback first, then leave without
  interpreter teardown);
- ``pytorch``: PyTorch's DTensor, the exception left to end the interpreter as a plain script does;
- ``shardwise-plain-exit``: shardwise's stack, the exception left to end the interpreter (what the
  trainer did before);
- ``pytorch-fast-exit``: PyTorch's DTensor with the same failure path as ``shardwise`` (the fast exit is
  not specific to shardwise: this row says how much of the difference it is);
- ``trainer``: the demo trainer itself, ``python -m shardwise.tools.train --fail-at-step N --fail-rank R``
  (its own launcher; the Transformer with TP + SP, a smaller configuration).

Ratios are to ``pytorch``. PyTorch's DTensor stack is imported here only to compare against
(benchmarks may; product code may not).
"""

from __future__ import annotations

import argparse
import datetime as _datetime
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# One table of each stack's public names for both fault benchmarks (the job is the same code on both).
from shardwise.tools.bench_exit_stress import _stack_api

VARIANTS = ("shardwise", "pytorch", "shardwise-plain-exit", "pytorch-fast-exit", "trainer")
_RAISE_LINE = re.compile(r"fault-exit: rank (\d+) raises in step (\d+) at (\d+\.\d+)")
_TRAINER_RAISE_LINE = re.compile(r"injected fault: rank (\d+) raises in step (\d+) at (\d+\.\d+)")
# torchrun's log lines start with glog's "W1202 11:28:56.647000" (month, day, local time).
_LAUNCHER_SAW_FAILURE = re.compile(r"[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) .*(?:closing signal|failed \(exitcode)")
_TRACEBACK_LINE = re.compile(r"\[rank(\d+)\]:\s*Traceback \(most recent call last\)")


# -- the job (runs on every rank under torch.distributed.run) ------------------------------


class FaultInjected(RuntimeError):
    """What the failing rank raises."""


def _training_job(stack: str, steps: int, fail_step: int, fail_rank: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    api = _stack_api(stack)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = api["init_device_mesh"]("cpu", (world,))
    torch.manual_seed(0)
    dim, hidden = 64, 256
    model = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
    plan = {"0": api["ColwiseParallel"](), "2": api["RowwiseParallel"](), "3": api["ColwiseParallel"](), "5": api["RowwiseParallel"]()}
    api["parallelize_module"](model, mesh, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        inputs = torch.randn(16, dim, generator=torch.Generator().manual_seed(step))
        loss = model(inputs).pow(2).mean()
        if rank == fail_rank and step == fail_step:
            print(f"fault-exit: rank {rank} raises in step {step} at {time.time():.6f}", file=sys.stderr, flush=True)
            raise FaultInjected(f"rank {rank} raises in step {step}, between its forward and its backward")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


def _job_main(variant: str, steps: int, fail_step: int, fail_rank: int) -> None:
    stack = "pytorch" if variant.startswith("pytorch") else "shardwise"
    fast_exit = variant in ("shardwise", "pytorch-fast-exit")
    if not fast_exit:
        _training_job(stack, steps, fail_step, fail_rank)  # an exception ends the interpreter as usual
        return None
    from shardwise.tools.train._worker import leave_at_once_after_failure

    try:
        _training_job(stack, steps, fail_step, fail_rank)
    except Exception as failure:
        leave_at_once_after_failure(int(os.environ["RANK"]), failure)
    return None


# -- the driver ----------------------------------------------------------------------------


@dataclass
class JobTiming:
    variant: str
    exit_status: int | None
    raise_to_launcher_s: float | None
    raise_to_end_s: float | None
    failing_traceback_first: bool
    every_rank_ended: bool


@dataclass
class VariantTally:
    jobs: list[JobTiming] = field(default_factory=list)

    def median(self, attribute: str) -> float | None:
        values = [getattr(job, attribute) for job in self.jobs if getattr(job, attribute) is not None]
        return statistics.median(values) if values else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _launcher_saw_failure_at(output: str, raised_at: float) -> float | None:
    """Wall-clock time of torchrun's first line saying it saw a failed rank (glog time stamps are local time)."""
    for match in _LAUNCHER_SAW_FAILURE.finditer(output):
        month, day, hour, minute, second = match.groups()
        raised = _datetime.datetime.fromtimestamp(raised_at)
        stamp = raised.replace(month=int(month), day=int(day), hour=int(hour), minute=int(minute), second=0, microsecond=0)
        return stamp.timestamp() + float(second)
    return None


def _run_job(variant: str, args: argparse.Namespace) -> JobTiming:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(entry for entry in sys.path if entry)}
    if variant == "trainer":
        command = [
            sys.executable, "-m", "shardwise.tools.train", "--steps", str(args.steps), "--dim", "32", "--n-layers", "1",
            "--seq-len", "16", "--batch-size", "4", "--log-every", "100", "--fail-at-step", str(args.fail_step),
            "--fail-rank", str(args.fail_rank), "--output-dir", os.path.join(args.scratch, "trainer-out"),
        ]  # fmt: skip
        raise_pattern = _TRAINER_RAISE_LINE
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}", "--max-restarts=0", "-m", "shardwise.tools.bench_fault_exit", "--job", variant,
            "--steps", str(args.steps), "--fail-step", str(args.fail_step), "--fail-rank", str(args.fail_rank),
        ]  # fmt: skip
        raise_pattern = _RAISE_LINE
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=args.timeout)
        status: int | None = process.returncode
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        status = None
    ended_at = time.time()
    raised = raise_pattern.search(output)
    if raised is None:
        print(f"--- {variant}: no raise found in the output (exit {status}) ---\n{output[-4000:]}", file=sys.stderr)
        return JobTiming(variant, status, None, None, False, False)
    raised_at = float(raised.group(3))
    saw = _launcher_saw_failure_at(output, raised_at)
    first_traceback = _TRACEBACK_LINE.search(output)
    return JobTiming(
        variant=variant,
        exit_status=status,
        raise_to_launcher_s=None if saw is None else max(saw - raised_at, 0.0),
        raise_to_end_s=ended_at - raised_at,
        failing_traceback_first=first_traceback is not None and int(first_traceback.group(1)) == args.fail_rank,
        # The launcher returns only once every worker has exited (it kills those left after the first failure).
        every_rank_ended=status is not None and status != 0,
    )


def _format_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _report(tallies: dict[str, VariantTally], args: argparse.Namespace) -> dict[str, Any]:
    baseline = tallies.get("pytorch")
    baseline_end = baseline.median("raise_to_end_s") if baseline else None
    baseline_saw = baseline.median("raise_to_launcher_s") if baseline else None
    print(
        f"\nfault exit: {args.nproc} gloo ranks, rank {args.fail_rank} raises in step {args.fail_step} of {args.steps}, "
        f"{args.repeats} job(s) per variant, medians (seconds from the raise)\n"
    )
    header = f"{'variant':<22} {'raise->launcher saw':>19} {'ratio':>6} {'raise->job end':>15} {'ratio':>6} {'traceback first':>16} {'all ended':>10}"
    print(header)
    print("-" * len(header))
    summary: dict[str, Any] = {}
    for variant, tally in tallies.items():
        saw, end = tally.median("raise_to_launcher_s"), tally.median("raise_to_end_s")
        saw_ratio = saw / baseline_saw if saw is not None and baseline_saw else None
        end_ratio = end / baseline_end if end is not None and baseline_end else None
        first = sum(job.failing_traceback_first for job in tally.jobs)
        ended = sum(job.every_rank_ended for job in tally.jobs)
        print(
            f"{variant:<22} {_format_seconds(saw):>19} {_format_seconds(saw_ratio):>6} {_format_seconds(end):>15} "
            f"{_format_seconds(end_ratio):>6} {f'{first}/{len(tally.jobs)}':>16} {f'{ended}/{len(tally.jobs)}':>10}"
        )
        summary[variant] = {
            "raise_to_launcher_saw_s": saw,
            "raise_to_job_end_s": end,
            "ratio_to_pytorch_launcher_saw": saw_ratio,
            "ratio_to_pytorch_job_end": end_ratio,
            "failing_traceback_first": f"{first}/{len(tally.jobs)}",
            "every_rank_ended": f"{ended}/{len(tally.jobs)}",
            "jobs": [job.__dict__ for job in tally.jobs],
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=[variant for variant in VARIANTS if variant != "trainer"], help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3, help="jobs per variant")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job before it counts as hung")
    parser.add_argument("--json", help="write the medians and every job's timings here")
    args = parser.parse_args(argv)
    if args.job:
        _job_main(args.job, args.steps, args.fail_step, args.fail_rank)
        return 0
    variants = [variant.strip() for variant in args.variants.split(",") if variant.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected some of {', '.join(VARIANTS)}")
    args.scratch = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-fault-exit-{os.getpid()}")
    tallies = {variant: VariantTally() for variant in variants}
    for repeat in range(args.repeats):
        for variant in variants:
            timing = _run_job(variant, args)
            tallies[variant].jobs.append(timing)
            print(
                f"run {repeat + 1}/{args.repeats} {variant:<22} exit {timing.exit_status} raise->launcher saw "
                f"{_format_seconds(timing.raise_to_launcher_s)} s, raise->end {_format_seconds(timing.raise_to_end_s)} s, "
                f"failing rank's traceback first: {timing.failing_traceback_first}",
                flush=True,
            )
    summary = _report(tallies, args)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
