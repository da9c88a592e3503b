"""`localgen bench decode`: decode throughput and latency beside Hugging Face transformers
``generate`` (sdpa, its default cache), measured in the same run, plus the HBM roofline.

Dummy weights of a real architecture's shape (``--model llama-2-7b``, any preset of
``localgen.policy.presets``) or a real model (``--model PATH``, the embedded default with
``--model embedded``). For each batch size both engines generate ``gen_len`` tokens after a
``prompt_len`` prompt (greedy, EOS ignored). Reported per run:

* tokens/s = batch × gen_len / wall time of the whole generation (prefill included), the
  number Hugging Face users see;
* decode tokens/s = tokens produced by decode steps / decode time (localgen's metrics; for
  transformers ``batch × (gen_len - 1) / (T(gen_len) - T(1))`` from a second ``generate`` with one
  new token, whose time T(1) is its prefill);
* prefill tokens/s = batch × prompt_len / prefill time;
* llama.cpp through llama-cpp-python's low-level batch API on the same GGUF, where installed
  (CPU): one sequence id per prompt, greedy on the logits of each sequence's last token, flash
  attention on at batch 1 and off above (as the issue's anchors);
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
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from localgen.fileio import atomic_write_json


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
    prefill_tokens_per_s: float | None = None  # batch * prompt_len / prefill_seconds


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


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def run_hf_split(model, batch: int, prompt_len: int, gen_len: int, vocab: int, device,
                 repeat: int = 1) -> tuple[float, float, float | None]:
    """transformers ``generate`` timed whole and with one new token (its prefill): (wall seconds
    of the whole generation, prefill seconds T(1), decode tokens/s
    ``batch × (gen_len - 1) / (T(gen_len) - T(1))``; None when gen_len is 1). The first call
    warms up with the measured shapes; with ``repeat`` > 1 each time is the median of that many
    measurements."""
    run_hf(model, batch, prompt_len, gen_len, vocab, device)  # warm-up, same shapes
    t1s, walls = [], []
    for _ in range(repeat):
        t1s.append(run_hf(model, batch, prompt_len, 1, vocab, device))
        walls.append(run_hf(model, batch, prompt_len, gen_len, vocab, device))
    t1, wall = _median(t1s), _median(walls)
    dec = batch * (gen_len - 1) / (wall - t1) if gen_len > 1 and wall > t1 else None
    return wall, t1, dec


def run_llama_cpp(gguf_path: str, batch: int, prompt_len: int, gen_len: int, vocab: int,
                  threads: int, repeat: int = 1) -> tuple[float, float, float] | None:
    """llama.cpp (llama-cpp-python) on the same GGUF and the same prompt ids: (wall seconds,
    decode tokens/s, prefill seconds); None when llama-cpp-python is not installed. Flash
    attention on at batch 1 and off above, as the issue's anchors were measured."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return run_llama_cpp_batch(gguf_path, batch, prompt_len, gen_len, vocab, threads,
                               flash_attn=batch == 1, repeat=repeat)


