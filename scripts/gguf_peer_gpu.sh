#!/usr/bin/env bash
# localgen against llama.cpp's CUDA tools on one Llama-2-7B-shaped Q4_K_M GGUF, on a CUDA machine,
# in three calls that follow each other while the machine is warm (RUN below):
#   scripts/gguf_peer_gpu.sh build WORK OUT  start llama.cpp's CUDA build in the background (setsid;
#                                            RUN/build.log) and the writing of RUN/m7b.gguf, run
#                                            the decode kernels' sweep (RUN/sweep.json, a copy in
#                                            OUT; SWEEP_S seconds, 300 by default, 0: none)
#                                            and the GGUF GPU tests meanwhile, then wait for both
#   scripts/gguf_peer_gpu.sh bench WORK OUT  `localgen bench decode` on RUN/m7b.gguf, batches 1, 16, 64,
#                                            with the sweep's winners (LOCALGEN_GGUF_DECODE_CONFIGS),
#                                            llama-bench / llama-batched-bench as the peer (-ngl 99)
#   scripts/gguf_peer_gpu.sh serve WORK OUT  `localgen bench serve` on RUN/m7b.gguf at concurrency 1 and
#                                            16 and 64 (CONCURRENCY) beside llama-server (-ngl 99), the sweep's
#                                            winners; the file's context is 256 tokens and its test
#                                            tokenizer splits words finely (32 words: ~154 tokens)
#   scripts/gguf_peer_gpu.sh trace WORK OUT  scripts/serve_step_trace.py on RUN/m7b.gguf at concurrency 16
#                                            and 1 (CONCURRENCY): where a served decode step's time goes
# WORK holds llama.cpp-src.tar.gz and build-llama-cpp.sh (from the shared tools' folder), or the
# build/bin folder of an earlier machine of the same image as llama_bin.tar.xz.part* (split so that
# each part comes back from a device call and the folder can be carried). The build,
# the 7B file and the sweep go to RUN (/tmp/gguf_peer), outside the repository: a folder that a
# device call carries is replaced at every call, which would take the build with it. `serve` needs the
# server's packages (fastapi, starlette, sse-starlette, uvicorn, pydantic, xgrammar) where the
# machine lacks them: carried as wheels like the others.
set -euo pipefail
cmd=$1
src=$(cd "$2" && pwd)
out=$3
work=/tmp/gguf_peer
mkdir -p "$work"
for f in llama.cpp-src.tar.gz build-llama-cpp.sh; do
  if [ -f "$src/$f" ] && [ ! -f "$work/$f" ]; then cp "$src/$f" "$work/"; fi
done
# tools built on an earlier machine of the same image (build/bin as llama_bin.tar.xz.part*): no build
if [ ! -x "$work/llama.cpp/build/bin/llama-server" ] && compgen -G "$src/llama_bin.tar.xz.part*" >/dev/null; then
  mkdir -p "$work/llama.cpp/build" && cat "$src"/llama_bin.tar.xz.part* | xz -d | tar xf - -C "$work/llama.cpp/build"
fi
export PYTHONUNBUFFERED=1
# kernels/ and profiles/ install under the localgen namespace; a bare checkout links them there
[ -e localgen/kernels ] || ln -s ../kernels localgen/kernels
[ -e localgen/profiles ] || ln -s ../profiles localgen/profiles
[ -f "$work/sweep.json" ] && export LOCALGEN_GGUF_DECODE_CONFIGS="$work/sweep.json"
gpu() { nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader; }
# until llama.cpp's tools and the 7B file are there (the build call may end before they are); the
# background jobs are known by the pids they left in RUN (a name search would also find any shell
# whose command line names them, the caller's included)
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_build() {
  for _ in $(seq 110); do
    [ -x "$work/llama.cpp/build/bin/llama-batched-bench" ] && [ -x "$work/llama.cpp/build/bin/llama-server" ] \
      && [ -f "$work/m7b.gguf" ] && ! running "$work/build.pid" && ! running "$work/m7b.pid" && return 0
    sleep 5
  done
}
case "$cmd" in
  build)
    gpu
    if [ ! -x "$work/llama.cpp/build/bin/llama-batched-bench" ]; then
      setsid nohup nice -n 19 bash "$work/build-llama-cpp.sh" build "$work" --cuda >"$work/build.log" 2>&1 </dev/null &
      echo $! >"$work/build.pid"
    fi
    if [ ! -f "$work/m7b.gguf" ]; then
      setsid nohup nice -n 10 python3 scripts/random_gguf.py 7b "$work/m7b.gguf" >"$work/m7b.log" 2>&1 </dev/null &
      echo $! >"$work/m7b.pid"
    fi
    if [ "${SWEEP_S:-300}" -gt 0 ]; then
      python3 -m localgen.bench.gguf_gemm_bench --sweep --budget-s "${SWEEP_S:-300}" --out "$work/sweep.json" \
        >"$out/sweep.log" 2>&1 || true
      cp "$work/sweep.json" "$out/" || true
      grep -E "^type " "$out/sweep.log" || tail -n 5 "$out/sweep.log"
    fi
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gguf_gemm_triton.py tests/test_gguf_mma.py tests/test_gguf_i8mma.py \
      tests/test_gguf_packed.py >"$out/tests.log" 2>&1 || true
    tail -n 4 "$out/tests.log"
    wait_build
    tail -n 3 "$work/build.log"; ls -la "$work/m7b.gguf" ;;
  bench)
    gpu; wait_build
    python3 -m localgen.bench.decode_bench --model "$work/m7b.gguf" --batches 1,16,64 --prompt-len 128 \
      --gen-len 128 --dtype bf16 --no-hf --repeat 2 --llama-cpp-bin "$work/llama.cpp/build/bin" \
      --out "$out/decode_7b_q4km.json" ;;
  serve)
    gpu; wait_build
    python3 -c "from localgen.cli.main import app; app(prog_name='localgen')" bench serve --model "$work/m7b.gguf" --concurrency "${CONCURRENCY:-1,16,64}" \
      --prompt-words 32 --max-tokens 64 --peer-ctx 256 \
      --llama-server "$work/llama.cpp/build/bin/llama-server" --out "$out/serve_7b_q4km.json" ;;
  trace)
    gpu; wait_build
    for c in $(echo "${CONCURRENCY:-16,1}" | tr , ' '); do
      python3 scripts/serve_step_trace.py --model "$work/m7b.gguf" --concurrency "$c" --prompt-words 32 \
        --max-tokens 64 --json "$out/serve_trace_c$c.json"
    done ;;
  *) sed -n 2,19p "$0"; exit 2 ;;
esac
