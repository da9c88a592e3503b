"""The offloading runtime (issue 6) on the CPU: every placement and block shape gives the plain
path's greedy tokens; disk placements really read their files; 4-bit runs stay within bounds."""

from __future__ import annotations

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from localgen.api import LLM, Request, SamplingParams  # noqa: E402
from localgen.policy import Policy  # noqa: E402
from tests.conftest import KERNEL_DEVICE  # noqa: E402
from tests.test_engine_vs_hf import run_staggered  # noqa: E402
from tests.tiny_models import VARIANTS, make_hf_model  # noqa: E402


def interpreted_cuda_route(twin: str):
    """Skip a test that sends CPU tensors down the CUDA route (``INT4_KERNEL_DEVICES`` or
    ``fused_enabled`` widened to the CPU) when the Triton kernels are compiled: they cannot read
    CPU tensors there, and ``twin`` (in scripts/offload_selftest.py) runs that route on the GPU."""
    return pytest.mark.skipif(KERNEL_DEVICE.type == "cuda",
                              reason=f"CPU tensors on the CUDA route run only under the Triton "
                                     f"interpreter; on a GPU offload_selftest.py's {twin} covers it")


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
KV = 1 << 22


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload_models")
    out = {v: make_hf_model(root, v) for v in ("llama3", "opt")}
    # a 4-layer model so mixed fractions put whole layers on all three tiers
    VARIANTS["llama_4l"] = {**VARIANTS["llama3"], "num_hidden_layers": 4}
    try:
        out["llama_4l"] = make_hf_model(root, "llama_4l")
    finally:
        del VARIANTS["llama_4l"]
    return out


def prompts(seed=0, lengths=(3, 17, 9, 33, 5)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 300, (n,), generator=g).tolist() for n in lengths]


def staggered(llm: LLM, ps) -> list[list[int]]:
    """Prompt i joins after i steps, so prefill and decode batches of several sizes occur."""
    done = run_staggered(llm, ps, GREEDY)
    return [done[i] for i in range(len(ps))]


_plain_cache: dict = {}


def plain(dirs, variant):
    if variant not in _plain_cache:
        llm = LLM.load(str(dirs[variant]), device="cpu", kv_cache_memory=KV, block_size=4, max_num_seqs=4)
        _plain_cache[variant] = staggered(llm, prompts())
    return _plain_cache[variant]


def P(w=(1, 0, 0), c=(1, 0, 0), h=(1, 0), gbs=1, ngb=1, **kw) -> Policy:
    return Policy(gbs=gbs, num_gpu_batches=ngb, wg=w[0], wc=w[1], wd=w[2], cg=c[0], cc=c[1], cd=c[2],
                  hg=h[0], hc=h[1], **kw).validate()


