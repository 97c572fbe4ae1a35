from simsched.model.block_pool import NULL, BlockPool
from simsched.model.kv_cache_manager import KVCacheManager
from simsched.model.request import Request, make_key
from simsched.model.single_type_kv_cache_manager import (mamba_reachable_blocks, replay_boundaries,
                                                   window_reachable_blocks)
from simsched.layout import Group


def mgr(groups, n=64, align=16):
    return KVCacheManager(groups, [g.block_size for g in groups], n, align)


def req(n_tokens, rid="r", groups=1, seed=1):
    return Request(rid, 0, None, [(seed * 31 + i) % 1000 for i in range(n_tokens)], n_tokens + 4,
                   16, groups)


def test_full_holds_every_block_and_null_block_never_used():
    kv = mgr([Group("full", 16)])
    r = req(100)
    nb = kv.allocate_slots(r, 100)
    assert len(nb[0]) == 7 and NULL not in nb[0]
    assert kv.pool.get_num_free_blocks() == 63 - 7


def test_sliding_window_frees_out_of_reach():
    kv = mgr([Group("sliding_window", 16, sliding_window=32)])
    r = req(160)
    kv.allocate_slots(r, 160)
    r.num_computed = 160
    kv.allocate_slots(r, 1)
    assert r.tables[0][:8] == [NULL] * 8 and NULL not in r.tables[0][8:]


def test_chunked_local_and_mamba_keep_reach_only():
    kv = mgr([Group("chunked_local", 16, attention_chunk_size=64),
              Group("mamba", 16, mamba_cache_mode="align")])
    r = req(100, groups=2)
    kv.allocate_slots(r, 100)
    r.num_computed = 100
    kv.allocate_slots(r, 1)
    assert r.tables[0][:4] == [NULL] * 4
    assert r.tables[1][:6] == [NULL] * 6 and r.tables[1][6] != NULL


def test_ring_holds_one_block_for_life():
    kv = mgr([Group("full", 16), Group("ring", 4)])
    r = req(100, groups=2)
    kv.allocate_slots(r, 100)
    r.num_computed = 100
    kv.allocate_slots(r, 50)
    assert len(r.tables[1]) == 1


def test_gpu_hit_needs_every_group_and_eviction_lru():
    groups = [Group("full", 16), Group("sliding_window", 16, sliding_window=32)]
    kv = mgr(groups, n=40)
    a = req(100, "a", 2)
    kv.allocate_slots(a, 100, cache_upto=100)
    kv.free(a)
    b = req(100, "b", 2)
    assert kv.get_computed_blocks(b) == 96
    # evict the sliding window's tail blocks: no hit at that length any more
    kv.pool.get_new_blocks(kv.pool.get_num_free_blocks() - 10)
    assert kv.get_computed_blocks(b) < 96


def test_pool_dry_returns_none():
    kv = mgr([Group("full", 16)], n=4)
    assert kv.allocate_slots(req(100), 100) is None


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
    kv.allocate_slots(r, 64)
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
    kv.allocate_slots(a, 80, cache_upto=80)
    for b in a.tables[1]:                  # forget the window group's blocks
        kv.pool.uncache(b)
    b = req(80, rid="b", groups=2)
    assert kv.get_computed_blocks(b) == 0 and kv.junction == 64
    assert kv.get_computed_blocks(req(80, rid="c", groups=2, seed=2)) == 0 and kv.junction == 0


# --- Mamba in align mode (MambaManager, mamba_cache_mode == "align") -------------------------
# Expectations derived from vllm/v1/core/single_type_kv_cache_manager.py, MambaManager (0.30.0 to
# 0.33.0 alike for these rules, num_speculative_blocks 0, no prefill checkpoint blocks).

MAMBA = Group("mamba", 16, mamba_cache_mode="align")


