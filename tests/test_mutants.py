"""Mutants of the real vLLM offloading scheduler, each caught by the lockstep harness.

Each mutant (``simsched/vllm/inside/mutants.py``) is patched into the real release inside its
worker, only through the explicit ``mutant`` argument of ``run_case``. The same case runs clean
without the mutant. Real-vLLM tests FAIL (never skip) when a release is missing.
"""

from __future__ import annotations

import copy

import pytest

from simsched.case import Case
from simsched.lockstep import HANDMADE, lockstep
from simsched.targets import Releases

LOAD_CASE, FENCE_CASE = HANDMADE["load"], HANDMADE["fence"]


def _with(case: dict, **per_request) -> dict:
    """``case`` with fields of its requests replaced (``a={"decode": 2}``)."""
    out = copy.deepcopy(case)
    for r in out["requests"]:
        r.update(per_request.get(r["id"], {}))
    return out


#: LOAD_CASE with caps: a stores at most 32 tokens; b (GPU hit 16, a's 64 tokens stored) loads
#: at most 32 (0.30.0 parses no max_load_tokens: it loads 48)
STORE_CAP_CASE = _with(LOAD_CASE, a={"max_offload_tokens": 32})
LOAD_CAP_CASE = _with(LOAD_CASE, b={"max_load_tokens": 32})
#: FENCE_CASE with two groups: f's second-group blocks include a's first-group blocks that
#: a's store (latency 8) still reads; the real scheduler flushes it
FENCE2_CASE = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                     {"kind": "full", "block_size": 16}],
                          "engine": {"num_gpu_blocks": 16}},
               "timing": {"store_latency": 8},
               "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 1},
                            {"id": "f", "prompt": [[9, 96]], "arrival": 3, "decode": 1}]}
#: b's load (p's chunk 3, stored and ready) lands in a block of a, whose store (latency 3) has
#: not read it yet: the real scheduler flushes a's store in b's admission step
LOAD_FENCE_CASE = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                              "engine": {"num_gpu_blocks": 8}},
                   "timing": {"store_latency": 3, "load_latency": 1},
                   "requests": [{"id": "p", "prompt": [[7, 64]], "decode": 1},
                                {"id": "a", "prompt": [[9, 64]], "arrival": 2, "decode": 1},
                                {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 3,
                                 "decode": 1}]}
#: a CPU tier of 4 chunks, all p's; f (max_offload_tokens 0: stores nothing) evicts p from the
#: GPU; b loads p's 4 chunks (latency 4) while c's 4 new chunks need slots: with every chunk
#: pinned by b's load, c's store fails to allocate (prepare_store returns None)
EVICT_CASE = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                         "engine": {"num_gpu_blocks": 13, "cpu_chunks": 4}},
              "timing": {"load_latency": 4},
              "requests": [{"id": "p", "prompt": [[7, 64]], "decode": 1},
                           {"id": "f", "prompt": [[9, 176]], "arrival": 2, "decode": 1,
                            "max_offload_tokens": 0},
                           {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 4, "decode": 1},
                           {"id": "c", "prompt": [[11, 64]], "arrival": 5, "decode": 1}]}

VERSIONS = ["0.30.0", "0.33.0"]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(VERSIONS, timeout=120) as p:
        yield p


