"""The offloading executor: a model whose layers stream from their tiers, and a runner that
follows a ``Policy`` with FlexGen's zig-zag block schedule (§4.1-4.2, Fig. 4).

A scheduled step's sequences are cut into zig-zag blocks of ``bls = gbs * num_gpu_batches``
sequences and each zig-zag block into ``num_gpu_batches`` GPU batches of ``gbs``. For each layer
``j`` the runner starts loading layer ``j+1``'s weights (``LayerWeights.prefetch``; async on
CUDA), takes layer ``j`` (``get``), and runs it for every GPU batch of the zig-zag block before
moving on, so each load is shared by the whole zig-zag block. Hidden states of a GPU batch live
between layers on the activation tiers
(``hg``/``hc``: rows split between the compute device and host memory; ``activations``: their
copies run on side streams under the neighbouring GPU batches' compute); the KV cache is placed
by ``cg/cc/cd`` (``kv.TieredKVCache``).
"""

from __future__ import annotations

import os

import torch

from localgen.attention.spec import layer_specs
from localgen.hostmem import keep_freed_host_memory
from localgen.kv.cache import free_memory_bytes
from localgen.models.config import ModelConfig, UnsupportedModelError
from localgen.models.model import family_of, fuse_weights, packed_shorts, read_weights, warn_expanded
from localgen.models.rope import layer_rope, model_rope, step_rope
from localgen.runtime.offload.policy import Policy, assign_tiers
from localgen.runtime.cuda_graphs import GraphedModelRunner
from localgen.runtime.model_runner import ModelRunner
from localgen.runtime.offload.activations import ActivationTier
from localgen.runtime.offload.kv import TieredKVCache, kv_layer_bytes
from localgen.runtime.offload.prefill_graphs import PrefillGraphs
from localgen.runtime.offload.timers import Timers
from localgen.runtime.offload.weights import LayerWeights, compress_layer
from localgen.runtime.sequence import Sequence


class OffloadedLM:
    """A decoder-only model whose layers live on the tiers ``policy`` gives (same surface as
    ``CausalLM``: cfg, dtype, device, weight_bytes, logits, forward).

    Embeddings, final norm and lm_head stay on the compute device; decoder layers are placed at
    layer granularity by ``wg/wc/wd`` and, with ``compress_weight``, stored as 4-bit groups of 64
    along the output channels (GGUF Q4_1 tensors imported bit-exactly in their own 32-groups along
    the input channels when ``gguf_native``). Raises ValueError (disk tier without offload_dir).
    """

    def __init__(self, cfg: ModelConfig, store, dtype: torch.dtype, device: torch.device,
                 policy: Policy, offload_dir: str | os.PathLike | None = None,
                 gguf_native: bool = True):
        policy.validate()
        self.cfg, self.dtype, self.device, self.policy = cfg, dtype, torch.device(device), policy
        if cfg.moe is not None:  # its schedule streams whole dense layers
            raise UnsupportedModelError(
                f"{cfg.architecture} is a mixture-of-experts model, and the offload runtime runs "
                "dense models only; run it without offloading (no --percent or saved policy)")
        self.family = family_of(cfg)
        # on the device once: a host-to-device copy per step would break CUDA-graph capture
        rope = model_rope(cfg)
        self.inv_freq = None if rope is None else rope.to(self.device)
        self.timers = Timers(self.device)
        gopt = getattr(self.family, "GLOBAL_OPTIONAL", set())
        gnames = self.family.global_weight_names(cfg)
        # without FlexGen's compression a GGUF's matrices stay in the file's blocks on every tier
        # (and move as such), so placements and copies count the file's bytes
        packed = frozenset() if policy.compress_weight else packed_shorts(self.family, store, self.device)
        if packed:
            every = [*gnames.values(), *(n for i in range(cfg.num_layers)
                                         for n in self.family.layer_weight_names(cfg, i).values())]
            warn_expanded(store, [n for n in every if n in store], dtype)
        self.global_w = read_weights(store, gnames, gopt, dtype, self.device, packed=packed)
        tiers = assign_tiers([1] * cfg.num_layers, (policy.wg, policy.wc, policy.wd))
        native = gguf_native and policy.compress_weight and hasattr(store, "reader")

        def layer_source(i: int):
            names = self.family.layer_weight_names(cfg, i)
            if not policy.compress_weight:
                return fuse_weights(self.family, cfg, read_weights(store, names, self.family.OPTIONAL,
                                                                   dtype, torch.device("cpu"),
                                                                   packed=packed))
            w = read_weights(store, names, self.family.OPTIONAL, None, torch.device("cpu"))  # as stored
            pre = {}
            if native:
                from localgen.quant.gguf_import import gguf_int4
                pre = {k: q for k in w if (q := gguf_int4(store, names[k])) is not None}
            # quantize where it is fast: on the GPU when there is one, a block of columns at a time
            w = compress_layer(w, pre, device=self.device if self.device.type == "cuda" else None)
            return fuse_weights(self.family, cfg, w)  # fewer, longer GEMMs

        self.layers = LayerWeights(None, tiers, dtype, self.device, offload_dir, self.timers,
                                   layer_source=layer_source, num_layers=cfg.num_layers)

    def fused(self, h: torch.Tensor) -> bool:
        """Whether the layers run as fused Triton kernels (Llama family on CUDA with triton)."""
        return getattr(self.family, "fused_enabled", lambda _h: False)(h)

    def _global_bytes(self) -> int:
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes
                   for t in self.global_w.values())

    def weight_bytes(self) -> int:
        return self._global_bytes() + sum(l.nbytes for l in self.layers.layouts)

    def weight_bytes_by_tier(self) -> dict[str, int]:
        out = {t: self.layers.bytes_on(t) for t in ("gpu", "cpu", "disk")}
        out["gpu"] += self._global_bytes()
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.family.logits(self.cfg, self.global_w, hidden)

    @torch.inference_mode()
    def forward(self, token_ids, positions, kv_caches, meta) -> torch.Tensor:
        """One batch through all layers (streaming each layer once); ``CausalLM.forward``'s contract."""
        h = self.family.embed(self.cfg, self.global_w, token_ids, positions).to(self.dtype)
        rope = step_rope(self.inv_freq, positions, self.dtype, self.fused(h))
        for j, kv in enumerate(kv_caches):
            self.layers.prefetch(j + 1)
            h = self.family.layer(self.cfg, self.layers.get(j), h, layer_rope(rope, j), kv, meta)
            self.layers.release(j)
        return h


