"""The paged KV cache split across tiers at layer granularity, optionally 4-bit (FlexGen §4.2, §5).

Each layer's K and V (``[num_blocks, block_size, num_kv_heads, head_dim]``, the plain layout of
``localgen.kv.cache``) live on one tier: the compute device ("gpu"), host memory ("cpu", pinned
when a GPU computes), or a file ``<offload_dir>/kv_<layer:03d>.bin`` mapped read-write ("disk"). With
``compress_cache`` they are stored as 4-bit groups of 64 along head_dim (the hidden dim), packed
uint8 plus fp16 scale/min, in every tier.

Rotated 4-bit KV (on by default with ``compress_cache``; QuaRot, Ashkboos et al. 2024, §4 "KV
cache"; SpinQuant, Liu et al. 2024): before quantizing, each head's K and V are multiplied by a
fixed orthogonal ``R`` ``[head_dim, head_dim]`` (``kv_rotation``). Post-RoPE keys carry a few
outlier channels that stretch every 64-group's range, so plain 4-bit codes leave the other
channels a step or two; a Hadamard-like ``R`` spreads each outlier over all channels and shrinks
the range. Nothing is rotated back on the cache: the query is rotated the same way (scores
``(qR)(kR)^T = qk^T``) and the output over rotated values is ``(PV)R``, turned back by ``R^T`` on
the ``[num_tokens, num_heads, head_dim]`` output. The stored format is unchanged (FlexGen's packed
codes + fp16 scale/min); the cache simply holds ``kR``/``vR``.

Recent block uncompressed (on by default with ``compress_cache``; KIVI, Liu et al. 2024, §3.3
keeps the most recent tokens in full precision, here at block granularity): every token is stored
4-bit as above, and in addition the fp values of each running sequence's last (partly filled)
block are kept in a small write-through pool (``recent_blocks`` blocks per layer, on the tier's
device, least recently written evicted first; ``recent.RecentIndex`` assigns the rows once per step
for every layer). A query reads the keys/values of its own block
(the block holding its position) in full precision and every earlier block 4-bit, in prefill
exactly as in decode: a prompt scored in one prefill sees what token-by-token decoding would see.
A block without a pool entry (evicted, or filled from the prefix cache) falls back to its 4-bit
values, so the pool changes accuracy, never correctness. Most attention mass of small models sits
on the last few tokens, which is where 4-bit keys cost the most.

Attention for an offloaded or compressed layer: each layer is its own attention backend, chosen once
when the cache is built (``build_tier_layer``):
1. new K/V are (quantized on the compute device and) written to the layer's tier at their slots;
2. decode with ``cpu_cache_compute`` and an off-GPU cache: q moves to the CPU, attention runs
   there (multi-threaded torch) over the cache in place, and only the output returns
   (``tier_backends.CpuAttentionTierLayer``);
3. by default the blocks the batch's block tables name are gathered (dequantized) onto the
   compute device and attention runs there over this local copy with remapped block tables
   (``tier_layer.TierLayer``); a 4-bit cache the Triton kernels can reach is read in place
   (``Int4KernelTierLayer``), as is a pinned fp host cache under a GPU (``MappedHostTierLayer``).
A layer that is on the compute device and uncompressed gets the plain ``LayerKV``, bound to the
runner's paged backend.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from localgen.attention.metadata import LayerKV
from localgen.attention.spec import AttentionSpec
from localgen.attention.triton import triton_kernels
from localgen.kernels.quant_ref import GROUP_SIZE
from localgen.models.config import ModelConfig
from localgen.runtime.offload.memory import Layout, host_empty
from localgen.runtime.offload.recent import RecentIndex, own_blocks
from localgen.runtime.offload.tier_backends import (CpuAttentionTierLayer, Int4KernelTierLayer,
                                                    MappedHostTierLayer)
from localgen.runtime.offload.tier_layer import TierLayer, resolve_device
from localgen.runtime.offload.timers import Timers


DEFAULT_RECENT_BLOCKS = 64  # fp pool rows per layer when the caller does not say (one per sequence)
# where a 4-bit cache on the compute device goes through the Triton kernels (tests add "cpu"
# under TRITON_INTERPRET=1)
INT4_KERNEL_DEVICES = ("cuda",)



def kv_layer_bytes(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                   compress: bool) -> int:
    """Stored bytes of one layer's K and V."""
    return Layout(_kv_items(cfg, num_blocks, block_size, dtype, compress)).nbytes


