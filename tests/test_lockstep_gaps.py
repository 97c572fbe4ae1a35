"""Model gaps of campaign c20b, each checked against the real releases step by step.

Real-vLLM tests FAIL (never skip) when a release is missing: ``Releases.installed([...])`` raises.
"""

from __future__ import annotations

import pytest

from simsched.case import Case
from simsched.lockstep import generate_case, lockstep
from simsched.model import run_case
from simsched.profiles import profile_for_release
from simsched.targets import Releases

LEGACY = ["0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0"]
ALL = LEGACY + ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(ALL, timeout=120) as p:
        yield p


def scheds(trace: list[str]) -> list[str]:
    return [x for x in trace if x.startswith("sched ")]


def stores(trace: list[str]) -> list[str]:
    return [x for x in trace if x.startswith("store ")]


# --- gap-trace_store-4d4914: align-mode Mamba before 0.29.0 ----------------------------------

#: one 64-token prompt beside an align-mode Mamba group: up to 0.28.0 (no
#: take_boundary_state_offloads, no _build_aligned_boundary_store_jobs) the Mamba state block is
#: part of the chunk store job; from 0.29.0 it is a boundary job of its own, before the chunk job
MAMBA_ONE = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                   {"kind": "mamba", "block_size": 16,
                                    "mamba_cache_mode": "align"}]},
             "requests": [{"id": "r0", "prompt": [[0, 64]]}]}


@pytest.mark.parametrize("version", LEGACY)
def test_model_stores_align_mamba_in_the_chunk_job_before_0290(version):
    """The store line is the one 0.25.1-0.28.0's real Scheduler emits for this case."""
    res = run_case(Case.from_json(MAMBA_ONE), profile_for_release(version))
    assert stores(res.trace) == ["store 0 r0 g0:0=1 g0:1=2 g0:2=3 g0:3=4 g1:3=5"]


@pytest.mark.parametrize("version", LEGACY + ["0.29.0"])
def test_align_mamba_store_jobs_agree(pool, version):
    case = MAMBA_ONE
    if version == "0.29.0":
        # every state kept (retention null): under 0.29.0's default of 0 the state at 64 is no
        # replay boundary's (63, aligned to 48) and is not offered at all
        case = {**MAMBA_ONE, "layout": {**MAMBA_ONE["layout"],
                                         "engine": {"retention_interval": "dense"}}}
    res = lockstep(Case.from_json(case), version, pool)
    assert res.agree, res.summary()
    want = (["store 0 r0 g1:3=5", "store 1 r0 g0:0=1 g0:1=2 g0:2=3 g0:3=4"]
            if version == "0.29.0" else ["store 0 r0 g0:0=1 g0:1=2 g0:2=3 g0:3=4 g1:3=5"])
    assert stores(res.real["trace"]) == want


# --- gap-trace_sched-91bff9: padding a one-token request to 1 + k tokens ---------------------

#: EAGLE with one draft token: r1, a one-token prompt, comes from the waiting queue after r0's
#: prefill in the same step. Scheduler.schedule pads a new decode only beside
#: scheduled_running_reqs (the running loop's requests, none here) or, 0.30.0+, after a prefix hit
#: (num_computed_tokens > 0): r1 is scheduled with its 1 token on every release. On 0.25.1 the
#: store is also the one with the EAGLE tail hole: r0's fourth chunk is never stored
PAD_AFTER_PREFILL = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                                "engine": {"speculative": {"method": "eagle", "num_tokens": 1}}},
                     "requests": [{"id": "r0", "prompt": [[0, 64]]},
                                  {"id": "r1", "prompt": [[0, 1]]}]}

#: b (a's 32 tokens + 1) arrives after a finished: a GPU prefix hit of 32 leaves one token, no
#: running request. 0.30.0+ pad it to 1 + 2 tokens; 0.25.1-0.29.0 (scheduled_running_reqs and
#: not prefill_scheduled) schedule its 1 token
PAD_AFTER_HIT = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                            "engine": {"num_gpu_blocks": 16,
                                       "speculative": {"method": "ngram", "num_tokens": 2}}},
                 "requests": [{"id": "a", "prompt": [[7, 32]], "decode": 1},
                              {"id": "b", "prompt": [[7, 32], [8, 1]], "arrival": 5,
                               "decode": 3}]}


@pytest.mark.parametrize("version", ALL)
def test_model_pads_a_waiting_decode_as_the_release_does(version):
    """The sched and store lines are those of the release's real run."""
    profile = profile_for_release(version)
    res = run_case(Case.from_json(PAD_AFTER_PREFILL), profile)
    assert scheds(res.trace) == ["sched r0 64", "sched r1 1"]
    chunks = "g0:0=1 g0:1=2 g0:2=3" + ("" if version == "0.25.1" else " g0:3=4")
    assert stores(res.trace) == [f"store 0 r0 {chunks}"]
    res = run_case(Case.from_json(PAD_AFTER_HIT), profile)
    first = 3 if version >= "0.30.0" else 1
    assert scheds(res.trace) == ["sched a 32", f"sched b {first}", "sched b 3"]


@pytest.mark.parametrize("version", ALL)
def test_spec_padding_agrees(pool, version):
    for case in (PAD_AFTER_PREFILL, PAD_AFTER_HIT):
        res = lockstep(Case.from_json(case), version, pool)
        assert res.agree, res.summary()
    first = 3 if version >= "0.30.0" else 1
    assert scheds(res.real["trace"]) == ["sched a 32", f"sched b {first}", "sched b 3"]


# --- gap-trace_alloc-bb3dc7: a one-token sliding window caches no block ----------------------

#: SlidingWindowManager.reachable_block_mask: a hit needs cdiv(window - 1, block_size) = 0
#: blocks of a one-token window, so cache_full_blocks hashes none of them; at r0's first decode
#: its four window blocks are freed unhashed, to the front of the free queue (8, 7, 6, 5): the
#: new blocks are 8 and 7, not 9 and 10 (every release's real run)
WINDOW_ONE = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                    {"kind": "sliding_window", "block_size": 16,
                                     "sliding_window": 1}]},
              "requests": [{"id": "r0", "prompt": [[0, 64]], "decode": 4}]}


