"""Lockstep replay against real vLLM releases: the model and the real Scheduler step for step.

Real-vLLM tests FAIL (never skip) when a release is missing: ``Releases.installed([...])`` raises.
"""

from __future__ import annotations

import dataclasses

import os
from pathlib import Path
import signal
import threading
import time

import pytest

from simsched.case import Case
from simsched.lockstep import (HANDMADE, canonical, diff_traces, generate_case, lockstep,
                               lockstep_observations, segments)
from simsched.targets import Releases
from simsched.vllm.releases import KNOWN_RELEASES, version_key

RING = {"groups": [{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}],
        "engine": {"num_gpu_blocks": 64}}
REQS = [{"id": "a", "prompt": [[7, 64]], "decode": 3},
        {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 6, "decode": 2}]
LOAD_CASE, FENCE_CASE = HANDMADE["load"], HANDMADE["fence"]
#: generated cases on which the model and 0.30.0/0.33.0 agree: seeds 0-29 of both layouts (on
#: 0.30.0, sliding-window seeds 0 and 1 agree only with the order the release walked each job's
#: key set in, which the model takes from the release's run: test_the_model_walks_a_job_s_key_set_
#: as_the_release_did). Agreement over 1,000 cases per release and layout: BENCHMARKS.md,
#: "Lockstep agreement".
AGREEING = ([("full16", s) for s in range(30)]
            + [("full16+sw16w128+full16", s) for s in range(30)])


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"],
                            timeout=120) as p:
        yield p


def sigs(res):
    return sorted(str(o.signature) for o in res.observations)


# --- the trace normaliser (no release needed) -----------------------------------------------

def test_canonical_orders_finish_and_done_but_keeps_schedule_order():
    seg = ["step 3", "sched b 1", "alloc b g0=-", "sched a 1", "alloc a g0=-", "check ok",
           "done 4 store", "finish a finished"]
    out = canonical(seg)
    assert out[1:5] == seg[1:5]
    assert out[-2:] == ["done 4 store", "finish a finished"]


def test_canonical_sorts_preempt_lines():
    """SchedulerOutput.preempted_req_ids is a set: the release side lists a step's preemptions
    by request ID, the model in preemption order (the last running request first)."""
    seg = ["step 10", "preempt r1", "preempt r0", "flush 8", "check ok"]
    assert canonical(seg)[1:3] == ["preempt r0", "preempt r1"]
    assert diff_traces(["# h"] + seg, ["# h", "step 10", "preempt r0", "preempt r1", "flush 8",
                                       "check ok"]) is None


def test_diff_names_first_differing_kind_and_drops_trailing_empty_steps():
    m = ["# h", "step 0", "sched a 4", "alloc a g0=1", "check ok", "step 1", "check ok"]
    r = ["# h", "step 0", "sched a 4", "alloc a g0=1", "check ok"]
    assert diff_traces(m, r) is None
    assert len(segments(m)) == 2
    gap_m = ["# h", "step 0", "sched a 4", "alloc a g0=1", "check ok", "step 1", "check ok",
             "step 2", "sched a 1", "alloc a g0=-", "check ok"]
    gap_r = ["# h", "step 0", "sched a 4", "alloc a g0=1", "check ok", "step 1", "sched a 1",
             "alloc a g0=-", "check ok"]
    assert diff_traces(gap_m, gap_r) is None
    r2 = ["# h", "step 0", "sched a 4", "alloc a g0=2", "check ok"]
    d = diff_traces(m, r2)
    assert d.step == 0 and d.kind == "alloc" and "free-queue" in d.hint
    r3 = ["# h", "step 0", "crash AssertionError f x"]
    assert diff_traces(["# h", "step 0", "crash AssertionError f y"], r3) is None


# --- the reference PR chain under lockstep ---------------------------------------------------

@pytest.mark.parametrize("version", ["0.29.0", "0.30.0"])
def test_ring_boot_assert_is_a_crash_on_0290_0300(pool, version):
    case = Case.from_json({"layout": RING, "requests": REQS})
    res = lockstep(case, version, pool)
    assert "crash:AssertionError:build_offloading_config" in sigs(res), res.summary()
    crash = next(o for o in res.observations if o.signature.kind == "crash")
    assert crash.outcome["release"] == version
    assert crash.outcome["file"].endswith("offloading/config.py")
    assert res.agree, res.summary()          # the model predicts the same crash


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0", "0.33.0"])
def test_ring_runs_clean_on_0310_and_later(pool, version):
    case = Case.from_json({"layout": RING, "requests": REQS})
    res = lockstep(case, version, pool)
    assert res.real["status"] == "ok"
    assert not res.real["findings"], res.real["findings"]
    assert not [o for o in res.observations if o.signature.kind != "divergence"]
    assert res.real["counters"]["steps"] > 0 and res.real["counters"]["stores"] > 0


