"""A small remote-execution worker for BuildGrid, for the loopback check (tools/remote/loopback_check.sh).

No Remote Workers API bot is on the package registries (BuildBox is not), so this is ours, built on
BuildGrid's own protocol modules and CAS client. It holds `--jobs` bot sessions with BuildGrid's Bots
service; for each lease it:

  1. reads the Action, its Command and its input root from the CAS (nothing else: no client path);
  2. lays the inputs out in a fresh directory (hard links to a local blob cache, so the Python
     environment's ~1 GB is fetched once per worker, not once per action);
  3. runs the command in a new mount namespace (`unshare --mount`) in which every `--hide` path
     (the client's output base, the workspace, the user's home) is covered by an empty tmpfs and
     every `--persistent` path is this worker's own directory (a cache that outlives actions, as an
     executor's persistent volume: the hermetic Python environment is unpacked there once per
     digest, see tools/build_defs/python_env_launcher.sh.tpl), with exactly the Command's
     environment, under the Action's timeout;
  4. uploads the declared outputs, stdout and stderr to the CAS and completes the lease with the
     ActionResult (BuildGrid then answers the client and fills its action cache).

Placement: the worker advertises `--property KEY=VALUE` pairs on its primary device; `--gpus N`
advertises `gpu=nvidia` and `gpu-count` = 1..N (BuildGrid matches an action's properties against
subsets of a worker's, so "gpu-count=4" reads as "at least 4"). With `--gpus 0` (the default) no GPU
test is ever given to this worker.

Runs in BuildGrid's own environment: python worker.py --remote http://127.0.0.1:PORT --work-dir DIR
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Iterator

import grpc
from buildgrid._protos.build.bazel.remote.execution.v2 import remote_execution_pb2 as re_pb2
from buildgrid._protos.google.devtools.remoteworkers.v1test2 import bots_pb2, bots_pb2_grpc, worker_pb2
from buildgrid._protos.google.rpc import code_pb2
from buildgrid.server.client.cas import Downloader, Uploader

LOG = logging.getLogger("shardwise-worker")
# Process groups of the actions running now: killed when the worker is stopped, so no test outlives it.
RUNNING: set[int] = set()
POLL_TIMEOUT_S = 5.0
# A busy server answers RESOURCE_EXHAUSTED or UNAVAILABLE; BuildGrid's client retries with backoff.
RETRIES = 8
FETCH_ATTEMPTS = 5


def _channel(remote: str) -> grpc.Channel:
    # A batch read answers up to the server's batch limit plus framing, just over gRPC's default
    # 4 MiB receive limit: allow more.
    target = remote.split("://", 1)[-1]
    limit = 64 * 1024 * 1024
    return grpc.insecure_channel(
        target, options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    )


class BlobCache:
    """Files by digest on local disk; an action's inputs are hard links to them (read-only)."""

    def __init__(self, root: str, channel: grpc.Channel, instance: str) -> None:
        self.root = root
        self.channel = channel
        self.instance = instance
        self._lock = threading.Lock()
        os.makedirs(root, exist_ok=True)

    def path(self, digest: re_pb2.Digest, executable: bool) -> str:
        # Executable and plain copies are separate files: hard links share the mode bits.
        suffix = "x" if executable else "r"
        return os.path.join(self.root, digest.hash[:2], f"{digest.hash}_{digest.size_bytes}{suffix}")

    def ensure(self, wanted: list[tuple[re_pb2.Digest, bool]]) -> None:
        # BuildGrid's client does not retry RESOURCE_EXHAUSTED (the server's concurrent-call limit,
        # reached while Bazel uploads in parallel); what was fetched stays, so a retry is cheap.
        for attempt in range(FETCH_ATTEMPTS):
            try:
                return self._ensure_once(wanted)
            except Exception:
                if attempt == FETCH_ATTEMPTS - 1:
                    raise
                LOG.warning("fetching inputs failed (attempt %d of %d); retrying", attempt + 1, FETCH_ATTEMPTS)
                time.sleep(2.0 * (attempt + 1))

    def _ensure_once(self, wanted: list[tuple[re_pb2.Digest, bool]]) -> None:
        with self._lock:
            missing: dict[tuple[str, bool], tuple[re_pb2.Digest, bool]] = {}
            for digest, executable in wanted:
                if not os.path.exists(self.path(digest, executable)):
                    missing[(digest.hash, executable)] = (digest, executable)
            if not missing:
                return
            LOG.info("fetching %d blobs into the cache", len(missing))
            started = time.monotonic()
            downloader = Downloader(self.channel, instance=self.instance, retries=RETRIES)
            try:
                staged = []
                for digest, executable in missing.values():
                    final = self.path(digest, executable)
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    temporary = f"{final}.{uuid.uuid4().hex}.part"
                    downloader.download_file(digest, temporary, is_executable=executable)
                    staged.append((temporary, final, executable))
                downloader.flush()
            finally:
                downloader.close()
            for temporary, final, executable in staged:
                os.chmod(temporary, 0o555 if executable else 0o444)
                os.replace(temporary, final)
            LOG.info("fetched %d blobs in %.1f s", len(staged), time.monotonic() - started)


