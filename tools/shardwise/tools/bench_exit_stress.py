"""Exit stress: does a good 4-rank job exit 0 every time? shardwise and PyTorch's DTensor, one run.

Run (from the repository root)::

    PYTHONPATH=mesh:placement:dtensor_ops:testing:tp_styles:tools python -m shardwise.tools.bench_exit_stress
    ... --runs 100                       # jobs per stack (default 20)
    ... --stacks shardwise               # only one stack (default: shardwise,pytorch)
    ... --nproc 4 --timeout 120          # ranks per job, seconds per job before it counts as hung
    ... --keep-logs DIR                  # the output of every failed job goes to DIR/<stack>-<n>.log

Each job is launched with ``python -m torch.distributed.run --nproc-per-node 4`` (gloo on CPU),
exactly as a user would, and does, with one stack's public API only:

1. ``distribute_tensor`` of a tensor with ``Shard(0)`` (the scatter from rank 0), with uneven rows
   (10 rows on 4 ranks: 3, 3, 3, 1) and with ``Replicate()`` (a broadcast);
2. every transition of a 1-D mesh: ``Shard(0) -> Replicate`` (all-gather), ``Replicate -> Shard(1)``
   (local), ``Shard(1) -> Shard(0)`` (all-to-all), ``Partial -> Replicate`` (all-reduce),
   ``Partial -> Shard(0)`` (reduce-scatter), uneven ``Shard(0) -> Replicate``, each checked against
   the plain tensor;
3. three training steps of a two-layer MLP laid out with ``ColwiseParallel``/``RowwiseParallel``
   (``parallelize_module``), SGD;
4. one more ``distribute_tensor(..., [Shard(0)])``, then ``destroy_process_group()`` and a
   normal return.

That is the *full* job.  The *minimal* job is the one of the bug report (issue 13): only
``distribute_tensor(t, mesh, [Shard(0)])`` and ``destroy_process_group()``; there a gloo process
group kept alive past ``destroy_process_group`` made about half of the jobs abort at exit, while
the full job, which does more Python work between its collectives and its exit, hid the same bug
(no abort in 13 runs of the code that had it).  ``--jobs`` (default ``minimal,full``) lists the
kinds, taken in turn run after run (both stacks run the same kind in a run).

The jobs of the two stacks are interleaved (shardwise, pytorch, shardwise, ...), so machine load
falls on both alike.  A job *fails* when the launcher exits non-zero, when it runs past
``--timeout``, or when not every rank printed its final ``ok`` line (lost output); an *abort* is a
job whose output shows ``terminate called`` or a rank killed by SIGABRT.  The table gives, per
stack, the jobs run, the failed ones, the aborts and the median seconds per job.  Exit status:
0 when no shardwise job failed, 1 otherwise.

PyTorch's DTensor stack is imported here only to compare against (benchmarks may; product code may not).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STACKS = ("shardwise", "pytorch")
# Not anchored: the ranks share the launcher's stdout, so their lines may run together.
_OK_LINE = re.compile(r"exit-stress rank (\d+) ok")
_ABORT_MARKERS = ("terminate called", "SIGABRT", "exitcode  : -6")


# -- the job (runs on every rank under torch.distributed.run) ------------------------------


def _stack_api(stack: str) -> dict[str, Any]:
    """The public names of one stack, so that the job below is the same code for both."""
    if stack == "shardwise":
        from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
        from shardwise.tp_styles import ColwiseParallel, RowwiseParallel, parallelize_module
    elif stack == "pytorch":
        from torch.distributed.tensor import (  # type: ignore[assignment]
            DTensor,
            Partial,
            Replicate,
            Shard,
            distribute_tensor,
            init_device_mesh,
        )
        from torch.distributed.tensor.parallel import (  # type: ignore[assignment]
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    else:
        raise ValueError(f"unknown stack {stack!r}; expected one of {STACKS}")
    return {
        "DTensor": DTensor,
        "Partial": Partial,
        "Replicate": Replicate,
        "Shard": Shard,
        "distribute_tensor": distribute_tensor,
        "init_device_mesh": init_device_mesh,
        "ColwiseParallel": ColwiseParallel,
        "RowwiseParallel": RowwiseParallel,
        "parallelize_module": parallelize_module,
    }


def _minimal_job(stack: str) -> list[Any]:
    """The job of the bug report, exactly: one scatter, then teardown."""
    import torch
    import torch.distributed as dist

    api = _stack_api(stack)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = api["init_device_mesh"]("cpu", (world,))
    full = torch.arange(8.0 * world).reshape(2 * world, 4)
    sharded = api["distribute_tensor"](full, mesh, [api["Shard"](0)])
    ok = torch.equal(sharded.to_local(), full.chunk(world)[rank])
    print(f"exit-stress rank {rank} ok" if ok else f"{stack}: wrong shard on rank {rank}", flush=True)
    dist.destroy_process_group()
    return [mesh, sharded]


def _full_job(stack: str) -> list[Any]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    api = _stack_api(stack)
    Shard, Replicate, Partial = api["Shard"], api["Replicate"], api["Partial"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = api["init_device_mesh"]("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(8, 6)

    def check(dtensor: Any, expected: torch.Tensor, what: str) -> None:
        got = dtensor.full_tensor()
        if not torch.allclose(got, expected):
            raise AssertionError(f"{stack}: {what} gave a wrong result on rank {rank}")

    sharded = api["distribute_tensor"](full, mesh, [Shard(0)])
    replicated = sharded.redistribute(mesh, [Replicate()])
    check(replicated, full, "Shard(0) -> Replicate")
    by_column = replicated.redistribute(mesh, [Shard(1)])
    check(by_column, full, "Replicate -> Shard(1)")
    by_row = by_column.redistribute(mesh, [Shard(0)])
    check(by_row, full, "Shard(1) -> Shard(0)")
    partial = api["DTensor"].from_local(full.clone(), mesh, [Partial()])
    check(partial.redistribute(mesh, [Replicate()]), full * world, "Partial -> Replicate")
    check(partial.redistribute(mesh, [Shard(0)]), full * world, "Partial -> Shard(0)")
    uneven = torch.arange(20.0).reshape(10, 2)
    check(api["distribute_tensor"](uneven, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]), uneven, "uneven")
    check(api["distribute_tensor"](full, mesh, [Replicate()]), full, "Replicate")

    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
    plan = {"0": api["ColwiseParallel"](), "2": api["RowwiseParallel"]()}
    api["parallelize_module"](model, mesh, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    # Last, as in the bug report: a scatter, then straight to teardown.
    last = api["distribute_tensor"](full, mesh, [Shard(0)])
    if not torch.equal(last.to_local(), full.chunk(world)[rank]):
        raise AssertionError(f"{stack}: the last distribute_tensor gave a wrong shard on rank {rank}")
    print(f"exit-stress rank {rank} ok", flush=True)
    dist.destroy_process_group()
    return [mesh, sharded, replicated, partial, model, optimizer, last]


JOBS = {"minimal": _minimal_job, "full": _full_job}

# What a job built stays referenced until the interpreter shuts down, as the module-level variables
# of a user's script do: objects that still hold a process group then are only freed in interpreter
# shutdown, which is where a gloo group kept alive aborts the process. (Objects freed when a
# function returns are gone before that, which hides the bug.)
_KEPT_UNTIL_EXIT: list[Any] = []


# -- the driver ----------------------------------------------------------------------------


@dataclass
class StackTally:
    runs: int = 0
    failed: int = 0
    aborts: int = 0
    hung: int = 0
    seconds: list[float] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_job(stack: str, kind: str, nproc: int, timeout_s: float) -> tuple[int | None, str, float]:
    """(launcher exit status or None when it ran past the timeout, its output, seconds)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        "-m",
        "shardwise.tools.bench_exit_stress",
        "--job",
        stack,
        "--job-kind",
        kind,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    try:
        finished = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s, env=env
        )
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else (expired.stdout or b"").decode(errors="replace")
        return None, output, time.perf_counter() - started
    return finished.returncode, finished.stdout, time.perf_counter() - started


