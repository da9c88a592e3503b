"""`localgen bench decode`: decode throughput and latency beside Hugging Face transformers
``generate`` (sdpa, its default cache), measured in the same run, plus the HBM roofline.

Dummy weights of a real architecture's shape (``--model llama-2-7b``, any preset of
``localgen.policy.presets``) or a real model (``--model PATH``, the embedded default with
``--model embedded``). For each batch size both engines generate ``gen_len`` tokens after a
``prompt_len`` prompt (greedy, EOS ignored). Reported per run:

* tokens/s = batch × gen_len / wall time of the whole generation (prefill included), the
  number Hugging Face users see;
* decode tokens/s = tokens produced by decode steps / decode time (localgen's metrics);
* llama.cpp through llama-cpp-python on the same GGUF, where installed (CPU, batch 1);
* the roofline: every decode step reads all weights and the batch's KV cache once, so
  ``tokens/s <= batch × copy_bandwidth / (weight bytes + mean KV bytes)`` (Efficiently Scaling
  Transformer Inference §2: decode is memory-bound). The copy bandwidth is measured here
  (device-to-device copy, bytes read + written).

Runs where only torch and transformers are installed (a GPU box):
``python -m localgen.bench.decode_bench --model llama-2-7b --batches 1,16,64 --out r.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class DecodeRun:
    engine: str
    batch: int
    prompt_len: int
    gen_len: int
    seconds: float
    tokens_per_s: float
    decode_tokens_per_s: float | None
    roofline_tokens_per_s: float
    fraction_of_roofline: float  # decode tokens/s (or tokens/s) over the roofline
    prefill_seconds: float | None = None
    graph_replay_ms: float | None = None  # GPU time of one decode graph replay (no host work)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written (median of 10)."""
    if device.type != "cuda":
        src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
        dst = torch.empty_like(src)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        return 2 * nbytes / sorted(times)[2]
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * nbytes / sorted(times)[5]


def roofline(weight_bytes: int, kv_bytes_per_token: int, batch: int, prompt_len: int,
             gen_len: int, bandwidth: float) -> float:
    """Upper bound on decode tokens/s: each step reads the weights and the batch's KV once."""
    mean_ctx = prompt_len + gen_len / 2
    step_bytes = weight_bytes + batch * mean_ctx * kv_bytes_per_token
    return batch * bandwidth / step_bytes


def graph_replay_ms(llm) -> float | None:
    """Median GPU time of replaying the most recently captured decode graph (CUDA events)."""
    graphs = getattr(llm.engine.runner, "graphs", None)
    if not graphs:
        return None
    g = list(graphs.values())[-1]
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[10]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (batch, prompt_len), generator=g).tolist()


def run_localgen(llm, batch: int, prompt_len: int, gen_len: int,
                 seed: int = 0) -> tuple[float, float]:
    """Wall seconds of one generation, and decode tokens/s from the engine's metrics."""
    from localgen.api import Request, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    reqs = [Request(prompt_token_ids=p, sampling=sp)
            for p in prompts(batch, prompt_len, llm.config.vocab_size, seed)]
    m = llm.metrics
    dec_t0, dec_n0, pre_t0 = m.decode_seconds, m.decode_tokens, m.prefill_seconds
    _sync(llm.engine.model.device)
    t = time.perf_counter()
    llm.generate(reqs)
    _sync(llm.engine.model.device)
    wall = time.perf_counter() - t
    dec = (m.decode_tokens - dec_n0) / max(m.decode_seconds - dec_t0, 1e-9)
    run_localgen.last_prefill_s = m.prefill_seconds - pre_t0
    return wall, dec


def run_hf(model, batch: int, prompt_len: int, gen_len: int, vocab: int, device) -> float:
    ids = torch.tensor(prompts(batch, prompt_len, vocab), device=device)
    _sync(device)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                       min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
    _sync(device)
    return time.perf_counter() - t


