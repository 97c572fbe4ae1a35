"""The ``simple_cpu`` connector path on real vLLM (issue 21): the ``SimpleCPUOffloadConnector``
on the real v1 Scheduler, its worker played (:mod:`simsched.vllm.inside.simple_cpu`), on 0.30.0
and 0.33.0, and the model in lockstep with them; at the end the model of 0.25.1-0.29.0's manager
in lockstep with 0.25.1, 0.28.0 and 0.29.0. Real-vLLM tests FAIL (never skip) when a release is
missing.

Each test names what it would miss if the harness did not drive the path: the store events
(eager: the step after the step that computed a block; lazy: only once the request freed its
blocks), their completion through ``SimpleCPUOffloadWorkerMetadata`` (else the CPU pool never
registers a block and B never hits), the content they move (B's load is judged by INV-5 on what
A's store wrote into the CPU block: without the harness's write B's forward reads nothing)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from simsched.case import Case
from simsched.lockstep import lockstep
from simsched.targets import Releases

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_paths import (RELEASES, distinct_drawn_cases, drawn_lockstep,  # noqa: E402
                        mutant_catches, run_checked, run_real as _run)



FULL = [{"kind": "full", "block_size": 16}]


def _case(requests: list, lazy: bool, blocks: int = 10, cpu: int = 16, load: int = 1,
          mnbt: int = 2048, store: int = 1, events: list = (), groups: list = FULL) -> Case:
    return Case.from_json({
        "layout": {"groups": groups,
                   "engine": {"num_gpu_blocks": blocks, "cpu_chunks": cpu,
                              "connector": {"kind": "simple_cpu", "lazy_offload": lazy}}},
        "timing": {"store_latency": store, "load_latency": load,
                   "max_num_batched_tokens": mnbt},
        "requests": requests, "events": list(events)})


#: A (80 tokens, 5 blocks) is offloaded; C (64 tokens) takes the GPU pool of 10 and evicts A's
#: last block from the GPU prefix cache; B shares A's 80 tokens: GPU hit 64, CPU hit 16 (A's
#: block 4, loaded back into B's block 4)
BASIC = [{"id": "A", "prompt": [[1, 80]], "decode": 4},
         {"id": "C", "prompt": [[2, 64]], "arrival": 10, "decode": 2},
         {"id": "B", "prompt": [[1, 80], [3, 16]], "arrival": 14, "decode": 3}]
#: as BASIC, B with room for one more block than the CPU tier holds (simple_hit_plus_block)
ROOM = [{"id": "A", "prompt": [[1, 80]], "decode": 2},
        {"id": "C", "prompt": [[2, 144]], "arrival": 10, "decode": 2},
        {"id": "B", "prompt": [[1, 80], [3, 48]], "arrival": 16, "decode": 2}]
#: A's 5 blocks stored in a CPU tier of 7 (6 usable), the GPU prefix cache reset; B (A's 80
#: tokens + 16) loads all 5 from CPU while E (96 tokens) stores into the full tier
PRESSURE = [{"id": "A", "prompt": [[1, 80]], "decode": 4},
            {"id": "B", "prompt": [[1, 80], [3, 16]], "arrival": 11, "decode": 3},
            {"id": "E", "prompt": [[4, 96]], "arrival": 11, "decode": 3}]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(RELEASES, timeout=120) as p:
        yield p


def _step_of(trace: list[str], i: int) -> int:
    return int(next(x for x in reversed(trace[:i]) if x.startswith("step ")).split()[1])


def _index(trace: list[str], prefix: str) -> int:
    return next(i for i, x in enumerate(trace) if x.startswith(prefix))


@pytest.mark.parametrize("version", RELEASES)
def test_eager_store_and_load_back(pool, version):
    """Eager: A's 5 full prompt blocks are stored in the step after the step that computed
    them (never the partial decode block), their completion reaches the CPU pool through
    ``completed_store_events``; B (GPU hit 64) loads A's block 4 from CPU into its own block 4,
    reported through ``finished_recving``, and its forward attends A's tokens (INV-5: without
    the harness's write of the stored content the load brings back nothing)."""
    real = _run(pool, version, _case(BASIC, lazy=False))
    trace = real["trace"]
    assert real["findings"] == [], trace
    i = _index(trace, "store ")
    assert trace[i] == "store 0 A g0:0=1 g0:1=2 g0:2=3 g0:3=4 g0:4=5", trace
    assert _step_of(trace, i) == 1          # A's prompt computed at step 0
    assert "done 0 store" in trace
    j = _index(trace, "load ")
    load = trace[j]
    assert load.split()[2:] == ["B", "g0:4=5"], load
    assert f"done {load.split()[1]} load" in trace
    # B is scheduled only after its load is reported, with 80 tokens computed
    assert _index(trace, "sched B") > trace.index(f"done {load.split()[1]} load")
    assert "sched B 16" in trace
    assert real["counters"]["finished"] == 3 and real["lookups"]["expected_hit"] >= 1, real


