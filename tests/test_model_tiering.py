"""The model of tiered offloading (``simsched/model/tiering_manager.py``) on its own: the
``TieringOffloadingManager`` over a CPU tier and one fs tier, driven hook by
hook as the offloading connector and the harness's I/O clock drive it. Each expectation is
vLLM's rule, cited; the model's agreement with the releases is ``test_real_tiering.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

from simsched.model.cpu_manager import HIT, HIT_PENDING, MISS, RETRY, CPUOffloadingManager
from simsched.model.tiering_manager import TieringOffloadingManager


def _st(rid: str):
    return SimpleNamespace(req=SimpleNamespace(rid=rid))


def _manager(capacity: int = 2, latency: int = 1, last: bool = False):
    mgr = TieringOffloadingManager(CPUOffloadingManager(capacity), [latency], last)
    return mgr


def _store(mgr, st, keys, content="kv"):
    """A GPU store of ``keys`` prepared and completed (the connector's two calls)."""
    to_store = mgr.prepare_store(keys, st)
    mgr.complete_store(to_store, [content] * len(to_store), None, list(to_store), st)
    return to_store


def test_a_chunk_only_on_the_fs_tier_is_retried_then_promoted_then_hit():
    """``AsyncLookupManager.lookup``: a key's first lookup queues its probe and answers RETRY
    (None) until the lookup thread's answer is drained; a file found is promoted
    (``_initiate_promotion``: HIT_PENDING), its read submitted at ``on_schedule_end`` and, once
    it ran and was polled, the chunk is a CPU HIT holding the file's content."""
    mgr, a, b = _manager(capacity=1), _st("A"), _st("B")
    mgr.on_new_request(a)
    mgr.on_new_request(b)
    _store(mgr, a, [1], "content-1")
    mgr.on_schedule_end()
    assert [ln.split()[:2] for ln in mgr.before_schedule(1)] == [["tier", "cascade"]]
    mgr.on_schedule_end()                     # (the cascade polled: chunk 1 unpinned)
    _store(mgr, a, [2])                       # evicts chunk 1 from the one-chunk CPU tier
    assert mgr.lookup(1, b) == RETRY          # the probe is queued, not answered
    assert mgr.lookup(1, b) == RETRY
    mgr.on_schedule_end()                     # the probe posted
    mgr.before_schedule(2)                    # answered before the next schedule()
    assert mgr.lookup(1, b) == HIT_PENDING    # promoted: a CPU chunk allocated (chunk 2 out)
    assert not mgr.is_ready(1) and mgr.lookup(2, b) != HIT
    mgr.on_schedule_end()                     # the read submitted
    assert [ln.split()[:2] for ln in mgr.before_schedule(3)] == [["tier", "promote"]]
    assert mgr.lookup(1, b) == HIT
    assert mgr.chunks_of([1])[0].content == "content-1"


def test_a_chunk_being_cascaded_is_not_evicted():
    """``create_store_job`` pins the chunks it writes (``prepare_read``) until the tier reports
    the write finished and the manager polls it (``complete_read``): a store that needs the
    only chunk fails meanwhile, and takes it after."""
    mgr, a = _manager(capacity=1, latency=2), _st("A")
    mgr.on_new_request(a)
    _store(mgr, a, [1])
    mgr.on_schedule_end()
    assert mgr.prepare_store([2], a) is None          # chunk 1 pinned by its cascade
    mgr.on_schedule_end()
    assert mgr.before_schedule(1) == []                # io_latency 2: not yet written
    mgr.on_schedule_end()
    assert mgr.before_schedule(2)[0].startswith("tier cascade 0 1")
    assert mgr.prepare_store([2], a) == [2]            # polled first: chunk 1 evicted


def test_the_poll_gate_before_and_from_0330():
    """The tiers are polled at most once per step (``_maybe_process_finished_jobs``), the gate
    reopened by ``on_schedule_end``. 0.30.0-0.32.0 call it before the step's store jobs, whose
    ``prepare_store`` polls and closes the gate again: the next step's lookups do not poll, and
    a cascade written before that step still pins its chunk. 0.33.0 calls it last
    (``tier_schedule_end_last``, placed by the connector's ``build_connector_meta``): the next
    step's first lookup polls. B's lookup then promotes a chunk of the one-chunk CPU tier
    (HIT_PENDING) on 0.33.0, and finds no room for it (MISS) before. (0.33.0's
    ``prepare_store`` also polls past the gate; under the harness's clock, where I/O completes
    before ``schedule()`` only, that poll finds nothing the step's first one did not.)"""
    for last, want in ((False, MISS), (True, HIT_PENDING)):
        mgr, a, b = _manager(capacity=1, last=last), _st("A"), _st("B")
        mgr.on_new_request(a)
        mgr.on_new_request(b)
        mgr.tiers[0].files[7] = "another instance's"    # key 7 on the fs tier only
        assert mgr.lookup(7, b) == RETRY
        if not last:
            mgr.on_schedule_end()
        to_store = mgr.prepare_store([1], a)
        if last:
            mgr.on_schedule_end()
        mgr.complete_store(to_store, ["x"], None, list(to_store), a)   # cascade of 1
        mgr.before_schedule(1)                 # probe answered, cascade written
        assert mgr.lookup(7, b) == want


def test_a_finished_requests_probes_are_forgotten_once_its_stores_completed():
    """``_maybe_finalize_request``: the tiers' ``on_request_finished`` (the probes'
    ``cleanup``) waits for the request's prepared stores; a key no live request asked for is
    probed again (RETRY) by the next one."""
    mgr, a, b = _manager(capacity=4), _st("A"), _st("B")
    mgr.on_new_request(a)
    assert mgr.lookup(7, a) == RETRY
    mgr.on_schedule_end()
    mgr.before_schedule(1)
    assert mgr.lookup(7, a) == MISS           # probed: no file
    to_store = mgr.prepare_store([5], a)
    mgr.on_request_finished(a)
    assert 7 in mgr.tiers[0].lookups.states    # a store of A is still pending
    mgr.complete_store(to_store, ["x"], None, list(to_store), a)
    assert 7 not in mgr.tiers[0].lookups.states
    mgr.on_new_request(b)
    assert mgr.lookup(7, b) == RETRY