def test_mamba_align_allocates_one_state_block_after_nulls():
    """allocate_new_blocks: num_required_blocks = cdiv(num_tokens, block_size); the request's
    blocks are padded with null blocks up to num_required_blocks - 1 and one new block holds the
    running state. A 100-token chunk: 6 nulls and 1 block (a full-attention group: 7 blocks)."""
    kv = mgr([Group("full", 16), MAMBA])
    r = req(100, groups=2)
    nb = kv.allocate_slots(r, 100)
    assert len(nb[0]) == 7 and NULL not in nb[0]
    assert nb[1][:6] == [NULL] * 6 and len(nb[1]) == 7 and nb[1][6] != NULL
    assert kv.pool.get_num_free_blocks() == 63 - 8


def test_mamba_align_chunks_leave_null_gaps_and_free_the_old_state():
    """Chunked prefill (32 tokens, then 40): the first chunk's state block sits at index 1, the
    second chunk adds nulls at 2 and 3 and its state at 4 (num_required 5). The next allocation
    (remove_skipped_blocks at 72 computed: get_num_skipped_tokens = 71, blocks [0, 4) out of
    reach; _remove_blocks_in_range skips the nulls instead of stopping at them) frees index 1."""
    kv = mgr([MAMBA])
    r = req(100)
    first = kv.allocate_slots(r, 32)[0]
    assert first[0] == NULL and first[1] != NULL
    r.num_computed = 32
    second = kv.allocate_slots(r, 40)[0]
    assert second[:2] == [NULL, NULL] and second[2] != NULL
    assert r.tables[0][1] == first[1]                    # still held: it seeds the next chunk
    r.num_computed = 72
    kv.allocate_slots(r, 1)
    assert r.tables[0][:4] == [NULL] * 4 and r.tables[0][4] == second[2]
    assert kv.pool.ref[first[1]] == 0                    # freed


def test_mamba_align_hit_takes_only_the_state_at_the_boundary():
    """find_longest_cache_hit: a Mamba hit is the one state block ending at the hit length, null
    blocks before it; the hit block is freed (to the evictable tail) once the next chunk's state
    exists: the hit 64 of a 100-token request then the 36 remaining tokens give [0,0,0,H,0,0,S]."""
    kv = mgr([Group("full", 16), MAMBA])
    a = req(64, "a", 2)
    kv.allocate_slots(a, 64, cache_upto=64)                    # the state at 64 is cached
    a.num_computed = 64
    state = a.tables[1][3]
    kv.free(a)
    b = req(100, "b", 2)
    assert kv.get_computed_blocks(b) == 64
    kv.apply_hit(b, 64)
    h = b.tables[1][3]
    assert b.tables[1] == [NULL, NULL, NULL, state]
    nb = kv.allocate_slots(b, 36, computed=64)
    assert nb[1][:2] == [NULL, NULL] and nb[1][2] != NULL
    b.num_computed = 100
    kv.allocate_slots(b, 1)
    assert b.tables[1][3] == NULL and kv.pool.ref[h] == 0


def test_mamba_align_admission_needs_at_most_one_new_block():
    """get_num_blocks_to_allocate, align mode: num_required - len(new_computed_blocks) -
    len(req_to_blocks), capped at 1 (+ num_speculative_blocks for a request not allocated yet) when
    positive, plus the evictable hit blocks. A 100-token request: 7 full-attention blocks + 1."""
    kv = mgr([Group("full", 16), MAMBA])
    r = req(100, groups=2)
    assert kv.admission_blocks(r, 0, 0, 100, True) == 7 + 1


def test_mamba_align_hit_on_a_state_cached_this_step_waits():
    """get_num_blocks_to_allocate: a hit whose last block was cached in this step
    (cached_blocks_this_step, cleared by new_step_starts) returns num_gpu_blocks + 1, so the
    request is not scheduled in this step; in the next one it is."""
    kv = mgr([Group("full", 16), MAMBA])
    a = req(64, "a", 2)
    kv.new_step()
    kv.allocate_slots(a, 64, cache_upto=64)
    b = req(100, "b", 2)
    assert kv.get_computed_blocks(b) == 64
    assert kv.admission_blocks(b, 64, 64, 100, True) > kv.pool.get_num_free_blocks()
    kv.new_step()
    assert kv.admission_blocks(b, 64, 64, 100, True) == 3 + 1