def caught(pool, version, case, mutant):
    clean = lockstep(Case.from_json(case), version, pool)
    assert clean.agree and not clean.real["findings"], clean.summary()
    res = lockstep(Case.from_json(case), version, pool, mutant=mutant)
    assert res.real["mutant"] == mutant
    return sorted(str(o.signature) for o in res.observations), res


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_store_shift_chunk_is_inv4(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "store_shift_chunk")
    assert "invariant:INV-4" in sigs, res.real["findings"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_drop_fence_is_inv6(pool, version):
    sigs, res = caught(pool, version, FENCE_CASE, "drop_fence")
    assert "invariant:INV-6" in sigs, res.real["findings"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_load_reverse_is_inv5(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "load_reverse")
    assert "invariant:INV-5" in sigs, res.real["findings"]
    assert "divergence:trace.load" in sigs


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_key_wrong_hash_is_inv3(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "key_wrong_hash")
    assert "invariant:INV-3" in sigs, res.real["findings"]


def test_mutant_only_through_the_explicit_argument(pool):
    res = lockstep(Case.from_json(LOAD_CASE), "0.33.0", pool)
    assert res.real["mutant"] is None and res.agree
    bad = lockstep(Case.from_json(LOAD_CASE), "0.33.0", pool, mutant="no_such_mutant")
    assert bad.real["status"] == "worker" and "unknown mutant" in bad.real["message"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_store_key_late_is_inv4(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "store_key_late")
    assert "invariant:INV-4" in sigs, res.real["findings"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_fence_skip_group_is_inv6(pool, version):
    clean = lockstep(Case.from_json(FENCE2_CASE), version, pool)
    assert any(x.startswith("flush ") for x in clean.real["trace"]), clean.real["trace"]
    sigs, res = caught(pool, version, FENCE2_CASE, "fence_skip_group")
    assert "invariant:INV-6" in sigs, res.real["findings"]
    # a layout of one group: the mutant has no group to skip
    one = lockstep(Case.from_json(FENCE_CASE), version, pool, mutant="fence_skip_group")
    assert one.agree and not one.real["findings"], one.summary()


def _stores_of(res, rid: str) -> list[str]:
    return [x for x in res.real["trace"] if x.startswith("store ") and x.split()[2] == rid]


@pytest.mark.parametrize("version", VERSIONS)
def test_max_offload_tokens_caps_stores(pool, version):
    """32 stores a's chunks 0 and 1 only; 0 stores none (every release: min(n, 0) in
    _calc_num_offloadable_tokens)."""
    res = lockstep(Case.from_json(STORE_CAP_CASE), version, pool)
    assert res.agree and not res.real["findings"], res.summary()
    assert [x.split()[3:] for x in _stores_of(res, "a")] == [["g0:0=1", "g0:1=2"]]
    zero = lockstep(Case.from_json(_with(LOAD_CASE, a={"max_offload_tokens": 0})), version,
                    pool)
    assert zero.agree and not zero.real["findings"] and not _stores_of(zero, "a")


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_max_offload_ignored_is_inv10(pool, version):
    sigs, res = caught(pool, version, STORE_CAP_CASE, "max_offload_ignored")
    assert "invariant:INV-10" in sigs, res.real["findings"]
    assert "beyond max_offload_tokens 32" in res.real["findings"][0]["detail"]


def test_mutant_max_load_ignored_is_inv10_on_0330(pool):
    sigs, res = caught(pool, "0.33.0", LOAD_CAP_CASE, "max_load_ignored")
    assert "invariant:INV-10" in sigs, res.real["findings"]
    assert "beyond max_load_tokens 32" in res.real["findings"][0]["detail"]


def test_max_load_tokens_unchecked_where_the_release_has_none_0300(pool):
    """0.30.0's RequestOffloadState parses no max_load_tokens: b loads 48 tokens past its
    GPU hit, beyond the 32 it asks for, and INV-10 does not hold 0.30.0 to it; the mutant that
    drops the cap is refused there."""
    res = lockstep(Case.from_json(LOAD_CAP_CASE), "0.30.0", pool)
    assert res.agree and not res.real["findings"], res.summary()
    loads = [x for x in res.real["trace"] if x.startswith("load ")]
    assert loads == ["load 2 b g0:1=2 g0:2=3 g0:3=4"]
    bad = lockstep(Case.from_json(LOAD_CAP_CASE), "0.30.0", pool, mutant="max_load_ignored")
    assert bad.real["status"] == "worker" and "no max_load_tokens" in bad.real["message"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_load_into_pending_store_is_inv6(pool, version):
    sigs, res = caught(pool, version, LOAD_FENCE_CASE, "load_into_pending_store")
    assert "invariant:INV-6" in sigs, res.real["findings"]
    assert "written by load" in res.real["findings"][0]["detail"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_evict_in_use_is_inv7(pool, version):
    clean = lockstep(Case.from_json(EVICT_CASE), version, pool)
    assert not _stores_of(clean, "c"), clean.real["trace"]   # no slot free: c stores nothing
    sigs, res = caught(pool, version, EVICT_CASE, "evict_in_use")
    assert "invariant:INV-7" in sigs, res.real["findings"]
    assert "still reads it" in res.real["findings"][0]["detail"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_lost_completion_is_inv8(pool, version):
    """a's store completion is lost: its chunks stay write-pending, b's lookup finds them
    pending (HIT_PENDING) and defers b at every step, with no transfer left to wait for."""
    sigs, res = caught(pool, version, LOAD_CASE, "lost_completion")
    assert "invariant:INV-8" in sigs, res.real["findings"]
    assert "stuck: ['b']" in res.real["findings"][0]["detail"]


# --- lookups: INV-9 and deferrals on the real run (tests/test_real_oracles.py: the oracle) ------

def _lookup_findings(res) -> list[dict]:
    return [f for f in res.real["findings"] if f.get("kind") == "invariant"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_lookup_first_chunk_only_is_inv9(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "lookup_first_chunk_only")
    assert [s for s in sigs if s.startswith("invariant:")] == ["invariant:INV-9"], sigs
    [f] = _lookup_findings(res)
    # b's GPU hit is its first block; a's three further chunks are ready: one found
    assert f["op"] == "lookup" and "cover 48 tokens beyond the GPU hit of 16, lookup found 16" \
        in f["detail"], f


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_lookup_defer_forever_is_a_deferral_finding(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "lookup_defer_forever")
    assert [s for s in sigs if s.startswith("invariant:")] == ["invariant:INV-8"], sigs
    [f] = _lookup_findings(res)
    # found by the deferral check (op lookup), before the quiet-tier stall check (liveness)
    assert f["op"] == "lookup" and "lookup deferred 4 steps (bound 3)" in f["detail"], f


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_lookup_refuse_window_is_inv9(pool, version):
    sigs, res = caught(pool, version, HANDMADE["window_load"], "lookup_refuse_window")
    assert [s for s in sigs if s.startswith("invariant:")] == ["invariant:INV-9"], sigs
    [f] = _lookup_findings(res)
    assert f["op"] == "lookup" and "cover 48 tokens beyond the GPU hit of 0, lookup found 0" \
        in f["detail"], f
    # the same mutant leaves a layout without a window alone
    clean = lockstep(Case.from_json(LOAD_CASE), version, pool, mutant="lookup_refuse_window")
    assert clean.agree and not clean.real["findings"], clean.summary()


#: b's prompt repeats a's, which finished: b's first blocks are a GPU prefix hit (touch); b
#: decodes on, holding them, for a few steps
GPU_HIT_CASE = {"layout": {"groups": [{"kind": "full", "block_size": 16}]},
                "requests": [{"id": "a", "prompt": [[7, 64]]},
                             {"id": "b", "prompt": [[7, 64], [8, 16]], "arrival": 3,
                              "decode": 4}]}


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_touch_double_ref_is_inv1(pool, version):
    sigs, res = caught(pool, version, GPU_HIT_CASE, "touch_double_ref")
    assert [s for s in sigs if s.startswith("invariant:")] == ["invariant:INV-1"], sigs
    [f] = [f for f in res.real["findings"] if f.get("inv_id") == "INV-1"]
    # the pool check: the hit block's ref_cnt against the one reference b's table keeps
    assert "refcount 2 but held 1 times" in f["detail"], f
