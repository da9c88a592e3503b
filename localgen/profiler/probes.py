"""Measurements behind a HardwareProfile (the hardware constants of FlexGen App. A.3).

Every probe times a warm-up run and then reports the best of ``repeats`` runs (the minimum time),
because interference from other processes only ever makes a run slower. Bandwidths are bytes/s,
compute FLOP/s, capacities bytes. Torch is imported inside the functions (``localgen --help`` stays
fast). GPU probes need CUDA; on a CPU-only machine ``run_profile`` measures the CPU as the compute
device and leaves the GPU fields empty.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import mmap
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from localgen.profiler.hardware import HardwareProfile

MiB = 1 << 20
_ALIGN = 4096  # O_DIRECT needs block-aligned buffers, offsets and sizes


@dataclass(frozen=True)
class ProbeSizes:
    """Problem sizes; ``quick`` ones keep a CPU-only test run to a few seconds."""

    link_bytes: tuple[int, ...] = (1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
    disk_bytes: int = 256 * MiB
    mem_bytes: int = 256 * MiB
    mm_prefill: tuple[int, int, int] = (2048, 4096, 4096)  # (m, k, n): m = tokens
    mm_decode: tuple[int, int, int] = (16, 4096, 4096)
    bmm_prefill: tuple[int, int, int, int] = (32, 512, 128, 512)  # (batch*heads, m, k, n)
    bmm_decode: tuple[int, int, int, int] = (256, 1, 128, 1024)
    attn_decode: tuple[int, int, int, int] = (16, 32, 128, 544)  # (seqs, kv heads, head_dim, context)
    repeats: int = 5


QUICK = ProbeSizes(link_bytes=(1 * MiB, 8 * MiB), disk_bytes=16 * MiB, mem_bytes=32 * MiB,
                   mm_prefill=(256, 512, 512), mm_decode=(8, 512, 512),
                   bmm_prefill=(8, 128, 64, 128), bmm_decode=(32, 1, 64, 256),
                   attn_decode=(2, 2, 64, 64), repeats=3)
CPU_DEFAULT = ProbeSizes(link_bytes=(), disk_bytes=128 * MiB, mem_bytes=128 * MiB,
                         mm_prefill=(512, 1024, 1024), mm_decode=(8, 2048, 2048),
                         bmm_prefill=(16, 256, 64, 256), bmm_decode=(64, 1, 64, 1024),
                         attn_decode=(8, 8, 64, 544), repeats=3)


def best_time(fn: Callable[[], object], repeats: int = 5, sync: Callable[[], None] | None = None) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    if sync:
        sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _cuda_sync():
    import torch

    return torch.cuda.synchronize


def probe_link_bdw(direction: str, pinned: bool, sizes=ProbeSizes.link_bytes, repeats: int = 5) -> float:
    """Host<->GPU copy bandwidth (bytes/s), the best over ``sizes``.

    ``direction`` "ctog" (host to device) or "gtoc"; ``pinned`` page-locked host memory (else pageable).
    Raises RuntimeError without CUDA.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("probe_link_bdw needs a CUDA GPU")
    best = 0.0
    for size in sizes:
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        src, dst = (host, dev) if direction == "ctog" else (dev, host)
        t = best_time(lambda: dst.copy_(src, non_blocking=pinned), repeats, _cuda_sync())
        best = max(best, size / t)
    return best


def probe_mem_bdw(device: str = "cpu", nbytes: int = ProbeSizes.mem_bytes, repeats: int = 5) -> float:
    """Device-memory copy bandwidth: bytes read + written per second by ``dst.copy_(src)``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = _cuda_sync() if device.startswith("cuda") else None
    return 2 * nbytes / best_time(lambda: dst.copy_(src), repeats, sync)


def probe_mm_flops(device: str, shape: tuple[int, int, int], dtype=None, repeats: int = 5) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` (2*m*k*n FLOPs); fp16 on a GPU, fp32 on the CPU by default."""
    import torch

    dtype = dtype or (torch.float16 if device.startswith("cuda") else torch.float32)
    m, k, n = shape
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    sync = _cuda_sync() if device.startswith("cuda") else None
    return 2 * m * k * n / best_time(lambda: a @ b, repeats, sync)


