"""The harness's time limits: a busy task is not a hang, an idle one is, and limits scale in one place."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shardwise.testing import MultiRankTimeout, run_on_ranks
from shardwise.testing import _timeouts


def busy_on_rank(busy_rank: int, seconds: float) -> int:
    # Stands in for an inductor compile under load: long in wall time, using CPU all along.
    import torch.distributed as dist

    if dist.get_rank() == busy_rank:
        end = time.monotonic() + seconds
        spins = 0
        while time.monotonic() < end:
            spins += 1
        return spins
    return 0


def busy_in_child_process(seconds: float) -> int:
    # The work happens in a process the rank started (as inductor's C++ compiler does); the rank waits.
    import torch.distributed as dist

    if dist.get_rank() == 0:
        code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
        return subprocess.run([sys.executable, "-c", code], check=True).returncode
    return 0


def idle_on_rank(seconds: float) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(seconds)


def test_a_rank_busy_longer_than_the_timeout_is_not_a_hang() -> None:
    run_on_ranks(idle_on_rank, 0.0, world_size=2)  # start the pool outside the measured time
    results = run_on_ranks(busy_on_rank, 1, 4.0, world_size=2, timeout=1.5)
    assert results[0] == 0 and results[1] > 0


def test_a_child_process_busy_longer_than_the_timeout_is_not_a_hang() -> None:
    assert run_on_ranks(busy_in_child_process, 4.0, world_size=2, timeout=1.5) == [0, 0]


def test_an_idle_rank_fails_after_the_no_progress_window() -> None:
    run_on_ranks(idle_on_rank, 0.0, world_size=2)
    started = time.monotonic()
    with pytest.raises(MultiRankTimeout, match=r"made no progress for 1\.5 s"):
        run_on_ranks(idle_on_rank, 300.0, world_size=2, timeout=1.5)
    assert time.monotonic() - started < 1.5 + 10.0


def test_a_busy_rank_is_stopped_at_the_hard_limit() -> None:
    run_on_ranks(idle_on_rank, 0.0, world_size=2)
    limit = _timeouts.task_limits(0.5).hard_limit_s
    with pytest.raises(MultiRankTimeout, match=f"hard limit of {limit:g} s"):
        run_on_ranks(busy_on_rank, 0, 300.0, world_size=2, timeout=0.5)


def test_limits_scale_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_timeouts.TIMEOUT_ENV_VAR, raising=False)
    monkeypatch.setenv(_timeouts.SCALE_ENV_VAR, "3")
    assert _timeouts.stall_seconds(None) == 3 * _timeouts.DEFAULT_STALL_S
    assert _timeouts.stall_seconds(10) == 30.0
    limits = _timeouts.task_limits(_timeouts.stall_seconds(10))
    assert limits.hard_limit_s == _timeouts.HARD_LIMIT_FACTOR * 30.0
    assert limits.collective_s > limits.hard_limit_s
    assert _timeouts.startup_seconds(30.0) == 3 * _timeouts.STARTUP_S
    monkeypatch.setenv(_timeouts.SCALE_ENV_VAR, "0")
    with pytest.raises(ValueError, match=f"{_timeouts.SCALE_ENV_VAR} must be a positive number, got '0'"):
        _timeouts.stall_seconds(None)


def test_cpu_of_a_process_tree_includes_live_children() -> None:
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc on this platform: progress is not measured, limits are wall clock")
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        before = _timeouts.process_tree_cpu_ticks([os.getpid()])
        time.sleep(1.0)
        after = _timeouts.process_tree_cpu_ticks([os.getpid()])
    finally:
        child.kill()
        child.wait()
    assert before is not None and after is not None and after > before
