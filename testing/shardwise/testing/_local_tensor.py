"""The "local tensor" variants of ``common_dtensor``: every rank of a test in one process.

PyTorch runs these variants under ``torch.distributed._local_tensor.LocalTensorMode``, where
each tensor holds one value per simulated rank and ranks are ``SymInt``s. shardwise's DTensor
does not run under that mode (see testing/README.md, "Local-tensor variants": the mode patches
the rank and coordinate lookups of *torch's* ``DeviceMesh`` only, so shardwise's mesh reports
rank 0's coordinate for every simulated rank and each rank would cut rank 0's shard). The
variants here keep the promise that matters to a test suite, every rank in one process with no
process start-up, by running the ranks as threads (``run_on_threads``): the tests see plain
``int`` ranks, real per-rank values and real collectives.

``map_local_for_rank`` / ``map_local_tensor_for_rank`` / ``reduce_local_int`` are PyTorch's
helpers for tests that must work both ways: under ``LocalTensorMode`` (torch's own DTensor)
they map over the simulated ranks, on real ranks they call the function once.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, ContextManager, Iterable, Sequence, TypeVar, Union

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import maybe_run_for_local_tensor

from shardwise.dtensor_ops import DTensor
from shardwise.testing._dtensor_test_base import (
    DTensorContinuousTestBase,
    DTensorOpTestBase,
    DTensorTestBase,
    _RankRunner,
)
from shardwise.testing._threaded import run_on_threads

__all__ = [
    "LocalDTensorContinuousTestBase",
    "LocalDTensorOpTestBase",
    "LocalDTensorTestBase",
    "create_local_tensor_test_class",
    "make_full_tensor",
    "make_wrapped",
    "map_local_for_rank",
    "map_local_tensor_for_rank",
    "reduce_local_int",
]

_R = TypeVar("_R")
_Case = TypeVar("_Case", bound=type)
ContextFactory = Union[ContextManager[Any], Callable[[Any], ContextManager[Any]]]

_THREAD_RANKS = "thread"


class _RanksAsThreads(_RankRunner):
    """Runs every test method on rank threads; process-group calls keep the thread world's group."""

    def _handle_test_skip(self, msg: str) -> None:
        self.skipTest(msg)

    def init_pg(self, eager_init: bool = False, backend: str | None = None) -> None:
        """The rank threads already share a default group of torch's threaded backend: kept."""
        self._owns_process_group = False
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__}.init_pg: the rank threads' process group is gone (destroyed by the test?); "
                "ranks as threads cannot make another one"
            )

    def destroy_pg(self, device_id: int | None = None) -> None:
        """Meet the other rank threads; the thread world destroys the group when the test ends."""
        if dist.is_initialized():
            dist.barrier()

    def init_manual_seed_for_rank(self) -> None:
        # The rank threads share torch's generator: one seed for all, as PyTorch's variants do.
        torch.manual_seed(0)

    def _run_on_ranks(self, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        __tracebackhide__ = True
        test_class = type(self)

        def run_on_this_thread() -> None:
            test = test_class(method_name)
            test._enter_rank(_THREAD_RANKS)
            test.setUp()
            try:
                getattr(test, method_name)(*args, **kwargs)
            finally:
                test.tearDown()

        run_on_this_thread.__module__ = test_class.__module__
        run_on_this_thread.__qualname__ = f"{test_class.__qualname__}.{method_name}"
        run_on_threads(run_on_this_thread, world_size=self._world_size_to_run(), timeout=self._timeout_seconds())


class LocalDTensorTestBase(_RanksAsThreads, DTensorTestBase):
    """``DTensorTestBase`` with every rank a thread of the test process (see the module docstring)."""


class LocalDTensorOpTestBase(_RanksAsThreads, DTensorOpTestBase):
    """``DTensorOpTestBase`` whose ``@with_comms`` methods also go through ``init_pg``/``destroy_pg``."""


class LocalDTensorContinuousTestBase(_RanksAsThreads, DTensorContinuousTestBase):
    """``DTensorContinuousTestBase`` with every rank a thread of the test process."""


def make_wrapped(fn: Callable[[Any], _R], ctxs: Sequence[ContextFactory]) -> Callable[[Any], _R]:
    """``fn(self)`` inside ``ctxs`` (context managers, or callables of the test giving one)."""

    @functools.wraps(fn)
    def wrapped(self: Any) -> _R:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            dynamo.reset()
        with contextlib.ExitStack() as stack:
            for ctx in ctxs:
                stack.enter_context(ctx(self) if callable(ctx) else ctx)
            return fn(self)

    return wrapped


def create_local_tensor_test_class(
    orig_cls: _Case, skipped_tests: Iterable[str] | None = None, base_class: type = LocalDTensorTestBase
) -> _Case:
    """A copy of ``orig_cls`` named ``<name>WithLocalTensor`` whose tests run with every rank in this process.

    ``skipped_tests`` names test methods the copy skips. Assign the result to a module-level name
    as in PyTorch (``FooWithLocalTensor = create_local_tensor_test_class(Foo)``) so test runners
    collect it.
    """
    skipped = set(skipped_tests or ())
    namespace = dict(vars(orig_cls))
    namespace.pop("__dict__", None)
    namespace.pop("__weakref__", None)
    for name in list(namespace):
        if name in skipped and callable(namespace[name]):

            def skip_this(self: Any, _name: str = name) -> None:
                self.skipTest(f"{_name} is skipped in the local-tensor variant")

            skip_this.__name__ = name
            namespace[name] = skip_this
    local_class = type(f"{orig_cls.__name__}WithLocalTensor", (base_class, *orig_cls.__bases__), namespace)
    local_class.__qualname__ = local_class.__name__
    return local_class  # type: ignore[return-value]


@maybe_run_for_local_tensor
def map_local_tensor_for_rank(tensor: torch.Tensor, rank: int, func: Callable[[torch.Tensor, int], _R]) -> _R:
    """``func(tensor, rank)``; per simulated rank under ``LocalTensorMode``."""
    return func(tensor, rank)


@maybe_run_for_local_tensor
def map_local_for_rank(rank: int, func: Callable[[int], _R]) -> _R:
    """``func(rank)``; per simulated rank under ``LocalTensorMode``."""
    return func(rank)


def reduce_local_int(val: Any, func: Callable[[dict[int, int]], _R]) -> _R:
    """``func({rank: value})`` of a per-rank int: a ``LocalIntNode`` SymInt, or a plain int on a real rank."""
    node = getattr(val, "node", None)
    local_ints = getattr(node, "_local_ints", None)
    if local_ints is not None:
        return func(dict(local_ints))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return func({rank: int(val)})


def make_full_tensor(dtensor_input: DTensor) -> torch.Tensor:
    """The whole tensor on every rank (PyTorch's shard-order-aware spelling of ``full_tensor()``)."""
    if not isinstance(dtensor_input, DTensor):
        raise TypeError(f"make_full_tensor expects a DTensor, got {type(dtensor_input).__name__}")
    return dtensor_input.full_tensor()
