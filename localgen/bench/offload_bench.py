"""`localgen bench offload`: run a model under a Policy and print measured vs predicted prefill and
decode time, with FlexGen's ctog / gtoc / dtoc / ctod / compute breakdown (§4.3), optionally beside
Hugging Face accelerate offloading (``device_map`` with the same ``max_memory``) in the same run.

Runnable without the CLI's dependencies (typer, rich, psutil, gguf) as
``python -m localgen.bench.offload_bench --preset llama-2-7b --dummy --gpu-memory 6GiB ...``:
dummy weights of a preset's real shapes (a shared random fp16 buffer, sliced per tensor), random
prompt ids, greedy decoding with EOS ignored. Throughput is FlexGen's: generated tokens / (prefill +
decode wall time). The measured breakdown comes from a second, short timed run in which every
transfer and compute section is synchronized and timed alone (no overlap); it is reported per
layer per step like the cost model's terms.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import types
from dataclasses import asdict, dataclass, field

import torch

from localgen.fileio import atomic_write_json
from localgen.models.dummy import DummyStore

if "psutil" not in sys.modules:  # the GPU machines lack psutil; the engine only needs RAM size
    try:
        import psutil  # noqa: F401
    except ImportError:
        import os

        _mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        sys.modules["psutil"] = types.SimpleNamespace(virtual_memory=lambda: types.SimpleNamespace(
            total=_mem, available=_mem // 2))

GiB = 1 << 30


def parse_size(s: str | int | None) -> int | None:
    if s is None or isinstance(s, int):
        return s
    units = {"gib": GiB, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "kib": 1024, "b": 1}
    t = s.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(float(t))


@dataclass
class RunResult:
    name: str
    batch: int
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    decode_tokens_per_s: float
    policy: str = ""
    memory_gib: dict = field(default_factory=dict)
    measured_terms: dict = field(default_factory=dict)  # phase -> term -> seconds per layer (per step)
    wall_tokens_per_s: float = 0.0  # generated tokens / wall time incl. the engine between steps
    repeats: list = field(default_factory=list)  # localgen: [prefill s, decode s, wall s] per repeat
    graphs: dict = field(default_factory=dict)  # localgen: CUDA graphs held at the end, zig-zag blocks a prefill graph served
    predicted: dict = field(default_factory=dict)
    error: str = ""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_cuda_memory() -> None:
    """Return a finished run's GPU memory and restart the peak count for the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def add_random_requests(llm, batch: int, prompt_len: int, gen_len: int, seed: int = 0) -> None:
    """``batch`` greedy requests of random prompt ids, EOS ignored (``gen_len`` tokens each)."""
    from localgen.runtime.offload import timed_run

    timed_run.add_random_requests(llm.engine, batch, prompt_len, gen_len, seed)


def generate_random(llm, batch: int, prompt_len: int, gen_len: int, seed: int = 0):
    """``add_random_requests`` run to completion -> (prefill seconds, decode seconds): the
    engine's model steps (runner and sampling), FlexGen's measure."""
    return generate_random_timed(llm, batch, prompt_len, gen_len, seed)[:2]


def generate_random_timed(llm, batch: int, prompt_len: int, gen_len: int, seed: int = 0):
    """``generate_random`` -> (prefill s, decode s, wall s) (``timed_run.timed_generation``)."""
    from localgen.runtime.offload import timed_run

    return timed_run.timed_generation(llm.engine, batch, prompt_len, gen_len, seed)


def policy_llm(cfg, policy, batch: int, prompt_len: int, gen_len: int, *, store=None,
               device="cuda", dtype=torch.float16, gpu_memory=None, offload_dir=None,
               block_size: int = 16, prefill_graphs: bool = True, name: str = "bench"):
    """An ``LLM`` over ``timed_run.build_engine``'s engine: ``policy`` over ``store`` (default:
    dummy weights of ``cfg``'s shapes), its KV cache sized for ``batch`` prompts of
    ``prompt_len`` + ``gen_len`` tokens. What the bench and the diagnostic scripts run."""
    from localgen.api import LLM
    from localgen.runtime.offload import timed_run

    engine = timed_run.build_engine(cfg, policy, batch, prompt_len, gen_len, store=store,
                                    device=device, dtype=dtype, gpu_memory=gpu_memory,
                                    offload_dir=offload_dir, block_size=block_size,
                                    prefill_graphs=prefill_graphs)
    return LLM(engine, name, None, policy)