def test_mamba_align_cached_states_are_offered_to_the_connector():
    """MambaManager.cache_blocks: each state block cached in this step is handed over with its
    boundary (_pending_boundary_state_offloads, drained by take_boundary_state_offloads); a
    chunk ending inside a block caches nothing; freeing a request drops its pending offers
    (pop_blocks_for_free)."""
    kv = mgr([Group("full", 16), MAMBA])
    a = req(100, "a", 2)
    kv.allocate_slots(a, 64, cache_upto=64)
    b = req(100, "b", 2, seed=2)
    kv.allocate_slots(b, 40, cache_upto=40)
    c = req(100, "c", 2, seed=3)
    kv.allocate_slots(c, 32, cache_upto=32)
    kv.free(c)
    assert kv.take_offers() == [("a", 1, a.tables[1][3], 64)]
    assert kv.take_offers() == []


# --- Mamba speculative state blocks (MambaSpec.num_speculative_blocks) -----------------------
# Expectations traced by hand through MambaManager.get_num_blocks_to_allocate and
# allocate_new_blocks (vllm/v1/core/single_type_kv_cache_manager.py, 0.30.0:1713-1933; 0.25.1
# and 0.33.0 alike for these steps: no partial hits, no prefill checkpoint blocks).

def spec_mgr(groups, spec_blocks, n=64, lags=False):
    return KVCacheManager(groups, [g.block_size for g in groups], n, 16,
                          num_speculative_blocks=spec_blocks, mamba_skip_lags=lags)


def test_mamba_align_first_allocation_adds_the_speculative_blocks():
    """num_required_blocks = cdiv(48, 16) + 2 = 5; a request not allocated yet needs 1 + 2
    blocks (get_num_blocks_to_allocate); allocate_new_blocks pads nulls up to index
    num_required_blocks - 2 - 1 = 2 and appends 3 new blocks: the running state at index 2,
    the speculative blocks after it (the release's run: g1=0,0,5,6,7 beside g0=1,2,3,4)."""
    kv = spec_mgr([Group("full", 16), MAMBA], 2)
    r = req(48, groups=2)
    assert kv.admission_blocks(r, 0, 0, 48, True) == 3 + 3
    nb = kv.allocate_slots(r, 48)
    assert nb[1][:2] == [NULL, NULL] and len(nb[1]) == 5 and NULL not in nb[1][2:]
    assert kv.pool.get_num_free_blocks() == 63 - 6


def test_mamba_align_speculative_blocks_move_to_the_end():
    """A 32-token chunk: [0, a, s1, s2]. The next chunk to 96 tokens: num_required_blocks = 6 +
    2 = 8, the running state's index 5 (num_skipped_blocks); nulls up to index 5, then the
    speculative blocks below it (indices 2 and 3) move to the end (_relocate_speculative_block),
    and one new block: [0, a, 0, 0, 0, s1, s2, n]. vLLM reports req_blocks[prev_block_len:], the
    moved blocks included: [0, s1, s2, n]. An allocated request needs one block
    (get_num_blocks_to_allocate)."""
    kv = spec_mgr([MAMBA], 2)
    r = req(200)
    first = kv.allocate_slots(r, 32)[0]
    a, s1, s2 = first[1:]
    assert first[0] == NULL
    r.num_computed = 32
    assert kv.admission_blocks(r, 0, 32, 96, False) == 1
    nb = kv.allocate_slots(r, 64)[0]
    n = nb[-1]
    assert nb == [NULL, s1, s2, n] and n not in first
    assert r.tables[0] == [NULL, a, NULL, NULL, NULL, s1, s2, n]
    # the next step (96 + 3 tokens): the state at 32 (a) is out of reach and freed, unhashed,
    # to the head of the free queue, where the table's new block comes from; the running state
    # (s1) and the speculative blocks stay
    r.num_computed = 96
    kv.allocate_slots(r, 3)
    assert r.tables[0] == [NULL] * 5 + [s1, s2, n, a]


