"""Token sampling: repetition penalty, temperature, top-k, top-p, min-p; greedy at temperature 0.

Each sequence may own a ``torch.Generator`` seeded from its request, and draws exactly one sample
from it per token, so a seeded request gives the same text alone or inside any batch.
The order of the logits processors follows Hugging Face ``generate`` (penalty, temperature, top-k,
top-p, min-p).
"""

from __future__ import annotations

import torch

from localgen.runtime.request import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    """CTRL-style penalty (Keskar et al. 2019) on one row ``[vocab]`` for tokens in ``seen``
    (prompt and output, as Hugging Face does): positive logits divided, negative multiplied."""
    idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
    vals = logits[idx]
    logits[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def filter_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on one row ``[vocab]``; removed tokens become -inf."""
    logits = logits / sp.temperature
    if 0 < sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the more likely ones already reach top_p (as transformers does)
        drop = probs.cumsum(-1) - probs >= sp.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if sp.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < sp.min_p * probs.max(), float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, sp: SamplingParams, seen: list[int],
               generator: torch.Generator | None) -> int:
    """One token id from a float32 logits row ``[vocab]``."""
    if sp.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits.clone(), seen, sp.repetition_penalty)
    if sp.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, sp), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], seen: list[list[int]],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[num_seqs, vocab]``; plain greedy rows in one argmax."""
    plain_greedy = [p.greedy and p.repetition_penalty == 1.0 for p in params]
    argmax = torch.argmax(logits, dim=-1).tolist() if any(plain_greedy) else None
    rows = logits.float().cpu() if not all(plain_greedy) else None
    return [argmax[i] if plain_greedy[i] else sample_row(rows[i], params[i], seen[i], generators[i])
            for i in range(len(params))]