def allocs(trace: list[str]) -> list[str]:
    return [x for x in trace if x.startswith("alloc ") and x != "alloc r0 g0=- g1=-"]


@pytest.mark.parametrize("version", ALL)
def test_model_frees_one_token_window_blocks_unhashed(version):
    res = run_case(Case.from_json(WINDOW_ONE), profile_for_release(version))
    assert allocs(res.trace) == ["alloc r0 g0=1,2,3,4 g1=5,6,7,8", "alloc r0 g0=8 g1=7"]


@pytest.mark.parametrize("version", ["0.25.1", "0.29.0", "0.30.0", "0.33.0"])
def test_one_token_window_agrees(pool, version):
    res = lockstep(Case.from_json(WINDOW_ONE), version, pool)
    assert res.agree, res.summary()
    assert allocs(res.real["trace"]) == ["alloc r0 g0=1,2,3,4 g1=5,6,7,8", "alloc r0 g0=8 g1=7"]


# --- gap-trace_preempt-095f6e: lookahead slots capped at max_model_len ----------------------

#: 1-token blocks, EAGLE with 3 drafts (a drafter group): r1's decode schedules 1 + 3 tokens at
#: 128; allocate_slots needs min(132 + 3 lookahead, max_model_len 133) slots, 2 new blocks per
#: group, which the 6 free blocks hold: no preemption (the model asked for 4 per group)
LOOKAHEAD_CAP = {"layout": {"groups": [{"kind": "full", "block_size": 1},
                                       {"kind": "full", "block_size": 1, "drafter": True}],
                            "engine": {"speculative": {"method": "eagle", "num_tokens": 3},
                                       "num_gpu_blocks": 269}},
                 "requests": [{"id": "r0", "prompt": [[0, 64]]},
                              {"id": "r1", "prompt": [[0, 128]], "decode": 2}],
                 "asserts": False}


@pytest.mark.parametrize("version", ["0.26.0", "0.30.0", "0.33.0"])
def test_model_caps_lookahead_slots_at_max_model_len(version):
    res = run_case(Case.from_json(LOOKAHEAD_CAP), profile_for_release(version))
    assert not any(x.startswith("preempt ") for x in res.trace)
    assert "alloc r1 g0=265,266 g1=267,268" in res.trace


@pytest.mark.parametrize("version", ["0.26.0", "0.30.0", "0.33.0"])
def test_lookahead_cap_agrees(pool, version):
    res = lockstep(Case.from_json(LOOKAHEAD_CAP), version, pool)
    assert res.agree, res.summary()
    assert "alloc r1 g0=265,266 g1=267,268" in res.real["trace"]


# --- gap-trace_sched-91bff9 / gap-trace_store-4d4914: prefix_cache_retention_interval 0 ------

RETENTION = ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]
#: ``engine.retention_interval`` left out: the release's default, as an engine started without
#: --prefix-cache-retention-interval has it (0 here; None, below, is the flag's None: dense)
UNSET = "unset"


def with_retention(case: dict, retention: int | None | str) -> dict:
    engine = {**case["layout"].get("engine", {})}
    if retention != UNSET:       # None: the flag's None, "dense" in the case format
        engine["retention_interval"] = "dense" if retention is None else retention
    return {**case, "layout": {**case["layout"], "engine": engine}}


#: r1 (r0's 64 tokens + 64) is admitted in r0's step, after r0's blocks are cached. Under
#: retention 0 SlidingWindowManager.reachable_block_mask keeps only the need = cdiv(128 - 1, 16)
#: = 8 blocks ending at r0's replay boundary, num_prompt - 1 = 63 aligned down to 48: blocks 0-2;
#: block 3 is never hashed, so r1 hits 48 tokens and takes a block of its own (5) for its fourth.
#: Dense (None) or a 64-token interval (a tail of 8 >= the 4 blocks of a segment: every block)
#: cache all four: r1 hits 64
SW_SIBLING = {"layout": {"groups": [{"kind": "sliding_window", "block_size": 16,
                                     "sliding_window": 128}]},
              "requests": [{"id": "r0", "prompt": [[0, 64]]}, {"id": "r1", "prompt": [[0, 128]]}]}

#: one 64-token prompt, a lone align-mode Mamba group: MambaManager.reachable_block_mask keeps,
#: under retention 0, only the state at the aligned replay boundary (63 -> 48, block 2); the state
#: at 64 (block 3) is never hashed, so never offered to the connector
#: (take_boundary_state_offloads): no store. 0.29.0-0.31.0 compute the prompt in one chunk (no
#: state at 48 exists); 0.32.0+ cut it at the prefill checkpoint, 48, whose state is stored
MAMBA_LONE = {"layout": {"groups": [{"kind": "mamba", "block_size": 16,
                                    "mamba_cache_mode": "align"}]},
              "requests": [{"id": "r0", "prompt": [[0, 64]]}]}

#: a hybrid model (full attention and an align-mode Mamba group) with EAGLE: left out, 0.29.0's
#: EngineArgs.create_engine_config makes the interval None (dense), so a's Mamba state at 64 is
#: cached and stored (store 2 a g1:3=7) as under an explicit None; 0.30.0+ keep CacheConfig's 0
#: (only the replay-boundary state at 48)
HYBRID_EAGLE = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                      {"kind": "mamba", "block_size": 16,
                                       "mamba_cache_mode": "align"}],
                           "engine": {"speculative": {"method": "eagle", "num_tokens": 1}}},
                "requests": [{"id": "a", "prompt": [[0, 64]], "decode": 2},
                             {"id": "b", "prompt": [[0, 64], [1, 40]], "arrival": 4,
                              "decode": 2}]}
#: a's state at 64 tokens, stored when every state is kept (the real runs of 0.29.0, 0.30.0 and
#: 0.33.0): block 6, which a's first allocation took as its speculative state block (EAGLE's one
#: draft: MambaSpec.num_speculative_blocks 1, g1=0,0,5,6) and the next one made the running state
DENSE_STATE_STORE = "store 2 a g1:3=6"