# --- agreement ------------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_agreement_on_handmade_load_and_fence_cases(pool, version):
    for c in (LOAD_CASE, FENCE_CASE):
        res = lockstep(Case.from_json(c), version, pool)
        assert res.agree, res.summary()
    assert res.real["counters"]["stores"] >= 1


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_agreement_on_generated_cases(pool, version):
    assert_agree(AGREEING, version, pool)


def assert_agree(layout_seeds, version, pool, async_scheduling: bool = False) -> None:
    """Every generated case agrees step for step, and together they load from the CPU tier (they
    exercise its loads, not just stores)."""
    loads = 0
    for layout, seed in layout_seeds:
        res = lockstep(generate_case(seed, layout, async_scheduling=async_scheduling), version,
                       pool)
        assert res.agree, f"{layout} seed {seed}: {res.summary()}"
        loads += res.real["counters"]["loads"]
    assert loads > 0


#: one hand-made case per scheduler rule the model mirrors (tests/test_model_rules.py derives
#: each case's expectation from the rule), and the generated seeds whose divergence the rule
#: explained: full16 seed 764 (a request aborted during its load keeps its blocks), seed 128
#: (admission needs blocks for the whole sequence), full16 seed 510 and full16+ring4 seeds 111
#: and 729 (0.31.0+: requests holding KV blocks are drained first, other skipped requests go back
#: to the front of ``waiting``),
#: full16 seed 268 (loaded blocks are cached only when the request is promoted),
#: full16+sw16w128+full16 seed 185 (a finished request's out-of-window blocks are freed first),
#: full16+chunked16c64 seed 307 (0.30.0+ _sliding_window_lookup: a miss clears a pending chunk
#: seen to its right, so the lookup is not deferred), full16+ring4 seed 755 (0.33.0: a resumed
#: request offers its chunks for storing again from chunk 0), full16+sw16w128+full16 seed 964
#: (the request's shared_prefix_boundary is a reachable boundary of sliding-window stores)
RULE_CASES = ["abort_load", "full_seq", "reserve", "promote", "window_finish", "mamba_load",
              "async_decode", "async_abort", "async_window", "ring_fence", "spec_reject",
              "spec_lookahead", "spec_pad", "spec_eagle_hit"]
RULE_SEEDS = [("full16", 764), ("full16", 128), ("full16", 510), ("full16+ring4", 111),
              ("full16+ring4", 729), ("full16", 268), ("full16+sw16w128+full16", 185),
              ("full16+chunked16c64", 307), ("full16+ring4", 755),
              ("full16+sw16w128+full16", 964)]


#: generated cases under async scheduling (the AsyncScheduler behind a batch queue of depth 2):
#: seeds that agree on 0.30.0 and 0.33.0 (sliding-window seeds 0 and 1 are left out for the
#: 0.30.0 store-order divergence AGREEING names); agreement over more cases: BENCHMARKS.md,
#: "Lockstep agreement"
#: sliding-window seeds 53 and 69 free window blocks on the processed tokens (async_window)
ASYNC_AGREEING = ([("full16", s) for s in range(12)]
                  + [("full16+sw16w128+full16", s) for s in [*range(2, 10), 53, 69]])


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_agreement_on_async_generated_cases(pool, version):
    assert_agree(ASYNC_AGREEING, version, pool, async_scheduling=True)


