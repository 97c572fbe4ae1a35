"""Each invariant shown to FIRE on a deliberately broken model, and to hold on the real one."""

import importlib
import sys
from types import SimpleNamespace

import pytest

import simsched
from simsched import PureSource
from simsched.case import Case
from simsched.model import run_case

FULL16 = [{"kind": "full", "block_size": 16}]


def mk(reqs, groups=FULL16, timing=None, **engine):
    obj = {"layout": {"groups": groups, "engine": engine}, "requests": reqs}
    if timing:
        obj["timing"] = timing
    return Case.from_json(obj)


# Two requests share a 96-token prefix; a big one in between evicts the GPU prefix cache, so the
# second request loads from the CPU tier.
def load_case():
    return mk([{"id": "a", "prompt": [[1, 96], [2, 20]], "decode": 2},
               {"id": "x", "prompt": [[9, 740]], "arrival": 4, "decode": 2},
               {"id": "b", "prompt": [[1, 96], [3, 20]], "arrival": 8, "decode": 2}],
              num_gpu_blocks=48, timing={"store_latency": 2, "load_latency": 1})


def inv_of(r):
    return r.findings[0].get("inv_id") if r.findings else None


@pytest.fixture
def src():
    """Fresh model modules from their Python source, for a test that patches their methods.

    Compiled model modules (mypyc, at install) call each other natively, past any patched class
    attribute; the source modules, imported afresh for the test alone, take the patch. The
    modules imported before are restored afterwards."""
    names = ["simsched." + m.replace("/", ".") for m in simsched.COMPILED]
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    finder = PureSource()
    sys.meta_path.insert(0, finder)
    try:
        mods = {m: importlib.import_module(f"simsched.model.{m}")
                for m in ("block_pool", "cpu_manager", "offloading_scheduler", "scheduler", "run")}
    finally:
        sys.meta_path.remove(finder)
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
        for n, mod in saved.items():
            parent, _, child = n.rpartition(".")
            setattr(sys.modules[parent], child, mod)
    assert all(m.__file__.endswith(".py") for m in mods.values())
    return SimpleNamespace(run_case=mods["run"].run_case,
                           offload=mods["offloading_scheduler"], **mods)


def test_load_case_is_clean_and_loads():
    r = run_case(load_case(), "prefix-cacheable")
    assert r.ok, r.findings
    assert r.counters["loads"] == 1


def test_inv1_leaked_block(monkeypatch, src):
    orig = src.block_pool.BlockPool.free_blocks
    monkeypatch.setattr(src.block_pool.BlockPool, "free_blocks",
                        lambda self, blocks: orig(self, list(blocks)[1:]))
    assert inv_of(src.run_case(load_case(), "prefix-cacheable")) == "INV-1"


def test_inv2_block_handed_to_two_requests(monkeypatch, src):
    orig = src.block_pool.BlockPool.get_new_blocks

    def twice(self, n):
        out = orig(self, n)
        if n and self.ref[1] > 0 and 1 not in out:
            out[0] = 1
            self.ref[1] += 1
        return out
    monkeypatch.setattr(src.block_pool.BlockPool, "get_new_blocks", twice)
    assert inv_of(src.run_case(load_case(), "prefix-cacheable")) in ("INV-2", "INV-1")


def test_inv3_key_count_mismatch(monkeypatch, src):
    orig = src.offload.OffloadingConnectorScheduler._build_store_jobs

    def drop(self, *a):
        jobs = orig(self, *a)
        for j in jobs:
            items = j.chunks()
            gid, c, h, k, blocks = items[0]
            items[0] = (gid, c, h, k, [])
            j.set_chunks(items)
        return jobs
    monkeypatch.setattr(src.offload.OffloadingConnectorScheduler, "_build_store_jobs", drop)
    assert inv_of(src.run_case(load_case(), "prefix-cacheable")) == "INV-3"


def test_inv4_store_shifted_by_one_chunk(monkeypatch, src):
    orig = src.offload.OffloadingConnectorScheduler._build_store_jobs

    def shift(self, *a):
        jobs = orig(self, *a)
        for j in jobs:
            st = self.req_status[j.rid]
            j.set_chunks([(gid, c, h, k, [(i + 1, st.groups[0].block_ids[i + 1])
                                          for i, _ in blocks])
                          for gid, c, h, k, blocks in j.chunks()[:-1]])
        return jobs
    monkeypatch.setattr(src.offload.OffloadingConnectorScheduler, "_build_store_jobs", shift)
    assert inv_of(src.run_case(load_case(), "prefix-cacheable")) == "INV-4"


def test_inv5_load_into_wrong_blocks(monkeypatch, src):
    orig = src.offload.OffloadingConnectorScheduler.update_state_after_alloc

    def rot(self, *a):
        job = orig(self, *a)
        if job is not None and len(job.chunks()) > 1:
            items = job.chunks()
            first = items[0]
            items = items[1:] + [first]
            job.set_chunks([(g, c, h, k, b2) for (g, c, h, k, _), b2 in
                            zip(items, [it[4] for it in [first] + items[:-1]])])
        return job
    monkeypatch.setattr(src.offload.OffloadingConnectorScheduler, "update_state_after_alloc", rot)
    assert inv_of(src.run_case(load_case(), "prefix-cacheable")) == "INV-5"