def allocs_of(trace: list[str], rid: str) -> list[str]:
    return [x for x in trace if x.startswith(f"alloc {rid} ")]


def sparse(retention) -> bool:
    """Whether the engine keeps only the reachable boundaries (0), as it does with the flag
    left out on these layouts (no hybrid model with EAGLE)."""
    return retention == 0 or retention == UNSET


@pytest.mark.parametrize("version", RETENTION)
@pytest.mark.parametrize("retention", [UNSET, None, 0, 64])
def test_model_caches_sliding_window_blocks_as_retention_keeps(version, retention):
    """The sched and alloc lines are those of each release's real run."""
    res = run_case(Case.from_json(with_retention(SW_SIBLING, retention)),
                   profile_for_release(version))
    hit = 48 if sparse(retention) else 64
    assert scheds(res.trace) == ["sched r0 64", f"sched r1 {128 - hit}"]
    assert allocs_of(res.trace, "r1") == (["alloc r1 g0=1,2,3,5,6,7,8,9"] if hit == 48
                                          else ["alloc r1 g0=1,2,3,4,5,6,7,8"])


@pytest.mark.parametrize("version", RETENTION)
@pytest.mark.parametrize("retention", [UNSET, None, 0, 64])
def test_model_offers_mamba_states_as_retention_keeps(version, retention):
    """The store lines are those of each release's real run."""
    res = run_case(Case.from_json(with_retention(MAMBA_LONE, retention)),
                   profile_for_release(version))
    checkpoint = version >= "0.32.0"
    want = ["store 0 r0 g0:2=1"] if checkpoint else []
    if not sparse(retention):
        want += ["store 1 r0 g0:3=2"] if checkpoint else ["store 0 r0 g0:3=1"]
    assert stores(res.trace) == want


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0", "0.33.0"])
@pytest.mark.parametrize("retention", [UNSET, None, 0])
def test_model_stores_hybrid_eagle_states_as_retention_keeps(version, retention):
    """0.29.0's real run stores the dense state with the flag left out, 0.30.0's does not."""
    res = run_case(Case.from_json(with_retention(HYBRID_EAGLE, retention)),
                   profile_for_release(version))
    dense = retention is None or (retention == UNSET and version == "0.29.0")
    assert (DENSE_STATE_STORE in res.trace) == dense


@pytest.mark.parametrize("version", RETENTION)
@pytest.mark.parametrize("retention", [UNSET, None, 0, 64])
def test_retention_agrees(pool, version, retention):
    sw = lockstep(Case.from_json(with_retention(SW_SIBLING, retention)), version, pool)
    assert sw.agree, sw.summary()
    mamba = lockstep(Case.from_json(with_retention(MAMBA_LONE, retention)), version, pool)
    assert mamba.agree, mamba.summary()
    if sparse(retention):
        # the real lines the model-only tests above expect: a case without the knob runs as a
        # deployment without the flag, retention 0 on both sides
        assert scheds(sw.real["trace"]) == ["sched r0 64", "sched r1 80"]
        assert allocs_of(sw.real["trace"], "r1") == ["alloc r1 g0=1,2,3,5,6,7,8,9"]
        assert stores(mamba.real["trace"]) == (["store 0 r0 g0:2=1"] if version >= "0.32.0"
                                                else [])
    if retention is None:
        assert allocs_of(sw.real["trace"], "r1") == ["alloc r1 g0=1,2,3,4,5,6,7,8"]


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0", "0.33.0"])
@pytest.mark.parametrize("retention", [UNSET, None])
def test_hybrid_eagle_retention_default_agrees(pool, version, retention):
    res = lockstep(Case.from_json(with_retention(HYBRID_EAGLE, retention)), version, pool)
    assert res.agree, res.summary()
    dense = retention is None or version == "0.29.0"
    assert (DENSE_STATE_STORE in res.real["trace"]) == dense


#: EAGLE (one draft) beside full attention, window 32: c resends a's 256-token prompt after b
#: (a's prompt + 40) finished. Under retention 0, 0.29.0 keeps the need = cdiv(31, 16) + 1 = 3
#: blocks ending at the peek block past 255 -> 240 (blocks 13-15); a hit at 224 needs blocks
#: 12-14 (find_longest_cache_hit counts the peek block, then pops it): no GPU hit, c loads its
#: 15 chunks from the CPU tier. 0.30.0+ also keep the tails of the replay pair (224 and 240,
#: get_replay_boundaries): c hits 14 blocks or more on the GPU
EAGLE_RESEND = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                      {"kind": "sliding_window", "block_size": 16,
                                       "sliding_window": 32}],
                           "engine": {"retention_interval": 0,
                                      "speculative": {"method": "eagle", "num_tokens": 1}}},
                "requests": [{"id": "a", "prompt": [[3, 256]], "decode": 2},
                             {"id": "b", "prompt": [[3, 256], [4, 40]], "arrival": 4,
                              "decode": 2},
                             {"id": "c", "prompt": [[3, 256]], "arrival": 8}]}

GPU_HIT_14 = "alloc c g0=" + ",".join(str(b) for b in range(1, 15)) + ","


def test_model_misses_the_eagle_window_hit_on_0290():
    """0.29.0's real run loads all 15 of c's chunks: no GPU hit."""
    res = run_case(Case.from_json(EAGLE_RESEND), profile_for_release("0.29.0"))
    loads = [x for x in res.trace if x.startswith("load ") and " c " in x]
    assert [x.split(" g1:")[0] for x in loads] == [
        "load 2 c g0:0=25 g0:1=29 g0:2=28 g0:3=24 g0:4=23 g0:5=22 g0:6=21 g0:7=20 g0:8=19 "
        "g0:9=18 g0:10=35 g0:11=36 g0:12=37 g0:13=38 g0:14=39"]


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0", "0.33.0"])
def test_eagle_window_hit_under_retention_agrees(pool, version):
    res = lockstep(Case.from_json(EAGLE_RESEND), version, pool)
    assert res.agree, res.summary()
    alloc = allocs_of(res.real["trace"], "c")
    assert alloc[0].startswith(GPU_HIT_14) != (version == "0.29.0"), alloc