#: generated cases with speculative decoding (drafts proposed by the harness's worker after each
#: step, accepted per the requests' ``accept`` patterns, so some are rejected): seeds that agree
#: on 0.30.0 and 0.33.0; agreement over more cases: BENCHMARKS.md, "Lockstep agreement"
SPEC_AGREEING = ([("full16+ngram2", s) for s in range(8)]
                 + [("full16+full16drafter+eagle2", s) for s in range(8)])


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_agreement_on_speculative_generated_cases(pool, version):
    rejected = 0
    for layout, seed in SPEC_AGREEING:
        case = generate_case(seed, layout)
        res = lockstep(case, version, pool)
        assert res.agree, f"{layout} seed {seed}: {res.summary()}"
        rejected += sum(1 for r in case.requests if r.accept and min(r.accept) < 2)
    assert rejected > 0          # the cases do reject drafts


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_agreement_on_speculative_async_generated_cases(pool, version):
    """Under async scheduling the scheduler schedules placeholder drafts and the worker verifies
    its own (0.33.0 ``gpu_model_runner.py:1343-1367``): the same cases agree step for step, and
    the drafts their patterns accept shorten the runs against the same cases with every draft
    rejected (a worker that took the placeholders for padding would run them alike)."""
    steps, steps_rejecting = 0, 0
    for layout, seed in SPEC_AGREEING:
        case = generate_case(seed, layout, async_scheduling=True)
        res = lockstep(case, version, pool)
        assert res.agree, f"{layout} seed {seed}: {res.summary()}"
        rejecting = dataclasses.replace(case, requests=tuple(
            dataclasses.replace(r, accept=(0,)) for r in case.requests))
        res0 = lockstep(rejecting, version, pool)
        assert res0.agree, f"{layout} seed {seed}, every draft rejected: {res0.summary()}"
        steps += res.real["counters"]["steps"]
        steps_rejecting += res0.real["counters"]["steps"]
    assert steps < steps_rejecting


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_agreement_on_rule_cases(pool, version):
    for name in RULE_CASES:
        res = lockstep(Case.from_json(HANDMADE[name]), version, pool)
        assert res.agree, f"{name}: {res.summary()}"
    for layout, seed in RULE_SEEDS:
        res = lockstep(generate_case(seed, layout), version, pool)
        assert res.agree, f"{layout} seed {seed}: {res.summary()}"


#: seeds whose first divergence was the CPU tier's eviction order on 0.31.0+ (full16 seed 0 on
#: 0.33.0 loaded a chunk the model had evicted): LRUCachePolicy ranks chunks by insertion and
#: finished requests (0.31.0, 0.32.0), by request and token position (0.33.0)
LRU_SEEDS = ([("full16", s) for s in (0, 30, 48, 68, 116)]
             + [("full16+sw16w128+full16", s) for s in (0, 1, 9, 37)])


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_agreement_on_cpu_lru_ranks(pool, version):
    for layout, seed in LRU_SEEDS:
        res = lockstep(generate_case(seed, layout), version, pool)
        assert res.agree, f"{layout} seed {seed}: {res.summary()}"


#: the mla and chunked-local layouts under lockstep: seeds that agree on 0.30.0 and 0.33.0
#: (chunked seeds 1 and 9, and 26, agree on 0.30.0 with the release's walk of each job's key
#: set); mla16 loads from the CPU tier in 8 of these cases
MORE_LAYOUTS = ([("mla16", s) for s in range(13)] + [("mla64", s) for s in range(6)]
                + [("full16+chunked16c64", s) for s in list(range(13)) + [26]])


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_agreement_on_mla_and_chunked_local_layouts(pool, version):
    assert_agree(MORE_LAYOUTS, version, pool)


#: align-mode Mamba (MambaManager, boundary-state stores, block-aligned prefill chunks): seeds
#: 0-19 (seed 9 agrees on 0.30.0 with the release's walk of each job's key set), and seed 78,
#: whose request loads a Mamba state from the CPU tier
MAMBA_SEEDS = [("full16+mamba16align", s) for s in list(range(20)) + [78]]


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_agreement_on_mamba_align_layout(pool, version):
    assert_agree(MAMBA_SEEDS, version, pool)


#: one request longer than the GPU pool holds (was INV-8 on every model profile)
TOO_LONG = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                       "engine": {"num_gpu_blocks": 8}},
            "requests": [{"id": "a", "prompt": [[7, 200]], "decode": 2}]}


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
@pytest.mark.parametrize("name, estimate", [("mamba_stall", 80), ("too_long", 112)])
def test_a_pool_too_small_for_the_longest_request_is_refused_at_startup(pool, version, name,
                                                                          estimate):
    """HANDMADE["mamba_stall"] (f: 96 + 1 tokens need 7 full-attention blocks and 2 align-mode
    Mamba blocks of the 7 usable ones; it used to stall, INV-8, on both sides) and a request of
    202 tokens in 7 blocks: the release's own start-up check (_check_enough_kv_cache_memory,
    run by the harness before the Scheduler is built) refuses both, and the model refuses them
    the same way: no run, no finding."""
    case = Case.from_json(HANDMADE[name] if name in HANDMADE else TOO_LONG)
    res = lockstep(case, version, pool)
    assert res.real["status"] == "refused", res.summary()
    assert res.model.refused is not None and res.observations == []
    assert res.summary().startswith(f"{version}: not run: refused at start-up: To serve at "
                                    "least one request with the model's max seq len")
    hint = f"the estimated maximum model length is {estimate}."
    assert hint in res.real["reason"] and hint in res.model.refused


