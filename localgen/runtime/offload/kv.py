"""The paged KV cache split across tiers at layer granularity, optionally 4-bit (FlexGen §4.2, §5).

Each layer's K and V (``[num_blocks, block_size, num_kv_heads, head_dim]``, the plain layout of
``localgen.kv.cache``) live on one tier: the compute device ("gpu"), host memory ("cpu", pinned
when a GPU computes), or a file ``<offload_dir>/kv_<layer:03d>.bin`` mapped read-write ("disk"). With
``compress_cache`` they are stored as 4-bit groups of 64 along head_dim (the hidden dim), packed
uint8 plus fp16 scale/min, in every tier.

Attention for an offloaded or compressed layer (``TierKV.attend``, reached through the hook in
``localgen.kv.attention.paged_attention``):
1. new K/V are (quantized on the compute device and) written to the layer's tier at their slots;
2. decode with ``cpu_cache_compute`` and an off-GPU cache: q moves to the CPU, attention runs
   there (multi-threaded torch) over the cache in place, and only the output returns
   (FlexGen's CPU delegation: ``b*h`` activations cross PCIe instead of ``b*s*h`` cache);
3. otherwise the blocks the batch's block tables name are gathered (dequantized) onto the compute
   device and attention runs there over this local copy with remapped block tables.
A layer that is on the compute device and uncompressed gets the plain ``LayerKV`` (no hook).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from localgen.kernels import paged_attention_ref as ref
from localgen.kernels.quant_ref import GROUP_SIZE, dequantize_int4, quantize_int4
from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.models.config import ModelConfig
from localgen.runtime.offload.memory import Layout, host_empty
from localgen.runtime.offload.timers import Timers


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


class TierKV:
    """One layer's K/V on an offload tier and/or 4-bit; ``attend`` is the attention call site."""

    def __init__(self, tensors: dict[str, torch.Tensor], tier: str, compress: bool,
                 compute_device: torch.device, dtype: torch.dtype, cpu_compute: bool, timers: Timers):
        self.t, self.tier, self.compress = tensors, tier, compress
        self.device, self.dtype, self.cpu_compute, self.timers = compute_device, dtype, cpu_compute, timers
        self.store_device = tensors["k#packed" if compress else "k"].device

    # -- storage -------------------------------------------------------------------------------
    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new ``[num_tokens, num_kv_heads, head_dim]`` keys/values at flat slots."""
        off = self.store_device != k.device
        slots = slots.to(self.store_device)
        for name, x in (("k", k), ("v", v)):
            parts = dict(zip(("#packed", "#scale", "#min"), quantize_int4(x, GROUP_SIZE, dim=-1))) \
                if self.compress else {"": x.to(self.dtype)}
            for suf, src in parts.items():
                dst = self.t[name + suf]
                if off:
                    with self.timers.section("gtoc"):
                        src = src.to(self.store_device)
                with self.timers.section("ctod" if self.tier == "disk" else "compute"):
                    dst.view(-1, *dst.shape[2:]).index_copy_(0, slots, src.to(dst.dtype))

    def _blocks(self, name: str, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Blocks ``ids`` of K or V, dequantized, on ``device`` in the compute dtype."""
        ids = ids.to(self.store_device)
        term = "dtoc" if self.tier == "disk" else "compute"
        if self.compress:
            with self.timers.section(term):
                p, s, z = (self.t[name + suf][ids] for suf in ("#packed", "#scale", "#min"))
            if device != self.store_device:
                with self.timers.section("ctog"):
                    p, s, z = (x.to(device, non_blocking=True) for x in (p, s, z))
            with self.timers.section("compute"):
                return dequantize_int4(p, s, z, GROUP_SIZE, dim=-1, dtype=self.dtype)
        with self.timers.section(term):
            x = self.t[name][ids]
        if device != self.store_device:
            with self.timers.section("ctog"):
                x = x.to(device, non_blocking=True)
        return x

    # -- attention -----------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """Write k/v, then attention of q ``[num_tokens, num_heads, head_dim]`` over the cache."""
        self.write(k, v, meta.slot_mapping)
        on_cpu = (self.cpu_compute and not meta.is_prefill and self.tier != "gpu"
                  and self.device.type != "cpu")
        where = torch.device("cpu") if on_cpu else self.device
        bs = self.t["k#packed" if self.compress else "k"].shape[1]
        tables = meta.block_tables.tolist()
        used: list[int] = []
        for row, ctx in zip(tables, meta.context_lens_list):
            used += row[:-(-ctx // bs)]
        uniq = sorted(set(used))
        pos = {b: i for i, b in enumerate(uniq)}
        ids = torch.tensor(uniq, dtype=torch.long)
        local = torch.tensor([[pos.get(b, 0) for b in row] for row in tables], dtype=torch.long,
                             device=where)
        kc, vc = self._blocks("k", ids, where), self._blocks("v", ids, where)
        if on_cpu:
            with self.timers.section("gtoc"):
                qc = q.to(where)
        else:
            qc = q
        with self.timers.section("compute"):
            if meta.is_prefill:
                out = ref.paged_prefill_attention(qc, kc, vc, local, meta.context_lens_list,
                                                  meta.query_lens, scale)
            else:
                out = ref.paged_decode_attention(qc, kc, vc, local, meta.context_lens.to(where), scale)
        if on_cpu:
            with self.timers.section("ctog"):
                out = out.to(self.device)
        return out


class TieredKVCache:
    """K/V of every layer on the tier ``tiers[i]`` gives; ``views[i]`` is what layer i attends with.

    ``num_blocks``/``block_size`` describe the block manager's pool (shared by all layers).
    Raises ValueError when a layer goes to disk and no ``offload_dir`` is given.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, tiers: list[str], compress: bool, cpu_compute: bool,
                 offload_dir: str | os.PathLike | None, timers: Timers):
        self.num_blocks, self.block_size, self.tiers = num_blocks, block_size, list(tiers)
        self.device = torch.device(device)
        lay = Layout(_kv_items(cfg, num_blocks, block_size, dtype, compress))
        self.layer_bytes = lay.nbytes
        self.views: list = []
        self.maps: list = []
        if "disk" in self.tiers and offload_dir is None:
            raise ValueError("the policy puts KV cache on disk (cd > 0): give an offload dir")
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
            if tier == "gpu" and not compress:
                self.views.append(LayerKV(t["k"], t["v"]))
            else:
                self.views.append(TierKV(t, tier, compress, self.device, dtype, cpu_compute, timers))

    def bytes_on(self, tier: str) -> int:
        return self.layer_bytes * sum(t == tier for t in self.tiers)

    @property
    def nbytes(self) -> int:
        return self.layer_bytes * len(self.tiers)
