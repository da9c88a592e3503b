"""Block allocator, block tables, reference counts and prefix caching, checked by hand."""

import pytest

from localgen.kv.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_rounds_up_to_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    table, cached = bm.allocate(list(range(10)))  # 10 tokens -> 3 blocks
    assert len(table) == 3 and cached == 0 and bm.num_free_blocks == 5
    bm.free(table)
    assert bm.num_free_blocks == 8 and table == []


def test_shared_prefix_blocks_are_reused_and_ref_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, _ = bm.allocate(list(range(10)))
    b, cached = bm.allocate(list(range(8)) + [99, 98, 97])  # same first 2 full blocks
    assert cached == 8 and b[:2] == a[:2] and b[2] != a[2]
    assert [bm.blocks[i].ref_count for i in a[:2]] == [2, 2]
    assert bm.num_free_blocks == 8 - 3 - 1
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b[:2]] == [1, 1]


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(list(range(8)))
    _, cached = bm.allocate(list(range(8)))  # fully cached prompt: the last block is recomputed
    assert cached == 4


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, _ = bm.allocate(list(range(9)))
    first = a[0]
    bm.free(a)
    b, cached = bm.allocate(list(range(8)) + [5])
    assert cached == 8 and b[0] == first
    bm.free(b)
    # fill the whole cache with other tokens: the old prefix is evicted
    c, _ = bm.allocate([50 + i for i in range(16)])
    bm.free(c)
    _, cached = bm.allocate(list(range(9)))
    assert cached == 0


def test_decode_fills_block_then_registers_it_for_reuse():
    bm = BlockManager(num_blocks=8, block_size=4)
    toks = [1, 2, 3]
    table, _ = bm.allocate(toks)
    toks.append(4)
    bm.append(table, toks)  # completes block 0
    toks.append(5)
    bm.append(table, toks)  # needs a new block
    assert len(table) == 2
    _, cached = bm.allocate([1, 2, 3, 4, 9])
    assert cached == 4


def test_no_prefix_caching_and_exhaustion():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    bm.allocate(list(range(5)))
    assert not bm.can_allocate([1])
    with pytest.raises(NoFreeBlocksError):
        bm.allocate([1])
    _, cached = BlockManager(4, 4, enable_prefix_caching=False).allocate(list(range(9)))
    assert cached == 0