def plan_kv_blocks(cfg: ModelConfig, policy: Policy, block_size: int, dtype: torch.dtype,
                   device: torch.device, kv_cache_memory: int | None, max_useful_tokens: int) -> int:
    """KV blocks of the (tiered) KV pool: ``kv_cache_memory`` stored bytes over all tiers and
    layers,
    else a share of free compute-device memory, at most what ``max_useful_tokens`` need."""
    per_block = kv_layer_bytes(cfg, 256, block_size, dtype, policy.compress_cache) / 256 * cfg.num_layers
    budget = kv_cache_memory if kv_cache_memory is not None else free_memory_bytes(torch.device(device))
    n = int(budget // per_block)
    if kv_cache_memory is None:
        n = min(n, -(-max_useful_tokens // block_size))
    if n < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block:.0f} bytes; "
                         "raise --kv-cache-memory")
    return n


class OffloadRunner(ModelRunner):
    """``run(seqs, is_prefill) -> logits`` with the zig-zag block schedule over an OffloadedLM.

    ``graphs``: a ``GraphedModelRunner`` over the same model and cache, or None. When the policy
    keeps every weight, the cache and the activations on the GPU, the schedule has no transfer to
    overlap, and a decode step is one batch of kernels whose launches can cost more than the
    kernels themselves; such steps replay
    as CUDA graphs over all of the step's sequences at once, unless the timers are on (each term
    is then timed alone) or the cache asks for an eager step. With ``prefill_graphs`` (and
    ``graphs``), a 4-bit cache's whole-prompt prefill zig-zag blocks replay as graphs as well
    (``prefill_graphs.PrefillGraphs``).

    A decode step whose every cache layer is read in place by the compute device's kernels
    (``TieredKVCache.decodes_in_place``) runs its zig-zag block as one GPU batch: no batch's cache
    has to cross PCIe, so the GPU batches have no transfers to overlap, and a step makes one call
    per layer instead of ``num_gpu_batches``, each call's host work paid once. Each streamed layer
    still serves the whole zig-zag block before the next one;
    prefill keeps the GPU batches (their activations are what the GPU memory holds)."""

    def __init__(self, model: OffloadedLM, kv: TieredKVCache, graphs: GraphedModelRunner | None = None,
                 prefill_graphs: bool = False):
        super().__init__(model, kv)
        self.policy = model.policy
        self.timers = model.timers
        self.graphs = graphs
        self.prefill_graphs = PrefillGraphs(self) if prefill_graphs and graphs is not None else None
        self.acts = ActivationTier(self.policy.hg, self.policy.hc, self.device, self.timers)
        # host-side work each step (CPU attention, gathers, pageable copies) allocates tensors of
        # 100s of MB per layer; fresh mmaps first-touch at a fraction of reused memory's speed
        keep_freed_host_memory()

    @property
    def one_batch_decode(self) -> bool:
        """Whether decode steps run each zig-zag block as one GPU batch (class doc); asked each
        step, as
        a mapped host layer that the kernels refuse falls back to gathering."""
        return self.kv.decodes_in_place()

    # -- the zig-zag block schedule ------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """float32 logits ``[len(seqs), vocab]`` for each sequence's last token."""
        self.timers.phase = "prefill" if is_prefill else "decode"
        if not is_prefill and self.graphs is not None and not self.timers.enabled:
            logits = self.graphs.decode(seqs)
            if logits is not None:
                return logits
        pg = self.prefill_graphs if is_prefill else None
        out = []
        bls, gbs = self.policy.bls, self.policy.gbs
        if not is_prefill and self.one_batch_decode:
            gbs = bls
        for b0 in range(0, len(seqs), bls):
            zigzag_block, logits = seqs[b0:b0 + bls], None
            if pg is not None:
                logits = None if self.timers.enabled else pg.run_zigzag_block(zigzag_block)
                if logits is None:
                    pg.release()  # the eager zig-zag block may need the memory the graphs hold
            if logits is None:
                logits = self._run_zigzag_block(zigzag_block, gbs, is_prefill)
            out.append(logits)
        return torch.cat(out)

    def _run_zigzag_block(self, zigzag_block: list[Sequence], gbs: int,
                          is_prefill: bool) -> torch.Tensor:
        steps, lasts = [], []
        for i in range(0, len(zigzag_block), gbs):
            ids, pos, meta = self.prepare(zigzag_block[i:i + gbs], is_prefill)
            steps.append((ids, pos, meta))
            lasts.append(torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1)
        return self.forward_zigzag_block(steps, lasts)

    def forward_zigzag_block(self, steps: list[tuple], lasts: list[torch.Tensor]) -> torch.Tensor:
        """The zig-zag schedule over one zig-zag block: ``steps`` holds each GPU batch's packed
        ``(token_ids, positions, AttentionMetadata)``, ``lasts`` each batch's row index of its
        sequences' last tokens (int64 on the compute device). Returns float32 logits
        ``[sequences of the zig-zag block, vocab]``. No host work depends on tensor values, so a
        CUDA graph can capture it (``prefill_graphs``)."""
        m, cfg, L = self.model, self.model.cfg, self.model.cfg.num_layers
        metas, hs, ropes = [], [], []
        with self.timers.section("compute"):
            for ids, pos, meta in steps:
                metas.append(meta)
                h = m.family.embed(cfg, m.global_w, ids, pos).to(m.dtype)
                ropes.append(step_rope(m.inv_freq, pos, m.dtype, m.fused(h)))
                hs.append(self.acts.store(h, len(hs)))
        overlap = not self.timers.enabled  # timed runs measure each term alone
        if overlap:
            m.layers.prefetch(0)
        nb = len(metas)
        for j in range(L):
            if overlap:
                m.layers.prefetch(j + 1)
            w = m.layers.get(j)
            kv = self.kv.views[j]
            for k, meta in enumerate(metas):  # every GPU batch uses layer j before layer j+1
                h = self.acts.load(hs[k])
                if nb > 1:  # the next batch's activations cross PCIe under this batch's compute
                    hs[(k + 1) % nb] = self.acts.prefetch(hs[(k + 1) % nb])
                with self.timers.section("compute"):
                    h = m.family.layer(cfg, w, h, layer_rope(ropes[k], j), kv, meta)
                hs[k] = self.acts.store(h, k)
            m.layers.release(j)
        logits = []
        for k, (h, last) in enumerate(zip(hs, lasts)):
            h = self.acts.load(h)
            if k + 1 < nb:
                hs[k + 1] = self.acts.prefetch(hs[k + 1])
            with self.timers.section("compute"):
                logits.append(m.logits(h[last]))
        return torch.cat(logits)

    def memory_by_tier(self) -> dict[str, int]:
        """Bytes this runner holds per tier: weights (+ staging), KV cache, pinned activation
        buffers."""
        mem = self.model.weight_bytes_by_tier()
        st = self.model.layers.staging_bytes()
        mem["gpu"] += st["gpu"]
        mem["cpu"] += st["cpu"] + self.acts.host_bytes()
        for t in mem:
            mem[t] += self.kv.bytes_on(t)
        return mem


def build_offload(cfg: ModelConfig, store, dtype: torch.dtype, device: torch.device, policy: Policy,
                  *, offload_dir=None, gpu_memory: int | None = None, gguf_native: bool = True):
    """-> (OffloadedLM, runner_factory for ``Engine``). ``gpu_memory`` caps this process's CUDA
    allocations (``torch.cuda.set_per_process_memory_fraction``) to emulate a smaller GPU."""
    device = torch.device(device)
    if device.type == "cuda" and gpu_memory:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(idx).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_memory / total), idx)
    # on a CPU-only machine the "gpu" tier is the CPU; any placement's schedule still runs
    model = OffloadedLM(cfg, store, dtype, device, policy, offload_dir, gguf_native)

    def factory(model: OffloadedLM, engine_config, max_model_len: int) -> OffloadRunner:
        n = plan_kv_blocks(cfg, policy, engine_config.block_size, dtype, device,
                           engine_config.kv_cache_memory, engine_config.max_num_seqs * max_model_len)
        kv = TieredKVCache(cfg, n, engine_config.block_size, dtype, device,
                           policy.cache_tiers(cfg.num_layers),
                           policy.compress_cache, policy.cpu_cache_compute, offload_dir, model.timers,
                           recent_blocks=engine_config.max_num_seqs, specs=layer_specs(cfg))
        graphs = None
        if engine_config.cuda_graphs and model.layers.all_on("gpu") and policy.hg >= 1 and kv.graphable():
            graphs = GraphedModelRunner(model, kv, engine_config.max_num_seqs, max_model_len)
        prefill = engine_config.prefill_graphs and policy.compress_cache
        return OffloadRunner(model, kv, graphs, prefill_graphs=prefill)

    return model, factory
