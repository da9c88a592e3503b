"""A GGUF under the offloading runtime: its matrices stay in the file's blocks on every tier
(GPU, pinned CPU, disk files), so a placement holds and moves the file's bytes, and the policy
search counts those bytes (issue 27, item 3)."""

from __future__ import annotations

import pytest
import torch

from localgen.api import LLM, Request, SamplingParams
from localgen.models.gguf_source import GGUFStore
from localgen.policy import Policy
from localgen.quant import gguf_blocks as gb
from tests.test_gguf_packed import PROMPT, Q4_K_M, reference_only, write_random_gguf  # noqa: F401

KV = 1 << 22


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    return write_random_gguf(tmp_path_factory.mktemp("gguf_offload") / "q4km.gguf", Q4_K_M)


def _policy(w, c=(1, 0, 0), **kw) -> Policy:
    return Policy(gbs=2, num_gpu_batches=1, wg=w[0], wc=w[1], wd=w[2], cg=c[0], cc=c[1], cd=c[2],
                  hg=1, hc=0, **kw).validate()


def _greedy(llm: LLM, n: int = 16) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([Request(prompt_token_ids=PROMPT, sampling=sp),
                         Request(prompt_token_ids=PROMPT[::-1] * 2, sampling=sp)])
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("w", [(0, 1, 0), (0, 0, 1), (0.5, 0, 0.5)], ids=["cpu", "disk", "gpu_disk"])
def test_offloaded_gguf_keeps_the_file_blocks_and_decodes_as_resident(q4km, tmp_path, monkeypatch,
                                                                      reference_only, w):
    monkeypatch.setenv("LOCALGEN_GGUF_PACKED", "1")
    resident = LLM.load(str(q4km), device="cpu", dtype="float32", kv_cache_memory=KV)
    want = _greedy(resident)
    llm = LLM.load(str(q4km), device="cpu", dtype="float32", kv_cache_memory=KV,
                   policy=_policy(w), offload_dir=str(tmp_path / "off"))
    model = llm.engine.model
    layer = model.layers.get(0)
    assert isinstance(layer["o"], gb.PackedGGUFWeight) and isinstance(layer["down"], gb.PackedGGUFWeight)
    assert isinstance(model.global_w["lm_head"], gb.PackedGGUFWeight)
    assert _greedy(llm) == want and len(set(want[0])) > 3
    file_bytes = GGUFStore(q4km).total_nbytes()
    by_tier = model.weight_bytes_by_tier()
    # each layer's flat buffer aligns its tensors to 64 bytes: a few hundred bytes a layer
    assert file_bytes <= sum(by_tier.values()) <= 1.05 * file_bytes, (by_tier, file_bytes)
    if w[2]:
        files = sorted((tmp_path / "off").glob("layer_*.bin"))
        assert sum(f.stat().st_size for f in files) == by_tier["disk"]


def test_offloaded_gguf_with_a_4bit_kv_cache(q4km, tmp_path, monkeypatch, reference_only):
    """FlexGen's 4-bit KV cache beside GGUF blocks: the same tokens as the expanded weights under
    the same 4-bit cache (the reference matmul multiplies the same float32 values)."""
    runs = []
    for env in ("1", "0"):
        monkeypatch.setenv("LOCALGEN_GGUF_PACKED", env)
        llm = LLM.load(str(q4km), device="cpu", dtype="float32", kv_cache_memory=KV,
                       policy=_policy((0, 1, 0), c=(0, 1, 0), compress_cache=True),
                       offload_dir=str(tmp_path / env))
        runs.append((_greedy(llm), llm.engine.model.weight_bytes()))
    (tokens, packed_bytes), (want, dense_bytes) = runs
    assert tokens == want and len(set(want[0])) > 3
    assert packed_bytes * 3 < dense_bytes


def test_compressed_policy_on_a_gguf_still_quantizes_to_flexgen_groups(q4km, tmp_path, monkeypatch):
    """``compress_weight`` keeps its meaning (FlexGen's g=64 4-bit groups) on any checkpoint."""
    monkeypatch.setenv("LOCALGEN_GGUF_PACKED", "1")
    llm = LLM.load(str(q4km), device="cpu", dtype="float32", kv_cache_memory=KV,
                   policy=_policy((0, 1, 0), compress_weight=True), offload_dir=str(tmp_path / "o"))
    qmeta = llm.engine.model.layers.qmeta[0]
    assert qmeta and all(m[0] == 64 for m in qmeta.values())  # (group_size, dim, shape) each
    assert not any(isinstance(t, gb.PackedGGUFWeight) for t in llm.engine.model.global_w.values())