def run_llama_cpp_batch(gguf_path: str, batch: int, prompt_len: int, gen_len: int, vocab: int,
                        threads: int, *, flash_attn: bool = False, n_batch: int = 2048,
                        out_tokens: list | None = None, prompt_ids: list[list[int]] | None = None,
                        repeat: int = 1) -> tuple[float, float, float]:
    """``batch`` sequences through llama.cpp at once with llama-cpp-python's low-level API: one
    context with ``n_seq_max = batch`` (a KV stream per sequence), the prompts packed into
    ``llama_batch``es of up to ``n_batch`` tokens with sequence ``i``'s tokens under seq id ``i``
    and logits requested for each prompt's last token only, then one token per sequence per
    decode call; greedy (argmax of each sequence's logits), EOS ignored, the same prompt ids as
    the other engines. Returns (wall seconds incl. prefill, decode tokens/s, prefill seconds);
    the first pass warms up, the next ``repeat`` are measured (medians). ``out_tokens``, when
    given, receives each sequence's generated ids; ``prompt_ids`` replaces the bench's prompts."""
    import llama_cpp as lc
    import numpy as np

    try:  # quiet, as Llama(verbose=False) is
        from llama_cpp._logger import set_verbose
        set_verbose(False)
    except ImportError:
        pass
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf_path).encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    cp = lc.llama_context_default_params()
    per_seq = -(-(prompt_len + gen_len + 8) // 256) * 256
    cp.n_ctx, cp.n_seq_max = batch * per_seq, batch
    cp.n_batch, cp.n_ubatch = n_batch, min(512, n_batch)
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                          else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.kv_unified = False  # no shared prefix: a stream per sequence
    cp.no_perf = True
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create a context")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    b = lc.llama_batch_init(n_batch, 0, 1)
    ids = prompt_ids if prompt_ids is not None else prompts(batch, prompt_len, vocab)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Submit (token, position, seq id, wants logits) entries; argmax per logits row."""
        b.n_tokens = len(entries)
        outs = []
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(out)
            b.seq_id[i][0] = seq
            if out:
                outs.append(i)
        rc = lc.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = (np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                for i in outs)
        return [int(r.argmax()) for r in rows]

    times = []
    try:
        for _ in range(1 + repeat):  # the first pass warms up
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            flat = [(tok, pos, s, pos == prompt_len - 1)
                    for s, p in enumerate(ids) for pos, tok in enumerate(p)]
            t0 = time.perf_counter()
            nxt = []
            for i in range(0, len(flat), n_batch):
                nxt += decode(flat[i:i + n_batch])
            t1 = time.perf_counter()
            steps = [nxt]
            for step in range(gen_len - 1):
                nxt = decode([(tok, prompt_len + step, s, True) for s, tok in enumerate(nxt)])
                steps.append(nxt)
            t2 = time.perf_counter()
            times.append((t0, t1, t2))
    finally:
        lc.llama_batch_free(b)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    if out_tokens is not None:
        out_tokens[:] = [list(seq) for seq in zip(*steps)]
    wall = _median([t2 - t0 for t0, _, t2 in times[1:]])
    pre = _median([t1 - t0 for t0, t1, _ in times[1:]])
    dec_s = _median([t2 - t1 for _, t1, t2 in times[1:]])
    dec = batch * (gen_len - 1) / dec_s if gen_len > 1 else float("nan")
    return wall, dec, pre


def load_models(spec: str, device: torch.device, dtype: torch.dtype, max_num_seqs: int,
                max_model_len: int, with_hf: bool):
    """(localgen LLM, transformers model or None) on the same (dummy or real) weights."""
    llm, make_hf = load_localgen(spec, device, dtype, max_num_seqs, max_model_len)
    return llm, (make_hf() if with_hf else None)


def load_localgen(spec: str, device: torch.device, dtype: torch.dtype, max_num_seqs: int,
                  max_model_len: int, prefill_graphs: bool = True):
    """(localgen LLM, a function that builds the transformers peer on the same weights);
    ``prefill_graphs``: ``EngineConfig.prefill_graphs``."""
    from localgen.api import LLM
    from localgen.runtime.engine import EngineConfig

    # a cache just big enough for the largest batch, so the transformers peer fits beside it
    ecfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        max_num_batched_tokens=max(8192, max_model_len),
                        prefill_graphs=prefill_graphs)
    if spec.lower() in {"embedded", "default"} or "/" in spec or spec.endswith(".gguf"):
        llm = LLM.load(None if spec.lower() in {"embedded", "default"} else spec, device=str(device),
                       dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       kv_cache_memory=_kv_budget(None, max_num_seqs, max_model_len, dtype, spec),
                       prefill_graphs=prefill_graphs)
        return llm, lambda: _hf_from_source(llm, device, dtype)
    from localgen.models.dummy import DummyStore
    from localgen.models.model import family_of
    from localgen.policy.presets import preset_config

    cfg = preset_config(spec)
    ecfg.kv_cache_memory = _kv_budget(cfg, max_num_seqs, max_model_len, dtype, spec)
    store = DummyStore(cfg, family_of(cfg), dtype=dtype)
    llm = LLM.from_parts(cfg, store, None, ecfg, device=str(device), dtype=dtype, name=spec)
    return llm, lambda: _hf_dummy(cfg, device, dtype)


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


def llama_cpp_tool_runs(gguf: str, batches: list[int], prompt_len: int, gen_len: int,
                        roofs: dict[int, float], *, gpu: bool, where, repeat: int, log
                        ) -> list[DecodeRun]:
    """The llama.cpp peer through its own tools (``llama_cpp_peer``) as DecodeRuns; [] with a
    line in the log when the tools are not there or fail."""
    from localgen.bench import llama_cpp_peer

    try:
        peer = llama_cpp_peer.run_peer(gguf, batches, prompt_len, gen_len, threads=torch.get_num_threads(),
                                       gpu=gpu, where=where, repeat=max(repeat, 3))
    except llama_cpp_peer.PeerError as e:
        log(f"llama.cpp peer skipped: {e}")
        return []
    runs = []
    for p in peer:
        pre = p.batch * prompt_len / p.prefill_tokens_per_s
        wall = pre + p.batch * gen_len / p.decode_tokens_per_s
        runs.append(DecodeRun("llama.cpp", p.batch, prompt_len, gen_len, wall, p.batch * gen_len / wall,
                              p.decode_tokens_per_s, roofs[p.batch],
                              p.decode_tokens_per_s / roofs[p.batch], pre, None, p.prefill_tokens_per_s))
        if p.weight_bytes:
            log(f"llama.cpp weights (llama-bench model size): {p.weight_bytes / 1e9:.2f} GB")
    return runs


def bench(spec: str, batches: list[int], prompt_len: int, gen_len: int, *, device: str | None,
          dtype: str, with_hf: bool = True, log=print, repeat: int = 1,
          llama_cpp_bin: str | None = None, prefill_graphs: bool = True) -> dict:
    """Every engine, every batch size; with ``repeat`` > 1 each engine's times are medians of
    that many measured runs (localgen's later runs use other prompts of the same length, so the
    prefix cache serves none of them). On a GGUF the llama.cpp peer runs through its own tools
    (``llama-bench``, ``llama-batched-bench``) when ``llama_cpp_bin`` or ``$LLAMA_CPP_BIN``
    finds them, on this device (all layers on the GPU there); else through llama-cpp-python on
    the CPU where it is installed. ``prefill_graphs``: ``EngineConfig.prefill_graphs``."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}[dtype]
    llm, make_hf = load_localgen(spec, dev, dt, max(batches), prompt_len + gen_len + 16,
                                 prefill_graphs)
    bw = copy_bandwidth(dev)
    wbytes = llm.engine.model.weight_bytes()
    kv_tok = llm.config.kv_bytes_per_token(torch.tensor([], dtype=dt).element_size())
    log(f"{spec} on {dev} ({dt}): resident weights {wbytes / 1e9:.3f} GB, copy bandwidth {bw / 1e9:.0f} GB/s")
    roofs = {b: roofline(wbytes, kv_tok, b, prompt_len, gen_len, bw) for b in batches}
    runs: list[DecodeRun] = []
    # one engine at a time, each measured before the next is loaded (a second model resident in
    # the process competes for caches and memory and slows the measured engine's steps)
    for b in batches:
        # warm-up with the measured shapes: compiles kernels, captures this run's graph buckets
        # (other prompts than the measured ones: no prefix-cache hits in the measurement)
        run_localgen(llm, b, prompt_len, gen_len, seed=1)
        meas = []
        for i in range(repeat):
            wall, dec = run_localgen(llm, b, prompt_len, gen_len, seed=0 if i == 0 else 100 + i)
            meas.append((wall, dec, run_localgen.last_prefill_s))
        wall, dec, pre = (_median([m[j] for m in meas]) for j in range(3))
        runs.append(DecodeRun("localgen", b, prompt_len, gen_len, wall, b * gen_len / wall, dec,
                              roofs[b], dec / roofs[b], pre, graph_replay_ms(llm),
                              b * prompt_len / pre if pre else None))
    if with_hf:
        hf = make_hf()
        for b in batches:
            wall_hf, pre_hf, dec_hf = run_hf_split(hf, b, prompt_len, gen_len,
                                                   llm.config.vocab_size, dev, repeat)
            tps = b * gen_len / wall_hf
            runs.append(DecodeRun("transformers", b, prompt_len, gen_len, wall_hf, tps, dec_hf,
                                  roofs[b], (dec_hf or tps) / roofs[b], pre_hf, None,
                                  b * prompt_len / pre_hf))
        del hf
        gc.collect()
    gguf = getattr(getattr(llm, "source", None), "path", None)
    is_gguf = gguf is not None and str(gguf).endswith(".gguf")
    tools = is_gguf and llama_cpp_peer_tools(llama_cpp_bin)
    if tools:
        runs += llama_cpp_tool_runs(str(gguf), batches, prompt_len, gen_len, roofs,
                                    gpu=dev.type == "cuda", where=llama_cpp_bin, repeat=repeat, log=log)
    elif with_hf and dev.type == "cpu" and is_gguf:
        for b in batches:
            lc = run_llama_cpp(str(gguf), b, prompt_len, gen_len, llm.config.vocab_size,
                               torch.get_num_threads(), repeat)
            if lc is not None:
                wall_lc, dec_lc, pre_lc = lc
                runs.append(DecodeRun("llama.cpp", b, prompt_len, gen_len, wall_lc,
                                      b * gen_len / wall_lc, dec_lc, roofs[b], dec_lc / roofs[b],
                                      pre_lc, None, b * prompt_len / pre_lc))
    order = {"localgen": 0, "transformers": 1, "llama.cpp": 2}
    runs.sort(key=lambda r: (r.batch, order[r.engine]))
    ratios = peer_ratios(runs)
    table = format_table(runs) + "".join("\n" + line for line in format_ratios(ratios))
    log(table)
    # the file's name, not this machine's path: results are kept beside the docs
    return {"model": Path(spec).name, "device": str(dev), "dtype": str(dt), "copy_bandwidth": bw,
            "weight_bytes": wbytes, "threads": torch.get_num_threads(), "repeat": repeat,
            "prefill_graphs": prefill_graphs, "runs": [asdict(r) for r in runs], "ratios": ratios, "table": table}


def llama_cpp_peer_tools(where: str | None) -> bool:
    """Whether llama.cpp's llama-bench is at ``where``, ``$LLAMA_CPP_BIN`` or on PATH."""
    from localgen.bench.llama_cpp_peer import find_tool

    return find_tool("llama-bench", where) is not None


def peer_ratios(runs: list[DecodeRun]) -> dict[str, dict[str, dict[str, float | None]]]:
    """localgen ÷ each peer per batch size measured by both: ``decode`` (decode tokens/s),
    ``prefill`` (prefill tokens/s) and ``throughput`` (tokens/s of the whole generation, prefill
    included) — the ratios issue 7 names (batch-1 decode, prefill, batch-16 throughput)."""
    ours = {r.batch: r for r in runs if r.engine == "localgen"}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for r in runs:
        o = ours.get(r.batch)
        if r.engine == "localgen" or o is None:
            continue
        div = lambda a, b: a / b if a and b else None  # noqa: E731
        out.setdefault(r.engine, {})[str(r.batch)] = {
            "decode": div(o.decode_tokens_per_s, r.decode_tokens_per_s),
            "prefill": div(o.prefill_tokens_per_s, r.prefill_tokens_per_s),
            "throughput": div(o.tokens_per_s, r.tokens_per_s)}
    return out


def format_ratios(ratios: dict) -> list[str]:
    f = lambda x: f"{x:.2f}x" if x is not None else "-"  # noqa: E731
    return [f"localgen / {peer} at batch {b}: decode {f(r['decode'])}, prefill {f(r['prefill'])}, "
            f"throughput incl. prefill {f(r['throughput'])}"
            for peer, per_batch in ratios.items() for b, r in per_batch.items()]


def format_table(runs: list[DecodeRun]) -> str:
    lines = [f"{'engine':13s} {'batch':>5s} {'prompt':>6s} {'gen':>4s} {'tok/s':>9s} "
             f"{'decode tok/s':>12s} {'roofline':>9s} {'%roof':>6s} {'vs HF':>7s} {'prefill s':>9s}"
             f" {'prefill tok/s':>13s} {'graph ms':>8s}"]
    hf = {r.batch: r for r in runs if r.engine == "transformers"}
    for r in runs:
        ratio = r.tokens_per_s / hf[r.batch].tokens_per_s if r.batch in hf else float("nan")
        dec = f"{r.decode_tokens_per_s:12.1f}" if r.decode_tokens_per_s else f"{'-':>12s}"
        lines.append(f"{r.engine:13s} {r.batch:5d} {r.prompt_len:6d} {r.gen_len:4d} "
                     f"{r.tokens_per_s:9.1f} {dec} {r.roofline_tokens_per_s:9.1f} "
                     f"{100 * r.fraction_of_roofline:5.1f}% {ratio:6.2f}x "
                     f"{r.prefill_seconds if r.prefill_seconds is not None else float('nan'):9.3f}"
                     f" {r.prefill_tokens_per_s or float('nan'):13.1f}"
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
    ap.add_argument("--repeat", type=int, default=1,
                    help="measured runs per engine and batch size (medians reported)")
    ap.add_argument("--llama-cpp-bin", default=None,
                    help="folder of llama.cpp's llama-bench / llama-batched-bench (default: $LLAMA_CPP_BIN, PATH)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch and llama.cpp (default: torch's)")
    ap.add_argument("--no-prefill-graphs", action="store_true",
                    help="prefill one prompt eagerly on CUDA instead of replaying its graph")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    res = bench(a.model, [int(x) for x in a.batches.split(",")], a.prompt_len, a.gen_len,
                device=a.device, dtype=a.dtype, with_hf=not a.no_hf, repeat=a.repeat,
                llama_cpp_bin=a.llama_cpp_bin, prefill_graphs=not a.no_prefill_graphs)
    if a.out:
        atomic_write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
