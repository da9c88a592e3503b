"""KV groups (localgen/kv/groups.py): a model that mixes sliding-window and full-attention layers
(Gemma 2 and 3; the tiny fixtures of tests/fixtures/families/ have a window of 8 under prompts of
11 to 20 tokens) keeps one pool and one block table per window. Its greedy tokens equal
transformers' far past the window, from the Hugging Face directory and the GGUF; its sliding
group holds at most ``ceil(window / block_size) + 1`` blocks per sequence from the prefill on (the
prefill of its sliding layers attends over the step's own K/V), so a sliding pool is sized by
``max_num_seqs`` alone, while the full group holds the whole context; every pool is whole again
when the sequences finish. A model of one group keeps one pool, one table per sequence and the
tables of a bare ``BlockManager``."""

from __future__ import annotations

import functools

import pytest
import torch

from localgen.api import LLM, Request, SamplingParams
from localgen.kv.block_manager import BlockManager
from localgen.kv.cache import PagedKVCache, plan_group_blocks, plan_num_blocks, window_pool_blocks
from localgen.kv.groups import GroupedBlockManager, KVGroup, kv_groups
from localgen.runtime.cuda_graphs import GraphedModelRunner
from tests.fixtures.families.make_fixtures import HERE
from tests.test_engine_vs_hf import hf_greedy

WINDOW = 8  # sliding_window of the gemma2 and gemma3 fixtures
NEW = 40  # generated tokens: five windows past a 20-token prompt
CASES = [(n, s) for n in ("gemma2", "gemma3") for s in ("hf", "gguf")]


