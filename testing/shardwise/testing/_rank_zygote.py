"""The common parent of a CPU pool's rank processes: imports torch once, then forks every rank.

A rank started as a fresh interpreter pays torch's import (about 2 s of CPU each, 8 s for a pool of 4,
on every test file): on a loaded 2-core machine that was a quarter of the whole suite's CPU. The pool
starts this one process instead (``RankPool``, gloo pools only: CUDA must not be initialised before a
fork, and nothing here touches it). It imports what every rank imports, reads the ranks' plans (pickled
``RankPlan`` list on stdin), forks one child per plan, writes ``forked <pid> ...`` (in plan order) on
stdout, and then only reaps them: a line ``<pid> <exit code>`` per rank that ends (a negative code is the signal that killed it, as
``subprocess.Popen`` reports it). It exits when every rank has.

Each child becomes the rank: its variables in ``os.environ``, stdout and stderr to its log, stdin from
/dev/null, every other rank's control socket closed (so a rank that dies gives the test process EOF),
then ``_rank_worker.main()``, which never returns.
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass

__all__ = ["RankPlan", "main"]


@dataclass(frozen=True)
class RankPlan:
    """What one forked rank needs: its environment variables, its log file and its control socket's fd."""

    environment: dict[str, str]
    log_path: str
    control_fd: int


def _become_rank(plan: RankPlan, plans: list[RankPlan]) -> None:
    try:
        os.environ.update(plan.environment)
        for other in plans:
            if other.control_fd != plan.control_fd:
                os.close(other.control_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        log = os.open(plan.log_path, os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        from shardwise.testing import _rank_worker

        _rank_worker.main()  # ends the process itself
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(1)


def main() -> None:
    # What every rank would import on its own; the children inherit it.
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from shardwise.testing import _rank_worker  # noqa: F401

    plans: list[RankPlan] = pickle.load(sys.stdin.buffer)
    report = sys.stdout
    report.flush()
    sys.stderr.flush()
    forked: list[int] = []
    for plan in plans:
        pid = os.fork()
        if pid == 0:
            _become_rank(plan, plans)
        forked.append(pid)
    for plan in plans:
        os.close(plan.control_fd)  # the ranks hold theirs: EOF reaches the test process when one dies
    report.write("forked " + " ".join(str(pid) for pid in forked) + "\n")
    report.flush()
    children = set(forked)
    while children:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid in children:
            children.discard(pid)
            report.write(f"{pid} {os.waitstatus_to_exitcode(status)}\n")
            report.flush()
    os._exit(0)
