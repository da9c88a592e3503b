"""GGUF-quantized matmul on CUDA: the Triton kernels of ``kernels/gguf_gemm.py`` beside the
read-bandwidth bound and cuBLAS on the same weights in bf16, measured in one run.

    python -m localgen.bench.gguf_gemm_bench --out gguf_gemm.json
    python -m localgen.bench.gguf_gemm_bench --sweep --out gguf_gemv_sweep.json
    python -m localgen.bench.gguf_gemm_bench --dry-run     # the sweep's code on the CPU
    LOCALGEN_GGUF_DECODE_CONFIGS=gguf_gemv_sweep.json localgen bench decode ...  # its winners

For each weight shape (Llama-2-7B's by default), type and M: the kernel's time per call (CUDA-graph
replays over weight copies that together exceed L2, as in a decode step), the bytes of
quantized weight it must read, those bytes over a measured read-only pass's rate (the floor),
and ``x @ W_bf16.T`` with the dequantized weight resident (what an expanded model runs).
Weights are random blocks with finite scales; speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch

from localgen.fileio import atomic_write_json

SHAPES = {"7b_qkvo": (4096, 4096), "7b_gate_up": (11008, 4096), "7b_down": (4096, 11008)}


def _random_blocks(qtype: int, n: int, k: int, device) -> torch.Tensor:
    from localgen.kernels import gguf_gemm

    nb, bb = k // gguf_gemm.BLOCK_WEIGHTS[qtype], gguf_gemm.BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (n, nb, bb), dtype=torch.uint8, device=device)
    scales = {2: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}[qtype]
    for off in scales:
        d = (torch.rand(n, nb, device=device) / 64).to(torch.float16)
        raw[:, :, off:off + 2] = d.view(torch.uint8).view(n, nb, 2)
    return raw.view(n, nb * bb)


def _time_us(fns, reps: int = 20) -> float:
    """Median microseconds per call of ``fns`` (one call per weight copy, so each call reads its
    weight from memory, not L2), replayed as one CUDA graph so that launch costs are not timed:
    the engine replays its decode steps as CUDA graphs too."""
    import triton.testing

    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns:  # warm-up: compile and allocate outside the capture
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in fns:
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=reps * 10,
                                   return_mode="median") * 1e3 / len(fns)


def _copies(nbytes: int) -> int:
    """Weight copies to rotate through so that together they are 4x 60 MB, more than the L2
    of the GPUs the kernels are tuned for, so that every timed call reads its weight from HBM."""
    return max(2, -(-4 * 60_000_000 // nbytes))

def read_gbps(device) -> float:
    """GB/s of a read-only pass (a sum) over 1 GiB: the bound of a kernel that reads W once."""
    src = torch.ones(1 << 28, dtype=torch.float32, device=device)
    us = _time_us([lambda: src.sum()])
    return src.numel() * 4 / us / 1e3


def _block_n_config(qtype: int, m: int, block_n: int):
    """The default decode config of (qtype, m) with ``block_n`` output rows a program."""
    from dataclasses import replace

    from localgen.kernels import gguf_gemv

    return replace(gguf_gemv.default_config(qtype, m), block_n=block_n)


def run(shapes: dict[str, tuple[int, int]], qtypes: list[int], ms: list[int],
        block_ns: list[int], dtype: torch.dtype = torch.bfloat16) -> dict:
    """One row per (shape, type, M): the best of ``block_ns`` (output rows a program) for the
    fused kernel; the prefill path (M > 16) has no such choice."""
    from localgen.kernels import gguf_gemm, gguf_gemv

    dev = torch.device("cuda")
    floor = read_gbps(dev)
    rows = []
    for name, (n, k) in shapes.items():
        for qt in qtypes:
            raws = [_random_blocks(qt, n, k, dev) for _ in range(_copies(n * k // 2))]
            w16s = [gguf_gemm.dequantize(r, qt, k, dtype) for r in raws[:_copies(n * k * 2)]]
            raw, w16 = raws[0], w16s[0]
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                ref = x.float() @ w16.float().t()
                err = (gguf_gemm.matmul(x, raw, qt, k).float() - ref).abs().max()
                blocks = block_ns if m <= gguf_gemv.MAX_M else block_ns[:1]
                tried = {bn: _time_us([functools.partial(gguf_gemm.matmul, x, r, qt, k,
                                                         _block_n_config(qt, m, bn))
                                       for r in raws]) for bn in blocks}
                block_n = min(tried, key=tried.get)
                ours = tried[block_n]
                cublas = _time_us([functools.partial(torch.matmul, x, w.t()) for w in w16s])
                rows.append(dict(shape=name, n=n, k=k, qtype=qt, m=m, us=ours, block_n=block_n,
                                 us_by_block_n=tried, cublas_bf16_us=cublas,
                                 weight_bytes=raw.numel(), gbps=raw.numel() / ours / 1e3,
                                 share_of_read=raw.numel() / ours / 1e3 / floor,
                                 speedup_vs_bf16=cublas / ours, max_abs_err=float(err)))
                r = rows[-1]
                print(f"{name:11s} {n:5d}x{k:5d} type {qt:2d} M={m:4d}: {ours:8.1f} us "
                      f"(BN {block_n:3d}, {r['gbps']:6.0f} GB/s, {r['share_of_read']:5.1%} of read) "
                      f"bf16 cuBLAS {cublas:8.1f} us -> {cublas / ours:5.2f}x  err {float(err):.2e}",
                      flush=True)
            del raws, w16s
    return dict(device=torch.cuda.get_device_name(), read_gbps=floor, dtype=str(dtype),
                rows=rows)


# ---- --sweep: every decode kernel config beside the file kernel and cuBLAS, in one process ----

SWEEP_SHAPES = {**SHAPES, "7b_output": (32000, 4096)}
SWEEP_QTYPES = (12, 14)  # Q4_K, Q6_K
SWEEP_MS = (1, 16, 64)  # --sweep-ms 128,512 adds prefill rows (i8mma beside dequant + cuBLAS)
BAD_REL_ERR = 2e-2  # a config whose output is this far from the bf16 reference is broken


def _q8(block_n: int, num_warps: int, blocks_per_step: int):
    """An unsplit gemv config with 8-bit activations (``gguf_q8``)."""
    from localgen.kernels.gguf_gemv import DecodeConfig

    return DecodeConfig("gemv", block_n, split_k=1, num_warps=num_warps,
                        blocks_per_step=blocks_per_step, codes="q8")


def _m1_configs() -> list:
    """Timed at M = 1 only: the last sweep's M = 1 winner for both types and its runner-up,
    one row a program, and eight blocks of a row in flight."""
    return [_q8(2, 1, 4), _q8(4, 1, 4), _q8(1, 1, 4), _q8(2, 1, 8)]


def sweep_configs() -> list:
    """The configs ``--sweep`` times, each where :func:`sweep_serves` it."""
    from localgen.kernels.gguf_gemv import DecodeConfig as C

    return [C("file", 32), *_m1_configs(),
            # M <= 16 (and M = 1), 8-bit activations: a program's weight words meet every
            # activation row, so the dp4a count grows with M; rows a program, warps and blocks
            # a step such that a step's per-group scale tile (rows x 4 slots a block x groups
            # a slot) stays below the program's threads, where sm_90 builds keep one register
            # layout through the loop, and two of Q4_K's past it
            _q8(1, 1, 1), _q8(2, 1, 1), _q8(2, 2, 1), _q8(4, 2, 1), _q8(4, 4, 1),
            _q8(8, 4, 1), _q8(2, 4, 2), _q8(4, 4, 2), _q8(8, 8, 1),
            # M > 1 references: the prefill path (dequantize, then cuBLAS) beside the file
            # kernel above, and the tensor-core kernel (gguf_mma) in its best tile for Q4_K
            C("dequant"), C("mma", 64, num_warps=4), *_i8mma_configs()]


def _i8mma_configs() -> list:
    """The int8 tensor-core kernel (``gguf_i8mma``; M >= 2, so also at prefill rows): 16 or 32
    weight rows a program take mma.sync, 64 on four warps wgmma; K split to fill the GPU with
    four or eight programs a multiprocessor, or unsplit; a loop step of a whole block or of one
    64-weight chunk (fewer registers, more programs resident; Q4_K and Q5_K)."""
    from localgen.kernels.gguf_gemv import DecodeConfig as C

    return [C("i8mma", 16, num_warps=1), C("i8mma", 32, num_warps=4),
            C("i8mma", 32, num_warps=4, chunks_per_step=1), C("i8mma", 64, num_warps=4),
            C("i8mma", 64, num_warps=4, chunks_per_step=1),
            C("i8mma", 64, num_warps=4, programs_per_sm=8),
            C("i8mma", 64, split_k=1, num_warps=4)]


def sweep_serves(cfg, qtype: int, m: int) -> bool:
    """Whether the sweep times ``cfg`` at (qtype, m): where ``gguf_gemv.serves`` it, the M = 1
    configs (:func:`_m1_configs`) only at M = 1."""
    from localgen.kernels import gguf_gemv

    return gguf_gemv.serves(cfg, qtype, m) and (m == 1 or cfg not in _m1_configs())


def label(cfg) -> str:
    split = f"sk{cfg.split_k}" if cfg.split_k else f"auto{cfg.programs_per_sm}/SM"
    codes = f" kb{cfg.blocks_per_step} {cfg.codes}" if cfg.kernel == "gemv" else ""
    stages = f" st{cfg.num_stages}" if cfg.num_stages else ""
    if cfg.kernel == "i8mma" and cfg.chunks_per_step != 4:
        stages += f" ch{cfg.chunks_per_step}"
    if cfg.kernel == "dequant":
        return "dequant + cuBLAS"
    return f"{cfg.kernel} bn{cfg.block_n} w{cfg.num_warps} {split}{codes}{stages}"


def _time_or_once(fns, dev) -> float:
    """:func:`_time_us` on CUDA; elsewhere (``--dry-run``) each call once and NaN."""
    if dev.type == "cuda":
        return _time_us(fns, reps=10)
    for fn in fns:
        fn()
    return float("nan")


def _sweep_cell(cells: list, floor: float, name: str, qt: int, m: int, raws, x, ref,
                cublas: float, dev, deadline: float) -> None:
    """Time every config on one (shape, type, M) into ``cells``; a config that fails to compile
    or run, or gives wrong values, is reported and skipped."""
    import time

    from localgen.kernels import gguf_gemm

    n, k = raws[0].shape[0], x.shape[1]
    for cfg in sweep_configs():
        if not sweep_serves(cfg, qt, m) or time.monotonic() > deadline:
            continue
        cell = dict(shape=name, n=n, k=k, qtype=qt, m=m, config=label(cfg),
                    cfg=cfg.__dict__, weight_bytes=raws[0].numel(), cublas_bf16_us=cublas)
        try:
            got = gguf_gemm.matmul(x, raws[0], qt, k, cfg).float()
            cell["rel_err"] = float((got - ref).abs().max() / ref.abs().max())
            if cell["rel_err"] > BAD_REL_ERR:
                raise ArithmeticError(f"relative error {cell['rel_err']:.2e}")
            us = _time_or_once([functools.partial(gguf_gemm.matmul, x, r, qt, k, cfg)
                                for r in raws], dev)
        except Exception as exc:  # noqa: BLE001 - one bad config must not end the sweep
            cell["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"{name:10s} type {qt:2d} M={m:2d} {cell['config']:26s} FAILED {cell['error']}",
                  flush=True)
            cells.append(cell)
            continue
        gbps = raws[0].numel() / us / 1e3
        cell.update(us=us, gbps=gbps, share_of_read=gbps / floor, speedup_vs_bf16=cublas / us)
        cells.append(cell)
        print(f"{name:10s} type {qt:2d} M={m:2d} {cell['config']:26s} {us:7.1f} us "
              f"{gbps:6.0f} GB/s {gbps / floor:6.1%} of read  x cuBLAS {cublas / us:5.2f}  "
              f"err {cell['rel_err']:.1e}", flush=True)


def _sweep_weights(qt: int, n: int, k: int, dev, dtype):
    """Weight copies (together more than L2 on CUDA; one elsewhere) and their bf16 twins."""
    from localgen.kernels import gguf_gemm

    copies = (lambda b: _copies(b)) if dev.type == "cuda" else (lambda b: 1)
    raws = [_random_blocks(qt, n, k, dev) for _ in range(copies(n * k // 2))]
    w16s = [gguf_gemm.dequantize(r, qt, k, dtype) for r in raws[:copies(n * k * 2)]]
    return raws, w16s


def sweep(shapes: dict[str, tuple[int, int]], qtypes, ms, dev, dtype=torch.bfloat16,
          budget_s: float = 270.0) -> dict:
    """Every config of :func:`sweep_configs` on every (shape, type, M), beside bf16 cuBLAS, in
    one process; rows past ``budget_s`` seconds are skipped. Prints one line a cell and, per
    (type, M), the configs ranked by their summed time over the shapes."""
    import time

    deadline = time.monotonic() + budget_s
    floor = read_gbps(dev) if dev.type == "cuda" else float("nan")
    cells: list[dict] = []
    for name, (n, k) in shapes.items():
        for qt in qtypes:
            raws, w16s = _sweep_weights(qt, n, k, dev, dtype)
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                ref = x.float() @ w16s[0].float().t()
                cublas = _time_or_once([functools.partial(torch.matmul, x, w.t()) for w in w16s],
                                       dev)
                _sweep_cell(cells, floor, name, qt, m, raws, x, ref, cublas, dev, deadline)
            del raws, w16s
    ranking, winners = _rank(cells)
    return dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)",
                read_gbps=floor, dtype=str(dtype), cells=cells, ranking=ranking,
                winners=winners)


def _rank(cells: list[dict]) -> tuple[dict, list[dict]]:
    """Per ``"type T M=m"``: ``[(config, summed us)]`` best first, summed over the shapes that
    the most configs completed (a sweep cut short by its budget ranks on those), each config
    that ran on all of them; printed with the config to put in ``gguf_gemv.DECODE_CONFIGS``.
    Also the ``winners``, ``[{"qtype", "m", "cfg"}]``, the best of each type and M, that
    ``LOCALGEN_GGUF_DECODE_CONFIGS=<this JSON>`` makes the decode's defaults."""
    from collections import Counter

    from localgen.kernels import gguf_gemv

    timed = [c for c in cells if "us" in c]
    out, winners = {}, []
    for qt, m in sorted({(c["qtype"], c["m"]) for c in timed}):
        mine = [c for c in timed if (c["qtype"], c["m"]) == (qt, m)]
        per_shape = Counter(c["shape"] for c in mine)
        shapes = {sh for sh, n in per_shape.items() if n == max(per_shape.values())}
        sums: dict[str, list] = {}
        for c in mine:
            if c["shape"] in shapes:
                sums.setdefault(c["config"], [0.0, 0, c["cfg"]])
                sums[c["config"]][0] += c["us"]
                sums[c["config"]][1] += 1
        ranked = sorted((v[0], lab, v[2]) for lab, v in sums.items() if v[1] == len(shapes))
        out[f"type {qt} M={m}"] = [(lab, us) for us, lab, _ in ranked]
        winners.append(dict(qtype=qt, m=m, cfg=ranked[0][2]))
        default = label(gguf_gemv.default_config(qt, m))
        now = next((f"{us:.1f} us" for us, lab, _ in ranked if lab == default), "not swept")
        print(f"type {qt} M={m}: best {ranked[0][1]} ({ranked[0][0]:.1f} us over "
              f"{len(shapes)} shapes; the default {default}: {now}): "
              f"DecodeConfig(**{ranked[0][2]})", flush=True)
    return out, winners


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON results (required without --sweep / --dry-run)")
    p.add_argument("--qtypes", default="12,14,8,13,2", help="GGMLQuantizationType values")
    p.add_argument("--ms", default="1,4,16,64,512")
    p.add_argument("--block-n", default="32,64,128", help="output rows a program, tried per cell")
    p.add_argument("--sweep", action="store_true",
                   help="time every decode config (Q4_K, Q6_K; M 1, 16, 64) in one process")
    p.add_argument("--dry-run", action="store_true",
                   help="the sweep at a tiny shape on the CPU under the Triton interpreter")
    p.add_argument("--budget-s", type=float, default=270.0, help="the sweep's time limit")
    p.add_argument("--sweep-qtypes", default=",".join(map(str, SWEEP_QTYPES)),
                   help="the sweep's types (13: Q5_K too)")
    p.add_argument("--sweep-ms", default=",".join(map(str, SWEEP_MS)),
                   help="the sweep's activation rows (4: the q8 kernels' M_PAD 4 too; past 64: "
                        "prefill rows, i8mma beside dequant + cuBLAS)")
    a = p.parse_args(argv)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels' module is imported
        # fp16: the interpreter's bf16 tl.dot is wrong
        result = sweep({"tiny": (40, 512)}, ints(a.sweep_qtypes), (1, 3, 33, 80),
                       torch.device("cpu"), torch.float16, budget_s=a.budget_s)
    elif a.sweep:
        result = sweep(SWEEP_SHAPES, ints(a.sweep_qtypes), ints(a.sweep_ms), torch.device("cuda"),
                       budget_s=a.budget_s)
    elif a.out:
        result = run(SHAPES, ints(a.qtypes), ints(a.ms), ints(a.block_n))
    else:
        p.error("--out is required without --sweep or --dry-run")
    if a.out:
        atomic_write_json(a.out, result)


if __name__ == "__main__":
    main()
