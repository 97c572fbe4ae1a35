from simsched.model.request import make_key
from simsched.model.cpu_manager import (HIT, HIT_PENDING, MISS, CPUOffloadingManager, RankedCPUManager,
                                  tuple_set_order)


def test_cpu_tier_states_and_lru():
    a, b, c, d = (make_key(0, h) for h in range(4))    # offload keys (group_id, block hash)
    t = CPUOffloadingManager(2)
    assert t.prepare_store([a, b]) == [a, b]
    assert t.lookup(a) == HIT_PENDING
    assert t.prepare_store([c]) is None            # nothing evictable while being written
    t.complete_store([a, b], [None, None])
    assert t.lookup(a) == HIT
    t.touch([a])
    assert t.prepare_store([c]) == [c]             # evicts b, the least recently used
    assert t.lookup(b) == MISS and t.lookup(a) == HIT
    t.prepare_load([a])
    t.complete_store([c], [None])
    assert t.prepare_store([d]) == [d]             # a is being loaded: c goes
    assert t.lookup(c) == MISS


def test_load_window_covers_a_partial_rightmost_chunk():
    """GroupOffloadConfig.load_window_size_in_chunks (0.30.0+): a SlidingWindowSpec group's
    window in chunks is max(window_in_chunks, cdiv(sliding_window - 1 + (-num_tokens % tpc),
    tpc)); other windowed groups keep their window."""
    from simsched.case import Case
    from simsched.model import Model
    from simsched.profiles import PROFILES
    layout = {"groups": [{"kind": "full", "block_size": 16},
                         {"kind": "sliding_window", "block_size": 16, "sliding_window": 128},
                         {"kind": "chunked_local", "block_size": 16, "attention_chunk_size": 64}],
              "engine": {"num_gpu_blocks": 64}}
    m = Model(Case.from_json({"layout": layout, "requests": []}),
              PROFILES["prefix-cacheable-windows-in-config"])
    off = m.off
    sw, cl = off.cfgs[1], off.cfgs[2]
    assert sw.sliding_window_in_chunks == 8                      # cdiv(127, 16)
    # right paddings 0, 15, 14, 1: cdiv(127, 16) = 8, cdiv(142, 16) = 9, cdiv(141, 16) = 9,
    # cdiv(128, 16) = 8
    assert [off._load_window(sw, n) for n in (96, 97, 98, 111)] == [8, 9, 9, 8]
    assert off._load_window(cl, 98) == cl.sliding_window_in_chunks


def test_lookup_restarts_store_index_from_0330():
    """0.33.0's get_num_new_matched_tokens sets every group's next_stored_chunk_idx to 0
    ("Restarting at token 0: offer every chunk again."): a resumed request offers its hit chunks
    for storing again (prepare_store skips those still in the tier). 0.32.0 keeps the index."""
    from simsched.case import Case
    from simsched.model import Model
    from simsched.profiles import PROFILES
    case = Case.from_json({"layout": {"groups": [{"kind": "full", "block_size": 16}],
                                      "engine": {"num_gpu_blocks": 64}},
                           "requests": [{"id": "a", "prompt": [[7, 64]]}]})
    out = {}
    for name in ("prefix-cacheable-strict-unit", "prefix-cacheable-windows-in-config"):
        m = Model(case, PROFILES[name])
        m.q.run_until(0)                       # a arrives and runs its prefill: 4 chunks stored
        st = m.off.req_status["a"]
        assert st.groups[0].next_stored == 4
        m.off.get_num_new_matched_tokens(m.reqs["a"], 0)
        out[name] = st.groups[0].next_stored
    assert out == {"prefix-cacheable-strict-unit": 4, "prefix-cacheable-windows-in-config": 0}