def probe_bmm_flops(device: str, shape: tuple[int, int, int, int], dtype=None, repeats: int = 5) -> float:
    """FLOP/s of a batched ``[bh, m, k] @ [bh, k, n]`` (attention shapes; 2*bh*m*k*n FLOPs)."""
    import torch

    dtype = dtype or (torch.float16 if device.startswith("cuda") else torch.float32)
    bh, m, k, n = shape
    a = torch.randn(bh, m, k, device=device, dtype=dtype)
    b = torch.randn(bh, k, n, device=device, dtype=dtype)
    sync = _cuda_sync() if device.startswith("cuda") else None
    return 2 * bh * m * k * n / best_time(lambda: torch.bmm(a, b), repeats, sync)


def cpu_attention_case(shape: tuple[int, int, int, int], dtype, block_size: int = 16):
    """A delegated decode-attention step as ``runtime/offload/kv.py`` runs it on the CPU: gather
    a batch's K/V blocks from a paged cache (shuffled block ids), then
    ``paged_attention_ref.paged_decode_attention``. ``shape``: (sequences, KV heads, head_dim,
    context); one query head per KV head. Returns ``(run, (q, k, v, tables))``."""
    import torch

    from localgen.kernels import paged_attention_ref as ref

    seqs, kvh, d, ctx = shape
    nb = -(-ctx // block_size)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(seqs * nb, block_size, kvh, d, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(seqs * nb, generator=g).view(seqs, nb)
    local = torch.arange(seqs * nb).view(seqs, nb)  # the gathered copy's own block table
    q = torch.randn(seqs, kvh, d, generator=g).to(dtype)
    lens = torch.full((seqs,), ctx)

    def run():
        ids = tables.flatten()
        return ref.paged_decode_attention(q, k[ids], v[ids], local, lens, d ** -0.5)

    return run, (q, k, v, tables)


def probe_cpu_attention(shape: tuple[int, int, int, int] = ProbeSizes.attn_decode, dtype=None,
                        repeats: int = 5) -> float:
    """Rate of decode attention on the CPU as the offloading runtime runs it when it delegates
    attention to the CPU (FlexGen §4.2; ``cpu_attention_case``). Returns K/V bytes read per
    second at 2 bytes an element, which equals the MHA FLOPs the cost model divides by
    ``cpu_flops`` (App. A.3 counts 4 * context * hidden for both). ``dtype``: the cache's, fp16
    beside a GPU, else float32 (``run_profile`` passes the one its profile implies). It is timed
    as the runtime runs it rather than as a plain bmm, which at these shapes over-predicts it many
    times over: the path is bound by memory, not FLOPs."""
    import torch

    from localgen.hostmem import keep_freed_host_memory

    keep_freed_host_memory()  # as the runtime runs: gathered blocks land in reused heap memory
    seqs, kvh, d, ctx = shape
    dtype = dtype or (torch.float16 if torch.cuda.is_available() else torch.float32)
    run, _ = cpu_attention_case(shape, dtype)
    return 2 * seqs * ctx * kvh * d * 2 / best_time(run, repeats)


def small_kernel_case(device: str, tokens: int = 16, hidden: int = 4096, inter: int = 11008,
                      kv_heads: int = 32, head_dim: int = 128) -> list[Callable[[], object]]:
    """The small kernels of a decode step's layer as localgen runs them (``localgen.kernels``):
    residual add + RMSNorm over ``[tokens, hidden]``, silu(gate) * up over ``[tokens, inter]``,
    the 4-bit K/V write of ``tokens`` tokens. Default sizes: Llama-2-7B, 16 sequences."""
    import torch

    from localgen.kernels import fused_act, fused_norm, kv_write, quant_ref

    dt = torch.float16
    x, res = (torch.randn(tokens, hidden, dtype=dt, device=device) for _ in range(2))
    w = torch.ones(hidden, dtype=dt, device=device)
    gate, up = (torch.randn(tokens, inter, dtype=dt, device=device) for _ in range(2))
    blocks = -(-tokens // 16)
    kc, vc = (quant_ref.quantize_kv(torch.zeros(blocks, 16, kv_heads, head_dim, dtype=dt, device=device))
              for _ in range(2))
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dt, device=device)
    slots = torch.arange(tokens, device=device)
    return [lambda: fused_norm.add_rms_norm(x, res, w, 1e-5), lambda: fused_act.silu_mul(gate, up),
            lambda: kv_write.write_kv_int4(kc, vc, k, k, slots)]


def probe_kernel_floor(rounds: int = 20, repeats: int = 5) -> float:
    """``HardwareProfile.gpu_kernel_floor``: mean seconds of one of a decode step's small kernels
    (``small_kernel_case``) in a CUDA-graph replay of ``rounds`` rounds of them
    (``dispatch.cuda_timer``: median of ``repeats`` replays)."""
    from localgen.kernels.dispatch import cuda_timer

    return cuda_timer(small_kernel_case("cuda") * rounds, repeat=repeats)


def int4_attention_case(shape: tuple[int, int, int, int], device: str, group: int = 64):
    """The paged int4 decode kernel over a random 4-bit cache: ``shape`` = (sequences, KV heads
    (= query heads), head_dim, context), shuffled block tables. Returns ``(call, bytes)``, bytes
    the codes plus fp16 scale and min the call reads."""
    import torch

    from localgen.kernels import paged_decode, quant_ref

    seqs, kvh, d, ctx = shape
    per_seq = -(-ctx // 16)
    cache = torch.randn(seqs * per_seq, 16, kvh, d, dtype=torch.float16, device=device)
    kc, vc = quant_ref.quantize_kv(cache, group), quant_ref.quantize_kv(cache.flip(0), group)
    tables = torch.randperm(seqs * per_seq, device=device).view(seqs, per_seq)
    lens = torch.full((seqs,), ctx, dtype=torch.long, device=device)
    q = torch.randn(seqs, kvh, d, dtype=torch.float16, device=device)
    nbytes = 2 * seqs * ctx * kvh * (d // 2 + 4 * -(-d // group))

    def call():
        return paged_decode.paged_decode_attention_int4(q, kc, vc, tables, lens, d ** -0.5,
                                                        max_context_len=ctx)

    return call, nbytes


def probe_int4_attention(shape: tuple[int, int, int, int] = (16, 32, 128, 544), calls: int = 10,
                         repeats: int = 5) -> float:
    """``HardwareProfile.gpu_int4_attn_bdw``: bytes/s of 4-bit KV the paged int4 decode kernel
    reads (``int4_attention_case``; default Llama-2-7B's 32 heads, 16 sequences of 544 tokens),
    ``calls`` calls in one CUDA graph, each over a cache of its own as a decode step's layers are:
    one case called again would be read partly from the GPU's L2 cache."""
    from localgen.kernels.dispatch import cuda_timer

    cases = [int4_attention_case(shape, "cuda") for _ in range(calls)]
    return cases[0][1] / cuda_timer([call for call, _ in cases], repeat=repeats)


def layer_host_case(num_layers: int, device: str, batch: int = 4, prompt_len: int = 16):
    """A tiny Llama (MHA: 4 heads of 64, hidden 256) of ``num_layers`` dummy-weight layers, every
    layer's 4-bit weights streamed from CPU memory and its 4-bit KV cache on ``device``: localgen's
    eager offloaded decode path (``runtime/offload``, one GPU batch of ``batch`` sequences), with
    GPU work too small to hide the host's. Returns ``decode(steps) -> seconds`` of ``steps``
    decode steps after a ``prompt_len``-token prefill."""
    from localgen.models.config import ModelConfig
    from localgen.runtime.offload.policy import Policy
    from localgen.runtime.offload.timed_run import build_engine, timed_generation

    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-5})
    policy = Policy(gbs=batch, num_gpu_batches=1, wg=0.0, wc=1.0, cg=1.0, hg=1.0,
                    compress_weight=True, compress_cache=True).validate()
    engine = build_engine(cfg, policy, batch, prompt_len, 64, device=device)

    def decode(steps: int) -> float:
        return timed_generation(engine, batch, prompt_len, steps + 1)[1]

    return decode


def probe_layer_host(device: str = "cuda", layers: tuple[int, int] = (2, 10), steps: int = 16,
                     repeats: int = 3) -> float:
    """``HardwareProfile.gpu_layer_host_s``: seconds the host spends issuing one eager decoder
    layer call of localgen's offloaded runtime (Python, kernel launches, stream and event
    bookkeeping), which CUDA-graph replays do not pay. The slope of a decode step's time over the
    layer count of two ``layer_host_case`` models, so that per-step work (embedding, sampling,
    scheduling) cancels; the best of ``repeats`` after a warm-up for each."""
    per_step = []
    for n in layers:
        decode = layer_host_case(n, device)
        decode(2)  # warm-up: kernels compiled, buffers allocated
        per_step.append(min(decode(steps) for _ in range(repeats)) / steps)
    return max(0.0, (per_step[1] - per_step[0]) / (layers[1] - layers[0]))


def probe_disk_bdw(offload_dir: str | os.PathLike, nbytes: int = ProbeSizes.disk_bytes,
                   repeats: int = 3) -> tuple[float, float, str]:
    """(dtoc_bdw, ctod_bdw, method) for a scratch file in ``offload_dir``, page cache bypassed.

    Uses O_DIRECT with an aligned buffer where the OS and file system allow it; otherwise writes
    with fsync and drops the file's pages with posix_fadvise(DONTNEED) before each read ("fadvise").
    The scratch file is removed afterwards.
    """
    d = Path(offload_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f".localgen_probe_{os.getpid()}.bin"
    nbytes = max(_ALIGN, nbytes // _ALIGN * _ALIGN)
    buf = mmap.mmap(-1, nbytes)  # page-aligned anonymous memory
    buf.write(os.urandom(1 << 16) * (nbytes >> 16) if nbytes >= 1 << 16 else os.urandom(nbytes))
    try:
        try:
            w, r = _disk_direct(path, buf, repeats)
            method = "O_DIRECT"
        except (OSError, AttributeError):
            w, r = _disk_fadvise(path, buf, repeats)
            method = "fadvise"
    finally:
        buf.close()
        path.unlink(missing_ok=True)
    return nbytes / r, nbytes / w, method


def _disk_direct(path: Path, buf: mmap.mmap, repeats: int) -> tuple[float, float]:
    flags = os.O_DIRECT  # AttributeError where the platform has none (macOS, Windows)

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read():
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            os.readv(fd, [buf])
        finally:
            os.close(fd)

    return best_time(write, repeats), best_time(read, repeats)


def _disk_fadvise(path: Path, buf: mmap.mmap, repeats: int) -> tuple[float, float]:
    def drop(fd):
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def write():
        with open(path, "wb", buffering=0) as f:
            f.write(buf)
            os.fsync(f.fileno())
            drop(f.fileno())

    def read():
        with open(path, "rb", buffering=0) as f:
            drop(f.fileno())
            f.readinto(buf)

    return best_time(write, repeats), best_time(read, repeats)


def probe_capacities(offload_dir: str | os.PathLike) -> dict:
    """Usable bytes: {"cpu_mem": available RAM, "disk_mem": free in offload_dir, "gpu_mem", "gpu_name",
    "cpu_name", "cpu_cores"}. GPU fields come from torch.cuda, else nvidia-ml-py if installed."""
    import psutil

    Path(offload_dir).mkdir(parents=True, exist_ok=True)
    out = {"cpu_mem": int(psutil.virtual_memory().available),
           "disk_mem": int(shutil.disk_usage(offload_dir).free),
           "cpu_name": _cpu_name(), "cpu_cores": psutil.cpu_count(logical=False) or os.cpu_count(),
           "gpu_name": None, "gpu_mem": 0}
    out.update(_gpu_info())
    return out


def _gpu_info() -> dict:
    try:
        import torch

        if torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info(0)
            return {"gpu_name": torch.cuda.get_device_name(0), "gpu_mem": int(free)}
    except Exception:  # a broken driver must not stop a CPU-only profile
        pass
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        return {"gpu_name": name.decode() if isinstance(name, bytes) else name,
                "gpu_mem": int(pynvml.nvmlDeviceGetMemoryInfo(h).free)}
    except Exception:
        return {}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_profile(offload_dir: str | os.PathLike, name: str = "local", sizes: ProbeSizes | None = None,
                progress: Callable[[str, int, int], None] | None = None,
                use_gpu: bool | None = None) -> HardwareProfile:
    """Measure this machine and return its HardwareProfile (not saved; call ``.save()``).

    ``progress(step_name, index, total)`` is called before each step. ``use_gpu`` None: if CUDA is
    available. The disk probes write a scratch file in ``offload_dir``.
    """
    import torch

    gpu = torch.cuda.is_available() if use_gpu is None else use_gpu
    sizes = sizes or (ProbeSizes() if gpu else CPU_DEFAULT)
    dev = "cuda" if gpu else "cpu"
    steps: list[tuple[str, Callable[[], dict]]] = [("capacities", lambda: probe_capacities(offload_dir))]
    if gpu:
        for d in ("ctog", "gtoc"):
            steps.append((f"{d} pinned", lambda d=d: {f"{d}_bdw": probe_link_bdw(d, True, sizes.link_bytes, sizes.repeats)}))
            steps.append((f"{d} pageable", lambda d=d: {f"{d}_bdw_pageable": probe_link_bdw(d, False, sizes.link_bytes, sizes.repeats)}))
        steps.append(("GPU memory", lambda: {"gpu_mem_bdw": probe_mem_bdw("cuda", sizes.mem_bytes, sizes.repeats)}))
        if importlib.util.find_spec("triton") is not None:  # localgen's own kernels
            steps.append(("kernel floor", lambda: {"gpu_kernel_floor": probe_kernel_floor(repeats=sizes.repeats)}))
            steps.append(("int4 attention", lambda: {"gpu_int4_attn_bdw": probe_int4_attention(repeats=sizes.repeats)}))
            steps.append(("eager layer host", lambda: {"gpu_layer_host_s": probe_layer_host(repeats=sizes.repeats)}))
    steps += [
        ("CPU memory", lambda: {"cpu_mem_bdw": probe_mem_bdw("cpu", sizes.mem_bytes, sizes.repeats)}),
        ("disk", lambda: dict(zip(("dtoc_bdw", "ctod_bdw", "disk_method"), probe_disk_bdw(offload_dir, sizes.disk_bytes, sizes.repeats)))),
        ("matmul prefill", lambda: {"mm_flops": probe_mm_flops(dev, sizes.mm_prefill, repeats=sizes.repeats)}),
        ("matmul decode", lambda: {"mm_flops_gen": probe_mm_flops(dev, sizes.mm_decode, repeats=sizes.repeats)}),
        ("bmm prefill", lambda: {"bmm_flops": probe_bmm_flops(dev, sizes.bmm_prefill, repeats=sizes.repeats)}),
        ("bmm decode", lambda: {"bmm_flops_gen": probe_bmm_flops(dev, sizes.bmm_decode, repeats=sizes.repeats)}),
        ("CPU attention", lambda: {"cpu_flops": probe_cpu_attention(
            sizes.attn_decode, torch.float16 if gpu else torch.float32, repeats=sizes.repeats)}),
    ]
    vals: dict = {}
    for i, (step, fn) in enumerate(steps):
        if progress:
            progress(step, i, len(steps))
        vals.update(fn())
    if progress:
        progress("done", len(steps), len(steps))
    return _assemble(vals, name, offload_dir, sizes, gpu)


def _assemble(vals: dict, name: str, offload_dir, sizes: ProbeSizes, gpu: bool) -> HardwareProfile:
    method = vals.pop("disk_method")
    today = _dt.date.today().isoformat()
    where = "GPU" if gpu else "CPU (no GPU: the CPU is the compute device)"
    src = {k: f"measured {today} by localgen profile, best of {sizes.repeats} after warm-up"
           for k in vals if k.endswith("_bdw") or k.endswith("_pageable")}
    src.update(dtoc_bdw=f"measured {today}, {sizes.disk_bytes} B file, {method}",
               ctod_bdw=f"measured {today}, {sizes.disk_bytes} B file with fsync, {method}",
               mm_flops=f"measured {today} on {where}, [m,k,n]={list(sizes.mm_prefill)}",
               mm_flops_gen=f"measured {today} on {where}, [m,k,n]={list(sizes.mm_decode)}",
               bmm_flops=f"measured {today} on {where}, [bh,m,k,n]={list(sizes.bmm_prefill)}",
               bmm_flops_gen=f"measured {today} on {where}, [bh,m,k,n]={list(sizes.bmm_decode)}",
               cpu_flops=f"measured {today}, the runtime's delegated CPU decode attention (KV block "
                         f"gather + paged reference), [seqs, kv heads, head_dim, context]="
                         f"{list(sizes.attn_decode)}, K/V bytes/s (= MHA FLOP/s)",
               gpu_kernel_floor=f"measured {today}: mean of the small decode kernels "
                                "(add + RMSNorm, silu*mul, 4-bit K/V write; 16 tokens of "
                                "Llama-2-7B) in a CUDA-graph replay",
               gpu_int4_attn_bdw=f"measured {today}: paged int4 decode kernel, 16 sequences x 32 "
                                 "heads x 544 tokens, codes + scale/min bytes per second in a "
                                 "CUDA-graph replay",
               gpu_layer_host_s=f"measured {today}: host seconds per eager decoder layer call of "
                                "the offloaded runtime (4-bit weights streamed, 4-bit KV on the "
                                "GPU), the slope over 2 and 10 layers of a tiny Llama",
               cpu_mem="psutil available RAM", disk_mem="free space in the offload dir",
               gpu_mem="torch.cuda.mem_get_info free bytes (or NVML)" if gpu else "no GPU")
    for k in ("gpu_kernel_floor", "gpu_int4_attn_bdw", "gpu_layer_host_s"):  # GPU with triton only
        if k not in vals:
            src.pop(k)
    if not gpu:
        vals["gpu_name"], vals["gpu_mem"] = None, 0
    return HardwareProfile(name=name, date=today, offload_dir=str(offload_dir), source=src, **vals).validate()
