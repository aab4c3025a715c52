#!/usr/bin/env bash
# Remote execution proven on this machine: BuildGrid (server, CAS, action cache, scheduler) and our
# worker on 127.0.0.1, then `bazel test --config=remote-cpu TARGET...` from a fresh client output
# base, twice (the second run must be served from the remote cache), then a GPU test sent with
# --config=remote to show that a CPU-only worker is never given it. Stops everything it started.
#
#   tools/remote/loopback_check.sh [TARGET...]      (default: the CI set below)
#
# Last line: `remote: A of N actions executed remotely; P of T tests passed` (first run, from its
# build event file). Needs: python3 with venv and pip, unshare (util-linux), root (mount namespaces
# with tmpfs), and the registries for the first install of BuildGrid.
set -uo pipefail
cd "$(dirname "$0")/../.."
repo_root="$(pwd)"

# 0.2.53 is the newest BuildGrid whose scheduler still runs on SQLite; from 0.3 on it needs PostgreSQL.
BUILDGRID_VERSION=0.2.53
default_targets=(
  //placement:test_layout          # plain pytest
  //testing:test_timeouts          # multi-rank: gloo ranks in the action, the harness's time limits
  //tools:test_wheels              # builds every wheel remotely, installs them with the env's pip
)
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=("${default_targets[@]}")
gpu_probe_target="${SHARDWISE_LOOPBACK_GPU_TARGET:-//dtensor_ops:test_redistribute_nccl_gpu}"
gpu_probe_wait_s="${SHARDWISE_LOOPBACK_GPU_WAIT_S:-120}"

state="$(mktemp -d /tmp/shardwise-loopback.XXXXXX)"
output_base="$state/client_output_base"
venv="${SHARDWISE_BUILDGRID_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/shardwise/buildgrid-$BUILDGRID_VERSION}"
server_pid="" worker_pid=""
bazel=("$repo_root/tools/bazel" "--output_base=$output_base")

log() { echo "loopback: $*" >&2; }

cleanup() {
  [[ -n "$worker_pid" ]] && kill "$worker_pid" 2>/dev/null && wait "$worker_pid" 2>/dev/null
  [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  [[ -d "$output_base" ]] && "${bazel[@]}" shutdown >/dev/null 2>&1
  # Bazel leaves its output tree read-only; the state folder goes with everything in it.
  chmod -R u+w "$state" 2>/dev/null
  rm -rf "$state"
}
trap cleanup EXIT

for tool in unshare python3; do
  command -v "$tool" >/dev/null || { log "$tool is needed"; exit 2; }
done

if [[ ! -x "$venv/bin/bgd" ]] || ! "$venv/bin/python" -c "import buildgrid.server.version as v; assert v.__version__ == '$BUILDGRID_VERSION'" 2>/dev/null; then
  log "installing BuildGrid $BUILDGRID_VERSION into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv" || { log "python3 -m venv failed (Debian: apt-get install python3-venv)"; exit 2; }
  "$venv/bin/pip" install --quiet --disable-pip-version-check "buildgrid==$BUILDGRID_VERSION" || exit 2
fi

port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
mkdir -p "$state/cas" "$state/worker"
sed "s|@PORT@|$port|; s|@STATE@|$state|g" tools/remote/buildgrid.yml.in > "$state/server.yml"
TMPDIR="$state" "$venv/bin/bgd" server start "$state/server.yml" > "$state/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 120); do
  python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 1)" 2>/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || { log "BuildGrid exited:"; tail -30 "$state/server.log" >&2; exit 1; }
  sleep 0.5
done
log "BuildGrid $BUILDGRID_VERSION serving on 127.0.0.1:$port (state in $state)"

# The actions see neither the client's output base, nor the workspace, nor the user's home.
"$venv/bin/python" tools/remote/worker.py --remote "http://127.0.0.1:$port" --work-dir "$state/worker" \
  --hide "$output_base" --hide "$repo_root" --hide "$HOME" --jobs "${SHARDWISE_LOOPBACK_JOBS:-2}" \
  > "$state/worker.log" 2>&1 &
worker_pid=$!

# Fewer parallel transfers than Bazel's default 100 and more retries than its 5: one Python server on a
# 2-core machine refuses calls beyond its limit (an input upload of //testing:test_timeouts failed so).
remote_flags=(--config=remote-cpu "--remote_executor=grpc://127.0.0.1:$port" --remote_max_connections=16 --remote_retries=10)

run_targets() {  # $1: build event file; the rest: bazel flags
  local bep="$1"; shift
  "${bazel[@]}" test "${remote_flags[@]}" --build_event_json_file="$bep" "$@" "${targets[@]}"
}

started=$(date +%s)
run_targets "$state/bep_first.json"
first_status=$?
first_s=$(( $(date +%s) - started ))
log "first run: bazel exit $first_status in ${first_s} s"
if [[ $first_status -ne 0 ]]; then
  log "worker log tail:"; tail -40 "$state/worker.log" >&2
fi

# Same targets again after `bazel clean`: nothing local is left, so every action must be answered
# by the remote action cache.
"${bazel[@]}" clean >/dev/null 2>&1
started=$(date +%s)
run_targets "$state/bep_second.json"
second_status=$?
second_s=$(( $(date +%s) - started ))
log "second run (after bazel clean): bazel exit $second_status in ${second_s} s"
python3 tools/remote/bep_counts.py --label "second run" "$state/bep_second.json" >&2

# Placement: a GPU test asks gpu=nvidia and gpu-count=N; this worker advertises no GPU, so the
# scheduler keeps the job queued (it does not fail it) until a worker that matches connects. After
# the wait the server's operations are listed, then Bazel is interrupted (SIGINT, as Ctrl-C).
if "${bazel[@]}" query "$gpu_probe_target" >/dev/null 2>&1; then
  "${bazel[@]}" test --config=remote "--remote_executor=grpc://127.0.0.1:$port" --remote_max_connections=16 \
    "$gpu_probe_target" > "$state/gpu_probe.log" 2>&1 &
  probe_pid=$!
  sleep "$gpu_probe_wait_s"
  operations="$("$venv/bin/bgd" operation --remote "http://127.0.0.1:$port" list 2>&1)"
  queued=$(grep -c "stage=2" <<<"$operations")
  still_waiting=0
  if kill -0 "$probe_pid" 2>/dev/null; then
    still_waiting=1
    kill -INT "$probe_pid"
  fi
  wait "$probe_pid"
  if [[ $still_waiting -eq 1 && $queued -ge 1 ]]; then
    log "placement: $gpu_probe_target (gpu=nvidia, gpu-count from its world size) was never given to the CPU-only worker: after ${gpu_probe_wait_s} s it was still queued on the server ($queued queued operation(s)); it waits, it does not fail"
  else
    log "placement: UNEXPECTED: $gpu_probe_target, still waiting: $still_waiting, $queued queued operation(s):"
    echo "$operations" | tail -5 >&2
    tail -20 "$state/gpu_probe.log" >&2
    first_status=1
  fi
fi

summary="$(python3 tools/remote/bep_counts.py "$state/bep_first.json")"
if [[ $first_status -ne 0 || $second_status -ne 0 ]]; then
  echo "$summary"
  exit 1
fi
python3 tools/remote/bep_counts.py --require-all-cached "$state/bep_second.json" >/dev/null || {
  echo "$summary"; log "the second run was not served entirely from the remote cache"; exit 1; }
echo "$summary"
