"""Token sampling: repetition, presence and frequency penalties, temperature, top-k, top-p, min-p;
greedy at temperature 0; log-probabilities of the sampled tokens.

Each sequence may own a ``torch.Generator`` seeded from its request, and draws exactly one sample
from it per token, so a seeded request gives the same text alone or inside any batch.
The order of the logits processors follows Hugging Face ``generate`` (penalty, temperature, top-k,
top-p, min-p); OpenAI's presence and frequency penalties come right after the repetition penalty.
"""

from __future__ import annotations

import torch

from localgen.runtime.request import SamplingParams, TokenLogprob


def apply_repetition_penalty(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    """CTRL-style penalty (Keskar et al. 2019) on one row ``[vocab]`` for tokens in ``seen``
    (prompt and output, as Hugging Face does): positive logits divided, negative multiplied."""
    idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
    vals = logits[idx]
    logits[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def apply_presence_frequency_penalties(logits: torch.Tensor, output: list[int], presence: float,
                                       frequency: float) -> torch.Tensor:
    """OpenAI's penalties on one row ``[vocab]``, over the tokens generated so far (not the
    prompt): ``logit -= count * frequency + (count > 0) * presence``."""
    if not output:
        return logits
    ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
    ids = ids.to(logits.device)
    logits[ids] -= counts.to(logits.device, logits.dtype) * frequency + presence
    return logits


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry of one log-softmax row ``[vocab]`` and the ``top`` largest entries."""
    alts: tuple[tuple[int, float], ...] = ()
    if top > 0:
        vals, idx = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        alts = tuple(zip(idx.tolist(), vals.tolist()))
    return TokenLogprob(token, float(logprobs[token]), alts)


def sampled_logprobs(logits: torch.Tensor, tokens: list[int],
                     params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """For each row of ``logits`` ``[num_seqs, vocab]`` whose request asked for logprobs, the
    sampled token's log-probability under the raw model distribution (no penalty, temperature or
    filter, as OpenAI reports them); None for the other rows."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if want:
        rows = torch.log_softmax(logits[want].float(), dim=-1).cpu()
        for r, i in enumerate(want):
            out[i] = token_logprob(rows[r], tokens[i], params[i].logprobs)
    return out


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


def _penalized(sp: SamplingParams) -> bool:
    return sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0


def sample_row(logits: torch.Tensor, sp: SamplingParams, seen: list[int],
               generator: torch.Generator | None, output: list[int] = ()) -> int:
    """One token id from a float32 logits row ``[vocab]``; ``seen`` is prompt and output,
    ``output`` the generated tokens only (what the presence/frequency penalties count)."""
    if sp.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits.clone(), seen, sp.repetition_penalty)
    if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0:
        logits = apply_presence_frequency_penalties(logits.clone(), list(output),
                                                    sp.presence_penalty, sp.frequency_penalty)
    if sp.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, sp), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], seen: list[list[int]],
           generators: list[torch.Generator | None],
           outputs: list[list[int]] | None = None) -> list[int]:
    """One token per row of ``logits`` ``[num_seqs, vocab]``; plain greedy rows in one argmax.
    ``outputs``: each row's generated tokens (for presence/frequency penalties; None: none)."""
    plain_greedy = [p.greedy and not _penalized(p) for p in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    argmax = torch.argmax(logits, dim=-1).tolist() if any(plain_greedy) else None
    rows = logits.float().cpu() if not all(plain_greedy) else None
    return [argmax[i] if plain_greedy[i]
            else sample_row(rows[i], params[i], seen[i], generators[i], outputs[i])
            for i in range(len(params))]