# --- gap-trace_load-a2f0ca, gap-trace_alloc-bb3dc7: several groups cache up to the scheduler
# --- block boundary -------------------------------------------------------------------------

#: full/16 + full/3, scheduler block lcm = 48: HybridKVCacheCoordinator.cache_blocks caches r0's
#: 64 tokens only up to 48 (_align_cacheable, 0.28.0+; the rounding in cache_blocks before), so
#: g0's block 4 and g1's blocks 21-26 are freed unhashed, to the front of the free queue (26, 25,
#: ..., 21, 4): r1's CPU load (48 to 63) lands in 26 and 25-21, its last g1 block is 4
ALIGN_LOAD = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                    {"kind": "full", "block_size": 3}]},
              "requests": [{"id": "r0", "prompt": [[0, 64]]}, {"id": "r1", "prompt": [[0, 64]]}],
              "timing": {"max_num_seqs": 1}}
ALIGN_LOAD_LINES = ["load 1 r1 g0:63=26 g1:50=25 g1:53=24 g1:56=23 g1:59=22 g1:62=21",
                    "alloc r1 g0=1,2,3,26 g1=5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,"
                    "25,24,23,22,21,4"]

#: three full/16 groups and a full/128 one (scheduler block 128), 18 usable blocks: a 64-token
#: prompt caches nothing, every block of r0 is freed unhashed, each group's blocks prepended in
#: turn (13, 12, ..., 1): r1 takes them from 13 down
ALIGN_ALLOC = {"layout": {"groups": [{"kind": "full", "block_size": 16}] * 3
                                    + [{"kind": "full", "block_size": 128}],
                          "engine": {"num_gpu_blocks": 19}},
               "requests": [{"id": "r0", "prompt": [[0, 64]]}, {"id": "r1", "prompt": [[0, 64]]}]}
ALIGN_ALLOC_LINE = "alloc r1 g0=13,12,11,10 g1=9,8,7,6 g2=5,4,3,2 g3=1"

#: EAGLE with a drafter group full/16 beside a target full/16 (the same spec, one SpecGroup:
#: verify_and_split_kv_cache_groups marks both use_eagle) and a full/32: of r0's 56 tokens the
#: aligned 32 are cached, the EAGLE groups' one block past it too (get_num_cacheable_tokens:
#: min(56, 32 + 16)), so only block 4 of g0 and g1 and block 10 of g2 are freed unhashed
ALIGN_EAGLE = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                     {"kind": "full", "block_size": 16, "drafter": True},
                                     {"kind": "full", "block_size": 32}],
                          "engine": {"speculative": {"method": "eagle", "num_tokens": 1}}},
               "requests": [{"id": "r0", "prompt": [[0, 56]]},
                            {"id": "r1", "prompt": [[1, 56]], "arrival": 2}]}
ALIGN_EAGLE_LINE = "alloc r1 g0=10,8,4,11 g1=12,13,14,15 g2=16,17"

#: a one-token window beside a drafter group of another spec is no EAGLE group: it hashes none
#: of its blocks (reachable_block_mask, need = 0 without the EAGLE block); freed out of the
#: window to the front, they are r0's next blocks
WINDOW_ONE_DRAFTER = {"layout": {"groups": [
    {"kind": "full", "block_size": 16},
    {"kind": "sliding_window", "block_size": 16, "sliding_window": 1},
    {"kind": "full", "block_size": 16, "drafter": True}],
    "engine": {"speculative": {"method": "eagle", "num_tokens": 1}}},
    "requests": [{"id": "r0", "prompt": [[0, 64]], "decode": 20}]}
WINDOW_ONE_DRAFTER_LINE = "alloc r0 g0=9 g1=8 g2=7"


def loads_allocs(trace: list[str], rid: str) -> list[str]:
    return [x for x in trace if x.startswith((f"load 1 {rid} ", f"alloc {rid} "))]


@pytest.mark.parametrize("version", ALL)
def test_model_caches_several_groups_up_to_the_scheduler_block(version):
    """The load and alloc lines are those of the release's real run."""
    profile = profile_for_release(version)
    res = run_case(Case.from_json(ALIGN_LOAD), profile)
    assert loads_allocs(res.trace, "r1") == ALIGN_LOAD_LINES
    res = run_case(Case.from_json(ALIGN_ALLOC), profile)
    assert ALIGN_ALLOC_LINE in res.trace
    assert ALIGN_EAGLE_LINE in run_case(Case.from_json(ALIGN_EAGLE), profile).trace
    assert WINDOW_ONE_DRAFTER_LINE in run_case(Case.from_json(WINDOW_ONE_DRAFTER), profile).trace


@pytest.mark.parametrize("version", ["0.25.1", "0.27.1", "0.29.0", "0.33.0"])
def test_scheduler_block_caching_agrees(pool, version):
    res = lockstep(Case.from_json(ALIGN_LOAD), version, pool)
    assert res.agree, res.summary()
    assert loads_allocs(res.real["trace"], "r1") == ALIGN_LOAD_LINES
    res = lockstep(Case.from_json(ALIGN_ALLOC), version, pool)
    assert res.agree, res.summary()
    assert ALIGN_ALLOC_LINE in res.real["trace"]
    for case, line in ((ALIGN_EAGLE, ALIGN_EAGLE_LINE),
                       (WINDOW_ONE_DRAFTER, WINDOW_ONE_DRAFTER_LINE)):
        res = lockstep(Case.from_json(case), version, pool)
        assert res.agree, res.summary()
        assert line in res.real["trace"]


# --- gap-trace_store-4d4914 (0.33.0): a chunk with a reachable null block is not stored ------

#: mla/64 + mla/256 + sliding_window_mla/64 (w=128), chunks of 4 blocks, 64-token prefill chunks:
#: by the last chunk the window's first block is out of reach (null), so its first offload chunk
#: has a null block. 0.33.0's _build_store_jobs skips a chunk with a reachable null block ("A
#: reachable null block would leave part of the chunk unwritten"); up to 0.32.0 only a null last
#: block skips it, and the chunk is stored without the null block
NULL_IN_CHUNK = {"layout": {"groups": [{"kind": "mla", "block_size": 64},
                                       {"kind": "mla", "block_size": 256},
                                       {"kind": "sliding_window_mla", "block_size": 64,
                                        "sliding_window": 128}],
                            "engine": {"blocks_per_chunk": 4}},
                 "requests": [{"id": "r0", "prompt": [[0, 256]]}],
                 "timing": {"max_num_batched_tokens": 64}}