def _judge(returncode: int | None, output: str, nproc: int) -> tuple[bool, bool]:
    """(failed, aborted) for one job."""
    ranks_ok = {int(match) for match in _OK_LINE.findall(output)}
    aborted = any(marker in output for marker in _ABORT_MARKERS)
    failed = returncode != 0 or ranks_ok != set(range(nproc)) or aborted
    return failed, aborted


def _report(tallies: dict[str, StackTally]) -> str:
    lines = [f"{'stack':<10} {'runs':>5} {'failed':>7} {'aborts':>7} {'hung':>5} {'s/job (median)':>15}"]
    for stack, tally in tallies.items():
        median = statistics.median(tally.seconds) if tally.seconds else float("nan")
        lines.append(
            f"{stack:<10} {tally.runs:>5} {tally.failed:>7} {tally.aborts:>7} {tally.hung:>5} {median:>15.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=20, help="jobs per stack")
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated: shardwise,pytorch")
    parser.add_argument("--nproc", type=int, default=4, help="ranks per job")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per job before it counts as hung")
    parser.add_argument("--keep-logs", type=Path, default=None, help="folder for the output of failed jobs")
    parser.add_argument(
        "--jobs",
        default="minimal,full",
        help="job kinds, taken in turn run after run: minimal (the bug report's scatter + destroy), full",
    )
    parser.add_argument("--job", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--job-kind", choices=tuple(JOBS), default="full", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job is not None:
        _KEPT_UNTIL_EXIT.extend(JOBS[args.job_kind](args.job))
        return 0
    kinds = [kind.strip() for kind in args.jobs.split(",") if kind.strip()]
    if not kinds or any(kind not in JOBS for kind in kinds):
        parser.error(f"--jobs: expected a comma-separated subset of {tuple(JOBS)}, got {args.jobs!r}")
    stacks = [name.strip() for name in args.stacks.split(",") if name.strip()]
    unknown = [name for name in stacks if name not in STACKS]
    if unknown or not stacks:
        parser.error(f"--stacks: unknown {unknown}; expected a comma-separated subset of {STACKS}")
    if args.runs < 1 or args.nproc < 1:
        parser.error("--runs and --nproc must be at least 1")
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
    tallies = {stack: StackTally() for stack in stacks}
    for run in range(1, args.runs + 1):
        kind = kinds[(run - 1) % len(kinds)]
        for stack in stacks:
            returncode, output, seconds = _run_job(stack, kind, args.nproc, args.timeout)
            failed, aborted = _judge(returncode, output, args.nproc)
            tally = tallies[stack]
            tally.runs += 1
            tally.seconds.append(seconds)
            tally.failed += failed
            tally.aborts += aborted
            tally.hung += returncode is None
            if failed and args.keep_logs is not None:
                (args.keep_logs / f"{stack}-{run}-{kind}.log").write_text(output)
            status = "ok" if not failed else ("ABORT" if aborted else "FAILED")
            print(f"run {run:>3} {stack:<10} {kind:<8} {status:<6} exit={returncode} {seconds:5.1f}s", flush=True)
    print(_report(tallies), flush=True)
    return 1 if "shardwise" in tallies and tallies["shardwise"].failed else 0


if __name__ == "__main__":
    sys.exit(main())
