"""GGUF blocks kept packed (localgen/quant/gguf_blocks.py): the torch dequantizer equals
gguf.quants.dequantize bit for bit for every type, the packed matmul equals a float64 matmul of
those weights, and tiny Llama GGUFs of random blocks, one per type plus a Q4_K_M-like mix, load
packed through ``LLM.load`` with the greedy tokens of the same weights expanded to float32 and
no more resident bytes than the file's tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).parent))
import tiny_models as tm  # noqa: E402

from localgen.models.gguf_source import GGUFStore, unpermute_qk  # noqa: E402
from localgen.quant import gguf_blocks as gb  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = sorted(gb.PACKED_TYPES)
# byte offsets of each block's fp16 fields (ggml-common.h): random bytes there could be inf/NaN
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
               Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
               Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.IQ2_XS: (0,)}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def reference_only(monkeypatch):
    """The exact float path: no C kernel (``localgen.kernels.gguf_cpu`` quantizes activations)."""
    monkeypatch.setenv(gb.CPU_KERNEL_ENV, "0")


def random_blocks(qtype, rows: int, k: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """``[rows, row_bytes]`` uint8: random bytes, fp16 fields finite in ``[-scale, scale]``."""
    rng = np.random.default_rng(seed)
    nb, size = k // gb.block_size(qtype), gb.type_size(qtype)
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        d = (rng.uniform(-scale, scale, size=(rows, nb, 1))).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8)
    return raw.reshape(rows, nb * size)


def gguf_dequantized(raw: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], -1)


# ---- block facts and the dequantizer ------------------------------------------------------


def test_block_facts_are_ggml_quant_sizes():
    for qt in TYPES:
        assert (gb.block_size(qt), gb.type_size(qt)) == gguf.constants.GGML_QUANT_SIZES[qt]
    assert gb.bits_per_weight(Q.Q4_K) == 4.5 and gb.bits_per_weight(Q.Q8_0) == 8.5
    assert gb.row_bytes(Q.Q6_K, 512) == 2 * 210
    with pytest.raises(ValueError, match="256-weight blocks"):
        gb.row_bytes(Q.Q4_K, 576)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_is_bit_exact_with_gguf(qtype, device):
    raw = random_blocks(qtype, 7, 2 * gb.block_size(qtype), seed=int(qtype))
    want = gguf_dequantized(raw, qtype)
    got = gb.dequantize(torch.from_numpy(raw).to(device), qtype).cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))  # bit for bit
    half = gb.dequantize(torch.from_numpy(raw).to(device), qtype, torch.bfloat16).cpu()
    assert torch.equal(half, torch.from_numpy(want).bfloat16())  # one rounding, from float32


def test_dequantize_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="IQ2_XS"):
        gb.dequantize(torch.zeros(1, 74, dtype=torch.uint8), Q.IQ2_XS)
    with pytest.raises(ValueError, match="whole 144-byte blocks"):
        gb.dequantize(torch.zeros(2, 100, dtype=torch.uint8), Q.Q4_K)
    with pytest.raises(ValueError, match="uint8"):
        gb.dequantize(torch.zeros(2, 144), Q.Q4_K)
    with pytest.raises(ValueError, match=r"needs uint8 rows \(3, 144\)"):
        gb.PackedGGUFWeight(torch.zeros(3, 288, dtype=torch.uint8), Q.Q4_K, (3, 256))


# ---- the packed weight --------------------------------------------------------------------


def packed(qtype, n: int, k: int, seed: int, device: str = "cpu") -> gb.PackedGGUFWeight:
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed))
    return gb.PackedGGUFWeight(raw, qtype, (n, k)).to(device)


def check_matmul(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None):
    """float32 against float64: a float32 dot product of K terms errs by at most about
    K * 2**-24 * sum |x w| (the recursive-summation bound; blocked BLAS sums do better)."""
    x64 = x.double().cpu()
    want = x64 @ w64.T + (0 if bias is None else bias.double().cpu())
    tol = x.shape[-1] * 2.0 ** -24 * (x64.abs() @ w64.abs().T) + 1e-30
    assert y.dtype == x.dtype and y.shape == want.shape
    assert ((y.double().cpu() - want).abs() <= tol).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_packed_linear_matches_float64(qtype, m, device, reference_only):
    n, k = 48, 512
    w = packed(qtype, n, k, seed=100 + int(qtype), device=device)
    w64 = torch.from_numpy(gguf_dequantized(w.raw.cpu().numpy(), qtype)).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(device)
    check_matmul(w(x, bias), x, w64, bias)
    check_matmul(gb.reference_matmul(x, w.raw, qtype), x, w64, None)


def test_reference_matmul_in_chunks_equals_one_gemm(monkeypatch, reference_only):
    w = packed(Q.Q5_K, 40, 512, seed=3)
    x = torch.randn(2, 3, 512)  # any leading dims, as F.linear
    whole = w(x)
    monkeypatch.setattr(gb, "CHUNK_WEIGHTS", 7 * 512)  # 6 chunks, the last one short
    chunked = w(x)
    assert chunked.shape == (2, 3, 40)
    w64 = torch.from_numpy(gguf_dequantized(w.raw.numpy(), Q.Q5_K)).double()
    for y in (whole, chunked):
        check_matmul(y.reshape(6, 40), x.reshape(6, 512), w64, None)


class FakeKernels:
    """``localgen.kernels.gguf_cpu``'s contract: float32 [m, n], or None to decline."""

    def __init__(self, answer: bool):
        self.answer, self.calls = answer, []

    def matmul(self, x, raw, qtype, k, activations="q8"):
        self.calls.append((x.dtype, x.is_contiguous(), tuple(raw.shape), qtype, k, activations))
        return torch.full((x.shape[0], raw.shape[0]), 7.0) if self.answer else None


