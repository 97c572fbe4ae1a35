"""The model of the ``SimpleCPUOffloadConnector``'s scheduler side
(:mod:`simsched.model.simple_cpu_scheduler`), against what 0.30.0-0.33.0's
``vllm/v1/simple_kv_offload/manager.py`` (**mgr**) and ``worker.py`` do, read from their source;
and of 0.25.1-0.29.0's manager (:mod:`simsched.model.simple_cpu_scheduler_legacy`), where it
differs.
``tests/test_real_simple_cpu.py`` runs the same model in lockstep with the releases."""

from __future__ import annotations

from simsched.case import Case
from simsched.invariants import check_pool
from simsched.model import run_case
from simsched.model.block_pool import BlockPool
from simsched.model.scheduler import Model
from simsched.profiles import PROFILES, profile_for_release

FULL = [{"kind": "full", "block_size": 16}]
#: A (80 tokens) is offloaded; C takes the pool of 10 blocks; B shares A's 80 tokens
BASIC = [{"id": "A", "prompt": [[1, 80]], "decode": 4},
         {"id": "C", "prompt": [[2, 64]], "arrival": 10, "decode": 2},
         {"id": "B", "prompt": [[1, 80], [3, 16]], "arrival": 14, "decode": 3}]


def _case(requests: list, lazy: bool, groups: list = FULL, blocks: int = 10,
          timing: dict | None = None) -> Case:
    return Case.from_json({
        "layout": {"groups": groups,
                   "engine": {"num_gpu_blocks": blocks, "cpu_chunks": 16,
                              "connector": {"kind": "simple_cpu", "lazy_offload": lazy}}},
        "timing": timing or {"store_latency": 1, "load_latency": 1},
        "requests": requests})


def _steps(trace: list[str], prefix: str) -> list[tuple[int, str]]:
    out, step = [], -1
    for line in trace:
        if line.startswith("step "):
            step = int(line.split()[1])
        elif line.startswith(prefix):
            out.append((step, line))
    return out


def test_eager_stores_a_block_the_step_after_it_is_computed():
    """``_select_eager_blocks_to_store`` stores the blocks of ``num_computed_tokens`` as
    ``build_connector_meta`` sees them, before the step's own tokens count (mgr 0.30.0:
    "Blocks from the current step are stored on a later step"): A's 5 prompt blocks, computed
    in step 0, are one store job in step 1; its partial decode block never. B loads A's block 4
    (evicted from the GPU by C) back into its own block 4, in a step of its own."""
    trace = run_case(_case(BASIC, False), profile_for_release("0.33.0")).trace
    stores = _steps(trace, "store ")
    assert stores[0] == (1, "store 0 A g0:0=1 g0:1=2 g0:2=3 g0:3=4 g0:4=5")
    assert _steps(trace, "load ") == [(8, "load 2 B g0:4=5")]


def test_lazy_walk_stores_freed_blocks_in_free_queue_order():
    """``_prepare_lazy_store_specs`` walks the GPU free queue from its cursor: A's blocks are
    stored only once A freed them, in the order they were freed (``free_blocks`` of a table
    tail first: the LRU end), nothing while A runs."""
    trace = run_case(_case(BASIC, True), profile_for_release("0.33.0")).trace
    stores = _steps(trace, "store ")
    finish_a = next(s for s, x in _steps(trace, "finish A"))
    assert stores[0] == (finish_a + 1, "store 0 A g0:4=5 g0:3=4 g0:2=3 g0:1=2 g0:0=1")


def test_a_store_pins_its_blocks_until_its_event_completes():
    """A store ``touch``es its GPU blocks (mgr ``_prepare_eager_store_specs``) and frees them
    in ``_process_store_completion``: with stores of 5 steps, A's stored blocks outlive A in
    the pool (held by the connector alone) until the event completes; INV-1 counts the pins."""
    requests = [{"id": "A", "prompt": [[1, 32]], "decode": 1}]
    m = Model(_case(requests, False, timing={"store_latency": 5}), profile_for_release("0.33.0"))
    m.q.run_until(3)          # A finished at step 1, its store of step 1 is in flight
    assert m.reqs["A"].finished
    assert sorted(m.simple.held_gpu_blocks()) == [1, 2]
    assert m.kv.pool.ref[1] == 1 and m.kv.pool.ref[2] == 1
    m.q.run()
    assert m.simple.held_gpu_blocks() == [] and m.kv.pool.ref[1] == 0