def test_mamba_align_decode_takes_a_block_only_when_the_running_block_moves():
    """Decode with 1 + 2 tokens a step from 48: num_required_blocks = cdiv(51, 16) + 2 = 6, one
    block more than the prefill's 5; the speculative blocks are not below the running state's
    index 3, nothing moves. Then up to 63 tokens nothing is added (6 blocks hold them), and
    at 63 + 3 = 66 the table grows again (7 blocks)."""
    kv = spec_mgr([MAMBA], 2)
    r = req(200)
    kv.allocate_slots(r, 48)
    table = list(r.tables[0])
    r.num_computed = 48
    nb = kv.allocate_slots(r, 3)[0]
    assert len(nb) == 1 and r.tables[0] == table + nb
    for c in (51, 54, 57, 60):
        r.num_computed = c
        assert kv.allocate_slots(r, 3) == [[]]
    r.num_computed = 63
    assert len(kv.allocate_slots(r, 3)[0]) == 1 and len(r.tables[0]) == 7


def test_a_load_allocates_the_speculative_blocks_after_every_group_s_loaded_blocks():
    """allocate_slots of a load (the connector's 64 tokens, nothing to compute):
    allocate_new_computed_blocks gives each group its blocks of the loaded tokens (Mamba: nulls
    and the state block at 64) before allocate_new_blocks adds the Mamba group's 2 speculative
    blocks: with the Mamba group first, its speculative blocks come after the full group's."""
    kv = spec_mgr([MAMBA, Group("full", 16)], 2)
    r = req(100, groups=2)
    assert kv.admission_blocks(r, 0, 64, 64, False) == 3 + 4
    nb = kv.allocate_slots(r, 0, computed=64)
    free = list(range(1, 8))                    # the free queue's head, in order
    assert nb[0] == [NULL, NULL, NULL, free[0], free[5], free[6]]
    assert nb[1] == free[1:5]


def test_mamba_none_mode_allocates_the_speculative_blocks_as_tokens():
    """mamba_cache_mode "none": get_num_blocks_to_allocate and allocate_new_blocks count
    num_tokens + block_size * num_speculative_blocks; the base rule frees the blocks below
    num_computed_tokens - 1."""
    kv = spec_mgr([Group("mamba", 16, mamba_cache_mode="none")], 2)
    r = req(100)
    assert kv.admission_blocks(r, 0, 0, 40, False) == 3 + 2
    assert len(kv.allocate_slots(r, 40)[0]) == 5
    r.num_computed = 40
    kv.allocate_slots(r, 1)
    assert r.tables[0][:2] == [NULL, NULL] and len(r.tables[0]) == 5


def test_0251_frees_mamba_states_on_fewer_computed_tokens():
    """0.25.1's MambaManager.remove_skipped_blocks (0.25.1:1156) frees on num_computed_tokens -
    num_speculative_blocks. A 32-token chunk, then 1 + 2 tokens of which one is kept (33
    computed): 0.26.0 on frees the state at 32 (get_num_skipped_tokens(33) = 32: blocks [0,
    2)), 0.25.1 counts 31 computed tokens (30 skipped: block 0 only) and keeps it."""
    for lags in (True, False):
        kv = spec_mgr([MAMBA], 2, lags=lags)
        r = req(200)
        kv.allocate_slots(r, 32)
        state_32 = r.tables[0][1]
        r.num_computed = 32
        kv.allocate_slots(r, 3)
        r.num_computed = 33
        kv.allocate_slots(r, 3)
        assert (r.tables[0][1] == state_32) == lags


