from simsched.allocator import NULL, KVCacheManager, Request
from simsched.layout import Group


def mgr(groups, n=64, align=16):
    return KVCacheManager(groups, [g.block_size for g in groups], n, align)


def req(n_tokens, rid="r", groups=1, seed=1):
    return Request(rid, 0, None, [(seed * 31 + i) % 1000 for i in range(n_tokens)], n_tokens + 4,
                   16, groups)


def test_full_holds_every_block_and_null_block_never_used():
    kv = mgr([Group("full", 16)])
    r = req(100)
    nb = kv.allocate(r, 100)
    assert len(nb[0]) == 7 and NULL not in nb[0]
    assert kv.pool.num_free() == 63 - 7


def test_sliding_window_frees_out_of_reach():
    kv = mgr([Group("sliding_window", 16, sliding_window=32)])
    r = req(160)
    kv.allocate(r, 160)
    r.num_computed = 160
    kv.allocate(r, 1)
    assert r.tables[0][:8] == [NULL] * 8 and NULL not in r.tables[0][8:]


def test_chunked_local_and_mamba_keep_reach_only():
    kv = mgr([Group("chunked_local", 16, attention_chunk_size=64),
              Group("mamba", 16, mamba_cache_mode="align")])
    r = req(100, groups=2)
    kv.allocate(r, 100)
    r.num_computed = 100
    kv.allocate(r, 1)
    assert r.tables[0][:4] == [NULL] * 4
    assert r.tables[1][:6] == [NULL] * 6 and r.tables[1][6] != NULL


def test_ring_holds_one_block_for_life():
    kv = mgr([Group("full", 16), Group("ring", 4)])
    r = req(100, groups=2)
    kv.allocate(r, 100)
    r.num_computed = 100
    kv.allocate(r, 50)
    assert len(r.tables[1]) == 1


def test_gpu_hit_needs_every_group_and_eviction_lru():
    groups = [Group("full", 16), Group("sliding_window", 16, sliding_window=32)]
    kv = mgr(groups, n=40)
    a = req(100, "a", 2)
    kv.allocate(a, 100, cache_upto=100)
    kv.free(a)
    b = req(100, "b", 2)
    assert kv.find_hit(b) == 96
    # evict the sliding window's tail blocks: no hit at that length any more
    kv.pool.get_new_blocks(kv.pool.num_free() - 10)
    assert kv.find_hit(b) < 96


def test_pool_dry_returns_none():
    kv = mgr([Group("full", 16)], n=4)
    assert kv.allocate(req(100), 100) is None


def test_admission_cap_of_recycling_groups():
    """SlidingWindowSpec.max_admission_blocks_per_request = cdiv(window - 1 + in_flight, bs) + 1
    and ChunkedLocalAttentionSpec's cdiv(chunk + in_flight, bs) cap the full-sequence admission
    gate (apply_admission_cap); a full group needs cdiv(num_tokens, bs); a ring its one block."""
    groups = [Group("full", 16), Group("sliding_window", 16, sliding_window=128),
              Group("chunked_local", 16, attention_chunk_size=64), Group("ring", 4)]
    kv = KVCacheManager(groups, [16, 16, 16, 4], 512, 16, max_in_flight_tokens=64)
    r = req(1000, groups=4)
    full, sw, cl = 63, -(-(127 + 64) // 16) + 1, -(-(64 + 64) // 16)
    assert (sw, cl) == (13, 8)
    assert kv.admission_blocks(r, 0, 0, 1000, True) == full + sw + cl + 1
    assert kv.admission_blocks(r, 0, 0, 1000, False) == 3 * full + 1


def test_out_of_window_blocks_are_freed_group_by_group():
    """KVCacheCoordinator.remove_skipped_blocks calls each group's manager in turn, and each
    (_remove_blocks_in_range) frees its blocks, last first, in its own BlockPool.free_blocks
    call; unhashed blocks go to the front of the free queue, so the later group's end up first."""
    groups = [Group("sliding_window", 16, sliding_window=32),
              Group("sliding_window", 16, sliding_window=32)]
    kv = KVCacheManager(groups, [16, 16], 64, 16, enable_prefix_caching=False)
    r = req(64, groups=2)
    kv.allocate(r, 64)
    g0, g1 = list(r.tables[0]), list(r.tables[1])
    kv.remove_skipped_blocks(r, 63)                    # 32 tokens out of the window: 2 blocks
    assert r.tables[0][:2] == r.tables[1][:2] == [NULL, NULL]
    assert kv.pool.get_new_blocks(4) == [g1[1], g1[0], g0[1], g0[0]]


def test_shared_prefix_boundary_is_the_longer_full_attention_hit():
    """HybridKVCacheCoordinator.find_longest_cache_hit returns num_uncached_common_prefix_tokens
    = longest hit of one attention type - reconciled hit; get_computed_blocks makes it the
    request's shared_prefix_boundary (hit + uncached, 0 if none): here the full group hits 64
    tokens, the sliding-window group none of its window blocks, so the hit is 0 and the
    junction 64."""
    groups = [Group("full", 16), Group("sliding_window", 16, sliding_window=32)]
    kv = KVCacheManager(groups, [16, 16], 64, 16)
    a = req(80, groups=2)
    kv.allocate(a, 80, cache_upto=80)
    for b in a.tables[1]:                  # forget the window group's blocks
        kv.pool._uncache(b, kv.pool.key[b])
        kv.pool.key[b] = None
    b = req(80, rid="b", groups=2)
    assert kv.find_hit(b) == 0 and kv.junction == 64
    assert kv.find_hit(req(80, rid="c", groups=2, seed=2)) == 0 and kv.junction == 0
