"""`localgen bench perplexity`: llama-perplexity's windows (second halves scored, BOS first when
the file asks for it) and reading its final estimate."""

from __future__ import annotations

import math

import pytest
import torch

from localgen.bench import perplexity_bench as pb
from localgen.bench.llama_cpp_peer import PeerError


def test_half_windows_score_the_second_half_with_bos_first(monkeypatch):
    seen = []
    vocab = 10

    def logits(llm, window):
        seen.append(list(window))
        out = torch.zeros(len(window), vocab)
        out[:, 3] = math.log(9.0)  # p(3) = 9/18 = 1/2, every other token 1/18
        return out

    monkeypatch.setattr(pb, "full_logits", logits)
    tokens = [3, 3, 5, 3, 3, 3, 7, 3, 3, 3, 2, 1, 4]  # three whole windows of 4; the last token left out
    ppl, n = pb.half_window_perplexity(None, tokens, ctx=4, chunks=5, bos=0)
    assert seen == [[0, 3, 5, 3], [0, 3, 7, 3], [0, 3, 2, 1]]
    # scored: positions 2..2 of each window predict token 3, 3, 1 -> p = 1/2, 1/2, 1/18
    assert n == 3
    assert ppl == pytest.approx(math.exp((2 * math.log(2) + math.log(18)) / 3))
    with pytest.raises(ValueError, match="no window"):
        pb.half_window_perplexity(None, tokens[:3], ctx=4, chunks=1)


def test_parse_llama_perplexity():
    out = "perplexity: 2.51 seconds per pass\n[1]23.1,[2]23.7,\nFinal estimate: PPL = 23.6998 +/- 1.83\n"
    assert pb.parse_llama_perplexity(out) == 23.6998
    with pytest.raises(PeerError, match="final estimate"):
        pb.parse_llama_perplexity("llama_model_load: error loading model")
