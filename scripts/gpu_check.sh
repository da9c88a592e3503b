#!/usr/bin/env bash
# On a CUDA machine: the kernel, attention and offload test modules with the Triton kernels
# compiled (no interpreter: tests/conftest.py sets it only where there is no GPU), the model
# test modules' CUDA runs, then scripts/gpu_selftest.py and scripts/offload_selftest.py. One
# command for a before/after check:
#
#   scripts/gpu_check.sh [PART] [OUT]   # PART: all (default), tests, models, selftest or offload;
#                                       # logs to OUT/gpu_check_PART.log when OUT is given
#
# The whole check can outlast one ten-minute device call; the parts fit one each.
# Needs torch, triton and transformers; gguf, pytest and platformdirs are installed from .whl/
# (carried with the call) into a private folder when the machine lacks them. Exit status: the
# number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 LOCALGEN_CACHE_DIR=${LOCALGEN_CACHE_DIR:-/tmp/gpu_check/cache}
unset TRITON_INTERPRET
if [ -d .whl ] && ! python3 -c "import pytest, gguf, platformdirs" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check/site .whl/*.whl && export PYTHONPATH=/tmp/gpu_check/site${PYTHONPATH:+:$PYTHONPATH}
fi
# kernels/ and profiles/ install under the localgen namespace; a bare checkout links them there
[ -e localgen/kernels ] || ln -s ../kernels localgen/kernels
[ -e localgen/profiles ] || ln -s ../profiles localgen/profiles
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}

present() {  # the arguments whose file exists (a node id names its module before "::")
  local m
  for m in "$@"; do [ -f "${m%%::*}" ] && echo "$m"; done
}
mapfile -t modules < <(present tests/test_kernels.py tests/test_decode_modes.py tests/test_fused_kernels.py \
  tests/test_gguf_gemm_triton.py tests/test_int4_dispatch.py tests/test_kv_rotation.py tests/test_offload.py \
  tests/test_profiler.py tests/test_attention*.py tests/test_triton_score_features.py)
# whole models on the GPU against transformers; of the families modules only the CUDA tests
mapfile -t models < <(present tests/test_engine_vs_hf.py tests/test_gguf_packed.py tests/test_gguf_offload.py \
  tests/test_families_dense.py::test_gpu_greedy_tokens_equal_transformers \
  tests/test_families_moe.py::test_greedy_tokens_on_cuda_equal_transformers)
part=${1:-all}
case "$part" in all|tests|models|selftest|offload) ;; *) echo "unknown part: $part" >&2; exit 2 ;; esac
log=${2:+$2/gpu_check_$part.log}
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }
failed=0
step() {
  echo "== $*"
  local t0=$SECONDS
  "$@"
  local rc=$?
  echo "== exit $rc after $((SECONDS - t0)) s: $*"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
(
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  want tests && step python3 -m pytest -q -p no:cacheprovider "${modules[@]}"
  want models && step python3 -m pytest -q -p no:cacheprovider "${models[@]}"
  want selftest && step python3 scripts/gpu_selftest.py
  want offload && step python3 scripts/offload_selftest.py
  echo "== failed steps: $failed"
  exit "$failed"
) 2>&1 | if [ -n "$log" ]; then tee "$log"; else cat; fi
exit "${PIPESTATUS[0]}"
