"""The paged KV cache tensors and how many blocks fit in memory.

Layout per layer, for K and for V: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a KV
block is ``block_size`` (16 by default) tokens of one sequence (PagedAttention §4.1).
"""

from __future__ import annotations

import math
import mmap
from typing import Protocol

import psutil
import torch

from localgen.kv.attention import LayerKV

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
    budget = kv_cache_memory if kv_cache_memory is not None else max(
        0, free_memory_bytes(device, reserve_bytes))
    n = budget // per_block
    if kv_cache_memory is None:
        n = min(n, -(-max_useful_tokens // block_size))
    if n < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
                         "raise --kv-cache-memory")
    return int(n)


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
    On the CPU the blocks take memory as they are first written (``lazy_zeros``)."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        # one extra block past the allocator's range: padded rows of a CUDA-graph batch write there
        dims = (shape.num_layers, 2, num_blocks + 1, block_size, shape.num_kv_heads, shape.head_dim)
        self.data = lazy_zeros(dims, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks
        self.views = [LayerKV(self.data[i, 0], self.data[i, 1], self.data[i])
                      for i in range(shape.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V, all layers, of one block (what each block of a budget costs)."""
        return self.data[:, :, 0].numel() * self.data.element_size()


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