def null_chunk_store(version: str) -> list[str]:
    tail = "" if version == "0.33.0" else " g2:3=5,7,8"
    return [f"store 0 r0 g0:3=1,4,6,3{tail}"]


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0", "0.33.0"])
def test_model_skips_a_chunk_with_a_null_block_on_0330(version):
    res = run_case(Case.from_json(NULL_IN_CHUNK), profile_for_release(version))
    assert stores(res.trace) == null_chunk_store(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_null_block_chunk_store_agrees(pool, version):
    res = lockstep(Case.from_json(NULL_IN_CHUNK), version, pool)
    assert res.agree, res.summary()
    assert stores(res.real["trace"]) == null_chunk_store(version)
# --- gap-trace_preempt-095f6e (20-minute campaign): async preemption of a request in flight --

#: async scheduling, 4-token blocks, a pool of 295 that r0 (356 + 16 tokens) and r1 (128) fill.
#: At step 10 r0's decode needs a block, none is free, and r1's last step is still in flight.
#: 0.26.0-0.29.0's preemption loop (Scheduler.schedule) has no _request_blocks_can_be_freed
#: check: r1 is preempted, its blocks deferred (_free_request_blocks), so r0 is preempted too;
#: both batches' tokens still arrive (r1 stops), and r0 resumes at step 11 with a prefix hit of
#: 356 tokens and 5 to compute. 0.30.0+ stop at the in-flight victim: nothing is preempted.
#: 0.25.1 (no num_in_flight_tokens) frees r0's window blocks on its computed tokens, in-flight
#: ones included: r1 is admitted one step earlier (step 6) and no pool runs dry. Its in-flight
#: preemptions show on lockstep's generated case 20 (sliding window, async): r2, r3, r5 and r6
#: preempted in one step.
PREEMPT_IN_FLIGHT = {"layout": {"groups": [{"kind": "full", "block_size": 4},
                                           {"kind": "full", "block_size": 4},
                                           {"kind": "sliding_window", "block_size": 4,
                                            "sliding_window": 64}],
                                "engine": {"async_scheduling": True, "num_gpu_blocks": 295}},
                     "requests": [{"id": "r0", "prompt": [[0, 256], [100, 100]], "decode": 16},
                                  {"id": "r1", "prompt": [[1, 128]]}],
                     "timing": {"max_num_batched_tokens": 64}}


def preempts_and_resume(trace: list[str]) -> tuple[list[str], list[str]]:
    """The preempt lines (sorted: the release side lists them by request ID) and the sched
    lines of r0 after them."""
    first = next((i for i, x in enumerate(trace) if x.startswith("preempt ")), len(trace))
    preempts = sorted(x for x in trace if x.startswith("preempt "))
    return preempts, [x for x in trace[first:] if x.startswith("sched r0 ")][:2]


@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0",
                                     "0.33.0"])
def test_model_preempts_a_request_in_flight_before_0300(version):
    """The preempt lines and r0's resume are those of the release's real run."""
    res = run_case(Case.from_json(PREEMPT_IN_FLIGHT), profile_for_release(version))
    if "0.26.0" <= version < "0.30.0":
        assert preempts_and_resume(res.trace) == (["preempt r0", "preempt r1"],
                                                  ["sched r0 5", "sched r0 1"])
    else:
        assert preempts_and_resume(res.trace) == ([], [])
    assert "finish r1 finished" in res.trace and "finish r0 finished" in res.trace


@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.29.0", "0.30.0"])
def test_preempt_in_flight_agrees(pool, version):
    res = lockstep(Case.from_json(PREEMPT_IN_FLIGHT), version, pool)
    assert res.agree, res.summary()
    want = ["preempt r0", "preempt r1"] if "0.26.0" <= version < "0.30.0" else []
    assert preempts_and_resume(res.real["trace"])[0] == want


def test_model_preempts_in_flight_on_0251():
    case = generate_case(20, "full16+sw16w128+full16", async_scheduling=True)
    res = run_case(case, profile_for_release("0.25.1"))
    assert preempts_and_resume(res.trace)[0] == ["preempt r2", "preempt r3", "preempt r5",
                                                 "preempt r6"]


def test_preempt_in_flight_agrees_on_0251(pool):
    res = lockstep(generate_case(20, "full16+sw16w128+full16", async_scheduling=True),
                   "0.25.1", pool)
    assert res.agree, res.summary()
    assert preempts_and_resume(res.real["trace"])[0] == ["preempt r2", "preempt r3",
                                                         "preempt r5", "preempt r6"]


# --- INV-8-liveness-full+mamba-c78a6e: an align-mode block wider than the budget -------------

#: a 96-token Mamba block in align mode and a budget of 64: no prefill chunk reaches a block
#: boundary. Up to 0.26.0 VllmConfig.validate_block_size (EngineCore._initialize_kv_caches)
#: asserts block_size <= max_num_batched_tokens: the engine refuses to start; under python -O
#: the assert is gone and _mamba_block_aligned_split cuts every chunk to 0 tokens (r0 never
#: runs). 0.27.0 drops the assert and advances such a block sub-block (64 + 32 to the boundary
#: at 96, then 32).
WIDE_ALIGN_BLOCK = {"layout": {"groups": [{"kind": "full", "block_size": 96},
                                          {"kind": "mamba", "block_size": 96,
                                           "mamba_cache_mode": "align"}]},
                    "requests": [{"id": "r0", "prompt": [[0, 128]]}],
                    "timing": {"max_num_batched_tokens": 64}}
WIDE_ALIGN_REFUSAL = ("In Mamba cache align mode, block_size (96) must be <= "
                      "max_num_batched_tokens (64).")


