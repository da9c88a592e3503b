"""`localgen bench kernels`: decode attention kernels vs SDPA vs the paged reference vs HBM copy.

Measures on one CUDA GPU, in the same run (issue 5; FlashDecoding / FlashDecoding++ §3):
  * ours: Triton paged decode, synchronized split-KV ("sync"), asynchronized unified-max ("async"),
    and the 4-bit KV variant ("int4", FlexGen §5 format; its own, smaller bytes are counted);
  * "sdpa": ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)`` on a contiguous
    ``[B, kv_heads, ctx, head_dim]`` cache (whichever backend torch picks);
  * "ref": the pure-torch paged reference twin (``paged_attention_ref``);
  * the HBM copy bandwidth (``dst.copy_(src)`` of 1 GiB, read + write bytes).
Shapes: B in {1, 8, 32, 128}, context in {512, 4k, 32k}, 32 query heads, 8 KV heads, head_dim 128,
bf16 (``--dtype``), KV block size 16 (``--block-size``), shuffled block tables. Cells that do
not fit in memory are skipped.

Timing: CUDA events around one call, median of ``--repeat`` after warm-up, L2 flushed before every
timed call by reading a 256 MiB buffer (``--flush read``). A flush that writes (``--flush write``, kept
for comparison) leaves the L2 full of dirty lines, and their write-back then lands inside the timed
call as extra DRAM traffic, which a decode step, whose preceding kernels write only small
activations, does not pay. The timing floor
(one tiny kernel timed the same way) is printed with the table. Ours and SDPA are timed as
CUDA-graph replays ("us", pure GPU time) and as eager calls ("eager_us", with Python launch
overhead); the reference eagerly (it reads
``context_lens.max()`` on the host). GB/s = KV bytes read / time; % copy = GB/s over the copy
bandwidth; "x sdpa" = SDPA time / our time (> 1: we are faster).

Only argparse + torch + triton are needed (GPU machines without typer/rich):

    python -m localgen.bench.kernels_bench --out kernels_bench.json
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import time

import torch

from localgen.fileio import atomic_write_json

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 4096, 32768)


def import_kernels():
    """``localgen.kernels`` when installed; else the repo's ``kernels/`` loaded under that name
    (a bare checkout, as on a GPU box without ``pip install``)."""
    try:
        import localgen.kernels  # noqa: F401
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        kdir = os.path.join(root, "kernels")
        spec = importlib.util.spec_from_file_location(
            "localgen.kernels", os.path.join(kdir, "__init__.py"), submodule_search_locations=[kdir])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["localgen.kernels"] = mod
        spec.loader.exec_module(mod)
    from localgen.kernels import paged_attention_ref, paged_decode, quant_ref
    return paged_decode, paged_attention_ref, quant_ref


FLUSH_MODES = ("read", "write")


class Timer:
    """Median µs of ``fn`` over ``repeat`` calls, each after an L2 flush: ``flush`` "read" (a
    reduction over a 256 MiB buffer: the L2 ends holding clean lines) or "write" (``zero_()``: the
    L2 ends holding dirty lines that the timed call writes back)."""

    def __init__(self, repeat: int, warmup: int, flush_bytes: int = 256 << 20, flush: str = "read"):
        if flush not in FLUSH_MODES:
            raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")
        self.repeat, self.warmup, self.mode = repeat, warmup, flush
        self.flush = torch.ones(flush_bytes // 4, dtype=torch.int32, device="cuda")

    def _flush(self) -> None:
        if self.mode == "read":
            self.flush.amax()
        else:
            self.flush.fill_(1)

    def _events(self, fn) -> float:
        times = []
        for _ in range(self.repeat):
            self._flush()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)  # µs
        return statistics.median(times)

    def eager(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        return self._events(fn)

    def graph(self, fn) -> float | None:
        """Median µs of CUDA-graph replays of ``fn`` (None if it cannot be captured)."""
        try:
            for _ in range(2):
                fn()  # compile / autotune outside the capture
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            for _ in range(self.warmup):
                g.replay()
            torch.cuda.synchronize()
            return self._events(g.replay)
        except Exception as e:  # noqa: BLE001
            print(f"    (graph capture failed: {type(e).__name__}: {e}; eager only)", flush=True)
            torch.cuda.synchronize()
            return None


def copy_bandwidth(timer: Timer, nbytes: int = 1 << 30) -> float:
    """bytes/s of ``dst.copy_(src)``, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = timer.eager(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (us * 1e-6)


def timing_floor(timer: Timer) -> float | None:
    """µs of a CUDA-graph replay of one tiny kernel, timed as the kernels are: what a cold call
    costs before it reads anything."""
    x = torch.zeros(1024, device="cuda")
    return timer.graph(lambda: x.add_(1))


def free_bytes() -> int:
    free, _ = torch.cuda.mem_get_info()
    return free


def quantize_chunked(cache: torch.Tensor, quant_ref, chunk_blocks: int = 4096):
    """int4 copy of a big cache without float32 copies of the whole thing."""
    nb = cache.shape[0]
    packed = torch.empty(*cache.shape[:-1], cache.shape[-1] // 2, dtype=torch.uint8,
                         device=cache.device)
    groups = -(-cache.shape[-1] // quant_ref.GROUP_SIZE)
    scale = torch.empty(*cache.shape[:-1], groups, dtype=torch.float16, device=cache.device)
    mn = torch.empty_like(scale)
    for i in range(0, nb, chunk_blocks):
        p, s, z = quant_ref.quantize_int4(cache[i:i + chunk_blocks])
        packed[i:i + chunk_blocks], scale[i:i + chunk_blocks], mn[i:i + chunk_blocks] = p, s, z
    return quant_ref.QuantizedKV(packed, scale, mn)


def random_paged_case(b: int, ctx: int, gen: torch.Generator, *, heads: int = HEADS,
                      kv_heads: int = KV_HEADS, dtype=torch.bfloat16, block_size: int = BLOCK_SIZE):
    """``(q, k, v, tables, lens)``: ``b`` sequences of ``ctx`` tokens in a paged cache of
    ``[b * ceil(ctx / block_size), block_size, kv_heads, HEAD_DIM]`` (normal values), shuffled
    block tables, and one query token each ``[b, heads, HEAD_DIM]``; drawn from ``gen``, on its
    device."""
    blocks_per_seq = -(-ctx // block_size)
    nb = b * blocks_per_seq
    device = gen.device
    k = torch.randn(nb, block_size, kv_heads, HEAD_DIM, dtype=dtype, device=device, generator=gen)
    v = torch.randn(nb, block_size, kv_heads, HEAD_DIM, dtype=dtype, device=device, generator=gen)
    tables = torch.randperm(nb, device=device, generator=gen).view(b, blocks_per_seq)
    lens = torch.full((b,), ctx, dtype=torch.int64, device=device)
    q = torch.randn(b, heads, HEAD_DIM, dtype=dtype, device=device, generator=gen)
    return q, k, v, tables, lens


def bench_cell(b: int, ctx: int, timer: Timer, mods, args, copy_bw: float) -> list[dict]:
    pd, ref, qr = mods
    dev, dt = "cuda", DTYPES[args.dtype]
    bs = args.block_size
    blocks_per_seq = -(-ctx // bs)
    nb = b * blocks_per_seq
    kv_bytes = 2 * nb * bs * KV_HEADS * HEAD_DIM * 2
    exact_bytes = 2 * b * ctx * KV_HEADS * HEAD_DIM * 2
    if kv_bytes * 2.3 + (1 << 30) > free_bytes():
        print(f"  B={b} ctx={ctx}: skipped ({kv_bytes / 2**30:.1f} GiB of KV does not fit)")
        return [{"B": b, "ctx": ctx, "impl": "all", "skipped": "memory"}]
    gen = torch.Generator(device=dev).manual_seed(1234 + b + ctx)
    q, k, v, tables, lens = random_paged_case(b, ctx, gen, dtype=dt, block_size=bs)
    scale = HEAD_DIM ** -0.5
    rows = []

    def record(impl, us, eager_us, nbytes, extra=None):
        t = us if us is not None else eager_us
        row = {"B": b, "ctx": ctx, "impl": impl, "us": us, "eager_us": eager_us,
               "kv_bytes": nbytes, "GBps": nbytes / (t * 1e-6) / 1e9,
               "pct_copy": 100 * nbytes / (t * 1e-6) / copy_bw}
        row.update(extra or {})
        rows.append(row)

    cfg = pd.decode_config(b, KV_HEADS, ctx, HEAD_DIM, q.device)
    splits = pd.config_splits(cfg, b, KV_HEADS, ctx, q.device)
    cfg4 = pd.decode_config(b, KV_HEADS, ctx, HEAD_DIM, q.device, quant=True)
    splits4 = pd.config_splits(cfg4, b, KV_HEADS, ctx, q.device)
    out = torch.empty_like(q)
    variants = {"sync": dict(phi=None), "async": dict(phi=args.phi)}
    for name, kw in variants.items():
        fn = lambda kw=kw: pd.paged_decode_attention(q, k, v, tables, lens, scale, out=out,  # noqa
                                                     max_context_len=ctx, **kw)
        record(name, timer.graph(fn), timer.eager(fn), exact_bytes, {"num_splits": splits, "config": cfg})
    _, flags = pd.paged_decode_attention(q, k, v, tables, lens, scale, phi=args.phi,
                                         max_context_len=ctx, return_flags=True)
    rows[-1]["recomputed_rows"] = int(flags.sum())
    want = pd.paged_decode_attention(q, k, v, tables, lens, scale, max_context_len=ctx)

    if not args.no_ref and kv_bytes * 7 + (1 << 30) < free_bytes():
        fn = lambda: ref.paged_decode_attention(q, k, v, tables, lens, scale)  # noqa: E731
        r = ref.paged_decode_attention(q, k, v, tables, lens, scale)
        err = float((r.float() - want.float()).abs().max())
        slow = copy.copy(timer)  # same flush buffer and mode, fewer calls
        slow.repeat, slow.warmup = max(3, args.repeat // 4), 1
        record("ref", None, slow.eager(fn), exact_bytes, {"max_abs_diff_vs_sync": err})
        del r
    else:
        rows.append({"B": b, "ctx": ctx, "impl": "ref", "skipped": "memory or --no-ref"})
    torch.cuda.empty_cache()

    if not args.no_int4:
        qk, qv = quantize_chunked(k, qr), quantize_chunked(v, qr)
        del k, v
        torch.cuda.empty_cache()
        q4 = 2 * b * ctx * KV_HEADS * (HEAD_DIM // 2 + 2 * 2 * (-(-HEAD_DIM // 64)))
        fn = lambda: pd.paged_decode_attention_int4(q, qk, qv, tables, lens, scale, out=out,  # noqa
                                                    max_context_len=ctx)
        record("int4", timer.graph(fn), timer.eager(fn), q4, {"num_splits": splits4, "config": cfg4})
        fn = lambda: pd.paged_decode_attention_int4(q, qk, qv, tables, lens, scale, out=out,  # noqa
                                                    max_context_len=ctx, phi=args.phi)
        record("int4_async", timer.graph(fn), timer.eager(fn), q4, {"num_splits": splits4})
        o4 = pd.paged_decode_attention_int4(q, qk, qv, tables, lens, scale, max_context_len=ctx)
        rows[-1]["max_abs_diff_vs_sync"] = float((o4.float() - want.float()).abs().max())
        del qk, qv
    else:
        del k, v
    torch.cuda.empty_cache()

    kc = torch.randn(b, KV_HEADS, ctx, HEAD_DIM, dtype=dt, device=dev, generator=gen)
    vc = torch.randn(b, KV_HEADS, ctx, HEAD_DIM, dtype=dt, device=dev, generator=gen)
    q4d = q.unsqueeze(2)  # [B, H, 1, D]
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4d, kc, vc, scale=scale, enable_gqa=True)
    record("sdpa", timer.graph(fn), timer.eager(fn), exact_bytes)
    del kc, vc
    torch.cuda.empty_cache()

    sdpa = rows[-1]["us"] or rows[-1]["eager_us"]
    for r in rows:
        if "us" in r:
            r["x_sdpa"] = sdpa / (r["us"] or r["eager_us"])
    return rows


def print_table(rows: list[dict], copy_bw: float, floor_us: float | None = None,
                flush: str = "read") -> None:
    print(f"\nHBM copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write); L2 flush: {flush}; "
          f"timing floor (one tiny kernel): {floor_us or float('nan'):.1f} us")
    hdr = f"{'B':>4} {'ctx':>6} {'impl':>10} {'us':>9} {'eager_us':>9} {'GB/s':>7} {'%copy':>6} {'x sdpa':>7}  note"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "skipped" in r:
            print(f"{r['B']:>4} {r['ctx']:>6} {r['impl']:>10}  skipped ({r['skipped']})")
            continue
        us = f"{r['us']:.1f}" if r["us"] is not None else "-"
        note = ""
        if "num_splits" in r:
            note += f"splits={r['num_splits']} "
        if "recomputed_rows" in r:
            note += f"recomputed={r['recomputed_rows']} "
        print(f"{r['B']:>4} {r['ctx']:>6} {r['impl']:>10} {us:>9} {r['eager_us']:>9.1f} "
              f"{r['GBps']:>7.0f} {r['pct_copy']:>6.1f} {r['x_sdpa']:>7.2f}  {note}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="decode attention kernels vs SDPA vs reference (CUDA)")
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--phi", type=float, default=0.0,
                    help="unified max for the async variant (scores here are ~N(0, 1))")
    ap.add_argument("--no-ref", action="store_true", help="skip the pure-torch reference")
    ap.add_argument("--no-int4", action="store_true")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                    help="tokens per KV block (the runtime's is 16)")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="read",
                    help="how the L2 is flushed before each timed call (see the module doc)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("localgen bench kernels needs a CUDA GPU")
    import triton
    mods = import_kernels()
    timer = Timer(args.repeat, args.warmup, flush=args.flush)
    copy_bw = copy_bandwidth(timer)
    floor_us = timing_floor(timer)
    t0 = time.time()
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            print(f"  B={b} ctx={ctx} ...", flush=True)
            rows += bench_cell(b, ctx, timer, mods, args, copy_bw)
    print_table(rows, copy_bw, floor_us, args.flush)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "copy_GBps": copy_bw / 1e9, "flush": args.flush,
              "timing_floor_us": floor_us,
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                        "block_size": args.block_size, "dtype": args.dtype},
              "repeat": args.repeat, "seconds": time.time() - t0, "rows": rows}
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