#: one request whose 128 tokens fill 8 blocks: the whole pool, the null block included
NULL_BLOCK_EDGE = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                              "engine": {"num_gpu_blocks": 8}},
                   "requests": [{"id": "a", "prompt": [[1, 126]], "decode": 2}]}


@pytest.mark.parametrize("version", sorted(KNOWN_RELEASES, key=version_key))
def test_the_startup_checks_of_every_release(version):
    """The liveness finding HANDMADE["mamba_stall"] once gave is a state no deployment reaches:
    every release's start-up check refuses its pool (97 tokens need 7 full-attention blocks and
    2 align-mode Mamba blocks, of 8), and the model refuses it the same way: no observation.
    NULL_BLOCK_EDGE is one that deployments reach before 0.29.0: their check counts the null
    block as usable (get_kv_cache_configs; 0.29.0 reserves it), the engine starts, and the
    request never gets the 8 blocks the BlockPool has only 7 of to give: INV-8 on the release
    and on the model alike; 0.29.0 on refuse it at start-up."""
    with Releases.installed([version], timeout=300) as one:
        res = lockstep(Case.from_json(HANDMADE["mamba_stall"]), version, one)
        assert res.real["status"] == "refused", res.summary()
        assert "max seq len (97)" in res.real["reason"]
        assert res.model.refused is not None and res.observations == []
        edge = lockstep(Case.from_json(NULL_BLOCK_EDGE), version, one)
    if version_key(version) >= version_key("0.29.0"):
        assert edge.real["status"] == "refused" and edge.observations == [], edge.summary()
        assert "the estimated maximum model length is 112" in edge.model.refused
    else:
        assert edge.agree, edge.summary()
        assert sigs(edge) == ["invariant:INV-8"]


#: EAGLE beside a group whose cache-hit finder never drops a block (the model crashed with a
#: KeyError on both: issue 17, item 6.1): chunked local attention (asserted on: the release's
#: own AssertionError at the first lookup) and align-mode Mamba (b's hit ends on a state block)
EAGLE_KEEPERS = {
    "chunked": {"layout": {"groups": [{"kind": "chunked_local", "block_size": 16,
                                       "attention_chunk_size": 64}],
                           "engine": {"num_gpu_blocks": 64, "speculative": {
                               "method": "eagle", "num_tokens": 2}}},
                "requests": [{"id": "a", "prompt": [[0, 100]], "decode": 8},
                             {"id": "b", "prompt": [[0, 100]], "arrival": 12, "decode": 4}]},
    "mamba": {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                    {"kind": "mamba", "block_size": 16,
                                     "mamba_cache_mode": "align"}],
                         "engine": {"num_gpu_blocks": 64, "speculative": {
                             "method": "eagle", "num_tokens": 2}}},
              "requests": [{"id": "a", "prompt": [[0, 64]], "decode": 8},
                           {"id": "b", "prompt": [[0, 64]], "arrival": 12, "decode": 4}]},
}


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
@pytest.mark.parametrize("asserts", [True, False])
@pytest.mark.parametrize("name", ["chunked", "mamba"])
def test_eagle_beside_a_group_that_keeps_its_hit_block(pool, version, asserts, name):
    res = lockstep(Case.from_json(dict(EAGLE_KEEPERS[name], asserts=asserts)), version, pool)
    assert res.model is not None and res.agree, res.summary()
    expect = (["crash:AssertionError:find_longest_cache_hit"] if name == "chunked" and asserts
              else [])
    assert sigs(res) == expect