PLACEMENTS = {
    "all_gpu_tier": P(),
    "all_cpu": P(w=(0, 1, 0), c=(0, 1, 0), h=(0, 1), gbs=2, ngb=2),
    "all_disk": P(w=(0, 0, 1), c=(0, 0, 1), h=(0, 1), gbs=1, ngb=3),
    "mixed_quarters": P(w=(0.25, 0.5, 0.25), c=(0.5, 0.25, 0.25), h=(0.5, 0.5), gbs=2, ngb=1),
    "mixed_thirds": P(w=(0.3, 0.3, 0.4), c=(0.2, 0.4, 0.4), gbs=3, ngb=2),
    "cpu_attention": P(w=(0.5, 0.5, 0), c=(0, 0.5, 0.5), gbs=4, ngb=1, cpu_cache_compute=True),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
@pytest.mark.parametrize("variant", ["llama_4l", "opt"])
def test_placements_give_plain_greedy_tokens(dirs, tmp_path, variant, name):
    pol = PLACEMENTS[name]
    llm = LLM.load(str(dirs[variant]), device="cpu", kv_cache_memory=KV, block_size=4, policy=pol,
                   offload_dir=str(tmp_path / "off"))
    assert llm.max_num_seqs == pol.bls
    assert staggered(llm, prompts()) == plain(dirs, variant)
    tiers = llm.engine.model.layers.tiers
    if variant == "llama_4l" and name.startswith("mixed"):
        assert set(tiers) == {"gpu", "cpu", "disk"}  # whole layers on every tier
    if pol.wd:
        assert llm.engine.model.layers.disk_reads > 0


@pytest.mark.parametrize("gbs,ngb", [(1, 1), (1, 4), (2, 2), (4, 1), (3, 2)])
def test_block_shapes_and_layer_reuse(dirs, tmp_path, gbs, ngb):
    """Each loaded layer serves every GPU batch of the block (zig-zag): one weight load per layer
    per block, however many GPU batches the block holds."""
    pol = P(w=(0, 0, 1), c=(0, 1, 0), gbs=gbs, ngb=ngb)
    llm = LLM.load(str(dirs["llama3"]), device="cpu", kv_cache_memory=KV, block_size=4, policy=pol,
                   offload_dir=str(tmp_path / "off"))
    layers, calls = llm.engine.model.layers, []
    get = layers.get
    layers.get = lambda j: calls.append(j) or get(j)
    batches = []
    run = llm.engine.runner._run_zigzag_block
    llm.engine.runner._run_zigzag_block = lambda block, g, pre: batches.append(len(block)) or run(block, g, pre)
    assert staggered(llm, prompts()) == plain(dirs, "llama3")
    L = llm.config.num_layers
    assert len(calls) == L * len(batches)  # not L * number of GPU batches
    assert calls == list(range(L)) * len(batches)
    assert max(batches) <= gbs * ngb
    assert layers.disk_reads == len(calls)  # every use of a disk layer reads its file


@pytest.mark.parametrize("cache,one_batch", [((1, 0, 0), True), ((0, 1, 0), False), ((0, 0, 1), False)])
def test_decode_runs_the_block_as_one_batch_when_the_cache_is_read_in_place(dirs, tmp_path, cache,
                                                                            one_batch):
    """A decode step whose every cache layer is read in place (the compute device's tier) runs
    its block as one GPU batch: one call per layer, however many GPU batches the policy has; a
    cache gathered per call (host or disk tier here) keeps the GPU batches, and prefill always
    does. Greedy tokens equal the plain path's either way."""
    pol = P(w=(0, 1, 0), c=cache, h=(0.5, 0.5), gbs=1, ngb=4)
    llm = LLM.load(str(dirs["llama3"]), device="cpu", kv_cache_memory=KV, block_size=4, policy=pol,
                   offload_dir=str(tmp_path / "off"))
    runner = llm.engine.runner
    assert runner.one_batch_decode == one_batch
    shapes = {True: [], False: []}  # is_prefill -> sequences of each GPU batch of each block
    fwd = runner.forward_zigzag_block
    runner.forward_zigzag_block = lambda steps, lasts: shapes[steps[0][2].is_prefill].append(
        [len(m.query_lens) for _, _, m in steps]) or fwd(steps, lasts)
    assert staggered(llm, prompts()) == plain(dirs, "llama3")
    assert all(n == 1 for b in shapes[True] for n in b)  # prefill keeps GPU batches of gbs
    decode = shapes[False]
    if one_batch:
        assert all(len(b) == 1 for b in decode) and max(b[0] for b in decode) > 1
    else:
        assert max(len(b) for b in decode) > 1 and all(n == 1 for b in decode for n in b)


def test_disk_placement_reads_the_files(dirs, tmp_path):
    off = tmp_path / "off"
    llm = LLM.load(str(dirs["llama3"]), device="cpu", kv_cache_memory=KV, block_size=4,
                   policy=P(w=(0, 0, 1)), offload_dir=str(off))
    layers = llm.engine.model.layers
    files = sorted(off.glob("layer_*.bin"))
    assert len(files) == llm.config.num_layers and not any(b is not None for b in layers.bufs)
    want = plain(dirs, "llama3")
    assert staggered(llm, prompts()) == want
    n0, b0 = layers.disk_reads, layers.disk_bytes_read
    assert b0 == sum(f.stat().st_size for f in files) * (n0 // len(files))
    # overwrite layer 1's bytes on disk: the next run must see it (nothing was cached in RAM)
    saved = files[1].read_bytes()
    with open(files[1], "r+b") as f:
        f.write(np.zeros(len(saved), np.uint8).tobytes())
    assert staggered(llm, prompts()) != want
    files[1].write_bytes(saved)
    assert staggered(llm, prompts()) == want
    assert layers.disk_reads > n0


def _quantized_store(d):
    """The checkpoint with every 2-D layer weight replaced by its 4-bit round trip (g=64 along
    output channels): what the runtime computes with when it compresses weights."""
    from localgen.models.sources import resolve_model
    from localgen.quant import dequantize, quantize

    src = resolve_model(str(d))

    class Store:
        def names(self):
            return src.weights.names()

        def get(self, name):
            t = src.weights.get(name)
            if ".layers." in name and t.dim() == 2:
                return dequantize(quantize(t.float(), dim=0))
            return t
    return src, Store()


@pytest.mark.parametrize("w", [(1, 0, 0), (0, 0, 1)])
def test_compressed_weights_equal_offline_round_trip(dirs, tmp_path, w):
    """4-bit weights stored packed (any tier) and dequantized before use compute exactly what the
    plain path computes on the round-tripped weights."""
    from localgen.runtime.engine import EngineConfig

    src, store = _quantized_store(dirs["llama3"])
    cfg = EngineConfig(block_size=4, kv_cache_memory=KV, max_num_seqs=4)
    ref = LLM.from_parts(src.config, store, src.tokenizer, cfg, device="cpu")
    pol = P(w=w, compress_weight=True, gbs=2, ngb=2)
    got = LLM.from_parts(src.config, src.weights, src.tokenizer, cfg, device="cpu", policy=pol,
                         offload_dir=str(tmp_path / "off"))
    assert staggered(got, prompts()) == staggered(ref, prompts())
    # stored packed: ~0.28 of the fp32/… bytes of the uncompressed layers
    plain_llm = LLM.load(str(dirs["llama3"]), device="cpu", kv_cache_memory=KV, policy=P())
    ratio = sum(l.nbytes for l in got.engine.model.layers.layouts) / \
        sum(l.nbytes for l in plain_llm.engine.model.layers.layouts)
    assert ratio < 0.2  # fp32 -> 4 bit + fp16 scale/min per 64: 0.14 (+ norms, alignment)


def test_compressed_kv_attention_within_bound():
    """A tiered layer with plain 4-bit KV (no rotation, no recent-block pool: FlexGen's format as is)
    attends over exactly the dequantized cache (grouped along head_dim). The defaults (rotated K/V,
    own block in fp) are checked against their own reference in test_kv_rotation.py."""
    from localgen.kernels import paged_attention_ref as ref
    from localgen.attention.spec import AttentionSpec
    from localgen.kv.attention import AttentionMetadata
    from localgen.quant import dequantize, quantize
    from localgen.runtime.offload.kv import TieredKVCache
    from localgen.runtime.offload.timers import Timers
    from tests.tiny_models import make_config
    from localgen.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(make_config("llama3").to_dict())
    cache = TieredKVCache(cfg, 8, 4, torch.float32, torch.device("cpu"), ["cpu"] * cfg.num_layers,
                          True, False, None, Timers(torch.device("cpu")), rotate=False, recent_blocks=0)
    g = torch.Generator().manual_seed(0)
    n, H, kvh, d = 7, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (H, kvh, kvh))
    slots = torch.tensor([8, 9, 10, 11, 20, 21, 22])
    meta = AttentionMetadata(True, slots, torch.tensor([[2, 5]]), torch.tensor([7]), [7], [7])
    out = cache.views[0].attend(q, k, v, meta, AttentionSpec(d ** -0.5))
    kq, vq = (dequantize(quantize(x, dim=-1)) for x in (k, v))
    kc, vc = torch.zeros(8, 4, kvh, d), torch.zeros(8, 4, kvh, d)
    ref.write_kv(kc, vc, kq, vq, slots)
    want = ref.paged_prefill_attention(q, kc, vc, meta.block_tables, [7], [7], d ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert ((kq - k).abs() <= (k.amax(-1, keepdim=True) - k.amin(-1, keepdim=True)) / 30 + 1e-3).all()


def test_compressed_logits_close(dirs):
    """Prefill logits with 4-bit weights and/or 4-bit KV stay close to fp32. The tiny random model
    is scaled (layer matrices x0.5) so it is not chaotic; at hidden 64 a 64-group spans a whole
    column of Gaussian weights, so each matrix carries ~10% error: bounds are relative L2 0.2 (KV)
    and 0.45 (weights, both). With 4-bit KV alone the greedy next token agrees; with 4-bit weights
    too it stays among the top 2 (the weight error alone leaves one prompt's top two 0.1 apart, a
    tie that any KV rounding can flip). (Real-model accuracy: ``localgen bench accuracy``.)"""
    from localgen.models.sources import resolve_model
    from localgen.runtime.engine import EngineConfig

    src = resolve_model(str(dirs["llama3"]))

    class Scaled:
        def names(self):
            return src.weights.names()

        def get(self, name):
            t = src.weights.get(name)
            return t * 0.5 if (".layers." in name and t.dim() == 2) else t

    p = prompts(3, lengths=(21, 30))
    res = {}
    for key, pol in (("plain", None), ("kv4", P(compress_cache=True)),
                     ("w4kv4", P(compress_weight=True, compress_cache=True))):
        llm = LLM.from_parts(src.config, Scaled(), None, EngineConfig(kv_cache_memory=KV), device="cpu",
                             policy=pol)
        eng = llm.engine
        for x in p:
            eng.add_request(Request(prompt_token_ids=x, sampling=GREEDY))
        batch = eng.scheduler.schedule()
        res[key] = eng.runner.run(batch.seqs, True)
    for key, bound in (("kv4", 0.2), ("w4kv4", 0.45)):
        rel = float((res[key] - res["plain"]).norm() / res["plain"].norm())
        assert 0 < rel < bound, (key, rel)
    assert torch.equal(res["kv4"].argmax(-1), res["plain"].argmax(-1))
    top2 = res["w4kv4"].topk(2, -1).indices
    assert (top2 == res["plain"].argmax(-1)[:, None]).any(-1).all()


@interpreted_cuda_route("kv4_gpu_kernels")
def test_int4_kernel_path_gives_the_reference_tokens(dirs, monkeypatch):
    """A 4-bit cache on the compute device (rotated, own blocks in the pool) as a CUDA run takes
    it (Triton quantize-and-write and int4 paged decode, here under TRITON_INTERPRET=1) gives the
    torch reference path's greedy tokens, over staggered prefill/decode batches and two GPU batches."""
    pytest.importorskip("triton")
    from localgen.runtime.offload import kv as offload_kv
    from localgen.runtime.offload.tier_backends import Int4KernelTierLayer

    pol = P(compress_cache=True, gbs=2, ngb=2)
    runs = {}
    for path, devices in (("reference", ("cuda",)), ("kernels", ("cuda", "cpu"))):
        monkeypatch.setattr(offload_kv, "INT4_KERNEL_DEVICES", devices)
        llm = LLM.load(str(dirs["llama3"]), device="cpu", kv_cache_memory=KV, block_size=4,
                       max_num_seqs=4, policy=pol)
        runs[path] = staggered(llm, prompts())
        assert all(isinstance(v, Int4KernelTierLayer) == (path == "kernels")
                   for v in llm.engine.kv_cache.views)
    assert runs["kernels"] == runs["reference"]


@interpreted_cuda_route("kv4_cpu_kernels")
def test_int4_host_cache_staged_for_the_kernel_gives_the_same_tokens(dirs, monkeypatch):
    """A 4-bit cache in pinned host memory under a GPU (``Int4KernelTierLayer._host_mapped``): the kernels
    write it and its fp pool in place, and each decode step copies the range of blocks it reads
    to the GPU for the int4 kernel with shifted block tables (``Int4KernelTierLayer._staged``). Emulated here
    on the CPU (Triton under TRITON_INTERPRET=1; the copy is a slice, the host's waits no-ops):
    the greedy tokens of staggered batches equal the in-place kernel path's, with block ranges
    that hold other sequences' blocks."""
    pytest.importorskip("triton")
    from localgen.runtime.offload import kv as offload_kv
    from localgen.runtime.offload.tier_backends import Int4KernelTierLayer
    from localgen.runtime.offload.tier_layer import TierLayer

    monkeypatch.setattr(offload_kv, "INT4_KERNEL_DEVICES", ("cuda", "cpu"))
    pol = P(compress_cache=True, gbs=2, ngb=2)
    runs, staged = {}, []
    for mapped in (False, True):
        if mapped:
            monkeypatch.setattr(Int4KernelTierLayer, "_host_mapped", lambda self: True)
            monkeypatch.setattr(TierLayer, "_settle_host", lambda self: None)
            real = Int4KernelTierLayer._staged
            monkeypatch.setattr(Int4KernelTierLayer, "_staged",
                                lambda self, meta: staged.append(self._plan(meta).block_range) or real(self, meta))
        llm = LLM.load(str(dirs["llama3"]), device="cpu", kv_cache_memory=KV, block_size=4,
                       max_num_seqs=4, policy=pol)
        runs[mapped] = staggered(llm, prompts())
    assert runs[True] == runs[False]
    assert staged and any(lo > 0 for lo, _ in staged)  # copies that start past block 0


@pytest.mark.parametrize("compress", [False, pytest.param(True, marks=interpreted_cuda_route(
    "kv4_gpu_kernels and w4_kv4_gpu_kernels (decode graphs)"))])
def test_graph_decode_gives_the_eager_tokens(dirs, monkeypatch, compress):
    """A policy with everything on the GPU tier decodes through the CUDA-graph runner (all of a
    step's sequences in one static batch, padded to its bucket, 4-bit pool rows assigned on the
    host): run here without capture (``capture=False``, Triton under TRITON_INTERPRET=1), it gives
    the eager zig-zag schedule's greedy tokens over staggered batches of 1-4 sequences."""
    pytest.importorskip("triton")
    from localgen.runtime.cuda_graphs import GraphedModelRunner
    from localgen.runtime.offload import kv as offload_kv

    monkeypatch.setattr(offload_kv, "INT4_KERNEL_DEVICES", ("cuda", "cpu"))
    pol = P(compress_weight=compress, compress_cache=compress, gbs=2, ngb=2)
    runs, replays = {}, []
    for graphed in (False, True):
        llm = LLM.load(str(dirs["llama3"]), device="cpu", kv_cache_memory=KV, block_size=4,
                       max_num_seqs=4, policy=pol)
        runner = llm.engine.runner
        assert runner.graphs is None  # only on CUDA by itself
        if graphed:
            runner.graphs = GraphedModelRunner(runner.model, runner.kv, 4, llm.engine.max_model_len,
                                               capture=False)
            decode = runner.graphs.decode
            monkeypatch.setattr(runner.graphs, "decode", lambda seqs: replays.append(len(seqs)) or decode(seqs))
        together = prompts(5, lengths=(4, 9, 6))  # three at once: a batch of 3 padded to 4
        runs[graphed] = staggered(llm, prompts()) + [run_staggered(llm, [together[0]])[0]] + \
            _at_once(llm, together)
    assert runs[True] == runs[False]
    assert {1, 3, 4} <= set(replays) and len(replays) >= 15
    assert [b for b, _ in sorted(runner.graphs.graphs)] == [1, 4]


def _graphed(llm: LLM, replays: list, monkeypatch, prefill: bool):
    """Give ``llm``'s offload runner decode graphs and, with ``prefill``, prefill graphs, run
    without capture; ``replays`` collects the size of each block a prefill graph serves."""
    from localgen.runtime.cuda_graphs import GraphedModelRunner
    from localgen.runtime.offload.prefill_graphs import PrefillGraphs

    runner = llm.engine.runner
    runner.graphs = GraphedModelRunner(runner.model, runner.kv, 4, llm.engine.max_model_len, capture=False)
    if not prefill:
        return None
    runner.prefill_graphs = pg = PrefillGraphs(runner, capture=False)
    run_block = pg.run_zigzag_block
    monkeypatch.setattr(pg, "run_zigzag_block", lambda b: (out := run_block(b)) is not None and replays.append(len(b)) or out)
    return pg


@interpreted_cuda_route("w4_kv4_prefill_graphs")
@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no_pool"])
def test_graph_prefill_gives_the_eager_tokens_and_cache(dirs, monkeypatch, pool):
    """Whole-prompt prefill blocks of a 4-bit all-GPU-tier policy through the static graph path
    (run here without capture, Triton under TRITON_INTERPRET=1), with and without the
    recent-block pool: a block shape goes through it from its second sighting on; after such a
    block, every layer's packed cache and pool equal the eager schedule's bit for bit; greedy
    tokens equal over blocks of 4 and 1 prompts, the same graph refilled with other prompts,
    prompt lengths a multiple of the block size and not; an eager prefill (mixed lengths) drops
    the graphs."""
    pytest.importorskip("triton")
    from localgen.runtime.offload import kv as offload_kv
    from localgen.runtime.offload import runner as offload_runner

    monkeypatch.setattr(offload_kv, "INT4_KERNEL_DEVICES", ("cuda", "cpu"))
    if not pool:
        cache = offload_runner.TieredKVCache
        monkeypatch.setattr(offload_runner, "TieredKVCache",
                            lambda *a, **kw: cache(*a, **{**kw, "recent_blocks": 0}))
    pol = P(compress_weight=True, compress_cache=True, gbs=2, ngb=2)
    g = torch.Generator().manual_seed(7)
    shapes = ((4, 9), (4, 9), (4, 9), (5, 8), (5, 8))
    rounds = [torch.randint(6, 300, shape, generator=g).tolist() for shape in shapes]
    runs, states, replays, held, pg = {}, {}, [], [], None
    for graphed in (False, True):
        llm = LLM.load(str(dirs["llama3"]), device="cpu", kv_cache_memory=KV, block_size=4,
                       max_num_seqs=4, policy=pol, enable_prefix_caching=False)
        # decode graphs in both runs: their pool rows are assigned per step, the eager
        # decode's per GPU batch, so the pools would differ by more than the prefill
        pg = _graphed(llm, replays, monkeypatch, prefill=graphed) or pg
        runs[graphed] = _at_once(llm, rounds[0])
        ids = [llm.add_request(Request(prompt_token_ids=p, sampling=GREEDY)) for p in rounds[1]]
        llm.step()  # the second (4, 9) block's prefill alone: graphed
        states[graphed] = [{k: t.clone() for k, t in {**v.t, "pool_k": v.pool_k, "pool_v": v.pool_v}.items()
                            if t is not None} for v in llm.engine.kv_cache.views]
        done = {}
        while llm.has_unfinished():
            done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
        runs[graphed] += [done[i] for i in ids] + [t for ps in rounds[2:] for t in _at_once(llm, ps)]
        if graphed:
            held = sorted(pg.graphs)
        runs[graphed] += staggered(llm, prompts())  # mixed lengths: eager prefills
    assert runs[True] == runs[False]
    for eager, graph in zip(states[False], states[True]):
        assert eager.keys() == graph.keys() and ("pool_k" in eager) == pool
        assert all(torch.equal(eager[k], graph[k]) for k in eager)
    # (4, 9) captured at round 2 and replayed at 3, released by round 4's first (4, 8) sighting
    assert replays == [4, 4, 4, 1] and held == [(1, 8), (4, 8)] and not pg.graphs
    assert pg.seen[(4, 9)] == 2 and pg.seen[(4, 8)] == 2


@interpreted_cuda_route("placements (fused layers on every CUDA run)")
@pytest.mark.parametrize("name", ["all_gpu_tier", "cpu_attention", "int4"])
def test_fused_layers_give_the_torch_tokens(dirs, monkeypatch, name):
    """The offload schedule's layers through the fused Triton kernels (add+RMSNorm, rope from
    positions, silu*mul; what CUDA runs, here under TRITON_INTERPRET=1) give the torch layer's
    greedy tokens, for a GPU-tier, a CPU-attention and a 4-bit placement."""
    pytest.importorskip("triton")
    from localgen.models import llama
    from localgen.runtime.offload import kv as offload_kv

    monkeypatch.setattr(offload_kv, "INT4_KERNEL_DEVICES", ("cuda", "cpu"))
    pol = PLACEMENTS.get(name) or P(compress_weight=True, compress_cache=True, gbs=2, ngb=2)
    runs, calls = {}, []
    fused_layer = llama.layer_step
    for fused in (False, True):
        monkeypatch.setattr(llama, "fused_enabled", lambda h, on=fused: on)
        monkeypatch.setattr(llama, "layer_step", lambda *a: calls.append(1) or fused_layer(*a))
        llm = LLM.load(str(dirs["llama_4l"]), device="cpu", kv_cache_memory=KV, block_size=4,
                       max_num_seqs=4, policy=pol, offload_dir=str(dirs["llama_4l"] / "off"))
        runs[fused] = staggered(llm, prompts())
        assert bool(calls) == fused
    assert runs[True] == runs[False]


def _at_once(llm: LLM, ps) -> list[list[int]]:
    ids = [llm.add_request(Request(prompt_token_ids=p, sampling=GREEDY)) for p in ps]
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
    return [done[i] for i in ids]


def test_graph_pool_rows():
    """The host side of a graphed 4-bit decode step: one row per sequence for all layers, a row
    made mid-block filled from the block's 4-bit values in every layer, None (an eager step) when
    the pool has fewer rows than sequences or an own block is shared."""
    from localgen.runtime.offload.kv import TieredKVCache
    from localgen.runtime.offload.timers import Timers
    from tests.tiny_models import make_config
    from localgen.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(make_config("llama3").to_dict())
    cpu = torch.device("cpu")
    kv = TieredKVCache(cfg, 16, 4, torch.float32, cpu, ["gpu"] * cfg.num_layers, True, False, None,
                       Timers(cpu), recent_blocks=2)
    for view in kv.views:  # block 3 holds 4-bit codes of 1.0 (scale 0, min 1)
        for name in ("k", "v"):
            view._packed(name).packed[3] = 0
            view._packed(name).scale[3] = 0
            view._packed(name).min[3] = 1
    assert kv.graph_pool_rows([[0, 1], [2, 3]], [6, 7]) == [0, 1]
    assert all(torch.equal(v.pool_k[1], torch.ones_like(v.pool_k[1])) for v in kv.views)  # made mid-block
    assert kv.graph_pool_rows([[0, 1], [2, 3]], [7, 8]) == [0, 1]  # kept
    assert kv.graph_pool_rows([[0, 1], [2, 3], [4, 5]], [8, 8, 5]) is None  # 3 sequences, 2 rows
    assert kv.graph_pool_rows([[0, 1], [0, 1, 2]], [7, 9]) is None  # block 1: own, and read by the other
    assert kv.recent.scratch == 2 and kv.views[0].pool_k.shape[0] == 3


def test_bare_cuda_device_is_resolved(monkeypatch):
    """The cache compares its compute device with its tensors' devices; a bare "cuda" must become
    "cuda:<current>" first (it once sent a GPU-tier 4-bit cache down the gather path)."""
    from localgen.runtime.offload.kv import resolve_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda:1")
    assert resolve_device(torch.device("cuda:0")) == torch.device("cuda:0")
    assert resolve_device("cpu") == torch.device("cpu")


def test_pinning_failure_falls_back_to_pageable(monkeypatch):
    from localgen.runtime.offload import memory

    memory._reset_pin_state()
    real = torch.empty

    def empty(*a, pin_memory=False, **kw):
        if pin_memory:
            raise RuntimeError("cudaHostAlloc failed: out of memory (locked-memory limit)")
        return real(*a, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.warns(RuntimeWarning, match="pageable"):
        buf = memory.host_empty(1024, pin=True)
    assert buf.numel() == 1024 and not buf.is_pinned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        memory.host_empty(16, pin=True)
    memory._reset_pin_state()


def test_assign_tiers_layer_granularity():
    from localgen.policy.policy import assign_tiers

    assert assign_tiers([1] * 4, (0.25, 0.5, 0.25)) == ["gpu", "cpu", "cpu", "disk"]
    assert assign_tiers([1] * 3, (0, 1, 0)) == ["cpu"] * 3
    assert assign_tiers([1] * 32, (0.2, 0.8, 0)).count("gpu") in (6, 7)


def test_disk_policy_needs_offload_dir(dirs):
    with pytest.raises(ValueError, match="offload dir"):
        LLM.load(str(dirs["llama3"]), device="cpu", kv_cache_memory=KV, policy=P(w=(0, 0, 1)))


@pytest.mark.parametrize("lens", [[5, 5, 5], [3, 7, 2, 1]])
def test_fresh_prefill_attention(lens):
    """The fresh-prompt prefill attention of an off-GPU cache tier (one call for equal prompts,
    one per prompt otherwise) against causal attention written out in float64, with GQA."""
    from localgen.attention.prefill import fresh_prefill_attention

    g = torch.Generator().manual_seed(len(lens))
    T, H, KVH, D = sum(lens), 8, 2, 16
    q, k, v = (torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (H, KVH, KVH))
    got = fresh_prefill_attention(q.float(), k.float(), v.float(), lens, 0.25)
    want, s = [], 0
    for n in lens:
        kk, vv = (x[s:s + n].repeat_interleave(H // KVH, 1) for x in (k, v))
        sc = torch.einsum("thd,shd->hts", q[s:s + n], kk) * 0.25
        sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want.append(torch.einsum("hts,shd->thd", sc.softmax(-1), vv))
        s += n
    torch.testing.assert_close(got.double(), torch.cat(want), atol=1e-5, rtol=1e-5)


def test_side_store_room_check(monkeypatch):
    """The side-stream prefill store's memory check on a (faked) CUDA device: a bare "cuda"
    device is resolved to an index before torch's per-device queries (torch refuses it; an
    earlier version passed it and silently lost the in-place cache path), and the store is
    declined when the K/V it keeps alive plus the layer's later temporaries would pass 90% of
    the capped GPU (Llama-2-7B, a 16 x 512 GPU batch under a 6 GiB cap: the case that ran out)."""
    from types import SimpleNamespace

    from localgen.policy.presets import preset_config
    from localgen.runtime.offload import kv as kv_mod
    from localgen.runtime.offload.tier_backends import _room_for

    gib = 1 << 30
    seen = []

    def props(i):
        seen.append(i)
        return SimpleNamespace(total_memory=80 * gib)

    def fraction(i):
        seen.append(i)
        return 6 / 80

    allocated = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: allocated[0])
    cfg = preset_config("llama-2-7b")
    tokens = 16 * 512
    qkv = torch.empty(tokens, 3, 8, dtype=torch.float16)  # stands for the fused qkv output
    k, v = qkv[:, 1], qkv[:, 2]
    held = qkv.untyped_storage().nbytes()
    later = tokens * kv_mod.prefill_temp_bytes_per_token(cfg, torch.float16)
    assert later == tokens * (4096 + 3 * 11008 + 2 * 4096) * 2
    allocated[0] = 5 * gib
    assert not _room_for(k, v, torch.device("cuda"), later)
    assert seen and all(isinstance(i, int) for i in seen)
    allocated[0] = int(0.9 * 6 * gib) - held - later - 1
    assert _room_for(k, v, torch.device("cuda"), later)
    allocated[0] += 2
    assert not _room_for(k, v, torch.device("cuda", 0), later)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_block_dequantization_kernel_matches_reference(head_dim):
    """Gathered 4-bit K/V blocks through the Triton dequantizer (on the kernels' device) equal
    ``dequantize_int4`` to the last bit of fp16, including head_dim 80's short last group."""
    pytest.importorskip("triton")
    from localgen.kernels.quant_ref import dequantize_int4, quantize_int4
    from localgen.runtime.offload.tier_layer import _dequantize_blocks

    x = torch.randn(5, 4, 2, head_dim, device=KERNEL_DEVICE) * 3
    p, s, z = quantize_int4(x, 64, dim=-1)
    ids = torch.tensor([3, 0, 4], device=KERNEL_DEVICE)
    got = _dequantize_blocks(p[ids], s[ids], z[ids], torch.float16)
    want = dequantize_int4(p[ids], s[ids], z[ids], 64, dim=-1, dtype=torch.float16)
    assert got.shape == (3, 4, 2, head_dim)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -10


def test_activation_tier_off_cuda_keeps_tensors():
    """Off CUDA (and with ``hc`` 0) hidden states stay where they are: store/prefetch/load pass
    the tensor through, so the CPU schedule is the one the placement tests check."""
    from localgen.runtime.offload.activations import ActivationTier
    from localgen.runtime.offload.timers import Timers

    h = torch.randn(6, 8)
    for hg, hc in ((0.0, 1.0), (1.0, 0.0)):
        acts = ActivationTier(hg, hc, torch.device("cpu"), Timers(torch.device("cpu")))
        assert not acts.active
        held = acts.prefetch(acts.store(h, 0))
        assert held is h and acts.load(held) is h and acts.host_bytes() == 0
