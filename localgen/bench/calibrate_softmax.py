"""Calibrate the unified max value ``phi`` and the safe range ``(a, b)`` of the asynchronized
softmax (FlashDecoding++ §3) for one model, on real text.

Runs the model (the embedded SmolLM2-135M by default, CPU) over WikiText-2 and collects, through
the score observer of the engine's attention backend, every pre-softmax attention score
``x = scale * q.k`` of every layer and head at every position (a prefill row at position t sees
exactly what a decode step at t sees). Then:

* ``(a, b)`` is the safe range of ``x - phi`` set by the dtype the kernel casts the partial
  exponentials to (``paged_decode.DEFAULT_BOUNDS``, reproduced here so this script does not need
  triton): bf16/fp32 ``(-64, 64)``, fp16 ``(-9, 11)``;
* ``phi`` is chosen on WikiText so that the fewest rows fall outside the tightest range (fp16),
  taking the middle of the optimal interval;
* recompute rates are reported on WikiText and, held out, on MT-Bench first turns (prompt plus
  greedy decode tokens): per row under the kernel's rule (row max ``x - phi`` outside ``(a, b)``),
  per (sequence, KV head) program (the unit the kernel recomputes), and under the paper-literal
  rule (any element of the row outside ``(a, b)``).

    python -m localgen.bench.calibrate_softmax --out profiles/softmax_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from localgen.bench.data import data_dir
from localgen.fileio import atomic_write_json
from localgen.kernels import paged_attention_ref as ref

BOUNDS = {"bfloat16": (-64.0, 64.0), "float32": (-64.0, 64.0), "float16": (-9.0, 11.0)}
HIST_LO, HIST_HI, HIST_BINS = -256.0, 256.0, 4096


class _Rows:
    """A growing ``[rows, heads]`` float32 buffer (capacity doubles). Appending small result
    tensors to a list instead fragments the heap: each long-lived 36 KiB row block lands in the hole
    a freed score matrix left, so the next score matrix cannot reuse it and the process grows by
    about one score matrix per (sequence, layer), until a long run exhausts memory. One buffer
    that doubles keeps the rows in a few large blocks."""

    def __init__(self):
        self.buf, self.n = None, 0

    def append(self, rows: torch.Tensor) -> None:
        if self.buf is None or self.n + rows.shape[0] > self.buf.shape[0]:
            cap = max(1 << 16, 2 * (self.buf.shape[0] if self.buf is not None else 0),
                      self.n + rows.shape[0])
            new = torch.empty(cap, rows.shape[1], dtype=torch.float32)
            if self.buf is not None:
                new[:self.n] = self.buf[:self.n]
            self.buf = new
        self.buf[self.n:self.n + rows.shape[0]] = rows
        self.n += rows.shape[0]

    def tensor(self) -> torch.Tensor:
        return self.buf[:self.n]


class ScoreStats:
    """Row max/min of x per (layer, head, position) and a histogram of all x."""

    def __init__(self, num_layers: int):
        self.num_layers, self.calls = num_layers, 0
        self.rowmax = [_Rows() for _ in range(num_layers)]
        self.rowmin = [_Rows() for _ in range(num_layers)]
        self.hist = torch.zeros(HIST_BINS, dtype=torch.float64)
        self.elements = 0
        self.xmin, self.xmax = math.inf, -math.inf
        self.group = 1

    def __call__(self, q, kv, meta, scale):
        layer = self.calls % self.num_layers
        self.calls += 1
        heads, kvh = q.shape[1], kv.k_cache.shape[2]
        self.group = heads // kvh
        start = 0
        for i, (ctx, ql) in enumerate(zip(meta.context_lens_list, meta.query_lens)):
            qi = q[start:start + ql].float()
            start += ql
            k = ref.gather_kv(kv.k_cache, meta.block_tables[i], ctx).float()
            k = k.repeat_interleave(self.group, dim=1)
            x = torch.einsum("thd,chd->htc", qi, k) * scale  # [H, ql, ctx]
            pos = torch.arange(ctx - ql, ctx, device=x.device)[:, None]
            vis = torch.arange(ctx, device=x.device)[None, :] <= pos  # [ql, ctx]
            self.rowmax[layer].append(x.masked_fill(~vis, -math.inf).amax(-1).T.cpu())  # [ql, H]
            self.rowmin[layer].append(x.masked_fill(~vis, math.inf).amin(-1).T.cpu())
            xv = x[:, vis]
            self.hist += torch.histc(xv.double().cpu(), HIST_BINS, HIST_LO, HIST_HI)
            self.elements += xv.numel()
            self.xmin, self.xmax = min(self.xmin, float(xv.min())), max(self.xmax, float(xv.max()))

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[layers, positions, heads] row max and row min."""
        return (torch.stack([r.tensor() for r in self.rowmax]),
                torch.stack([r.tensor() for r in self.rowmin]))

    def quantile(self, p: float) -> float:
        c = self.hist.cumsum(0) / self.hist.sum()
        i = int(torch.searchsorted(c, torch.tensor(p, dtype=torch.float64)))
        return HIST_LO + (i + 0.5) * (HIST_HI - HIST_LO) / HIST_BINS

    def element_outside(self, lo: float, hi: float) -> float:
        edges = torch.linspace(HIST_LO, HIST_HI, HIST_BINS + 1, dtype=torch.float64)
        centers = (edges[:-1] + edges[1:]) / 2
        out = self.hist[(centers <= lo) | (centers >= hi)].sum()
        return float(out / self.hist.sum())


