"""What every layer of the tiered KV cache derives once a step (``TierStepPlan``), and the masks and
pool slots of the recent-block pool (``recent_mask``, ``kept_tokens``, ``StaticPrefill``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localgen.attention.metadata import AttentionMetadata, pool_slot
from localgen.runtime.offload.recent import own_blocks, used_blocks


def whole_prompts(meta: AttentionMetadata) -> bool:
    """A prefill step with nothing cached before any of its prompts (context = query)."""
    return meta.is_prefill and meta.context_lens_list == list(meta.query_lens)



class TierStepPlan:
    """What every layer of one step reads, built once per step from its ``AttentionMetadata``:
    the blocks to gather (``ids``, sorted, CPU int64), each sequence's table remapped onto them
    (``local``), and for a decode step whose own (last) blocks are not shared, ``decode`` =
    (own block id, offset of the new token in it) per sequence, with ``decode_local`` (the own
    blocks' local indices) and ``decode_dst`` (the new tokens' flat local slots); ``assigned``:
    the step's pool rows once the first layer has asked (``RecentPoolAttention._assign_rows``), and ``prior``
    the rows the step found (read by every layer of a general step)."""

    def __init__(self, meta: AttentionMetadata, bs: int):
        self.tables = meta.block_tables.tolist()
        used = used_blocks(self.tables, meta.context_lens_list, bs)
        uniq = sorted(set(used))
        pos = {b: i for i, b in enumerate(uniq)}
        self.ids = torch.tensor(uniq, dtype=torch.long)
        self.block_range = (uniq[0], uniq[-1] + 1) if uniq else (0, 0)  # [first, last] block read
        self.local = [[pos.get(b, 0) for b in row] for row in self.tables]
        self._on: dict = {}  # device-side copies made once a step, by device (and key)
        self._tensors: dict = {}
        self.decode = None
        self.assigned: tuple[list[int], list[int]] | None = None
        self.prior: list[int | None] | None = None  # pool rows before ``assigned`` (general steps)
        if not meta.is_prefill and all(ql == 1 for ql in meta.query_lens):
            own = own_blocks(self.tables, meta.context_lens_list, bs, used)
            if own is not None:
                offs = [(c - 1) % bs for c in meta.context_lens_list]
                self.decode = (own, offs)
                self.decode_local = [pos[b] for b in own]
                self.decode_dst = [li * bs + o for li, o in zip(self.decode_local, offs)]

    def tensor(self, key: str, values: list[int], device: torch.device) -> torch.Tensor:
        """``values`` as an int64 tensor on ``device``, reused while the same values are asked
        for under ``key`` (the layers of a step ask for the same ones: one host->device copy)."""
        hit = self._tensors.get((key, device))
        if hit is not None and hit[0] == values:
            return hit[1]
        t = torch.tensor(values, dtype=torch.long, device=device)
        self._tensors[(key, device)] = (values, t)
        return t

    def _once(self, key: tuple, make):
        """``make()`` the first time a layer of the step asks for ``key``, then the same tensor."""
        if key not in self._on:
            self._on[key] = make()
        return self._on[key]

    def ids_on(self, device: torch.device) -> torch.Tensor:
        """``ids`` on ``device`` (each layer's gather reads them)."""
        return self._once(("ids", device), lambda: self.ids.to(device))

    def local_on(self, device: torch.device) -> torch.Tensor:
        return self._once(("local", device),
                          lambda: torch.tensor(self.local, dtype=torch.long, device=device))

    def tables_from(self, lo: int, block_tables: torch.Tensor) -> torch.Tensor:
        """The step's block tables (``meta.block_tables``) shifted onto a copy of blocks ``lo``
        onward (``Int4KernelTierLayer._staged``; entries past a context, unread, clamped to 0), made once a step."""
        return self._once(("tables_from", lo, block_tables.device),
                          lambda: (block_tables - lo).clamp_(min=0))

    def recent_mask(self, a: int, ctx: int, bs: int, device: torch.device) -> torch.Tensor:
        """``recent_mask``, made once a step."""
        return self._once(("recent_mask", a, ctx, device), lambda: recent_mask(a, ctx, bs, device))



def recent_mask(a: int, ctx: int, bs: int, device: torch.device) -> torch.Tensor:
    """Mask of queries at positions ``a .. ctx-1`` over a sequence's 4-bit keys ``0 .. ctx-1``
    followed by its fp keys ``s0 .. ctx-1`` (``s0`` the first slot of the first query's block):
    query p sees 4-bit keys before its own block and fp keys of its block up to p
    (``RecentPoolAttention._attend_recent_*``). A whole prompt of L tokens: ``[L, 2L]`` bool."""
    qpos = torch.arange(a, ctx, device=device)[:, None]
    own = (qpos // bs) * bs  # first position of each query's own block
    jq = torch.arange(ctx, device=device)[None, :]
    jf = torch.arange((a // bs) * bs, ctx, device=device)[None, :]
    return torch.cat([jq < own, (jf >= own) & (jf <= qpos)], dim=1)



def kept_tokens(rows: list[int], context_lens: list[int], query_lens: list[int],
                bs: int) -> tuple[list[int], list[int]]:
    """What a step puts into the recent-block pool: the flat pool slots (``pool_slot``) and the
    step's packed token indices of each sequence's new tokens in its last block, for the
    sequences with a pool row (``rows[i] >= 0``)."""
    slots, toks, start = [], [], 0
    for r, ctx, ql in zip(rows, context_lens, query_lens):
        j = (ctx - 1) // bs
        first = max(ctx - ql, j * bs)
        if r >= 0:
            slots += range(pool_slot(r, first - j * bs, bs), pool_slot(r, ctx - j * bs, bs))
            toks += range(start + first - (ctx - ql), start + ql)
        start += ql
    return slots, toks



@dataclass
class StaticPrefill:
    """A whole-prompt prefill batch replayed as a CUDA graph (``runtime.offload.prefill_graphs``):
    its pool writes settled on the host before the replay, so no layer plans on the host.

    keep_slots: ``[n_keep]`` int64 flat pool slots (``kept_tokens``; sequences without a row
    write the scratch row), on the store device. keep_tokens: ``[n_keep]`` int64 packed token
    indices of this batch. mask: ``[L, 2L]`` bool ``recent_mask`` of the batch's prompt length."""

    keep_slots: torch.Tensor
    keep_tokens: torch.Tensor
    mask: torch.Tensor