def run_llama_cpp(gguf_path: str, batch: int, prompt_len: int, gen_len: int, vocab: int,
                  threads: int) -> tuple[float, float, float] | None:
    """llama.cpp (llama-cpp-python, flash attention on) on the same GGUF and the same prompt ids,
    batch 1 only: (wall seconds, decode tokens/s, prefill seconds); None when not installed or
    batch > 1 (its Python API has no batched generation)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    if batch != 1:
        return None
    llm = Llama(model_path=gguf_path, n_ctx=prompt_len + gen_len + 8, n_batch=512,
                n_threads=threads, flash_attn=True, verbose=False)
    ids = prompts(1, prompt_len, vocab)[0]
    for _ in range(2):  # the first pass warms up; the second is measured
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for _ in range(gen_len):
            llm.eval([llm.sample(temp=0.0)])
        t2 = time.perf_counter()
    return t2 - t0, gen_len / (t2 - t1), t1 - t0


def load_models(spec: str, device: torch.device, dtype: torch.dtype, max_num_seqs: int,
                max_model_len: int, with_hf: bool):
    """(localgen LLM, transformers model or None) on the same (dummy or real) weights."""
    from localgen.api import LLM
    from localgen.runtime.engine import EngineConfig

    # a cache just big enough for the largest batch, so the transformers peer fits beside it
    ecfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        max_num_batched_tokens=max(8192, max_model_len))
    if spec.lower() in {"embedded", "default"} or "/" in spec or spec.endswith(".gguf"):
        llm = LLM.load(None if spec.lower() in {"embedded", "default"} else spec, device=str(device),
                       dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       kv_cache_memory=_kv_budget(None, max_num_seqs, max_model_len, dtype, spec))
        hf = _hf_from_source(llm, device, dtype) if with_hf else None
        return llm, hf
    from localgen.models.dummy import DummyStore
    from localgen.models.model import family_of
    from localgen.policy.presets import preset_config

    cfg = preset_config(spec)
    ecfg.kv_cache_memory = _kv_budget(cfg, max_num_seqs, max_model_len, dtype, spec)
    store = DummyStore(cfg, family_of(cfg), dtype=dtype)
    llm = LLM.from_parts(cfg, store, None, ecfg, device=str(device), dtype=dtype, name=spec)
    hf = _hf_dummy(cfg, device, dtype) if with_hf else None
    return llm, hf


def _kv_budget(cfg, max_num_seqs: int, max_model_len: int, dtype, spec: str) -> int:
    """KV bytes for max_num_seqs full contexts (+ a block of slack per sequence)."""
    if cfg is None:
        from localgen.models.sources import resolve_model

        cfg = resolve_model(None if spec.lower() in {"embedded", "default"} else spec).config
    per_tok = cfg.kv_bytes_per_token(torch.tensor([], dtype=dtype).element_size())
    return max_num_seqs * (max_model_len + 16) * per_tok


def _hf_dummy(cfg, device, dtype):
    """The same architecture in transformers with random weights (initialized on the device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hc = AutoConfig.for_model(cfg.extra.get("model_type", "llama"), **{
        k: v for k, v in cfg.extra.items() if k not in ("model_type", "architectures")})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hc, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _hf_from_source(llm, device, dtype):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(llm.source.path)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = path.parent if path.suffix == ".gguf" else path
    return AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, attn_implementation="sdpa",
                                                **kw).to(device).eval()