def rates(stats: ScoreStats, phi: float, bounds: tuple[float, float]) -> dict:
    a, b = bounds
    rmax, rmin = stats.rows()
    bad_row = ((rmax - phi) <= a) | ((rmax - phi) >= b)
    L, T, H = bad_row.shape
    bad_prog = bad_row.view(L, T, H // stats.group, stats.group).any(-1)
    literal = bad_row | ((rmin - phi) <= a)
    return {"rows": L * T * H, "row_rate": float(bad_row.float().mean()),
            "program_rate": float(bad_prog.float().mean()),
            "any_layer_step_rate": float(bad_row.any(-1).any(0).float().mean()),
            "literal_row_rate": float(literal.float().mean()),
            "literal_element_rate": stats.element_outside(phi + a, phi + b)}


def choose_phi(stats: ScoreStats, bounds: tuple[float, float], step: float = 0.25) -> float:
    """phi minimizing the row rate under ``bounds``; the middle of the optimal interval."""
    rmax, _ = stats.rows()
    lo, hi = float(rmax.min()) - bounds[1], float(rmax.max()) - bounds[0]
    grid = torch.arange(math.floor(lo), math.ceil(hi) + step, step)
    best, cands = None, []
    for phi in grid.tolist():
        r = float((((rmax - phi) <= bounds[0]) | ((rmax - phi) >= bounds[1])).float().mean())
        if best is None or r < best - 1e-12:
            best, cands = r, [phi]
        elif abs(r - best) <= 1e-12:
            cands.append(phi)
    return round((cands[0] + cands[-1]) / 2, 3)


def summarize(stats: ScoreStats) -> dict:
    rmax, rmin = stats.rows()
    per_layer = [{"layer": i, "x_min": float(rmin[i].min()), "x_max": float(rmax[i].max()),
                  "rowmax_p0.01": float(rmax[i].flatten().quantile(1e-4)),
                  "rowmax_p99.99": float(rmax[i].flatten().quantile(1 - 1e-4))}
                 for i in range(rmax.shape[0])]
    return {"elements": stats.elements, "rows": rmax.numel(), "x_min": stats.xmin,
            "x_max": stats.xmax, "x_p0.01": stats.quantile(1e-4), "x_p99.99": stats.quantile(1 - 1e-4),
            "rowmax_min": float(rmax.min()), "rowmax_max": float(rmax.max()),
            "rowmax_p0.01": float(rmax.flatten().quantile(1e-4)),
            "rowmax_p99.99": float(rmax.flatten().quantile(1 - 1e-4)),
            "per_layer": per_layer}


def run_wikitext(llm, path: str, tokens: int, chunk: int) -> ScoreStats:
    from localgen.api import Request, SamplingParams
    text = open(path, encoding="utf-8").read()
    ids = llm.tokenizer.encode(text[: tokens * 8])[:tokens]
    stats = ScoreStats(llm.config.num_layers)
    prev = llm.engine.runner.observe_scores(stats)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate([Request(prompt_token_ids=ids[i:i + chunk], sampling=sp)
                      for i in range(0, len(ids) - chunk + 1, chunk)])
    finally:
        llm.engine.runner.observe_scores(prev)
    return stats


def run_mt_bench(llm, path: str, n: int, max_tokens: int) -> ScoreStats:
    from localgen.api import Request, SamplingParams
    qs = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()][:n]
    stats = ScoreStats(llm.config.num_layers)
    prev = llm.engine.runner.observe_scores(stats)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        llm.generate([Request(messages=[{"role": "user", "content": q["turns"][0]}], sampling=sp)
                      for q in qs])
    finally:
        llm.engine.runner.observe_scores(prev)
    return stats


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--wikitext", default=str(data_dir() / "wikitext2_test.raw"))
    ap.add_argument("--mt-bench", default=str(data_dir() / "mt_bench_questions.jsonl"))
    ap.add_argument("--tokens", type=int, default=16384, help="WikiText tokens")
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per WikiText sequence")
    ap.add_argument("--mt-bench-n", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="profiles/softmax_smollm2-135m.json")
    args = ap.parse_args(argv)

    from localgen.api import LLM
    t0 = time.time()
    llm = LLM.load(args.model, device="cpu", dtype="float32")
    print(f"loaded {llm.model_name} in {time.time() - t0:.1f}s", flush=True)
    wiki = run_wikitext(llm, args.wikitext, args.tokens, args.chunk)
    print(f"wikitext: {wiki.elements} scores, {time.time() - t0:.1f}s", flush=True)
    mt = run_mt_bench(llm, args.mt_bench, args.mt_bench_n, args.max_new_tokens)
    print(f"mt-bench: {mt.elements} scores, {time.time() - t0:.1f}s", flush=True)

    phi = choose_phi(wiki, BOUNDS["float16"])
    result = {
        "model": llm.model_name, "method": "FlashDecoding++ §3 asynchronized softmax",
        "phi": phi, "bounds": BOUNDS, "rule": "recompute a row when max_j x_j - phi is outside (a, b)",
        "calibration": {"wikitext_tokens": args.tokens, "chunk": args.chunk,
                        "mt_bench_questions": args.mt_bench_n, "max_new_tokens": args.max_new_tokens},
        "x": {"wikitext": summarize(wiki), "mt_bench": summarize(mt)},
        "recompute": {name: {dt: rates(s, phi, BOUNDS[dt]) for dt in ("bfloat16", "float16")}
                      for name, s in (("wikitext", wiki), ("mt_bench", mt))},
    }
    atomic_write_json(args.out, result)
    for name in ("wikitext", "mt_bench"):
        x = result["x"][name]
        print(f"{name}: x in [{x['x_min']:.2f}, {x['x_max']:.2f}] (p0.01 {x['x_p0.01']:.2f}, "
              f"p99.99 {x['x_p99.99']:.2f}); row max in [{x['rowmax_min']:.2f}, {x['rowmax_max']:.2f}]")
        for dt in ("bfloat16", "float16"):
            r = result["recompute"][name][dt]
            print(f"  phi={phi} {dt} (a,b)={BOUNDS[dt]}: rows {100 * r['row_rate']:.4f}%  "
                  f"programs {100 * r['program_rate']:.4f}%  literal rows "
                  f"{100 * r['literal_row_rate']:.3f}%  literal elements "
                  f"{100 * r['literal_element_rate']:.4f}%")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