def test_store_events_are_reported_in_order():
    """The worker reports a store event once its jobs and every earlier event's are done
    (wrk 0.30.0 ``_poll_stores``: the high-water mark). A's event waits 6 steps, C's 1: C's
    blocks reach the CPU pool (a hash registered there) only with A's, not when C's job is
    done."""
    requests = [{"id": "A", "prompt": [[1, 32]], "decode": 8},
                {"id": "C", "prompt": [[2, 32]], "arrival": 1, "decode": 8}]
    timing = {"store_latency": 1, "jobs": [{"store": 0, "latency": 6}]}
    m = Model(_case(requests, False, blocks=20, timing=timing), profile_for_release("0.33.0"))
    cpu = m.simple.cpu_block_pool
    m.q.run_until(4)          # C's job (store 1, step 2) done at 3; A's (step 1) at 7
    assert 1 not in m.simple.jobs and 0 in m.simple.jobs
    assert cpu.get_num_free_blocks() == 15 - 4 and not cpu.cached_block_hash_to_block._cache
    m.q.run_until(8)
    assert len(cpu.cached_block_hash_to_block._cache) == 4


def test_0300_stores_every_group_0310_the_prefix_cacheable_ones():
    """0.30.0's eager selection runs over every group and resolves each group's hashes at its
    block size: a ring of 4-token blocks beside 16-token attention (hash unit 16) fails
    ``resolve_block_hashes``'s assert at the first step; 0.31.0 skips the groups that are not
    prefix-cacheable (``prefix_cacheable_group_ids``) and runs the case through."""
    ring = [{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}]
    case = _case(BASIC, False, groups=ring, blocks=40)
    old = run_case(case, PROFILES["every-group"])
    assert old.findings[0]["function"] == "resolve_block_hashes"
    assert old.trace[-2:] == ["step 0", "crash AssertionError resolve_block_hashes schedule"]
    assert run_case(case, PROFILES["prefix-cacheable"]).findings == []


def test_inv1_counts_a_connector_pin_and_inv2_the_requests_alone():
    """A block one request holds and the connector pinned has ``ref_cnt`` 2: INV-1 holds with
    the pin counted, breaks without it; INV-2 (two requests on an unhashed block) is not about
    the pin."""
    class Holder:
        def __init__(self, table):
            self.tables = [table]
    pool = BlockPool(4)
    b = pool.get_new_blocks(1)[0]
    pool.touch([b])
    assert check_pool(0, pool, [Holder([b])], [b]) is None
    assert check_pool(0, pool, [Holder([b])]).inv_id == "INV-1"
    assert check_pool(0, pool, [Holder([b]), Holder([b])]).inv_id == "INV-2"


# -- 0.25.1-0.29.0's manager (simsched/model/simple_cpu_scheduler_legacy.py) ----------------------

#: A's prompt of two blocks, done in one step with its only output token: A finishes in the step
#: that computed its blocks
ONE_STEP = [{"id": "A", "prompt": [[1, 32]], "decode": 1}]
#: one request of 128 tokens (8 blocks of a GPU pool of 10), a CPU tier of 5 blocks (4 usable)
LIVELOCK = [{"id": "A", "prompt": [[1, 128]], "decode": 2}]
#: A offloaded, then a GPU prefix-cache reset, then B sharing A's 80 tokens
AFTER_RESET = [{"id": "A", "prompt": [[1, 80]], "decode": 4},
               {"id": "B", "prompt": [[1, 80], [3, 16]], "arrival": 11, "decode": 3}]
RESET = [{"step": 10, "do": "reset_prefix_cache"}]


def _with(case: Case, engine: dict | None = None, events: list = (),
          request: dict | None = None) -> Case:
    d = case.to_json()
    d["layout"]["engine"].update(engine or {})
    d["events"] = list(events)
    for r in d["requests"]:
        if request and r["id"] in request:
            r.update(request[r["id"]])
    return Case.from_json(d)


