"""The paged KV cache tensors and how many blocks fit in memory.

Layout per layer, for K and for V: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a KV
block is ``block_size`` (16 by default) tokens of one sequence (PagedAttention §4.1). Each KV group
(``localgen.kv.groups``) has its own pool, so ``num_blocks`` is per group: a sliding-window
group's pool is sized for windows (``plan_group_blocks``).
"""

from __future__ import annotations

import math
import mmap
from typing import Protocol, Sequence

import psutil
import torch

from localgen.kv.attention import LayerKV
from localgen.kv.groups import KVGroup

# Share of free memory the cache may take when the user gives no --kv-cache-memory.
GPU_FREE_FRACTION = 0.9
CPU_AVAILABLE_FRACTION = 0.25
CPU_DEFAULT_CAP = 2 << 30  # host RAM is shared with everything else; --kv-cache-memory lifts it


class KVShape(Protocol):
    """The shape of a model's KV cache: what the cache needs to know of the model (a
    ``ModelConfig`` is one). K and V of one token take ``num_kv_heads * head_dim`` elements each
    in every one of ``num_layers`` layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def bytes_per_block(shape: KVShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of all layers for one KV block of ``block_size`` tokens."""
    esize = torch.tensor([], dtype=dtype).element_size()
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * esize * block_size


