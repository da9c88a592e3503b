"""The sampling features the OpenAI server exposes: presence/frequency penalties (hand-computed
values) and log-probabilities (against transformers on the same tiny weights)."""

from __future__ import annotations

import math

import pytest
import torch

from localgen.api import LLM, Request, SamplingParams
from localgen.runtime.sampling import apply_presence_frequency_penalties, sample, sampled_logprobs
from tests.tiny_models import make_hf_model, make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("srvsamp"), "smollm")


def test_presence_and_frequency_penalties_by_hand():
    lg = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # token 1 twice, token 3 once; token 0 and 2 never generated
    out = apply_presence_frequency_penalties(lg.clone(), [1, 3, 1], presence=0.5, frequency=0.25)
    assert out.tolist() == [1.0, 2.0 - 2 * 0.25 - 0.5, 3.0, 4.0 - 0.25 - 0.5]
    neg = apply_presence_frequency_penalties(lg.clone(), [0], presence=-1.0, frequency=-0.5)
    assert neg.tolist() == [2.5, 2.0, 3.0, 4.0]


def test_penalties_count_output_not_prompt_and_change_greedy_choice():
    lg = torch.tensor([[0.0, 3.0, 2.5]])
    sp = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    # token 1 in the prompt only: not penalized, greedy keeps it
    assert sample(lg, [sp], [[1, 1]], [None], [[]]) == [1]
    # token 1 generated once: 3.0 - 1.0 < 2.5, greedy moves to token 2
    assert sample(lg, [sp], [[1, 1]], [None], [[1]]) == [2]


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.1),
                                         ("logprobs", 21), ("logprobs", -1)])
def test_validate_rejects_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_sampled_logprobs_by_hand():
    lg = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    lps = sampled_logprobs(lg, [1, 0], [SamplingParams(logprobs=2), SamplingParams()])
    assert lps[1] is None
    assert lps[0].token_id == 1 and lps[0].logprob == pytest.approx(math.log(0.75))
    assert [t for t, _ in lps[0].top] == [1, 0]
    assert lps[0].top[1][1] == pytest.approx(math.log(0.25))


def test_engine_logprobs_match_transformers(model_dir):
    llm = LLM.load(str(model_dir), device="cpu", kv_cache_memory=1 << 22)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    out = llm.generate([Request(prompt_token_ids=[5, 9, 14, 3], sampling=sp)])[0]
    assert len(out.logprobs) == len(out.token_ids) == 5
    hf = make_model("smollm")
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([[5, 9, 14, 3] + out.token_ids])).logits[0], -1)
    for i, lp in enumerate(out.logprobs):
        row = ref[3 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
    plain = llm.generate([Request(prompt_token_ids=[5, 9, 14, 3],
                                  sampling=SamplingParams(temperature=0.0, max_tokens=2))])[0]
    assert plain.logprobs is None
