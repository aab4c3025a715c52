"""A pool of rank processes reused by many multi-rank tests.

Starting a rank costs seconds (importing torch), a test often milliseconds, so the ranks are
started once per (world size, backend) and reused. A gloo pool's ranks are forked from one process
that imported torch once (``_rank_zygote``); with ``SHARDWISE_TEST_FORK_RANKS=0``, and always for NCCL
and shared-GPU pools, each rank is its own interpreter. Each test gets a fresh default process group
on a new prefix of a TCPStore hosted here; after a test that hangs, crashes or leaves a rank in
an unknown state, the whole pool is killed and the next test starts a new one.
"""

from __future__ import annotations

import atexit
import codecs
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_readable
from typing import IO, NoReturn, Protocol

from shardwise.testing import _protocol as protocol
from shardwise.testing import _rank_worker
from shardwise.testing import _timeouts
from shardwise.testing._rank_zygote import RankPlan

# How long the others get to report once one rank has failed: several ranks failing the same
# assertion report within milliseconds, and ranks blocked in a gloo collective with a failed peer
# error out as soon as that peer tears its process group down (which it does at once).
GRACE_AFTER_FAILURE_S = 5.0
# How long peers get to report on their own before a failed rank whose process groups outlived its
# teardown is ended (which closes their connections, and costs the pool a restart): ranks failing the
# same assertion report within milliseconds and keep the pool; a peer blocked in a collective with the
# failed rank waits this long instead of the whole grace.
OPEN_GROUPS_WAIT_S = 0.5
# How long a rank gets to write its stacks after SIGUSR1.
STACK_DUMP_WAIT_S = 2.0
# Idle pools kept alive at once (each rank holds a few hundred MB with torch imported).
MAX_LIVE_POOLS = 2
SEED = 0
_OUTPUT_TAIL_LINES = 40

_WORKER_COMMAND = "from shardwise.testing._rank_worker import main; main()"
_ZYGOTE_COMMAND = "from shardwise.testing._rank_zygote import main; main()"
FORK_RANKS_ENV_VAR = "SHARDWISE_TEST_FORK_RANKS"


def _forks_ranks(backend: str) -> bool:
    """Whether a pool of ``backend`` forks its ranks from one zygote: gloo pools, unless $SHARDWISE_TEST_FORK_RANKS=0.

    Not CUDA pools: CUDA must not be initialised before a fork. The one failure forked ranks once
    showed (a peer's gloo rendezvous closed under it) was a race of the worker's, not of forking: a
    body failing at once destroyed its group while a slower rank was still connecting; every rank
    now waits until all are connected (``_rank_worker._Worker.init_default_group``).
    """
    return backend == "gloo" and hasattr(os, "fork") and os.environ.get(FORK_RANKS_ENV_VAR, "1").strip() != "0"