def test_hit_blocks_out_of_reach_of_the_loaded_tokens_are_not_touched():
    """save_new_computed_blocks: the blocks skipped at local + external computed tokens are
    replaced by nulls without being touched, so an evictable hit block keeps its place in the
    free queue (touching then freeing it would move it to the tail)."""
    groups = [Group("full", 16), Group("sliding_window", 16, sliding_window=32)]
    kv = mgr(groups, n=40)
    a = req(100, "a", 2)
    kv.allocate_slots(a, 100, cache_upto=100)
    kv.free(a)
    order = list(kv.pool.free)
    b = req(200, "b", 2)
    L = kv.get_computed_blocks(b)
    assert L == 96
    kv.apply_hit(b, L, L + 64)                           # 64 tokens more from the CPU tier
    sw = b.tables[1]
    assert sw == [NULL] * 6                              # the window at 160 starts past 96
    assert [x for x in kv.pool.free if x not in b.tables[0]] == \
        [x for x in order if x not in b.tables[0]]


def test_mamba_align_prompt_tail_recached_on_0320_only():
    """MambaManager._cache_partial_tail_block, called by cache_blocks with the cacheable tokens
    aligned down (_align_cacheable): at the prompt's last hash boundary, (num_prompt - 1) // 16
    * 16 = 64 for a 70-token prompt, 0.32.0 registers the state block again although it is keyed
    there already, so it is cached this step again and a sibling hitting it waits one more step;
    0.33.0 returns early ("already keyed here"), 0.30.0/0.31.0 skip a Mamba block equal to the
    hash block. a computes 64 tokens (step 0), then its last 6 (step 1): b, hitting a's state at
    64, is deferred in step 1 on 0.32.0 only."""
    for recache, deferred in ((16, True), (0, False)):
        kv = KVCacheManager([Group("full", 16), MAMBA], [16, 16], 64, 16,
                            mamba_tail_recache=recache)
        a = Request("a", 0, None, [(31 + i) % 1000 for i in range(70)], 74, 16, 2)
        kv.new_step()
        kv.allocate_slots(a, 64, cache_upto=64)
        a.num_computed = 64
        kv.new_step()
        kv.allocate_slots(a, 6, cache_upto=70)
        b = Request("b", 1, None, [(31 + i) % 1000 for i in range(64)] + [5] * 36, 104, 16, 2)
        assert kv.get_computed_blocks(b) == 64
        waits = kv.admission_blocks(b, 64, 64, 100, True) > kv.pool.get_num_free_blocks()
        assert waits is deferred, recache


# --- the GPU prefix cache against a straightforward BlockHashToBlockMap ----------------------

class _RefPool:
    """The reference: vLLM's BlockPool as written there (a free list, refcounts, and per key
    the blocks cached under it in insertion order, a hit taking the first)."""

    def __init__(self, n):
        self.free, self.ref, self.key, self.map = list(range(1, n)), [1] + [0] * (n - 1), [None] * n, {}

    def get_new_blocks(self, n):
        out, self.free = self.free[:n], self.free[n:]
        for b in out:
            self.uncache(b)
            self.ref[b] = 1
        return out

    def uncache(self, b):
        k = self.key[b]
        if k is not None:
            self.map[k].remove(b)
            if not self.map[k]:
                del self.map[k]
            self.key[b] = None

    def cache(self, b, k):
        self.key[b] = k
        self.map.setdefault(k, []).append(b)

    def free_blocks(self, blocks):
        head, tail = [], []
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (head if self.key[b] is None else tail).append(b)
        self.free = head + self.free + tail

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1