def bench(spec: str, batches: list[int], prompt_len: int, gen_len: int, *, device: str | None,
          dtype: str, with_hf: bool = True, log=print) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}[dtype]
    llm, hf = load_models(spec, dev, dt, max(batches), prompt_len + gen_len + 16, with_hf)
    bw = copy_bandwidth(dev)
    wbytes = llm.engine.model.weight_bytes()
    kv_tok = llm.config.kv_bytes_per_token(torch.tensor([], dtype=dt).element_size())
    log(f"{spec} on {dev} ({dt}): weights {wbytes / 1e9:.2f} GB, copy bandwidth {bw / 1e9:.0f} GB/s")
    runs: list[DecodeRun] = []
    for b in batches:
        # warm-up with the measured shapes: compiles kernels, captures this run's graph buckets
        # (other prompts than the measured ones: no prefix-cache hits in the measurement)
        run_localgen(llm, b, prompt_len, gen_len, seed=1)
        roof = roofline(wbytes, kv_tok, b, prompt_len, gen_len, bw)
        wall, dec = run_localgen(llm, b, prompt_len, gen_len)
        runs.append(DecodeRun("localgen", b, prompt_len, gen_len, wall, b * gen_len / wall, dec,
                              roof, dec / roof, run_localgen.last_prefill_s,
                              graph_replay_ms(llm)))
        if hf is not None:
            run_hf(hf, b, prompt_len, gen_len, llm.config.vocab_size, dev)  # warm-up, same shapes
            wall_hf = run_hf(hf, b, prompt_len, gen_len, llm.config.vocab_size, dev)
            tps = b * gen_len / wall_hf
            runs.append(DecodeRun("transformers", b, prompt_len, gen_len, wall_hf, tps, None, roof,
                                  tps / roof))
        gguf = getattr(getattr(llm, "source", None), "path", None)
        if with_hf and dev.type == "cpu" and gguf is not None and str(gguf).endswith(".gguf"):
            lc = run_llama_cpp(str(gguf), b, prompt_len, gen_len, llm.config.vocab_size,
                               torch.get_num_threads())
            if lc is not None:
                wall_lc, dec_lc, pre_lc = lc
                runs.append(DecodeRun("llama.cpp", b, prompt_len, gen_len, wall_lc,
                                      gen_len / wall_lc, dec_lc, roof, dec_lc / roof, pre_lc))
        gc.collect()
    table = format_table(runs) + _llama_cpp_ratios(runs)
    log(table)
    return {"model": spec, "device": str(dev), "dtype": str(dt), "copy_bandwidth": bw,
            "weight_bytes": wbytes, "runs": [asdict(r) for r in runs], "table": table}


def _llama_cpp_ratios(runs: list[DecodeRun]) -> str:
    """Lines of localgen ÷ llama.cpp ratios (decode, prefill, end to end) per batch measured by both."""
    ours = {r.batch: r for r in runs if r.engine == "localgen"}
    lines = []
    for r in (r for r in runs if r.engine == "llama.cpp" and r.batch in ours):
        o = ours[r.batch]
        pre = (r.prefill_seconds / o.prefill_seconds) if o.prefill_seconds else float("nan")
        lines.append(f"localgen / llama.cpp at batch {r.batch}: decode "
                     f"{o.decode_tokens_per_s / r.decode_tokens_per_s:.2f}x, prefill {pre:.2f}x, "
                     f"end to end {o.tokens_per_s / r.tokens_per_s:.2f}x")
    return "".join("\n" + line for line in lines)


def format_table(runs: list[DecodeRun]) -> str:
    lines = [f"{'engine':13s} {'batch':>5s} {'prompt':>6s} {'gen':>4s} {'tok/s':>9s} "
             f"{'decode tok/s':>12s} {'roofline':>9s} {'%roof':>6s} {'vs HF':>7s} {'prefill s':>9s}"
             f" {'graph ms':>8s}"]
    hf = {r.batch: r for r in runs if r.engine == "transformers"}
    for r in runs:
        ratio = r.tokens_per_s / hf[r.batch].tokens_per_s if r.batch in hf else float("nan")
        dec = f"{r.decode_tokens_per_s:12.1f}" if r.decode_tokens_per_s else f"{'-':>12s}"
        lines.append(f"{r.engine:13s} {r.batch:5d} {r.prompt_len:6d} {r.gen_len:4d} "
                     f"{r.tokens_per_s:9.1f} {dec} {r.roofline_tokens_per_s:9.1f} "
                     f"{100 * r.fraction_of_roofline:5.1f}% {ratio:6.2f}x "
                     f"{r.prefill_seconds if r.prefill_seconds is not None else float('nan'):9.3f}"
                     f" {r.graph_replay_ms if r.graph_replay_ms is not None else float('nan'):8.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-2-7b",
                    help="a preset name (dummy weights), 'embedded', or a model path")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument("--out", default=None, help="write JSON results here")
    a = ap.parse_args(argv)
    res = bench(a.model, [int(x) for x in a.batches.split(",")], a.prompt_len, a.gen_len,
                device=a.device, dtype=a.dtype, with_hf=not a.no_hf)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