def run_localgen(cfg, store, policy, batch: int, prompt_len: int, gen_len: int, *, device="cuda",
                 dtype=torch.float16, gpu_memory=None, offload_dir=None, timed_steps: int = 3,
                 hw=None, block_size: int = 16, repeats: int = 1, prefill_graphs: bool = True) -> RunResult:
    """Generate ``gen_len`` tokens for ``batch`` random prompts under ``policy``, ``repeats``
    times (the result is the repeat of median throughput; all are kept in ``repeats``); then a
    short timed run (``timed_steps`` tokens) for the per-term breakdown; plus the cost model's
    prediction. ``prefill_graphs``: ``EngineConfig.prefill_graphs``."""
    t0 = time.perf_counter()
    llm = policy_llm(cfg, policy, batch, prompt_len, gen_len, store=store, device=device,
                     dtype=dtype, gpu_memory=gpu_memory, offload_dir=offload_dir,
                     block_size=block_size, prefill_graphs=prefill_graphs)
    _log(f"  built in {time.perf_counter() - t0:.1f} s; {policy.describe()}")
    if getattr(llm.engine.runner, "graphs", None) is not None:  # capture the measured shapes' graphs
        for _ in range(2):  # a prefill graph is captured at its shape's second sighting
            generate_random(llm, batch, prompt_len, 2, seed=1)
    else:
        # warm up at the measured prompt length: shorter prompts would leave the first use of the
        # large-M paths (int4 dequantize + cuBLAS, the prefill attention, the allocator's growth)
        # inside the timed prefill
        generate_random(llm, min(batch, policy.bls), prompt_len, 2, seed=1)
    _log("  warmed up")
    runs = []
    for i in range(max(1, repeats)):
        runs.append(generate_random_timed(llm, batch, prompt_len, gen_len, seed=0 if i == 0 else 100 + i))
        _log(f"  generated: prefill {runs[-1][0]:.3f} s, decode {runs[-1][1]:.3f} s, wall {runs[-1][2]:.3f} s")
    pre, dec, wall = sorted(runs, key=lambda r: r[0] + r[1])[len(runs) // 2]
    res = RunResult("localgen", batch, pre, dec, batch * gen_len / (pre + dec),
                    batch * (gen_len - 1) / dec if dec else 0.0, policy.describe(),
                    wall_tokens_per_s=batch * gen_len / wall, repeats=[list(r) for r in runs])
    res.memory_gib = {k: round(v / GiB, 3) for k, v in llm.memory_by_tier().items()}
    runner = llm.engine.runner
    res.graphs = {name: len(g.graphs) for name, g in (("decode", getattr(runner, "graphs", None)),
                                                      ("prefill", getattr(runner, "prefill_graphs", None)))
                  if g is not None}
    if "prefill" in res.graphs:
        served = runner.prefill_graphs.served  # zig-zag blocks; the older key stays for readers
        res.graphs["prefill_zigzag_blocks_served"] = res.graphs["prefill_blocks_served"] = served
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        res.memory_gib["cuda_max_allocated"] = round(torch.cuda.max_memory_allocated() / GiB, 3)
    timers = llm.engine.model.timers
    if timed_steps:
        timers.reset()
        timers.enabled = True
        generate_random(llm, batch, prompt_len, timed_steps + 1, seed=2)
        timers.enabled = False
        L = cfg.num_layers
        res.measured_terms = {
            "prefill": {k: v / L for k, v in timers.terms("prefill").items()},
            "decode": {k: v / L / timed_steps for k, v in timers.terms("decode").items()},
        }
    if hw is not None:
        from localgen.policy.cost_model import CostModel, Workload

        pred = CostModel(cfg, hw, Workload(prompt_len, gen_len), runtime="localgen").predict(policy)
        res.predicted = {"prefill_s": pred.prefill_time, "decode_s": pred.decode_time,
                         "tokens_per_s": pred.throughput, "prefill_terms": pred.prefill_terms,
                         "decode_terms": pred.decode_terms,
                         "peak_gib": {k: round(v / GiB, 3) for k, v in pred.peak_mem.items()},
                         "profile": hw.name}
    llm.engine.model.layers.close()
    del llm
    _free_cuda_memory()
    return res


def accelerate_weight_budget(cfg, batch: int, prompt_len: int, gen_len: int, cap: int,
                             dtype_bytes: int = 2) -> int:
    """GPU bytes accelerate's weights may take (its ``max_memory``) when its whole run must stay
    within ``cap`` bytes: the cap less its KV cache (transformers' cache keeps every layer's K/V on
    the GPU, fp16, prompt + generated tokens), less the prefill's largest activations (hidden
    states and the MLP's intermediate of ``batch`` prompts, ``4h + 2f`` values a token), less
    1 GiB for the allocator, logits and the attention's temporaries. Negative when even no
    weights would leave room."""
    cache = batch * (prompt_len + gen_len) * cfg.kv_bytes_per_token(dtype_bytes)
    acts = batch * prompt_len * (4 * cfg.hidden_size + 2 * cfg.intermediate_size) * dtype_bytes
    return cap - cache - acts - GiB


def accelerate_fit_batch(cfg, prompt_len: int, gen_len: int, cap: int, dtype_bytes: int = 2) -> int:
    """The largest batch accelerate runs within ``cap``: its weight budget
    (``accelerate_weight_budget``) still holds the embeddings (so that the model executes on the
    GPU) plus the one offloaded layer that ``infer_auto_device_map`` reserves room for. 0 if none."""
    need = (cfg.global_parameters() + cfg.layer_parameters()) * dtype_bytes
    b = 0
    while accelerate_weight_budget(cfg, b + 1, prompt_len, gen_len, cap, dtype_bytes) >= need:
        b += 1
    return b


def run_accelerate(hf_config: dict, batch: int, prompt_len: int, gen_len: int, gpu_memory: int,
                   cpu_memory: int = 200 * GiB, dtype=torch.float16, fit: bool = False) -> RunResult:
    """Hugging Face accelerate offloading: ``device_map`` from ``max_memory={0: gpu_memory, "cpu": ...}``
    (layers that do not fit stay on the CPU and move to the GPU on each forward), dummy weights.
    ``fit``: a GPU of ``gpu_memory`` bytes, as localgen's runs get: the allocator is capped there
    and ``max_memory`` leaves room for accelerate's cache and activations
    (``accelerate_weight_budget``); otherwise, like the issue's anchor, only its weights are
    limited (the cache and activations come on top)."""
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    total = torch.cuda.get_device_properties(0).total_memory
    # a localgen run in this process may have set a cap: set this run's own
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_memory / total) if fit else 1.0)
    weight_memory = gpu_memory
    if fit:
        from localgen.models.config import ModelConfig

        weight_memory = accelerate_weight_budget(ModelConfig.from_hf_dict(hf_config), batch, prompt_len,
                                                 gen_len, gpu_memory)
        if weight_memory <= 0:
            raise ValueError(f"accelerate's cache and activations at batch {batch} exceed the "
                             f"{gpu_memory / GiB:.1f} GiB GPU")

    cfg = AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(max(p.numel() for p in model.parameters()), generator=g) * 0.02).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else big[:p.numel()].view(p.shape))
    model.tie_weights()
    model.eval()
    # the rotary inv_freq buffer was on meta; recompute it
    for mod in model.modules():
        if hasattr(mod, "inv_freq") and hasattr(mod, "rope_init_fn"):
            inv, _ = mod.rope_init_fn(mod.config, torch.device("cpu"))
            mod.inv_freq = inv
            if hasattr(mod, "original_inv_freq"):
                mod.original_inv_freq = inv
    dmap = infer_auto_device_map(model, max_memory={0: weight_memory, "cpu": cpu_memory},
                                 no_split_module_classes=model._no_split_modules, dtype=dtype)
    model = dispatch_model(model, device_map=dmap)
    ids = torch.randint(10, cfg.vocab_size - 10, (batch, prompt_len), generator=g).to("cuda")
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm up
        _sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        _sync()
        pre = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False)
        _sync()
        total = time.perf_counter() - t0
    assert out.shape[1] == prompt_len + gen_len
    on_gpu = sum(1 for v in dmap.values() if v == 0)
    res = RunResult("accelerate", batch, pre, total - pre, batch * gen_len / total,
                    batch * (gen_len - 1) / max(total - pre, 1e-9),
                    f"device_map: {on_gpu}/{len(dmap)} modules on GPU, max_memory GPU {weight_memory / GiB:.1f} GiB"
                    + (f", allocator capped at {gpu_memory / GiB:.1f} GiB" if fit else ""))
    res.memory_gib = {"cuda_max_allocated": round(torch.cuda.max_memory_allocated() / GiB, 3)}
    del model
    _free_cuda_memory()
    return res