def _prompts(lengths=(20, 11, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(6, 300, (n,), generator=g).tolist() for n in lengths]


@functools.lru_cache(maxsize=None)
def _hf_tokens(name: str) -> list[list[int]]:
    """transformers' greedy tokens (float32) for each of ``_prompts()``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(HERE / name, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, NEW) for p in _prompts()]


@pytest.fixture
def reference():
    return _hf_tokens


def _load(name: str, source: str, block_size: int = 4, **kw) -> LLM:
    """The fixture with room for ``_requests()`` alone (3 sequences of at most 64 tokens), so a
    sliding pool is smaller than the full pool and hands out released blocks again."""
    path = HERE / name if source == "hf" else HERE / f"{name}.gguf"
    kw.setdefault("kv_cache_memory", 1 << 22)
    kw.setdefault("max_num_seqs", 3)
    kw.setdefault("max_model_len", 64)
    return LLM.load(str(path), device="cpu", dtype="float32", block_size=block_size, **kw)


def _requests() -> list[Request]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [Request(prompt_token_ids=p, sampling=sp, request_id=f"r{i}")
            for i, p in enumerate(_prompts())]


def _run(llm: LLM, each_step=None) -> list[list[int]]:
    """Greedy tokens of ``_requests()``, all submitted at once; ``each_step(engine)`` after every
    step."""
    for r in _requests():
        llm.add_request(r)
    out = {}
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        if each_step is not None:
            each_step(llm.engine)
    return [out[f"r{i}"] for i in range(len(out))]


def test_layers_are_grouped_by_window_full_attention_first():
    groups = kv_groups([8, 8, None, 16, 8, None])
    assert groups == (KVGroup(None, (2, 5)), KVGroup(8, (0, 1, 4)), KVGroup(16, (3,)))
    assert kv_groups([None] * 3) == (KVGroup(None, (0, 1, 2)),)
    assert kv_groups([4] * 2) == (KVGroup(4, (0, 1)),)  # Mistral: one group that slides
    with pytest.raises(ValueError, match="at least one layer"):
        kv_groups([])
    with pytest.raises(ValueError, match="layer 1's sliding window"):
        kv_groups([None, 0])


@pytest.mark.parametrize("name,source", CASES)
def test_greedy_tokens_equal_transformers_far_past_the_window(reference, name, source):
    """The window-8 pool has 3 * (2 + 1) + 1 = 10 blocks of 4 tokens, fewer than the 45 the
    three sequences take in the full pool: its tables differ from the full group's."""
    llm = _load(name, source)
    kv = llm.engine.kv_cache
    assert [g.window for g in kv.groups] == [None, WINDOW] and kv.group_blocks[1] == 10
    assert _run(llm) == reference(name)


def test_the_sliding_group_holds_only_its_window_and_every_pool_comes_back_whole(reference):
    """Block size 16 (the default): a table of the sliding group keeps at most
    ceil(8 / 16) + 1 = 2 live blocks once decoding; the full group's holds every block. The
    sliding pool has 3 * 2 + 1 = 7 blocks, the three sequences 12 in the full one."""
    llm = _load("gemma3", "hf", block_size=16)
    bm = llm.engine.block_manager
    full, sliding = bm.pools
    assert sliding.num_blocks == 7
    seen = []

    def check(engine):
        for s in engine.scheduler.running:
            want = full.blocks_for(s.num_tokens - 1)  # the last sampled token has no K/V yet
            assert len(s.block_table) == full.live_blocks(s.block_table) == want
            (table,) = s.group_tables
            if s.num_output_tokens > 1:  # decoded at least once: blocks behind the window went
                assert sliding.live_blocks(table) <= -(-WINDOW // 16) + 1
                seen.append(len(table) - sliding.live_blocks(table))
    assert _run(llm, check) == reference("gemma3")
    assert max(seen) >= 3  # tables grew well past their live blocks
    assert full.num_free_blocks == full.num_blocks and sliding.num_free_blocks == sliding.num_blocks
    assert llm.metrics.kv_blocks_used == 0 and llm.metrics.kv_blocks_total == bm.num_blocks


def test_a_sliding_pool_is_sized_for_windows_and_the_full_pool_takes_the_rest():
    """Hand-computed: 6 layers of one KV head of 16 float32 dims, 16-token blocks: 2048 bytes a
    layer's block. With 2 sequences, the window-8 pool needs 2 * (1 + 1) + 1 = 5 blocks, for
    contexts of 64 tokens or of a million; a budget of 1 * 100 + 5 * 5 layer-blocks gives the
    full layer 100 blocks, where one pool of every layer would hold 125 / 6 = 20."""
    shape = type("Shape", (), dict(num_layers=6, num_kv_heads=1, head_dim=16))
    groups = kv_groups([WINDOW] * 5 + [None])
    assert window_pool_blocks(WINDOW, 16, 2) == 5 and window_pool_blocks(40, 16, 3) == 13
    assert plan_group_blocks(shape, groups, 16, torch.float32, torch.device("cpu"),
                             2048 * (100 + 5 * 5), 2, 1 << 20) == [100, 5]
    args = (16, torch.float32, torch.device("cpu"))
    budget = 2048 * (1 * 100 + 5 * 5)
    assert plan_group_blocks(shape, groups, *args, budget, 2, 64) == [100, 5]
    assert plan_group_blocks(shape, groups, *args, budget - 1, 2, 64) == [99, 5]
    assert plan_num_blocks(shape, *args, budget, 2 * 64) == 20
    small = 2048 * 6 * 3  # below the window pool's need: both pools get the same 3 blocks
    assert plan_group_blocks(shape, groups, *args, small, 2, 64) == [3, 3]
    with pytest.raises(ValueError, match="holds no block"):
        plan_group_blocks(shape, groups, *args, 2048 * 6 - 1, 2, 64)
    kv = PagedKVCache(shape, [100, 5], 16, torch.float32, torch.device("cpu"), groups)
    assert kv.group_block_bytes == [2048, 5 * 2048] and kv.bytes_per_block == 6 * 2048
    assert kv.nbytes == 2048 * (101 + 5 * 6) and kv.num_blocks == 5
    assert [v.kv_group for v in kv.views] == [1] * 5 + [0]


def test_admission_and_growth_need_room_in_every_group():
    bm = GroupedBlockManager.build([(32, None), (3, WINDOW)], block_size=4)
    tables, cached = bm.allocate(list(range(12)))  # 3 blocks in each pool
    assert cached == 0 and [len(t) for t in tables] == [3, 3]
    assert not bm.can_allocate(list(range(100, 104)))  # the full pool has 29 free; sliding none
    assert not bm.can_append(tables, 13)  # the 13th token needs a 4th sliding block
    other = GroupedBlockManager.build([(32, None), (5, WINDOW)], block_size=4)
    tables, _ = other.allocate(list(range(12)))
    tokens = list(range(13))
    other.append(tables, tokens)  # the query at 12 sees 5..12: block 0 goes to the placeholder,
    # the fifth sliding block
    assert other.live_blocks(1, tables[1]) == 3 and other.live_blocks(0, tables[0]) == 4
    other.free(tables)
    assert other.num_free_blocks == other.num_blocks == 37
    with pytest.raises(ValueError, match="single KV group"):
        GroupedBlockManager([BlockManager(4), BlockManager(4, sliding_window=WINDOW)])


def test_a_mixed_model_reuses_no_prefix_and_still_decodes_transformers_tokens(reference):
    llm = _load("gemma3", "hf", enable_prefix_caching=True)
    assert not any(p.enable_prefix_caching for p in llm.engine.block_manager.pools)
    assert _run(llm) == reference("gemma3")
    assert _run(llm) == reference("gemma3")  # the same prompts again: computed, not reused
    assert llm.metrics.cached_prompt_tokens == 0


def test_preemption_in_a_mixed_model_keeps_transformers_tokens(reference):
    """85 layer-blocks of 512 bytes: the window pool's 10 blocks for 5 layers leave the full
    layer 35 blocks of 4 tokens, where the three sequences end needing 43: sequences are
    preempted and recomputed (a prefill of prompt and output so far, whose sliding group again
    holds only the window)."""
    llm = _load("gemma3", "hf", kv_cache_memory=85 * 512)
    assert llm.engine.kv_cache.group_blocks == (35, 10)
    sliding = llm.engine.block_manager.pools[1]
    recomputed = []

    def check(engine):
        for s in engine.scheduler.running:
            assert sliding.live_blocks(s.group_tables[0]) <= 3
            if s.num_preemptions and s.num_output_tokens > 1:
                recomputed.append(s.request_id)
    assert _run(llm, check) == reference("gemma3")
    assert llm.metrics.num_preemptions > 0 and recomputed
    assert llm.engine.block_manager.num_free_blocks == 45


def test_one_group_keeps_one_pool_and_a_bare_block_managers_tables():
    """Prefix caching on: the grouped manager of one pool hands out exactly the tables, cached
    counts and free counts of a ``BlockManager`` driven by the same calls."""
    bare, grouped = BlockManager(12, 4, sliding_window=WINDOW), GroupedBlockManager.build(
        [(12, WINDOW)], 4)
    a, b = list(range(10)), list(range(9)) + [99]
    ta, ca = bare.allocate(a)
    (ga,), gca = grouped.allocate(a)
    tb, cb = bare.allocate(b)
    (gb,), gcb = grouped.allocate(b)
    assert (ga, gca, gb, gcb) == (ta, ca, tb, cb) and cb == 8
    for tok in range(10, 30):
        a.append(tok)
        bare.append(ta, a)
        grouped.append([ga], a)
        assert ga == ta and grouped.num_free_blocks == bare.num_free_blocks
    for table, grouped_table in ((ta, ga), (tb, gb)):
        bare.free(table)
        grouped.free([grouped_table])
    assert grouped.num_free_blocks == bare.num_free_blocks == 12


def test_a_one_group_model_gets_one_pool_and_one_table_per_sequence():
    llm = _load("mistral", "hf")  # every layer slides: one group that gives blocks back
    kv, bm = llm.engine.kv_cache, llm.engine.block_manager
    assert kv.num_groups == 1 and kv.groups[0].window == WINDOW and bm.pools[0].sliding_window
    assert all(v.kv_group == 0 for v in kv.views)
    seen = []
    _run(llm, lambda e: seen.extend(s.group_tables for s in e.scheduler.running))
    assert seen and not any(seen)


def test_decode_graphs_run_a_mixed_model_eagerly(reference):
    """Whatever the specs say, a sequence of several KV groups never takes a decode graph (the
    graphs hold one block table per sequence); the eager steps give transformers' tokens."""
    llm = _load("gemma3", "hf")
    eng = llm.engine
    runner = GraphedModelRunner(eng.model, eng.kv_cache, 4, eng.max_model_len, capture=False)
    runner.replays = True
    eng.runner = runner
    assert _run(llm) == reference("gemma3")
    assert not runner.graphs


def test_a_prompt_past_a_mixed_models_budget_is_refused_with_the_bytes_of_every_group():
    """5 blocks of 4 tokens in each pool (6 layers x 512 bytes a block): 20 tokens, 15360 bytes;
    a 30-token prompt (and its first output token) needs 8 blocks of every layer, 24576 bytes."""
    from localgen.runtime.request import KVBudgetError

    llm = _load("gemma3", "hf", kv_cache_memory=5 * 6 * 512)
    assert llm.engine.kv_cache.group_blocks == (5, 5) and llm.engine.kv_capacity_tokens == 20
    with pytest.raises(KVBudgetError, match=r"5 blocks of 4 tokens\) holds 20 tokens") as err:
        llm.add_request(Request(prompt_token_ids=list(range(6, 36))))
    assert (err.value.budget_bytes, err.value.needed_bytes) == (15360, 24576)


# ---- a prefill holds only the window in its sliding group ---------------------------------------

@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_after_the_prefill_a_sliding_table_holds_only_its_window(reference, name):
    """4-token blocks, window 8: right after the prefill step (one output token, nothing decoded
    yet) a prompt of L tokens holds blocks ``(L - 8) // 4 ..`` of its sliding table, at most
    ceil(8 / 4) + 1 = 3 of them, the entries before pointing at the placeholder; the full group
    holds all ``ceil(L / 4)``. Every later step stays within 3 too."""
    llm = _load(name, "hf")
    full, sliding = llm.engine.block_manager.pools
    checked = []

    def check(engine):
        for s in engine.scheduler.running:
            (table,) = s.group_tables
            assert sliding.live_blocks(table) <= 3
            if s.num_output_tokens == 1:
                n = s.num_tokens - 1  # the prompt: the sampled token has no K/V yet
                behind = (n - WINDOW) // 4
                assert len(table) == full.blocks_for(n) == full.live_blocks(s.block_table)
                assert sliding.live_blocks(table) == full.blocks_for(n) - behind
                if behind:  # the 17- and 20-token prompts: the placeholder, then the window
                    assert len(set(table[:behind])) == 1 and table[0] not in table[behind:]
                checked.append(n)
    assert _run(llm, check) == reference(name)
    assert sorted(checked) == [11, 17, 20]
    assert sliding.num_free_blocks == sliding.num_blocks


@functools.lru_cache(maxsize=None)
def _hf_long(name: str, length: int, new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(HERE / name, dtype=torch.float32).eval()
    return hf_greedy(hf, _prompts((length,))[0], new)


def _greedy_one(llm: LLM, prompt: list[int], new: int) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.add_request(Request(prompt_token_ids=prompt, sampling=sp, request_id="long"))
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                return o.token_ids
    raise AssertionError("the request never finished")


@pytest.mark.parametrize("name,source", CASES)
def test_a_prompt_longer_than_the_whole_sliding_pool_gives_transformers_tokens(name, source):
    """One sequence, 4-token blocks, window 8: the sliding pool has 1 * (2 + 1) + 1 = 4 blocks
    (16 tokens) whether the context is 64 or 256 tokens, yet a 150-token prompt prefills and
    decodes transformers' tokens (the sliding layers' prefill attends over its own K/V; the
    positions behind the window are never cached)."""
    assert _load(name, source, max_num_seqs=1).engine.kv_cache.group_blocks[1] == 4
    llm = _load(name, source, max_num_seqs=1, max_model_len=256)
    assert llm.engine.kv_cache.group_blocks[1] == 4 and llm.engine.token_limit == 256
    assert _greedy_one(llm, _prompts((150,))[0], 12) == _hf_long(name, 150, 12)


def test_the_triton_backends_windowed_prefill_reads_no_cache(monkeypatch):
    """The paged Triton backend (the interpreter on the CPU) on Gemma 3 with a prompt past its
    sliding pool: the windowed layers' prefill goes through ``fresh_prefill_attention``, and the
    tokens are transformers'."""
    pytest.importorskip("triton")
    from localgen.attention.triton import TritonPagedBackend
    from tests.conftest import KERNEL_DEVICE

    if KERNEL_DEVICE.type == "cpu":
        monkeypatch.setattr("localgen.runtime.model_runner.select_backend",
                            lambda *a, **kw: TritonPagedBackend())
    llm = LLM.load(str(HERE / "gemma3"), device=KERNEL_DEVICE.type, dtype="float32",
                   block_size=4, kv_cache_memory=1 << 22, max_num_seqs=1, max_model_len=64)
    assert type(llm.engine.runner.attention) is TritonPagedBackend
    assert llm.engine.kv_cache.group_blocks[1] == 4
    assert _greedy_one(llm, _prompts((40,))[0], 6) == _hf_long("gemma3", 40, 6)


def _packed(lens, heads=4, kv_heads=2, dim=16):
    """q, k, v of packed prompts of ``lens`` tokens, k/v strided views of one qkv tensor (as a
    fused projection gives them)."""
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(sum(lens), (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, :heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(-1, kv_heads, dim)
    return q, k, v


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_fresh_prefill_attends_over_the_steps_kv_and_never_the_cache(backend):
    """Window 5 with soft-cap and sinks over prompts of 7, 20 and 3 tokens: the cache is NaN
    and every slot goes to the scratch block, yet each backend's prefill equals the paged
    reference over a cache holding the prompts (``paged_feature_attention``)."""
    from localgen.attention.metadata import AttentionMetadata, LayerKV
    from localgen.attention.reference import TorchReferenceBackend
    from localgen.attention.spec import AttentionSpec
    from localgen.kernels import paged_attention_ref as ref

    if backend == "triton":
        pytest.importorskip("triton")
        from localgen.attention.triton import TritonPagedBackend
        from tests.conftest import KERNEL_DEVICE
        attention, device = TritonPagedBackend(), KERNEL_DEVICE
    else:
        attention, device = TorchReferenceBackend(), torch.device("cpu")
    lens, bs = [7, 20, 3], 4
    q, k, v = _packed(lens)
    spec = AttentionSpec(16 ** -0.5, 5, 2.0, torch.linspace(-1.0, 1.0, 4))
    tables = torch.tensor([[0, 1, 0, 0, 0], [2, 3, 4, 5, 6], [7, 0, 0, 0, 0]])
    k_cache, v_cache = torch.zeros(9, bs, 2, 16), torch.zeros(9, bs, 2, 16)
    slots = torch.cat([tables[i, torch.arange(n) // bs] * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    ref.write_kv(k_cache, v_cache, k, v, slots)
    want = ref.paged_feature_attention(q, k_cache, v_cache, tables, lens, lens, spec.scale, 5,
                                       2.0, spec.sinks)
    pair = torch.full((2, 9, bs, 2, 16), float("nan"), device=device)
    kv = LayerKV(pair[0], pair[1], pair, attention)
    scratch = torch.tensor([8 * bs + p % bs for n in lens for p in range(n)], device=device)
    meta = AttentionMetadata(True, scratch, tables.to(device), torch.tensor(lens, device=device),
                             lens, lens, fresh_prefill=True)
    sinks = spec.sinks.to(device)
    got = kv.attend(q.to(device), k.to(device), v.to(device), meta,
                    AttentionSpec(spec.scale, 5, 2.0, sinks))
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)



@pytest.mark.parametrize("window", [5, None])
def test_a_feature_prefill_in_query_chunks_sees_only_the_keys_it_needs(monkeypatch, window):
    """Prompts of 7, 20 and 3 tokens in chunks of 4 queries (soft-cap and sinks, window 5 or
    none) equal one call a prompt, and each chunk's call gets at most its own rows plus the
    window's keys behind them (none: the keys up to its last row), not the whole prompt."""
    from localgen.attention.prefill import fresh_feature_attention
    from localgen.attention.spec import AttentionSpec
    from localgen.kernels import paged_attention_ref as ref

    lens = [7, 20, 3]
    q, k, v = _packed(lens)
    spec = AttentionSpec(16 ** -0.5, window, 2.0, torch.linspace(-1.0, 1.0, 4))
    whole = fresh_feature_attention(q, k, v, lens, spec, query_chunk=64)
    spans, inner = [], ref.feature_attention

    def spy(qc, keys, vals, first, *rest):
        spans.append((qc.shape[0], keys.shape[0], first))
        return inner(qc, keys, vals, first, *rest)

    monkeypatch.setattr(ref, "feature_attention", spy)
    chunked = fresh_feature_attention(q, k, v, lens, spec, query_chunk=4)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)
    assert len(spans) == 2 + 5 + 1
    for rows, keys, first in spans:
        assert keys == first + rows  # the chunk's last query sees the last key given
        assert window is None or first <= window - 1

def test_a_window_prefill_pool_allocates_the_window_and_the_placeholder():
    """Window 8, 4-token blocks, 5 blocks: a 21-token prompt takes (21 - 8) // 4 = 3 placeholder
    entries and blocks 3..5 (3 live) plus the placeholder itself: 4 blocks, 1 left; another
    such prompt then needs 3 (the placeholder is shared), a 4-token one 1. Decoding to 25 tokens
    takes a 7th entry and gives block 3 back."""
    with pytest.raises(ValueError, match="window_prefill"):
        BlockManager(5, 4, True, WINDOW, window_prefill=True)
    bm = BlockManager(5, 4, False, WINDOW, window_prefill=True)
    assert bm.prefill_blocks(21) == 4 and bm.prefill_blocks(8) == 2
    assert bm.capacity_tokens > 1 << 40  # 5 blocks >= 3 live + the placeholder
    table, cached = bm.allocate(list(range(21)))
    assert cached == 0 and len(table) == 6 and len(set(table[:3])) == 1
    assert table[0] not in table[3:] and bm.live_blocks(table) == 3 and bm.num_free_blocks == 1
    assert bm.prefill_blocks(21) == 3 and not bm.can_allocate(list(range(21)))
    short, _ = bm.allocate(list(range(4)))
    assert len(short) == bm.live_blocks(short) == 1 and bm.num_free_blocks == 0
    bm.free(short)
    for n in range(22, 26):
        bm.append(table, list(range(n)))
    assert len(table) == 7 and len(set(table[:4])) == 1 and bm.live_blocks(table) == 3
    bm.free(table)
    assert bm.num_free_blocks == 5
    assert BlockManager(3, 4, False, WINDOW, window_prefill=True).capacity_tokens == 12


def test_each_layers_spec_carries_its_own_window():
    """Gemma 3's fixture: layers 0..4 slide over 8 tokens, layer 5 attends globally (its
    ``layer_types``); Mistral's every layer slides; Qwen3's none."""
    from localgen.attention.spec import layer_specs
    from localgen.models.config import ModelConfig
    from localgen.runtime.model_runner import layer_windows

    def cfg(name):
        import json
        return ModelConfig.from_hf_dict(json.loads((HERE / name / "config.json").read_text()))

    gemma3 = cfg("gemma3")
    assert [s.sliding_window for s in layer_specs(gemma3)] == [WINDOW] * 5 + [None]
    assert layer_windows(gemma3) == [gemma3.dense.window(i) for i in range(6)]
    assert [s.sliding_window for s in layer_specs(cfg("mistral"))] == [WINDOW] * 2
    assert all(s.plain for s in layer_specs(cfg("qwen3")))