@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.27.0", "0.33.0"])
def test_model_applies_the_align_block_size_check(version):
    res = run_case(Case.from_json(WIDE_ALIGN_BLOCK), profile_for_release(version))
    if version < "0.27.0":
        assert res.refused == WIDE_ALIGN_REFUSAL and not res.findings
        stripped = run_case(Case.from_json(dict(WIDE_ALIGN_BLOCK, asserts=False)),
                            profile_for_release(version))
        assert stripped.refused is None
        assert [f["inv_id"] for f in stripped.findings] == ["INV-8"]
        assert scheds(stripped.trace) == []
    else:
        assert res.refused is None and not res.findings
        assert scheds(res.trace) == ["sched r0 64", "sched r0 32", "sched r0 32"]


@pytest.mark.parametrize("version", ["0.26.0", "0.27.0"])
def test_align_block_size_check_agrees(pool, version):
    res = lockstep(Case.from_json(WIDE_ALIGN_BLOCK), version, pool)
    assert not res.observations, res.summary()
    if version == "0.26.0":
        assert res.real["status"] == "refused" and res.real["reason"] == WIDE_ALIGN_REFUSAL
        stripped = lockstep(Case.from_json(dict(WIDE_ALIGN_BLOCK, asserts=False)), version, pool)
        assert stripped.agree, stripped.summary()
        assert [f["inv_id"] for f in stripped.real["findings"]] == ["INV-8"]
    else:
        assert res.agree, res.summary()
        assert scheds(res.real["trace"]) == ["sched r0 64", "sched r0 32", "sched r0 32"]


# --- AssertionError-_build_store_jobs-3e6630: aborting a request that waits with no block ----

#: max_num_seqs 1: r1 waits behind r0, its lookup deferred while r0's store is in flight; it
#: is aborted before step 2 (Scheduler.finish_requests, the engine core's abort_requests).
#: 0.26.0's request_finished keys its whole prompt (update_offload_keys) and keeps its state;
#: _build_store_jobs then walks it in finished_req_ids with four keys and no block:
#: assert len(offload_keys) == len(offload_block_ids). 0.25.1 drops the state of a request
#: without jobs; 0.27.0's RequestOffloadState.storable_chunks counts allocated chunks only.
#: A vLLM-alone repro (also a request aborted mid-prefill):
#: docs/repro/abort_unallocated_chunks_store_assert.py
ABORT_WAITING = {"layout": {"groups": [{"kind": "full", "block_size": 16}]},
                 "requests": [{"id": "r0", "prompt": [[0, 64]]},
                              {"id": "r1", "prompt": [[0, 64]], "abort_at": 2}],
                 "timing": {"store_latency": 2, "max_num_seqs": 1}}


@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.27.0"])
def test_abort_of_a_waiting_request_crashes_0260_only(pool, version):
    res = lockstep(Case.from_json(ABORT_WAITING), version, pool)
    crashes = [(f["exception"], f["function"]) for f in res.real["findings"]
               if f["kind"] == "crash"]
    if version == "0.26.0":
        assert crashes == [("AssertionError", "_build_store_jobs")], res.summary()
        assert "finish r1 aborted" in res.real["trace"]
    else:
        assert res.agree and crashes == [], res.summary()


# --- gap-trace_alloc-bb3dc7 / gap-trace_load-a2f0ca of campaign c20e: a one-token window ------

#: full/16 beside a one-token sliding window: r0's window blocks are never cached (their mask
#: is all False), and SlidingWindowManager.find_longest_cache_hit matches only on a cached
#: block, so r1 gets no GPU hit at all (0.25.1-0.29.0 load it from the CPU tier instead)
ONE_TOKEN_WINDOW = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                          {"kind": "sliding_window", "block_size": 16,
                                           "sliding_window": 1}]},
                    "requests": [{"id": "r0", "prompt": [[0, 64]]},
                                 {"id": "r1", "prompt": [[0, 128]]}],
                    "timing": {"max_num_batched_tokens": 64}}


@pytest.mark.parametrize("version", ["0.29.0", "0.33.0"])
def test_model_gives_a_one_token_window_no_gpu_hit(version):
    """The lines 0.29.0's and 0.33.0's real Scheduler emit for r1."""
    res = run_case(Case.from_json(ONE_TOKEN_WINDOW), profile_for_release(version))
    r1 = [x for x in res.trace if x.startswith(("alloc r1", "load 1 r1"))]
    if version == "0.29.0":
        assert r1[0] == "load 1 r1 g0:0=8 g0:1=7 g0:2=6 g0:3=5"
    else:
        assert r1[0] == "alloc r1 g0=8,7,6,5 g1=9,10,11,12"


@pytest.mark.parametrize("version", ["0.25.1", "0.29.0", "0.33.0"])
def test_one_token_window_hit_agrees(pool, version):
    res = lockstep(Case.from_json(ONE_TOKEN_WINDOW), version, pool)
    assert res.agree, res.summary()


#: gap-model_predicts_invariant_INV-8-a6b5d7 of campaign c20e: a lone align-mode Mamba group of
#: 1152 tokens, asserts stripped, a 128-token prompt and a budget of 64. 0.25.1-0.26.0 align a
#: chunk's end only below the last cacheable position (here 0: the prompt fills no block), so
#: the prompt runs in two chunks of 64 and does not stall
LONE_WIDE_MAMBA = {"layout": {"groups": [{"kind": "mamba", "block_size": 1152,
                                          "mamba_cache_mode": "align"}]},
                   "requests": [{"id": "r0", "prompt": [[0, 128]]}],
                   "timing": {"max_num_batched_tokens": 64}, "asserts": False}


@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.27.0"])
def test_model_splits_a_prompt_shorter_than_the_mamba_block(version):
    res = run_case(Case.from_json(LONE_WIDE_MAMBA), profile_for_release(version))
    assert scheds(res.trace) == ["sched r0 64", "sched r0 64"], res.trace


@pytest.mark.parametrize("version", ["0.26.0", "0.27.0"])
def test_prompt_shorter_than_the_mamba_block_agrees(pool, version):
    res = lockstep(Case.from_json(LONE_WIDE_MAMBA), version, pool)
    assert res.agree, res.summary()
    assert scheds(res.real["trace"]) == ["sched r0 64", "sched r0 64"]