def test_0290_flushes_nothing_at_finish_0300_does():
    """0.25.1-0.29.0 store a block only when ``_prepare_eager_store_specs`` sees its request
    scheduled with the block confirmed (mgr 0.29.0:531-535: "If a request finishes in the same
    step as its last full block, that block may be missed. (TODO: flush on finish.)"): A's two
    blocks, computed in the step A finishes in, are never stored. 0.30.0's
    ``request_finished_all_groups`` queues them for the next step's event."""
    case = _case(ONE_STEP, False)
    old = run_case(case, profile_for_release("0.29.0")).trace
    assert _steps(old, "store ") == []
    new = run_case(case, profile_for_release("0.30.0")).trace
    assert _steps(new, "store ") == [(1, "store 0 A g0:0=1 g0:1=2")]


def test_0290_idles_with_its_last_stores_in_flight():
    """0.25.1-0.29.0's keep-alive hook (``has_pending_transfers``) is not the one the scheduler
    asks (``has_pending_push_work``): after A finishes, the step that reports it runs the lazy
    walk's store and the engine then idles with it in flight, never reported. 0.30.0+ step on
    while a store is pending, and this case's lazy walk makes a new one every step (INV-8)."""
    case = _case(LIVELOCK, True, timing={"store_latency": 2, "max_num_batched_tokens": 32})
    case = _with(case, {"cpu_chunks": 5})
    old = run_case(case, profile_for_release("0.29.0"))
    assert old.findings == [] and old.trace[-1].startswith("end idle with jobs in flight: store ")
    new = run_case(case, profile_for_release("0.30.0"))
    assert [f["inv_id"] for f in new.findings] == ["INV-8"]


def test_0290_loads_for_a_request_that_skips_the_prefix_cache():
    """0.25.1-0.29.0's lookup does not ask ``skip_reading_prefix_cache`` (mgr 0.29.0:245-281)
    and their scheduler takes the connector's answer as it is (0.31.0 sets it aside): B, which
    asked to read no prefix cache, loads A's blocks from the CPU tier. 0.30.0's lookup answers
    0 for it."""
    case = _with(_case(AFTER_RESET, False, blocks=16), events=RESET,
                 request={"B": {"skip_reading_prefix_cache": True}})
    old = run_case(case, profile_for_release("0.29.0"))
    assert old.findings == [] and [x for _, x in _steps(old.trace, "load ")] == [
        "load 1 B g0:0=6 g0:1=7 g0:2=8 g0:3=9 g0:4=10"]
    assert _steps(run_case(case, profile_for_release("0.30.0")).trace, "load ") == []


def test_0260_cpu_lookup_drops_no_eagle_block_without_a_drafter_group():
    """Before 0.27.0 the CPU coordinator is built with ``use_eagle=False`` (mgr 0.26.0:125):
    with MTP drafting and no layer group the KV cache config marks a drafter's, it has no EAGLE
    group (kv_cache_coordinator.py 0.26.0:98-104) and B's CPU hit keeps its last block; 0.27.0
    (``use_eagle()``) marks every group and drops it."""
    case = _with(_case(AFTER_RESET, False, blocks=16),
                 {"speculative": {"method": "mtp", "num_tokens": 2}}, events=RESET)
    old = _steps(run_case(case, profile_for_release("0.26.0")).trace, "load ")
    new = _steps(run_case(case, profile_for_release("0.27.0")).trace, "load ")
    assert len(old) == 1 and len(old[0][1].split()) - 3 == len(new[0][1].split()) - 3 + 1, (
        old, new)


def test_0290_passes_over_a_ring_group_0300_crashes_on_it():
    """0.25.1-0.29.0's eager selection reads each block's own hash (mgr 0.29.0:600-622), with
    no per-group resolution of the request's hashes: a ring of 4-token blocks beside 16-token
    attention (hash unit 16) runs through, its blocks (never hashed) passed over and the full
    group stored. 0.30.0's ``resolve_block_hashes`` asserts on the ring at the first step."""
    ring = [{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}]
    case = _case(BASIC, False, groups=ring, blocks=40)
    old = run_case(case, profile_for_release("0.29.0"))
    stores = _steps(old.trace, "store ")
    assert old.findings == [] and stores[0] == (1, "store 0 A g0:0=1 g0:1=2 g0:2=3 g0:3=4 g0:4=5")
    assert all(" g1:" not in x for _, x in stores), stores
    assert run_case(case, PROFILES["every-group"]).findings[0]["function"] == "resolve_block_hashes"