def _directories(downloader: Downloader, root: re_pb2.Digest) -> dict[str, re_pb2.Directory]:
    """Every Directory of an input tree, by digest hash (fetched level by level, in batches)."""
    found: dict[str, re_pb2.Directory] = {}
    level = [root]
    while level:
        unique = {digest.hash: digest for digest in level if digest.hash not in found}
        digests = list(unique.values())
        messages = downloader.get_messages(digests, [re_pb2.Directory() for _ in digests])
        level = []
        for digest, message in zip(digests, messages):
            assert isinstance(message, re_pb2.Directory)
            found[digest.hash] = message
            level.extend(node.digest for node in message.directories)
    return found


def _walk(
    directories: dict[str, re_pb2.Directory], digest: re_pb2.Digest, prefix: str
) -> Iterator[tuple[str, re_pb2.Directory]]:
    directory = directories[digest.hash]
    yield prefix, directory
    for node in directory.directories:
        yield from _walk(directories, node.digest, os.path.join(prefix, node.name))


def _materialize(cache: BlobCache, channel: grpc.Channel, instance: str, root: re_pb2.Digest, exec_root: str) -> int:
    downloader = Downloader(channel, instance=instance, retries=RETRIES)
    try:
        directories = _directories(downloader, root)
    finally:
        downloader.close()
    tree = list(_walk(directories, root, ""))
    cache.ensure([(node.digest, node.is_executable) for _, directory in tree for node in directory.files])
    count = 0
    for relative, directory in tree:
        target_dir = os.path.join(exec_root, relative)
        os.makedirs(target_dir, exist_ok=True)
        for node in directory.files:
            os.link(cache.path(node.digest, node.is_executable), os.path.join(target_dir, node.name))
            count += 1
        for link in directory.symlinks:
            os.symlink(link.target, os.path.join(target_dir, link.name))
    return count


def _mount_namespace_command(argv: list[str], cwd: str, environment: dict[str, str]) -> list[str]:
    # Inside a private mount namespace, an empty tmpfs over each hidden path ($SHARDWISE_HIDE): the
    # client's files are not there, so an action that reads one through a leaked absolute path fails.
    # Then each persistent path ($SHARDWISE_PERSIST, SRC=DEST pairs) is this worker's own directory
    # SRC, so what the client's machine keeps at DEST is not seen either. `env -i` then gives the
    # command exactly the environment its Command states.
    script = (
        'IFS=:; for d in $SHARDWISE_HIDE; do mount -t tmpfs -o size=1m,mode=0755 hidden "$d" || exit 125; done; '
        'for p in $SHARDWISE_PERSIST; do mkdir -p "${p#*=}" && mount --bind "${p%%=*}" "${p#*=}" || exit 125; done; '
        'unset IFS; cd "$SHARDWISE_CWD" && exec env -i "$@"'
    )
    env_args = [f"{key}={value}" for key, value in sorted(environment.items())]
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh", *env_args, *argv]


