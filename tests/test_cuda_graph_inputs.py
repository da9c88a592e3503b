"""The decode graph's input staging (runtime/cuda_graphs.py), checked on the CPU: the flat buffer
of ids, positions, slots, context lengths, pool rows and slots, and block tables the captured
graph reads."""

from types import SimpleNamespace

import numpy as np
import torch

from localgen.runtime.cuda_graphs import GraphedModelRunner, _Graph, _PrefillGraph
from localgen.runtime.request import Priority, SamplingParams
from localgen.runtime.sequence import Sequence


def _graph(batch: int, width: int) -> _Graph:
    staging_t = torch.full((batch * (6 + width),), -7, dtype=torch.long)  # poisoned
    return _Graph(None, batch, width * 16, torch.zeros_like(staging_t), staging_t.numpy(),
                  staging_t, None, None)


def _seq(tokens: list[int], table: list[int]) -> Sequence:
    return Sequence("r", tokens, 1, SamplingParams(), Priority.INTERACTIVE, None,
                    block_table=table)


def test_fill_writes_each_field_and_pads_unused_rows():
    asked = []

    def pool_rows(tables, ctx):  # a cache with a recent-block pool (runtime/offload/kv.py)
        asked.append((tables, ctx))
        return None if len(tables) == 1 else [6, 2]

    runner = object.__new__(GraphedModelRunner)
    runner.kv = SimpleNamespace(block_size=16, scratch_block=99, graph_pool_rows=pool_rows)
    runner.scratch_row, runner.capture = 7, True
    g = _graph(batch=4, width=3)
    a = _seq(list(range(20)), [5, 8])  # 20 tokens: the last one at position 19, block 8 slot 3
    b = _seq([1, 2, 3], [2])
    assert runner._fill(g, [a, b])
    assert asked == [([[5, 8], [2]], [20, 3])]
    got = g.device_inputs
    b4 = 4
    ids, pos, slots, ctx, rows, pool_slots = (got[i * b4:(i + 1) * b4].tolist() for i in range(6))
    table = got[6 * b4:].view(4, 3).tolist()
    assert ids == [19, 3, 0, 0]
    assert pos == [19, 2, 0, 0]
    assert slots == [8 * 16 + 3, 2 * 16 + 2, 99 * 16, 99 * 16]
    assert ctx == [20, 3, 1, 1]
    assert rows == [6, 2, 7, 7]  # padded rows: the scratch row
    assert pool_slots == [6 * 16 + 3, 2 * 16 + 2, 7 * 16, 7 * 16]  # row * block_size + offset
    assert table == [[5, 8, 99], [2, 99, 99], [99, 99, 99], [99, 99, 99]]
    # a step the cache refuses leaves the buffers alone (it runs eagerly)
    assert not runner._fill(g, [b])
    assert g.device_inputs[:4].tolist() == [19, 3, 0, 0]
    # a second, smaller step overwrites the rows that were live before
    runner.kv.graph_pool_rows = lambda tables, ctx: [5]
    assert runner._fill(g, [b])
    assert g.device_inputs[:4].tolist() == [3, 0, 0, 0]
    assert g.device_inputs[4 * b4:5 * b4].tolist() == [5, 7, 7, 7]
    assert g.device_inputs[6 * b4:].view(4, 3)[1].tolist() == [99, 99, 99]
    assert np.all(g.staging == g.device_inputs.numpy())


def test_capture_batches_makes_every_batch_buckets_graph_once_and_steps_use_them():
    """A server's load captures the decode graph of each batch bucket at the smallest context
    bucket (here as the CPU stand-in, ``capture=False``); the steps of three sequences then find
    their graph there (nothing new is captured) and give the tokens of the eager runner."""
    from localgen.api import LLM, Request
    from tests.fixtures.families.make_fixtures import HERE

    def load() -> LLM:
        return LLM.load(str(HERE / "qwen3"), device="cpu", dtype="float32", block_size=4,
                        kv_cache_memory=1 << 22, max_num_seqs=3, max_model_len=64)

    def greedy(llm: LLM) -> dict[str, list[int]]:
        g = torch.Generator().manual_seed(5)
        for i, n in enumerate((9, 14, 6)):
            ids = torch.randint(3, 100, (n,), generator=g).tolist()
            llm.add_request(Request(prompt_token_ids=ids, request_id=f"r{i}",
                                    sampling=SamplingParams(max_tokens=8, temperature=0.0,
                                                            ignore_eos=True)))
        out: dict[str, list[int]] = {}
        while llm.has_unfinished():
            for o in llm.step():
                out[o.request_id] = list(o.token_ids)
        return out

    eager = greedy(load())
    llm = load()
    eng = llm.engine
    runner = GraphedModelRunner(eng.model, eng.kv_cache, 3, eng.max_model_len, capture=False)
    eng.runner = runner
    assert llm.warm_graphs() == 3  # batch buckets 1, 2, 3; one context bucket (64)
    assert sorted(runner.graphs) == [(1, 64), (2, 64), (3, 64)]
    assert llm.warm_graphs() == 0  # each bucket once
    assert greedy(llm) == eager
    assert sorted(runner.graphs) == [(1, 64), (2, 64), (3, 64)]