# --- Mamba groups (align mode) -----------------------------------------------------------------

MAMBA = [{"kind": "full", "block_size": 16},
         {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}]
#: A's 80 tokens in prefill chunks of 32 (its Mamba states at 32 and 64 cached as each chunk is
#: allocated), a GPU prefix-cache reset, then B sharing A's 80 tokens: B's hit is on CPU, the
#: Mamba state at 64 among it
MAMBA_AFTER_RESET = [{"id": "A", "prompt": [[1, 80]], "decode": 4},
                     {"id": "B", "prompt": [[1, 80], [3, 16]], "arrival": 11, "decode": 3}]


def _mamba_case(lazy: bool, mnbt: int = 32, cpu: int = 16, dcp: int = 1) -> Case:
    return Case.from_json({
        "layout": {"groups": MAMBA,
                   "engine": {"num_gpu_blocks": 16, "cpu_chunks": cpu, "dcp_size": dcp,
                              "connector": {"kind": "simple_cpu", "lazy_offload": lazy}}},
        "timing": {"store_latency": 1, "load_latency": 1, "max_num_batched_tokens": mnbt},
        "requests": MAMBA_AFTER_RESET, "events": [{"step": 10, "do": "reset_prefix_cache"}]})


def test_mamba_states_are_stored_as_the_kv_cache_manager_hands_them_over():
    """0.30.0+ eager mode: an align-mode Mamba group's blocks are not scanned positionally
    (``has_positionally_stable_blocks`` False: its table nulls interior states, 0.30.0:1444-1450);
    its states reach the CPU pool as ``take_boundary_state_offloads`` hands them over, in the
    step that allocates them, ahead of the positional picks (mgr 0.30.0:657-720): A's state at
    64 (block 6) in step 1, with A's first two attention blocks. B loads it back (g1:3).
    Without the hand-offs store 0 has no g1 block; with a positional scan of the Mamba group
    step 1 also stores A's state at 32 (g1:1=3)."""
    trace = run_case(_mamba_case(False), profile_for_release("0.33.0")).trace
    stores = _steps(trace, "store ")
    assert stores[0] == (1, "store 0 A g1:3=6 g0:0=1 g0:1=2")
    assert not any(" g1:1=" in x for _, x in stores)
    assert _steps(trace, "load ") == [(7, "load 3 B g0:0=9 g0:1=8 g0:2=7 g0:3=10 g1:3=11")]


def test_no_positional_scan_of_a_mamba_group():
    """``has_positionally_stable_blocks`` is False for an align-mode Mamba group
    (single_type_kv_cache_manager.py 0.30.0:1444-1450; mgr 0.30.0:835): a CPU pool of 2
    blocks evicts A's handed-off state at 64 (g1:3), and no later step stores it again (a
    positional scan of the group would, from A's table; 0.33.0 agrees step for step,
    ``test_real_simple_cpu``)."""
    trace = run_case(_mamba_case(False, cpu=3), profile_for_release("0.33.0")).trace
    stores = _steps(trace, "store ")
    assert stores[0] == (1, "store 0 A g1:3=6 g0:0=1")
    assert not any(" g1:3=" in x for _, x in stores[1:]), stores


def test_0290_stores_mamba_states_positionally():
    """0.25.1-0.29.0 have no hand-offs (mgr 0.29.0:576-634 scans every group): A's state at 64
    is stored the step after it was computed, with the attention blocks of its chunk."""
    trace = run_case(_mamba_case(False), profile_for_release("0.29.0")).trace
    assert _steps(trace, "store ")[:2] == [(1, "store 0 A g0:0=1 g0:1=2"),
                                           (2, "store 1 A g0:2=4 g0:3=5 g1:3=6")]


