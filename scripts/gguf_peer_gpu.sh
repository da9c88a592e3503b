#!/usr/bin/env bash
# localgen against llama.cpp's CUDA tools on one Llama-2-7B-shaped Q4_K_M GGUF, on a CUDA machine,
# in two calls that follow each other while the machine is warm:
#   scripts/gguf_peer_gpu.sh build WORK      start llama.cpp's CUDA build in the background (setsid;
#                                            WORK/build.log), write WORK/m7b.gguf, run the GGUF GPU
#                                            tests meanwhile, then wait for the build
#   scripts/gguf_peer_gpu.sh bench WORK OUT  `localgen bench decode` on WORK/m7b.gguf, batches 1, 16, 64,
#                                            with llama-bench / llama-batched-bench as the peer (-ngl 99)
#   scripts/gguf_peer_gpu.sh serve WORK OUT  `localgen bench serve` on WORK/m7b.gguf at concurrency 1 and
#                                            16 beside llama-server (-ngl 99); the file's test
#                                            tokenizer splits words finely, hence --peer-ctx
# WORK holds llama.cpp-src.tar.gz and build-llama-cpp.sh (from the shared tools' folder).
set -euo pipefail
cmd=$1
work=$(cd "$2" && pwd)
export PYTHONUNBUFFERED=1
case "$cmd" in
  build)
    if [ ! -x "$work/llama.cpp/build/bin/llama-batched-bench" ]; then
      setsid nohup bash "$work/build-llama-cpp.sh" build "$work" --cuda >"$work/build.log" 2>&1 </dev/null &
    fi
    [ -f "$work/m7b.gguf" ] || python3 scripts/random_gguf.py 7b "$work/m7b.gguf"
    python3 -m pytest -q -p no:cacheprovider tests/test_gguf_gemm_triton.py tests/test_gguf_packed.py \
      tests/test_gguf_offload.py || true
    for _ in $(seq 120); do
      [ -x "$work/llama.cpp/build/bin/llama-batched-bench" ] && [ -x "$work/llama.cpp/build/bin/llama-bench" ] \
        && ! pgrep -f build-llama-cpp.sh >/dev/null && break
      sleep 5
    done
    tail -n 3 "$work/build.log" ;;
  bench)
    out=$3
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    python3 -m localgen.bench.decode_bench --model "$work/m7b.gguf" --batches 1,16,64 --prompt-len 128 \
      --gen-len 128 --dtype bf16 --no-hf --repeat 3 --llama-cpp-bin "$work/llama.cpp/build/bin" \
      --out "$out/decode_7b_q4km.json" ;;
  serve)
    out=$3
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    python3 -c "from localgen.cli.main import app; app(prog_name='localgen')" bench serve --model "$work/m7b.gguf" --concurrency 1,16 \
      --prompt-words 128 --max-tokens 64 --peer-ctx 1536 \
      --llama-server "$work/llama.cpp/build/bin/llama-server" --out "$out/serve_7b_q4km.json" ;;
  *) sed -n 2,13p "$0"; exit 2 ;;
esac