def free_memory_bytes(device: torch.device, reserve_bytes: int = 0) -> int:
    """Bytes the KV cache may take by default: a share of free CUDA memory, or of available host
    RAM (capped at CPU_DEFAULT_CAP). On CUDA ``reserve_bytes`` are kept free first."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int((free - reserve_bytes) * GPU_FREE_FRACTION)
    return min(int(psutil.virtual_memory().available * CPU_AVAILABLE_FRACTION), CPU_DEFAULT_CAP)


def plan_num_blocks(shape: KVShape, block_size: int, dtype: torch.dtype, device: torch.device,
                    kv_cache_memory: int | None, max_useful_tokens: int,
                    reserve_bytes: int = 0) -> int:
    """Blocks to allocate: ``kv_cache_memory`` bytes if given, else a share of free memory after
    ``reserve_bytes`` (activations, CUDA-graph pools), never more than ``max_useful_tokens`` need
    (max_num_seqs full contexts).

    Raises ValueError when the budget holds less than one block.
    """
    per_block = bytes_per_block(shape, block_size, dtype)
    budget = _budget(device, kv_cache_memory, reserve_bytes)
    n = budget // per_block
    if kv_cache_memory is None:
        n = min(n, -(-max_useful_tokens // block_size))
    if n < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
                         "raise --kv-cache-memory")
    return int(n)


def _budget(device: torch.device, kv_cache_memory: int | None, reserve_bytes: int) -> int:
    """Bytes the cache may take: ``kv_cache_memory`` if given, else ``free_memory_bytes``."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    return max(0, free_memory_bytes(device, reserve_bytes))


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int) -> int:
    """Blocks a sliding group of ``window`` tokens in a model of several KV groups can use:
    ``ceil(window / block_size) + 1`` per sequence (what a sequence keeps from its prefill on,
    ``localgen.kv.groups``), whatever ``max_model_len``, plus the placeholder released table
    entries point at."""
    return max_num_seqs * (-(-window // block_size) + 1) + 1


def plan_group_blocks(shape: KVShape, groups: Sequence[KVGroup], block_size: int,
                      dtype: torch.dtype, device: torch.device, kv_cache_memory: int | None,
                      max_num_seqs: int, max_model_len: int, reserve_bytes: int = 0) -> list[int]:
    """Blocks of each KV group's pool, in group order. One group: ``plan_num_blocks`` over
    ``max_num_seqs`` full contexts. Several: the largest ``n`` whose pools fit the budget, a
    full-attention group taking ``n`` blocks (at most ``max_num_seqs`` contexts when the budget is
    free memory) and a sliding group ``min(n, window_pool_blocks(...))``; a pool's block holds
    its group's layers only. Raises ValueError when the budget holds no block of every group."""
    if len(groups) == 1:
        return [plan_num_blocks(shape, block_size, dtype, device, kv_cache_memory,
                                max_num_seqs * max_model_len, reserve_bytes)]
    per_layer = bytes_per_block(shape, block_size, dtype) // shape.num_layers
    budget = _budget(device, kv_cache_memory, reserve_bytes)
    caps = [None if g.window is None else
            window_pool_blocks(g.window, block_size, max_num_seqs) for g in groups]

    def counts(n: int) -> list[int]:
        return [n if cap is None else min(n, cap) for cap in caps]

    def cost(n: int) -> int:
        return per_layer * sum(len(g.layers) * c for g, c in zip(groups, counts(n)))

    hi = budget // per_layer
    if kv_cache_memory is None:
        hi = min(hi, -(-max_num_seqs * max_model_len // block_size))
    lo = 0
    while lo < hi:  # the largest n with cost(n) <= budget; cost grows with n
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    if lo < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of "
                         f"{per_layer * shape.num_layers} bytes (one of each KV group's); "
                         "raise --kv-cache-memory")
    return counts(lo)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of ``shape``. On the CPU it lives in an anonymous memory map: the kernel
    hands out zero pages on first write, so a cache sized for many long sequences takes RAM only
    for the blocks that are used, and nothing is zero-filled up front. Elsewhere ``torch.zeros``
    (a device memset is fast; its memory is committed at once)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the map alive
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


class PagedKVCache:
    """K and V tensors for every layer; ``layer(i)`` is the view the model's layer ``i`` gets.
    On the CPU the blocks take memory as they are first written (``lazy_zeros``).

    ``groups``: the layers' KV groups (``localgen.kv.groups.kv_groups``), each with its own pool
    of ``num_blocks[g]`` blocks, one tensor ``[layers, 2, num_blocks[g] + 1, block_size,
    num_kv_heads, head_dim]``; None = one group of every layer (``num_blocks`` may then be an
    int). Raises ValueError when the groups do not cover every layer once or the counts do not
    match them."""

    def __init__(self, shape: KVShape, num_blocks: int | Sequence[int], block_size: int,
                 dtype: torch.dtype, device: torch.device, groups: Sequence[KVGroup] | None = None):
        groups = tuple(groups or (KVGroup(None, tuple(range(shape.num_layers))),))
        counts = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        _check_groups(groups, counts, shape.num_layers)
        self.groups, self.group_blocks, self.block_size = groups, tuple(counts), block_size
        self.tensors: list[torch.Tensor] = []
        self.views: list[LayerKV] = [None] * shape.num_layers  # type: ignore[list-item]
        for g, (group, n) in enumerate(zip(groups, counts)):
            # one extra block past the allocator's range, written and never read: padded rows of
            # a CUDA-graph batch and a sliding group's prefill K/V behind the window go there
            dims = (len(group.layers), 2, n + 1, block_size, shape.num_kv_heads, shape.head_dim)
            data = lazy_zeros(dims, dtype, device)
            self.tensors.append(data)
            for j, layer in enumerate(group.layers):
                self.views[layer] = LayerKV(data[j, 0], data[j, 1], data[j], kv_group=g)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_blocks(self) -> int:
        """Blocks every group's pool has: the block ids one table may address in each."""
        return min(self.group_blocks)

    @property
    def scratch_block(self) -> int:
        """The block past group 0's allocator range (CUDA graphs replay one-group caches only)."""
        return self.group_blocks[0]

    def group_scratch_block(self, group: int) -> int:
        """The block past KV group ``group``'s allocator range (written, never read)."""
        return self.group_blocks[group]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V, all layers, of one block: what a block of tokens costs held in every
        group (a sliding group holds a prompt's blocks of its window only)."""
        return sum(self.group_block_bytes)

    @property
    def group_block_bytes(self) -> list[int]:
        """Bytes of one block of each group's pool (K and V of the group's layers)."""
        return [t[:, :, 0].numel() * t.element_size() for t in self.tensors]


def _check_groups(groups: Sequence[KVGroup], counts: list[int], num_layers: int) -> None:
    layers = sorted(i for g in groups for i in g.layers)
    if layers != list(range(num_layers)):
        raise ValueError(f"KV groups must hold each of {num_layers} layers once, got {groups}")
    if len(counts) != len(groups) or min(counts) < 1:
        raise ValueError(f"PagedKVCache needs one block count >= 1 per KV group: {len(groups)} "
                         f"groups, counts {counts}")


def activation_reserve_bytes(cfg, max_num_batched_tokens: int, max_num_seqs: int,
                             dtype: torch.dtype) -> int:
    """GPU memory (bytes) to leave free beside the cache, for a model of ``cfg``'s shapes (a
    ``ModelConfig``: hidden_size, q_size, kv_size, intermediate_size, vocab_size): a prefill's
    activations at ``max_num_batched_tokens`` (residual, q/k/v, gated MLP), the logits of a full
    decode batch in float32 (twice: graph outputs and sampling), and 256 MiB for CUDA-graph
    pools."""
    esize = torch.tensor([], dtype=dtype).element_size()
    per_token = 4 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size
    logits = 2 * max_num_seqs * cfg.vocab_size * 4
    return max_num_batched_tokens * per_token * esize * 2 + logits + (256 << 20)
