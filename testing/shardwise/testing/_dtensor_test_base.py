"""unittest-style bases for DTensor tests: a drop-in for PyTorch's ``common_dtensor`` test bases.

The bases are torch's own ``torch.testing._internal.common_utils.TestCase`` (testing
infrastructure, not DTensor), so every assertion (``assertEqual`` on tensors and sequences with
torch's tolerances, ``assertNotWarn``, ``assertExpectedInline``, ...) behaves as in PyTorch's suite.

``DTensorTestBase``: every test method runs on ``world_size`` rank *processes* of the pooled
harness (``run_on_ranks``), as PyTorch's ``MultiProcessTestCase`` runs it on spawned processes.
The test process does not pickle the TestCase: it sends the class's module, file and qualified
name plus the test's name, and each rank rebuilds a fresh instance and runs ``setUp``, the method
and ``tearDown`` on it. The harness gives every call a fresh default process group; ``@with_comms``
keeps PyTorch's meaning (``init_pg`` before, ``destroy_pg`` after), where ``init_pg`` keeps the
harness's group unless another backend is asked for.

``DTensorContinuousTestBase``: the same on processes, for classes written against PyTorch's
``MultiProcContinuousTest`` (``world_size`` a class attribute, no ``@with_comms`` needed).

``DTensorOpTestBase``: every test method runs on ``world_size`` rank *threads* of the test
process (see ``_threaded.py``), for sweeps over many ops where process start-up would dominate.

Differences from PyTorch worth knowing (also in testing/README.md):

* On processes, ``setUp``/``tearDown`` run in the test process (unittest runs them) and again on
  every rank around the method; PyTorch runs them in the parent only. On threads, as in PyTorch,
  ``setUp``/``tearDown`` run in the test thread and ``perThreadSetUp``/``perThreadTearDown`` on
  the rank threads. Class fixtures (``setUpClass``) run in the test process only.
* Process ranks always start with a default process group (PyTorch's start without one until
  ``init_pg``); a failed test does not poison the following ones (the pool recovers).
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import unittest
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence, TypeVar, cast, overload

import torch
import torch.distributed as dist
from torch.testing._internal import common_utils
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.testing._converter import DTensorConverter
from shardwise.testing._multi_rank import function_ref, multi_rank, run_on_ranks
from shardwise.testing._protocol import FunctionRef
from shardwise.testing._rank_worker import reinit_default_group, resolve_function
from shardwise.testing._threaded import run_on_threads

__all__ = [
    "DEVICE_COUNT",
    "DEVICE_TYPE",
    "NUM_DEVICES",
    "PG_BACKEND",
    "DTensorContinuousTestBase",
    "DTensorOpTestBase",
    "DTensorTestBase",
    "DTensorTestMixin",
    "TestFunc",
    "run_subtests",
    "skip_if_lt_x_gpu",
    "skip_unless_torch_gpu",
    "with_comms",
]

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])
TestFunc = Callable[..., object]

# More than one GPU is what makes CUDA worth testing on: one GPU per rank, NCCL.
DEVICE_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0
_MULTI_GPU = DEVICE_COUNT > 1
DEVICE_TYPE = "cuda" if _MULTI_GPU else "cpu"
PG_BACKEND = "nccl" if _MULTI_GPU else "gloo"
NUM_DEVICES = min(4, DEVICE_COUNT) if _MULTI_GPU else 4

# PyTorch's main process (or thread) has this rank while its ranks run the test.
MAIN_PROCESS_RANK = -1

_PROCESS_RANKS = "process"
_THREAD_RANKS = "thread"

# The backends PyTorch's DTensorTestBase.init_pg accepts (on top of "<cpu>:gloo,<device>:<backend>").
_KNOWN_BACKENDS = (
    "nccl",
    "gloo",
    "mpi",
    "cpu:gloo,cuda:nccl",
    "cpu:gloo,cuda:ncclx",
    "cuda:ncclx",
    "hccl",
    "xccl",
    "fake",
    "cpu:gloo,xpu:xccl",
)

# torch's TestCase.run compiles the test under these settings; otherwise it only sets dynamo
# options, which costs importing dynamo (seconds) in every test process: skipped then.
_COMPILED_TEST_RUN = bool(
    common_utils.TEST_WITH_TORCHDYNAMO
    or common_utils.TEST_WITH_AOT_EAGER
    or common_utils.TEST_WITH_TORCHINDUCTOR
    or common_utils.TEST_WITH_CROSSREF
)


def _device_type_for(world_size: int) -> str:
    """CUDA when every rank can have a GPU of its own, else CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return DEVICE_TYPE
    return "cpu"


