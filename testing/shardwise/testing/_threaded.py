"""Ranks as threads of this process: a world of ``world_size`` threads, each with its own rank.

Starting rank processes costs seconds; a thread costs microseconds, which is what a sweep over
many ops and shardings needs. The ranks share one process and talk through torch's threaded
process group (``torch.testing._internal.distributed.multi_threaded_pg``, a test utility), whose
groups are registered per thread so that ``torch.ops._c10d_functional`` collectives find each
rank's own group by name.

Sharing a process has a cost: state that a real rank keeps for itself in module globals would
be shared by every rank thread. The shardwise stack keeps per-rank data in two objects: the
mesh's process-group registry and dtensor_ops's ``RANK_CACHES`` (``shardwise.dtensor_ops._caches``);
while a thread world runs, the registry and each field of ``RANK_CACHES`` are swapped for
per-thread copies (see ``isolated_rank_state``). Torch's random generator is process-wide too: ranks drawing
random numbers at the same time get interleaved draws, unlike separate processes.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import traceback
import types
import unittest
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from shardwise.testing._multi_rank import DEFAULT_WORLD_SIZE, resolve_timeout
from shardwise.testing._protocol import RemoteError
from shardwise.testing._rank_pool import SEED, MultiRankError, MultiRankTimeout

__all__ = ["isolated_rank_state", "run_on_threads"]

_R = TypeVar("_R")

# How long the other rank threads get to notice that one failed (they are woken out of their
# collectives at once, so this only bounds a rank stuck outside collectives).
_GRACE_AFTER_FAILURE_S = 5.0
_THREADED_BACKEND = "threaded"
# What torch's threaded process group raises in the ranks it wakes up after another rank failed.
_TERMINATION_MESSAGE = "Test termination event occurs."

# The mesh's process-group registry (one object, read through its module's global by that module only):
# each rank thread has its own groups.
_MESH_REGISTRY = ("shardwise.mesh._process_groups", "_registry")


class _PerThreadMapping(MutableMapping[Any, Any]):
    """A dict per thread behind one object, for module-level caches read as ``cache.get(key)``."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _dict(self) -> dict[Any, Any]:
        mapping: dict[Any, Any] | None = getattr(self._local, "mapping", None)
        if mapping is None:
            mapping = {}
            self._local.mapping = mapping
        return mapping

    def __getitem__(self, key: Any) -> Any:
        return self._dict()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._dict()[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._dict()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def __contains__(self, key: object) -> bool:
        return key in self._dict()

    def get(self, key: Any, default: Any = None) -> Any:
        return self._dict().get(key, default)

    def clear(self) -> None:
        self._dict().clear()


class _PerThreadObject:
    """One ``factory()`` instance per thread behind one object (attribute access is forwarded)."""

    def __init__(self, factory: Callable[[], object]) -> None:
        object.__setattr__(self, "_factory", factory)
        object.__setattr__(self, "_local", threading.local())

    def _instance(self) -> object:
        local = object.__getattribute__(self, "_local")
        instance = getattr(local, "instance", None)
        if instance is None:
            instance = object.__getattribute__(self, "_factory")()
            local.instance = instance
        return instance

    def __getattr__(self, name: str) -> Any:
        return getattr(self._instance(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._instance(), name, value)


@contextmanager
def isolated_rank_state() -> Iterator[list[str]]:
    """Give every thread its own per-rank state while inside: each field of dtensor_ops's
    ``RANK_CACHES`` object (its decisions, programs, ...) and the mesh's process-group registry.

    Yields the names of what was swapped; restores the originals on exit.
    """
    from shardwise.dtensor_ops._caches import RANK_CACHES, RankCaches

    swapped: list[tuple[object, str, object]] = []
    try:
        for field in RankCaches.fields():
            swapped.append((RANK_CACHES, field, getattr(RANK_CACHES, field)))
            setattr(RANK_CACHES, field, _PerThreadMapping())
        module_name, attribute = _MESH_REGISTRY
        module = importlib.import_module(module_name)
        registry = getattr(module, attribute)
        swapped.append((module, attribute, registry))
        setattr(module, attribute, _PerThreadObject(type(registry)))
        yield [f"RANK_CACHES.{field}" for field in RankCaches.fields()] + [f"{module_name}.{attribute}"]
    finally:
        for holder, attribute, original in reversed(swapped):
            setattr(holder, attribute, original)


# ---------------------------------------------------------------------------------- the world

_world_lock = threading.Lock()


def _set_thread_isolation_mode(enabled: bool) -> None:
    # Per-thread c10d group registries: each rank thread resolves group names to its own groups.
    set_mode: Callable[[bool], None] = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode")
    set_mode(enabled)


def _skip_exception_types() -> tuple[type[BaseException], ...]:
    skip_types: list[type[BaseException]] = [unittest.SkipTest]
    outcomes = sys.modules.get("_pytest.outcomes")
    pytest_skipped = getattr(outcomes, "Skipped", None)
    if isinstance(pytest_skipped, type) and issubclass(pytest_skipped, BaseException):
        skip_types.append(pytest_skipped)
    return tuple(skip_types)


class _RankOutcome:
    __slots__ = ("value", "error", "raised_at", "traceback_text")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.raised_at = 0.0
        self.traceback_text = ""


def _is_termination_echo(error: BaseException) -> bool:
    return isinstance(error, SystemExit) and error.code == _TERMINATION_MESSAGE


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _traceback_text(error: BaseException) -> str:
    tb = error.__traceback__
    # The outermost frames are this package's (thread entry point, test-case plumbing): the
    # test's frames are what matter.
    while tb is not None and os.path.dirname(os.path.abspath(tb.tb_frame.f_code.co_filename)) == _PACKAGE_DIR:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _remote_error(outcome: _RankOutcome) -> RemoteError:
    assert outcome.error is not None
    error_type = type(outcome.error)
    module = error_type.__module__
    name = error_type.__qualname__ if module == "builtins" else f"{module}.{error_type.__qualname__}"
    return RemoteError(
        exception_type=name,
        message=str(outcome.error),
        traceback_text=outcome.traceback_text,
        raised_at=outcome.raised_at,
    )


def _thread_stacks(threads: dict[int, threading.Thread]) -> dict[int, str]:
    frames = sys._current_frames()
    # Thread start-up and this module's rank entry point sit below every test body.
    noise = {threading.__file__, __file__}
    stacks: dict[int, str] = {}
    for rank, thread in threads.items():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if frame is None:
            stacks[rank] = "(the thread has no Python frame)"
            continue
        summary = traceback.StackSummary.from_list(
            [entry for entry in traceback.extract_stack(frame) if entry.filename not in noise]
        )
        stacks[rank] = "".join(summary.format())
    return stacks


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def run_on_threads(
    fn: Callable[..., _R],
    *args: Any,
    world_size: int = DEFAULT_WORLD_SIZE,
    timeout: float | None = None,
    **kwargs: Any,
) -> list[_R]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` rank threads; return each rank's result.

    Every thread has its own default process group (torch's "threaded" backend), so
    ``dist.get_rank()``, c10d and ``torch.ops._c10d_functional`` collectives and shardwise
    meshes work as on separate processes. ``fn`` may be any callable (no pickling). Raises
    ``MultiRankError`` naming the ranks that raised, with the first one's traceback, or
    ``MultiRankTimeout`` with the stacks of the threads still running after ``timeout`` seconds
    (default: $SHARDWISE_TEST_TIMEOUT, else 120 s). A skip raised on the ranks is re-raised.
    Only one thread world runs at a time in a process.
    """
    __tracebackhide__ = True
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    timeout_s = resolve_timeout(timeout)
    description = _describe(fn)
    if not _world_lock.acquire(blocking=False):
        raise RuntimeError(
            f"run_on_threads({description}): a thread world is already running in this process; "
            "thread worlds cannot be nested or run concurrently (torch's threaded process group is process-wide)"
        )
    try:
        return _run_world(fn, args, kwargs, world_size, timeout_s, description)
    finally:
        _world_lock.release()


def _run_world(
    fn: Callable[..., _R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    world_size: int,
    timeout_s: float,
    description: str,
) -> list[_R]:
    __tracebackhide__ = True
    from torch.testing._internal.distributed import multi_threaded_pg

    process_local_group = multi_threaded_pg.ProcessLocalGroup
    outcomes = [_RankOutcome() for _ in range(world_size)]
    first_failure = threading.Event()
    # Cleared when this world is over: a rank thread left behind after a timeout must not set
    # torch's process-wide termination event for the next world.
    world_active = threading.Event()
    world_active.set()
    store = dist.HashStore()

    def rank_main(rank: int) -> None:
        outcome = outcomes[rank]
        try:
            dist.init_process_group(_THREADED_BACKEND, rank=rank, world_size=world_size, store=store)
            outcome.value = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - everything a rank raises is reported
            outcome.error = error
            outcome.raised_at = time.time()
            outcome.traceback_text = _traceback_text(error)
            first_failure.set()
            if world_active.is_set():
                # Wake the ranks waiting for this one in a collective: they exit with SystemExit.
                process_local_group.exception_handle(error)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    process_local_group.reset()
    _set_thread_isolation_mode(True)
    multi_threaded_pg._install_threaded_pg()
    summing_reduce_scatter = multi_threaded_pg.ReduceScatter
    setattr(multi_threaded_pg, "ReduceScatter", _reduce_scatter_with_max_and_min(summing_reduce_scatter))
    threads: dict[int, threading.Thread] = {}
    try:
        with isolated_rank_state():
            torch.manual_seed(SEED)
            for rank in range(world_size):
                thread = threading.Thread(target=rank_main, args=(rank,), name=f"shardwise-rank-{rank}", daemon=True)
                threads[rank] = thread
                thread.start()
            deadline = time.monotonic() + timeout_s
            grace_deadline: float | None = None
            for thread in threads.values():
                while thread.is_alive():
                    now = time.monotonic()
                    if grace_deadline is None and first_failure.is_set():
                        grace_deadline = now + _GRACE_AFTER_FAILURE_S
                    limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
                    if now >= limit:
                        break
                    thread.join(min(0.05, limit - now))
                if thread.is_alive():
                    break
            stuck = {rank: thread for rank, thread in threads.items() if thread.is_alive()}
            stacks = _thread_stacks(stuck) if stuck else {}
            if stuck:
                # Wake the stuck ranks if they wait in a collective, so they do not linger.
                process_local_group.exception_handle(TimeoutError(f"{description} timed out"))
                for thread in stuck.values():
                    thread.join(1.0)
    finally:
        world_active.clear()
        process_local_group.reset()
        multi_threaded_pg._uninstall_threaded_pg()
        setattr(multi_threaded_pg, "ReduceScatter", summing_reduce_scatter)
        _set_thread_isolation_mode(False)

    return _collect(outcomes, stuck, stacks, world_size, timeout_s, description)


def _reduce_scatter_with_max_and_min(summing: type) -> type:
    """torch's threaded reduce-scatter (``summing``) with MAX and MIN added, as gloo and NCCL have them.

    The thread ranks stand for gloo ranks; without these, redistributions a real backend runs
    (Partial(max) -> Shard) would fail only in threaded tests.
    """

    class ReduceScatterWithMaxAndMin:
        def __init__(self, op: Any) -> None:
            # ``op`` is a ReduceOp, which compares equal to (but does not hash as) its RedOpType.
            self.combine = torch.maximum if op == dist.ReduceOp.MAX else torch.minimum if op == dist.ReduceOp.MIN else None
            self.summing = summing(op) if self.combine is None else None

        @torch.no_grad()
        def work(self, data: list[Any]) -> None:
            # data[rank] = ([output tensor], [[piece for rank 0, piece for rank 1, ...]])
            if self.summing is not None:
                self.summing.work(data)
                return
            assert self.combine is not None
            for destination_rank, (outputs, _) in enumerate(data):
                pieces = [inputs[0][destination_rank] for _, inputs in data]
                reduced = pieces[0]
                for piece in pieces[1:]:
                    reduced = self.combine(reduced, piece.to(reduced.device))
                outputs[0].detach().copy_(reduced)

    return ReduceScatterWithMaxAndMin


def _collect(
    outcomes: list[_RankOutcome],
    stuck: dict[int, threading.Thread],
    stacks: dict[int, str],
    world_size: int,
    timeout_s: float,
    description: str,
) -> list[_R]:
    __tracebackhide__ = True
    context = f"(world_size={world_size}, ranks as threads)"
    raised = {rank: outcome.error for rank, outcome in enumerate(outcomes) if outcome.error is not None}
    skip_types = _skip_exception_types()
    skips = [error for error in raised.values() if isinstance(error, skip_types)]
    real_failures = {
        rank: outcomes[rank]
        for rank, error in raised.items()
        if not isinstance(error, skip_types) and not _is_termination_echo(error)
    }
    if not real_failures and stuck:
        raise MultiRankTimeout(
            f"{description} timed out after {timeout_s:g} s {context}: ranks {sorted(stuck)} did not finish"
            + _format_stacks(stacks),
            unfinished_ranks=tuple(sorted(stuck)),
            stacks=stacks,
        )
    if real_failures:
        order = sorted(real_failures, key=lambda rank: (real_failures[rank].raised_at, rank))
        errors = {rank: _remote_error(real_failures[rank]) for rank in order}
        first = order[0]
        first_note = f", rank {first} first" if len(order) > 1 else ""
        lines = [f"{description} failed on ranks {sorted(order)}{first_note} {context}"]
        lines.append(f"\nrank {first} raised {errors[first].headline()}")
        lines.append(errors[first].traceback_text.rstrip())
        for rank in order[1:]:
            lines.append(f"\nrank {rank} also raised {errors[rank].headline()}")
        if stuck:
            lines.append(f"\nranks {sorted(stuck)} did not finish (rank {first} failed first)")
            lines.append(_format_stacks(stacks))
        raise MultiRankError(
            "\n".join(lines), errors=errors, unfinished_ranks=tuple(sorted(stuck)), stacks=stacks
        )
    if skips:
        raise skips[0]
    if raised:
        # Only termination echoes and no cause: something else set torch's termination event.
        raise MultiRankError(f"{description}: ranks {sorted(raised)} were terminated without a failing rank {context}")
    return [outcome.value for outcome in outcomes]


def _format_stacks(stacks: dict[int, str]) -> str:
    if not stacks:
        return ""
    parts = ["\nPython stacks of the rank threads that did not finish (most recent call last):"]
    for rank, stack in sorted(stacks.items()):
        parts.append(f"--- rank {rank} ---\n{stack.rstrip()}")
    return "\n".join(parts)
