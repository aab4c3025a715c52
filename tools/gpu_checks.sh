#!/usr/bin/env bash
# Every GPU check of the repository in one command, outside Bazel, on a machine with CUDA:
#
#     bash tools/gpu_checks.sh [OUTPUT_DIR]        # from the repository root; default ./gpu_checks_out
#
# 1. the machine (nvidia-smi, torch, CUDA) and an import of every shardwise package;
# 2. the planner's C++ search built for this interpreter (without it the planner runs in Python);
# 3. the demo trainer on cuda (FSDP x TP on a 2x2 mesh, parity with one GPU), the main job;
# 4. every gpu-tagged test file with pytest (and the harness's NCCL test), JUnit XML and log.
#
# With one GPU per rank the multi-rank tests and the trainer run NCCL. With fewer GPUs (one, say) the
# ranks share them over gloo with CUDA tensors (shardwise.testing's shared-GPU pool; the trainer's
# `--backend gloo`): the same CUDA kernels, gloo's transport. Needs python3 with torch (CUDA build),
# pytest and pybind11; pytest-xdist and pytest-timeout when present. Writes only under OUTPUT_DIR and
# its own temporary folder. Exits non-zero when any step failed; the summary is the last lines.
# Knobs (environment): GPU_TESTS_SELECT (a pytest -k expression), GPU_TESTS_WORKERS (xdist workers, 4),
# GPU_TEST_TIMEOUT_S (per test, 420), GPU_TESTS_TIMEOUT_S (all tests, 900), TRAINER_TIMEOUT_S (300), PYTHON.
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
out="$(mkdir -p "${1:-./gpu_checks_out}" && cd "${1:-./gpu_checks_out}" && pwd)"
python="${PYTHON:-python3}"
scratch="$(mktemp -d "${TMPDIR:-/tmp}/shardwise-gpu-checks-XXXXXX")"
export PYTHONPATH="$here/mesh:$here/placement:$here/dtensor_ops:$here/tp_styles:$here/testing:$here/tools:$here/fsdp_ext:$here/compile_support${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TMPDIR="$scratch" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" TRITON_CACHE_DIR="$scratch/triton"
export CUDA_CACHE_PATH="$scratch/cuda" MPLCONFIGDIR="$scratch/matplotlib"
failed=()

step() {  # step NAME LOG COMMAND...: run, log, remember a failure
    local name="$1" log="$2"
    shift 2
    echo "== $name" | tee -a "$out/$log"
    local started=$SECONDS
    "$@" >>"$out/$log" 2>&1
    local status=$?
    echo "== $name: exit $status in $((SECONDS - started)) s" | tee -a "$out/$log"
    [ "$status" -eq 0 ] || failed+=("$name")
}

{
    date -u
    nvidia-smi 2>&1 | head -20
    "$python" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| gpus", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

step "import every package" machine.txt "$python" -c '
import importlib
for name in ("shardwise.mesh", "shardwise.placement", "shardwise.dtensor_ops", "shardwise.tp_styles",
             "shardwise.fsdp_ext", "shardwise.compile_support", "shardwise.testing", "shardwise.tools.train"):
    importlib.import_module(name)
    print("imported", name)
'

gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
backend=()
[ "${gpus:-0}" -ge 4 ] || backend=(--backend gloo)
step "trainer on cuda (dp 2 x tp 2${backend:+, ranks sharing $gpus GPU(s) over gloo})" trainer.log \
    timeout "${TRAINER_TIMEOUT_S:-300}" "$python" -m shardwise.tools.train --device cuda "${backend[@]}" --dp 2 --tp 2 --steps 8 \
    --output-dir "$out/trainer"

pytest_args=(-p no:cacheprovider -rA -v --junitxml="$out/gpu_tests.xml")
"$python" -c 'import xdist' 2>/dev/null && pytest_args+=(-n "${GPU_TESTS_WORKERS:-4}" --dist loadfile)
"$python" -c 'import pytest_timeout' 2>/dev/null && pytest_args+=(--timeout "${GPU_TEST_TIMEOUT_S:-420}")
[ -z "${GPU_TESTS_SELECT:-}" ] || pytest_args+=(-k "$GPU_TESTS_SELECT")  # a pytest -k expression
gpu_test_files=(*/tests/test_*_gpu.py)  # what Bazel tags gpu (tools/build_defs/defs.bzl)
step "gpu-tagged tests" gpu_tests.log timeout "${GPU_TESTS_TIMEOUT_S:-900}" "$python" -m pytest "${pytest_args[@]}" \
    "${gpu_test_files[@]}" testing/tests/test_harness.py::test_nccl_runs_with_one_gpu_per_rank_else_shares_the_gpus_over_gloo

rm -rf "$scratch"
tail -3 "$out/gpu_tests.log" 2>/dev/null
grep -E 'parity|tokens/s' "$out/trainer.log" 2>/dev/null | tail -3
if [ "${#failed[@]}" -eq 0 ]; then
    echo "gpu checks: all passed ($out)"
else
    echo "gpu checks: FAILED: ${failed[*]} ($out)"
    exit 1
fi