def _backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def _available_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Callable[[_F], _F]:
    """Skip the decorated test unless ``x`` CUDA GPUs are visible (as ``common_distributed``'s).

    ``allow_cpu=True`` runs it anyway on a machine with no GPU at all. The skip goes through the
    test's ``_handle_test_skip`` when it has one (every base here does), else ``unittest.SkipTest``.
    """

    def decorate(test: _F) -> _F:
        if not callable(test):
            raise TypeError(f"skip_if_lt_x_gpu decorates a test function, got {test!r}")

        @functools.wraps(test)
        def skip_or_run(*args: Any, **kwargs: Any) -> Any:
            available = _available_gpus()
            if available >= x or (allow_cpu and available == 0):
                return test(*args, **kwargs)
            message = f"Need at least {x} CUDA devices"
            handler = getattr(args[0], "_handle_test_skip", None) if args else None
            if handler is not None:
                handler(message)
                return None
            raise unittest.SkipTest(message)

        return cast(_F, skip_or_run)

    return decorate


def skip_unless_torch_gpu(method: _T) -> _T:
    """Skip the decorated test (method or function) unless there are ``NUM_DEVICES`` GPUs.

    Checked when the test runs (on the ranks for a test method, in the test process for a
    module-level function), before any collective.
    """
    if not callable(method):
        raise TypeError(f"skip_unless_torch_gpu decorates a test function, got {method!r}")
    test: Callable[..., Any] = method

    @functools.wraps(test)
    def skip_or_run(*args: Any, **kwargs: Any) -> Any:
        available = _available_gpus()
        if available < NUM_DEVICES:
            raise unittest.SkipTest(f"needs {NUM_DEVICES} CUDA GPUs, found {available}")
        return test(*args, **kwargs)

    return cast(_T, skip_or_run)


def run_subtests(
    cls_inst: unittest.TestCase,
    subtest_config: Mapping[str, Sequence[Any]],
    test_fn: Callable[..., Any],
    *test_args: Any,
    **test_kwargs: Any,
) -> None:
    """Call ``test_fn`` once per combination of ``subtest_config``'s values, each as a subTest.

    ``subtest_config`` maps a keyword of ``test_fn`` to the values to try; the combinations are
    the cartesian product in the mapping's order, passed as keyword arguments after
    ``test_args``/``test_kwargs``. Under a process group, all ranks meet at a barrier after
    every combination, so that one slow combination cannot overlap with the next.
    """
    keys = list(subtest_config)
    for key in keys:
        if key in test_kwargs:
            raise ValueError(f"run_subtests: {key!r} is both in subtest_config and a fixed keyword argument")
    value_lists = [list(subtest_config[key]) for key in keys]
    for values in itertools.product(*value_lists):
        subtest_kwargs = dict(zip(keys, values))
        with cls_inst.subTest(**subtest_kwargs):
            _reset_dynamo()
            try:
                test_fn(*test_args, **test_kwargs, **subtest_kwargs)
            except Exception as error:
                # On the ranks subTest does not catch: say which combination failed.
                error.add_note(f"in subtest {subtest_kwargs}")
                raise
            finally:
                _reset_dynamo()
        if dist.is_initialized():
            dist.barrier()


def _reset_dynamo() -> None:
    # Compiled code of one subtest must not leak into the next; importing dynamo just to reset
    # it would cost seconds, so only reset it if something already imported it.
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


# ------------------------------------------------------------------------------ with_comms


def _is_method_qualname(qualname: str) -> bool:
    parts = qualname.split(".")
    return len(parts) > 1 and parts[-2] != "<locals>"