@pytest.mark.parametrize("answer", [True, False])
def test_cpu_kernel_serves_when_it_answers(monkeypatch, answer):
    fake = FakeKernels(answer)
    monkeypatch.setattr(gb, "_cpu_kernels", fake)
    w = packed(Q.Q4_K, 16, 256, seed=5)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = w(x)
    assert fake.calls == [(torch.float32, True, (16, 144), int(Q.Q4_K), 256, "q8")]
    assert y.dtype == torch.bfloat16  # the kernel's float32 comes back in x's dtype
    assert bool((y == 7).all()) == answer
    monkeypatch.setenv(gb.CPU_ACTIVATIONS_ENV, "f32")
    w(x)
    assert fake.calls[-1][-1] == "f32"
    monkeypatch.setenv(gb.CPU_ACTIVATIONS_ENV, "int4")
    with pytest.raises(ValueError, match="LOCALGEN_GGUF_ACTIVATIONS"):
        w(x)
    monkeypatch.setenv(gb.CPU_KERNEL_ENV, "0")
    assert not (w(x) == 7).all() and len(fake.calls) == 2  # the switch keeps the reference


def test_rows_move_as_raw_bytes():
    """Gathering, permuting (llama.cpp's Q/K permutation) and stacking rows of blocks commute
    with dequantization: each row is whole blocks."""
    w = packed(Q.Q4_K, 32, 512, seed=9)
    dense = w.dequantize()
    assert torch.equal(gb.dequantize(unpermute_qk(w.raw, 4), Q.Q4_K), unpermute_qk(dense, 4))
    ids = torch.tensor([[3, 0], [31, 3]])
    assert torch.equal(w.embedding(ids), dense[ids])
    other = packed(Q.Q4_K, 8, 512, seed=10)
    both = gb.PackedGGUFWeight.cat_rows([w, other])
    assert both.shape == (40, 512) and torch.equal(both.dequantize(),
                                                   torch.cat([dense, other.dequantize()]))
    assert gb.PackedGGUFWeight.cat_rows([w, packed(Q.Q6_K, 8, 512, seed=11)]) is None
    assert w.nbytes == 32 * 2 * 144 and w.to("cpu").qtype == Q.Q4_K


@pytest.mark.parametrize("heads,head_dim,width,chunk", [(4, 8, 144, 1 << 20), (6, 4, 10, 100),
                                                         (3, 2, 5, 1)])
def test_unpermute_in_place_equals_the_permuted_copy(heads, head_dim, width, chunk, monkeypatch):
    """The in-place undo of llama.cpp's Q/K permutation, one head or several a chunk (the
    chunk size forced small), equals ``unpermute_qk``'s copy row for row."""
    from localgen.models import gguf_tensors

    monkeypatch.setattr(gguf_tensors, "UNPERMUTE_CHUNK_BYTES", chunk)
    w = torch.randint(0, 256, (heads * head_dim, width), dtype=torch.uint8)
    want = unpermute_qk(w, heads).contiguous()
    assert gguf_tensors.unpermute_qk_(w, heads) is w
    assert torch.equal(w, want)


