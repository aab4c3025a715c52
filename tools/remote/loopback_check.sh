#!/usr/bin/env bash
# Remote execution proven on this machine: BuildGrid (server, CAS, action cache, scheduler) and our
# worker on 127.0.0.1, then `bazel test --config=remote-cpu TARGET...` from a fresh client output
# base, twice (the second run, after `bazel clean`, must be served entirely from the remote cache),
# then a GPU test sent with --config=remote to show placement: neither the CPU-only worker nor one
# advertising too few GPUs is given it (it stays queued), a worker advertising enough GPUs is.
# Stops everything it started.
#
#   tools/remote/loopback_check.sh [TARGET...]      (default: the CI set below)
#
# Last line: `remote: A of N actions executed remotely; P of T tests passed` (first run, from its
# build event file). SHARDWISE_LOOPBACK_KEEP=1 keeps the state folder (logs, event files) afterwards.
# Needs: python3 with venv and pip, unshare (util-linux), root (mount namespaces with tmpfs), and the
# registries for the first install of BuildGrid.
set -uo pipefail
script_started=$(date +%s)
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
gpu_probe_wait_s="${SHARDWISE_LOOPBACK_GPU_WAIT_S:-60}"

state="$(mktemp -d /tmp/shardwise-loopback.XXXXXX)"
output_base="$state/client_output_base"
# The client builds a snapshot of the working tree (tracked and untracked, not ignored files): both runs
# see the same sources even while someone edits the checkout, so the second run can be all cache hits.
workspace="$state/workspace"
venv="${SHARDWISE_BUILDGRID_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/shardwise/buildgrid-$BUILDGRID_VERSION}"
server_pid="" worker_pid="" gpu_workers=()
# A client server left behind by a killed run goes away by itself.
bazel=("$workspace/tools/bazel" "--output_base=$output_base" --max_idle_secs=600)

log() { echo "loopback: $*" >&2; }

