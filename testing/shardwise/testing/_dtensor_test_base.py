"""unittest-style bases for DTensor tests (drop-in for PyTorch's ``common_dtensor`` helpers).

``DTensorTestBase``: its ``@with_comms`` test methods run on ``world_size`` rank *processes* of
the pooled harness (``run_on_ranks``). The test process does not pickle the TestCase: it sends
the class's module, file and qualified name plus the method name, and each rank rebuilds a
fresh instance of the class and runs ``setUp``, the method and ``tearDown`` on it, inside the
process group the harness started for the test.

``DTensorOpTestBase``: every test method runs on ``world_size`` rank *threads* of the test
process (see ``_threaded.py``), for sweeps over many ops where process start-up would dominate.

Differences from PyTorch worth knowing:

* ``setUp``/``tearDown`` run in the test process (unittest runs them) and again on every rank,
  around the method, on the rank's own instance: what ``setUp`` stores is there on the ranks.
  Class fixtures (``setUpClass``) run in the test process only.
* ``DTensorTestBase`` methods without ``@with_comms`` run in the test process only, where
  ``self.rank`` is not defined (PyTorch runs them on every rank without a process group).
* A failing subtest of ``run_subtests`` on the ranks stops the test there (ranks must stay in
  step) and its parameters are added to the error as a note.
"""

from __future__ import annotations

import functools
import itertools
import sys
import unittest
from typing import Any, Callable, Mapping, Sequence, TypeVar, cast

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map_only

from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh
from shardwise.testing._converter import DTensorConverter
from shardwise.testing._multi_rank import function_ref, multi_rank, run_on_ranks
from shardwise.testing._protocol import FunctionRef
from shardwise.testing._rank_worker import resolve_function
from shardwise.testing._threaded import run_on_threads

__all__ = [
    "DEVICE_TYPE",
    "NUM_DEVICES",
    "DTensorOpTestBase",
    "DTensorTestBase",
    "run_subtests",
    "skip_unless_torch_gpu",
    "with_comms",
]

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

# More than one GPU is what makes CUDA worth testing on: one GPU per rank, NCCL.
_MULTI_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 1
DEVICE_TYPE = "cuda" if _MULTI_GPU else "cpu"
NUM_DEVICES = min(4, torch.cuda.device_count()) if _MULTI_GPU else 4

_PROCESS_RANKS = "process"
_THREAD_RANKS = "thread"