def policy_from_args(s: str):
    """``"gbs,ngb,wg,wc,cg,cc,hg,hc[,w4][,kv4][,cpuattn]"`` (fractions in percent)."""
    from localgen.policy.policy import Policy

    parts = s.split(",")
    nums = [float(x) for x in parts[:8]]
    flags = set(parts[8:])
    gbs, ngb = int(nums[0]), int(nums[1])
    wg, wc, cg, cc, hg, hc = (x / 100 for x in nums[2:8])
    return Policy(gbs=gbs, num_gpu_batches=ngb, wg=wg, wc=wc, wd=max(0.0, 1 - wg - wc), cg=cg, cc=cc,
                  cd=max(0.0, 1 - cg - cc), hg=hg, hc=hc, hd=max(0.0, 1 - hg - hc),
                  compress_weight="w4" in flags, compress_cache="kv4" in flags,
                  cpu_cache_compute="cpuattn" in flags).validate()


def policy_to_args(p) -> str:
    """The ``policy_from_args`` form of Policy ``p`` (fractions in percent)."""
    pct = ",".join(f"{v * 100:.6g}" for v in (p.wg, p.wc, p.cg, p.cc, p.hg, p.hc))
    flags = [f for f, on in (("w4", p.compress_weight), ("kv4", p.compress_cache),
                             ("cpuattn", p.cpu_cache_compute)) if on]
    return ",".join([f"{p.gbs},{p.num_gpu_batches},{pct}"] + flags)