# --- gap-trace_store-4d4914 of campaign c20e: fine-grained hash hits under DCP ---------------

#: full/16 + align-mode Mamba/16 under DCP 2: from 0.30.0 the hybrid coordinator enables partial
#: hash hits (partial_hash_hits_enabled: a Mamba block at least the hash unit under DCP), so it
#: caches every computed token, unrounded: the Mamba state at 48 is cached and offered to the
#: connector (0.32.0+ store it); 0.28.0 turns partial hits off under DCP (0.29.0 has 0.30.0's
#: rule: kv_cache_coordinator.py 0.29.0:627-641)
DCP_MAMBA = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                   {"kind": "mamba", "block_size": 16,
                                    "mamba_cache_mode": "align"}],
                        "engine": {"dcp_size": 2}},
             "requests": [{"id": "r0", "prompt": [[0, 64]]}]}


def test_partial_hash_hits_by_release():
    from simsched.geometry import partial_hash_hits
    from simsched.layout import Layout
    dcp = Layout.from_json(DCP_MAMBA["layout"])
    unit = Layout.from_json({"groups": DCP_MAMBA["layout"]["groups"],
                             "engine": {"prefix_match_unit": 4}})
    window = Layout.from_json({"groups": DCP_MAMBA["layout"]["groups"] + [
        {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}],
        "engine": {"prefix_match_unit": 4}})
    got = {v: (partial_hash_hits(dcp, profile_for_release(v), 16),
               partial_hash_hits(unit, profile_for_release(v), 4),
               partial_hash_hits(window, profile_for_release(v), 4))
           for v in ("0.25.1", "0.27.0", "0.29.0", "0.33.0")}
    # kv_cache_coordinator.py of each release: none in 0.25.1; no DCP and any other group up to
    # 0.27.1; from 0.28.0 a sliding-window group of blocks wider than the unit turns them off
    assert got == {"0.25.1": (False, False, False), "0.27.0": (False, True, True),
                   "0.29.0": (True, True, False), "0.33.0": (True, True, False)}


@pytest.mark.parametrize("version", ["0.29.0", "0.33.0"])
def test_dcp_mamba_state_cached_unrounded_agrees(pool, version):
    res = lockstep(Case.from_json(DCP_MAMBA), version, pool)
    assert res.agree, res.summary()
    if version == "0.33.0":
        assert stores(res.real["trace"])[0] == "store 0 r0 g1:2=3"
# --- gap-trace_load (full/5 + full/16[drafter]) and gap-trace_sched (full/4 + full/16[drafter]) -
# EAGLE with a drafter group of another block size: only the EAGLE groups (the drafter's spec,
# verify_and_split_kv_cache_groups' use_eagle) match past the candidate hit and drop a block of
# their own size (HybridKVCacheCoordinator.find_longest_cache_hit, FullAttentionManager.
# find_longest_cache_hit(drop_eagle_block)); the target group neither matches past nor drops.
# The margin is capped at max_cache_hit_length (num_tokens - 1) up to 0.31.0, by the keys of
# known tokens (len(block_hashes) * hash_block_size) from 0.32.0.

#: full/5 + full/16[drafter] (scheduler block 80), a 100-token prompt repeated: g0 (no EAGLE group)
#: hits 99 // 5 = 19 blocks of the 16 cached, 80; g1 matches its 6 cached blocks (96, the EAGLE
#: block past 80) and drops one: 80, on every release (a model dropping a block of the smallest
#: size from every group finds 75, aligned 0)
DRAFTER_HIT = {"layout": {"groups": [{"kind": "full", "block_size": 5},
                                     {"kind": "full", "block_size": 16, "drafter": True}],
                          "engine": {"speculative": {"method": "eagle", "num_tokens": 1}}},
               "requests": [{"id": "a", "prompt": [[7, 100]], "decode": 1},
                            {"id": "b", "prompt": [[7, 100]], "arrival": 3, "decode": 1}]}
DRAFTER_HIT_LINES = ["sched b 20", "alloc b g0=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,28,21,20,19,"
                     "18 g1=22,23,24,25,26,17,29"]

#: the same layout, a (176 tokens) caches 160 in g0 and, the EAGLE
#: block past it, 176 in g1. b repeats the prompt: g0 hits 160; g1 matches 175 // 16 = 10 blocks up
#: to 0.31.0 (the cap), drops one: 144, aligned 80 (the CPU tier loads 80 more); 0.32.0+ match 11
#: blocks, drop one: 160
DRAFTER_OTHER_SIZE = {"layout": {"groups": [{"kind": "full", "block_size": 5},
                                            {"kind": "full", "block_size": 16, "drafter": True}],
                                 "engine": {"speculative": {"method": "eagle", "num_tokens": 1}}},
                      "requests": [{"id": "a", "prompt": [[7, 176]], "decode": 1},
                                   {"id": "b", "prompt": [[7, 176]], "arrival": 3, "decode": 1}]}

#: full/4 + full/16[drafter] (scheduler block 16), two 32-token requests at step 0: b hits a's
#: blocks cached in the same step. g0 hits 31 // 4 = 7 blocks, aligned 16; g1 matches 31 // 16 = 1
#: block up to 0.31.0 and drops it: no hit; 0.32.0+ match min(16 + 16, 32) // 16 = 2, drop one: 16
DRAFTER_SAME_STEP = {"layout": {"groups": [{"kind": "full", "block_size": 4},
                                           {"kind": "full", "block_size": 16, "drafter": True}],
                                "engine": {"speculative": {"method": "eagle", "num_tokens": 1}}},
                     "requests": [{"id": "a", "prompt": [[7, 32]], "decode": 3},
                                  {"id": "b", "prompt": [[7, 32]], "decode": 3}]}


def b_hit_lines(trace: list[str]) -> list[str]:
    return [x for x in trace if x.startswith(("load 1 b ", "sched b ", "alloc b "))][:3]