def test_fill_prefill_pads_the_prompt_into_the_scratch_block():
    runner = object.__new__(GraphedModelRunner)
    runner.kv = SimpleNamespace(block_size=4, scratch_block=9)
    L, width = 16, 5
    staging_t = torch.full((2 * L + 1 + width,), -7, dtype=torch.long)  # poisoned
    g = _PrefillGraph(None, L, width, torch.zeros_like(staging_t), staging_t.numpy(), staging_t,
                      None)
    s = _seq(list(range(100, 110)), [3, 7, 1])  # 10 tokens: blocks 3, 7 and 2 slots of 1
    s.num_prompt_tokens = 10
    runner._fill_prefill(g, s)
    got = g.device_inputs.tolist()
    assert got[:L] == list(range(100, 110)) + [0] * 6
    assert got[L:2 * L] == ([3 * 4 + i for i in range(4)] + [7 * 4 + i for i in range(4)]
                            + [1 * 4, 1 * 4 + 1] + [9 * 4 + p % 4 for p in range(10, 16)])
    assert got[2 * L] == 9  # the prompt's last row
    assert got[2 * L + 1:] == [3, 7, 1, 9, 9]


def test_prefill_graphs_give_the_eager_runners_tokens():
    """Single prompts of several lengths (padded to their buckets, one bucket reused) prefilled
    through the prefill graphs (the CPU stand-in, ``capture=False``), among decode steps of
    other sequences: the same greedy tokens and first-token logits as the eager runner."""
    from localgen.api import LLM, Request
    from tests.fixtures.families.make_fixtures import HERE

    def load() -> LLM:
        return LLM.load(str(HERE / "qwen3"), device="cpu", dtype="float32", block_size=4,
                        kv_cache_memory=1 << 22, max_num_seqs=3, max_model_len=64)

    def greedy(llm: LLM) -> dict[str, tuple[list[int], list]]:
        g = torch.Generator().manual_seed(11)
        out: dict[str, tuple[list[int], list]] = {}
        for i, n in enumerate((9, 16, 13, 5, 30)):  # buckets 16, 16, 16, 16, 32
            ids = torch.randint(3, 100, (n,), generator=g).tolist()
            llm.add_request(Request(prompt_token_ids=ids, request_id=f"r{i}",
                                    sampling=SamplingParams(max_tokens=6, temperature=0.0,
                                                            ignore_eos=True, logprobs=3)))
            for _ in range(2):  # the earlier prompts decode between the arrivals
                for o in llm.step():
                    out[o.request_id] = (list(o.token_ids), o.logprobs)
        while llm.has_unfinished():
            for o in llm.step():
                out[o.request_id] = (list(o.token_ids), o.logprobs)
        return out

    eager = greedy(load())
    llm = load()
    eng = llm.engine
    runner = GraphedModelRunner(eng.model, eng.kv_cache, 3, eng.max_model_len, capture=False,
                                prefill_graphs=True)
    eng.runner = runner
    got = greedy(llm)
    assert sorted(runner.prefill_graphs) == [16, 32]
    # captured at load instead (a server's way), around stand-in prompts: the same tokens
    llm = load()
    eng = llm.engine
    runner = GraphedModelRunner(eng.model, eng.kv_cache, 3, eng.max_model_len, capture=False,
                                prefill_graphs=True)
    eng.runner = runner
    free = eng.block_manager.num_free_blocks
    assert runner.capture_prefills() == 3 and sorted(runner.prefill_graphs) == [16, 32, 64]
    assert runner.capture_prefills() == 0 and eng.block_manager.num_free_blocks == free
    warmed = greedy(llm)
    assert warmed == got
    for rid, (tokens, logprobs) in eager.items():
        assert got[rid][0] == tokens
        first, want = got[rid][1][0], logprobs[0]  # the prefill's own logits
        assert first.token_id == want.token_id
        assert [t for t, _ in first.top] == [t for t, _ in want.top]
        # float32 products over 16 or 32 rows instead of the prompt's: rounding only
        assert abs(first.logprob - want.logprob) < 1e-4
        assert max(abs(a - b) for (_, a), (_, b) in zip(first.top, want.top)) < 1e-4