def _run_action(
    cache: BlobCache,
    channel: grpc.Channel,
    instance: str,
    work_dir: str,
    hide: list[str],
    persist: list[str],
    worker_name: str,
    action: re_pb2.Action,
) -> re_pb2.ActionResult:
    downloader = Downloader(channel, instance=instance, retries=RETRIES)
    try:
        command = downloader.get_message(action.command_digest, re_pb2.Command())
    finally:
        downloader.close()
    result = re_pb2.ActionResult()
    metadata = result.execution_metadata
    metadata.worker = worker_name
    metadata.worker_start_timestamp.GetCurrentTime()
    exec_root = tempfile.mkdtemp(prefix="action-", dir=work_dir)
    try:
        metadata.input_fetch_start_timestamp.GetCurrentTime()
        files = _materialize(cache, channel, instance, action.input_root_digest, exec_root)
        metadata.input_fetch_completed_timestamp.GetCurrentTime()
        outputs = list(command.output_files) + list(command.output_directories) + list(command.output_paths)
        for output in outputs:
            os.makedirs(os.path.dirname(os.path.join(exec_root, command.working_directory, output)), exist_ok=True)
        environment = {variable.name: variable.value for variable in command.environment_variables}
        cwd = os.path.join(exec_root, command.working_directory)
        argv = _mount_namespace_command(list(command.arguments), cwd, environment)
        hidden = ":".join(path for path in hide if os.path.isdir(path))
        timeout = action.timeout.seconds or None
        LOG.info("running %s (%d input files, timeout %s s)", command.arguments[:2], files, timeout)
        metadata.execution_start_timestamp.GetCurrentTime()
        with open(os.path.join(exec_root, ".stdout"), "wb") as out, open(os.path.join(exec_root, ".stderr"), "wb") as err:
            process = subprocess.Popen(
                argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                env={
                    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SHARDWISE_HIDE": hidden, "SHARDWISE_CWD": cwd,
                    "SHARDWISE_PERSIST": ":".join(persist),
                },
            )
            RUNNING.add(process.pid)
            try:
                result.exit_code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                result.exit_code = -signal.SIGKILL
                err.write(f"\nshardwise worker: killed after the action's timeout of {timeout} s\n".encode())
            finally:
                RUNNING.discard(process.pid)
        metadata.execution_completed_timestamp.GetCurrentTime()
        LOG.info(
            "finished %s: exit %d, inputs laid out in %.1f s, ran %.1f s", command.arguments[1:2], result.exit_code,
            (metadata.input_fetch_completed_timestamp.ToNanoseconds() - metadata.input_fetch_start_timestamp.ToNanoseconds()) / 1e9,
            (metadata.execution_completed_timestamp.ToNanoseconds() - metadata.execution_start_timestamp.ToNanoseconds()) / 1e9,
        )
        metadata.output_upload_start_timestamp.GetCurrentTime()
        uploader = Uploader(channel, instance=instance, retries=RETRIES)
        try:
            for output in outputs:
                path = os.path.join(cwd, output)
                if os.path.isfile(path):
                    digest = uploader.upload_file(path)
                    result.output_files.add(path=output, digest=digest, is_executable=os.access(path, os.X_OK))
                elif os.path.isdir(path):
                    tree_digest = uploader.upload_tree(path)
                    result.output_directories.add(path=output, tree_digest=tree_digest)
            result.stdout_digest.CopyFrom(uploader.upload_file(os.path.join(exec_root, ".stdout")))
            result.stderr_digest.CopyFrom(uploader.upload_file(os.path.join(exec_root, ".stderr")))
            uploader.flush()
        finally:
            uploader.close()
        metadata.output_upload_completed_timestamp.GetCurrentTime()
    finally:
        shutil.rmtree(exec_root, ignore_errors=True)
    metadata.worker_completed_timestamp.GetCurrentTime()
    return result


def _device_properties(args: argparse.Namespace) -> list[tuple[str, str]]:
    properties = [("OSFamily", "Linux")]
    for pair in args.property:
        key, _, value = pair.partition("=")
        properties.append((key, value))
    if args.gpus > 0:
        properties.append(("gpu", "nvidia"))
        properties.extend(("gpu-count", str(count)) for count in range(1, args.gpus + 1))
    return properties


def _execute_lease(
    args: argparse.Namespace, channel: grpc.Channel, cache: BlobCache, bot_id: str, lease: bots_pb2.Lease,
    finished: dict[str, bots_pb2.Lease], done: threading.Event,
) -> None:
    outcome = bots_pb2.Lease(id=lease.id, state=bots_pb2.LeaseState.COMPLETED)
    try:
        action = re_pb2.Action()
        if not lease.payload.Unpack(action):
            digest = re_pb2.Digest()
            lease.payload.Unpack(digest)
            downloader = Downloader(channel, instance=args.instance, retries=RETRIES)
            try:
                action = downloader.get_message(digest, re_pb2.Action())
            finally:
                downloader.close()
        result = _run_action(cache, channel, args.instance, args.work_dir, args.hide, args.persist_pairs, bot_id, action)
        outcome.result.Pack(result)
        outcome.status.code = code_pb2.OK
    except Exception as error:  # reported to the client as the action's failure
        LOG.exception("action failed in the worker")
        # A retryable code for BuildGrid (as INTERNAL is): the job is queued again, up to its attempt limit.
        outcome.status.code = code_pb2.UNAVAILABLE
        outcome.status.message = f"shardwise worker: {type(error).__name__}: {error}"
    finished[lease.id] = outcome
    done.set()