@pytest.mark.parametrize("version", RELEASES)
def test_lazy_stores_only_freed_blocks(pool, version):
    """Lazy: nothing of A is stored while A holds its blocks; the step after A finishes, the
    free-queue walk stores A's five hashed blocks (and the engine keeps stepping for it:
    ``has_pending_push_work``), and B loads block 4 back with A's content."""
    real = _run(pool, version, _case(BASIC, lazy=True))
    trace = real["trace"]
    assert real["findings"] == [], trace
    i = _index(trace, "store ")
    assert i > trace.index("finish A finished"), trace
    assert sorted(trace[i].split()[3:]) == ["g0:0=1", "g0:1=2", "g0:2=3", "g0:3=4", "g0:4=5"]
    load = trace[_index(trace, "load ")]
    assert load.split()[2:] == ["B", "g0:4=5"], load
    assert real["counters"]["finished"] == 3


def _generated(n: int) -> list[Case]:
    """``n`` cases the campaign's strategies draw on the simple_cpu path (eager or lazy; most
    of them come back to a conversation once another request took its GPU blocks)."""
    return distinct_drawn_cases(n, path="simple_cpu")


@pytest.mark.parametrize("version", RELEASES)
def test_generated_simple_cpu_cases_run_step_by_step(pool, version):
    """15 drawn cases of the path: none ends in an error of the harness; most run step by
    step, with stores (and loads) of the real connector."""
    ran, stores, loads, outcomes = 0, 0, 0, []
    for case in _generated(15):
        real, summary = run_checked(pool, version, case)
        outcomes.append(summary)
        if real.get("status") == "ok" and real["counters"]["steps"] > 0:
            ran += 1
            stores += real["counters"]["stores"]
            loads += real["counters"]["loads"]
    print(version, f"{ran} of 15 ran, {stores} store jobs, {loads} load jobs", outcomes)
    assert ran >= 8 and stores >= 8 and loads >= 2, outcomes


@pytest.mark.parametrize("version", RELEASES)
def test_mutant_cpu_reversed_is_inv4(pool, version):
    """``simple_cpu_reversed``: A's store event hands the worker its CPU blocks reversed; once
    the manager processed the completion, the CPU pool has block 5 registered under A's block
    4's hash while the worker wrote A's block 0 there (INV-4 on the CPU pool, in the next
    step). The same case is clean unmutated (test above)."""
    real = _run(pool, version, _case(BASIC, lazy=False), "simple_cpu_reversed")
    assert [f["inv_id"] for f in real["findings"]] == ["INV-4"], real["trace"]
    assert real["findings"][0]["detail"].startswith("CPU block 5 registered under g0:4 of A")


@pytest.mark.parametrize("mutant,least", [("simple_cpu_reversed", 10),
                                           ("simple_hit_plus_block", 4)])
def test_mutants_are_caught_on_generated_cases(pool, mutant, least):
    """30 drawn cases of the path on 0.33.0 with a mutant of SimpleCPU's manager: INV-4 alone
    fires on several, each clean unmutated. ``simple_cpu_reversed`` on every case with a store
    event of two blocks or more (22 of 30 when written); ``simple_hit_plus_block`` where a
    request comes back to a prefix the CPU pool holds and has room past it (8 of 30). Not
    ``simple_unpinned_load``: it needs a store that evicts during a load of several steps (the
    PRESSURE case below; none of the 30)."""
    caught, outcomes = mutant_catches(pool, "0.33.0", _generated(30), mutant, "INV-4")
    print(mutant, f"caught on {caught} of 30", outcomes)
    assert caught >= least, outcomes


@pytest.mark.parametrize("version", RELEASES)
def test_mutant_hit_plus_block_is_caught(pool, version):
    """``simple_hit_plus_block``: B's lookup claims one block more than the CPU tier holds; the
    block is never loaded, and what B's store then reads of it is not B's tokens (INV-4)."""
    case = _case(ROOM, lazy=False, blocks=12)
    assert _run(pool, version, case)["findings"] == []
    real = _run(pool, version, case, "simple_hit_plus_block")
    assert [f["inv_id"] for f in real["findings"]] == ["INV-4"], real["trace"]


@pytest.mark.parametrize("version", RELEASES)
def test_mutant_unpinned_load_is_inv7(pool, version):
    """``simple_unpinned_load``: B's load (4 steps) reads A's CPU blocks unpinned, after a GPU
    prefix-cache reset; E's store into the full CPU tier (6 usable blocks) evicts one of them
    while the load still reads it (INV-7). Unmutated, E's stores wait for free CPU blocks."""
    case = _case(PRESSURE, lazy=False, blocks=16, cpu=7, load=4,
                 events=[{"step": 10, "do": "reset_prefix_cache"}])
    clean = _run(pool, version, case)
    assert clean["findings"] == [] and clean["counters"]["loads"] == 1, clean["trace"]
    real = _run(pool, version, case, "simple_unpinned_load")
    assert [f["inv_id"] for f in real["findings"]] == ["INV-7"], real["trace"]