def print_result(r: RunResult, out=print) -> None:
    out(f"{r.name:10s} batch {r.batch:4d}: {r.tokens_per_s:9.2f} tokens/s (decode {r.decode_tokens_per_s:.2f}); "
        f"prefill {r.prefill_s:.2f} s, decode {r.decode_s:.2f} s  [{r.policy}]" + (f" ERROR {r.error}" if r.error else ""))
    if r.wall_tokens_per_s:
        out(f"{'':10s} end to end (engine between steps included): {r.wall_tokens_per_s:.2f} tokens/s"
            + (f"; median of {len(r.repeats)} repeats" if len(r.repeats) > 1 else ""))
    if r.predicted:
        p = r.predicted
        out(f"{'':10s} predicted ({p['profile']}): {p['tokens_per_s']:.2f} tokens/s; prefill {p['prefill_s']:.2f} s, "
            f"decode {p['decode_s']:.2f} s; peak GiB {p['peak_gib']}")
    if r.measured_terms:
        for ph in ("prefill", "decode"):
            m = r.measured_terms[ph]
            pt = r.predicted.get(f"{ph}_terms", {}) if r.predicted else {}
            cells = "  ".join(f"{t} {m[t] * 1e3:.2f}" + (f"/{pt.get('comp' if t == 'compute' else t, 0) * 1e3:.2f}" if pt else "")
                              for t in ("ctog", "gtoc", "dtoc", "ctod", "compute"))
            out(f"{'':10s} {ph} ms/layer measured{'/predicted' if pt else ''}: {cells}")
    if r.memory_gib:
        out(f"{'':10s} memory GiB: {r.memory_gib}" + (f"; CUDA graphs {r.graphs}" if r.graphs else ""))


