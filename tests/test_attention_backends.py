"""The attention backends (``localgen.attention``, and the offload runtime's tiered ones) against
the torch reference on the same inputs, how a backend is chosen, and the reference's sliding window,
logit soft-capping and sinks against a softmax written out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from localgen.attention import select
from localgen.attention.base import UnsupportedAttention
from localgen.attention.cpu import CpuBackend, CpuKernelBackend
from localgen.attention.metadata import AttentionMetadata, LayerKV
from localgen.attention.reference import TorchReferenceBackend
from localgen.attention.spec import AttentionSpec
from localgen.kernels import paged_decode_cpu
from localgen.models.config import ModelConfig
from localgen.runtime.offload import kv as offload_kv
from localgen.runtime.offload.kv import TieredKVCache, build_tier_layer
from localgen.runtime.offload.tier_backends import (CpuAttentionTierLayer, Int4KernelTierLayer,
                                                    MappedHostTierLayer)
from localgen.runtime.offload.tier_layer import TierLayer
from localgen.runtime.offload.timers import Timers
from tests.conftest import KERNEL_DEVICE
from tests.tiny_models import make_config

BS = 4  # tokens per KV block: several blocks per sequence at small lengths
HEADS, KV_HEADS, D = 4, 2, 16  # GQA: two query heads per KV head
CPU = torch.device("cpu")


class Steps:
    """A prefill of ``prompt_lens`` (the second step's sequences may carry cached prefixes) and
    then ``decodes`` decode steps, over shuffled block tables; each step's q/k/v drawn from one
    seed so every backend sees the same inputs."""

    def __init__(self, prompt_lens: list[int], decodes: int, seed: int = 0, device=CPU):
        self.g = torch.Generator().manual_seed(seed)
        self.device = device
        self.num_blocks = 64
        need = [-(-(n + decodes) // BS) for n in prompt_lens]
        perm = torch.randperm(self.num_blocks - 1, generator=self.g).tolist()
        self.tables, at = [], 0
        for k in need:
            self.tables.append(perm[at:at + k])
            at += k
        self.prompt_lens, self.decodes = prompt_lens, decodes

    def _table(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], device=self.device)

    def _qkv(self, n: int):
        q, k, v = (torch.randn(n, h, D, generator=self.g) for h in (HEADS, KV_HEADS, KV_HEADS))
        return q.to(self.device), k.to(self.device), v.to(self.device)

    def _meta(self, prefill: bool, starts: list[int], ends: list[int]):
        slots = [t[p // BS] * BS + p % BS for t, a, e in zip(self.tables, starts, ends)
                 for p in range(a, e)]
        return AttentionMetadata(prefill, torch.tensor(slots, device=self.device), self._table(),
                                 torch.tensor(ends, device=self.device),
                                 [e - a for a, e in zip(starts, ends)], list(ends))

    def __iter__(self):
        """(q, k, v, meta) of each step: a prefill of each prompt's first part, a prefill of its
        rest over that cached prefix, then the decode steps."""
        cut = [n // 2 for n in self.prompt_lens]
        for starts, ends in (([0] * len(cut), cut), (cut, self.prompt_lens)):
            yield (*self._qkv(sum(e - a for a, e in zip(starts, ends))), self._meta(True, starts, ends))
        lens = list(self.prompt_lens)
        for _ in range(self.decodes):
            yield (*self._qkv(len(lens)), self._meta(False, lens, [n + 1 for n in lens]))
            lens = [n + 1 for n in lens]


def paged_view(num_blocks: int, dtype=torch.float32, device=CPU) -> LayerKV:
    pair = torch.zeros(2, num_blocks, BS, KV_HEADS, D, dtype=dtype, device=device)
    return LayerKV(pair[0], pair[1], pair)


def run(attend, steps: Steps) -> list[torch.Tensor]:
    return [attend(q, k, v, meta).float().cpu() for q, k, v, meta in steps]


def reference_outputs(steps_args: dict) -> list[torch.Tensor]:
    view = paged_view(64)
    view.backend = TorchReferenceBackend()
    spec = AttentionSpec(D ** -0.5)
    return run(lambda q, k, v, meta: view.attend(q.cpu(), k.cpu(), v.cpu(), _on(meta, CPU), spec),
               Steps(**steps_args))


def _on(meta: AttentionMetadata, device) -> AttentionMetadata:
    return AttentionMetadata(meta.is_prefill, meta.slot_mapping.to(device), meta.block_tables.to(device),
                             meta.context_lens.to(device), meta.query_lens, meta.context_lens_list)


CASES = [dict(prompt_lens=[7], decodes=3), dict(prompt_lens=[5, 13, 9], decodes=4),
         dict(prompt_lens=[8, 8], decodes=2)]


def paged_backends():
    out = [("cpu-torch", CpuBackend, CPU)]
    if paged_decode_cpu.available():
        out.append(("cpu-c-kernel", CpuKernelBackend, CPU))
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name,cls,device", paged_backends())
def test_paged_cpu_backends_match_the_reference(case, name, cls, device):
    view = paged_view(64)
    view.backend = cls()
    spec = AttentionSpec(D ** -0.5)
    got = run(lambda q, k, v, meta: view.attend(q, k, v, meta, spec), Steps(**case))
    for a, b in zip(got, reference_outputs(case)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_paged_triton_backend_matches_the_reference(case):
    """On the GPU compiled; on the CPU under the Triton interpreter (tests/conftest.py)."""
    pytest.importorskip("triton")
    from localgen.attention.triton import TritonPagedBackend

    view = paged_view(64, device=KERNEL_DEVICE)
    view.backend = TritonPagedBackend()
    spec = AttentionSpec(D ** -0.5)
    got = run(lambda q, k, v, meta: view.attend(q, k, v, meta, spec), Steps(**case, device=KERNEL_DEVICE))
    for a, b in zip(got, reference_outputs(case)):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def tier_layer(cls, compress: bool, device=CPU, cpu_compute=False, **kw):
    """Layer 0 of a one-tier host-memory cache computed on ``device`` (pinned under a CUDA
    device), rebuilt as ``cls`` over the same tensors."""
    cfg = ModelConfig.from_hf_dict({**make_config("llama3").to_dict(), "head_dim": D,
                                    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    cache = TieredKVCache(cfg, 64, BS, torch.float32, device, ["cpu"] * cfg.num_layers, compress, False,
                          None, Timers(device), **kw)
    first = cache.views[0]
    return cls(first.t, "cpu", compress, device, torch.float32, cpu_compute, first.timers,
               first.rot, first.recent)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cls", [TierLayer, CpuAttentionTierLayer, MappedHostTierLayer])
def test_fp_tier_backends_match_the_reference(case, cls):
    """The uncompressed tiered backends (gathered blocks, CPU-computed decode, GPU kernels over
    mapped host memory: over pinned host tensors from the GPU where the kernels are compiled,
    under the Triton interpreter on the CPU) give the reference's values."""
    device = CPU
    if cls is MappedHostTierLayer:
        pytest.importorskip("triton")
        device = KERNEL_DEVICE
    layer = tier_layer(cls, compress=False, device=device)
    assert layer.t["k"].device.type == "cpu" and layer.t["k"].is_pinned() == (device.type == "cuda")
    spec = AttentionSpec(D ** -0.5)
    got = run(lambda q, k, v, meta: layer.attend(q, k, v, meta, spec), Steps(**case, device=device))
    for a, b in zip(got, reference_outputs(case)):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    if cls is MappedHostTierLayer:
        assert layer.mapped  # the kernels took the host tensors: no fallback to the gather path


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("recent_blocks", [0, 8])
def test_int4_kernel_tier_backend_matches_the_gather_path(case, recent_blocks, monkeypatch):
    """The Triton int4 backend (quantize-and-write, int4 paged decode) against the torch gather
    path over the same 4-bit format, with and without the fp pool of each sequence's own block."""
    pytest.importorskip("triton")
    if KERNEL_DEVICE.type == "cuda":  # the layers hold CPU tensors, which compiled kernels cannot read
        pytest.skip("CPU tensors on the int4 kernel route run only under the Triton interpreter; on a "
                    "GPU offload_selftest.py's kv4_cpu_kernels and kv4_gpu_kernels cover it")
    spec = AttentionSpec(D ** -0.5)
    outs = {}
    for cls in (TierLayer, Int4KernelTierLayer):
        layer = tier_layer(cls, compress=True, rotate=False, recent_blocks=recent_blocks)
        outs[cls] = run(lambda q, k, v, meta: layer.attend(q, k, v, meta, spec), Steps(**case))
    for a, b in zip(outs[Int4KernelTierLayer], outs[TierLayer]):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


# ---- selection ------------------------------------------------------------------------------------

def test_device_backend_rules(monkeypatch):
    kernel = paged_decode_cpu.available()
    assert type(select.device_backend("cpu", torch.float32)) is (CpuKernelBackend if kernel else CpuBackend)
    assert type(select.device_backend("cpu", torch.float16)) is CpuBackend  # the kernel takes no fp16
    monkeypatch.setattr(select, "triton_kernels", lambda: None)
    assert type(select.device_backend("cuda", torch.float16)) is TorchReferenceBackend
    assert type(select.device_backend("mps", torch.float16)) is TorchReferenceBackend


def test_triton_backend_is_chosen_on_cuda_where_triton_imports():
    pytest.importorskip("triton")
    from localgen.attention.triton import TritonPagedBackend

    assert type(select.device_backend("cuda", torch.bfloat16)) is TritonPagedBackend


def test_a_spec_feature_falls_back_to_the_reference_or_refuses():
    window = AttentionSpec(0.25, sliding_window=8)
    plain = AttentionSpec(0.25)
    assert type(select.select_backend("cpu", torch.float32, [plain, window])) is TorchReferenceBackend
    assert type(select.select_backend("cpu", torch.float32, [plain, plain])) is not TorchReferenceBackend
    with pytest.raises(UnsupportedAttention, match="^sliding-window attention is not supported by the "
                                                   "CPU.* attention backend on cpu$"):
        select.select_backend("cpu", torch.float32, [window], fallback=False)


def test_backends_refuse_a_spec_they_do_not_compute():
    capped = AttentionSpec(0.25, logit_softcap=30.0)
    steps = iter(Steps([6], 0))
    q, k, v, meta = next(steps)
    view = paged_view(64)
    view.backend = CpuBackend()
    with pytest.raises(UnsupportedAttention, match="logit soft-capping .* on cpu"):
        view.attend(q, k, v, meta, capped)
    layer = tier_layer(Int4KernelTierLayer, compress=True)  # the gather path computes it
    with pytest.raises(UnsupportedAttention, match="logit soft-capping .* tiered .* on cpu"):
        layer.attend(q, k, v, meta, capped)


def tensors_of(compress: bool) -> dict:
    return tier_layer(TierLayer, compress, recent_blocks=0).t


def test_tier_backend_selection(monkeypatch):
    timers = Timers(CPU)
    gpu = torch.device("cuda", 0)  # the choice only: no tensor moves to it here

    def pick(compress, device, cpu_compute=False, tier="cpu"):
        return type(build_tier_layer(tensors_of(compress), tier, compress, device, torch.float32,
                                     cpu_compute, timers))

    assert pick(False, gpu, cpu_compute=True) is CpuAttentionTierLayer  # FlexGen's delegation
    assert pick(False, gpu) is TierLayer  # pageable host memory: the kernels cannot map it
    assert pick(False, CPU, cpu_compute=True) is TierLayer  # computed on the CPU already
    assert pick(True, CPU) is TierLayer  # INT4_KERNEL_DEVICES: CUDA only
    pytest.importorskip("triton")
    monkeypatch.setattr(offload_kv, "INT4_KERNEL_DEVICES", ("cuda", "cpu"))
    assert pick(True, CPU) is Int4KernelTierLayer


def test_runner_binds_one_backend_and_checks_every_layer(monkeypatch):
    from localgen.runtime.model_runner import ModelRunner

    monkeypatch.setattr("localgen.kernels.cpu_build.build_all", lambda: None)
    cfg = SimpleNamespace(num_layers=2, head_dim=D)
    model = SimpleNamespace(cfg=cfg, device=CPU, dtype=torch.float32)
    kv = SimpleNamespace(views=[paged_view(8), paged_view(8)], block_size=BS)
    runner = ModelRunner(model, kv)
    assert all(v.backend is runner.attention for v in kv.views)
    seen = []
    assert runner.observe_scores(lambda *a: seen.append(a)) is None
    assert runner.attention.observer is not None and not kv.views[0].fuses_cpu_decode(torch.float32)
    cfg.sliding_window = 4  # a windowed family: the reference backend computes it
    assert type(ModelRunner(model, SimpleNamespace(views=[paged_view(8)], block_size=BS)).attention) \
        is TorchReferenceBackend
    gathered = tier_layer(TierLayer, compress=False)  # the gather path computes it
    ModelRunner(model, SimpleNamespace(views=[gathered, gathered], block_size=BS))
    layer = tier_layer(Int4KernelTierLayer, compress=True)  # in-place kernels cannot: refused at build
    with pytest.raises(UnsupportedAttention, match="sliding-window attention"):
        ModelRunner(model, SimpleNamespace(views=[layer, layer], block_size=BS))


def test_graphed_runner_decodes_a_windowed_model_eagerly(monkeypatch):
    """The reference computes a window per sequence from host-side lengths, which a replayed graph
    would freeze: such a model's decode steps run eagerly (``decode`` gives None)."""
    from localgen.runtime.cuda_graphs import GraphedModelRunner

    monkeypatch.setattr("localgen.kernels.cpu_build.build_all", lambda: None)

    def runner(**window):
        model = SimpleNamespace(cfg=SimpleNamespace(num_layers=1, head_dim=D, **window), device=CPU,
                                dtype=torch.float32)
        kv = SimpleNamespace(views=[paged_view(8)], block_size=BS, scratch_block=7)
        return GraphedModelRunner(model, kv, 4, 64, capture=False)

    assert runner().replays
    windowed = runner(sliding_window=4)
    assert not windowed.replays and windowed.decode([SimpleNamespace()]) is None


# ---- sliding window, soft-capping and sinks in the reference ----------------------------------

def hand_attention(q, keys, vals, first, scale, window=None, cap=None, sinks=None):
    """Element by element: query t (position first + t), head h, over keys 0 .. first + t (within
    the window), scores soft-capped, a sink's exp added to the denominator."""
    n, heads, d = q.shape
    group = heads // keys.shape[1]
    out = torch.zeros(n, heads, d, dtype=torch.float64)
    for t in range(n):
        p = first + t
        for h in range(heads):
            kh = h // group
            seen = [j for j in range(p + 1) if window is None or j > p - window]
            s = []
            for j in seen:
                x = scale * sum(float(q[t, h, c]) * float(keys[j, kh, c]) for c in range(d))
                s.append(cap * math.tanh(x / cap) if cap is not None else x)
            m = max(s + ([float(sinks[h])] if sinks is not None else []))
            e = [math.exp(x - m) for x in s]
            z = sum(e) + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
            for w, j in zip(e, seen):
                out[t, h] += (w / z) * vals[j, kh].double()
    return out


SPECS = [dict(sliding_window=3), dict(logit_softcap=0.5), dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
         dict(sliding_window=5, logit_softcap=1.0, sinks=torch.tensor([1.0, 1.0, -2.0, 0.3]))]


@pytest.mark.parametrize("features", SPECS)
def test_reference_window_softcap_sinks_match_a_hand_softmax(features):
    """Prefill over a cached prefix and decode steps, two sequences (GQA), through the reference
    backend's paged path, against ``hand_attention`` over each sequence's own K/V."""
    spec = AttentionSpec(D ** -0.5, **features)
    assert TorchReferenceBackend().supports(spec) and not CpuBackend().supports(spec)
    view = paged_view(64)
    view.backend = TorchReferenceBackend()
    steps = Steps([6, 9], decodes=3, seed=3)
    hist = [([], []) for _ in steps.prompt_lens]  # each sequence's keys and values so far
    for q, k, v, meta in steps:
        got = view.attend(q, k, v, meta, spec)
        start = 0
        for i, (ql, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            hist[i][0].append(k[start:start + ql])
            hist[i][1].append(v[start:start + ql])
            want = hand_attention(q[start:start + ql], torch.cat(hist[i][0]), torch.cat(hist[i][1]),
                                  ctx - ql, spec.scale, spec.sliding_window, spec.logit_softcap,
                                  spec.sinks)
            torch.testing.assert_close(got[start:start + ql].double(), want, atol=1e-5, rtol=1e-5)
            start += ql


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionSpec(0.1, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        AttentionSpec(0.1, logit_softcap=-1.0)