def drafter_hit_lines(version: str) -> tuple[list[str], list[str]]:
    """b's lines in the real traces of DRAFTER_OTHER_SIZE and DRAFTER_SAME_STEP."""
    if version == "0.25.1":
        other = ["load 1 b g0:84=48 g0:89=36 g0:94=35 g0:99=34 g0:104=33 g0:109=49 g0:114=50 "
                 "g0:119=51 g0:124=52 g0:129=53 g0:134=54 g0:139=55 g0:144=56 g1:95=57 g1:111=58 "
                 "g1:127=59 g1:143=60", "sched b 32",
                 "alloc b g0=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,48,36,35,34,33,49,50,51,52,53,"
                 "54,55,56,61,62,63,64,65,66,67 g1=37,38,39,40,41,57,58,59,60,68,69,70"]
    elif version < "0.32.0":
        other = ["load 1 b g0:84=48 g0:89=36 g0:94=35 g0:99=34 g0:104=33 g0:109=49 g0:114=50 "
                 "g0:119=51 g0:124=52 g0:129=53 g0:134=54 g0:139=55 g0:144=56 g0:149=57 g0:154=58 "
                 "g0:159=59 g1:95=60 g1:111=61 g1:127=62 g1:143=63 g1:159=64", "sched b 16",
                 "alloc b g0=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,48,36,35,34,33,49,50,51,52,53,"
                 "54,55,56,57,58,59,65,66,67,68 g1=37,38,39,40,41,60,61,62,63,64,69,70"]
    else:
        other = ["sched b 16",
                 "alloc b g0=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,"
                 "27,28,29,30,31,32,48,36,35,34 g1=37,38,39,40,41,42,43,44,45,46,33,49"]
    if version < "0.32.0":
        same = ["sched b 32", "alloc b g0=13,14,15,16,17,18,19,20,21 g1=22,23,24", "sched b 2"]
    else:
        same = ["sched b 16", "alloc b g0=1,2,3,4,13,14,15,16,17 g1=10,18,19", "sched b 2"]
    return other, same


@pytest.mark.parametrize("version", ["0.25.1", "0.29.0", "0.32.0", "0.33.0"])
def test_model_drops_eagle_block_in_drafter_groups_only(version):
    """b's load, sched and alloc lines are those of the release's real run."""
    profile = profile_for_release(version)
    other, same = drafter_hit_lines(version)
    assert b_hit_lines(run_case(Case.from_json(DRAFTER_HIT), profile).trace) == DRAFTER_HIT_LINES
    assert b_hit_lines(run_case(Case.from_json(DRAFTER_OTHER_SIZE), profile).trace) == other
    assert b_hit_lines(run_case(Case.from_json(DRAFTER_SAME_STEP), profile).trace) == same


@pytest.mark.parametrize("version", ["0.25.1", "0.29.0", "0.32.0", "0.33.0"])
def test_drafter_group_eagle_hits_agree(pool, version):
    other, same = drafter_hit_lines(version)
    for case, want in ((DRAFTER_HIT, DRAFTER_HIT_LINES), (DRAFTER_OTHER_SIZE, other),
                       (DRAFTER_SAME_STEP, same)):
        res = lockstep(Case.from_json(case), version, pool)
        assert res.agree, res.summary()
        assert b_hit_lines(res.real["trace"]) == want


# --- gap-trace_sched of the 2026-12-02 tenth-session run: the prompt's last hash boundary -------

#: full/16 + align-mode Mamba/16 with prefix_match_unit 4: Scheduler.mamba_partial_cache_hit (a
#: hash unit below the block, fine-grained hits on) adds a stop at the prompt's last hash boundary
#: (``tail_boundary`` in ``_mamba_block_aligned_split``) when it lies past the last cacheable
#: block boundary. Up to 0.31.0 it is num_prompt floored to the unit: 64 for a 64-token prompt (no
#: stop), 60 for 62; from 0.32.0 get_mamba_prefill_checkpoint_position floors num_prompt - 1: 60
#: for both. The first step ends at the last cacheable block boundary: num_tokens floored to the
#: block up to 0.31.0 (64 for 64: one step), num_tokens - 1 floored from 0.32.0 (48).
def _tail_case(prompt: int) -> dict:
    return {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                  {"kind": "mamba", "block_size": 16,
                                   "mamba_cache_mode": "align"}],
                       "engine": {"prefix_match_unit": 4}},
            "requests": [{"id": "r0", "prompt": [[0, prompt]]}]}


TAIL_SCHEDS = {("0.31.0", 64): [64], ("0.31.0", 62): [48, 12, 2],
               ("0.32.0", 64): [48, 12, 4], ("0.33.0", 62): [48, 12, 2]}


@pytest.mark.parametrize("version, prompt", sorted(TAIL_SCHEDS))
def test_model_stops_at_the_prompts_last_hash_boundary(version, prompt):
    res = run_case(Case.from_json(_tail_case(prompt)), profile_for_release(version))
    assert scheds(res.trace) == [f"sched r0 {n}" for n in TAIL_SCHEDS[version, prompt]], \
        res.trace


@pytest.mark.parametrize("version", ["0.26.0", "0.27.1"])
def test_last_hash_boundary_stop_agrees(pool, version):
    res = lockstep(Case.from_json(_tail_case(62)), version, pool)
    assert res.agree, res.summary()
    assert scheds(res.real["trace"]) == ["sched r0 48", "sched r0 12", "sched r0 2"]


@pytest.mark.parametrize("version, prompt", [("0.28.0", 62), ("0.33.0", 64)])
def test_last_hash_boundary_schedule_agrees(pool, version, prompt):
    """From 0.28.0 the step that ends at the boundary also stores the partial tail (the
    connector's ``_build_partial_tail_store_jobs``: the attention block and the Mamba state's
    copy-on-write block under the boundary's key), which the model does not have yet: the
    schedule agrees, the store that follows is a model gap."""
    res = lockstep(Case.from_json(_tail_case(prompt)), version, pool)
    assert scheds(res.model.trace) == scheds(res.real["trace"]), res.summary()
    tail = prompt - 60          # 60: the prompt's last hash boundary for both lengths
    assert scheds(res.real["trace"]) == ["sched r0 48", "sched r0 12", f"sched r0 {tail}"]