def test_inv6_fence_dropped(monkeypatch, src):
    """Without flushes, a finished request's store is still reading a block that is reused."""
    orig = src.offload.OffloadingConnectorScheduler.build_connector_meta

    def no_flush(self, *a):
        stores, loads, flush = orig(self, *a)
        return stores, loads, set()
    monkeypatch.setattr(src.offload.OffloadingConnectorScheduler, "build_connector_meta", no_flush)
    c = mk([{"id": "a", "prompt": [[1, 64]], "decode": 1},
            {"id": "x", "prompt": [[9, 700]], "arrival": 1, "decode": 2}],
           num_gpu_blocks=48, timing={"store_latency": 5})
    assert inv_of(src.run_case(c, "prefix-cacheable")) == "INV-6"


def test_inv6_holds_with_fences():
    c = mk([{"id": "a", "prompt": [[1, 64]], "decode": 1},
            {"id": "x", "prompt": [[9, 700]], "arrival": 1, "decode": 2}],
           num_gpu_blocks=48, timing={"store_latency": 5})
    r = run_case(c, "prefix-cacheable")
    assert r.ok, r.findings
    assert any(line.startswith("flush") for line in r.trace)


def test_inv6b_unlanded_block_used():
    """INV-6b (real runs, the multi path): a store or a forward over a block another connector
    is still writing; the real cases are tests/test_real_multi.py (mutant gate_open)."""
    from simsched.invariants import check_unlanded
    unlanded = {4: "NIXL recv of r"}
    v = check_unlanded(3, [2, 4], unlanded, "store 1 of r")
    assert v is not None and v.inv_id == "INV-6b" and v.op == "unlanded"
    assert v.detail == "store 1 of r uses block 4 before NIXL recv of r has landed"
    assert check_unlanded(3, [2, 5], unlanded, "store 1 of r") is None
    assert check_unlanded(3, [4], {}, "the forward of r") is None


def test_inv7_load_of_pending_chunk(monkeypatch, src):
    # the connector's lookup sees every chunk in the tier as ready (pending ones too)
    lookup = src.offload.OffloadingConnectorScheduler._lookup_complete_chunks

    def pending_as_hit(self, st):
        tier = self.tier
        real = type(tier).lookup
        cm = src.cpu_manager
        tier.lookup = lambda key, st=None: (cm.HIT if real(tier, key) == cm.HIT_PENDING
                                            else real(tier, key))
        try:
            return lookup(self, st)
        finally:
            del tier.lookup
    monkeypatch.setattr(src.offload.OffloadingConnectorScheduler, "_lookup_complete_chunks",
                        pending_as_hit)
    c = mk([{"id": "a", "prompt": [[1, 96]], "decode": 1},
            {"id": "b", "prompt": [[1, 96], [3, 20]], "arrival": 2, "decode": 2}],
           num_gpu_blocks=48, enable_prefix_caching=False,
           timing={"store_latency": 20, "load_latency": 1})
    # with the release's asserts: CPUOffloadingManager.prepare_load's own assert
    crash = src.run_case(c, "prefix-cacheable").findings[0]
    assert (crash["exception"], crash["function"]) == ("AssertionError", "prepare_load"), crash
    # under python -O the load goes ahead: INV-7 names the chunk it read too early
    c = Case.from_json({**c.to_json(), "asserts": False})
    assert inv_of(src.run_case(c, "prefix-cacheable")) == "INV-7"


def test_a_request_longer_than_the_pool_is_refused_at_startup():
    # not INV-8: vLLM refuses to start an engine whose pool cannot hold one request of
    # max_model_len (check_enough_kv_cache_memory): 2002 tokens need 126 blocks of 15
    c = mk([{"id": "a", "prompt": [[1, 2000]], "decode": 2}], num_gpu_blocks=16)
    r = run_case(c, "prefix-cacheable")
    assert r.findings == [] and r.counters["steps"] == 0
    assert r.refused.startswith("To serve at least one request with the model's max seq len "
                                "(2002), (126 blocks) KV cache is needed")
    assert r.trace[-1] == f"refused at start-up: {r.refused}"


def test_inv9_lookup_misses_ready_prefix(monkeypatch, src):
    monkeypatch.setattr(src.offload.OffloadingConnectorScheduler, "_lookup_complete_chunks",
                        lambda self, st: 0)
    assert inv_of(src.run_case(load_case(), "prefix-cacheable")) == "INV-9"


def test_inv6_read_fences_name_what_the_per_block_check_names():
    """The model keeps INV-6's pending reads per store job with a count per block (ReadFences);
    the engine per block (check_writes): the same findings."""
    from simsched import invariants as inv
    fences = inv.ReadFences(64)
    for jid, blocks in {4: [10, 11, 12], 2: [12, 30, 30], 7: [3], 9: [40]}.items():
        fences.add(jid, blocks)
    fences.add(9, [41])                     # a job's blocks replaced
    assert fences.pop(7) == [3] and fences.pop(99) is None
    by_job = {4: {10, 11, 12}, 2: {12, 30}, 9: {41}}
    v = fences.check(3, [5, 12, 10], "request", "r")
    assert v.detail == "block 12 written by request r while store job 2 still reads it"
    for _ in range(2):
        by_block: dict = {}
        for jid, blocks in by_job.items():
            for b in blocks:
                by_block.setdefault(b, set()).add(jid)
        for written in ([1, 2, 3], [5, 12, 10], [30, 11], [11, 30], [], [0, 40, 41], [3]):
            a = inv.check_writes(3, written, by_block, "request r")
            b = fences.check(3, written, "request", "r")
            assert (a and a.to_json()) == (b and b.to_json()), written
        fences.pop(2)
        by_job.pop(2, None)
    assert fences.count == [1 if b in (10, 11, 12, 41) else 0 for b in range(64)]