def _random_tier_run(seed: int, request_ranks: bool, steps: int = 60) -> int:
    """Random stores, completions, loads and request finishes on a small RankedCPUManager. Before
    every store that must evict, the victims are worked out by brute force from the entries:
    the evictable chunks (ready, no load in flight) not named by the store, lowest (rank, key)
    first; the store must evict exactly those, or refuse (None) and evict nothing when there are
    too few. Returns the number of evicting stores checked."""
    import random
    from types import SimpleNamespace as NS
    rng = random.Random(seed)
    cfgs = [NS(group_id=0, tokens_per_chunk=16), NS(group_id=1, tokens_per_chunk=16)]
    tier = RankedCPUManager(6, request_ranks, cfgs)
    reqs = []
    for r in range(4):
        idents = [100 * r + rng.randrange(3) * 1000 + i for i in range(5)]   # some shared
        reqs.append(NS(req=NS(rid=f"r{r}"), groups=[NS(keys=[make_key(g, h) for h in idents])
                                                    for g in (0, 1)]))
    writing, loading, checked = [], [], 0
    for step in range(steps):
        op = rng.randrange(5)
        st = rng.choice(reqs)
        if op <= 1:
            g = rng.randrange(2)
            lo = rng.randrange(5)
            keys = st.groups[g].keys[lo:lo + rng.randint(1, 3)]
            entries = tier.chunks
            new = [k for k in keys if k not in entries]
            n_evict = len(new) - (tier.capacity - len(entries))
            candidates = sorted((c.rank, k) for k, c in entries.items()
                                if c.ref_cnt == 0 and k not in keys)
            before = set(entries)
            got = tier.prepare_store(keys, st)
            if n_evict > 0:
                checked += 1
                if len(candidates) < n_evict:
                    assert got is None and set(tier.chunks) == before
                    continue
                assert before - set(tier.chunks) == {k for _, k in candidates[:n_evict]}
            assert got == new
            writing.append(new)
        elif op == 2 and writing:
            done = writing.pop(rng.randrange(len(writing)))
            tier.complete_store(done, [None] * len(done))
        elif op == 3:
            ready = [k for g in st.groups for k in g.keys if tier.is_ready(k)]
            if ready:
                keys = ready[:rng.randint(1, 2)]
                tier.prepare_load(keys, st)
                loading.append(keys)
            elif loading:
                tier.complete_load(loading.pop(0))
        else:
            if loading:
                tier.complete_load(loading.pop(0))
            tier.on_request_finished(st)
    return checked


def test_ranked_tier_evicts_the_lowest_evictable_chunks():
    """RankedCPUManager (0.31.0+ LRUCachePolicy) keeps its eviction candidates in a heap whose
    stale items are dropped lazily: whatever the order of stores, completions, loads and
    finishes, an eviction takes exactly the lowest (rank, key) evictable chunks not protected
    by the store."""
    checked = sum(_random_tier_run(seed, rr) for seed in range(150) for rr in (False, True))
    assert checked > 500        # the runs do reach full tiers
    # longer runs (the heap rebuilt when its stale items outnumber the evictable chunks)
    assert sum(_random_tier_run(seed, rr, 600) for seed in range(20) for rr in (False, True))


def _key_lists(rng) -> list[list]:
    """Four requests' key lists of 8 keys in random groups, some idents shared between them."""
    lists = []
    for r in range(4):
        idents = [100 * r + rng.randrange(3) * 1000 + i for i in range(8)]   # some shared
        lists.append([make_key(rng.randrange(3), h) for h in idents])
    return lists