def peer_ratios(results: list[RunResult], cap: int | None) -> list[str]:
    """One line per localgen run: its throughput over accelerate's best batch in the same run,
    and over accelerate's best among the batches whose peak allocated GPU memory stayed within
    the cap (``max_memory`` places only accelerate's weights; its cache and activations come on
    top, so on a GPU of the cap's size the larger batches would not run)."""
    peers = [r for r in results if r.name == "accelerate" and not r.error]
    fits = [r for r in peers if cap is not None
            and r.memory_gib.get("cuda_max_allocated", float("inf")) * GiB <= cap]
    lines = []
    for r in results:
        if r.name != "localgen" or r.error or not peers:
            continue
        best = max(peers, key=lambda p: p.tokens_per_s)
        line = (f"localgen batch {r.batch} / accelerate's best (batch {best.batch}, "
                f"{best.tokens_per_s:.2f} tok/s): {r.tokens_per_s / best.tokens_per_s:.1f}x")
        if fits:
            fit = max(fits, key=lambda p: p.tokens_per_s)
            line += (f"; / its best within the {cap / GiB:.1f} GiB cap (batch {fit.batch}, "
                     f"{fit.tokens_per_s:.2f} tok/s): {r.tokens_per_s / fit.tokens_per_s:.1f}x")
        elif cap is not None:
            line += f"; no accelerate batch stayed within the {cap / GiB:.1f} GiB cap"
        lines.append(line)
    return lines


def _peer_batches(a, cfg=None, gpu_mem=None) -> list[int]:
    """``--peer-batches`` as batch sizes; ``fit`` among them: ``accelerate_fit_batch`` for the cap."""
    out = []
    for x in a.peer_batches.split(","):
        if x == "fit":
            if cfg is None or gpu_mem is None:
                raise ValueError("--peer-batches fit needs a preset and a GPU memory cap")
            x = accelerate_fit_batch(cfg, a.prompt_len, a.gen_len, gpu_mem)
        if x:
            out.append(int(x))
    return out


def _run_here(a, cfg, hw, gpu_mem, hf_config, peer_batches: list[int]) -> list[RunResult]:
    """Every policy, then every accelerate batch, in this process."""
    from localgen.models.model import family_of

    store = DummyStore(cfg, family_of(cfg))
    results = []
    for spec in a.policy:
        pol = policy_from_args(spec)
        try:
            r = run_localgen(cfg, store, pol, pol.bls, a.prompt_len, a.gen_len, device=a.device,
                             gpu_memory=gpu_mem, offload_dir=a.offload_dir, timed_steps=a.timed_steps, hw=hw,
                             repeats=a.repeats, prefill_graphs=a.prefill_graphs)
        except Exception as e:  # report and go on: the peer still runs
            peak = (f"; peak allocated {torch.cuda.max_memory_allocated() / GiB:.3f} GiB"
                    if torch.cuda.is_available() else "")
            r = RunResult("localgen", pol.bls, 0, 0, 0, 0, pol.describe(), error=repr(e)[:300] + peak)
            _free_cuda_memory()
        print_result(r)
        sys.stdout.flush()
        results.append(r)
    for b in peer_batches:
        try:
            r = run_accelerate(hf_config, b, a.prompt_len, a.gen_len, gpu_mem, fit=a.peer_fit)
        except Exception as e:
            r = RunResult("accelerate", b, 0, 0, 0, 0, error=repr(e)[:300])
        print_result(r)
        sys.stdout.flush()
        results.append(r)
    return results