cleanup() {
  for pid in "${gpu_workers[@]}"; do kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; done
  [[ -n "$worker_pid" ]] && kill "$worker_pid" 2>/dev/null && wait "$worker_pid" 2>/dev/null
  [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  [[ -d "$output_base" ]] && "${bazel[@]}" shutdown >/dev/null 2>&1
  if [[ -n "${SHARDWISE_LOOPBACK_KEEP:-}" ]]; then
    log "kept $state (server.log, worker.log, the build event files)"
    return
  fi
  # Bazel leaves its output tree read-only; the state folder goes with everything in it.
  chmod -R u+w "$state" 2>/dev/null
  rm -rf "$state"
}
trap cleanup EXIT
# Killed (CI's timeout, Ctrl-C): still stop what was started.
trap 'exit 143' TERM
trap 'exit 130' INT

for tool in unshare python3; do
  command -v "$tool" >/dev/null || { log "$tool is needed"; exit 2; }
done

if [[ ! -x "$venv/bin/bgd" ]] || ! "$venv/bin/python" -c "import buildgrid.server.version as v; assert v.__version__ == '$BUILDGRID_VERSION'" 2>/dev/null; then
  log "installing BuildGrid $BUILDGRID_VERSION into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv" || { log "python3 -m venv failed (Debian: apt-get install python3-venv)"; exit 2; }
  "$venv/bin/pip" install --quiet --disable-pip-version-check "buildgrid==$BUILDGRID_VERSION" || exit 2
fi

mkdir -p "$workspace"
if git -C "$repo_root" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$repo_root" ls-files -z --cached --others --exclude-standard \
    | (cd "$repo_root" && tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$workspace"
else
  (cd "$repo_root" && tar --exclude='./bazel-*' --exclude=./user.bazelrc -cf - .) | tar -xf - -C "$workspace"
fi
cd "$workspace"

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

# The actions see neither the client's output base, nor the workspace, nor the user's home. Where the
# hermetic toolchain's launcher unpacks the Python environment archive (one directory per digest,
# tools/build_defs/python_env_launcher.sh.tpl), they see the worker's own cache, not this machine's.
hide_flags=(--hide "$output_base" --hide "$workspace" --hide "$repo_root" --hide "$HOME"
  --persistent "/tmp/shardwise-python-env-$(id -u)")
"$venv/bin/python" tools/remote/worker.py --remote "http://127.0.0.1:$port" --work-dir "$state/worker" \
  --name cpu-worker --jobs "${SHARDWISE_LOOPBACK_JOBS:-2}" "${hide_flags[@]}" > "$state/worker.log" 2>&1 &
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

# Placement: a GPU test asks gpu=nvidia and gpu-count=N (N = its world size, 4 by default). While only
# the CPU-only worker and a worker advertising N-1 GPUs are connected, the scheduler keeps the job
# QUEUED (BuildGrid has no queue timeout configured here, so it waits; it does not fail). Then a worker
# advertising N GPUs connects and is given it. That worker has no GPU at all: the test's CUDA checks
# skip (with their reason) and the target passes, which is what the placement proof needs.
gpu_count="$("${bazel[@]}" query --output=build "$gpu_probe_target" 2>/dev/null \
  | grep -o '"gpu-count": "[0-9]*"' | grep -o '[0-9][0-9]*' | head -1)"
if [[ -n "$gpu_count" ]]; then
  fewer=$((gpu_count > 1 ? gpu_count - 1 : 0))
  start_fake_gpu_worker() {  # $1: GPUs advertised
    "$venv/bin/python" "$workspace/tools/remote/worker.py" --remote "http://127.0.0.1:$port" \
      --work-dir "$state/worker_gpu$1" --name "worker-advertising-$1-gpus" --gpus "$1" --jobs 1 \
      "${hide_flags[@]}" > "$state/worker_gpu$1.log" 2>&1 &
    gpu_workers+=("$!")
  }
  start_fake_gpu_worker "$fewer"
  "${bazel[@]}" test --config=remote "${remote_flags[@]:1}" --build_event_json_file="$state/bep_gpu.json" \
    "$gpu_probe_target" > "$state/gpu_probe.log" 2>&1 &
  probe_pid=$!
  sleep "$gpu_probe_wait_s"
  operations="$("$venv/bin/bgd" operation --remote "http://127.0.0.1:$port" list 2>&1)"
  queued=$(grep -c "stage=2" <<<"$operations")
  if kill -0 "$probe_pid" 2>/dev/null && [[ $queued -ge 1 ]] \
      && ! grep -q "${gpu_probe_target##*:}" "$state/worker.log" "$state/worker_gpu$fewer.log"; then
    log "placement: $gpu_probe_target (gpu=nvidia, gpu-count=$gpu_count) was given neither to the CPU-only worker nor to the one advertising $fewer GPU(s): after ${gpu_probe_wait_s} s it was still QUEUED on the server ($queued queued operation(s); Bazel shows [Sched]). It waits; BuildGrid fails a queued job only when queue-timeout-job-max-age is configured (UNAVAILABLE 'Operation has been queued for too long'), or at once for a property key it does not know (FAILED_PRECONDITION 'Unregistered platform property')"
    start_fake_gpu_worker "$gpu_count"
    waited=0
    while kill -0 "$probe_pid" 2>/dev/null && [[ $waited -lt ${SHARDWISE_LOOPBACK_GPU_RUN_S:-900} ]]; do
      sleep 5; waited=$((waited + 5))
    done
    kill -0 "$probe_pid" 2>/dev/null && kill -INT "$probe_pid"
    wait "$probe_pid"
    probe_status=$?
    if [[ $probe_status -eq 0 ]] && grep -q "running .*test-setup.sh" "$state/worker_gpu$gpu_count.log"; then
      log "placement: then a worker advertising $gpu_count GPUs connected and was given it within ${waited} s; $(python3 "$workspace/tools/remote/bep_counts.py" "$state/bep_gpu.json"); it has no GPU, so the test's CUDA checks skipped"
    else
      log "placement: UNEXPECTED: after a worker advertising $gpu_count GPUs connected, bazel exited $probe_status"
      tail -20 "$state/gpu_probe.log" >&2; tail -5 "$state/worker_gpu$gpu_count.log" >&2
      first_status=1
    fi
  else
    log "placement: UNEXPECTED: $gpu_probe_target, $queued queued operation(s):"
    echo "$operations" | tail -5 >&2
    tail -20 "$state/gpu_probe.log" >&2
    kill -INT "$probe_pid" 2>/dev/null; wait "$probe_pid"
    first_status=1
  fi
  for pid in "${gpu_workers[@]}"; do kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; done
fi

log "done in $(( $(date +%s) - script_started )) s (before stopping the server and workers)"
summary="$(python3 tools/remote/bep_counts.py "$state/bep_first.json")"
if [[ $first_status -ne 0 || $second_status -ne 0 ]]; then
  echo "$summary"
  exit 1
fi
python3 tools/remote/bep_counts.py --require-all-cached "$state/bep_second.json" >/dev/null || {
  echo "$summary"; log "the second run was not served entirely from the remote cache"; exit 1; }
echo "$summary"
