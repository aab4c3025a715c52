"""Entry point of a rank process of the multi-rank test pool.

Started by the test process as ``python -c "from shardwise.testing._rank_worker import main; main()"``
(never through multiprocessing's spawn, which would re-import the pytest or Bazel main script). It
connects to the TCPStore hosted by the test process, then runs one task at a time: initialise the
default process group on a fresh store prefix, call the test body, tear every process group down.
"""

from __future__ import annotations

import ast
import faulthandler
import importlib
import importlib.util
import os
import pickle
import random
import signal
import socket
import sys
import time
import traceback
import types
import weakref
from datetime import timedelta
from typing import Any, Callable

from shardwise.testing import _protocol as protocol

# Set on the wrappers made by ``multi_rank`` so a rank runs the undecorated body.
RANK_BODY_ATTRIBUTE = "__shardwise_rank_body__"


class _FunctionNotFound(LookupError):
    pass


def _same_file(module: types.ModuleType, expected_file: str | None) -> bool:
    module_file = getattr(module, "__file__", None)
    if expected_file is None or module_file is None:
        return expected_file is None
    return os.path.realpath(module_file) == os.path.realpath(expected_file)


def _assert_rewritten_code(file: str) -> types.CodeType | None:
    try:
        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:
        return None
    with open(file, "rb") as source_file:
        source = source_file.read()
    tree = ast.parse(source, filename=file)
    rewrite_asserts(tree, source, file, None)
    return compile(tree, file, "exec", dont_inherit=True)