def test_load_job_chunks_match_a_per_chunk_walk():
    """update_state_after_alloc appends a load job's chunks by slices: chunks
    ``n_local // bpc .. cdiv(num_cached, tpc) - 1`` (within the offload keys), chunk ``c``
    loading the blocks ``[max(c * bpc, n_local), min((c + 1) * bpc, n_gpu))`` (``n_local``: the
    first block not cached on the GPU, ``n_gpu`` the blocks of the computed tokens). Checked
    against that per-chunk walk for random hits, block tables and chunk sizes (partial chunks at
    either end included)."""
    import random
    from simsched.case import Case
    from simsched.model import Model
    from simsched.profiles import PROFILES
    rng = random.Random(5)
    for it in range(300):
        bpc = rng.randint(1, 4)
        case = Case.from_json({
            "layout": {"groups": [{"kind": "full", "block_size": 4}],
                       "engine": {"num_gpu_blocks": 256, "blocks_per_chunk": bpc}},
            "requests": [{"id": "a", "prompt": [[7, rng.randint(8, 160)]]}]})
        m = Model(case, PROFILES["prefix-cacheable-windows-in-config"], checks="fast")
        m._arrival(0)
        off, req = m.off, m.reqs["a"]
        off.asserts = False         # (hits not chunk-aligned, beyond the keys: partial chunks)
        st = off.req_status["a"]
        off.update_offload_keys(st)
        gs = st.groups[0]
        keys, tpc = gs.keys, off.cfgs[0].tokens_per_chunk
        tier = off.tier
        got = tier.prepare_store(keys)
        tier.complete_store(got, [None] * len(got))
        num_local = rng.randint(0, req.num_tokens - 1)
        num_external = rng.randint(1, req.num_tokens - num_local)
        num_cached = num_local + num_external
        n_gpu = -(-num_cached // 4)
        table = rng.sample(range(1, 256), n_gpu)
        # the GPU-cached blocks: those of the first n_cached (a NULL block counts as cached)
        n_cached = rng.randint(0, -(-num_local // 4))
        block_keys: list = [None] * 256
        for i in range(n_cached):
            if rng.random() < 0.2:
                table[i] = 0
            else:
                block_keys[table[i]] = i
        st.num_local = num_local
        job = off.update_state_after_alloc(req, [table], num_external, block_keys)
        if n_gpu == n_cached:
            assert job is not None and not job.chunks()
            continue
        hpc = off.cfgs[0].hashes_per_chunk
        want = [(0, c, hpc * c + hpc - 1, keys[c],
                 [(i, table[i]) for i in range(max(c * bpc, n_cached), min((c + 1) * bpc, n_gpu))])
                for c in range(n_cached // bpc, min(-(-num_cached // tpc), len(keys)))]
        assert job.chunks() == want, it
        # (chunks() reads bpos[x]:bpos[x + 1] only: its length and its end too)
        assert len(job.bpos) == len(want) + 1 and job.bpos[-1] == len(job.bids) == len(job.bidx)


def test_tuple_set_order_is_the_set_of_pairs_order():
    """tuple_set_order orders keys as the set of their (group_id, ident) tuples iterates."""
    import random
    from simsched.model.request import key_group, key_ident

    for seed in range(200):
        rng = random.Random(seed)
        groups = sorted(rng.choices(range(4), k=rng.randrange(30)))
        pairs = [(g, rng.randrange(-2 ** 63, 2 ** 63)) for g in groups]
        keys = [make_key(g, h) for g, h in pairs]
        want = [make_key(g, h) for g, h in set((key_group(k), key_ident(k)) for k in keys)]
        assert tuple_set_order(keys) == want


def test_sliding_window_nulling_visits_every_block_a_store_reads():
    """``build_connector_meta``'s nulling of re-allocated blocks walks only ``sw_held`` and, with
    offload_prompt_only, only the blocks of the prompt's whole chunks from next_stored on; a
    state leaves ``sw_held`` when it has none left and joins again with new blocks. Checked over
    generated cases (sources, the methods wrapped): after each call every state outside
    ``sw_held`` has no such block, and every store job reads only blocks of the prompt's whole
    chunks."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = '''
from simsched.lockstep import generate_case
from simsched.model import run_case
from simsched.model.offloading_scheduler import OffloadingConnectorScheduler
import simsched
assert not simsched.compiled()
meta = OffloadingConnectorScheduler.build_connector_meta
build = OffloadingConnectorScheduler._build_store_jobs
seen = [0, 0]
def limit(off, st, gi):
    stop = len(st.groups[gi].block_ids)
    if off.prompt_only:
        stop = min(stop, st.req.num_prompt // off.cfgs[gi].tokens_per_chunk * off.bpc)
    return stop
def checked_meta(self, *a, **k):
    out = meta(self, *a, **k)
    for rid, st in self.req_status.items():
        for gi in self.sw_groups:
            if st.groups[gi].next_stored * self.bpc < limit(self, st, gi):
                assert rid in self.sw_held, rid
                seen[0] += 1
    return out
def checked_build(self, *a, **k):
    jobs = build(self, *a, **k)
    for job in jobs:
        st = self.req_status[job.rid]
        if self.prompt_only:
            for x in range(len(job.gids)):
                gi = [c.group_id for c in self.cfgs].index(job.gids[x])
                cap = st.req.num_prompt // self.cfgs[gi].tokens_per_chunk * self.bpc
                assert all(i < cap for i in job.bidx[job.bpos[x]:job.bpos[x + 1]])
                seen[1] += 1
    return jobs
OffloadingConnectorScheduler.build_connector_meta = checked_meta
OffloadingConnectorScheduler._build_store_jobs = checked_build
for layout in ("full16+sw16w128+full16", "full16+sw16w64"):
    for seed in range(60):
        case = generate_case(seed, layout, async_scheduling=seed % 3 == 0)
        for profile in ("every-group", "prefix-cacheable-windows-in-config"):
            run_case(case, profile, checks="fast", trace=False)
assert seen[0] > 100 and seen[1] > 1000, seen
print("ok", seen)
'''
    env = dict(os.environ, SIMSCHED_PURE="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent,
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_jobs_keep_their_chunks():
    """A job keeps the tier's chunks of its keys (Job.cpu_chunks: from chunks_of after
    prepare_store, and from prepare_load) and its completion uses them: under random stores,
    loads and completions in any order (evictions included), the chunks kept are still the keys'
    chunks when the job completes, and each tier ends as the same tier completed by keys alone."""
    import random
    from types import SimpleNamespace as NS

    def state(t):
        return ({k: (c.ref_cnt, c.content, c.rank) for k, c in t.chunks.items()},
                list(t.evictable), t.evictions)

    cfgs = [NS(group_id=g, tokens_per_chunk=16) for g in range(3)]
    evicted = 0
    for seed in range(200):
        rng = random.Random(seed)
        make = [lambda: CPUOffloadingManager(8),
                lambda: RankedCPUManager(8, rng.random() < 0.5, cfgs)][seed % 2]
        by_chunks, by_keys = make(), make()
        lists = _key_lists(rng)
        writing, loading = [], []
        for _ in range(120):
            op = rng.randrange(5)
            keys = rng.choice(lists)
            if op <= 1:
                lo = rng.randrange(8)
                sub = keys[lo:lo + rng.randint(1, 4)]
                got = by_chunks.prepare_store(sub)
                assert by_keys.prepare_store(sub) == got
                if got:
                    writing.append((got, by_chunks.chunks_of(got)))
            elif op == 2 and writing:
                done, chunks = writing.pop(rng.randrange(len(writing)))
                assert all(by_chunks.chunks[k] is c for k, c in zip(done, chunks))
                contents = [("c", k) for k in done]
                by_chunks.complete_store(done, contents, chunks)
                by_keys.complete_store(done, contents)
            elif op == 3:
                ready = [k for k in keys if by_keys.is_ready(k)]
                if ready:
                    sub = ready[:rng.randint(1, 3)]
                    chunks = by_chunks.prepare_load(sub)
                    by_keys.prepare_load(sub)
                    loading.append((sub, chunks))
            elif loading:
                done, chunks = loading.pop(rng.randrange(len(loading)))
                assert all(by_chunks.chunks[k] is c for k, c in zip(done, chunks))
                by_chunks.complete_load(done, chunks)
                by_keys.complete_load(done)
            assert state(by_chunks) == state(by_keys)
        evicted += by_chunks.evictions
    assert evicted > 1000
