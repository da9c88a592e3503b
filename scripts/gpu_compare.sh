#!/usr/bin/env bash
# Before/after on a CUDA machine: the GPU self-tests, `localgen bench decode` and `localgen bench
# offload` for a base tree and the working tree, one after the other in the same call, so that a
# change said to keep behaviour and speed is checked on the same card.
#
#   here:  git archive -o .whl/base.tar REV      (.whl travels when the device call carries it)
#   there: scripts/gpu_compare.sh base "$OUT" .whl/base.tar     (one call: the base tree)
#          scripts/gpu_compare.sh head "$OUT"                   (the next call: the working tree)
#
# A tree's checks take most of one call's ten minutes, hence one call a tree, the second while the
# machine is still warm. Writes OUT/NAME.log (everything printed) and OUT/NAME.json (the
# benchmarks' results by run). Needs torch, triton and transformers; gguf, pytest and platformdirs from
# wheels on PYTHONPATH when the machine lacks them.
#
# STEPS=offload,decode (a comma list of selftest, offload_selftest, decode, decode_gguf, offload;
# default all) runs only those checks, for a before/after of one benchmark inside one call.
set -uo pipefail
name=$1
out=$(cd "$2" && pwd)
tar_file=${3:-}
gguf=/tmp/gpu_compare/tinyllama_q4km.gguf
export PYTHONUNBUFFERED=1 LOCALGEN_CACHE_DIR=/tmp/gpu_compare/cache
tree=$(pwd)
if [ -n "$tar_file" ]; then
  tree=/tmp/gpu_compare/tree_$name
  rm -rf "$tree" && mkdir -p "$tree" && tar -xf "$tar_file" -C "$tree" || exit 1
fi
site=${PYTHONPATH:-}
STEPS=${STEPS:-selftest,offload_selftest,decode,decode_gguf,offload}

run_tree() {  # NAME DIR: every check of one tree, each in its own process
  local name=$1 tree=$2 tmp=/tmp/gpu_compare/$1
  mkdir -p "$tmp"
  cd "$tree" || return 1
  # kernels/ and profiles/ install under the localgen namespace; a bare checkout links them there
  ln -sfn ../kernels localgen/kernels && ln -sfn ../profiles localgen/profiles
  export PYTHONPATH="$tree${site:+:$site}"
  local -A cmd=(
    [selftest]="python3 scripts/gpu_selftest.py"
    [offload_selftest]="python3 scripts/offload_selftest.py"
    [decode]="python3 -m localgen.bench.decode_bench --model llama-2-7b --batches 1,16 --prompt-len 128 --gen-len 64 --dtype fp16 --no-hf --repeat 3 --out $tmp/decode_fp16.json"
    [decode_gguf]="python3 -m localgen.bench.decode_bench --model $gguf --batches 1,16 --prompt-len 128 --gen-len 64 --dtype bf16 --no-hf --repeat 3 --out $tmp/decode_gguf.json"
    [offload]="python3 -m localgen.bench.offload_bench --preset llama-2-7b --gpu-memory 6GiB --gen-len 16 --peer-batches '' --policy 8,2,26,74,0,100,100,0 --policy 4,4,100,0,100,0,33,67,w4,kv4 --out $tmp/offload.json")
  local step
  for step in ${STEPS//,/ }; do
    [ -n "${cmd[$step]:-}" ] || { echo "== $name: unknown step $step"; continue; }
    [ "$step" = decode_gguf ] && { mkdir -p "$(dirname "$gguf")"; [ -f "$gguf" ] || python3 scripts/random_gguf.py 1b "$gguf"; }
    echo "== $name: ${cmd[$step]}"
    local t0=$SECONDS
    eval "timeout 420 ${cmd[$step]}"
    echo "== $name: exit $? after $((SECONDS - t0)) s"
  done
  python3 - "$tmp" "$out/$name.json" <<'EOF'
import json, sys
from pathlib import Path
tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(tmp.glob("*.json"))}
dest.write_text(json.dumps(runs, indent=1))
EOF
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
(run_tree "$name" "$tree") > "$out/$name.log" 2>&1
grep -h "^== " "$out/$name.log"