def _load_module(ref: protocol.FunctionRef) -> types.ModuleType:
    module = sys.modules.get(ref.module_name)
    if module is not None and _same_file(module, ref.file):
        return module
    if not ref.assert_rewrite:
        try:
            module = importlib.import_module(ref.module_name)
        except ImportError:
            module = None
        if module is not None and _same_file(module, ref.file):
            return module
    if ref.file is None:
        raise _FunctionNotFound(
            f"cannot import module {ref.module_name!r} on this rank (sys.path={sys.path!r})"
        )
    # Load the file the test process ran, under the same name: pytest may have imported it under
    # a name that is not importable from sys.path (importlib import mode), with its asserts rewritten.
    spec = importlib.util.spec_from_file_location(ref.module_name, ref.file)
    if spec is None or spec.loader is None:
        raise _FunctionNotFound(f"cannot load {ref.file!r} as module {ref.module_name!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[ref.module_name] = module
    try:
        code = _assert_rewritten_code(ref.file) if ref.assert_rewrite else None
        if code is None:
            spec.loader.exec_module(module)
        else:
            exec(code, module.__dict__)
    except BaseException:
        del sys.modules[ref.module_name]
        raise
    return module


def resolve_function(ref: protocol.FunctionRef) -> Callable[..., Any]:
    target: Any = _load_module(ref)
    for part in ref.qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise _FunctionNotFound(
                f"module {ref.module_name!r} ({ref.file}) has no attribute {ref.qualname!r}"
            ) from None
    while hasattr(target, RANK_BODY_ATTRIBUTE):
        target = getattr(target, RANK_BODY_ATTRIBUTE)
    if not callable(target):
        raise _FunctionNotFound(f"{ref.describe()} is not callable")
    result: Callable[..., Any] = target
    return result


def _traceback_without_worker_frames(error: BaseException) -> str:
    # The frames of this module (task loop, call into the body) are noise in a test report.
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _remote_error(error: BaseException, raised_at: float) -> protocol.RemoteError:
    error_type = type(error)
    module = error_type.__module__
    name = error_type.__qualname__ if module in ("builtins", "__main__") else f"{module}.{error_type.__qualname__}"
    return protocol.RemoteError(
        exception_type=name,
        message=str(error),
        traceback_text=_traceback_without_worker_frames(error),
        raised_at=raised_at,
    )


def _pytest_skip_reason(error: BaseException) -> str | None:
    # Only a test module that imported pytest can raise pytest's Skipped.
    outcomes = sys.modules.get("_pytest.outcomes")
    skipped_type = getattr(outcomes, "Skipped", None)
    if isinstance(skipped_type, type) and isinstance(error, skipped_type):
        return str(getattr(error, "msg", None) or error)
    return None


# The worker and the task it is running, while a test body runs: what ``reinit_default_group``
# needs to build another default process group on the task's store.
_running: "tuple[_Worker, protocol.RunTask] | None" = None
_reinit_count = 0


def reinit_default_group(backend: str | None = None) -> None:
    """Initialise the default process group again on this rank (after a test destroyed it).

    Only inside a test body run by the pool; ``backend`` defaults to the pool's. Every rank must
    call it, as ``dist.init_process_group``.
    """
    global _reinit_count
    if _running is None:
        raise RuntimeError("reinit_default_group: no pooled test body is running in this process")
    worker, task = _running
    _reinit_count += 1
    dist = worker.dist
    worker.init_default_group(
        f"{task.store_prefix}reinit-{_reinit_count}/", task.collective_timeout_s, backend or worker.process_group_backend
    )


class _Worker:
    def __init__(self) -> None:
        self.rank = int(os.environ[protocol.ENV_RANK])
        self.world_size = int(os.environ[protocol.ENV_WORLD_SIZE])
        self.backend = os.environ[protocol.ENV_BACKEND]
        self.process_group_backend = protocol.process_group_backend(self.backend)
        self.control = socket.socket(fileno=int(os.environ[protocol.ENV_CONTROL_FD]))

        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        # Several ranks share a 2-core machine: intra-op threads would only fight each other.
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        if self.backend == "nccl":
            torch.cuda.set_device(self.rank)
        elif self.backend == protocol.SHARED_GPU_POOL:
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        startup_timeout = float(os.environ[protocol.ENV_STARTUP_TIMEOUT])
        self.store = dist.TCPStore(
            os.environ[protocol.ENV_STORE_HOST],
            int(os.environ[protocol.ENV_STORE_PORT]),
            self.world_size,
            is_master=False,
            timeout=timedelta(seconds=startup_timeout),
        )
        self.rank_environment = {
            name: os.environ[name] for name in os.environ[protocol.ENV_RANK_VARIABLES].split(",")
        }

    def init_default_group(self, store_prefix: str, timeout_s: float, backend: str) -> None:
        """``dist.init_process_group`` under ``store_prefix``, returning only once every rank's group is connected.

        A rank's ``init_process_group`` returns when ITS side of gloo's full mesh is connected; a peer may still
        be finishing its handshakes. A body that fails at once on every rank would then destroy its group
        under that peer ("Gloo connectFullMesh failed ... Connection closed by peer" on it, seen with forked
        ranks, whose set-up is fast). Each rank therefore marks itself connected in the store and waits for
        every other rank's mark: no store round trip crosses the body, and no collective is added to it.
        """
        dist = self.dist
        store = dist.PrefixStore(store_prefix, self.store)
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=timeout_s)
        )
        store.set(f"connected/{self.rank}", "1")
        store.wait([f"connected/{rank}" for rank in range(self.world_size)], timedelta(seconds=timeout_s))

    def serve(self) -> None:
        protocol.send_message(self.control, protocol.WorkerReady(rank=self.rank, pid=os.getpid()))
        while True:
            try:
                message = protocol.receive_message(self.control)
            except EOFError:
                return
            if isinstance(message, protocol.Shutdown):
                return
            if isinstance(message, protocol.RunTask):
                result = self.run(message)
                sys.stdout.flush()
                sys.stderr.flush()
                protocol.send_message(self.control, result)

    def _reset_state(self, task: protocol.RunTask) -> None:
        torch = self.torch
        environment = dict(task.environment)
        environment.update(self.rank_environment)
        if os.environ != environment:
            os.environ.clear()
            os.environ.update(environment)
        seed = task.seed
        random.seed(seed)
        torch.manual_seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed)
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)

    def _wait_for_teardown(self, task_id: int) -> None:
        protocol.send_message(self.control, protocol.BodyFinished(task_id=task_id, rank=self.rank))
        while True:
            try:
                message = protocol.receive_message(self.control)
            except EOFError:
                raise SystemExit("the test process went away") from None
            if isinstance(message, protocol.TearDown) and message.task_id == task_id:
                return
            if isinstance(message, protocol.Shutdown):
                raise SystemExit(0)

    def run(self, task: protocol.RunTask) -> protocol.TaskResult:
        global _running, _reinit_count
        _running = (self, task)
        _reinit_count = 0  # ranks count their re-initialisations per task, so their prefixes agree
        try:
            return self._run(task)
        finally:
            _running = None

    def _run(self, task: protocol.RunTask) -> protocol.TaskResult:
        dist = self.dist
        if list(sys.path) != list(task.sys_path):
            sys.path[:] = task.sys_path
        self._reset_state(task)
        pickled_value: bytes | None = None
        error: protocol.RemoteError | None = None
        skip_reason: str | None = None
        clean_teardown = True
        groups_outlived_teardown = False
        try:
            body = resolve_function(task.function)
            args, kwargs = pickle.loads(task.call_payload)
            self.init_default_group(task.store_prefix, task.collective_timeout_s, self.process_group_backend)
            value = body(*args, **kwargs)
            try:
                pickled_value = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as pickling_error:
                raise TypeError(
                    f"the return value of {task.function.describe()} on rank {self.rank} "
                    f"({type(value).__name__}) cannot be pickled back to the test process: {pickling_error}"
                ) from pickling_error
        except BaseException as body_error:  # noqa: BLE001 - everything a rank raises is reported
            raised_at = time.time()
            skip_reason = _pytest_skip_reason(body_error)
            if skip_reason is None:
                error = _remote_error(body_error, raised_at)
        if error is None:
            self._wait_for_teardown(task.task_id)
        try:
            if dist.is_initialized():
                groups_outlived_teardown = self._destroy_every_group()
        except BaseException as teardown_error:  # noqa: BLE001
            clean_teardown = False
            if error is None:
                error = _remote_error(teardown_error, time.time())
        return protocol.TaskResult(
            task_id=task.task_id,
            rank=self.rank,
            pickled_value=pickled_value if error is None else None,
            error=error,
            skip_reason=skip_reason,
            clean_teardown=clean_teardown,
            groups_outlived_teardown=groups_outlived_teardown,
        )

    def _destroy_every_group(self) -> bool:
        """``destroy_process_group()``; True when one of the groups it destroyed is still alive here afterwards.

        A gloo group closes its connections when its C++ object goes away, not when c10d forgets it. After
        a DTensor step something below Python can still hold a group (found after a failing tensor-parallel
        step: no Python referrer, not freed by the garbage collector; torch's functional-collective work
        registry still held 2 works issued in the forward and never waited, since the rank raised before
        the backward that would have waited them), and a peer blocked in a collective on
        it then waits until the collective timeout instead of failing at once. Reported to the test process,
        which ends this process when peers are still waiting.
        """
        dist = self.dist
        groups = [weakref.ref(group) for group in list(dist.distributed_c10d._world.pg_names)]
        dist.destroy_process_group()
        return any(reference() is not None for reference in groups)


def main() -> None:
    # Ctrl-C belongs to the test process, which tears the pool down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        # The test process sends SIGUSR1 to a rank that did not answer in time to get its stacks.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    worker = _Worker()  # a failure to start prints its traceback and exits non-zero
    try:
        worker.serve()
    except SystemExit:
        pass  # the test process went away or asked the rank to stop
    sys.stdout.flush()
    sys.stderr.flush()
    # Interpreter shutdown with torch and a TCPStore client takes seconds and there is nothing
    # left to save: leave at once.
    os._exit(0)
