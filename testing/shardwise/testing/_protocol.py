"""Messages exchanged between the test process and its rank processes.

Both ends live in this package, so the wire format is private: a length prefix
followed by a pickled message dataclass, over a socket pair inherited by the rank.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass

_LENGTH_PREFIX = struct.Struct("!Q")

ENV_RANK = "SHARDWISE_RANK"
ENV_WORLD_SIZE = "SHARDWISE_WORLD_SIZE"
ENV_BACKEND = "SHARDWISE_BACKEND"
# ENV_BACKEND's value for a pool whose ranks share the visible GPUs over gloo (CUDA tensors, rank % GPU count).
SHARED_GPU_POOL = "gloo-shared-gpu"

ENV_CONTROL_FD = "SHARDWISE_CONTROL_FD"
ENV_STORE_HOST = "SHARDWISE_STORE_HOST"
ENV_STORE_PORT = "SHARDWISE_STORE_PORT"
ENV_STARTUP_TIMEOUT = "SHARDWISE_STARTUP_TIMEOUT"
# Comma-separated names of the variables the pool sets for a rank; they win over the test
# process's environment, which every task otherwise carries to the ranks.
ENV_RANK_VARIABLES = "SHARDWISE_RANK_VARIABLES"


def process_group_backend(pool_backend: str) -> str:
    """The c10d backend a pool's ranks start their default groups with."""
    return "gloo" if pool_backend == SHARED_GPU_POOL else pool_backend


@dataclass(frozen=True)
class FunctionRef:
    """Where a rank finds the function to run: by module name, falling back to the file."""

    module_name: str
    qualname: str
    file: str | None
    # The test process imported the module through pytest's assertion rewriting: the ranks rewrite
    # it too, so that a failed ``assert`` on a rank explains itself.
    assert_rewrite: bool = False

    def describe(self) -> str:
        return f"{self.module_name}.{self.qualname}"


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    pid: int


@dataclass(frozen=True)
class RunTask:
    task_id: int
    store_prefix: str
    function: FunctionRef
    # Pickled (args, kwargs), pickled once by the test process so every rank gets the same bytes
    # and an unpicklable argument fails in the test process, before any rank starts.
    call_payload: bytes
    sys_path: tuple[str, ...]
    seed: int
    collective_timeout_s: float
    # The test process's os.environ when the task started: a pooled rank sees what a freshly
    # started one would (e.g. a variable a test set with monkeypatch).
    environment: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class BodyFinished:
    """The body returned on this rank; it waits for TearDown before destroying its process groups."""

    task_id: int
    rank: int


@dataclass(frozen=True)
class TearDown:
    task_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class RemoteError:
    """An exception raised on a rank, as text (exceptions and tracebacks do not always pickle)."""

    exception_type: str
    message: str
    traceback_text: str
    # Wall-clock time (comparable between processes of one machine) at which it was raised: the
    # first rank to raise is usually the cause, the others fail because a peer left a collective,
    # and the ranks do not necessarily report in that order.
    raised_at: float

    def headline(self) -> str:
        first_line = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.exception_type}: {first_line}" if first_line else self.exception_type


@dataclass(frozen=True)
class TaskResult:
    task_id: int
    rank: int
    pickled_value: bytes | None
    error: RemoteError | None
    skip_reason: str | None
    # False when tearing down the process group failed: the rank's state is suspect, so the pool
    # is restarted before the next test.
    clean_teardown: bool
    # True when a process group of this task was still alive in the rank after destroy_process_group
    # (something in C++ still held it): its connections stay open, so a peer blocked in a collective
    # with this rank cannot see it fail. After a failure the test process then ends this rank's process,
    # which closes them (see RankPool._run_task).
    groups_outlived_teardown: bool = False


Message = WorkerReady | RunTask | BodyFinished | TearDown | Shutdown | TaskResult


def send_message(sock: socket.socket, message: Message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH_PREFIX.pack(len(data)) + data)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise EOFError("the other end of the control socket closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def receive_message(sock: socket.socket) -> Message:
    (length,) = _LENGTH_PREFIX.unpack(_receive_exactly(sock, _LENGTH_PREFIX.size))
    message = pickle.loads(_receive_exactly(sock, length))
    if not isinstance(message, (WorkerReady, RunTask, BodyFinished, TearDown, Shutdown, TaskResult)):
        raise TypeError(f"unexpected control message of type {type(message).__name__}")
    return message