#: one request of 128 tokens (8 blocks of a GPU pool of 10), a CPU tier of 5 blocks (4 usable)
LIVELOCK = [{"id": "A", "prompt": [[1, 128]], "decode": 2}]


@pytest.mark.parametrize("version", RELEASES)
def test_lazy_offload_never_lets_the_engine_idle(pool, version):
    """A real vLLM bug (0.30.0-0.33.0; 0.25.1-0.29.0 strand the last store instead): with
    ``lazy_offload`` and a CPU tier smaller than the hashed blocks in the GPU free queue, the
    engine never goes idle after its last request. ``Scheduler.has_requests()`` is true while a
    store is pending (``has_pending_push_work`` -> ``has_pending_stores``, 0.30.0
    ``scheduler.py:2681``, ``manager.py:1119-1125``); every ``schedule()`` runs the lazy walk
    (``_prepare_lazy_store_specs``, ``manager.py:566-620``), which stores each hashed free GPU
    block the CPU pool no longer holds, evicting another (LRU, ``get_new_blocks``): each step
    makes the next pending store. The harness steps while ``has_requests()``, as
    ``EngineCore.step`` does: INV-8 once it steps 100 steps after the last request finished
    (``MAX_STEPS_AFTER_LAST``). Eager offload on the same case
    goes idle. Not found reported upstream (issues searched 2026-12: none)."""
    lazy = _run(pool, version, _case(LIVELOCK, lazy=True, cpu=5, mnbt=32, store=2))
    found = [f["inv_id"] for f in lazy["findings"]]
    assert found == ["INV-8"], (
        f"vLLM {version}: a deployment with --kv-transfer-config '{{\"kv_connector\":"
        "\"SimpleCPUOffloadConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":"
        "{\"lazy_offload\":true}}' and a CPU budget (cpu_bytes_to_use, 8 GiB by default) "
        "smaller than the GPU KV cache busy-loops once traffic has left more distinct blocks "
        "in the GPU prefix cache than the tier holds: expected INV-8", lazy["trace"][-40:])
    assert "the engine never went idle" in lazy["findings"][0]["detail"]
    assert lazy["counters"]["finished"] == 1
    assert lazy["counters"]["stores"] >= 50   # a store every idle step or two, 100 steps on
    eager = _run(pool, version, _case(LIVELOCK, lazy=False, cpu=5, mnbt=32, store=2))
    assert eager["findings"] == [] and eager["counters"]["steps"] < 30, eager["trace"]


RESET = [{"step": 10, "do": "reset_prefix_cache"}]
#: A, then a GPU prefix-cache reset, then B sharing A's 80 tokens: all of B's hit is on CPU
AFTER_RESET = [{"id": "A", "prompt": [[1, 80]], "decode": 4},
               {"id": "B", "prompt": [[1, 80], [3, 16]], "arrival": 11, "decode": 3}]
HYBRID = [{"kind": "full", "block_size": 16},
          {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}]


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("lazy", [False, True])
def test_hybrid_hit_loads_the_window_tail(pool, version, lazy):
    """Full + sliding window (32): the GPU hashes only the sliding-window blocks its sparse
    retention keeps (A's blocks 2, 3 of 5), so only those reach the CPU tier; after a GPU reset
    B's CPU hit is 64 tokens (full blocks 0-3 and window blocks 2, 3: 6 blocks loaded), and its
    forward attends A's tokens through both groups (INV-5)."""
    real = _run(pool, version, _case(AFTER_RESET, lazy, blocks=16, events=RESET,
                                     groups=HYBRID))
    trace = real["trace"]
    assert real["findings"] == [], trace
    stored = [x for line in trace if line.startswith("store ") and " A " in line
              for x in line.split()[3:]]
    assert {x.split("=")[0] for x in stored if x.startswith("g1:")} >= {"g1:2", "g1:3"}
    assert not any(x.startswith(("g1:0=", "g1:1=")) for x in stored), stored
    load = trace[_index(trace, "load ")].split()
    assert load[2] == "B" and [x.split("=")[0] for x in load[3:]] == [
        "g0:0", "g0:1", "g0:2", "g0:3", "g1:2", "g1:3"], load


RING = [{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}]


