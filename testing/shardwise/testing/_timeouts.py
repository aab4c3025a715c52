"""Every time limit of the multi-rank harness, in one place, and how they scale.

A multi-rank task fails as hung when *no progress* is seen for ``stall_s`` seconds, not after a fixed
wall-clock time: progress is CPU time used by any rank or by any process a rank started (inductor's
compile workers and C++ compiler, torchrun children). An inductor compile on a loaded 2-core machine
can take minutes of wall time, all of it busy; a deadlock (ranks blocked in a collective, on a lock,
or on each other) uses none. A task that keeps making progress is still stopped at ``hard_limit_s``
(a livelock is a failure too).

    stall_s       = $SHARDWISE_TEST_TIMEOUT (default 120 s)     x scale   (or the test's own timeout=)
    hard_limit_s  = HARD_LIMIT_FACTOR (8) x stall_s
    startup_s     = max(STARTUP_S (120 s), stall_s)              x scale   (starting ranks imports torch)
    collective_s  = hard_limit_s + 60 s   (gloo/NCCL give up only after the harness has, so a hang is
                                           reported here with every rank's stack)
    scale         = $SHARDWISE_TEST_TIMEOUT_SCALE (default 1; e.g. 3 under a sanitizer or on an
                                           oversubscribed remote worker)

Where /proc is missing (not Linux), progress cannot be seen and ``stall_s`` is a wall-clock limit;
thread worlds (``run_on_threads``) share the test's process and also use it as a wall-clock limit.
The outer limit, per Bazel test target, is Bazel's: `test --test_timeout=` in .bazelrc.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TIMEOUT_ENV_VAR = "SHARDWISE_TEST_TIMEOUT"
SCALE_ENV_VAR = "SHARDWISE_TEST_TIMEOUT_SCALE"
DEFAULT_STALL_S = 120.0
STARTUP_S = 120.0
HARD_LIMIT_FACTOR = 8.0
COLLECTIVE_MARGIN_S = 60.0
# How often the pool looks at the ranks' CPU time while it waits for them.
PROGRESS_POLL_S = 2.0


def _positive_float_from_env(name: str, default: float, what: str) -> float:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be a positive {what}, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"environment variable {name} must be a positive {what}, got {text!r}")
    return value


def scale() -> float:
    return _positive_float_from_env(SCALE_ENV_VAR, 1.0, "number")


def stall_seconds(timeout: float | None) -> float:
    """The no-progress window of one task: the test's ``timeout=``, else $SHARDWISE_TEST_TIMEOUT, else 120 s."""
    if timeout is not None:
        if isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout) * scale()
    return _positive_float_from_env(TIMEOUT_ENV_VAR, DEFAULT_STALL_S, "number of seconds") * scale()


@dataclass(frozen=True)
class TaskLimits:
    stall_s: float
    hard_limit_s: float
    collective_s: float


def task_limits(stall_s: float) -> TaskLimits:
    hard_limit_s = HARD_LIMIT_FACTOR * stall_s
    return TaskLimits(stall_s=stall_s, hard_limit_s=hard_limit_s, collective_s=hard_limit_s + COLLECTIVE_MARGIN_S)


def startup_seconds(stall_s: float) -> float:
    return max(STARTUP_S * scale(), stall_s)


def poll_seconds(stall_s: float) -> float:
    # A short stall window (a test of the harness itself) is still detected within about itself.
    return min(PROGRESS_POLL_S, stall_s / 4)


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0
    # utime, stime, cutime, cstime (fields 14-17 of proc(5); index 11-14 after the command name):
    # the last two hold children that already exited, e.g. a finished C++ compile.
    return sum(int(value) for value in fields[11:15])


def process_tree_cpu_ticks(root_pids: list[int]) -> int | None:
    """CPU ticks used so far by these processes and all their live descendants; None without /proc."""
    if not os.path.isdir("/proc"):
        return None
    children = _children_by_parent()
    total = 0
    seen: set[int] = set()
    stack = list(root_pids)
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _cpu_ticks(pid)
        stack.extend(children.get(pid, ()))
    return total