#: align-mode Mamba with 2-block chunks (the case of finding invariant-INV-4-e66b97, grown to a
#: CPU load): on 0.33.0 the MambaManager's align table nulls interior states, so the state block a
#: boundary store job reads sits at the index its source spec names (block_indices, boundary //
#: tokens_per_block - 1), not at a position the harness can read off the table. Every state is
#: kept (retention_interval null, the flag's None): under the releases' default of 0 only the
#: replay boundary's state is, and b has nothing to load
MAMBA_CHUNK2 = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                      {"kind": "mamba", "block_size": 16,
                                       "mamba_cache_mode": "align"}],
                           "engine": {"blocks_per_chunk": 2, "num_gpu_blocks": 10,
                                      "retention_interval": "dense"}},
                "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                             {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                             {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8,
                              "decode": 2}]}


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_mamba_boundary_store_with_two_block_chunks(pool, version):
    res = lockstep(Case.from_json(MAMBA_CHUNK2), version, pool)
    assert res.agree, res.summary()
    assert res.real["counters"]["loads"] >= 1


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_align_mamba_block_other_than_the_engine_block_is_unsupported(pool, version):
    """Every release sets mamba_block_size = block_size in align mode (Platform's hybrid
    block-size alignment), so full/16 + mamba/528(align) (finding invariant-INV-2-e66b97: INV-2
    under async scheduling on 0.33.0) is no real engine's layout; with the Mamba block at the
    engine's block size the same workload runs and agrees."""
    case = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                  {"kind": "mamba", "block_size": 528,
                                   "mamba_cache_mode": "align"}],
                       "engine": {"async_scheduling": True}},
            "requests": [{"id": "r0", "prompt": [[0, 64]]}]}
    res = lockstep(Case.from_json(case), version, pool)
    assert res.real["status"] == "unsupported", res.summary()
    assert "mamba_block_size" in res.real["reason"]
    assert res.observations == []
    case["layout"]["groups"][1]["block_size"] = 16
    res = lockstep(Case.from_json(case), version, pool)
    assert res.agree, res.summary()


@pytest.mark.parametrize("version", ["0.29.0", "0.33.0"])
def test_none_mode_mamba_with_prefix_caching_is_unsupported(pool, version):
    """With prefix caching on, vLLM's MambaModelConfig.verify_and_update_config makes a Mamba
    group's mode "none" into "align": the campaign's clusters AssertionError-__init-c73f71
    (0.33.0's MambaManager assert) and AssertionError-build_offloading_config-c6e0ef
    (``block_size % self.hash_block_size`` in BlockPool, ``full/16 + mamba/32(none)``) were of
    engines no deployment starts. The same layout in align mode runs."""
    case = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                  {"kind": "mamba", "block_size": 16,
                                   "mamba_cache_mode": "none"}]},
            "requests": [{"id": "r0", "prompt": [[0, 64]]}]}
    res = lockstep(Case.from_json(case), version, pool)
    assert res.real["status"] == "unsupported", res.summary()
    assert "MambaModelConfig" in res.real["reason"]
    assert res.observations == []
    case["layout"]["groups"][1]["mamba_cache_mode"] = "align"
    res = lockstep(Case.from_json(case), version, pool)
    assert res.agree, res.summary()


def test_campaign_layouts_draw_no_none_mode_mamba():
    """The strategies follow the same rule: with prefix caching on, only align-mode Mamba."""
    from hypothesis import given, settings
    from fuzz.strategies import cases

    seen = []

    @settings(max_examples=300, database=None, deadline=None)
    @given(cases())
    def draw(case):
        seen.extend(g.mamba_cache_mode for g in case.layout.groups if g.kind == "mamba")
    draw()
    assert seen and set(seen) == {"align"}


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_a_request_aborted_before_it_arrives_is_never_sent(pool, version):
    """finding divergence-trace_end-e66b97 (tests/test_model_rules.py, WITHDRAWN): the harness
    does not add the withdrawn request, even while another request keeps the engine busy."""
    from test_model_rules import WITHDRAWN
    res = lockstep(Case.from_json(WITHDRAWN), version, pool)
    assert res.agree, res.summary()
    assert not [x for x in res.real["trace"] if " r2 " in f"{x} "]
    assert res.real["counters"]["aborted"] == 1


def test_observations_api_matches_replay(pool):
    from simsched.targets import ReleaseTarget
    obs = lockstep_observations(Case.from_json({"layout": RING, "requests": REQS}),
                                ReleaseTarget("0.30.0", pool))
    assert [str(o.signature) for o in obs] == ["crash:AssertionError:build_offloading_config"]


# --- robust workers -------------------------------------------------------------------------