def test_eager_offload_with_a_ring_group_crashes_0300_not_0330(pool):
    """A real vLLM bug of 0.30.0 (fixed in 0.31.0 by the prefix-cacheable group filter,
    ``manager.py`` 0.31.0:851): eager ``_select_eager_blocks_to_store`` visits every KV cache
    group and resolves the block hashes of the ring group (block 4) against the hash block of 16
    (``resolve_block_hashes``, 0.30.0 ``manager.py:842``): an AssertionError in the first
    ``schedule()`` that has a request. A deployment gets there with SimpleCPUOffloadConnector
    in eager mode (the default) on a model whose KV cache planner gives a ring group a block
    smaller than the hash block (0.30.0's planner does for two full-attention layers of one
    16-dim KV head beside a ring layer of capacity 4). 0.33.0 offloads the full-attention
    group and B loads it back."""
    case = _case(AFTER_RESET, lazy=False, blocks=16, events=RESET, groups=RING)
    old = lockstep(case, "0.30.0", pool).real
    crash = [(f.get("kind"), f.get("exception"), f.get("stage")) for f in old["findings"]]
    assert crash == [("crash", "AssertionError", "schedule")], (
        "vLLM 0.30.0: eager SimpleCPUOffloadConnector with a ring KV cache group of block 4 "
        "under hash block 16 crashes the scheduler in the first schedule() of a request", old)
    assert not any(x.startswith("store ") for x in old["trace"])
    new = _run(pool, "0.33.0", case)
    assert new["findings"] == [] and new["counters"]["loads"] == 1, new["trace"]
    # lazy mode on 0.30.0 survives (the lazy walk has no per-group hash resolution)
    lazy = _run(pool, "0.30.0", _case(AFTER_RESET, lazy=True, blocks=16, events=RESET,
                                      groups=RING))
    assert lazy["findings"] == [] and lazy["counters"]["loads"] == 1, lazy["trace"]


#: a hash unit of 1 token (an MLA group of block 1) beside full attention of block 16: the GPU
#: manager caches A's prompt tail (17 of 18 tokens, or 18 with a drafter) in the full group's
#: block 1 under the hash boundary inside it (``_cache_partial_tail_block``, 0.26.0+)
TAIL_GROUPS = [{"kind": "mla", "block_size": 1}, {"kind": "full", "block_size": 16}]
TAIL = [{"id": "A", "prompt": [[1, 18]], "decode": 3},
        {"id": "B", "prompt": [[1, 18], [2, 20]], "arrival": 12, "decode": 2}]


def _tail_case(lazy: bool, drafter: bool) -> Case:
    case = _case(TAIL, lazy, blocks=120, cpu=200, events=RESET, groups=TAIL_GROUPS)
    if not drafter:
        return case
    d = case.to_json()
    d["layout"]["groups"][1]["drafter"] = True
    d["layout"]["engine"]["speculative"] = {"method": "mtp", "num_tokens": 2}
    return Case.from_json(d)


@pytest.mark.parametrize("version", RELEASES)
def test_lazy_walk_stores_a_partial_tail_checked_by_content(pool, version):
    """The lazy walk stores every hashed GPU block of the free queue, A's partial tail too:
    with an MTP drafter (whose lookup reads the whole prompt) the full group's block 1 under
    the hash of A's 18 tokens. The harness names it by the block that holds the boundary and
    judges it by content (INV-4 on the tokens up to the boundary), not as a complete block
    (INV-3 "key of hash 17 paired with chunk 0" before it knew partial tails: a finding of the
    harness, drawn by the campaign on a SimpleCPU + MTP layout)."""
    real = _run(pool, version, _tail_case(lazy=True, drafter=True))
    assert real["findings"] == [], real["trace"]
    stored = [x for line in real["trace"] if line.startswith("store ") and " A " in line
              for x in line.split()[3:]]
    assert any(x.startswith("g1:17=") for x in stored), stored


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("lazy", [False, True])
def test_eagle_block_drop_is_the_lookup_of_every_group(pool, version, lazy):
    """With an MTP drafter, SimpleCPU's CPU coordinator is built with ``use_eagle``
    (``use_eagle_block_drop()``): its lookup drops the volatile trailing block, so B, whose
    shared prefix with A is one block of the full group after a GPU reset, finds no CPU hit.
    That is vLLM's rule, not a miss: INV-9 excuses the eagle tail of every group the CPU
    coordinator drops it in (it fired "ready chunks cover 16 tokens beyond the GPU hit of 0,
    lookup found 0" while the driver named no drafter group). Without the drafter, B loads."""
    real = _run(pool, version, _tail_case(lazy=lazy, drafter=True))
    assert real["findings"] == [] and real["counters"]["loads"] == 0, real["trace"]
    plain = _run(pool, version, _tail_case(lazy=lazy, drafter=False))
    assert plain["findings"] == [] and plain["counters"]["loads"] == 1, plain["trace"]


#: the campaign's shrunk case (a sliding window of 128 on blocks of 4, eager): r3's store is
#: allocated CPU block 1, which held r0's block, in the step that schedules it
STAMPED = [{"id": "r0", "prompt": [[0, 64]], "decode": 4},
           {"id": "r2", "prompt": [[301, 84]], "arrival": 18, "decode": 2},
           {"id": "r3", "prompt": [[300, 8], [302, 20]], "arrival": 26, "decode": 4}]