def _with_comms_method(func: _F, eager_init: bool, backend: str | None) -> _F:
    @functools.wraps(func)
    def run_with_comms(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not isinstance(self, unittest.TestCase):
            raise TypeError(
                f"with_comms: {func.__qualname__} must be a method of a test case, got an instance of {type(self).__name__}"
            )
        if isinstance(self, _RankRunner) and self._rank_mode is None:
            # Called in the test process other than as the test itself (a helper method): still
            # on the ranks, by its own name.
            return self._run_on_ranks(func.__name__, args, kwargs)
        init_pg = getattr(self, "init_pg", None)
        if init_pg is None:
            # Bases without process-group management (ranks as threads) just run the test.
            return func(self, *args, **kwargs)
        init_pg(eager_init, backend)
        if not getattr(self, "_owns_process_group", True):
            # The harness's own group: it meets every rank and destroys the group after the test
            # (and after a failure, without leaving the other ranks in a barrier).
            return func(self, *args, **kwargs)
        try:
            result = func(self, *args, **kwargs)
        except Exception:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        destroy_pg: Callable[[], None] = getattr(self, "destroy_pg")
        destroy_pg()
        return result

    return cast(_F, run_with_comms)


@overload
def with_comms(eager_init: _F, backend: str | None = None) -> _F: ...


@overload
def with_comms(eager_init: bool = False, backend: str | None = None) -> Callable[[_F], _F]: ...


def with_comms(eager_init: Any = False, backend: str | None = None) -> Any:
    """Run the decorated test with the default process group initialised, as PyTorch's.

    ``@with_comms`` or ``@with_comms(eager_init=True, backend="gloo")``. On a method of
    ``DTensorTestBase`` (which runs on rank processes): ``self.init_pg(eager_init, backend)``,
    the test, ``self.destroy_pg()``. On a base without ``init_pg`` (``DTensorOpTestBase``, whose
    ranks are threads) it runs the test as it is. Parametrized methods
    (``instantiate_parametrized_tests``) and other decorators around it work. On a module-level
    test function it is ``multi_rank(world_size=NUM_DEVICES, backend=backend)``.
    """
    if callable(eager_init):
        return _with_comms(eager_init, eager_init=False, backend=backend)
    if not isinstance(eager_init, bool):
        raise TypeError(f"with_comms: eager_init must be a bool, got {eager_init!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"with_comms: backend must be a str or None, got {backend!r}")
    return functools.partial(_with_comms, eager_init=eager_init, backend=backend)


def _with_comms(func: _F, *, eager_init: bool, backend: str | None) -> _F:
    if not callable(func):
        raise TypeError(f"with_comms decorates a test method or function, got {func!r}")
    qualname = getattr(func, "__qualname__", "")
    if _is_method_qualname(qualname):
        return _with_comms_method(func, eager_init, backend)
    if "<locals>" in qualname:
        raise TypeError(
            f"with_comms: {qualname} is defined inside a function; the ranks find tests by module "
            "and name, so define it at module level or as a method of a DTensorTestBase subclass"
        )
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"with_comms on a module-level function: backend must be 'gloo', 'nccl' or None, got {backend!r}")
    resolved = backend if backend is not None else _backend_for(_device_type_for(NUM_DEVICES))
    return multi_rank(world_size=NUM_DEVICES, backend=resolved)(func)


# ------------------------------------------------------------------------------ shared helpers


def _call_cleanups(test: unittest.TestCase) -> None:
    # TestCase.doCleanups outside TestCase.run drops the cleanups' errors; raise the first instead.
    cleanups: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = getattr(test, "_cleanups", [])
    first_error: BaseException | None = None
    while cleanups:
        function, args, kwargs = cleanups.pop()
        try:
            function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - run every cleanup, report the first failure
            if first_error is None:
                first_error = error
    if first_error is not None:
        raise first_error


def _run_on_this_rank(
    test: unittest.TestCase,
    method_name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    set_up: Callable[[], None],
    tear_down: Callable[[], None],
) -> None:
    """set-up, the method, tear-down and cleanups, as unittest would, but letting errors through."""
    set_up()
    try:
        getattr(test, method_name)(*args, **kwargs)
    finally:
        try:
            tear_down()
        finally:
            _call_cleanups(test)


def _placements_of(args: object, kwargs: object) -> list[tuple[str, ...]]:
    leaves, _ = tree_flatten((args, kwargs))
    return [tuple(str(p) for p in leaf.placements) for leaf in leaves if isinstance(leaf, DTensor)]


def _as_global(value: object) -> object:
    return value.full_tensor() if isinstance(value, DTensor) else value


class DTensorTestMixin(common_utils.TestCase):
    """What every base shares: rank bookkeeping, meshes, subtests and op checks (torch's TestCase)."""

    # Per-test timeout for the ranks: seconds or a timedelta; None: $SHARDWISE_TEST_TIMEOUT, else 120 s.
    timeout: float | timedelta | None = None
    MAIN_PROCESS_RANK = MAIN_PROCESS_RANK
    MAIN_THREAD_RANK = MAIN_PROCESS_RANK

    def __init__(self, method_name: str = "runTest", methodName: str = "runTest") -> None:
        if methodName != "runTest":
            method_name = methodName
        super().__init__(method_name)
        self._rank_mode: str | None = None
        # Whether init_pg made the default group (so with_comms destroys it) or found the harness's.
        self._owns_process_group = False
        self._rank: int | None = None
        self._device_type: str | None = None

    def run(self, result: unittest.TestResult | None = None) -> Any:
        if _COMPILED_TEST_RUN:
            return super().run(result)
        return unittest.TestCase.run(self, result)

    # -- rank, world and device ---------------------------------------------------------

    @property
    def world_size(self) -> int:
        return NUM_DEVICES

    @property
    def rank(self) -> int:
        """This rank on the ranks; ``MAIN_PROCESS_RANK`` (-1) in the test process, as in PyTorch."""
        return MAIN_PROCESS_RANK if self._rank is None else self._rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

    @property
    def is_local_tensor_enabled(self) -> bool:
        return False

    def _default_device_type(self) -> str:
        return _device_type_for(self._world_size_to_run())

    @property
    def device_type(self) -> str:
        return self._device_type if self._device_type is not None else self._default_device_type()

    @device_type.setter
    def device_type(self, value: str) -> None:
        self._device_type = value

    def build_device_mesh(self) -> DeviceMesh:
        """A 1-D mesh over all ``world_size`` ranks."""
        return init_device_mesh(self.device_type, (self._world_size_to_run(),))

    def init_manual_seed_for_rank(self) -> None:
        torch.manual_seed(self.rank)

    def _handle_test_skip(self, msg: str) -> None:
        self.skipTest(msg)

    def _world_size_to_run(self) -> int:
        world_size = self.world_size
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"{type(self).__name__}.world_size must be an int, got {world_size!r}")
        # MultiProcContinuousTest's "unset" world size: every device, here NUM_DEVICES.
        resolved = NUM_DEVICES if world_size == -2 else world_size
        if resolved < 1:
            # e.g. world_size = torch.cuda.device_count() on a machine without GPUs.  PyTorch's base then
            # starts no process and reports a pass without running the test; here it is a skip.
            raise unittest.SkipTest(f"{type(self).__name__}.world_size is {world_size}: no rank to run the test on")
        return resolved

    def _timeout_seconds(self) -> float | None:
        timeout = self.timeout
        if isinstance(timeout, timedelta):
            return timeout.total_seconds()
        return timeout

    def _enter_rank(self, mode: str) -> None:
        world_size = dist.get_world_size()
        if world_size != self._world_size_to_run():
            raise RuntimeError(
                f"{type(self).__name__}.world_size is {self.world_size} but the test runs in a world of "
                f"{world_size} ranks; world_size must not depend on where it is read"
            )
        self._rank_mode = mode
        self._rank = dist.get_rank()

    # -- assertions of PyTorch's multi-rank test cases ------------------------------------

    def assertEqualOnRank(self, x: Any, y: Any, msg: str | None = None, *, rank: int = 0) -> None:
        """``assertEqual`` on one rank only (thread ranks share one random generator)."""
        if self.rank == rank:
            self.assertEqual(x, y, msg)

    def assertNotEqualOnRank(self, x: Any, y: Any, msg: str | None = None, *, rank: int = 0) -> None:
        if self.rank == rank:
            self.assertNotEqual(x, y, msg)

    # -- subtests and op checks -------------------------------------------------------

    def run_subtests(
        self,
        subtest_config: Mapping[str, Sequence[Any]],
        test_fn: Callable[..., Any],
        *test_args: Any,
        **test_kwargs: Any,
    ) -> None:
        """``run_subtests(self, ...)``: ``test_fn`` for every combination of ``subtest_config``."""
        run_subtests(self, subtest_config, test_fn, *test_args, **test_kwargs)

    def _test_op_on_dtensor(self, op_call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``op_call`` on the given DTensors against ``op_call`` on their full tensors."""
        flat_args, args_spec = tree_flatten(args)
        full_args = tree_unflatten(
            [arg.full_tensor().detach().clone() if isinstance(arg, DTensor) else arg for arg in flat_args], args_spec
        )
        full_kwargs = {key: _as_global(value) for key, value in kwargs.items()}
        expected, _ = tree_flatten(op_call(*full_args, **full_kwargs))
        actual, _ = tree_flatten(op_call(*args, **kwargs))
        self.assertEqual(expected, [_as_global(leaf) for leaf in actual])

    def _test_op(self, mesh: DeviceMesh, op_call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Check ``op_call`` on every sharding of its tensor arguments against plain tensors.

        The op runs once on the given tensors; then, for each combination of
        ``DTensorConverter(mesh, args, kwargs)``, on DTensors, and every DTensor in its result
        must equal (``full_tensor()``, ``torch.testing.assert_close``) the plain result.
        """
        op_name = getattr(op_call, "__name__", repr(op_call))
        converter = DTensorConverter(mesh, args, kwargs)
        if converter.num_tensor_args == 0:
            raise AssertionError(f"_test_op({op_name}): no tensor argument to shard; pass the op at least one tensor")
        # On copies: an in-place op must not change the inputs the DTensor runs start from.
        plain_args, plain_kwargs = tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
        expected = op_call(*plain_args, **plain_kwargs)
        expected_leaves, expected_structure = tree_flatten(expected)
        for combination, (dist_args, dist_kwargs) in enumerate(converter):
            placements = _placements_of(dist_args, dist_kwargs)
            if not converter.successful():
                raise AssertionError(
                    f"_test_op({op_name}): DTensorConverter could not turn every tensor argument into a DTensor "
                    f"(converted {converter.hit}, passed through {converter.miss}); expected dense, strided "
                    "torch.Tensor or nn.Parameter arguments"
                )
            actual = op_call(*dist_args, **dist_kwargs)
            actual_leaves, actual_structure = tree_flatten(actual)
            if actual_structure != expected_structure:
                raise AssertionError(
                    f"_test_op({op_name}) with input placements {placements}: the DTensor result has structure "
                    f"{actual_structure}, expected {expected_structure}"
                )
            for index, (actual_leaf, expected_leaf) in enumerate(zip(actual_leaves, expected_leaves)):
                actual_global = _as_global(actual_leaf)
                if isinstance(expected_leaf, torch.Tensor) or isinstance(actual_global, torch.Tensor):

                    def describe(message: str, index: int = index) -> str:
                        return (
                            f"_test_op({op_name}) output {index} with input placements {placements} "
                            f"(combination {combination}): {message}"
                        )

                    torch.testing.assert_close(actual_global, expected_leaf, msg=describe)
                elif actual_global != expected_leaf:
                    raise AssertionError(
                        f"_test_op({op_name}) output {index} with input placements {placements}: "
                        f"got {actual_global!r}, expected {expected_leaf!r}"
                    )


class _RankRunner(DTensorTestMixin):
    """A base whose every test method, called in the test process, runs on the ranks instead."""

    def __init__(self, method_name: str = "runTest", methodName: str = "runTest") -> None:
        if methodName != "runTest":
            method_name = methodName
        super().__init__(method_name)
        test_method = getattr(self, method_name, None)
        if test_method is None:
            if method_name != "runTest":
                raise ValueError(f"no such test method in {type(self)}: {method_name}")
            return  # unittest allows an instance without a test method

        @functools.wraps(test_method)
        def join_or_run(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if self._rank_mode is not None:
                return test_method(*args, **kwargs)
            return self._run_on_ranks(method_name, args, kwargs)

        # unittest runs getattr(self, methodName): the instance attribute takes precedence. The
        # ranks look the test up by the same name, so parametrized tests (whose generated name
        # is the attribute) reach their parameters there too.
        setattr(self, method_name, join_or_run)

    def _run_on_ranks(self, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not say where its ranks run")


# ------------------------------------------------------------------------------ processes


class DTensorTestBase(_RankRunner):
    """Base for multi-process DTensor tests: every test method runs on pooled rank processes.

    ``world_size`` (default ``NUM_DEVICES``; a property or a class attribute) and ``timeout``
    may be overridden per class. The class must be reachable by its module and qualified name
    (module level, or nested in a module-level class) so that the ranks can rebuild it.
    """

    @property
    def backend(self) -> str:
        return _backend_for(self.device_type)

    def init_pg(self, eager_init: bool = False, backend: str | None = None) -> None:
        """Make sure the default process group of ``backend`` (default ``self.backend``) exists.

        On the ranks the harness has already made one with the pool's backend: kept when it is
        the one asked for, else replaced (on every rank) by a group of the asked-for backend.
        ``eager_init`` binds NCCL's communicator to this rank's GPU, as in PyTorch.
        """
        requested = backend if backend is not None else self.backend
        device_type = self.device_type
        if requested not in _KNOWN_BACKENDS and requested != f"cpu:gloo,{device_type}:{_backend_for(device_type)}":
            raise RuntimeError(f"Backend {requested} not supported! expected one of {_KNOWN_BACKENDS}")
        world_size = self._world_size_to_run()
        if any(gpu in requested for gpu in ("nccl", "xccl", "hccl")) and _available_gpus() < world_size:
            self._handle_test_skip(f"Need at least {world_size} CUDA devices")
        if self._rank_mode is None:
            raise RuntimeError(
                f"{type(self).__name__}.init_pg runs on the ranks (inside a test method), not in the test process"
            )
        self._owns_process_group = False
        if dist.is_initialized():
            if dist.get_world_size() == world_size and str(dist.get_backend()) == requested:
                return
            dist.destroy_process_group()
        self._owns_process_group = True
        if "nccl" in requested:
            torch.cuda.set_device(self.rank)
        reinit_default_group(requested)
        if eager_init and "nccl" in requested:
            # Forms the communicator now, as PyTorch's device_id= does.
            dist.barrier(device_ids=[self.rank])

    def destroy_pg(self, device_id: int | None = None) -> None:
        """Meet every rank, then destroy the default process group (and every group made from it)."""
        if not dist.is_initialized():
            return
        if self.device_type == "cpu":
            dist.barrier()
        else:
            dist.barrier(device_ids=[torch.cuda.current_device() if device_id is None else device_id])
        dist.destroy_process_group()

    def _run_on_ranks(self, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        __tracebackhide__ = True
        test_class = type(self)
        class_ref = _class_ref(test_class)
        skip_types = _pytest_skip_types()
        try:
            run_on_ranks(
                _run_test_method,
                class_ref,
                method_name,
                args,
                kwargs,
                world_size=self._world_size_to_run(),
                backend=_backend_for(self.device_type),
                timeout=self._timeout_seconds(),
            )
        except skip_types as skipped:
            # unittest.SkipTest reads as a skip under unittest and pytest alike.
            raise unittest.SkipTest(str(getattr(skipped, "msg", skipped))) from None


class DTensorContinuousTestBase(DTensorTestBase):
    """Base for classes written against PyTorch's ``MultiProcContinuousTest`` DTensor base.

    ``world_size`` is a class attribute (-2, PyTorch's "unset", means ``NUM_DEVICES``); the test
    methods need no ``@with_comms``: the default process group exists on the ranks while they
    run. PyTorch keeps one group for the whole class; here the pooled processes stay for the whole
    file and each test gets a fresh group (about 50 ms), so a failing test does not skip the rest.
    """

    world_size: int = -2

    @classmethod
    def backend_str(cls) -> str:
        return PG_BACKEND

    @property
    def pg(self) -> dist.ProcessGroup:
        group = dist.distributed_c10d._get_default_group()
        return group


def _pytest_skip_types() -> tuple[type[BaseException], ...]:
    outcomes = sys.modules.get("_pytest.outcomes")
    skipped = getattr(outcomes, "Skipped", None)
    if isinstance(skipped, type) and issubclass(skipped, BaseException):
        return (skipped,)
    return ()


def _class_ref(test_class: type) -> FunctionRef:
    if "<locals>" in test_class.__qualname__:
        raise TypeError(
            f"{test_class.__qualname__} is defined inside a function: the rank processes rebuild the test "
            "case from its module and class name, so define the class at module level"
        )
    try:
        return function_ref(test_class)
    except TypeError as error:
        raise TypeError(
            f"the rank processes cannot find test class {test_class.__module__}.{test_class.__qualname__}: {error}"
        ) from None


def _run_test_method(class_ref: FunctionRef, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Rank-process side of ``DTensorTestBase``: rebuild the test case and run one method."""
    __tracebackhide__ = True
    test_class = resolve_function(class_ref)
    if not (isinstance(test_class, type) and issubclass(test_class, DTensorTestBase)):
        raise TypeError(f"{class_ref.describe()} is not a DTensorTestBase subclass on this rank: {test_class!r}")
    test = test_class(method_name)
    test._enter_rank(_PROCESS_RANKS)
    os.environ.setdefault("LOCAL_RANK", str(test.rank))
    try:
        _run_on_this_rank(test, method_name, args, kwargs, test.setUp, test.tearDown)
    except unittest.SkipTest as skip:
        # The harness reports pytest's skip (only) as a skip of the whole test.
        try:
            import pytest
        except ImportError:
            raise skip from None
        pytest.skip(str(skip))


# ------------------------------------------------------------------------------ threads


def _give_thread_its_tolerances(test: unittest.TestCase) -> None:
    """Device-type test classes (``instantiate_device_type_tests``) keep ``precision``/``rel_tol`` in a
    class-level ``threading.local`` set on the thread that made the class: a rank thread would find it
    empty.  Each rank's instance gets its own, at torch's defaults (a test's own override sets it again)."""
    if not hasattr(type(test), "_tls"):
        return
    from torch.testing._internal.common_utils import TestCase as TorchTestCase

    tolerances = threading.local()
    tolerances.precision = TorchTestCase._precision
    tolerances.rel_tol = TorchTestCase._rel_tol
    test._tls = tolerances  # type: ignore[attr-defined]


class DTensorOpTestBase(_RankRunner):
    """Base for fast op tests: every test method runs on ``world_size`` rank threads.

    Each rank thread builds its own instance of the class (``self.rank`` set) and runs
    ``perThreadSetUp``, the method and ``perThreadTearDown`` with its own default process group of
    torch's threaded backend (``setUp``/``tearDown`` run once, in the test thread, as in
    PyTorch's ``MultiThreadedTestCase``). ``@with_comms`` is accepted and changes nothing.
    """

    @property
    def device_type(self) -> str:
        return self._device_type if self._device_type is not None else DEVICE_TYPE

    @device_type.setter
    def device_type(self, value: str) -> None:
        self._device_type = value

    def perThreadSetUp(self) -> None:
        """Runs on every rank thread before the test (``setUp`` runs in the test thread only)."""

    def perThreadTearDown(self) -> None:
        """Runs on every rank thread after the test."""

    def _run_on_ranks(self, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        __tracebackhide__ = True
        test_class = type(self)

        def run_on_this_thread() -> None:
            test = test_class(method_name)
            _give_thread_its_tolerances(test)
            test._enter_rank(_THREAD_RANKS)
            _run_on_this_rank(test, method_name, args, kwargs, test.perThreadSetUp, test.perThreadTearDown)

        # Failures name the test rather than this closure.
        run_on_this_thread.__module__ = test_class.__module__
        run_on_this_thread.__qualname__ = f"{test_class.__qualname__}.{method_name}"
        run_on_threads(run_on_this_thread, world_size=self._world_size_to_run(), timeout=self._timeout_seconds())