def _long_case() -> Case:
    """The kill (after 1 s) must land in the release's run, after the model's (lockstep runs
    the model first): about 0.5 s of model, then about 2 s of release. With prompt-only stores
    a 400-token decode ran both in under 1 s; 1,600 tokens kept the model past 1 s."""
    reqs = [{"id": f"r{i}", "prompt": [[i % 5, 200 + i]], "arrival": i // 4, "decode": 800}
            for i in range(64)]
    return Case.from_json({"layout": {"groups": [{"kind": "full", "block_size": 16}],
                                      "engine": {"num_gpu_blocks": 4000}},
                           "requests": reqs})


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])      # utime + stime


def _kill_when_busy(pid: int) -> None:
    idle = _cpu_ticks(pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _cpu_ticks(pid) < idle + 3:
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)


def test_killed_worker_is_a_recorded_finding_and_restarts(pool):
    worker = pool.worker("0.33.0", True)
    worker.start()
    pid = worker.pid
    # Killed while it works on the case: the killer waits until the idle worker starts using
    # CPU time (it has received the case), so no timer races a case that may end first.
    timer = threading.Thread(target=_kill_when_busy, args=(pid,))
    timer.start()
    try:
        res = lockstep(_long_case(), "0.33.0", pool, timeout=60)
    finally:
        timer.join()
    assert sigs(res) == ["crash:WorkerDied:release_worker"], res.real
    assert res.real["signal"] == signal.SIGKILL
    again = lockstep(Case.from_json(LOAD_CASE), "0.33.0", pool)   # restarted transparently
    assert again.agree and worker.pid != pid


def test_hung_worker_is_a_recorded_finding_and_restarts(pool):
    worker = pool.worker("0.33.0", True)
    worker.start()
    pid = worker.pid
    os.kill(pid, signal.SIGSTOP)           # a worker that never answers
    t0 = time.monotonic()
    res = lockstep(Case.from_json(LOAD_CASE), "0.33.0", pool, timeout=3)
    assert time.monotonic() - t0 < 30
    assert sigs(res) == ["crash:WorkerTimeout:release_worker"], res.real
    again = lockstep(Case.from_json(LOAD_CASE), "0.33.0", pool)
    assert again.agree and worker.pid != pid


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_bare_real_run_drives_the_scheduler_like_the_checked_run(pool, version):
    """bench_model.py --real times the bare Scheduler (``run_case`` with ``bare=True``: no trace,
    shadow or checks); it must schedule, store, load and preempt exactly as the checked run."""
    from simsched.lockstep import run_real
    cases = [Case.from_json(LOAD_CASE), Case.from_json(FENCE_CASE),
             generate_case(7, "full16+sw16w128+full16"), generate_case(3, "full16")]
    for case in cases:
        full = run_real(case, version, pool)
        bare = pool.worker(version, case.asserts).call("run_case", timeout=120,
                                                        case=case.to_json(), bare=True)
        assert full["status"] == bare["status"] == "ok", (full.get("status"), bare)
        assert bare["counters"] == full["counters"]
        assert bare["counters"]["steps"] > 0 and bare["loop_cpu"] > 0


#: a one-token prompt whose token is in the CPU tier (a stored it; block size 1, so 1-token
#: chunks): BENCHMARKS.md, "Findings on 0.33.0, triaged", the INV-8 row
ONE_TOKEN = {"layout": {"groups": [{"kind": "full", "block_size": 1}],
                        "engine": {"num_gpu_blocks": 64}},
             "requests": [{"id": "a", "prompt": [[1, 1], [2, 1]], "decode": 1},
                          {"id": "b", "prompt": [[1, 1]], "arrival": 3, "decode": 1}]}


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_one_token_prompt_loaded_from_the_cpu_tier_livelocks(pool, version):
    """A real vLLM liveness bug. b's whole prompt (one token) hits the CPU tier: the load
    completes, _update_waiting_for_remote_kv recomputes the last prompt token
    (num_computed_tokens 1 -> 0), the waiting loop takes b for a new request, the connector's
    lookup finds the chunk again and loads it again: b is never scheduled. The model reproduces
    it; with an EAGLE drafter group the trailing-chunk pop leaves nothing to load."""
    case = Case.from_json(ONE_TOKEN)
    real = pool.worker(version, True).call("run_case", timeout=120, case=case.to_json(),
                                          step_cap=300)
    assert real["status"] == "ok"
    assert [(f.get("inv_id"), f.get("op")) for f in real["findings"]] == [("INV-8", "load")]
    trace = real["trace"]
    assert not any(x.startswith("sched b ") for x in trace)
    # stopped at b's third load without a step of it (MAX_LOADS_UNSCHEDULED), not the step cap
    assert sum(1 for x in trace if x.startswith("load ") and x.split()[2] == "b") == 3
    from simsched.model import run_case
    from simsched.profiles import profile_for_release
    model = run_case(case, profile_for_release(version))
    assert [f.get("inv_id") for f in model.findings] == ["INV-8"]
    eagle = {**ONE_TOKEN, "layout": {
        "groups": [{"kind": "full", "block_size": 1},
                   {"kind": "full", "block_size": 1, "drafter": True}],
        "engine": {"num_gpu_blocks": 64, "speculative": {"method": "eagle", "num_tokens": 2}}}}
    res = lockstep(Case.from_json(eagle), version, pool)
    assert res.agree and not res.real["findings"], res.summary()