def test_a_hash_stamped_at_allocation_is_registered_only_at_completion():
    """0.25.1-0.29.0 stamp a stored block's hash on its CPU block when they allocate it and map
    the hash (where a lookup finds it) only when the store completes. INV-4 on the CPU pool
    judges a block once it is mapped: a campaign reported "CPU block 1 registered under g0:1
    of r3 holds what a store wrote of another prefix" on this case for every release up to
    0.29.0, the harness's own error (under ``python -O``: with asserts the manager refuses a
    layout without full attention at start-up). The reversed mutant is still caught there, at the
    completion of the store it reverses."""
    case = dataclasses.replace(_case(STAMPED, lazy=False, blocks=64, cpu=39, groups=[
        {"kind": "sliding_window", "block_size": 4, "sliding_window": 128}]), asserts=False)
    with Releases.installed(["0.29.0"], timeout=120) as p:
        assert _run(p, "0.29.0", case)["findings"] == []
        real = _run(p, "0.29.0", _case(BASIC, lazy=False), "simple_cpu_reversed")
        assert [f["inv_id"] for f in real["findings"]] == ["INV-4"], real["trace"]


#: the campaign's shrunk case: blocks of 12 and of 16 (a drafter's) make a scheduler block of
#: 48; r5 comes back to r3's 48 tokens
ALIGNED = {"layout": {"groups": [{"kind": "full", "block_size": 12},
                                 {"kind": "full", "block_size": 16, "drafter": True}],
                      "engine": {"speculative": {"method": "eagle", "num_tokens": 1},
                                 "connector": {"kind": "simple_cpu", "lazy_offload": False}}},
           "requests": [{"id": "r0", "prompt": [[0, 64]]},
                        {"id": "r3", "prompt": [[300, 48]], "arrival": 21, "decode": 2},
                        {"id": "r5", "prompt": [[300, 48], [302, 28]], "arrival": 37,
                         "decode": 4}]}


@pytest.mark.parametrize("version", RELEASES)
def test_a_cpu_hit_ends_on_the_scheduler_block(pool, version):
    """SimpleCPU's lookup is its CPU coordinator's ``find_longest_cache_hit``, whose hits end
    on the scheduler block (48 tokens here; the hash unit only with partial hash hits): r5's
    48 shared tokens, less the EAGLE tail, are no hit. INV-9's oracle held the lookup to the
    groups' blocks (a 32-token hit) until the driver named that alignment
    (``hit_alignment``); a campaign reported it on every release."""
    real = _run(pool, version, Case.from_json(ALIGNED))
    assert real["findings"] == [] and real["counters"]["finished"] == 3, real["trace"]


#: the campaign's shrunk case: r0's store never completes (``timing.jobs``) and pins r0's four
#: blocks of a pool of 8; r5 needs five
PINNED = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                     "engine": {"num_gpu_blocks": 8,
                                "connector": {"kind": "simple_cpu", "lazy_offload": False}}},
          "requests": [{"id": "r0", "prompt": [[0, 64]]},
                       {"id": "r5", "prompt": [[300, 32], [302, 32]], "arrival": 37,
                        "decode": 4}],
          "timing": {"jobs": [{"store": 0, "latency": None}]}}


@pytest.mark.parametrize("version", RELEASES)
def test_a_store_that_never_completes_holds_its_pinned_blocks(pool, version):
    """SimpleCPU pins the GPU blocks a store reads until it completes (``touch``): a store
    that never completes holds them for good, and a request that needs them waits, held back
    by it (``inv.held_back``'s ``stores_pin``), no finding. The rule once knew only loads to
    hold blocks, and a campaign reported r5 "stuck and not held back" (INV-8) on
    0.30.0-0.33.0."""
    real = _run(pool, version, Case.from_json(PINNED))
    assert real["findings"] == [], real["trace"][-3:]
    assert real["trace"][-1] == "end waiting on store 0 (never completes); held back: r5=blocks"


def test_0290_idles_with_its_last_lazy_stores_in_flight():
    """0.25.1-0.29.0 name SimpleCPU's keep-alive hook ``has_pending_transfers``, which no one
    calls (``Scheduler.has_requests`` asks ``has_pending_push_work``, the base's False): once
    the last request finishes the engine idles, its last lazy stores in flight and never
    reported. The run ends there (``strands_at_idle``), as the engine does, where it once
    stepped on to collect them and each step's lazy walk made the next store: INV-8 "the
    engine never went idle" on 0.29.0, the harness's own (a campaign found it on a full + a
    sliding-window group). 0.30.0+ override the hook and do loop (test above)."""
    with Releases.installed(["0.29.0"], timeout=120) as p:
        real = _run(p, "0.29.0", _case(LIVELOCK, lazy=True, cpu=5, mnbt=32, store=2))
    assert real["findings"] == [], real["trace"][-3:]
    assert real["trace"][-1].startswith("end idle with jobs in flight: store "), real["trace"][-3:]
    assert real["counters"]["finished"] == 1 and real["counters"]["steps"] < 40


