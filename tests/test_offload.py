from simsched.offload import HIT, HIT_PENDING, MISS, CPUTier


def test_cpu_tier_states_and_lru():
    t = CPUTier(2)
    assert t.prepare_store(["a", "b"]) == ["a", "b"]
    assert t.lookup("a") == HIT_PENDING
    assert t.prepare_store(["c"]) is None          # nothing evictable while being written
    t.complete_store(["a", "b"], {})
    assert t.lookup("a") == HIT
    t.touch(["a"])
    assert t.prepare_store(["c"]) == ["c"]         # evicts b, the least recently used
    assert t.lookup("b") == MISS and t.lookup("a") == HIT
    t.prepare_load(["a"])
    t.complete_store(["c"], {})
    assert t.prepare_store(["d"]) == ["d"]         # a is being loaded: c goes
    assert t.lookup("c") == MISS
