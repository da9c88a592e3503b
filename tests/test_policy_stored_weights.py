"""The cost model and the policy search count a GGUF's weights as the file stores them (issue 27,
item 3): a layer's bytes are its tensors' bytes in the file, not two per parameter."""

from __future__ import annotations

import dataclasses
import math

import pytest

from localgen.models.gguf_source import GGUFStore
from localgen.policy.cost_model import CostModel, StoredWeights, Workload, compressed_ratio
from localgen.policy.policy import Policy
from localgen.policy.presets import preset_config, resolve_model_weights
from localgen.policy.search import search
from localgen.profiler.hardware import GiB, load_profile
from tests.test_gguf_packed import Q4_K_M, write_random_gguf

T4 = load_profile("flexgen_t4")
WL = Workload(prompt_len=512, gen_len=32)
LLAMA7B = preset_config("llama-2-7b")
# Q4_K_M averages ~4.8 bits a weight (Q4_K with some Q6_K)
Q4KM_7B = StoredWeights(layer_bytes=202.4e6 * 4.85 / 8, global_bytes=2 * 32000 * 4096 * 5.5 / 8)


def test_stored_weights_are_the_file_tensor_bytes(tmp_path, monkeypatch):
    path = write_random_gguf(tmp_path / "m.gguf", Q4_K_M)
    monkeypatch.setenv("LOCALGEN_GGUF_PACKED", "1")
    sw = resolve_model_weights(str(path))[1]
    store = GGUFStore(path)
    # matrices: the file's blocks; norms (F32 in the file): the compute dtype's 2 bytes
    want = {True: 0, False: 0}
    for name in store.names():
        n = store.nbytes(name) if store.packs(name) else 2 * math.prod(store.shape(name))
        want[name.startswith("model.layers.")] += n
    layers = store.hf_config["num_hidden_layers"]
    assert sw.layer_bytes * layers == pytest.approx(want[True])
    assert sw.global_bytes == want[False]
    assert sw.layer_bytes * layers + sw.global_bytes < 0.4 * 2 * sum(
        math.prod(store.shape(n)) for n in store.names())
    monkeypatch.setenv("LOCALGEN_GGUF_PACKED", "0")
    assert resolve_model_weights(str(path))[1] is None
    assert resolve_model_weights("llama-2-7b")[1] is None  # a preset: dtype_bytes per parameter


def test_cost_model_counts_stored_bytes():
    cm = CostModel(LLAMA7B, T4, WL, runtime="localgen", stored=Q4KM_7B)
    plain = CostModel(LLAMA7B, T4, WL, runtime="localgen")
    L = LLAMA7B.num_layers
    assert cm.total_weight_bytes() == pytest.approx(L * Q4KM_7B.layer_bytes + Q4KM_7B.global_bytes)
    assert cm.layer_weight_bytes() == Q4KM_7B.layer_bytes
    assert plain.layer_weight_bytes() == plain.layer_weight_elems() * 2
    # FlexGen's compression keeps its meaning: 4-bit groups of the float weights
    assert cm.layer_weight_bytes(True) == pytest.approx(plain.layer_weight_elems() * 2 * compressed_ratio())
    # the same all-on-GPU policy needs the file's bytes, not fp16's
    pol = Policy(gbs=1, num_gpu_batches=1).validate()
    gpu_stored, gpu_plain = cm.predict(pol).peak_mem["gpu"], plain.predict(pol).peak_mem["gpu"]
    saved = (L * (plain.layer_weight_elems() * 2 - Q4KM_7B.layer_bytes)
             + LLAMA7B.global_parameters() * 2 - Q4KM_7B.global_bytes)
    assert gpu_plain - gpu_stored == pytest.approx(saved, rel=0.02)


def test_search_puts_a_q4km_7b_whole_on_an_8gb_gpu():
    """A 7B Q4_K_M file (~4 GB) on an 8 GB card: the search keeps every layer on the GPU with no
    compression, where the same model counted in fp16 (13.5 GB) has to offload."""
    hw = dataclasses.replace(T4, gpu_mem=8 * GiB)
    got = search(LLAMA7B, hw, WL, objective="latency", runtime="localgen", stored=Q4KM_7B)
    assert got.policy.wg == 1 and not got.policy.compress_weight
    fp16 = search(LLAMA7B, hw, WL, objective="latency", runtime="localgen")
    assert fp16.policy.wg < 1