# -- the model in lockstep (simsched/model/simple_cpu_scheduler.py, 0.30.0+) ----------------------

#: BASIC with a ring beside the full-attention group: 0.30.0 stores the ring too (every group)
RING_16 = [{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 16}]
#: a pool of 8 blocks that two long prompts overrun: B is preempted while A's stores are in
#: flight (need_flush), and resumes with a new table
PREEMPT = [{"id": "A", "prompt": [[1, 64]], "decode": 40},
           {"id": "B", "prompt": [[2, 48]], "arrival": 1, "decode": 40}]


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("name", ["eager", "lazy", "ring-eager", "ring-lazy", "preempt-eager",
                                  "preempt-lazy", "pressure-eager", "async-eager", "async-lazy"])
def test_the_model_steps_with_the_release(pool, version, name):
    """Hand-made cases of each mode, model and release step for step: the same store events
    cut into the same jobs (eager: the step after the tokens are computed; lazy: the freed
    blocks, walked from the cursor), the same loads into the same blocks, the same GPU free
    queue (a store pins its blocks until its event completes) and flushes on a preemption.
    Without the model's SimpleCPU scheduler every case diverges at its first store line."""
    res = lockstep(_hand_made(name), version, pool)
    assert res.model is not None, res.observations
    assert res.divergence is None, res.divergence.describe()
    assert any(x.startswith("store ") for x in res.model.trace), res.model.trace


def _hand_made(name: str) -> Case:
    """The hand-made case ``name`` (its mode the suffix: eager or lazy)."""
    lazy = name.endswith("lazy")
    if name.startswith("ring"):
        return _case(BASIC, lazy, blocks=24, groups=RING_16)
    if name.startswith("preempt"):
        return _case(PREEMPT, lazy, blocks=8, cpu=12, store=3)
    if name.startswith("pressure"):
        return _case(PRESSURE, lazy, cpu=7)
    if name.startswith("async"):
        # the batch in flight's sampled tokens are not confirmed (num_output_placeholders)
        case = _case(PREEMPT[:1] + BASIC[1:], lazy, store=2)
        return dataclasses.replace(case, layout=case.layout.with_engine(async_scheduling=True))
    if name.startswith("livelock"):
        return _case(LIVELOCK, lazy, cpu=5, mnbt=32, store=2)
    if name.startswith("hybrid"):
        return _case(AFTER_RESET, lazy, blocks=16, events=RESET, groups=HYBRID)
    if name.startswith("onestep"):
        return _case(ONE_STEP, lazy)
    if name.startswith(("skip", "mtp")):
        d = _case(AFTER_RESET, lazy, blocks=16, events=RESET).to_json()
        if name.startswith("skip"):
            d["requests"][1]["skip_reading_prefix_cache"] = True
        else:
            d["layout"]["engine"]["speculative"] = {"method": "mtp", "num_tokens": 2}
        return Case.from_json(d)
    return _case(BASIC, lazy)


def test_the_model_crashes_where_0300_does(pool):
    """0.30.0's eager mode stores every group, a ring too, and its ``resolve_block_hashes``
    asserts that the hash unit divides the ring's block (here 4, of a unit of 16): the model
    raises where the release does, inside ``schedule()`` (no scheduler output in the step);
    0.33.0 stores the prefix-cacheable groups only and runs the case through."""
    ring = [{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}]
    case = _case(BASIC, False, blocks=40, groups=ring)
    old = lockstep(case, "0.30.0", pool)
    assert old.divergence is None, old.divergence.describe()
    assert old.model.trace[-1] == "crash AssertionError resolve_block_hashes schedule"
    assert old.model.trace[-2] == "step 0"
    new = lockstep(case, "0.33.0", pool)
    assert new.divergence is None and not new.model.findings, new.model.findings


@pytest.mark.parametrize("version", RELEASES)
def test_drawn_simple_cpu_cases_step_with_the_model(pool, version):
    """40 cases the strategy draws on the path (``cases(path="simple_cpu")``): every one the
    model covers (``unmodelled_path``: Mamba groups under fine-grained hash hits aside) and the
    release runs step by step agrees with the model (lazy walks that store a prompt's partial
    tail, and async scheduling, among them)."""
    agreed, unmodelled, diverged = drawn_lockstep(pool, version, 40, "simple_cpu")
    assert diverged == []
    assert agreed >= 24, (agreed, unmodelled)


#: the campaign's INV-4-store-full-5c108f (all ten releases, classed a bug): an eager store read
#: a block whose last slot held a rejected draft's KV in the harness's shadow only. The worker
#: writes a step's KV from its own count, the scheduler's minus the drafts it rejected in the
#: previous batch (0.33.0 ``gpu_model_runner.py:1343-1367``); the harness wrote it from the
#: scheduler's, one slot ahead after each rejection
ASYNC_EAGLE = {"layout": {"groups": [{"kind": "full", "block_size": 4}],
                          "engine": {"speculative": {"method": "eagle", "num_tokens": 1},
                                     "async_scheduling": True,
                                     "connector": {"kind": "simple_cpu",
                                                   "lazy_offload": False}}},
               "requests": [{"id": "r0", "prompt": [[0, 64]]},
                            {"id": "r4", "prompt": [[300, 8], [302, 20]], "arrival": 30,
                             "decode": 16, "accept": [1, 0, 1, 1, 0]}]}


