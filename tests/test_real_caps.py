"""Oracles of the real run that do not trust the model: caps (INV-10) and partial-tail stores
(INV-4 by content). Real-vLLM tests FAIL (never skip) when a release is missing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from simsched import invariants as inv
from simsched.model.request import make_key
from simsched.case import Case
from simsched.lockstep import lockstep, run_real
from simsched.targets import Releases

#: align-mode Mamba with a block (32) larger than the hash block (prefix_match_unit 16): a's
#: prompt of 48 ends inside a block, its Mamba state at 48 is cached as a partial block, and its
#: first decode's allocation copies it (CoW) and hands it to the connector: 0.30.0 stores a
#: partial tail keying both groups at 48 (_build_partial_tail_store_jobs)
TAIL = {"layout": {"groups": [{"kind": "full", "block_size": 32},
                              {"kind": "mamba", "block_size": 32, "mamba_cache_mode": "align"}],
                   "engine": {"num_gpu_blocks": 16, "prefix_match_unit": 16}},
        "requests": [{"id": "a", "prompt": [[7, 48]], "decode": 3}]}


def _tail(cap: int | None) -> dict:
    req = dict(TAIL["requests"][0], **({} if cap is None else {"max_offload_tokens": cap}))
    return dict(TAIL, requests=[req])


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(["0.30.0"], timeout=120) as p:
        yield p


def test_partial_tail_store_is_checked_by_content_not_flagged_0300(pool):
    """Before: INV-3 "key of hash 2 paired with chunk 0" on every partial tail. Now the store
    of a's tail (the full group's block 1, the Mamba CoW copy) passes INV-4 by content."""
    res = lockstep(Case.from_json(_tail(None)), "0.30.0", pool)
    tails = [x for x in res.real["trace"] if x.startswith("store ") and " g0:2=" in x]
    assert len(tails) == 1 and " g1:2=" in tails[0], res.real["trace"]
    assert res.real["findings"] == []


def test_partial_tail_store_ignores_a_zero_cap_0300(pool):
    """Finding: max_offload_tokens 0 stores no chunk (_calc_num_offloadable_tokens), but the
    partial tail at 48 is stored: _build_partial_tail_store_jobs reads
    ``req_status.max_offload_tokens or req.num_prompt_tokens`` (0 as no cap)."""
    res = lockstep(Case.from_json(_tail(0)), "0.30.0", pool)
    f = res.real["findings"]
    assert [x["inv_id"] for x in f] == ["INV-10"], f
    assert "up to 48 beyond max_offload_tokens 0" in f[0]["detail"]


def test_partial_tail_beyond_a_cap_asserts_0300(pool):
    """Finding: max_offload_tokens 32 below the handed-over boundary 48 trips
    ``assert boundary <= max_boundary`` in _build_partial_tail_store_jobs (the aligned boundary
    jobs skip such a boundary instead)."""
    res = lockstep(Case.from_json(_tail(32)), "0.30.0", pool)
    f = res.real["findings"]
    assert [(x["kind"], x["exception"], x["function"]) for x in f] == \
        [("crash", "AssertionError", "_build_partial_tail_store_jobs")], f


class _Ident:
    """An identity tracker: the identity of the prefix ``[0, e)`` is ``seed * 1000 + e``."""

    def __init__(self, seed: int):
        self.seed = seed

    def ident_at(self, e: int):
        return self.seed * 1000 + e


def _item(gid: int, hidx: int, req, tph: int = 16):
    end = (hidx + 1) * tph
    return (gid, end // 32, hidx, make_key(gid, req.ident_at(end)), [(1, 5)])


def test_check_stored_tail_by_content():
    job, req, other = SimpleNamespace(jid=3), _Ident(1), _Ident(2)
    att, mamba = _item(0, 2, req), _item(1, 2, req)
    # an attention block written past the boundary by the request itself: good
    assert inv.check_stored_tail(0, job, att, (0, 49, None), req, req, 16, False) is None
    # ... by another request, or not up to the boundary, or of another group: INV-4
    for content, writer in [((0, 49, None), other), ((0, 40, None), req), ((1, 49, None), req)]:
        v = inv.check_stored_tail(0, job, att, content, req, writer, 16, False)
        assert v is not None and v.inv_id == "INV-4"
    # a complete block judged by its own identity
    assert inv.check_stored_tail(0, job, att, (0, 64, 1064), req, None, 16, False) is None
    assert inv.check_stored_tail(0, job, att, (0, 64, 2064), req, None, 16, False) is not None
    # a Mamba state summarises exactly the boundary
    assert inv.check_stored_tail(0, job, mamba, (1, 48, None), req, req, 16, True) is None
    assert inv.check_stored_tail(0, job, mamba, (1, 49, None), req, req, 16, True) is not None
    assert inv.check_stored_tail(0, job, mamba, None, req, req, 16, True) is not None


def test_check_caps():
    job = SimpleNamespace(jid=1, items=[(0, 0, 0, None, [(0, 7)]), (0, 1, 1, None, [(1, 8)])])
    assert inv.check_store_cap(0, job, 32, 16) is None
    assert inv.check_store_cap(0, job, None, 16) is None
    assert inv.check_store_cap(0, job, 16, 16).inv_id == "INV-10"
    assert inv.check_store_cap(0, job, 0, 16).inv_id == "INV-10"
    load = SimpleNamespace(jid=2, items=[(0, 1, 1, None, [(1, 8)]), (0, 2, 2, None, [(2, 9)])])
    assert inv.check_load_cap(0, load, 32, 16, {0: 16}) is None        # tokens 16 to 48
    assert inv.check_load_cap(0, load, 31, 16, {0: 16}).inv_id == "INV-10"
    assert inv.check_load_cap(0, load, None, 16, {0: 16}) is None


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_a_partial_tail_block_goes_on_being_appended_to(pool, version):
    """A partial-tail store reads the full-attention block holding tokens [0, 64) of a 96-token
    block while its request decodes into the same block at 64: the stored tokens do not change,
    so the write is no INV-6 (the default campaign reported it as one)."""
    case = {"layout": {"groups": [{"kind": "full", "block_size": 96},
                                  {"kind": "mamba", "block_size": 96,
                                   "mamba_cache_mode": "align"}],
                       "engine": {"prefix_match_unit": 16}},
            "requests": [{"id": "r0", "prompt": [[0, 64]], "decode": 4}],
            "timing": {"store_latency": 2}}
    res = run_real(Case.from_json(case), version, pool)
    assert res["status"] == "ok" and not res["findings"], res["findings"]
    assert res["counters"]["stores"] >= 1


@pytest.mark.parametrize("version", ["0.27.0", "0.28.0"])
def test_a_pinned_partial_tail_block_is_held_by_its_request(version):
    """0.27.0-0.28.0 pin the CoW copy of a producer's boundary state (r0's Mamba state at 64,
    inside a 128-token block) for the connector, off the request's table, until the request's
    blocks are freed (KVCacheManager._partial_tail_pins). INV-1 counts it held by r0: the
    campaign reported "free 1020 + held 2 != pool 1023" at r0's first decode."""
    case = {"layout": {"groups": [{"kind": "full", "block_size": 128},
                                  {"kind": "mamba", "block_size": 128,
                                   "mamba_cache_mode": "align"}],
                       "engine": {"prefix_match_unit": 16}},
            "requests": [{"id": "r0", "prompt": [[0, 64]], "decode": 4}]}
    with Releases.installed([version], timeout=120) as p:
        res = run_real(Case.from_json(case), version, p)
    assert res["status"] == "ok" and not res["findings"], res["findings"]
    assert res["counters"]["finished"] == 1 and res["counters"]["steps"] >= 4, res["counters"]
