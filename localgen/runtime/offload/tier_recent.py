"""The recent-block pool's attention (KIVI, Liu et al. 2024, §3.3, at block granularity): each query
reads the keys/values of its own block in full precision from a small fp pool and every earlier
block 4-bit (``localgen.runtime.offload.kv`` describes the pool and its invariant).
``RecentPoolAttention`` is the part of a tiered layer (``tier_layer.TierLayer``) that keeps the
pool and attends through it."""

from __future__ import annotations

import torch

from localgen.attention.metadata import pool_slot
from localgen.attention.prefill import equal_runs
from localgen.attention.triton import triton_kernels
from localgen.kernels import paged_attention_ref as ref
from localgen.runtime.offload.tier_plan import TierStepPlan, kept_tokens


class RecentPoolAttention:
    """Pool upkeep and pool-reading attention of one 4-bit layer. Needs, from the layer:
    ``block_size``, ``kv_heads``, ``dtype``, ``device``, ``store_device``, ``recent`` (the
    cache's ``RecentIndex``), ``pool_k``/``pool_v`` and ``_blocks``, ``_settle_host``,
    ``_host_mapped``."""

    def fill_rows(self, rows: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Pool rows made while their block already holds slots start from its 4-bit values
        (``rows``, ``block_ids``: int64 on the store device)."""
        dev = self.store_device
        self.pool_k[rows], self.pool_v[rows] = self._blocks("k", block_ids, dev), self._blocks("v", block_ids, dev)

    def _fill_new_rows(self, plan: TierStepPlan, rows: list[int], block_ids: list[int]) -> None:
        """``fill_rows`` for this step's new rows, their index tensors copied once a step."""
        dev = self.store_device
        self.fill_rows(plan.tensor("init_rows", rows, dev), plan.tensor("init_ids", block_ids, dev))

    def _attend_recent(self, q, k, v, kc, vc, plan: TierStepPlan, meta, scale, where, assigned=None):
        """Attention where each query reads its own block in fp and earlier blocks 4-bit; the pool
        keeps each sequence's last block (module docstring). Same shapes as ``TierLayer.forward``; ``kc``/``vc``
        are the gathered, dequantized blocks ``[len(plan.ids), block_size, kvh, d]`` (this call's
        own copy: own blocks are overwritten in place in decode).

        Pool invariant: a row holds, for every slot of its block written so far, the fp value, or
        the 4-bit one where the row was (re)made after the slot was written (eviction, prefix
        cache), so a row is read whole, with no per-slot mask. ``assigned``: this step's
        ``_assign_rows`` result when the caller already made it (it must run once a step)."""
        if plan.decode is None:
            out = self._attend_recent_general(q, k, v, kc, vc, plan, meta, scale, where)
            self._keep_recent(plan, meta, k, v)
            return out
        offs = plan.decode[1]
        rows, init = assigned or self._assign_rows(plan, meta)
        dev = self.store_device
        if init:
            self._fill_new_rows(plan, [rows[i] for i in init], [plan.decode[0][i] for i in init])
        have = [i for i, r in enumerate(rows) if r >= 0]
        if len(have) == len(rows):  # the usual case: this step's token into the pool, the rows out
            r_t = plan.tensor("rows", rows, dev)
            self._pool_put(plan.tensor("pool_slots", self._pool_slots(rows, offs), dev), k, v)
            li = plan.tensor("own_local", plan.decode_local, where)
            self._settle_host()
            kc[li], vc[li] = self.pool_k[r_t].to(where), self.pool_v[r_t].to(where)
        else:  # more sequences than pool rows: those without one read only this token in fp
            d_t = plan.tensor("dst", plan.decode_dst, where)
            kc.view(-1, *kc.shape[2:]).index_copy_(0, d_t, k.to(where, self.dtype))
            vc.view(-1, *vc.shape[2:]).index_copy_(0, d_t, v.to(where, self.dtype))
            if have:
                r_have = [rows[i] for i in have]
                r_t = plan.tensor("rows", r_have, dev)
                slots = self._pool_slots(r_have, [offs[i] for i in have])
                t_t = plan.tensor("have", have, k.device)
                self._pool_put(plan.tensor("pool_slots", slots, dev), k[t_t], v[t_t])
                li = plan.tensor("own_local", [plan.decode_local[i] for i in have], where)
                self._settle_host()
                kc[li], vc[li] = self.pool_k[r_t].to(where), self.pool_v[r_t].to(where)
        return ref.paged_decode_attention(q, kc, vc, plan.local_on(where), meta.context_lens.to(where), scale)

    def _own_region(self, i: int, r: int | None, row: list[int], ctx: int, ql: int, start: int, kc,
                    vc, local, k: torch.Tensor, v: torch.Tensor, where: torch.device):
        """Sequence ``i``'s own-block region in fp: positions ``bs * (a // bs) .. ctx-1`` (a = its
        first query position) as ``[n, kv_heads, head_dim]`` K and V on ``where``: the first own
        block's slots written before this step from its pool row ``r`` (as the step found it) if it
        has one (else their 4-bit values), then this step's new tokens ``k/v[start:start+ql]``."""
        bs, a = self.block_size, ctx - ql
        j0 = a // bs
        new_k, new_v = k[start:start + ql].to(where, self.dtype), v[start:start + ql].to(where, self.dtype)
        n0 = a - j0 * bs  # earlier slots of the first own block
        if n0 == 0:
            return new_k, new_v
        if r is not None:
            pk, pv = self.pool_k[r, :n0].to(where), self.pool_v[r, :n0].to(where)
        else:
            pk, pv = kc[local[i][j0], :n0], vc[local[i][j0], :n0]
        return torch.cat([pk, new_k]), torch.cat([pv, new_v])

    def _attend_recent_fresh(self, q, k, v, k4, v4, meta, scale, mask_for):
        """Whole prompts (nothing cached before them): ``_attend_recent_general``'s masked
        attention with no pool row to read, over ``k4``/``v4`` (the 4-bit values just stored,
        token for token like k/v), each run of equal-length prompts in one SDPA call (a prefill
        of 4 x 512 tokens is one call per layer, not one per sequence); ``mask_for(L)`` is the
        ``[L, 2L]`` ``recent_mask`` of an L-token prompt."""
        num_heads = q.shape[1]
        out, start = torch.empty_like(q), 0
        for i, j in equal_runs(list(meta.query_lens)):
            n, L = j - i, meta.query_lens[i]
            end = start + n * L
            shape = (n, L, *k.shape[1:])
            fk, fv = (x[start:end].to(self.dtype).view(shape) for x in (k, v))
            keys = torch.cat([k4[start:end].view(shape), fk], 1)
            vals = torch.cat([v4[start:end].view(shape), fv], 1)
            # [n, kvh, 2L, d]
            keys, vals = keys.transpose(1, 2).to(q.dtype), vals.transpose(1, 2).to(q.dtype)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start:end].view(n, L, num_heads, -1).transpose(1, 2), keys, vals, attn_mask=mask_for(L),
                scale=scale, enable_gqa=self.kv_heads != num_heads)
            out[start:end] = o.transpose(1, 2).reshape(n * L, num_heads, -1)
            start = end
        return out

    def _attend_recent_general(self, q, k, v, kc, vc, plan, meta, scale, where):
        """Any batch (prefill, several queries per sequence, shared own blocks): per sequence, one
        SDPA over its 4-bit context followed by its own-block region in fp, masked so that a query
        at position p sees 4-bit keys before its block and fp keys of its block up to p."""
        bs, num_heads = self.block_size, q.shape[1]
        if plan.prior is None:  # the rows as the step found them: later layers see the same
            assert plan.assigned is None, "pool rows read after the step assigned them"
            plan.prior = [self.pool_rows.get(row[(ctx - ql) // bs]) for row, ctx, ql
                          in zip(plan.tables, meta.context_lens_list, meta.query_lens)]
        prior = plan.prior
        outs, start = [], 0
        for i, (row, ctx, ql) in enumerate(zip(plan.tables, meta.context_lens_list, meta.query_lens)):
            a = ctx - ql
            fk, fv = self._own_region(i, prior[i], row, ctx, ql, start, kc, vc, plan.local, k, v, where)
            ids = plan.tensor(f"ctx{i}", plan.local[i][:-(-ctx // bs)], where)
            keys = torch.cat([kc[ids].flatten(0, 1)[:ctx], fk]).transpose(0, 1)  # [kvh, 2ctx - s0, d], s0 = the own region's first slot
            vals = torch.cat([vc[ids].flatten(0, 1)[:ctx], fv]).transpose(0, 1)
            mask = plan.recent_mask(a, ctx, bs, where)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start:start + ql].transpose(0, 1), keys.to(q.dtype), vals.to(q.dtype),
                attn_mask=mask, scale=scale, enable_gqa=self.kv_heads != num_heads)
            outs.append(o.transpose(0, 1))
            start += ql
        return torch.cat(outs)

    def _keep_recent(self, plan: TierStepPlan, meta, k: torch.Tensor, v: torch.Tensor) -> None:
        """After a general step: pool this step's tokens of each sequence's last block."""
        bs, dev = self.block_size, self.store_device
        rows, init = self._assign_rows(plan, meta)
        if init:
            self._fill_new_rows(plan, [rows[i] for i in init],
                                [plan.tables[i][(meta.context_lens_list[i] - 1) // bs] for i in init])
        slots, t_l = kept_tokens(rows, meta.context_lens_list, meta.query_lens, bs)
        if slots:
            t_t = plan.tensor("keep_toks", t_l, k.device)
            self._pool_put(plan.tensor("keep_slots", slots, dev), k[t_t], v[t_t])

    def _pool_slots(self, rows: list[int], offs: list[int]) -> list[int]:
        """Flat pool slots (``attention.pool_slot``) of ``rows`` at ``offs``."""
        return [pool_slot(r, o, self.block_size) for r, o in zip(rows, offs)]

    def _pool_put(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write fp K/V ``[n, kv_heads, head_dim]`` into the pool at flat slots ``slots``."""
        if self._host_mapped():  # the pinned pool, written by the kernel like the mapped fp cache
            triton_kernels()[2].write_kv(self.pool_k, self.pool_v, k, v, slots.to(self.device))
            return
        for pool, x in ((self.pool_k, k), (self.pool_v, v)):
            pool.view(-1, *pool.shape[2:])[slots] = x.to(self.store_device, self.dtype)

    def _assign_rows(self, plan: TierStepPlan, meta) -> tuple[list[int], list[int]]:
        """This step's pool rows (``RecentIndex.assign``), decided once by the first layer that
        asks and kept on the step's plan for the others."""
        if plan.assigned is None:
            plan.assigned = self.recent.assign(plan.tables, meta.context_lens_list, meta.query_lens,
                                               self.block_size)
        return plan.assigned
