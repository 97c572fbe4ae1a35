from simsched.allocator import make_key
from simsched.offload import HIT, HIT_PENDING, MISS, CPUTier


def test_cpu_tier_states_and_lru():
    a, b, c, d = (make_key(0, h) for h in range(4))    # offload keys (group_id, block hash)
    t = CPUTier(2)
    assert t.prepare_store([a, b]) == [a, b]
    assert t.lookup(a) == HIT_PENDING
    assert t.prepare_store([c]) is None            # nothing evictable while being written
    t.complete_store([a, b], {})
    assert t.lookup(a) == HIT
    t.touch([a])
    assert t.prepare_store([c]) == [c]             # evicts b, the least recently used
    assert t.lookup(b) == MISS and t.lookup(a) == HIT
    t.prepare_load([a])
    t.complete_store([c], {})
    assert t.prepare_store([d]) == [d]             # a is being loaded: c goes
    assert t.lookup(c) == MISS


def test_load_window_covers_a_partial_rightmost_chunk():
    """GroupOffloadConfig.load_window_size_in_chunks (0.30.0+): a SlidingWindowSpec group's
    window in chunks is max(window_in_chunks, cdiv(sliding_window - 1 + (-num_tokens % tpc),
    tpc)); other windowed groups keep their window."""
    from simsched.case import Case
    from simsched.model import Model
    from simsched.geometry import PROFILES
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
    from simsched.geometry import PROFILES
    from simsched.model import Model
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