class _RankProcess(Protocol):
    """The part of ``subprocess.Popen``'s interface the pool uses for a rank."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class _Zygote:
    """The process the ranks were forked from (``_rank_zygote``); it reports each rank's exit code."""

    def __init__(self, process: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        self.process = process
        self.log = log
        self.exit_codes: dict[int, int] = {}
        self._pending = b""
        assert process.stdout is not None
        self._stdout = process.stdout
        os.set_blocking(self._stdout.fileno(), False)

    def read_lines(self) -> list[str]:
        """The complete lines the zygote wrote since the last call."""
        while True:
            try:
                chunk = os.read(self._stdout.fileno(), 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        return [line.decode() for line in lines]

    def collect_exit_codes(self) -> None:
        for line in self.read_lines():
            pid, code = line.split()
            self.exit_codes[int(pid)] = int(code)

    def close(self) -> None:
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stdout.close()
        self.log.close()


class _ForkedRank:
    """A rank forked by the pool's zygote, seen through ``_RankProcess``."""

    def __init__(self, pid: int, zygote: _Zygote) -> None:
        self._pid = pid
        self._zygote = zygote

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        self._zygote.collect_exit_codes()
        return self._zygote.exit_codes.get(self._pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(_ZYGOTE_COMMAND, timeout or 0.0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class MultiRankError(Exception):
    """A multi-rank test failed: a rank raised, died, or did not answer in time."""

    def __init__(
        self,
        message: str,
        *,
        errors: dict[int, protocol.RemoteError] | None = None,
        exit_codes: dict[int, int | None] | None = None,
        unfinished_ranks: tuple[int, ...] = (),
        stacks: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.errors: dict[int, protocol.RemoteError] = dict(errors or {})
        self.exit_codes: dict[int, int | None] = dict(exit_codes or {})
        self.unfinished_ranks = unfinished_ranks
        self.stacks: dict[int, str] = dict(stacks or {})

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.errors) | set(self.exit_codes) | set(self.unfinished_ranks)))


class MultiRankTimeout(MultiRankError):
    """No rank failed, but some did not answer within the timeout."""


# Reported as where users import them from.
MultiRankError.__module__ = "shardwise.testing"
MultiRankTimeout.__module__ = "shardwise.testing"


@dataclass
class _Rank:
    rank: int
    process: _RankProcess
    control: socket.socket
    log_path: str
    log_reader: IO[bytes]
    pid: int = 0
    output_since_task_start: list[str] = field(default_factory=list)
    # Incremental, so that a character split across two reads is not mangled.
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def read_new_output(self) -> str:
        return self.decoder.decode(self.log_reader.read())


def _format_rank_output_tail(lines: list[str]) -> str:
    text = "".join(lines).rstrip("\n")
    if not text:
        return ""
    tail = text.splitlines()[-_OUTPUT_TAIL_LINES:]
    return "\n".join(tail)


def absolute_sys_path() -> list[str]:
    # Absolute, so that the ranks import the same files whatever their working directory ("" is
    # the working directory of this process).
    return [os.path.abspath(entry) for entry in sys.path]


def _describe_exit(exit_code: int | None) -> str:
    if exit_code is None:
        return "closed its control connection but did not exit"
    if exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"was killed by signal {-exit_code}"
    return f"exited with code {exit_code}"


def _without_harness_frames(faulthandler_dump: str) -> str:
    # The rank's task loop sits below every test body; it only hides where the test is stuck.
    harness_markers = (_rank_worker.__file__, '"<string>"')
    kept = [line for line in faulthandler_dump.splitlines() if not any(m in line for m in harness_markers)]
    return "\n".join(kept).rstrip()


class RankPool:
    """``world_size`` rank processes running tasks for the test process, one task at a time."""

    def __init__(self, world_size: int, backend: str, startup_timeout_s: float) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self.backend = backend
        self._task_counter = 0
        self._log_dir = tempfile.mkdtemp(prefix=f"shardwise-ranks-{world_size}-{backend}-")
        # One store per pool, one key prefix per task: a task never sees keys of an earlier one,
        # and a restarted pool starts from an empty store.
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=startup_timeout_s),
        )
        self._ranks: list[_Rank] = []
        self._zygote: _Zygote | None = None
        self.alive = False
        try:
            self._start(startup_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _worker_environment(self, rank: int, control_fd: int, startup_timeout_s: float) -> dict[str, str]:
        return {**os.environ, **self._rank_variables(rank, control_fd, startup_timeout_s)}

    def _rank_variables(self, rank: int, control_fd: int, startup_timeout_s: float) -> dict[str, str]:
        python_path = absolute_sys_path()
        rank_variables = {
            "PYTHONPATH": os.pathsep.join(python_path),
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self._store.port),
            protocol.ENV_RANK: str(rank),
            protocol.ENV_WORLD_SIZE: str(self.world_size),
            protocol.ENV_BACKEND: self.backend,
            protocol.ENV_CONTROL_FD: str(control_fd),
            protocol.ENV_STORE_HOST: "127.0.0.1",
            protocol.ENV_STORE_PORT: str(self._store.port),
            protocol.ENV_STARTUP_TIMEOUT: str(startup_timeout_s),
        }
        rank_variables[protocol.ENV_RANK_VARIABLES] = ",".join([*rank_variables, protocol.ENV_RANK_VARIABLES])
        return rank_variables

    def _start(self, startup_timeout_s: float) -> None:
        if _forks_ranks(self.backend):
            self._fork_ranks(startup_timeout_s)
        else:
            self._exec_ranks(startup_timeout_s)
        self._wait_until_ready(startup_timeout_s)

    def _fork_ranks(self, startup_timeout_s: float) -> None:
        """Start the zygote, hand it every rank's plan, and read back the pids it forked."""
        plans: list[RankPlan] = []
        child_ends: list[socket.socket] = []
        parent_ends: list[socket.socket] = []
        for rank_number in range(self.world_size):
            parent_end, child_end = socket.socketpair()
            log_path = os.path.join(self._log_dir, f"rank{rank_number}.log")
            open(log_path, "wb").close()
            variables = self._rank_variables(rank_number, child_end.fileno(), startup_timeout_s)
            plans.append(RankPlan(variables, log_path, child_end.fileno()))
            child_ends.append(child_end)
            parent_ends.append(parent_end)
        zygote_log = open(os.path.join(self._log_dir, "zygote.log"), "wb")
        process = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE_COMMAND],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=zygote_log,
            pass_fds=tuple(end.fileno() for end in child_ends),
            env={**os.environ, **plans[0].environment},
        )
        for end in child_ends:
            end.close()
        self._zygote = _Zygote(process, zygote_log)
        assert process.stdin is not None
        try:
            process.stdin.write(pickle.dumps(plans))
            process.stdin.close()
        except BrokenPipeError:
            pass  # it died while starting: reported below
        deadline = time.monotonic() + startup_timeout_s
        pids: list[int] = []
        while not pids:
            lines = self._zygote.read_lines()
            if lines:
                pids = [int(pid) for pid in lines[0].split()[1:]]
                break
            if process.poll() is not None or time.monotonic() > deadline:
                for end in parent_ends:
                    end.close()
                with open(zygote_log.name, "rb") as log:
                    output = log.read().decode("utf-8", errors="replace").rstrip()
                raise RuntimeError(
                    f"the {self.world_size}-rank {self.backend} test pool's zygote ({sys.executable} -c "
                    f"{_ZYGOTE_COMMAND!r}) forked no ranks within {startup_timeout_s:.0f} s"
                    f" (exit code {process.poll()}):\n{output}"
                )
            time.sleep(0.01)
        for rank_number, (pid, parent_end, plan) in enumerate(zip(pids, parent_ends, plans)):
            self._ranks.append(
                _Rank(
                    rank=rank_number,
                    process=_ForkedRank(pid, self._zygote),
                    control=parent_end,
                    log_path=plan.log_path,
                    log_reader=open(plan.log_path, "rb"),
                )
            )

    def _exec_ranks(self, startup_timeout_s: float) -> None:
        for rank_number in range(self.world_size):
            parent_end, child_end = socket.socketpair()
            log_path = os.path.join(self._log_dir, f"rank{rank_number}.log")
            with open(log_path, "wb") as log_writer:
                process = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_COMMAND],
                    stdin=subprocess.DEVNULL,
                    stdout=log_writer,
                    stderr=subprocess.STDOUT,
                    pass_fds=(child_end.fileno(),),
                    env=self._worker_environment(rank_number, child_end.fileno(), startup_timeout_s),
                )
            child_end.close()
            self._ranks.append(
                _Rank(
                    rank=rank_number,
                    process=process,
                    control=parent_end,
                    log_path=log_path,
                    log_reader=open(log_path, "rb"),
                )
            )

    def _wait_until_ready(self, startup_timeout_s: float) -> None:
        deadline = time.monotonic() + startup_timeout_s
        waiting = {rank.control: rank for rank in self._ranks}
        while waiting:
            remaining = deadline - time.monotonic()
            readable = wait_for_readable(list(waiting), timeout=max(remaining, 0.0)) if remaining > 0 else []
            if not readable:
                self._raise_startup_failure(
                    sorted(rank.rank for rank in waiting.values()),
                    f"did not start within {startup_timeout_s:.0f} s",
                )
            for connection in readable:
                assert isinstance(connection, socket.socket)
                rank = waiting.pop(connection)
                try:
                    message = protocol.receive_message(rank.control)
                except EOFError:
                    self._raise_startup_failure([rank.rank], "exited while starting")
                if not isinstance(message, protocol.WorkerReady) or message.rank != rank.rank:
                    self._raise_startup_failure([rank.rank], f"sent {message!r} instead of a ready message")
                rank.pid = message.pid
        self.alive = True
        self.forward_output()

    def _raise_startup_failure(self, ranks: list[int], what: str) -> NoReturn:
        exit_codes = {rank.rank: self._exit_code(rank, wait_s=1.0) for rank in self._ranks if rank.rank in ranks}
        self._kill_processes()
        outputs = []
        for rank in self._ranks:
            if rank.rank in ranks:
                with open(rank.log_path, "rb") as log:
                    output = log.read().decode("utf-8", errors="replace").rstrip()
                outputs.append(
                    f"--- rank {rank.rank} ({_describe_exit(exit_codes[rank.rank])}) output ---\n"
                    f"{output or '(no output)'}"
                )
        self._close()
        raise MultiRankError(
            f"rank processes {ranks} of the {self.world_size}-rank {self.backend} test pool {what} "
            f"(command: {sys.executable} -c {_WORKER_COMMAND!r})\n" + "\n".join(outputs)
        )

    def forward_output(self) -> None:
        """Copy what the ranks printed to this process's stdout, where pytest captures it per test."""
        for rank in self._ranks:
            text = rank.read_new_output()
            if not text:
                continue
            rank.output_since_task_start.append(text)
            prefix = f"[rank {rank.rank}] "
            lines = text.splitlines()
            sys.stdout.write("".join(f"{prefix}{line}\n" for line in lines))
        sys.stdout.flush()

    def run(
        self,
        function: protocol.FunctionRef,
        call_payload: bytes,
        *,
        timeout_s: float,
        description: str,
    ) -> list[protocol.TaskResult]:
        """Run one task on every rank; return the per-rank results or raise MultiRankError."""
        __tracebackhide__ = True  # pytest: the failure is the ranks', not this frame's
        if not self.alive:
            raise RuntimeError("this rank pool was shut down; get a new one from get_pool()")
        self._task_counter += 1
        task = protocol.RunTask(
            task_id=self._task_counter,
            store_prefix=f"shardwise-task-{self._task_counter}/",
            function=function,
            call_payload=call_payload,
            sys_path=tuple(absolute_sys_path()),
            seed=SEED,
            # Collectives must outlive the harness's limits so that a hang is seen here, with
            # stacks, rather than as a gloo timeout error on some rank.
            collective_timeout_s=_timeouts.task_limits(timeout_s).collective_s,
            environment=tuple(os.environ.items()),
        )
        for rank in self._ranks:
            rank.output_since_task_start.clear()
        try:
            return self._run_task(task, timeout_s=timeout_s, description=description)
        except MultiRankError:
            raise  # _run_task already decided whether the ranks can be reused
        except BaseException:
            # Anything unexpected here (including Ctrl-C) leaves the ranks in an unknown state.
            if self.alive:
                self.kill()
            raise

    def _run_task(self, task: protocol.RunTask, *, timeout_s: float, description: str) -> list[protocol.TaskResult]:
        __tracebackhide__ = True
        started = time.monotonic()
        for rank in self._ranks:
            try:
                protocol.send_message(rank.control, task)
            except OSError:
                pass  # the rank is gone; its EOF is reported below
        pending = {rank.control: rank for rank in self._ranks}
        results: dict[int, protocol.TaskResult] = {}
        failure_order: list[int] = []
        exit_codes: dict[int, int | None] = {}
        # Ranks whose body returned and that wait to tear their process group down. They wait so
        # that no rank closes its connections while a slower peer is still connecting to it (gloo
        # then fails that peer's init); a failure releases them at once, so that ranks blocked in
        # a collective with a failed rank error out instead of hanging.
        bodies_finished: set[int] = set()
        awaiting_teardown: list[_Rank] = []
        teardown_released = False
        # timeout_s is a no-progress window, not a wall-clock budget (see _timeouts): while any rank
        # or a process it started (an inductor compile) uses CPU, the task is not hung.
        limits = _timeouts.task_limits(timeout_s)
        poll_s = _timeouts.poll_seconds(timeout_s)
        hard_deadline = started + limits.hard_limit_s
        last_progress_at = started
        last_cpu_ticks = _timeouts.process_tree_cpu_ticks([rank.process.pid for rank in self._ranks])
        first_failure_at: float | None = None
        stalled = False
        failed_with_open_groups: list[_Rank] = []
        open_groups_seen_at: float | None = None
        ended_after_failure: list[_Rank] = []
        while pending:
            now = time.monotonic()
            if first_failure_at is None:
                current_ticks = _timeouts.process_tree_cpu_ticks([rank.process.pid for rank in self._ranks])
                if current_ticks is not None and current_ticks != last_cpu_ticks:
                    last_progress_at, last_cpu_ticks = now, current_ticks
                limit = min(hard_deadline, last_progress_at + timeout_s)
                if now >= limit:
                    stalled = now < hard_deadline
                    break
                wait_s = min(limit - now, poll_s)
            else:
                limit = first_failure_at + GRACE_AFTER_FAILURE_S
                if now >= limit:
                    break
                wait_s = limit - now
                if open_groups_seen_at is not None:
                    wait_s = max(min(wait_s, open_groups_seen_at + OPEN_GROUPS_WAIT_S - now), 0.0)
            for connection in wait_for_readable(list(pending), timeout=wait_s):
                assert isinstance(connection, socket.socket)
                rank = pending[connection]
                try:
                    message = protocol.receive_message(connection)
                except (EOFError, OSError):
                    del pending[connection]
                    exit_codes[rank.rank] = self._exit_code(rank)
                    failure_order.append(rank.rank)
                    continue
                if isinstance(message, protocol.BodyFinished) and message.task_id == task.task_id:
                    bodies_finished.add(rank.rank)
                    awaiting_teardown.append(rank)
                elif isinstance(message, protocol.TaskResult) and message.task_id == task.task_id:
                    del pending[connection]
                    bodies_finished.add(rank.rank)
                    results[rank.rank] = message
                    if message.error is not None:
                        failure_order.append(rank.rank)
                        if message.groups_outlived_teardown:
                            failed_with_open_groups.append(rank)
                else:
                    raise RuntimeError(f"rank {rank.rank} answered {message!r} to task {task.task_id}")
            if failure_order and first_failure_at is None:
                first_failure_at = time.monotonic()
            if failed_with_open_groups and open_groups_seen_at is None:
                open_groups_seen_at = time.monotonic()
            # Once one rank was ended the pool restarts anyway: later ones (peers that failed on the lost
            # connection, with their groups open too) are ended without waiting again.
            if (
                pending
                and failed_with_open_groups
                and open_groups_seen_at is not None
                and (ended_after_failure or time.monotonic() >= open_groups_seen_at + OPEN_GROUPS_WAIT_S)
            ):
                # A failed rank whose process groups outlived its teardown keeps their connections open, so
                # peers blocked in a collective with it would wait for the collective timeout. It has reported
                # its error; ending its process closes those connections and the peers' collectives fail at
                # once (gloo: "Connection closed by peer"), so they report too. The pool is restarted after.
                for failed in failed_with_open_groups:
                    failed.process.kill()
                ended_after_failure.extend(failed_with_open_groups)
                failed_with_open_groups.clear()
                open_groups_seen_at = None
            if failure_order or len(bodies_finished) == self.world_size:
                teardown_released = True
            if teardown_released:
                for rank in awaiting_teardown:
                    try:
                        protocol.send_message(rank.control, protocol.TearDown(task_id=task.task_id))
                    except OSError:
                        pass  # its EOF is reported by the next wait
                awaiting_teardown.clear()
        elapsed = time.monotonic() - started
        # A rank that finished its body but not its teardown answered; it only waited for the others.
        unfinished = tuple(sorted(rank.rank for rank in pending.values() if rank.rank not in bodies_finished))
        stacks = self._dump_stacks(unfinished) if unfinished else {}
        self.forward_output()

        pool_is_usable = (
            not pending and not exit_codes and not ended_after_failure and all(r.clean_teardown for r in results.values())
        )
        if not pool_is_usable:
            self.kill()

        if not failure_order and not unfinished:
            return [results[rank] for rank in range(self.world_size)]
        errors = {rank: result.error for rank, result in results.items() if result.error is not None}
        # A dead rank is the likeliest cause of everything else; then errors in the order raised.
        failure_order = sorted(exit_codes) + sorted(errors, key=lambda rank: (errors[rank].raised_at, rank))
        header_context = f"(world_size={self.world_size}, backend={self.backend})"
        if not failure_order:
            finished = sorted(results)
            why = (
                f"made no progress for {timeout_s:g} s (no rank, nor any process it started, used CPU; "
                f"{elapsed:.1f} s in all)"
                if stalled
                else f"was still running after its hard limit of {limits.hard_limit_s:g} s"
            )
            raise MultiRankTimeout(
                f"{description} timed out: it {why} {header_context}: "
                f"ranks {list(unfinished)} did not answer"
                + (f" (ranks {finished} finished)" if finished else "")
                + ". The rank pool was killed; the next test starts a new one."
                + self._format_stacks(stacks, "did not answer"),
                unfinished_ranks=unfinished,
                stacks=stacks,
            )
        report = self._format_failure(
            description, header_context, failure_order, errors, exit_codes, unfinished, stacks, elapsed
        )
        raise MultiRankError(
            report, errors=errors, exit_codes=exit_codes, unfinished_ranks=unfinished, stacks=stacks
        )

    def _format_failure(
        self,
        description: str,
        header_context: str,
        failure_order: list[int],
        errors: dict[int, protocol.RemoteError],
        exit_codes: dict[int, int | None],
        unfinished: tuple[int, ...],
        stacks: dict[int, str],
        elapsed: float,
    ) -> str:
        failed = sorted(set(failure_order))
        first = failure_order[0]
        first_note = f", rank {first} first" if len(failed) > 1 else ""
        lines = [f"{description} failed on ranks {failed}{first_note} {header_context}"]
        rank_by_number = {rank.rank: rank for rank in self._ranks}
        for position, rank_number in enumerate(failure_order):
            if rank_number in errors:
                error = errors[rank_number]
                if position == 0:
                    lines.append(f"\nrank {rank_number} raised {error.headline()}")
                    lines.append(error.traceback_text.rstrip())
                else:
                    lines.append(f"\nrank {rank_number} also raised {error.headline()}")
            else:
                lines.append(
                    f"\nrank {rank_number} died: its process (pid {rank_by_number[rank_number].pid}) "
                    f"{_describe_exit(exit_codes[rank_number])} while running the test"
                )
                output = _format_rank_output_tail(rank_by_number[rank_number].output_since_task_start)
                if output:
                    lines.append(f"last output of rank {rank_number}:\n{output}")
        if unfinished:
            lines.append(
                f"\nranks {list(unfinished)} did not finish within {elapsed:.1f} s (rank {first} failed first); "
                "the rank pool was killed."
            )
            lines.append(self._format_stacks(stacks, "did not finish"))
        elif set(exit_codes):
            lines.append("\nthe rank pool was killed; the next test starts a new one.")
        return "\n".join(lines)

    @staticmethod
    def _format_stacks(stacks: dict[int, str], what: str) -> str:
        if not stacks:
            return ""
        parts = [f"\nPython stacks of the ranks that {what} (most recent call first):"]
        for rank_number, stack in sorted(stacks.items()):
            parts.append(f"--- rank {rank_number} ---\n{_without_harness_frames(stack) or '(no stack was written)'}")
        return "\n".join(parts)

    @staticmethod
    def _exit_code(rank: _Rank, wait_s: float = 5.0) -> int | None:
        try:
            return rank.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def _dump_stacks(self, rank_numbers: tuple[int, ...]) -> dict[int, str]:
        """Ask the given ranks for their Python stacks (faulthandler on SIGUSR1) and collect them."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        self.forward_output()
        targets = [rank for rank in self._ranks if rank.rank in rank_numbers and rank.process.poll() is None]
        for rank in targets:
            try:
                os.kill(rank.process.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        stacks: dict[int, str] = {rank.rank: "" for rank in targets}
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            grew = False
            for rank in targets:
                text = rank.read_new_output()
                if text:
                    grew = True
                    stacks[rank.rank] += text
                    rank.output_since_task_start.append(text)
            if grew:
                quiet_since = time.monotonic()
            elif all(stacks.values()) and time.monotonic() - quiet_since > 0.2:
                break
        return stacks

    def kill(self) -> None:
        """Kill every rank at once (after a failure their state is unknown)."""
        self._kill_processes()
        self._close()

    def _kill_processes(self) -> None:
        self.alive = False
        for rank in self._ranks:
            if rank.process.poll() is None:
                rank.process.kill()
        for rank in self._ranks:
            try:
                rank.process.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass

    def shutdown(self) -> None:
        """Ask the ranks to exit, kill those that do not."""
        if not self.alive:
            self._close()
            return
        self.alive = False
        for rank in self._ranks:
            try:
                protocol.send_message(rank.control, protocol.Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for rank in self._ranks:
            try:
                rank.process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                rank.process.kill()
                rank.process.wait()
        self._close()

    def _close(self) -> None:
        for rank in self._ranks:
            rank.control.close()
            rank.log_reader.close()
        if self._zygote is not None:
            self._zygote.close()  # it exits once every rank has
            self._zygote = None
        shutil.rmtree(self._log_dir, ignore_errors=True)


_live_pools: OrderedDict[tuple[int, str], RankPool] = OrderedDict()


def get_pool(world_size: int, backend: str, startup_timeout_s: float) -> RankPool:
    """The live pool for (world_size, backend), started on first use; least recently used pools are shut down."""
    if protocol.ENV_RANK in os.environ:
        # A rank process imports the module that defines the body it runs; a module that starts
        # ranks at import would make every rank start its own pool, and each of those again.
        raise RuntimeError(
            f"rank {os.environ[protocol.ENV_RANK]} was asked to start a pool of {world_size} ranks: rank "
            "processes cannot start ranks. The module defining the rank body probably calls "
            "run_on_ranks at import; put that call under `if __name__ == '__main__':` or in a test function"
        )
    key = (world_size, backend)
    pool = _live_pools.get(key)
    if pool is not None and pool.alive:
        _live_pools.move_to_end(key)
        return pool
    _live_pools.pop(key, None)
    while len(_live_pools) >= MAX_LIVE_POOLS:
        _, evicted = _live_pools.popitem(last=False)
        evicted.shutdown()
    pool = RankPool(world_size, backend, startup_timeout_s)
    _live_pools[key] = pool
    return pool


def shutdown_pools() -> None:
    """Stop every rank process started by this process (also run at interpreter exit)."""
    while _live_pools:
        _, pool = _live_pools.popitem()
        pool.shutdown()


atexit.register(shutdown_pools)


def pickle_call(args: tuple[object, ...], kwargs: dict[str, object], what: str) -> bytes:
    try:
        return pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        raise TypeError(
            f"the arguments of {what} must be picklable to be sent to the rank processes: {error}"
        ) from error