@pytest.mark.parametrize("version", RELEASES)
def test_async_drafts_write_at_the_workers_positions(pool, version):
    res = lockstep(Case.from_json(ASYNC_EAGLE), version, pool)
    assert res.real["status"] == "ok" and not res.real["findings"], res.summary()
    assert res.agree, res.summary()
    stores = [x for x in res.real["trace"] if x.startswith("store ") and " r4 " in x]
    assert len(stores) >= 4           # r4's decode blocks are stored as they complete


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("lazy", [False, True])
def test_dcp_blocks_span_the_ranks(pool, version, lazy):
    """Under DCP an attention block spans ``dcp_size`` times its tokens
    (``resolve_dcp_kv_block_size``): BASIC with 8-token MLA blocks on 2 ranks is BASIC's
    geometry, and the model pairs each stored block with the hash at its end (a model that
    read the spec's 8 tokens paired block 0 with hash 0 and broke INV-3 at A's first store)."""
    case = Case.from_json({
        "layout": {"groups": [{"kind": "mla", "block_size": 8}],
                   "engine": {"num_gpu_blocks": 10, "cpu_chunks": 16, "dcp_size": 2,
                              "connector": {"kind": "simple_cpu", "lazy_offload": lazy}}},
        "timing": {"store_latency": 1, "load_latency": 1}, "requests": BASIC})
    res = lockstep(case, version, pool)
    assert res.agree, res.summary()
    assert res.real["counters"]["loads"] == 1     # B's CPU hit on A's last block


# -- the model of 0.25.1-0.29.0's manager in lockstep (simple_cpu_scheduler_legacy.py) ----------

LEGACY = ["0.25.1", "0.28.0", "0.29.0"]
#: A finishes in the step that computes its two prompt blocks
ONE_STEP = [{"id": "A", "prompt": [[1, 32]], "decode": 1}]


@pytest.fixture(scope="module")
def legacy_pool():
    with Releases.installed(LEGACY, timeout=120) as p:
        yield p


@pytest.mark.parametrize("version", LEGACY)
@pytest.mark.parametrize("name", ["eager", "lazy", "preempt-eager", "preempt-lazy",
                                  "pressure-eager", "async-eager", "async-lazy",
                                  "livelock-eager", "livelock-lazy", "hybrid-eager",
                                  "hybrid-lazy", "onestep-eager", "skip-eager", "skip-lazy",
                                  "mtp-eager", "mtp-lazy"])
def test_the_legacy_model_steps_with_the_release(legacy_pool, version, name):
    """The hand-made cases on 0.25.1-0.29.0's manager, model and release step for step; each
    runs into one of the rules 0.30.0 changed: the last lazy stores stranded when the engine
    idles (livelock-lazy: the run ends on "end idle with jobs in flight", where the model of
    0.30.0 steps on to INV-8), no finish flush (onestep: nothing stored; the model of 0.30.0
    stores A's blocks at step 1), a request that skips the prefix cache still loads from CPU
    (skip: one load; the model of 0.30.0 none), and before 0.27.0 a CPU lookup that drops no
    EAGLE block without a drafter group (mtp: one block more than 0.30.0's model loads)."""
    res = lockstep(_hand_made(name), version, legacy_pool)
    assert res.model is not None, res.observations
    assert res.divergence is None, res.divergence.describe()
    assert res.real["findings"] == [], res.real["trace"][-5:]
    if name.startswith(("skip", "mtp")):
        assert res.real["counters"]["loads"] == 1, res.real["trace"]
    if name == "livelock-lazy":
        assert res.model.trace[-1].startswith("end idle with jobs in flight: store ")


@pytest.mark.parametrize("version", LEGACY)
def test_drawn_simple_cpu_cases_step_with_the_legacy_model(legacy_pool, version):
    """40 drawn cases of the path (eager and lazy) on 0.25.1-0.29.0: every one the model covers
    and the release runs step by step agrees with the model."""
    agreed, unmodelled, diverged = drawn_lockstep(legacy_pool, version, 40, "simple_cpu")
    assert diverged == []
    assert agreed >= 20, (agreed, unmodelled)


def test_the_legacy_model_passes_over_a_ring_with_0290(legacy_pool):
    """Eager offload with a ring of 4-token blocks under a hash unit of 16: 0.29.0 (the first
    release with a ring) passes over the ring's blocks, never hashed, and stores the full group;
    the model agrees step for step, where the model of 0.30.0's selection crashes in
    ``resolve_block_hashes`` as 0.30.0 does (``test_the_model_crashes_where_0300_does``)."""
    ring = [{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}]
    res = lockstep(_case(BASIC, False, blocks=40, groups=ring), "0.29.0", legacy_pool)
    assert res.divergence is None and res.real["findings"] == [], res.summary()
    assert any(x.startswith("store ") for x in res.model.trace), res.model.trace