def test_block_pool_matches_the_reference():
    """BlockPool's free queue (a doubly linked list over block IDs) and its prefix cache (every
    block cached under a key, in caching order): random allocations, cachings (many blocks under
    few keys, equal keys as distinct int objects, keys past 64 bits), frees, hits and uncachings
    behave as the reference, the queue's back links included."""
    import random
    for seed in range(40):
        rng = random.Random(seed)
        n = rng.choice([6, 12, 24])
        pool, ref = BlockPool(n), _RefPool(n)
        idents = [rng.randrange(-2**63, 2**63) for _ in range(rng.choice([2, 5, 12]))]
        keys = [make_key(g, h) for g in range(3) for h in idents]
        held: list[int] = []
        for _ in range(400):
            op = rng.random()
            if op < 0.3 and pool.get_num_free_blocks():
                m = rng.randint(1, pool.get_num_free_blocks())
                got = pool.get_new_blocks(m)
                assert got == ref.get_new_blocks(m)
                held += got
            elif op < 0.55 and held:
                b = rng.choice(held)
                if pool.key[b] is None:
                    k = rng.choice(keys)
                    pool.cache(b, int(str(k)) if rng.random() < 0.5 else k)   # equal, not same
                    ref.cache(b, k)
            elif op < 0.75 and held:
                gone = rng.sample(held, rng.randint(1, len(held)))
                for b in gone:
                    held.remove(b)
                pool.free_blocks(gone)
                ref.free_blocks(gone)
            elif op < 0.9:
                # a hit: the blocks some keys' lookups take
                hit = [b for b in map(pool.holder, rng.sample(keys, 3)) if b is not None]
                pool.touch(hit)
                ref.touch(hit)
                held += hit
            elif held:
                b = rng.choice(held)
                pool.uncache(b)
                ref.uncache(b)
            assert pool.free_queue() == ref.free
            assert pool.get_num_free_blocks() == len(ref.free)
            assert pool.ref == ref.ref and pool.key == ref.key
            queue, back, b = pool.free_block_queue, [], pool.free_block_queue.prev_free[NULL]
            while b != NULL:
                back.append(b)
                b = queue.prev_free[b]
            assert back == ref.free[::-1]
            for k in keys:
                assert pool.cached_block_hash_to_block.blocks(k) == ref.map.get(k, [])
                assert pool.holder(k) == (ref.map[k][0] if ref.map.get(k) else None)


def _longest_hit(kv, r):
    """The hit get_computed_blocks finds, by trying every candidate (no EAGLE): the full
    groups' run of cached blocks bounds it; then the largest multiple of the scheduler block at
    or below it at which every other group finds the blocks in its reach cached."""
    align, pool = kv.config.block_size, kv.pool

    def cached(m, j):
        keys = r.keys(m.gid, m.block_size)
        return j < len(keys) and pool.holder(keys[j]) is not None

    L = r.num_tokens - 1
    if not kv.full:
        L = L // align * align
    for m in kv.full:
        n = 0
        while n < L // m.block_size and cached(m, n):
            n += 1
        L = min(L, n * m.block_size) // align * align
    while L > 0:
        for m in kv.rest:
            lo = m.get_num_skipped_tokens(L) // m.block_size
            hi = L // m.block_size
            if m.kind == "sliding_window" and lo >= hi > 0:
                lo = hi - 1
            if not all(cached(m, j) for j in range(lo, hi)):
                break
        else:
            return L
        L -= align
    return max(L, 0)