@pytest.mark.parametrize("version, seed", [("0.31.0", 25), ("0.31.0", 110), ("0.32.0", 74)])
def test_an_inflight_reservation_holds_a_spec_decode_step(pool, version, seed):
    """Scheduler._request_remaining_blocks under speculative decoding: 0.31.0 adds one spec
    decode step's blocks to each in-flight prefill's reservation, 0.32.0 on counts its
    1 + k + lookahead slots with the sequence. On these EAGLE cases (the planner's merged
    group, a 24-block pool) an async load of the whole prompt is then refused for a step, and
    the prefix it wanted is evicted from the 16-chunk tier meanwhile: the model admitted the
    load until it held the step too (BENCHMARKS.md, planner-built families)."""
    from simsched.families import family_case

    res = lockstep(family_case(seed, "dense+eagle"), version, pool)
    assert res.agree, res.summary()


def test_the_model_walks_a_job_s_key_set_as_the_release_did(pool):
    """Up to 0.30.0 a completed store job's chunks join the CPU tier's evictable list in the
    order complete_store walks the job's key set (TransferJobStatus.keys), a set of hash bytes
    whose order vLLM leaves to the hash seed. The release's run reports that order per job and
    lockstep gives it to the model: on sliding-window seed 1 the release walks some job's keys
    in another order than the model's own choice (tuple_set_order), the model without the
    release's walks evicts other chunks and differs, and with them agrees."""
    from simsched.model import run_case
    from simsched.model.cpu_manager import tuple_set_order
    from simsched.profiles import profile_for_release

    case = generate_case(1, "full16+sw16w128+full16")
    res = lockstep(case, "0.30.0", pool)
    walks = dict(res.real["walks"])
    assert any(list(w) != tuple_set_order(w) for w in walks.values())
    assert res.agree, res.summary()
    alone = run_case(case, profile_for_release("0.30.0"))
    assert diff_traces(alone.trace, res.real["trace"]) is not None


#: the campaign's INV-9-lookup-full+sliding_window-086d17: EAGLE with no drafter group makes every
#: group an EAGLE group on 0.25.1-0.29.0, and only a sliding-window EAGLE group looks up the
#: chunk it pops before 0.30.0; r1's lookup past its GPU hit of 32: group 0 finds chunks 2 and 3
#: and pops 3, group 1 then looks up chunk 2 alone and pops it: no hit (0.29.0
#: ``_lookup_complete_chunks``)
EAGLE_EVERY_GROUP = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                           {"kind": "full", "block_size": 16},
                                           {"kind": "sliding_window", "block_size": 16,
                                            "sliding_window": 128}],
                                "engine": {"speculative": {"method": "eagle", "num_tokens": 1},
                                           "num_gpu_blocks": 18}},
                     "requests": [{"id": "r0", "prompt": [[0, 64]]},
                                  {"id": "r1", "prompt": [[0, 64]]}]}


@pytest.mark.parametrize("version,hit", [("0.29.0", False), ("0.30.0", True)])
def test_eagle_groups_pop_their_chunks_in_turn_before_0300(pool, version, hit):
    res = lockstep(Case.from_json(EAGLE_EVERY_GROUP), version, pool)
    assert res.agree, res.summary()
    invs = [f.get("inv_id") for f in res.real["findings"]]
    assert invs == ([] if hit else ["INV-9"]), invs
    assert any(x.startswith("load ") for x in res.real["trace"]) == hit