# -- Mamba groups (align mode) ----------------------------------------------------------------

MAMBA = [{"kind": "full", "block_size": 16},
         {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}]


def _mamba_case(lazy: bool, cpu: int = 16, dcp: int = 1) -> Case:
    """A's 80 tokens in prefill chunks of 32, a GPU prefix-cache reset, B sharing A's 80 tokens
    (``test_model_simple_cpu``'s MAMBA_AFTER_RESET): B loads A's Mamba state at 64 from CPU."""
    case = _case(AFTER_RESET, lazy, blocks=16, cpu=cpu, mnbt=32, events=RESET, groups=MAMBA)
    return dataclasses.replace(case, layout=case.layout.with_engine(dcp_size=dcp))


def _drawn_mamba(n: int) -> list[Case]:
    """The first ``n`` cases with a Mamba group the strategy draws on the path, as
    ``bench/bench_lockstep_paths.py --where mamba`` draws them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_lockstep_paths import drawn_cases
    return drawn_cases(n, "simple_cpu", "mamba")


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("lazy,cpu", [(False, 16), (True, 16), (False, 3)])
def test_mamba_states_step_with_the_release(pool, version, lazy, cpu):
    """Eager mode stores an align-mode Mamba group's states as the KV cache manager hands them
    over (``take_boundary_state_offloads``), in the step that allocates them, and never scans
    the group's table (``has_positionally_stable_blocks``); lazy mode stores the freed states
    its walk finds. B loads A's state at 64 back (g1:3). With a CPU pool of 2 blocks the state
    is evicted and not stored again. Without the hand-offs the first store line differs; with a
    positional scan of the group, the CPU pool of 2 diverges (a store of g1:3 again)."""
    res = lockstep(_mamba_case(lazy, cpu), version, pool)
    assert res.model is not None, res.observations
    assert res.divergence is None, res.divergence.describe()
    assert res.real["findings"] == [], res.real["trace"][-5:]
    stores = [x for x in res.real["trace"] if x.startswith("store ")]
    assert any(" g1:3=" in x for x in stores), stores
    if cpu == 16:
        assert res.real["counters"]["loads"] == 1, res.real["trace"]


@pytest.mark.parametrize("version", RELEASES)
def test_drawn_mamba_cases_step_with_the_model(pool, version):
    """The 40 drawn cases with a Mamba group (``--where mamba``): every one the model covers
    agrees step for step (without the hand-offs 12 to 19 diverge at a store line)."""
    agreed, unmodelled, diverged = drawn_lockstep(pool, version, 40, "simple_cpu",
                                                  _drawn_mamba(40))
    assert diverged == []
    assert agreed >= 20, (agreed, unmodelled)


@pytest.mark.parametrize("version", ["0.28.0", "0.29.0"])
@pytest.mark.parametrize("lazy", [False, True])
def test_the_legacy_model_stores_mamba_states_positionally(legacy_pool, version, lazy):
    """0.28.0-0.29.0's manager scans every group, a Mamba group too, and takes no hand-off:
    A's state at 64 is stored the step after it was computed (eager), and the model agrees
    step for step."""
    res = lockstep(_mamba_case(lazy), version, legacy_pool)
    assert res.model is not None, res.observations
    assert res.divergence is None, res.divergence.describe()
    assert res.real["findings"] == [] and res.real["counters"]["loads"] == 1, res.summary()


@pytest.mark.parametrize("lazy", [False, True])
def test_0280_scales_a_mamba_block_by_the_dcp_size(legacy_pool, lazy):
    """Under DCP 2 0.28.0's manager counts the Mamba group in blocks of 32 tokens, its pools in
    blocks of 16 (``LegacySimpleCPUOffloadScheduler.spec_block_sizes``): the eager scan stores
    the state at 32 a step late, and B's load takes no Mamba state (lazy: one load line of
    attention blocks alone). The model agrees step for step; with the pools' block size it
    diverges at A's first store (eager) and at B's load (lazy)."""
    res = lockstep(_mamba_case(lazy, dcp=2), "0.28.0", legacy_pool)
    assert res.model is not None, res.observations
    assert res.divergence is None, res.divergence.describe()
    assert res.real["counters"]["loads"] == 1, res.summary()


@pytest.mark.parametrize("version", ["0.28.0", "0.29.0"])
def test_drawn_mamba_cases_step_with_the_legacy_model(legacy_pool, version):
    agreed, unmodelled, diverged = drawn_lockstep(legacy_pool, version, 40, "simple_cpu",
                                                  _drawn_mamba(40))
    assert diverged == []
    assert agreed >= 20, (agreed, unmodelled)
