"""FlexGen's analytical cost model (Sheng et al. 2023, §4.3 and App. A.3), for any ModelConfig.

Per layer and per zig-zag block of ``bls`` sequences (FlexGen §4.1), prefill and decode each take
the max of five terms (seconds): ``ctog`` CPU->GPU, ``gtoc`` GPU->CPU, ``dtoc`` disk->CPU,
``ctod`` CPU->disk reads/writes, and ``comp`` compute, because the zig-zag block schedule overlaps
them (§4.2). Then
``T = T_pre * l + T_gen * (n - 1) * l`` and throughput is ``bls * n / T`` tokens/s.

Every term and every peak-memory constraint is *affine* in the 9 placement fractions
``x = (wg, wc, wd, cg, cc, cd, hg, hc, hd)`` once ``(gbs, num_gpu_batches)`` and the boolean options
are fixed. ``CostModel.terms`` returns them as coefficient vectors, so the LP search
(``search.py``) and the evaluation of a given policy (``CostModel.predict``) read the same numbers.

Generalized from FlexGen's OPT-only model:
- weights per layer: q/k/v/o with GQA-sized k/v (``kv_size``) and 2 (OPT) or 3 (Llama) MLP matrices;
- KV bytes use ``num_kv_heads * head_dim``; attention FLOPs use ``num_heads * head_dim``;
- 4-bit group-wise compression (g=64, fp16 min and scale per group) scales stored/moved bytes by
  ``compressed_ratio()`` (~0.28) and adds dequantization, modeled as a memory-bound elementwise pass;
- matmuls take ``max(FLOPs / mm_flops, weight bytes / device memory bandwidth)`` (roofline, as in
  Pope et al., "Efficiently Scaling Transformer Inference"), since FlexGen's fitted decode FLOP/s
  overestimate small batches;
- CPU attention delegation (``cpu_cache_compute``, §4.2): attention over the CPU/disk part of the
  cache runs on the CPU and only q/k/v and the output cross PCIe; without it that cache is copied
  to the GPU every decode step;
- a CPU-only machine: the CPU is the compute device; GPU fractions are fixed to 0 and the GPU
  links cost nothing.
FlexGen's fitted non-linear CPU attention FLOP/s (c1..c3) is applied when the profile carries it
(``cpu_flops_fit``). Not modeled: embeddings' compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from localgen.models.config import ModelConfig
from localgen.policy.gemm_times import GemmTimes, gemm_times
from localgen.policy.policy import FRACTIONS, Policy
from localgen.profiler.hardware import HardwareProfile

WG, WC, WD, CG, CC, CD, HG, HC, HD = range(9)
NVARS = 9
TERMS = ("ctog", "gtoc", "dtoc", "ctod", "comp", "host")
TIERS = ("gpu", "cpu", "disk")
Form = Literal["released", "paper"]
DEFAULT_MEM_FRACTION = 0.9  # GPU: headroom for allocator fragmentation and the CUDA context
# Usable share of each tier's capacity. CPU RAM and disk: 0.8, FlexGen's relaxation ratios alpha_c and
# alpha_n (FMInference/FlexGen experimental/cost_model.py, module globals used in solve_lp:
# ``cmem = config.cmem * alpha_c``, ``nmem = config.nmem * alpha_n``). GPU: 0.9, not FlexGen's alpha_g = 0.8:
# our GPU rows already count the double-buffered layer and the working buffers, and at 0.8 (11.8 of the
# T4's 14.76 GiB) OPT-6.7B's 12.4 GiB of weights would not fit (FlexGen Tables 15/16 run them all on the GPU).
# 0.9 leaves ~1.5 GiB for the CUDA context, cuBLAS workspace and fragmentation.
DEFAULT_MEM_FRACTIONS = {"gpu": DEFAULT_MEM_FRACTION, "cpu": 0.8, "disk": 0.8}


def compressed_ratio(bits: int = 4, group_size: int = 64, dtype_bytes: int = 2) -> float:
    """Stored bytes per fp16 byte for group-wise asymmetric quantization (FlexGen §5).

    Each group of ``group_size`` values keeps ``bits``-bit codes plus a min and a scale in the
    original dtype: (bits/8 + 2*dtype_bytes/group_size) / dtype_bytes; 4 bits, g=64 -> 0.28125.
    """
    return (bits / 8 + 2 * dtype_bytes / group_size) / dtype_bytes


@dataclass(frozen=True)
class Workload:
    """A generation job: ``prompt_len`` (FlexGen s) and ``gen_len`` (n) tokens, in ``dtype_bytes``."""

    prompt_len: int
    gen_len: int
    dtype_bytes: int = 2

    def __post_init__(self):
        if self.prompt_len < 1 or self.gen_len < 1:
            raise ValueError(f"prompt_len and gen_len must be >= 1, got {self.prompt_len}, {self.gen_len}")


@dataclass(frozen=True)
class StoredWeights:
    """A checkpoint's weights as its file stores them and the runtime keeps them (a GGUF's
    quantized blocks, ``policy.presets.stored_weights``): ``layer_bytes``, the mean bytes of
    one decoder layer's tensors; ``global_bytes``, the embeddings, final norm and output matrix.
    Without it the model counts ``dtype_bytes`` per parameter."""

    layer_bytes: float
    global_bytes: float


def _affine(const: float = 0.0, **coefs: float) -> np.ndarray:
    """Vector [c_wg, ..., c_hd, const] of an expression affine in the 9 fractions."""
    v = np.zeros(NVARS + 1)
    v[NVARS] = const
    for name, c in coefs.items():
        v[FRACTIONS.index(name)] += c
    return v


@dataclass
class Terms:
    """Affine expressions for one (gbs, num_gpu_batches, options) choice.

    ``prefill``/``decode``: term name -> seconds per layer; ``pre_rows``/``gen_rows``: the
    expressions whose max is T_pre/T_gen under the chosen overlap ``form``. ``memory``: (tier, bytes) rows; a tier's
    peak is the max of its rows (FlexGen's max over working buffers, linearized as one row each).
    ``capacity``: usable bytes per tier. ``fixed_zero``: fractions forced to 0 (no GPU).
    """

    prefill: dict[str, np.ndarray]
    decode: dict[str, np.ndarray]
    pre_rows: list[np.ndarray]  # T_pre = max of these (the overlap form)
    gen_rows: list[np.ndarray]  # T_gen = max of these
    memory: list[tuple[str, np.ndarray]]
    capacity: dict[str, float]
    fixed_zero: tuple[int, ...]
    num_layers: int
    gen_len: int
    bls: int


@dataclass
class Prediction:
    """Cost-model output for one policy (seconds, bytes, tokens/s).

    ``prefill_terms``/``decode_terms`` are per layer; ``prefill_time``/``decode_time`` cover all layers
    and steps. ``peak_mem`` and ``capacity`` are per tier; ``fits`` says every peak is within capacity.
    """

    prefill_time: float
    decode_time: float
    throughput: float
    prefill_terms: dict[str, float]
    decode_terms: dict[str, float]
    peak_mem: dict[str, float]
    capacity: dict[str, float] = field(default_factory=dict)

    @property
    def total_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def prefill_bottleneck(self) -> str:
        return max(self.prefill_terms, key=self.prefill_terms.get)

    @property
    def decode_bottleneck(self) -> str:
        return max(self.decode_terms, key=self.decode_terms.get)

    def fits(self, rel_tol: float = 1e-6) -> bool:
        return all(self.peak_mem[t] <= self.capacity[t] * (1 + rel_tol) + 1 for t in self.capacity)


POOL_BLOCK_TOKENS = 16  # the engine's default block size (EngineConfig.block_size)


class CostModel:
    """FlexGen App. A.3 cost model for ``cfg`` on ``hw`` running ``wl``.

    ``mem_fraction``: usable share of each capacity, a float for every tier or a dict per tier
    (default ``DEFAULT_MEM_FRACTIONS``: GPU 0.9, CPU and disk 0.8 as FlexGen's alpha_c and alpha_n).
    ``form`` picks how the five terms overlap: "paper" is App. A.3 as printed, each of T_pre and
    T_gen the max of the five; "released" (default) is the authors' fitted refinement in FlexGen's
    ``experimental/cost_model.py``: T_pre = max(ctog + dtoc, gtoc + ctod, comp) (disk->CPU->GPU of
    the same bytes is a chain) and T_gen = ctog + max(gtoc, dtoc, ctod, comp) (weight loads do not
    hide behind decode compute); "paper" is optimistic. On the paper profile the search reproduces
    Table 2 closely, and the paper's placements for OPT-175B (no weights on the GPU, about half in
    RAM, cache on disk) and roughly for OPT-30B and OPT-6.7B; ``python -m localgen.policy.table2``
    prints the table and the remaining differences (docs/benchmarks.md).
    ``runtime`` picks whose runtime is priced: "flexgen" (default; the paper's, Table 2) copies an
    uncompressed CPU-held KV cache from pageable memory, dequantizes 4-bit weights before every
    GEMM and attends with bmm. "localgen" keeps that cache pinned and the GPU kernels read and
    write it in place (``runtime/offload/kv.py``), at the pinned bandwidth; its 4-bit GEMMs take
    the GPU's measured dispatch timings (``gemm_times``); its paged-decode kernels read the cache
    as stored; and a policy whose cache the GPU reads in place decodes a zig-zag block as one batch
    (``terms(one_batch=True)``; as CUDA graphs when everything is on the GPU).
    Raises ValueError for an unknown model family, form or runtime.
    """

    def __init__(self, cfg: ModelConfig, hw: HardwareProfile, wl: Workload,
                 mem_fraction: float | dict[str, float] | None = None, form: Form = "released",
                 runtime: str = "flexgen", stored: StoredWeights | None = None):
        if runtime not in ("flexgen", "localgen"):
            raise ValueError(f"runtime must be 'flexgen' or 'localgen', got {runtime!r}")
        self.runtime = runtime
        if cfg.family not in ("opt", "llama"):
            raise ValueError(f"cost model has no shapes for family {cfg.family!r}")
        if form not in ("released", "paper"):
            raise ValueError(f"form must be 'released' or 'paper', got {form!r}")
        if mem_fraction is None:
            mem_fraction = dict(DEFAULT_MEM_FRACTIONS)
        elif not isinstance(mem_fraction, dict):
            mem_fraction = {t: float(mem_fraction) for t in TIERS}
        else:
            mem_fraction = {**DEFAULT_MEM_FRACTIONS, **mem_fraction}
        self.cfg, self.hw, self.wl, self.mem_fraction, self.form = cfg, hw, wl, mem_fraction, form
        self.stored = stored

    # -- shapes ---------------------------------------------------------------------------------
    def layer_weight_elems(self) -> int:
        """Matrix elements of one decoder layer: q,o [h1 x q], k,v [h1 x kv], MLP m x [h1 x h2]."""
        c = self.cfg
        n_mlp = 2 if c.family == "opt" else 3
        return 2 * c.hidden_size * c.q_size + 2 * c.hidden_size * c.kv_size + n_mlp * c.hidden_size * c.intermediate_size

    def _sublayer_matrices(self) -> tuple[list[int], list[int]]:
        """Matrix sizes (elements) of a layer's two sublayers in FlexGen's tensor order:
        attention w_q, w_k, w_v, w_out; MLP wi, wo (OPT) or gate, up, down (Llama)."""
        c = self.cfg
        h, q, kv, h2 = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        return [h * q, h * kv, h * kv, q * h], [h * h2] * (2 if c.family == "opt" else 3)

    def min_gpu_weight_share(self) -> float:
        """Smallest nonzero share of a layer's weight bytes that FlexGen's runtime can put on the GPU.

        FlexGen flexgen/flex_opt.py ``init_weight_list``: within each sublayer (``SelfAttention``:
        w_q, w_k, w_v, w_out + biases/LN; ``MLP``: wi, wo + biases/LN), tensor i goes to
        ``get_choice(midpoint_i, [disk%, cpu%, gpu%], [disk, cpu, gpu])``, the tier where the midpoint
        of its cumulative size falls, so the GPU gets each sublayer's tail. The first matrix to reach
        the GPU is the last matrix of the sublayer whose midpoint threshold is lowest (OPT: w_out, at a
        nominal --percent of 1/8); returned is its share of the layer's bytes (OPT: 1/12; biases
        ignored). E.g. the paper's "20% of OPT-30B's weights on the GPU" puts w_out there, 1/12 of the bytes.
        """
        subs = self._sublayer_matrices()
        total = sum(map(sum, subs))
        return min(subs, key=lambda m: m[-1] / 2 / sum(m))[-1] / total

    def min_offload_weight_share(self) -> float:
        """Smallest nonzero share of a layer's weight bytes that FlexGen's runtime can keep off the GPU.

        The mirror of ``min_gpu_weight_share``: the tiers fill disk, CPU, GPU in tensor order, so the
        first matrix of a sublayer leaves the GPU once ``wc + wd`` passes its midpoint (OPT: w_q, 1/8
        nominal, 1/12 of the bytes). A smaller CPU/disk share (e.g. 1%) leaves every matrix on the GPU,
        as does layer granularity (a share below half a layer rounds to none).
        """
        subs = self._sublayer_matrices()
        total = sum(map(sum, subs))
        return min(subs, key=lambda m: m[0] / 2 / sum(m))[0] / total

    def linear_shapes(self) -> list[tuple[int, int]]:
        """``(N, K)`` of each matrix of a layer as localgen multiplies it (q/k/v fused, and
        Llama's gate/up: ``llama.fuse_weights``, ``opt.fuse_weights``)."""
        c = self.cfg
        h, q, kv, h2 = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        up = 2 * h2 if c.family == "llama" else h2
        return [(q + 2 * kv, h), (h, q), (up, h), (h, h2)]

    def int4_gemm_times(self) -> GemmTimes | None:
        """The GPU's measured int4 GEMM timings covering this layer, under localgen's runtime
        (``gemm_times``); None otherwise (FlexGen's dequantize-then-GEMM is modeled instead)."""
        if self.runtime != "localgen" or not self.hw.has_gpu:
            return None
        gt = gemm_times(self.hw.gpu_name, "float16") or gemm_times(self.hw.gpu_name, "bfloat16")
        return gt if gt is not None and gt.covers(self.linear_shapes()) else None

    def activation_elems(self, compress_cache: bool, prefill: bool) -> float:
        """Elements one token moves (read + written) through the elementwise kernels of one layer
        under localgen's runtime, attention and GEMMs apart. Llama's fused kernels: two residual
        add + RMSNorm (4h each), the layer's output add (3h), rotary q and k (2(q + kv)),
        silu(gate) * up (3I; OPT's activation, 2I), the K/V write (2kv in, 2kv out as stored);
        with a 4-bit cache also q, k, v rotated and the output rotated back (4q + 4kv), and in
        prefill the 4-bit K/V the write echoes (2kv) and their concatenation with the fp ones
        (8kv)."""
        c = self.cfg
        h, q, kv, inter = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        ck = compressed_ratio(dtype_bytes=self.wl.dtype_bytes) if compress_cache else 1.0
        n = 11 * h + 2 * (q + kv) + (3 if c.family == "llama" else 2) * inter + 2 * kv * (1 + ck)
        if compress_cache:
            n += 4 * q + 4 * kv + (10 * kv if prefill else 0)
        return n

    @staticmethod
    def small_kernels(compress_cache: bool) -> int:
        """Kernels of a decode step's layer (per GPU batch) that move too little to matter beside
        their floor (``HardwareProfile.gpu_kernel_floor``): two add + norms, the output add, rotary,
        silu * mul, the K/V write; a 4-bit cache adds four rotations and two pool writes."""
        return 12 if compress_cache else 6

    def total_weight_bytes(self, compress_weight: bool = False) -> float:
        """All parameters (embeddings, norms, biases included) in stored bytes."""
        if self.stored is not None and not compress_weight:
            return self.cfg.num_layers * self.stored.layer_bytes + self.stored.global_bytes
        return self.cfg.num_parameters() * self.wl.dtype_bytes * self._cw(compress_weight)

    def layer_weight_bytes(self, compress_weight: bool = False) -> float:
        """One decoder layer's weights as stored and moved: the file's bytes (``stored``), FlexGen's
        4-bit groups with ``compress_weight`` (the runtime quantizes any checkpoint), else
        ``dtype_bytes`` per element."""
        if self.stored is not None and not compress_weight:
            return self.stored.layer_bytes
        return self.layer_weight_elems() * self.wl.dtype_bytes * self._cw(compress_weight)

    def global_weight_bytes(self, compress_weight: bool = False) -> float:
        """Embeddings, final norm and output matrix as the runtime keeps them on the compute
        device: the file's bytes when it keeps the stored blocks, else ``dtype_bytes`` each."""
        if self.stored is not None and not compress_weight:
            return self.stored.global_bytes
        return self.cfg.global_parameters() * self.wl.dtype_bytes

    def _layer_all_bytes(self, compress_weight: bool) -> float:
        """One layer's stored bytes, norms and biases included (what its tier holds)."""
        if self.stored is not None and not compress_weight:
            return self.stored.layer_bytes
        return self.cfg.layer_parameters() * self.wl.dtype_bytes * self._cw(compress_weight)

    def _cw(self, on: bool) -> float:
        return compressed_ratio(dtype_bytes=self.wl.dtype_bytes) if on else 1.0

    # -- rates ----------------------------------------------------------------------------------
    def _dev_mem_bdw(self) -> float | None:
        return self.hw.gpu_mem_bdw if self.hw.has_gpu else self.hw.cpu_mem_bdw

    def cpu_attn_flops(self, gbs: int) -> float:
        """CPU attention FLOP/s for a GPU batch of ``gbs`` (delegated decode attention, §4.2).

        With the profile's ``cpu_flops_fit`` (c1, c2, c3) this is FlexGen's fitted non-linear rate
        (experimental/cost_model.py, solve_lp: ``cpu_flops_real``): small GPU batches and small
        hidden sizes run the CPU kernels less efficiently, so e.g. gbs 16 gets 0.93x and gbs 64 1.0x
        of ``cpu_flops`` for OPT-30B. Without it, ``cpu_flops`` flat.
        """
        fit = self.hw.cpu_flops_fit
        if not fit:
            return self.hw.cpu_flops
        c1, c2, c3 = fit
        a = max(0.0, math.log2(64 / gbs))
        b = max(0.0, math.log2(4096 / self.cfg.hidden_size))
        return self.hw.cpu_flops * max(0.1, 1 + c1 * a * b - c2 * a - c3 * b)

    def _matmul_time(self, flops: float, weight_bytes: float, flops_rate: float) -> float:
        """Roofline: compute bound by FLOP/s, or bound by reading the weights once per GPU batch."""
        bdw = self._dev_mem_bdw()
        return max(flops / flops_rate, weight_bytes / bdw if bdw else 0.0)

    def _elementwise_time(self, nbytes: float, on_gpu: bool) -> float:
        """A memory-bound pass (dequantization) touching ``nbytes``."""
        bdw = (self.hw.gpu_mem_bdw if on_gpu else self.hw.cpu_mem_bdw) or self.hw.cpu_flops
        return nbytes / bdw

    # -- terms ----------------------------------------------------------------------------------
    def terms(self, gbs: int, num_gpu_batches: int, compress_weight: bool = False,
              compress_cache: bool = False, cpu_cache_compute: bool = False,
              one_batch: bool = False, graphed: bool = False) -> Terms:
        """Affine cost and memory terms (App. A.3) for this batch shape and options.

        ``one_batch``: decode runs all ``bls`` sequences of a step as one batch (localgen, when
        every cache layer is read in place on the GPU: ``one_batch_decode``; as CUDA graphs when
        everything is on the GPU), so each layer's weights are read once a step, not once per GPU
        batch. Under localgen's runtime with 4-bit weights and a measured GEMM table for this GPU
        (``int4_gemm_times``), the layer's GEMMs take the table's time at M = gbs (decode; bls
        with ``one_batch``) and gbs * s (prefill), with no separate dequantization pass.
        ``host``: under localgen's runtime on a GPU, the host's work of issuing the eager layer
        calls (``HardwareProfile.gpu_layer_host_s`` per call: one per GPU batch, one a decode
        step with ``one_batch``); ``graphed`` (CUDA-graph replays, everything on the GPU) pays
        none. Its own row of the max in either form: the host runs ahead of the streams, so it
        bounds a layer only when the GPU's work is shorter."""
        c, wl, hw = self.cfg, self.wl, self.hw
        gpu = hw.has_gpu
        cpu_cache_compute = cpu_cache_compute and gpu  # no GPU: all attention is on the CPU already
        s, n, B = wl.prompt_len, wl.gen_len, wl.dtype_bytes
        bls = gbs * num_gpu_batches
        h1, q, kv, l = c.hidden_size, c.q_size, c.kv_size, c.num_layers
        r = compressed_ratio(dtype_bytes=B)
        cw, ck = (r if compress_weight else 1.0), (r if compress_cache else 1.0)
        W = self.layer_weight_elems()
        wi16 = W * B  # one layer, fp16
        wi = self.layer_weight_bytes(compress_weight)  # one layer, as stored and moved
        # GEMMs that multiply from the stored blocks read those bytes, not an fp16 copy
        wmm = wi if self.stored is not None and not compress_weight else wi16
        ctx = s + n / 2  # FlexGen's average decode context
        hid_p, hid_g = s * h1 * B * bls, h1 * B * bls
        kv_p = 2 * kv * B * ck * s * bls  # cache written by prefill
        kv_read = 2 * kv * B * ck * ctx * bls  # cache read per decode step
        kv_new = 2 * kv * B * ck * bls  # cache appended per decode step
        kv16 = 2 * kv * B * ctx * bls  # fp16 cache the attention reads (== MHA FLOPs)

        inf = float("inf")
        ctog = hw.ctog_bdw if gpu else inf
        gtoc = hw.gtoc_bdw if gpu else inf
        # The KV cache crosses PCIe from/to pageable memory, not pinned buffers: FlexGen keeps its CPU
        # cache unpinned (flexgen/pytorch_backend.py init_cache_one_gpu_batch: "disable pin_memory due to
        # high memory overhead") and copies strided slices of it; our runtime gathers a batch's blocks
        # into a fresh (pageable) tensor before the copy (runtime/offload/kv.py). So cache stores use
        # gtoc_bdw_cache (FlexGen's fitted figure for exactly that path), else the pageable bandwidth;
        # cache loads the pageable ctog bandwidth, else -- the paper publishes no load figure for that
        # path -- the same fitted gtoc_bdw_cache, else pinned as the last resort.
        gtoc_cache = (hw.gtoc_bdw_cache or hw.gtoc_bdw_pageable or hw.gtoc_bdw) if gpu else inf
        ctog_cache = (hw.ctog_bdw_pageable or hw.gtoc_bdw_cache or hw.ctog_bdw) if gpu else inf
        dtoc, ctod = hw.dtoc_bdw, hw.ctod_bdw
        # a CPU-held cache (cc; not disk) under localgen's runtime: pinned, read/written in place by
        # the GPU's kernels (fp or 4-bit), except a 4-bit one that the CPU attends to
        in_place = self.runtime == "localgen" and not (compress_cache and cpu_cache_compute)
        ctog_cc, gtoc_cc = (ctog, gtoc) if in_place else (ctog_cache, gtoc_cache)

        reads = 1 if one_batch else num_gpu_batches  # weight passes of a decode step
        gt = self.int4_gemm_times() if compress_weight else None
        if gt is not None:  # localgen's measured int4 GEMMs (dequantization included)
            mm_p = num_gpu_batches * gt.layer_seconds(self.linear_shapes(), gbs * s)
            mm_g = reads * gt.layer_seconds(self.linear_shapes(), bls // reads)
        else:  # FlexGen: dequantize, then the GEMM
            deq_w = self._elementwise_time(wi16 * (1 + r), gpu) if compress_weight else 0.0
            mm_p = self._matmul_time(2 * W * s * bls, num_gpu_batches * wmm, hw.mm_flops) + deq_w
            mm_g = self._matmul_time(2 * W * bls, reads * wmm, hw.mm_flops_gen) + deq_w
        comp_p = (mm_p + 4 * s * s * q * bls / hw.bmm_flops
                  + (self._elementwise_time(kv_p / ck * (1 + r), gpu) if compress_cache else 0.0))
        # localgen's elementwise kernels on the GPU: memory-bound passes over the activations
        # (prefill), each at least a kernel floor (a decode step's few tokens)
        elem_g = 0.0
        if self.runtime == "localgen" and gpu and hw.gpu_mem_bdw:
            comp_p += s * bls * self.activation_elems(compress_cache, True) * B / hw.gpu_mem_bdw
            elem_g = (bls * self.activation_elems(compress_cache, False) * B / hw.gpu_mem_bdw
                      + reads * self.small_kernels(compress_cache) * (hw.gpu_kernel_floor or 0.0))
        host = (hw.gpu_layer_host_s or 0.0) if self.runtime == "localgen" and gpu and not graphed else 0.0
        prefill = {
            "ctog": _affine(wc=wi / ctog, wd=wi / ctog, hc=hid_p / ctog, hd=hid_p / ctog),
            "gtoc": _affine(cc=kv_p / gtoc_cc, cd=kv_p / gtoc_cache, hc=hid_p / gtoc, hd=hid_p / gtoc),
            "dtoc": _affine(wd=wi / dtoc, hd=hid_p / dtoc),
            "ctod": _affine(cd=kv_p / ctod, hd=hid_p / ctod),
            "comp": _affine(comp_p),
            "host": _affine(num_gpu_batches * host),
        }

        deq_kv = kv16 * (1 + r) if compress_cache else 0.0
        gpu_attn = kv16 / hw.bmm_flops_gen + self._elementwise_time(deq_kv, True) if gpu else 0.0
        kernel_attn = self.runtime == "localgen" and gpu and bool(hw.gpu_mem_bdw)
        if kernel_attn:  # the paged-decode kernels read the GPU-tier cache as stored, in place
            # (4-bit: unpacked in registers, at the int4 kernel's measured rate where the profile
            # has it); FlexGen's bmm + dequant pass otherwise
            bdw = (hw.gpu_int4_attn_bdw or hw.gpu_mem_bdw) if compress_cache else hw.gpu_mem_bdw
            gpu_attn = kv16 * ck / bdw
        if cpu_cache_compute:
            qkv_out = (q + 2 * kv) * B * bls  # q,k,v down; attention output (q) up
            cpu_attn = kv16 / self.cpu_attn_flops(gbs) + self._elementwise_time(deq_kv, False)
            ctog_g = _affine(wc=wi / ctog, wd=wi / ctog, hc=hid_g / ctog, hd=hid_g / ctog,
                             cc=q * B * bls / ctog, cd=q * B * bls / ctog)
            gtoc_g = _affine(hc=hid_g / gtoc, hd=hid_g / gtoc, cc=qkv_out / gtoc, cd=qkv_out / gtoc)
            comp_g = _affine(mm_g + elem_g, cg=gpu_attn, cc=cpu_attn, cd=cpu_attn)
        else:
            attn = gpu_attn if gpu else kv16 / hw.cpu_flops + self._elementwise_time(deq_kv, False)
            # localgen gathers (and dequantizes) a disk-held cache before the kernel reads it; a
            # CPU-held one too unless the kernels read it in place
            off_gpu = self._elementwise_time(deq_kv, True) if kernel_attn else 0.0
            ctog_g = _affine(wc=wi / ctog, wd=wi / ctog, hc=hid_g / ctog, hd=hid_g / ctog,
                             cc=kv_read / ctog_cc, cd=kv_read / ctog_cache)
            gtoc_g = _affine(hc=hid_g / gtoc, hd=hid_g / gtoc, cc=kv_new / gtoc_cc, cd=kv_new / gtoc_cache)
            comp_g = _affine(mm_g + attn + elem_g, cc=0.0 if in_place else off_gpu, cd=off_gpu)
        decode = {
            "ctog": ctog_g,
            "gtoc": gtoc_g,
            "dtoc": _affine(cd=kv_read / dtoc, wd=wi / dtoc, hd=hid_g / dtoc),
            "ctod": _affine(cd=kv_new / ctod, hd=hid_g / ctod),
            "comp": comp_g,
            "host": _affine(reads * host),
        }
        if not gpu:  # the CPU computes in place: no PCIe copies
            for t in (prefill, decode):
                t["ctog"], t["gtoc"] = _affine(), _affine()

        memory = self._memory_rows(gbs, bls, cw, ck, wi, wi16, compress_weight, compress_cache, cpu_cache_compute,
                                   one_batch)
        f = self.mem_fraction
        cap = {"gpu": hw.gpu_mem * f["gpu"], "cpu": hw.cpu_mem * f["cpu"], "disk": hw.disk_mem * f["disk"]}
        if not gpu:
            cap.pop("gpu")
        pre_rows, gen_rows = _overlap_rows(prefill, decode, self.form)
        # activations never go to disk (as in FlexGen's runtime: hg + hc = 1)
        fixed_zero = (HD,) if gpu else (WG, CG, HG, HD)
        return Terms(prefill, decode, pre_rows, gen_rows, memory, cap, fixed_zero, l, n, bls)

    def _memory_rows(self, gbs, bls, cw, ck, wi, wi16, compress_weight, compress_cache, cpu_cache_compute,
                     one_batch=False):
        """Peak bytes per tier (App. A.3 "peak memory"), one row per candidate GPU working buffer."""
        c, wl, gpu = self.cfg, self.wl, self.hw.has_gpu
        s, n, B = wl.prompt_len, wl.gen_len, wl.dtype_bytes
        h1, q, kv, nh, h2 = c.hidden_size, c.q_size, c.kv_size, c.num_heads, c.intermediate_size
        n_mlp = 2 if c.family == "opt" else 3
        # localgen keeps the embeddings, final norm and lm_head on the GPU, whole and
        # uncompressed (runtime/offload/runner.py OffloadedLM): the fractions place the layers
        fixed_gpu = self.global_weight_bytes(compress_weight) if self.runtime == "localgen" and gpu else 0.0
        wtot = (c.num_layers * self._layer_all_bytes(compress_weight) if fixed_gpu
                else self.total_weight_bytes(compress_weight))
        cache_full = 2 * kv * B * ck * (s + n) * bls * c.num_layers  # all layers, final length
        kv_gbs = 2 * kv * B * ck * (s + n) * gbs  # one layer, one GPU batch, final length
        kv_bls = kv_gbs * (bls // gbs)  # one layer, the whole zig-zag block
        deq_buf = wi16 if compress_weight else 0.0
        # 4-bit KV keeps each running sequence's last KV block also in fp16 (the recent-block pool of
        # runtime/offload/kv.py: bls rows of POOL_BLOCK_TOKENS per layer, on the cache's tier)
        pool = 2 * kv * B * POOL_BLOCK_TOKENS * bls * c.num_layers if compress_cache else 0.0
        # largest live intermediates of one GPU batch (fp16): qkv projection, attention, MLP
        att_p = gbs * B * (s * (2 * q + 2 * kv) + nh * s * s)
        if compress_cache and self.runtime == "localgen":
            # localgen's 4-bit prefill attention also holds the rotated q/k/v, the 4-bit echo of
            # k/v and k/v concatenated with each prompt's own KV blocks in fp (runtime/offload/kv.py
            # _fresh_int4_prefill; scripts/offload_memory.py shows them at a policy's peak)
            att_p += gbs * s * B * (q + 8 * kv)
        ops_p = [gbs * s * B * (h1 + q + 2 * kv), att_p, gbs * s * B * (h1 + n_mlp * h2)]
        att_g = gbs * B * (q + nh * (s + n)) + (2 * kv * B * (s + n) * gbs if compress_cache else 0.0)
        ops_g = [gbs * B * (h1 + q + 2 * kv), att_g, gbs * B * (h1 + n_mlp * h2)]
        rows = []
        if gpu:
            home_p = dict(wg=wtot, hg=s * h1 * B * bls, cg=cache_full + pool)
            home_g = dict(wg=wtot, hg=h1 * B * bls, cg=cache_full + pool)
            for op in ops_p:  # double-buffered streamed layer + one GPU batch's activations
                rows.append(("gpu", _affine(fixed_gpu + 2 * wi + deq_buf + s * h1 * B * gbs + op,
                                            **_add(home_p, wg=-2 * wi, hg=-s * h1 * B * gbs))))
            for i, op in enumerate(ops_g):
                extra = {}
                if i == 1 and cpu_cache_compute:  # attention on GPU only for the GPU part of the cache
                    op, extra = 0.0, dict(cg=att_g)
                elif one_batch and compress_cache:  # a 4-bit host layer's KV blocks of the whole step,
                    # copied to the GPU for the int4 kernel (runtime/offload/tier_backends.py Int4KernelTierLayer._staged)
                    extra = dict(cc=kv_bls)
                elif not cpu_cache_compute:  # CPU/disk cache streamed in, double-buffered
                    extra = dict(cc=2 * kv_gbs, cd=2 * kv_gbs)
                rows.append(("gpu", _affine(fixed_gpu + 2 * wi + deq_buf + h1 * B * gbs + op,
                                            **_add(home_g, extra, wg=-2 * wi, hg=-h1 * B * gbs))))
            work_p, work_g = 0.0, [0.0]
        else:  # the CPU is the compute device: its working buffers land in RAM
            work_p, work_g = deq_buf + max(ops_p), [deq_buf + max(ops_g)]
        # CPU attention (delegation): fp32 scores and the new q/k/v of one GPU batch, plus an fp32 copy of
        # that batch's K and V over the full length (FlexGen pytorch_backend.py
        # init_attention_compute_workspace allocates such fp32 K/V buffers; our runtime gathers the
        # batch's KV blocks and attends in fp32)
        deleg = (gbs * (4 * nh * (s + n) + B * (2 * q + 2 * kv)) + 2 * 4 * kv * (s + n) * gbs
                 if cpu_cache_compute else 0.0)
        # The CPU cache counts at its full length (s + n) already in prefill: FlexGen pre-allocates each
        # zig-zag block's KV buffers for prompt + generation at its start (App. A.2.1 "FlexGen now
        # pre-allocates continuous buffers for all KV cache"), and App. A.3's cpu_home^p has the same
        # 4(s+n)h1*cc*bls*l as gpu_home^p. Counting only the prompt's s here let the LP trade cache for
        # weights in RAM at a ~6% discount (OPT-175B then kept 8% of its cache in RAM and 22% of its weights).
        rows.append(("cpu", _affine(work_p + s * h1 * B * gbs, wc=wtot, hc=s * h1 * B * bls, cc=cache_full + pool,
                                    wd=2 * wi, cd=2 * kv * B * ck * s * gbs + pool)))
        for w in work_g:
            rows.append(("cpu", _affine(w + deleg + 2 * h1 * B * gbs, wc=wtot, hc=h1 * B * bls,
                                        cc=cache_full + pool, wd=2 * wi, cd=2 * kv_gbs + pool)))
        rows.append(("disk", _affine(wd=wtot, hd=s * h1 * B * bls, cd=cache_full)))
        return rows

    # -- evaluation -----------------------------------------------------------------------------
    @property
    def graphs(self) -> bool:
        """Whether this runtime and machine decode all-GPU policies as CUDA graphs (localgen on
        a GPU)."""
        return self.runtime == "localgen" and self.hw.has_gpu

    def graphed(self, policy: Policy) -> bool:
        """Whether localgen decodes ``policy`` as CUDA graphs (everything on the GPU)."""
        return self.graphs and min(policy.wg, policy.cg, policy.hg) >= 1 - 1e-9

    def one_batch_decode(self, policy: Policy) -> bool:
        """Whether localgen decodes a step's zig-zag block as one batch (``runtime/offload/runner.py``):
        on a GPU, with every cache layer read in place by the GPU's kernels, i.e. on the GPU, or
        (fp or 4-bit, not delegated to the CPU) in pinned host memory; layers placed whole as
        the runtime places them (``Policy.cache_tiers``)."""
        if not self.graphs:
            return False
        tiers = set(policy.cache_tiers(self.cfg.num_layers))
        if policy.cpu_cache_compute:
            return tiers == {"gpu"}
        return "disk" not in tiers

    def predict(self, policy: Policy) -> Prediction:
        """Predicted times, throughput and peak memory of ``policy`` (App. A.3 T, peak memory)."""
        t = self.terms(policy.gbs, policy.num_gpu_batches, policy.compress_weight,
                       policy.compress_cache, policy.cpu_cache_compute, self.one_batch_decode(policy),
                       self.graphed(policy))
        return evaluate_terms(t, np.array(policy.fractions()))


def evaluate_terms(t: Terms, x: np.ndarray) -> Prediction:
    """Evaluate ``Terms`` at fractions ``x`` (length 9): max over terms, max over memory rows."""
    xa = np.append(x, 1.0)
    pre = {k: float(v @ xa) for k, v in t.prefill.items()}
    dec = {k: float(v @ xa) for k, v in t.decode.items()}
    t_pre = max(float(v @ xa) for v in t.pre_rows) * t.num_layers
    t_dec = max(float(v @ xa) for v in t.gen_rows) * t.num_layers * (t.gen_len - 1)
    peak = {tier: 0.0 for tier in TIERS}
    for tier, row in t.memory:
        peak[tier] = max(peak[tier], float(row @ xa))
    thr = t.bls * t.gen_len / (t_pre + t_dec)
    return Prediction(t_pre, t_dec, thr, pre, dec, peak, dict(t.capacity))


def _overlap_rows(pre: dict, dec: dict, form: str) -> tuple[list, list]:
    if form == "paper":
        return [pre[k] for k in TERMS], [dec[k] for k in TERMS]
    return ([pre["ctog"] + pre["dtoc"], pre["gtoc"] + pre["ctod"], pre["comp"], pre["host"]],
            [dec["ctog"] + dec[k] for k in ("gtoc", "dtoc", "ctod", "comp")] + [dec["host"]])


def _add(base: dict, extra: dict | None = None, **more) -> dict:
    out = dict(base)
    for d in (extra or {}), more:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out
