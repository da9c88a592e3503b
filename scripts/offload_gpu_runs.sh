#!/usr/bin/env bash
# Issue 6 on a lent H100/H200: the offloading runtime beside accelerate and FlexGen's figures.
# Run from the repo root on the GPU machine: scripts/offload_gpu_runs.sh STAGE   (writes to $OUT)
#   selftest : scripts/offload_selftest.py (every placement on CUDA vs the resident path)
#   int4kv   : scripts/gpu_selftest.py --int4-kv (the 4-bit KV write and decode kernels vs torch/float64)
#   llama7b  : (each policy and peer batch in its own process) Llama-2-7B shape, 6 GiB cap: weights 26/74 with the cache on the CPU (attended in
#              place by the GPU), the searched 4-bit policy; accelerate at batch 1, 8, 32 (same max_memory)
#   llama7b_fp, llama7b_w4, llama7b_peer: the parts of llama7b in their own processes (llama7b_w4:
#              the search's 4-bit policy at 6 GiB on the H200 profile, 4x4 with activations 33/67)
#   llama7b_w4big: 4-bit weights and KV all on the GPU in fewer, larger GPU batches (16x1, 8x2): the
#              host cost is per layer per GPU batch
#   llama7b_graph: 4-bit weights and KV all on the GPU (decode replayed as CUDA graphs) at 4x4, 8x2,
#              16x1, and the search's 8x2 with 8% of the weights on the CPU (eager)
#   llama7b_w4cpu: 4-bit weights all on the GPU, fp16 cache on the CPU, with and without the int4 GEMM
#   opt30b_acc: accelerate alone on OPT-30B at batch 1
#   opt67b   : OPT-6.7B with FlexGen's measured placement (45/55, 32x4, cache on the CPU)
#   opt30b   : OPT-30B, 16 GiB cap: FlexGen's placement (its "20/80" keeps 8% of the weight bytes on the
#              GPU by its per-tensor rule; whole layers here: 10/90), 32x2, cache on the CPU
#   opt30b_peer : OPT-30B, 16 GiB cap: the searched 4-bit policy; accelerate at batch 1
#   opt30b_pick : OPT-30B, 16 GiB cap: POLICIES (default: the H100 search's pick with the 4-bit cache in
#              pinned host memory, read in place, 16x25) each in its own process; accelerate within the cap
#              (--peer-fit) at PEERS (default: fit, the largest batch whose cache and activations fit)
#   opt30b_w4 : OPT-30B, 16 GiB cap: the H100 profile's searched 4-bit policy (8x7, weights on the CPU,
#              cache 99% GPU, activations CPU); accelerate at batch 8 (PEERS= for none)
#   prefill_diag : scripts/offload_prefill_diag.py on the opt30b_w4 policy: cold and warm prefills with the
#              activation copies on side streams and on the compute stream, the terms alone, a profile of each
#              (trace to $TRACE_DIR, default $OUT; DIAG_ARGS: more options)
#   cpuattn  : scripts/cpu_attention_bench.py on the host CPU; llama7b_short: the first llama7b policy, 3 tokens
#   profile_w4 : scripts/offload_profile.py on Llama-2-7B, 6 GiB: where a 4-bit decode step spends its time
#   profile_w4_prefill : the same for the prefill step
#   profile_w4_sync : the prefill profile, then where a prefill and a decode step synchronize with the GPU
#   profile_w4_mem : the prefill profile capped at 6 GiB and uncapped, then the decode one (the allocator's
#              retries and cudaMalloc/cudaFree counts printed with each: what a capped GPU costs)
#   profile_w4_stacks : the prefill and decode profiles with Python stacks: where the host waits on the GPU
#   (REPEATS=N before any stage: each localgen policy generates N times; the median is reported)
#   shape_sweep : scripts/decode_shape_sweep.py: the decode kernels' launch configs at the runtime's 4-bit MHA
#              shape (16 x 32 heads, 544 tokens, fp own-block pool) and two GQA bench cells; the 4-bit K/V write
#   profile_opt30b_py : cProfile of OPT-30B 4-bit 8x7 decode steps (16 GiB): the host's Python time by function
#   opt30b_bias_ab : the opt30b_w4 policy four times, the GEMM's bias in its store on / off / on / off
#   bias_check : scripts/bias_epilogue_check.py: the int4 GEMM's bias in its store vs y + bias, bit for bit
#   cpu_kernels : scripts/cpu_decode_kernels_bench.py on the host CPU (all its threads): the C decode kernels vs torch
#   probe_kernels : localgen profile's two probes of localgen's own GPU kernels (kernel floor, int4 attention rate)
#   cpuattn_probe : localgen profile's CPU-attention probe on the host (compare: the runtime's 4.86 GFLOP/s)
#   gemm_cublas : scripts/gemm_variants.py: the int4 flat GEMM beside cuBLAS on the dense weight, fp16 and bf16
#   profile  : the hardware profile (localgen profile's probes) of this machine, as JSON
#   gemm_table16 : the same, float16 only
#   llama7b_w4g : the graphed 4-bit policy alone (4x4, everything on the GPU)
#   llama7b_w4g_ab : the same four times, alternating prefill graphs on / off (--no-prefill-graphs)
#   kernels  : localgen bench kernels (issue 5) with the L2 flushed by a read, then by a write (the old method)
#   kernel_sweep : scripts/decode_sweep.py over the B >= 8, context >= 4k cells (sync configs, read flush)
#   kernel_sweep_b8 : the same at B = 8, 4k only, wider: 64-256-token tiles, 4/8 warps, 1-3 stages, 2-8 splits
#   kernel_sweep_int4 : the int4 cache's configs (64/128-token tiles, 4/8 warps, 1/2/4 programs per SM) over
#              B 1/8/32/128 x 4k/32k, beside the bf16 ones at 128-token tiles
#   kernel_splits_short : explicit split counts at short contexts (512-1024): Llama-2-7B's MHA (32 KV heads) at
#              B 16/64, and the bench's GQA (8 KV heads) at B 8/32/64, beside the default config's count
#   kernel_splits_long : explicit split counts 1-8 at B = 32/64/128, contexts 16k/32k (the default config's
#              tiles): does splitting pay where the (sequence, KV head) programs alone fill the GPU?
#   gemm_table : M1/M2 inflection points (FlashDecoding++ §5) of Llama-2-7B's and SmolLM2's [N, K], fp16 and bf16
#   search_picks : localgen profile's eager-layer host probe, then the search's pick (the H100/H200 profile with
#              that host time) for OPT-30B at 16 GiB and Llama-2-7B at 6 GiB, 4-bit and fp16 (SEARCH_CASES to
#              change), each run as a localgen policy (REPEATS applies)
#   memory_llama_fp : scripts/offload_memory.py: GPU memory of the search's Llama-2-7B fp16 pick (4 x 85) at a
#              12 GiB cap and of the 16 x 8 policy of record, beside the predicted peak
#   gemm_table_opt : the same for OPT-6.7B's and OPT-30B's [N, K], fp16, installed as profiles/gemm_${TAG}_opt_float16.json
#              for the stages after it (the dispatcher and the cost model merge every matching file)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -o -i -E 'h100|h200' | head -1 | tr A-Z a-z)}
TAG=${TAG:-gpu}  # output file suffix: the GPU kind
ln -sfn ../kernels localgen/kernels; ln -sfn ../profiles localgen/profiles; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # a capped GPU: no fragmentation slack
B="python3 -m localgen.bench.offload_bench --profile ${TAG/gpu/h200} --timed-steps 1 --offload-dir /tmp/lg_off --repeats ${REPEATS:-1}"
for stage in "$@"; do
  case $stage in
    int4kv) timeout 150 python3 scripts/gpu_selftest.py --int4-kv 2>&1 | tee "$OUT/int4kv_selftest_$TAG.txt" ;;
    kernels) for fl in read write; do timeout 240 python3 -m localgen.bench.kernels_bench --flush $fl \
        $([ $fl = write ] && echo --no-ref --no-int4) --out "$OUT/kernels_bench_${TAG}_$fl.json" 2>&1 \
        | tee "$OUT/kernels_bench_${TAG}_$fl.txt"; done ;;
    kernel_sweep) timeout 400 python3 scripts/decode_sweep.py --batches 8,32,128 --contexts 4096,32768 --no-int4 \
        --deadline 300 --out "$OUT/decode_sweep_$TAG.json" 2>&1 | tail -60 | tee "$OUT/decode_sweep_$TAG.txt" ;;
    kernel_sweep_b8) timeout 300 python3 scripts/decode_sweep.py --batches 8 --contexts 4096 --no-int4 \
        --block-n 64,128,256 --warps 4,8 --stages 1,2,3 --splits 2,3,4,5,6,8 --repeat 20 --deadline 240 \
        --out "$OUT/decode_sweep_b8_$TAG.json" 2>&1 | tail -30 | tee "$OUT/decode_sweep_b8_$TAG.txt" ;;
    kernel_sweep_int4) timeout 400 python3 scripts/decode_sweep.py --batches 1,8,32,128 --contexts 4096,32768 \
        --block-n 64,128 --warps 4 --stages 2 --pps 1,2,4 --int4-warps 4,8 --repeat 10 --deadline 300 \
        --out "$OUT/decode_sweep_int4_$TAG.json" 2>&1 | tail -40 | tee "$OUT/decode_sweep_int4_$TAG.txt" ;;
    kernel_splits_short) S="--block-n 128 --warps 4 --stages 2 --no-int4 --repeat 20 --deadline 120"
        timeout 200 python3 scripts/decode_sweep.py --heads 32 --kv-heads 32 --batches 16,64 --contexts 544,1024 \
          --splits 1,2,3,5 $S --out "$OUT/decode_splits_short_mha_$TAG.json" 2>&1 | tail -8 | tee "$OUT/decode_splits_short_mha_$TAG.txt"
        timeout 200 python3 scripts/decode_sweep.py --batches 8,32,64 --contexts 512,1024 --splits 1,2,3,4 $S \
          --out "$OUT/decode_splits_short_gqa_$TAG.json" 2>&1 | tail -10 | tee "$OUT/decode_splits_short_gqa_$TAG.txt" ;;
    kernel_splits_long) timeout 300 python3 scripts/decode_sweep.py --batches 32,64,128 --contexts 16384,32768 \
        --no-int4 --block-n 128 --warps 4 --stages 2 --splits 1,2,3,4,6,8 --repeat 20 --deadline 240 \
        --out "$OUT/decode_splits_long_$TAG.json" 2>&1 | tail -30 | tee "$OUT/decode_splits_long_$TAG.txt" ;;
    selftest) timeout 200 python3 scripts/offload_selftest.py 2>&1 | tee "$OUT/offload_selftest_$TAG.txt" ;;
    selftest_exact) LOCALGEN_EXACT_PIN_MIN=0 timeout 150 python3 scripts/offload_selftest.py 2>&1 | tee "$OUT/offload_selftest_exactpin_$TAG.txt" ;;
    llama7b_fp) timeout 200 $B --preset llama-2-7b --gpu-memory 6GiB --policy 16,8,26,74,0,100,100,0 \
        --peer-batches '' --out "$OUT/offload_llama7b_fp_$TAG.json" 2>&1 | tee "$OUT/offload_llama7b_fp_$TAG.txt" ;;
    llama7b_w4) timeout 300 $B --preset llama-2-7b --gpu-memory 6GiB --policy 4,4,100,0,100,0,33,67,w4,kv4 \
        --policy 4,4,100,0,100,0,100,0,w4,kv4 --policy 2,4,100,0,100,0,100,0,w4,kv4 \
        --peer-batches '' --out "$OUT/offload_llama7b_w4_$TAG.json" 2>&1 | tee "$OUT/offload_llama7b_w4_$TAG.txt" ;;
    llama7b_w4big) timeout 300 $B --preset llama-2-7b --gpu-memory 6GiB --policy 16,1,100,0,100,0,100,0,w4,kv4 \
        --policy 8,2,100,0,100,0,100,0,w4,kv4 --peer-batches '' --out "$OUT/offload_llama7b_w4big_$TAG.json" 2>&1 | tee "$OUT/offload_llama7b_w4big_$TAG.txt" ;;
    llama7b_graph) timeout 400 $B --preset llama-2-7b --gpu-memory 6GiB --policy 4,4,100,0,100,0,100,0,w4,kv4 \
        --policy 8,2,100,0,100,0,100,0,w4,kv4 --policy 16,1,100,0,100,0,100,0,w4,kv4 \
        --policy 8,2,92,8,100,0,100,0,w4,kv4 --peer-batches '' \
        --out "$OUT/offload_llama7b_graph_$TAG.json" 2>&1 | tee "$OUT/offload_llama7b_graph_$TAG.txt" ;;
    llama7b_w4g) timeout 200 $B --preset llama-2-7b --gpu-memory 6GiB --policy 4,4,100,0,100,0,100,0,w4,kv4 \
        --peer-batches '' --out "$OUT/offload_llama7b_w4g_$TAG.json" 2>&1 | tee "$OUT/offload_llama7b_w4g_$TAG.txt" ;;
    llama7b_w4g_ab) for run in 1 2; do for pg in prefill-graphs no-prefill-graphs; do timeout 150 $B --preset llama-2-7b \
        --gpu-memory 6GiB --policy 4,4,100,0,100,0,100,0,w4,kv4 --peer-batches '' --$pg \
        --out "$OUT/offload_llama7b_w4g_${pg}_${run}_$TAG.json" 2>&1 | tee "$OUT/offload_llama7b_w4g_${pg}_${run}_$TAG.txt"
        done; done ;;
    llama7b_w4cpu) for g in 1 0; do LOCALGEN_INT4_GEMM=$g timeout 150 $B --preset llama-2-7b --gpu-memory 6GiB \
        --policy 16,8,100,0,0,100,100,0,w4 --peer-batches '' --out "$OUT/offload_llama7b_w4cpu_gemm$g.json" \
        2>&1 | tee "$OUT/offload_llama7b_w4cpu_gemm$g.txt"; done ;;
    opt30b_acc) timeout 300 $B --preset opt-30b --gpu-memory 16GiB --peer-batches 1 \
        --out "$OUT/offload_opt30b_acc_$TAG.json" 2>&1 | tee "$OUT/offload_opt30b_acc_$TAG.txt" ;;
    llama7b_peer) timeout 330 $B --preset llama-2-7b --gpu-memory 6GiB --peer-batches 1,8,32 \
        --out "$OUT/offload_llama7b_peer_$TAG.json" 2>&1 | tee "$OUT/offload_llama7b_peer_$TAG.txt" ;;
    llama7b) timeout 560 $B --preset llama-2-7b --gpu-memory 6GiB \
        --policy 16,8,26,74,0,100,100,0 --policy 4,4,100,0,100,0,100,0,w4,kv4 \
        --peer-batches 1,8,32 --out "$OUT/offload_llama7b_$TAG.json" 2>&1 | tee "$OUT/offload_llama7b_$TAG.txt" ;;
    opt67b) timeout 200 $B --preset opt-6.7b --gpu-memory none \
        --policy 32,4,45,55,0,100,100,0 --peer-batches '' \
        --out "$OUT/offload_opt67b_$TAG.json" 2>&1 | tee "$OUT/offload_opt67b_$TAG.txt" ;;
    opt30b) timeout 560 $B --preset opt-30b --gpu-memory 16GiB \
        --policy 32,2,10,90,0,100,100,0 --peer-batches '' \
        --out "$OUT/offload_opt30b_$TAG.json" 2>&1 | tee "$OUT/offload_opt30b_$TAG.txt" ;;
    int4check) timeout 240 python3 -c "import sys, torch; sys.path.insert(0, 'scripts'); import gpu_selftest as g; g._alias_kernels(); print(g.check_int4_linear(torch.device('cuda')))" 2>&1 | tee "$OUT/int4_linear_check_$TAG.txt" ;;
    limits) cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null; ulimit -a | grep -i -E "mem|lock" ;;
    cpuattn) timeout 200 python3 scripts/cpu_attention_bench.py 2>&1 | tee "$OUT/cpu_attention_${TAG}_host.txt" ;;
    llama7b_short) timeout 300 $B --preset llama-2-7b --gpu-memory 6GiB --gen-len 3 \
        --policy 16,8,26,74,0,100,100,0,cpuattn --peer-batches '' 2>&1 | tee "$OUT/offload_llama7b_short_$TAG.txt" ;;
    opt30b_peer) timeout 560 $B --preset opt-30b --gpu-memory 16GiB --policy 4,14,9,91,100,0,0,100,w4,kv4 --peer-batches 1 \
        --out "$OUT/offload_opt30b_peer_$TAG.json" 2>&1 | tee "$OUT/offload_opt30b_peer_$TAG.txt" ;;
    opt30b_pick) timeout 580 $B --preset opt-30b --gpu-memory 16GiB \
        $(for p in ${POLICIES:-16,25,72.766,27.234,0,100,0,100,w4,kv4}; do echo --policy $p; done) \
        --peer-batches "${PEERS-fit}" --peer-fit --out "$OUT/offload_opt30b_pick_$TAG.json" 2>&1 \
        | tee "$OUT/offload_opt30b_pick_$TAG.txt" ;;
    opt30b_w4) timeout 560 $B --preset opt-30b --gpu-memory 16GiB --policy 8,7,0,100,99,1,0,100,w4,kv4 --peer-batches "${PEERS-8}" \
        --out "$OUT/offload_opt30b_w4_$TAG.json" 2>&1 | tee "$OUT/offload_opt30b_w4_$TAG.txt" ;;
    profile_opt30b_py) timeout 400 python3 scripts/offload_profile.py --preset opt-30b --gpu-memory 16GiB \
        --policy 8,7,0,100,99,1,0,100,w4,kv4 --steps 3 --rows 45 --py-profile 2>&1 | tee "$OUT/offload_profile_opt30b_py_$TAG.txt" ;;
    prefill_diag) timeout 300 python3 scripts/offload_prefill_diag.py --preset opt-30b --gpu-memory 16GiB \
        --policy 8,7,0,100,99,1,0,100,w4,kv4 --trace "${TRACE_DIR:-$OUT}/offload_prefill_trace_opt30b_$TAG.json.gz" ${DIAG_ARGS:-} \
        2>&1 | tee "$OUT/offload_prefill_diag_opt30b_$TAG.txt" ;;
    profile_w4) timeout 300 python3 scripts/offload_profile.py --preset llama-2-7b --gpu-memory 6GiB \
        --policy 4,4,100,0,100,0,100,0,w4,kv4 2>&1 | tee "$OUT/offload_profile_w4_$TAG.txt" ;;
    profile_w4_prefill) timeout 200 python3 scripts/offload_profile.py --preset llama-2-7b --gpu-memory 6GiB \
        --policy 4,4,100,0,100,0,100,0,w4,kv4 --phase prefill --rows 30 2>&1 | tee "$OUT/offload_profile_w4_prefill_$TAG.txt" ;;
    profile_w4_sync) timeout 200 python3 scripts/offload_profile.py --preset llama-2-7b --gpu-memory 6GiB \
        --policy 4,4,100,0,100,0,100,0,w4,kv4 --phase prefill --rows 30 --sync-debug 2>&1 | tee "$OUT/offload_profile_w4_sync_$TAG.txt" ;;
    profile_w4_mem) for cap in 6GiB none; do timeout 200 python3 scripts/offload_profile.py --preset llama-2-7b \
        $([ $cap = none ] || echo --gpu-memory $cap) --policy 4,4,100,0,100,0,100,0,w4,kv4 --phase prefill --rows 30 \
        2>&1 | tee "$OUT/offload_profile_w4_prefill_${cap}_$TAG.txt"; done
        timeout 200 python3 scripts/offload_profile.py --preset llama-2-7b --gpu-memory 6GiB \
        --policy 4,4,100,0,100,0,100,0,w4,kv4 --rows 40 2>&1 | tee "$OUT/offload_profile_w4_decode_$TAG.txt" ;;
    profile_w4_stacks) for ph in prefill decode; do timeout 200 python3 scripts/offload_profile.py --preset llama-2-7b \
        --gpu-memory 6GiB --policy 4,4,100,0,100,0,100,0,w4,kv4 --phase $ph --rows 30 --sync-stacks 2>&1 \
        | tee "$OUT/offload_profile_w4_stacks_${ph}_$TAG.txt"; done ;;
    shape_sweep) timeout 420 python3 scripts/decode_shape_sweep.py --cell-seconds 80 \
        --out "$OUT/decode_shape_sweep_$TAG.json" 2>&1 | tee "$OUT/decode_shape_sweep_$TAG.txt" ;;
    opt30b_bias_ab) for ep in 1 0 1 0; do LOCALGEN_INT4_BIAS_EPILOGUE=$ep timeout 200 $B --preset opt-30b --gpu-memory 16GiB \
        --policy 8,7,0,100,99,1,0,100,w4,kv4 --peer-batches "" 2>&1 | grep -E "^localgen|generated" | sed "s/^/epilogue=$ep /" \
        | tee -a "$OUT/offload_opt30b_bias_ab_$TAG.txt"; done ;;
    bias_check) timeout 120 python3 scripts/bias_epilogue_check.py 2>&1 | tee "$OUT/bias_epilogue_check_$TAG.txt" ;;
    cpu_kernels) timeout 200 python3 scripts/cpu_decode_kernels_bench.py --cold --calls 50 --repeat 3 2>&1 | tee "$OUT/cpu_decode_kernels_${TAG}_host.txt" ;;
    probe_kernels) timeout 200 python3 -c "from localgen.profiler import probes as p; print('gpu_kernel_floor', p.probe_kernel_floor()); print('gpu_int4_attn_bdw', p.probe_int4_attention())" 2>&1 | tee "$OUT/probe_kernels_$TAG.txt" ;;
    cpuattn_probe) timeout 120 python3 -c "from localgen.profiler import probes; [print('cpu attention probe', s, round(probes.probe_cpu_attention(s) / 1e9, 2), 'GB/s of fp16 K/V') for s in ((16, 32, 128, 544), (8, 32, 128, 544))]" 2>&1 | tee "$OUT/cpuattn_probe.txt" ;;
    profile) timeout 300 python3 -c "import sys; from localgen.profiler.probes import run_profile; hw = run_profile('/tmp/lg_prof', progress=lambda n, i, t: print(n, i, t, flush=True)); print(hw.to_json()); hw.save(sys.argv[1])" "$OUT/profile_$TAG.json" 2>&1 | tee "$OUT/profile_$TAG.txt" ;;
  gemm_cublas) for dt in float16 bfloat16; do timeout 150 python3 scripts/gemm_variants.py --dtype $dt \
        --out "$OUT/gemm_variants_${dt}_$TAG.json" 2>&1 | tee "$OUT/gemm_variants_${dt}_$TAG.txt"; done ;;
  gemm_table|gemm_table16) dts="float16 bfloat16"; [ $stage = gemm_table16 ] && dts=float16
      for dt in $dts; do timeout 200 python3 -m localgen.kernels.dispatch --dtype $dt \
        --shapes 4096x4096,11008x4096,4096x11008,12288x4096,22016x4096,960x576,576x576,3072x576,576x1536 \
        --out "$OUT/gemm_$dt.json" 2>&1 | tee "$OUT/gemm_$dt.txt"; done ;;
  search_picks) host=$(timeout 120 python3 -c "from localgen.profiler.probes import probe_layer_host; print(probe_layer_host())" | tail -1)
      echo "gpu_layer_host_s $host" | tee "$OUT/layer_host_$TAG.txt"
      timeout 200 python3 scripts/search_picks.py --profile ${TAG/gpu/h200} --layer-host-s "$host" \
        $(for c in ${SEARCH_CASES:-opt-30b:16:on opt-30b:16:off llama-2-7b:6:on llama-2-7b:6:off}; do echo --case $c; done) \
        | tee -a "$OUT/layer_host_$TAG.txt" | while read -r preset cap spec pred; do
          echo "search pick: $preset ${cap} GiB --policy $spec (predicted $pred tok/s)"
          timeout 300 $B --preset "$preset" --gpu-memory "${cap}GiB" --policy "$spec" --peer-batches '' \
            --out "$OUT/offload_pick_${preset}_${spec//,/_}_$TAG.json" < /dev/null 2>&1 | tee -a "$OUT/search_picks_$TAG.txt"
        done ;;
  memory_llama_fp) for spec in 4,85,38.0497,61.9503,0,100,0,100 16,8,26,74,0,100,100,0; do timeout 200 python3 \
        scripts/offload_memory.py --preset llama-2-7b --gpu-memory 12GiB --policy $spec 2>&1 | tee -a "$OUT/offload_memory_$TAG.txt"; done ;;
  gemm_table_opt) timeout 300 python3 -m localgen.kernels.dispatch --dtype float16 \
        --shapes 12288x4096,16384x4096,4096x16384,21504x7168,7168x7168,28672x7168,7168x28672 \
        --out "$OUT/gemm_opt_float16.json" 2>&1 | tee "$OUT/gemm_opt_float16.txt" \
        && cp "$OUT/gemm_opt_float16.json" "profiles/gemm_${TAG}_opt_float16.json" ;;
  esac
  free -g | head -2; dmesg 2>/dev/null | tail -3
  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>/dev/null
done