def test_the_hit_search_resumes_where_it_missed_and_finds_what_trying_every_length_finds():
    """get_computed_blocks skips, after a miss, every candidate whose reach still covers the
    missing block: with requests sharing prefixes allocated, cached, freed and evicted at random,
    a waiting request's hit is the one trying every candidate length gives."""
    import random
    kinds = [Group("sliding_window", 16, sliding_window=32),
             Group("sliding_window", 16, sliding_window=1),
             Group("chunked_local", 16, attention_chunk_size=64),
             Group("mamba", 16, mamba_cache_mode="align")]
    for seed in range(30):
        rng = random.Random(seed)
        groups = [Group("full", 16)] * rng.randint(0, 1) + rng.sample(kinds, rng.randint(1, 2))
        kv = mgr(groups, n=rng.choice([24, 40, 80]))
        bases = [[rng.randrange(1000) for _ in range(rng.choice([32, 64, 96]))] for _ in range(3)]
        made = 0

        def new_req():
            nonlocal made
            made += 1
            toks = rng.choice(bases) + [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
            return Request(f"r{made}", made, None, toks, 10**6, 16, len(groups))

        waiting = [new_req() for _ in range(3)]
        running: list = []
        for _ in range(120):
            w = rng.choice(waiting)
            L = kv.get_computed_blocks(w)
            assert L == _longest_hit(kv, w), (seed, groups)
            kv.new_step()
            if rng.random() < 0.5 and kv.admission_blocks(w, L, L, w.num_tokens, True) \
                    <= kv.pool.get_num_free_blocks():
                kv.apply_hit(w, L)
                w.num_computed = L
                if kv.allocate_slots(w, w.num_tokens - L, cache_upto=w.num_tokens) is None:
                    kv.free(w)
                    w.num_computed = 0
                    continue
                waiting.remove(w)
                running.append(w)
                waiting.append(new_req())
            elif running and rng.random() < 0.6:
                r = running.pop(rng.randrange(len(running)))
                kv.free(r)


def test_request_keys_are_the_keys_of_their_prefixes():
    """Request.keys(gid, stride) lists make_key(gid, ident_at(k * stride)), k = 1, 2, ..., as far
    as the tokens are known (group 0's keys a unit apart are the identities themselves), for
    requests sharing a prefix with an earlier one and as tokens arrive between calls."""
    import random
    for seed in range(30):
        rng = random.Random(seed)
        unit = rng.choice([4, 8, 16])
        base = [rng.randrange(1000) for _ in range(rng.randint(0, 200))]
        first = Request("a", 0, None, base, 10**6, unit, 3)
        shared = len(base) // unit
        tail = [rng.randrange(1000) for _ in range(rng.randint(0, 60))]
        r = Request("b", 1, None, base + tail, 10**6, unit, 3, first, rng.randint(0, shared))
        for _ in range(20):
            for who in (first, r):
                gid, stride = rng.randrange(3), unit * rng.choice([1, 1, 2, 4])
                want = [make_key(gid, who.ident_at(k * stride))
                        for k in range(1, who.num_tokens // stride + 1)]
                assert who.keys(gid, stride) == want
            r.append_tokens([rng.randrange(1000) for _ in range(rng.choice([1, 1, 3]))])


# --- sparse prefix-cache retention (reachable_block_mask) -----------------------------------

def test_window_mask_keeps_the_tail_at_the_replay_boundary_under_retention_0():
    # window 128, 16-token blocks: need = cdiv(127, 16) = 8; a 64-token prompt's replay boundary
    # 63 aligns to 48, so blocks 0-2 are kept, block 3 is not
    assert window_reachable_blocks(0, 4, 16, 16, 8, 0, 0, (63,)) == [True, True, True, False]
    # dense (None) and a 64-token interval: a tail of 8 covers every segment's blocks
    assert window_reachable_blocks(0, 4, 16, 16, 8, 0, None, (63,)) is None
    assert window_reachable_blocks(0, 4, 16, 16, 8, 0, 64, (63,)) is None
    # dense segments thinner than the window's need: window 17 in 64-token segments (need 1)
    assert window_reachable_blocks(0, 8, 64, 16, 1, 0, None, (63,)) == [
        False, False, False, True, False, False, False, True]


def test_mamba_mask_keeps_the_boundary_state_and_one_per_interval():
    assert mamba_reachable_blocks(0, 4, 16, 16, 0, (63,)) == [False, False, True, False]
    assert mamba_reachable_blocks(0, 4, 16, 16, 32, (63,)) == [False, True, True, True]
    assert mamba_reachable_blocks(0, 4, 16, 16, None, (63,)) is None
    assert mamba_reachable_blocks(0, 4, 16, 16, 16, (63,)) is None


def test_replay_boundaries_eagle_pair():
    assert replay_boundaries(64, 16, False) == (63,)
    # a resend's aligned hit 48 and a longer sibling's 64, each one block lower
    assert replay_boundaries(64, 16, True) == (32, 48)
    assert replay_boundaries(70, 16, True) == (48,)