def _device_type_for(world_size: int) -> str:
    """CUDA when every rank can have a GPU of its own, else CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return DEVICE_TYPE
    return "cpu"


def _backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def skip_unless_torch_gpu(method: _T) -> _T:
    """Skip the decorated test (method or function) unless there are ``NUM_DEVICES`` GPUs.

    Checked when the test runs, in the test process, before any rank starts.
    """
    if not callable(method):
        raise TypeError(f"skip_unless_torch_gpu decorates a test function, got {method!r}")
    test: Callable[..., Any] = method

    @functools.wraps(test)
    def skip_or_run(*args: Any, **kwargs: Any) -> Any:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
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


def with_comms(func: _F) -> _F:
    """Run the decorated test on every rank with the default process group initialised.

    On a method of ``DTensorTestBase``: calling it in the test process runs it on
    ``self.world_size`` pooled rank processes (gloo on CPU, NCCL with a GPU per rank), where
    ``self.rank``, ``self.device_type`` and ``self.backend`` are set. On a method of
    ``DTensorOpTestBase`` (whose methods always run on rank threads) it only keeps the same
    spelling working. On a module-level test function it is ``multi_rank(world_size=NUM_DEVICES)``.
    """
    if not callable(func):
        raise TypeError(f"with_comms decorates a test method or function, got {func!r}")
    qualname = getattr(func, "__qualname__", "")
    if not _is_method_qualname(qualname):
        if "<locals>" in qualname:
            raise TypeError(
                f"with_comms: {qualname} is defined inside a function; the ranks find tests by module "
                "and name, so define it at module level or as a method of a DTensorTestBase subclass"
            )
        backend = _backend_for(_device_type_for(NUM_DEVICES))
        return multi_rank(world_size=NUM_DEVICES, backend=backend)(func)
    method_name = func.__name__

    @functools.wraps(func)
    def run_with_comms(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not isinstance(self, (DTensorTestBase, DTensorOpTestBase)):
            raise TypeError(
                f"with_comms: {qualname} must be a method of a DTensorTestBase or DTensorOpTestBase subclass, "
                f"got an instance of {type(self).__name__}"
            )
        if self._rank_mode is None:
            return self._run_on_ranks(method_name, run_with_comms, args, kwargs)
        return func(self, *args, **kwargs)

    return cast(_F, run_with_comms)


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


def _run_on_this_rank(test: unittest.TestCase, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """setUp, the method, tearDown and cleanups, as unittest would, but letting errors through."""
    test.setUp()
    try:
        getattr(test, method_name)(*args, **kwargs)
    finally:
        try:
            test.tearDown()
        finally:
            _call_cleanups(test)


def _placements_of(args: object, kwargs: object) -> list[tuple[str, ...]]:
    leaves, _ = tree_flatten((args, kwargs))
    return [tuple(str(p) for p in leaf.placements) for leaf in leaves if isinstance(leaf, DTensor)]


def _as_global(value: object) -> object:
    return value.full_tensor() if isinstance(value, DTensor) else value


class _DTensorTestHelpers(unittest.TestCase):
    """What both bases share: rank bookkeeping, meshes, subtests and op checks."""

    # Per-test timeout in seconds for the ranks; None: $SHARDWISE_TEST_TIMEOUT, else 120 s.
    timeout: float | None = None

    def __init__(self, methodName: str = "runTest") -> None:
        super().__init__(methodName)
        self._rank_mode: str | None = None
        self._rank: int | None = None
        self._device_type: str | None = None

    # -- rank, world and device ---------------------------------------------------------

    @property
    def world_size(self) -> int:
        return NUM_DEVICES

    @property
    def rank(self) -> int:
        if self._rank is None:
            raise AttributeError(
                f"{type(self).__name__}.{self._testMethodName}: self.rank is only defined while the test runs "
                "on the ranks (a @with_comms method of DTensorTestBase, any test of DTensorOpTestBase)"
            )
        return self._rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

    def _default_device_type(self) -> str:
        return DEVICE_TYPE

    @property
    def device_type(self) -> str:
        return self._device_type if self._device_type is not None else self._default_device_type()

    @device_type.setter
    def device_type(self, value: str) -> None:
        self._device_type = value

    def build_device_mesh(self) -> DeviceMesh:
        """A 1-D mesh over all ``world_size`` ranks."""
        return DeviceMesh(self.device_type, list(range(self.world_size)))

    def _enter_rank(self, mode: str) -> None:
        world_size = dist.get_world_size()
        if world_size != self.world_size:
            raise RuntimeError(
                f"{type(self).__name__}.world_size is {self.world_size} but the test runs in a world of "
                f"{world_size} ranks; world_size must not depend on where it is read"
            )
        self._rank_mode = mode
        self._rank = dist.get_rank()

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


# ------------------------------------------------------------------------------ processes


class DTensorTestBase(_DTensorTestHelpers):
    """Base for multi-process DTensor tests: ``@with_comms`` methods run on pooled rank processes.

    ``world_size`` (default ``NUM_DEVICES``) and ``timeout`` may be overridden per class. The
    class must be reachable by its module and qualified name (module level, or nested in a
    module-level class) so that the ranks can rebuild it.
    """

    def _default_device_type(self) -> str:
        return _device_type_for(self.world_size)

    @property
    def backend(self) -> str:
        return _backend_for(self.device_type)

    def _run_on_ranks(
        self, method_name: str, wrapper: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        __tracebackhide__ = True
        test_class = type(self)
        _check_method_reachable(test_class, method_name, wrapper)
        class_ref = _class_ref(test_class)
        skip_types = _pytest_skip_types()
        try:
            run_on_ranks(
                _run_test_method,
                class_ref,
                method_name,
                args,
                kwargs,
                world_size=self.world_size,
                backend=self.backend,
                timeout=self.timeout,
            )
        except skip_types as skipped:
            # unittest.SkipTest reads as a skip under unittest and pytest alike.
            raise unittest.SkipTest(str(getattr(skipped, "msg", skipped))) from None


def _pytest_skip_types() -> tuple[type[BaseException], ...]:
    outcomes = sys.modules.get("_pytest.outcomes")
    skipped = getattr(outcomes, "Skipped", None)
    if isinstance(skipped, type) and issubclass(skipped, BaseException):
        return (skipped,)
    return ()


def _check_method_reachable(test_class: type, method_name: str, wrapper: Callable[..., Any]) -> None:
    # The ranks look the method up by name: it must lead to this with_comms wrapper, possibly
    # through other decorators (functools.wraps sets __wrapped__).
    candidate: Any = getattr(test_class, method_name, None)
    while candidate is not None and candidate is not wrapper:
        candidate = getattr(candidate, "__wrapped__", None)
    if candidate is None:
        raise TypeError(
            f"with_comms: {test_class.__qualname__}.{method_name} does not lead to the decorated method; "
            "the ranks find the method by its name, so define it under the name it was written with"
        )


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
    try:
        _run_on_this_rank(test, method_name, args, kwargs)
    except unittest.SkipTest as skip:
        # The harness reports pytest's skip (only) as a skip of the whole test.
        try:
            import pytest
        except ImportError:
            raise skip from None
        pytest.skip(str(skip))


# ------------------------------------------------------------------------------ threads


class DTensorOpTestBase(_DTensorTestHelpers):
    """Base for fast op tests: every test method runs on ``world_size`` rank threads.

    Each rank thread builds its own instance of the class (``self.rank`` set) and runs
    ``setUp``, the method and ``tearDown`` with its own default process group of torch's
    threaded backend. ``@with_comms`` is accepted and changes nothing.
    """

    def __init__(self, methodName: str = "runTest") -> None:
        super().__init__(methodName)
        if methodName == "runTest" and not hasattr(self, methodName):
            return  # unittest allows an instance without a test method
        test_method = getattr(self, methodName)

        @functools.wraps(test_method)
        def run_on_rank_threads(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if self._rank_mode is not None:
                return test_method(*args, **kwargs)
            return self._run_on_ranks(methodName, run_on_rank_threads, args, kwargs)

        # unittest runs getattr(self, methodName): the instance attribute takes precedence.
        setattr(self, methodName, run_on_rank_threads)

    def _run_on_ranks(
        self, method_name: str, wrapper: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        __tracebackhide__ = True
        test_class = type(self)

        def run_on_this_thread() -> None:
            test = test_class(method_name)
            test._enter_rank(_THREAD_RANKS)
            _run_on_this_rank(test, method_name, args, kwargs)

        # Failures name the test rather than this closure.
        run_on_this_thread.__module__ = test_class.__module__
        run_on_this_thread.__qualname__ = f"{test_class.__qualname__}.{method_name}"
        run_on_threads(run_on_this_thread, world_size=self.world_size, timeout=self.timeout)