def _bot_loop(args: argparse.Namespace, slot: int, stop: threading.Event, cache: BlobCache) -> None:
    channel = _channel(args.remote)
    stub = bots_pb2_grpc.BotsStub(channel)
    bot_id = f"{args.name}-{slot}"
    device = worker_pb2.Device(handle=bot_id)
    for key, value in _device_properties(args):
        device.properties.add(key=key, value=value)
    fresh = bots_pb2.BotSession(bot_id=bot_id, status=bots_pb2.OK, worker=worker_pb2.Worker(devices=[device]))
    session = stub.CreateBotSession(bots_pb2.CreateBotSessionRequest(parent=args.instance, bot_session=fresh))
    LOG.info("bot %s connected as %s", bot_id, session.name)
    started: set[str] = set()
    finished: dict[str, bots_pb2.Lease] = {}
    done = threading.Event()
    while not stop.is_set():
        # The session is reported every few seconds even while an action runs: BuildGrid takes a
        # silent bot for dead (bot-session-keepalive-timeout) and would give its lease to another.
        for lease in session.leases:
            if lease.id in finished:
                lease.CopyFrom(finished.pop(lease.id))
        try:
            session = stub.UpdateBotSession(
                bots_pb2.UpdateBotSessionRequest(name=session.name, bot_session=session), timeout=POLL_TIMEOUT_S * 2
            )
        except grpc.RpcError as error:
            if error.code() in (
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED
            ):
                time.sleep(0.5)
                continue
            if error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                # The server no longer knows this session (restarted, or it timed the bot out): its
                # leases went back to the queue, so start over with a new session.
                LOG.warning("bot %s: session lost (%s); reconnecting", bot_id, error.details())
                session = stub.CreateBotSession(bots_pb2.CreateBotSessionRequest(parent=args.instance, bot_session=fresh))
                continue
            # Anything else (a busy SQLite scheduler answers INTERNAL on a conflicting update) is
            # the server's moment: a bot slot must not die of it.
            LOG.warning("bot %s: UpdateBotSession failed (%s: %s); retrying", bot_id, error.code(), error.details())
            time.sleep(1.0)
            continue
        for lease in session.leases:
            # BuildGrid may hand a lease over already ACTIVE; either way, one we have not started is new.
            if lease.state in (bots_pb2.LeaseState.PENDING, bots_pb2.LeaseState.ACTIVE) and lease.id not in started:
                started.add(lease.id)
                lease.state = bots_pb2.LeaseState.ACTIVE
                threading.Thread(
                    target=_execute_lease,
                    args=(args, channel, cache, bot_id, bots_pb2.Lease().FromString(lease.SerializeToString()), finished, done),
                    daemon=True,
                ).start()
        done.wait(POLL_TIMEOUT_S if any(lease.state == bots_pb2.LeaseState.ACTIVE for lease in session.leases) else 0.2)
        done.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remote", required=True, help="BuildGrid's address, e.g. http://127.0.0.1:50051")
    parser.add_argument("--instance", default="")
    parser.add_argument("--work-dir", required=True, help="fresh action directories and the blob cache go here")
    parser.add_argument("--hide", action="append", default=[], help="a path covered by an empty tmpfs in actions")
    parser.add_argument(
        "--persistent", action="append", default=[],
        help="a path where actions see a directory of this worker's that outlives them (a cache)",
    )
    parser.add_argument("--property", action="append", default=[], help="KEY=VALUE advertised to the scheduler")
    parser.add_argument("--gpus", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="bot sessions, i.e. actions run at once")
    parser.add_argument("--name", default=f"shardwise-worker-{os.getpid()}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    for path in args.hide:
        if os.path.realpath(args.work_dir).startswith(os.path.realpath(path) + os.sep):
            parser.error(f"--work-dir {args.work_dir} is inside hidden path {path}: actions could not see their inputs")
    args.persist_pairs = []
    for path in args.persistent:
        if not os.path.isabs(path) or any(ch in path for ch in ":="):
            parser.error(f"--persistent {path}: an absolute path without ':' or '=' is needed")
        own = os.path.join(os.path.abspath(args.work_dir), "persistent", path.strip("/").replace("/", "_"))
        os.makedirs(own, exist_ok=True)
        args.persist_pairs.append(f"{own}={path}")
    if shutil.which("unshare") is None:
        parser.error("unshare (util-linux) is needed to run actions in their own mount namespace")
    cache_channel = _channel(args.remote)
    cache = BlobCache(os.path.join(args.work_dir, "blobs"), cache_channel, args.instance)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads = [
        threading.Thread(target=_bot_loop, args=(args, slot, stop, cache), name=f"bot-{slot}", daemon=True)
        for slot in range(args.jobs)
    ]
    for thread in threads:
        thread.start()
    while not stop.is_set() and any(thread.is_alive() for thread in threads):
        stop.wait(1.0)
    for group in list(RUNNING):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