def _run_isolated(a, argv, peer_batches: list[int]) -> list[RunResult]:
    """Each policy and each accelerate batch in a fresh process of this module (same machine,
    same invocation): a run inherits nothing from the one before it (pinned host memory, the
    allocator's cache and cap, a host heap grown by an offloaded run), as each would start on
    its own. A child that writes no result becomes an error row."""
    import subprocess
    import tempfile

    base = list(sys.argv[1:] if argv is None else argv)
    keep, skip = [], {"--policy", "--peer-batches", "--out"}
    it = iter(base)
    for x in it:
        if x in skip:
            next(it, None)
        elif not (x.startswith("--policy=") or x.startswith("--peer-batches=") or x.startswith("--out=")
                  or x in ("--isolate", "--no-isolate")):
            keep.append(x)
    jobs = [["--policy", p, "--peer-batches", ""] for p in a.policy]
    jobs += [["--peer-batches", str(b)] for b in peer_batches]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, job in enumerate(jobs):
            out = f"{tmp}/{i}.json"
            cmd = [sys.executable, "-m", "localgen.bench.offload_bench", *keep, *job, "--no-isolate", "--out", out]
            rc = subprocess.run(cmd).returncode
            try:
                with open(out) as f:
                    results += [RunResult(**d) for d in json.load(f)]
            except (OSError, ValueError) as e:
                err = f"subprocess exit {rc}: {e!r}"[:300]
                r = (RunResult("localgen", policy_from_args(job[1]).bls, 0, 0, 0, 0, job[1], error=err)
                     if job[0] == "--policy" else RunResult("accelerate", int(job[1]), 0, 0, 0, 0, error=err))
                print_result(r)
                results.append(r)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-2-7b", help="shape preset (localgen.policy.presets)")
    ap.add_argument("--policy", action="append", default=[],
                    help="gbs,ngb,wg,wc,cg,cc,hg,hc[,w4][,kv4][,cpuattn]; repeat for several (none: peers only)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gpu-memory", default="6GiB", help="GPU memory cap ('none': the whole GPU)")
    ap.add_argument("--peer-batches", default="1,8",
                    help="batch sizes for accelerate ('' = none; 'fit': the largest that --peer-fit allows)")
    ap.add_argument("--peer-fit", action="store_true",
                    help="accelerate within the GPU cap, as localgen: allocator capped, max_memory less its cache")
    ap.add_argument("--profile", default=None, help="HardwareProfile name/path for predictions")
    ap.add_argument("--offload-dir", default="/tmp/localgen_offload")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timed-steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1,
                    help="localgen generations per policy; the median-throughput one is reported")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each policy and peer batch in its own process (default: on CUDA with several)")
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="replay all-GPU 4-bit prefill zig-zag blocks as CUDA graphs (EngineConfig.prefill_graphs)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from localgen.policy.presets import HF_CONFIGS, preset_config

    cfg = preset_config(a.preset)
    hw = None
    if a.profile:
        from localgen.profiler.hardware import load_profile
        hw = load_profile(a.profile)
    gpu_mem = None if a.gpu_memory.lower() == "none" else parse_size(a.gpu_memory)
    if torch.cuda.is_available():
        if gpu_mem is None:
            gpu_mem = torch.cuda.get_device_properties(0).total_memory
        print(f"device: {torch.cuda.get_device_name()}, cap {gpu_mem / GiB:.1f} GiB", flush=True)
    if hw is not None and gpu_mem is not None:  # predict for the capped GPU the run emulates
        import dataclasses
        hw = dataclasses.replace(hw, gpu_mem=min(hw.gpu_mem, gpu_mem))
    peer_batches = _peer_batches(a, cfg, gpu_mem)
    if a.isolate is None:
        a.isolate = torch.cuda.is_available() and len(a.policy) + len(peer_batches) > 1
    results = (_run_isolated(a, argv, peer_batches) if a.isolate
               else _run_here(a, cfg, hw, gpu_mem, HF_CONFIGS.get(a.preset), peer_batches))
    for line in peer_ratios(results, gpu_mem):
        print(line)
    if a.out:
        atomic_write_json(a.out, [asdict(r) for r in results])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