def test_0280_scales_a_mamba_block_by_the_dcp_size():
    """0.25.1-0.29.0 count every group's blocks in ``spec.block_size * cp_world_size`` (mgr
    0.29.0:354-357, 375-376, 594-595), a Mamba group's too, which no pool scales: under DCP 2
    the eager scan of the Mamba group reaches half as far (A's state at 32 is not stored in
    step 1), and B's CPU hit of 64 tokens takes 64 // 32 = 2 of the group's hit blocks, both
    null: A's state at 64 is not loaded (0.28.0 agrees step for step; B then runs from a state
    block nothing wrote)."""
    profile = profile_for_release("0.28.0")
    eager = run_case(_mamba_case(False, dcp=2), profile).trace
    assert _steps(eager, "store ")[:2] == [(1, "store 0 A g0:1=1"),
                                           (2, "store 1 A g0:3=3 g1:1=2")]
    lazy = run_case(_mamba_case(True, dcp=2), profile).trace
    assert [x for _, x in _steps(lazy, "load ")] == ["load 3 B g0:1=7 g0:3=5"]


def test_lazy_walk_stores_a_freed_mamba_state():
    """Lazy mode drops the hand-offs (the scheduler drains them unread) and its walk of the
    GPU free queue stores what is hashed there: A's state at 64, freed when A's running state
    moved on, before A finishes."""
    trace = run_case(_mamba_case(True), profile_for_release("0.33.0")).trace
    finish_a = next(s for s, x in _steps(trace, "finish A"))
    assert _steps(trace, "store ")[0] == (3, "store 0 A g1:3=6") and finish_a > 3


def test_lazy_target_counts_two_blocks_per_mamba_group():
    """``_estimate_lazy_target_blocks``: a Mamba group keeps 2 blocks, not the budget's
    (mgr 0.30.0:307, 0.29.0:232): (cdiv(2048, 16) + 2) * 2."""
    for v in ("0.29.0", "0.33.0"):
        m = Model(_mamba_case(True, mnbt=2048), profile_for_release(v))
        assert m.simple.target_free == (2048 // 16 + 2) * 2


#: full/32 + Mamba/32 over a hash unit of 16: fine-grained hash hits; A's prompt ends at 88, its
#: last hash boundary (80) inside its attention block 2
FINE = [{"kind": "full", "block_size": 32},
        {"kind": "mamba", "block_size": 32, "mamba_cache_mode": "align"}]


def _fine_case(lazy: bool) -> Case:
    return Case.from_json({
        "layout": {"groups": FINE,
                   "engine": {"num_gpu_blocks": 16, "cpu_chunks": 16, "prefix_match_unit": 16,
                              "connector": {"kind": "simple_cpu", "lazy_offload": lazy}}},
        "timing": {"store_latency": 1, "load_latency": 1},
        "requests": [{"id": "A", "prompt": [[1, 88]], "decode": 1}]})


def test_finish_flush_stores_the_prompts_partial_tail():
    """With fine-grained hits on the CPU coordinator, the finish flush adds the attention block
    cached under the prompt's last hash boundary (``_find_fa_partial_tail_source``, mgr
    0.30.0:1202-1248): A's block 2 under the hash at 80 (g0:4), which no positional scan
    reaches (they stop at 80). 0.33.0 stores it so (step 3, ``store 3 A g0:4=4``: its trace
    has the producer's Mamba copy as store 2, not modelled: ``_simple_cpu_gap``)."""
    trace = run_case(_fine_case(False), profile_for_release("0.33.0")).trace
    assert _steps(trace, "store ")[-1] == (3, "store 2 A g0:4=4")


def test_the_lazy_cpu_coordinator_takes_no_fine_grained_hits():
    """0.30.0+ build the CPU coordinator with ``allow_partial_hash_hits=not lazy_offload``
    (mgr 0.30.0:200): fine-grained hits in eager mode only; 0.29.0's in either mode."""
    def hits(lazy: bool, v: str) -> tuple[bool, bool]:
        m = Model(_fine_case(lazy), profile_for_release(v))
        return m.kv.config.partial_hash_hits, m.simple.cpu_coordinator.config.partial_hash_hits
    assert hits(False, "0.33.0") == (True, True) and hits(True, "0.33.0") == (True, False)
    assert hits(True, "0.30.0") == (True, False) and hits(True, "0.29.0") == (True, True)
