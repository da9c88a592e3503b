"""Sampling processors against hand-computed values and Hugging Face's logits processors."""


import pytest
import torch

from localgen.runtime.detokenizer import IncrementalDetokenizer
from localgen.runtime.request import SamplingParams
from localgen.runtime.sampling import apply_repetition_penalty, filter_logits, sample


def probs(logits):
    return torch.softmax(logits, -1)


def test_top_k_keeps_k_largest():
    lg = torch.tensor([1.0, 4.0, 3.0, 2.0])
    out = filter_logits(lg, SamplingParams(top_k=2))
    assert torch.isinf(out[[0, 3]]).all() and torch.isfinite(out[[1, 2]]).all()


def test_top_p_keeps_smallest_set_reaching_p():
    lg = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(lg, SamplingParams(top_p=0.7)))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    kept = torch.isfinite(filter_logits(lg, SamplingParams(top_p=0.5)))
    assert kept.tolist() == [True, False, False, False]


def test_min_p_is_relative_to_the_top_probability():
    lg = torch.log(torch.tensor([0.6, 0.25, 0.1, 0.05]))
    kept = torch.isfinite(filter_logits(lg, SamplingParams(min_p=0.2)))  # threshold 0.12
    assert kept.tolist() == [True, True, False, False]


def test_temperature_scales_logits():
    lg = torch.tensor([1.0, 2.0])
    out = filter_logits(lg, SamplingParams(temperature=0.5))
    assert out.tolist() == [2.0, 4.0]


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    lg = torch.randn(50)
    seen = [3, 7, 7, 12]
    ours = apply_repetition_penalty(lg.clone(), seen, 1.3)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), lg[None].clone())[0]
    torch.testing.assert_close(ours, ref)


def test_seeded_sampling_is_independent_of_batch_neighbours():
    lg = torch.randn(3, 100)
    sp = SamplingParams(temperature=1.0, seed=5)
    alone = sample(lg[1:2], [sp], [[]], [torch.Generator().manual_seed(5)])
    other = SamplingParams(temperature=0.9)
    batch = sample(lg, [other, sp, other], [[], [], []],
                   [torch.Generator().manual_seed(1), torch.Generator().manual_seed(5), None])
    assert batch[1] == alone[0]


def test_sampling_frequencies_follow_the_distribution():
    p = torch.tensor([0.7, 0.2, 0.1])
    g = torch.Generator().manual_seed(0)
    draws = [sample(torch.log(p)[None], [SamplingParams()], [[]], [g])[0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 3000
    assert torch.allclose(freq, p, atol=0.03)


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_k", -2),
                                          ("min_p", 1.5), ("max_tokens", 0), ("stop", [""])])
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


class CharTokenizer:
    """One character per token id (ord), enough to test detokenization."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_string_across_token_boundaries_is_never_streamed():
    d = IncrementalDetokenizer(CharTokenizer(), stop=("END",))
    streamed, ids = "", []
    for ch in "abc EN":
        ids.append(ord(ch))
        delta, hit = d.update(ids)
        streamed += delta
        assert not hit
    assert streamed == "abc "  # "EN" is held back: it may become "END"
    ids.append(ord("D"))
    delta, hit = d.update(ids)
    assert hit and streamed + delta == "abc "


def test_held_back_text_is_released_when_it_does_not_stop():
    d = IncrementalDetokenizer(CharTokenizer(), stop=("END",))
    ids = [ord(c) for c in "xEN"]
    assert d.update(ids)[0] == "x"
    ids.append(ord("Q"))
    assert d.update(ids)[0] == "ENQ"
    assert d.update(ids + [ord("E")], final=True)[0] == "E"
