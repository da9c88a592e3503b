"""Offline launch-config sweep for the paged decode kernels (issue 5), on one CUDA GPU.

For each bench cell (B, ctx) of ``localgen bench kernels`` it times, as CUDA-graph replays with
the L2 flushed, the sync kernel over block_n x num_warps x num_stages x split targets (fused
combine), then for the best config: unfused vs fused and the async variant; then int4 over
block_n x num_warps x split targets. Every timed output is checked against a reference output
(the unfused default config) so a fast-but-wrong config cannot win. The table in
``paged_decode.decode_config`` is chosen from this output. Stops cleanly at ``--deadline`` s.

    python3 scripts/decode_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from localgen.bench.kernels_bench import (HEAD_DIM, HEADS, KV_HEADS, Timer,  # noqa: E402
                                          copy_bandwidth, import_kernels, quantize_chunked,
                                          random_paged_case)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--deadline", type=float, default=240.0)
    ap.add_argument("--no-int4", action="store_true")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--int4-warps", default="4", help="num_warps values for the int4 configs")
    ap.add_argument("--heads", type=int, default=HEADS, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=KV_HEADS, help="KV heads (= --heads: MHA)")
    ap.add_argument("--pps", default="1,2,4,8", help="programs per SM targets (split counts)")
    ap.add_argument("--splits", default=None, help="explicit split counts (instead of --pps)")
    args = ap.parse_args()
    t0 = time.time()
    pd, ref, qr = import_kernels()
    timer = Timer(args.repeat, 2)
    bw = copy_bandwidth(timer)
    res = {"copy_GBps": bw / 1e9, "device": torch.cuda.get_device_name(), "cells": []}
    dev, dt = "cuda", torch.bfloat16

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for b, ctx in itertools.product(map(int, args.batches.split(",")),
                                    map(int, args.contexts.split(","))):
        if time.time() - t0 > args.deadline:
            print("deadline reached", flush=True)
            break
        gen = torch.Generator(device=dev).manual_seed(7 + b + ctx)
        q, k, v, tables, lens = random_paged_case(b, ctx, gen, heads=args.heads,
                                                  kv_heads=args.kv_heads, dtype=dt)
        scale = HEAD_DIM ** -0.5
        nbytes = 2 * b * ctx * args.kv_heads * HEAD_DIM * 2
        want = pd.paged_decode_attention(q, k, v, tables, lens, scale, max_context_len=ctx,
                                         block_n=64, num_warps=4, num_stages=2, fused=False,
                                         num_splits=pd.choose_num_splits(b, args.kv_heads, ctx,
                                                                         q.device, 64, 2))
        out = torch.empty_like(q)
        cell = {"B": b, "ctx": ctx, "runs": []}
        res["cells"].append(cell)

        def run(kind, kk, vv, nbytes_, **kw):
            f = pd.paged_decode_attention_int4 if kind == "int4" else pd.paged_decode_attention
            fn = lambda: f(q, kk, vv, tables, lens, scale, out=out, max_context_len=ctx, **kw)  # noqa
            try:
                fn()
                torch.cuda.synchronize()
                err = float((out.float() - want.float()).abs().max())
                us = timer.graph(fn)
            except Exception as e:  # noqa: BLE001
                print(f"  {kind} {kw}: {type(e).__name__}: {e}", flush=True)
                return None
            r = {"kind": kind, **{k_: (str(v_) if k_ == "phi" else v_) for k_, v_ in kw.items()},
                 "us": us, "err": err, "GBps": nbytes_ / (us * 1e-6) / 1e9 if us else None}
            r["pct_copy"] = 100 * r["GBps"] * 1e9 / bw if us else None
            cell["runs"].append(r)
            return r

        seen = set()
        best = None
        split_opts = [("n", s_) for s_ in ints(args.splits)] if args.splits else \
            [("pps", p_) for p_ in ints(args.pps)]
        for bn, nw, ns, (how, val) in itertools.product(ints(args.block_n), ints(args.warps),
                                                        ints(args.stages), split_opts):
            splits = val if how == "n" else pd.choose_num_splits(
                b, args.kv_heads, ctx, q.device, bn, programs_per_sm=val)
            key = (bn, nw, ns, splits)
            if key in seen:
                continue
            seen.add(key)
            r = run("sync", k, v, nbytes, block_n=bn, num_warps=nw, num_stages=ns,
                    num_splits=splits, fused=True)
            if r and r["us"] and r["err"] < 0.05 and (best is None or r["us"] < best["us"]):
                best = r
        if best is None:
            continue
        cfg = {k_: best[k_] for k_ in ("block_n", "num_warps", "num_stages", "num_splits")}
        run("sync_unfused", k, v, nbytes, **cfg, fused=False)
        run("async", k, v, nbytes, **cfg, fused=True, phi=0.0)
        run("async_unfused", k, v, nbytes, **cfg, fused=False, phi=0.0)
        run("sync_default", k, v, nbytes)
        run("async_default", k, v, nbytes, phi=0.0)
        print(f"B={b} ctx={ctx} best sync {cfg} {best['us']:.1f} us "
              f"{best['pct_copy']:.1f}% copy; " + "; ".join(
                  f"{r['kind']} {r['us']:.1f}" for r in cell["runs"][-6:] if r.get("us")),
              flush=True)
        if not args.no_int4 and time.time() - t0 < args.deadline:
            qk, qv = quantize_chunked(k, qr), quantize_chunked(v, qr)
            del k, v
            q4 = 2 * b * ctx * args.kv_heads * (HEAD_DIM // 2 + 8)
            b4 = None
            seen = set()
            for bn, nw, pps in itertools.product(ints(args.block_n), ints(args.int4_warps),
                                                 ints(args.pps)):
                splits = pd.choose_num_splits(b, args.kv_heads, ctx, q.device, bn,
                                              programs_per_sm=pps)
                if (bn, nw, splits) in seen:
                    continue
                seen.add((bn, nw, splits))
                r = run("int4", qk, qv, q4, block_n=bn, num_warps=nw, num_stages=2,
                        num_splits=splits, fused=True)
                if r and r["us"] and (b4 is None or r["us"] < b4["us"]):
                    b4 = r
            if b4:
                print(f"   int4 best bn={b4['block_n']} nw={b4['num_warps']} "
                      f"splits={b4['num_splits']} {b4['us']:.1f} us {b4['GBps']:.0f} GB/s "
                      f"err={b4['err']:.3f}", flush=True)
            del qk, qv
        else:
            del k, v
        torch.cuda.empty_cache()
        save()
    res["seconds"] = time.time() - t0
    save()
    print(f"sweep done in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