def _kv_items(cfg, num_blocks, block_size, dtype, compress):
    base = (num_blocks, block_size, cfg.num_kv_heads)
    if not compress:
        return [(n, dtype, base + (cfg.head_dim,)) for n in ("k", "v")]
    ng = -(-cfg.head_dim // GROUP_SIZE)
    items = []
    for n in ("k", "v"):
        items += [(n + "#packed", torch.uint8, base + (cfg.head_dim // 2,)),
                  (n + "#scale", torch.float16, base + (ng,)), (n + "#min", torch.float16, base + (ng,))]
    return items


def kv_rotation(head_dim: int, seed: int = 0) -> torch.Tensor:
    """A fixed orthogonal ``[head_dim, head_dim]`` float64 matrix for rotated 4-bit KV (QuaRot §4).

    Power-of-two ``head_dim``: the normalized Sylvester (Walsh-)Hadamard matrix ``H / sqrt(d)``,
    the online rotation QuaRot applies to keys after RoPE: every entry is ``±1/sqrt(d)``, so each
    input channel (an outlier) is spread evenly over all outputs. (Measured on SmolLM2-135M, a
    seeded random ±1 diagonal in front, QuaRot's randomized variant, did no better.) Other sizes
    (80, 96, ...): a random orthogonal matrix from ``seed`` (QR of a Gaussian with the signs of R's
    diagonal folded in, SpinQuant's initialization). Deterministic for a given ``(head_dim, seed)``.
    Raises ValueError for ``head_dim < 1``.
    """
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / head_dim ** 0.5
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r))[None, :]



def prefill_temp_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes per prompt token that the rest of a layer allocates after its attention, all counted
    as alive at once (an upper bound): the attention output and the o-projection (q_size +
    hidden), the MLP's up/gate output, its activation and the down projection (3 intermediate +
    hidden). Llama-2-7B: 90 KB a token, 0.69 GiB for a 16 x 512 GPU batch."""
    return (cfg.q_size + 3 * cfg.intermediate_size + 2 * cfg.hidden_size) * dtype.itemsize



def build_tier_layer(tensors: dict[str, torch.Tensor], tier: str, compress: bool,
                     compute_device: torch.device, dtype: torch.dtype, cpu_compute: bool,
                     timers: Timers, rotation: torch.Tensor | None = None,
                     recent: RecentIndex | None = None, prefill_temp_per_token: int = 0,
                     spec: AttentionSpec | None = None) -> TierLayer:
    """The attention backend of one tiered layer (its own KV view), from its placement, format and
    the compute device (module docstring): the Triton int4 kernels for a 4-bit cache they reach
    (the compute device's own memory, or pinned host memory under a GPU that computes the
    attention itself); GPU kernels in place over a pinned fp host cache; CPU-computed decode for
    a cache off the GPU when the policy delegates attention; else the gather path. A ``spec``
    beyond plain causal attention (a window, softcap or sinks; None = plain) skips the kernels
    that read the cache in place, which compute plain attention only: the gather path and
    CPU-computed decode compute every spec."""
    device = resolve_device(compute_device)
    key = tensors["k#packed" if compress else "k"]
    gpu_reads_host = (tier == "cpu" and not cpu_compute and device.type == "cuda" and key.is_pinned())
    cls = TierLayer
    plain = spec is None or spec.plain
    if compress and plain:
        if (device.type in INT4_KERNEL_DEVICES and (key.device == device or gpu_reads_host)
                and triton_kernels() is not None):
            cls = Int4KernelTierLayer
    elif gpu_reads_host and plain and triton_kernels() is not None:
        cls = MappedHostTierLayer
    if cls is TierLayer and cpu_compute and tier != "gpu" and device.type != "cpu":
        cls = CpuAttentionTierLayer
    args = (tensors, tier, compress, device, dtype, cpu_compute, timers, rotation, recent,
            prefill_temp_per_token)
    layer = cls(*args)
    if layer.int4_kernels and key.device != device and layer.pool_k is not None \
            and not layer.pool_k.is_pinned():  # the kernels cannot reach a pageable pool
        layer = TierLayer(*args)
    return layer


class TieredKVCache:
    """K/V of every layer on the tier ``tiers[i]`` gives; ``views[i]`` is what layer i attends with.

    ``num_blocks``/``block_size`` describe the block manager's pool (shared by all layers).
    With ``compress``: ``rotate`` (default on) stores K/V rotated by ``kv_rotation`` (QuaRot), which
    cuts the 4-bit error on outlier channels (without compression it would change nothing but
    float rounding, so it is off there unless asked for); ``recent_blocks`` (default
    ``DEFAULT_RECENT_BLOCKS``; 0 = off) is the per-layer capacity of the fp pool of each sequence's
    last block, one block per concurrently running sequence (the runner passes ``max_num_seqs``).
    ``specs``: each layer's ``AttentionSpec`` (None: plain), which picks a tier layer that
    computes it (``build_tier_layer``).
    ``nbytes``/``bytes_on`` count the pools at full capacity. Raises ValueError when a layer goes
    to disk and no ``offload_dir`` is given.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, tiers: list[str], compress: bool, cpu_compute: bool,
                 offload_dir: str | os.PathLike | None, timers: Timers, rotate: bool | None = None,
                 recent_blocks: int | None = None, specs: list[AttentionSpec] | None = None):
        self.num_blocks, self.block_size, self.tiers = num_blocks, block_size, list(tiers)
        self.device = resolve_device(device)
        # one block past the allocator's range: padded rows of a CUDA-graph batch write there
        lay = Layout(_kv_items(cfg, num_blocks + 1, block_size, dtype, compress))
        self.scratch_block = num_blocks
        if recent_blocks is None:
            recent_blocks = DEFAULT_RECENT_BLOCKS
        self.recent_blocks = min(recent_blocks, num_blocks) if compress else 0
        self.recent = RecentIndex(self.recent_blocks) if self.recent_blocks else None
        # the pool of a disk layer lives in host memory; its rows plus the scratch row
        self.pool_bytes = ((self.recent_blocks + 1) * block_size * cfg.num_kv_heads * cfg.head_dim * 2
                           * dtype.itemsize if self.recent_blocks else 0)
        self.layer_bytes = lay.nbytes
        self.views: list = []
        self.maps: list = []
        if "disk" in self.tiers and offload_dir is None:
            raise ValueError("the policy puts KV cache on disk (cd > 0): give an offload dir")
        self.rotate = compress if rotate is None else rotate
        rot = kv_rotation(cfg.head_dim) if self.rotate else None
        temp = prefill_temp_bytes_per_token(cfg, dtype)
        specs = specs if specs is not None else [None] * len(self.tiers)
        for i, tier in enumerate(self.tiers):
            if tier == "gpu":
                buf = torch.zeros(lay.nbytes, dtype=torch.uint8, device=self.device)
            elif tier == "cpu":
                buf = host_empty(lay.nbytes, pin=self.device.type == "cuda")
                buf.zero_()
            else:
                path = Path(offload_dir) / f"kv_{i:03d}.bin"
                path.parent.mkdir(parents=True, exist_ok=True)
                mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(lay.nbytes,))
                self.maps.append(mm)
                buf = torch.from_numpy(mm)
            t = lay.views(buf)
            if tier == "gpu" and not compress and rot is None:
                self.views.append(LayerKV(t["k"], t["v"]))
            else:
                self.views.append(build_tier_layer(t, tier, compress, self.device, dtype, cpu_compute,
                                                   timers, rot, self.recent, temp, specs[i]))

    def graphable(self) -> bool:
        """Whether a decode step can be replayed as a CUDA graph: every layer on the GPU tier and,
        for a 4-bit cache, written and read by the Triton kernels (no host work per layer)."""
        return (self.device.type == "cuda" and all(t == "gpu" for t in self.tiers)
                and all(isinstance(v, LayerKV) or v.graph_safe for v in self.views))

    def decodes_in_place(self) -> bool:
        """Whether every layer's decode attention reads the cache where it is stored, through the
        compute device's kernels: plain layers on the compute device, 4-bit layers there through
        the Triton kernels, a pinned host cache mapped into them. A decode batch of any size then
        needs no copy of its blocks (the gather path and CPU attention make one per call)."""
        return all(isinstance(v, LayerKV) or v.reads_in_place() for v in self.views)

    def graph_pool_rows(self, tables: list[list[int]], context_lens: list[int]) -> list[int] | None:
        """The pool row of each sequence of a decode step about to be replayed as a CUDA graph
        (``runtime.cuda_graphs``), assigned on the host once for all layers; rows made while their
        block already holds earlier slots are filled in every layer first, from the 4-bit values
        (eagerly, before the replay). Rows are unused (0) without a pool. None when the step must
        run eagerly: an own block another sequence also reads, or more sequences than rows."""
        if self.recent is None:
            return [0] * len(tables)
        bs = self.block_size
        if own_blocks(tables, context_lens, bs) is None:
            return None
        rows, init = self.recent.assign(tables, context_lens, [1] * len(tables), bs)
        if init:  # before any fallback: the eager path will find these rows made
            r = [rows[i] for i in init]
            ids = [tables[i][(context_lens[i] - 1) // bs] for i in init]
            on: dict = {}  # the index tensors once per device, not once per layer
            for view in self.views:
                dev = view.store_device
                if dev not in on:
                    on[dev] = (torch.tensor(r, device=dev), torch.tensor(ids, device=dev))
                view.fill_rows(*on[dev])
        return rows if min(rows) >= 0 else None

    def bytes_on(self, tier: str) -> int:
        """Bytes held on ``tier``: the stored K/V, plus the recent-block pools at full capacity
        (a disk layer's pool is in host memory, "cpu")."""
        pools = sum((t if t != "disk" else "cpu") == tier for t in self.tiers)
        return self.layer_bytes * sum(t == tier for t in self.tiers) + self.pool_bytes * pools

    @property
    def nbytes(self) -> int:
        return (self.layer_bytes + self.pool_bytes) * len(self.tiers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V, all layers, of one block (the layers' pools hold num_blocks + 1)."""
        return self.layer_bytes * len(self.tiers) // (self.num_blocks + 1)
