"""The "local tensor" variants of ``common_dtensor``: every rank of a test simulated in one process.

As PyTorch's: ``LocalDTensorTestBase`` / ``LocalDTensorOpTestBase`` / ``LocalDTensorContinuousTestBase``
run each test method in the test process over a "fake" process group of ``world_size`` ranks,
``self.rank`` is a ``LocalIntNode`` SymInt holding every rank, and ``create_local_tensor_test_class``
copies a test class with every ``test_*`` method run under ``torch.distributed._local_tensor.LocalTensorMode``:
tensors are ``LocalTensor``s (one tensor per simulated rank), shardwise's meshes report each
simulated rank's coordinate (``shardwise.mesh._simulation``) and collectives are performed by the
mode on the ``LocalTensor``s. One process, no start-up, no threads.

Where the mode cannot simulate something (testing/README.md, "Local-tensor variants"), the threaded
variants remain: ``ThreadedLocalDTensorTestBase`` / ``ThreadedLocalDTensorOpTestBase`` /
``ThreadedLocalDTensorContinuousTestBase`` run every rank as a thread of the test process with real
per-rank values and ``int`` ranks; ``create_local_tensor_test_class(cls, base_class=ThreadedLocal...)``
uses them (no mode then).

``map_local_for_rank`` / ``map_local_tensor_for_rank`` / ``reduce_local_int`` are PyTorch's helpers
for tests that must work both ways: under ``LocalTensorMode`` they map over the simulated ranks, on
real ranks they call the function once.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, ContextManager, Iterable, Sequence, TypeVar, Union

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalIntNode, LocalTensorMode, maybe_run_for_local_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh
from shardwise.mesh._simulation import mode_disabled, rank_of_piece
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
    "ThreadedLocalDTensorContinuousTestBase",
    "ThreadedLocalDTensorOpTestBase",
    "ThreadedLocalDTensorTestBase",
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

_SIMULATED_RANKS = "simulated"
_THREAD_RANKS = "thread"
_FAKE_BACKEND = "fake"


def _init_fake_world(world_size: int) -> None:
    dist.init_process_group(_FAKE_BACKEND, rank=0, world_size=world_size, store=FakeStore())


def _is_fake_world(world_size: int) -> bool:
    return (
        dist.is_initialized()
        and str(dist.get_backend()) == _FAKE_BACKEND
        and dist.get_world_size() == world_size
    )


class _RanksSimulated(_RankRunner):
    """Runs every test method in the test process over a fake process group of ``world_size`` ranks.

    The ranks are simulated by ``LocalTensorMode`` (entered around each ``test_*`` method by
    :func:`create_local_tensor_test_class`, or by the test itself via ``_get_local_tensor_mode()``).
    """

    @property
    def is_local_tensor_enabled(self) -> bool:
        return True

    @property
    def rank(self) -> Any:
        """Every simulated rank at once: a ``LocalIntNode`` SymInt ``{r: r}`` (PyTorch's spelling)."""
        if self._rank_mode != _SIMULATED_RANKS:
            return super().rank
        return torch.SymInt(LocalIntNode({rank: rank for rank in range(self._world_size_to_run())}))

    @rank.setter
    def rank(self, value: int) -> None:
        # PyTorch's local bases ignore assignments to rank.
        pass

    @property
    def device_type(self) -> str:
        return self._device_type if self._device_type is not None else "cpu"

    @device_type.setter
    def device_type(self, value: str) -> None:
        self._device_type = value

    @property
    def backend(self) -> str:
        return _FAKE_BACKEND

    def _handle_test_skip(self, msg: str) -> None:
        self.skipTest(msg)

    def assertEqualOnRank(self, x: Any, y: Any, msg: str | None = None, *, rank: int = 0) -> None:
        """``assertEqual`` on simulated rank ``rank``'s values (its piece of each ``LocalTensor``)."""
        with mode_disabled():
            self.assertEqual(rank_of_piece(x, rank), rank_of_piece(y, rank), msg)

    def assertNotEqualOnRank(self, x: Any, y: Any, msg: str | None = None, *, rank: int = 0) -> None:
        with mode_disabled():
            self.assertNotEqual(rank_of_piece(x, rank), rank_of_piece(y, rank), msg)

    def _get_local_tensor_mode(self) -> LocalTensorMode:
        return LocalTensorMode(frozenset(range(self._world_size_to_run())))

    def build_device_mesh(self) -> DeviceMesh:
        with mode_disabled():
            return super().build_device_mesh()

    def init_pg(self, eager_init: bool = False, backend: str | None = None) -> None:
        """A fake process group of ``world_size`` ranks (any ``backend`` asked for is simulated by it)."""
        world_size = self._world_size_to_run()
        self._owns_process_group = False
        if _is_fake_world(world_size):
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        _init_fake_world(world_size)
        self._owns_process_group = True

    def destroy_pg(self, device_id: int | None = None) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def init_manual_seed_for_rank(self) -> None:
        # One generator for all simulated ranks; per-rank streams come from LocalTensorMode.
        torch.manual_seed(0)

    def _run_on_ranks(self, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        world_size = self._world_size_to_run()
        if dist.is_initialized() and not _is_fake_world(world_size):
            raise RuntimeError(
                f"{type(self).__name__}.{method_name}: a process group ({dist.get_backend()}, world size "
                f"{dist.get_world_size()}) is already initialised in the test process; the local-tensor variants "
                f"simulate {world_size} ranks over a fake group of their own. Destroy it first"
            )
        if not dist.is_initialized():
            _init_fake_world(world_size)
        torch.autograd._enable_record_function(False)
        self._rank_mode = _SIMULATED_RANKS
        try:
            return getattr(self, method_name)(*args, **kwargs)
        finally:
            self._rank_mode = None
            torch.autograd._enable_record_function(True)
            if dist.is_initialized() and str(dist.get_backend()) == _FAKE_BACKEND:
                dist.destroy_process_group()


class LocalDTensorTestBase(_RanksSimulated, DTensorTestBase):
    """``DTensorTestBase`` with every rank simulated in the test process (see the module docstring)."""


class LocalDTensorOpTestBase(_RanksSimulated, DTensorOpTestBase):
    """``DTensorOpTestBase`` with every rank simulated in the test process."""


class LocalDTensorContinuousTestBase(_RanksSimulated, DTensorContinuousTestBase):
    """``DTensorContinuousTestBase`` with every rank simulated in the test process."""


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


class ThreadedLocalDTensorTestBase(_RanksAsThreads, DTensorTestBase):
    """``DTensorTestBase`` with every rank a thread of the test process (no ``LocalTensorMode``)."""


class ThreadedLocalDTensorOpTestBase(_RanksAsThreads, DTensorOpTestBase):
    """``DTensorOpTestBase`` whose ``@with_comms`` methods also go through ``init_pg``/``destroy_pg``."""


class ThreadedLocalDTensorContinuousTestBase(_RanksAsThreads, DTensorContinuousTestBase):
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


def _local_tensor_mode_of(test: Any) -> ContextManager[Any]:
    mode: ContextManager[Any] = test._get_local_tensor_mode()
    return mode


def create_local_tensor_test_class(
    orig_cls: _Case, skipped_tests: Iterable[str] | None = None, base_class: type = LocalDTensorTestBase
) -> _Case:
    """A copy of ``orig_cls`` named ``<name>WithLocalTensor`` whose tests simulate every rank in this process.

    With a ``LocalDTensor*`` base (the default) every ``test_*`` method runs under
    ``LocalTensorMode``; with a ``ThreadedLocalDTensor*`` base the ranks are threads instead.
    ``skipped_tests`` names test methods the copy skips. Assign the result to a module-level name
    as in PyTorch (``FooWithLocalTensor = create_local_tensor_test_class(Foo)``) so test runners
    collect it.
    """
    skipped = set(skipped_tests or ())
    under_mode = issubclass(base_class, _RanksSimulated)
    namespace = dict(vars(orig_cls))
    namespace.pop("__dict__", None)
    namespace.pop("__weakref__", None)
    for name in list(namespace):
        value = namespace[name]
        if not callable(value):
            continue
        if name in skipped:

            def skip_this(self: Any, _name: str = name) -> None:
                self.skipTest(f"{_name} is skipped in the local-tensor variant")

            skip_this.__name__ = name
            namespace[name] = skip_this
        elif under_mode and name.startswith("test_"):
            namespace[name] = make_wrapped(value, [_local_tensor_mode_of])
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