# ---- GGUF files of random blocks, loaded through localgen ----------------------------------

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # in_features multiples of 256
LAYER_TENSORS = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN),
                 "attn_v": (HIDDEN // 2, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
                 "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}


def unit_scale(qtype) -> float:
    """fp16-field scale giving weights of standard deviation ~0.2 (as tiny_models' matrices), so
    greedy decoding of random blocks is not degenerate."""
    probe = gguf_dequantized(random_blocks(qtype, 16, 256, seed=0), qtype)
    return 0.2 / float(probe.std())


def write_random_gguf(path: Path, types: dict[str, object], *, tied: bool = False) -> Path:
    """A tiny Llama GGUF whose matrices are random blocks: ``types`` maps a tensor kind
    (``token_embd``, ``output``, ``attn_q``…, ``ffn_down``) or ``"*"`` to its GGUF type; norms
    are F32. ``tied`` stores no ``output.weight`` (the embedding is the output matrix)."""
    vocab = tm.vocab_size()
    cfg = {"vocab_size": vocab}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random-blocks")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    tm._add_tokenizer(w, cfg)
    mats = {"token_embd": (vocab, HIDDEN)} | ({} if tied else {"output": (vocab, HIDDEN)})
    mats |= {f"blk.{i}.{kind}": shape for i in range(LAYERS) for kind, shape in LAYER_TENSORS.items()}
    rng = np.random.default_rng(0)
    for seed, (name, (n, k)) in enumerate(mats.items()):
        qtype = types.get(name.split(".")[-1], types["*"])
        raw = random_blocks(qtype, n, k, seed, scale=unit_scale(qtype))
        w.add_tensor(f"{name}.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    for name in ["output_norm"] + [f"blk.{i}.{k}" for i in range(LAYERS) for k in ("attn_norm", "ffn_norm")]:
        w.add_tensor(f"{name}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Q4_K_M's mix (llama.cpp's llama_tensor_get_type): attn_v, ffn_down and output in Q6_K
Q4_K_M = {"*": Q.Q4_K, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K}
FILES = {q.name: ({"*": q}, False) for q in TYPES} | {
    "Q4_K_M": (Q4_K_M, False), "Q8_0_tied": ({"*": Q.Q8_0}, True)}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf_blocks")
    return {k: write_random_gguf(d / f"{k}.gguf", types, tied=tied)
            for k, (types, tied) in FILES.items()}


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0_tied", "IQ4_XS"])
def test_store_packs_the_file_bytes_and_unpermutes_rows(gguf_files, kind):
    store = GGUFStore(gguf_files[kind])
    for name in store.names():
        w = store.get_packed(name)
        if len(store.shape(name)) == 1:
            assert w is None and not store.packs(name)
            continue
        assert w.nbytes == store.nbytes(name) and w.shape == store.shape(name)
        assert torch.equal(w.dequantize(), store.get(name)), name  # q/k rows unpermuted alike



@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0_tied"])
def test_rows_stacked_as_read_equal_the_parts_concatenated(gguf_files, kind):
    """q/k/v and gate/up read straight into one matrix hold the bytes of the parts read one by
    one and concatenated (Q/K unpermuted); parts of different types are not stacked."""
    store = GGUFStore(gguf_files[kind])
    layer = "model.layers.0."
    for parts in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                  ["mlp.gate_proj", "mlp.up_proj"]):
        names = [f"{layer}{p}.weight" for p in parts]
        stacked = store.get_packed_rows(names)
        if len({store.stored_type(n) for n in names}) > 1:
            assert stacked is None
            continue
        want = torch.cat([store.get_packed(n).raw for n in names])
        assert torch.equal(stacked.raw, want) and stacked.shape == (want.shape[0], store.shape(names[0])[1])


def test_a_packed_llama_layer_is_stacked_as_read_not_concatenated(gguf_files, monkeypatch):
    from localgen.api import LLM

    def refuse(parts):
        raise AssertionError("rows concatenated after reading")

    monkeypatch.setattr(gb.PackedGGUFWeight, "cat_rows", staticmethod(refuse))
    llm = LLM.load(str(gguf_files["Q8_0_tied"]), device="cpu", dtype="float32",
                   kv_cache_memory=1 << 22)
    assert {"qkv", "gate_up"} <= llm.engine.model.layers[0].keys()

PROMPT = [5, 9, 30, 41, 77, 6]


def load(path: Path, packed_env: str, monkeypatch):
    from localgen.api import LLM

    monkeypatch.setenv("LOCALGEN_GGUF_PACKED", packed_env)
    return LLM.load(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 22)


def greedy(path: Path, packed_env: str, monkeypatch, n: int = 20):
    from localgen.api import Request, SamplingParams

    llm = load(path, packed_env, monkeypatch)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = llm.generate([Request(prompt_token_ids=PROMPT, sampling=sp)])[0]
    return llm, out.token_ids


@pytest.mark.parametrize("kind", list(FILES))
def test_packed_model_decodes_as_the_expanded_one(gguf_files, kind, monkeypatch, reference_only):
    path = gguf_files[kind]
    llm, tokens = greedy(path, "1", monkeypatch)
    _, want = greedy(path, "0", monkeypatch)
    assert tokens == want and len(set(tokens)) > 3  # varied tokens: a real comparison
    model = llm.engine.model
    assert isinstance(model.global_w["embed"], gb.PackedGGUFWeight)
    assert ("lm_head" in model.global_w) == (not FILES[kind][1])
    layer = model.layers[0]
    assert all(isinstance(layer[k], gb.PackedGGUFWeight) for k in ("o", "down"))
    # q/k/v fuse only where their types agree (Q4_K_M: v is Q6_K); gate and up always do
    assert ("qkv" in layer) == (kind != "Q4_K_M") and "gate_up" in layer
    file_bytes = GGUFStore(path).total_nbytes()
    assert llm.weight_bytes <= 1.05 * file_bytes, (llm.weight_bytes, file_bytes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0_tied", "IQ4_NL"])
def test_packed_model_on_cuda(gguf_files, kind, monkeypatch):
    """On the GPU (bf16, CUDA graphs for decode) the packed weights stay the file's bytes and
    decode as the expanded ones: both paths multiply the same bf16 values."""
    from localgen.api import LLM, Request, SamplingParams

    path, runs = gguf_files[kind], []
    for env in ("1", "0"):
        monkeypatch.setenv("LOCALGEN_GGUF_PACKED", env)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        llm = LLM.load(str(path), device="cuda", kv_cache_memory=1 << 22)
        held = torch.cuda.memory_allocated() - before - llm.kv_cache_bytes
        sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        out = llm.generate([Request(prompt_token_ids=PROMPT, sampling=sp)])[0]
        runs.append((llm.weight_bytes, held, out.token_ids))
        del llm
    (packed_bytes, packed_held, tokens), (dense_bytes, _, want) = runs
    file_bytes = GGUFStore(path).total_nbytes()
    assert tokens == want and len(set(tokens)) > 3
    assert packed_bytes <= 1.05 * file_bytes < dense_bytes
    assert packed_held <= 1.05 * file_bytes + (1 << 20), (packed_held, file_bytes)


@pytest.mark.skipif(not gb.cpu_kernel_serves(Q.Q8_0), reason="no C compiler for the kernel")
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_0", "Q6_K", "IQ4_XS", "Q2_K"])
def test_cpu_kernel_with_float_activations_decodes_as_the_expanded_one(gguf_files, kind,
                                                                       monkeypatch):
    """``LOCALGEN_GGUF_ACTIVATIONS=f32``: the C kernel multiplies the file's values in float32,
    so greedy decoding equals the weights expanded to float32 at load."""
    monkeypatch.setenv(gb.CPU_ACTIVATIONS_ENV, "f32")
    _, tokens = greedy(gguf_files[kind], "1", monkeypatch, n=32)
    _, want = greedy(gguf_files[kind], "0", monkeypatch, n=32)
    assert tokens == want and len(set(tokens)) > 3


def prefill_logits(llm) -> torch.Tensor:
    from localgen.api import Request, SamplingParams

    llm.add_request(Request(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=1)))
    return llm.engine.runner.run(llm.engine.scheduler.schedule().seqs, True)[0]


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0_tied"])
def test_packed_model_with_the_cpu_kernel_where_present(gguf_files, kind, monkeypatch):
    """Default dispatch: ``localgen.kernels.gguf_cpu`` where it builds, else the reference. The
    kernel rounds activations to 8 bits (~0.6% relative error a matmul on these random blocks),
    which two random layers amplify to a few percent of the logits: close, not equal (a wrong
    layout or dispatch would be off by ~100%)."""
    path = gguf_files[kind]
    got = prefill_logits(load(path, "1", monkeypatch))
    want = prefill_logits(load(path, "0", monkeypatch))
    assert float((got - want).norm() / want.norm()) < 0.15


def test_other_quantized_types_load_expanded_with_one_warning(tmp_path, monkeypatch,
                                                             reference_only):
    path = write_random_gguf(tmp_path / "iq2.gguf", {"*": Q.Q4_K, "ffn_down": Q.IQ2_XS})
    with pytest.warns(UserWarning) as record:
        llm, tokens = greedy(path, "1", monkeypatch, n=8)
    msgs = [str(r.message) for r in record if "expanded" in str(r.message)]
    assert len(msgs) == 1
    assert "IQ2_XS" in msgs[0] and "model.layers.0.mlp.down_proj.weight" in msgs[0]
    assert "MiB more than" in msgs[0]
    assert isinstance(llm.engine.model.layers[0]["down"], torch.Tensor)
    _, want = greedy(path, "0", monkeypatch, n=8)
    assert tokens == want
