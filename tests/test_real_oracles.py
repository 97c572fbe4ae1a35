"""INV-9 on real runs: the hit a lookup must find, computed from the CPU tier's content alone
(``simsched.invariants.expected_lookup_hit``), each rule by which vLLM loads less tested on its
own; then the oracle and the deferral check on the real releases (FAIL, never skip, when a
release is missing)."""

from __future__ import annotations

import pytest

from simsched import invariants as inv
from simsched.case import Case
from simsched.invariants import HitGroup, expected_lookup_hit, reach_chunks
from simsched.lockstep import HANDMADE, run_real
from simsched.targets import Releases

T, F = True, False


def full(ready, tpc=16):
    return HitGroup(tpc, "full", list(ready))


# --- the oracle, rule by rule (no vLLM) -------------------------------------------------------

def test_hit_is_the_ready_prefix_past_the_gpu_hit():
    assert expected_lookup_hit(0, 84, [full([T] * 5)]) == 80
    assert expected_lookup_hit(0, 84, [full([T, T, F, T, T])]) == 32
    # chunks below the GPU hit are not needed: the GPU holds them
    assert expected_lookup_hit(32, 84, [full([F, F, T, T, F])]) == 32
    assert expected_lookup_hit(0, 84, [full([F] * 5)]) == 0


def test_every_offloaded_group_must_be_ready():
    assert expected_lookup_hit(0, 84, [full([T] * 5), full([T, T, T, F, T])]) == 48


def test_hit_alignment_rule():
    # a coordinator's lookup (SimpleCPU's) ends on its scheduler block: blocks of 12 and 16
    # ready up to 48 tokens hit 48 with an alignment of 48; ready up to 36 and 32, 32 without
    # it and none with it
    groups = [full([T] * 6, tpc=12), full([T] * 4, tpc=16)]
    assert expected_lookup_hit(0, 80, groups, align=48) == 48
    short = [full([T, T, T, F, F, F], tpc=12), full([T, T, F, F], tpc=16)]
    assert expected_lookup_hit(0, 80, short) == 32
    assert expected_lookup_hit(0, 80, short, align=48) == 0


def test_last_token_rule():
    # the last token is always recomputed: a 64-token prompt hits 63 tokens at most (the
    # chunk holding token 62 is loaded; vLLM may load all 64 and recompute the last)
    assert expected_lookup_hit(0, 64, [full([T] * 4)]) == 63
    # a one-chunk prompt: 15 tokens left, less than a chunk
    assert expected_lookup_hit(0, 16, [full([T])]) == 0


def test_less_than_a_chunk_rule():
    assert expected_lookup_hit(48, 84, [full([T] * 5)]) == 32
    assert expected_lookup_hit(64, 84, [full([T] * 5)]) == 16
    # the GPU hit ends inside the last ready chunk: 8 tokens, less than a chunk
    assert expected_lookup_hit(56, 84, [full([T] * 4 + [F])]) == 0
    # the largest chunk of any group decides: 32-token chunks need 32 tokens past the hit
    assert expected_lookup_hit(48, 84, [full([T] * 5), full([T, T], tpc=32)]) == 0


def test_window_reach():
    w = HitGroup(16, "window", [F, T, T, F, F], span=32)
    # at 48 the window [17, 48) lies in chunks 1-2: ready; at 64 it needs chunk 3
    assert reach_chunks(w, 0, 48) == (1, 3)
    assert expected_lookup_hit(0, 84, [full([T] * 5), w]) == 48
    # a hit ending mid-chunk (the last token kept back): [32, 63) covers chunks 2-3
    assert reach_chunks(w, 0, 63) == (2, 4)
    assert expected_lookup_hit(0, 64, [full([T] * 4), HitGroup(16, "window", [F, F, T, T],
                                                                span=32)]) == 63
    # the window's reach starts no lower than the GPU hit
    assert reach_chunks(w, 32, 48) == (2, 3)


def test_a_window_hit_ends_at_a_stored_chunk():
    """A one-token window needs no KV before ``end``, but a hit still ends at a stored chunk
    (nothing stored: no hit), as vLLM's GPU hit ends at a cached block."""
    one = HitGroup(16, "window", [F, F, F, F], span=1)
    assert reach_chunks(one, 0, 63) == (3, 4)
    assert expected_lookup_hit(0, 64, [one]) == 0
    assert expected_lookup_hit(0, 64, [HitGroup(16, "window", [F, F, F, T], span=1)]) == 63


def test_chunked_local_reach():
    local = HitGroup(16, "local", [F, F, F, F, T, F], span=64)
    # at 64 an attention chunk starts: nothing of the local group is needed
    assert reach_chunks(local, 0, 64) == (4, 4)
    # at 80 it needs [64, 80), chunk 4
    assert reach_chunks(local, 0, 80) == (4, 5)
    assert expected_lookup_hit(0, 100, [full([T] * 6), local]) == 80


def test_a_hit_serves_something_stored():
    """Chunked local attention alone at an attention-chunk boundary needs no chunk: nothing
    stored, nothing served, no hit expected (INV-9 is about a stored prefix not served)."""
    nothing = HitGroup(16, "local", [F] * 6, span=64)
    assert reach_chunks(nothing, 0, 64) == (4, 4)
    assert expected_lookup_hit(0, 100, [nothing]) == 0


def test_state_reach():
    # a recurrent state resumes only at a chunk end whose state is stored
    mamba = HitGroup(16, "state", [F, F, F, T, F])
    assert reach_chunks(mamba, 0, 63) is None
    assert reach_chunks(mamba, 0, 64) == (3, 4)
    assert expected_lookup_hit(0, 84, [full([T] * 5), mamba]) == 64


def test_eagle_tail_rule():
    drafter = HitGroup(16, "full", [T, T, T, F, F, F], drafter=True)
    # the drafter proves a hit at 48 with chunk 3, not ready: 32
    assert reach_chunks(drafter, 0, 48) == (0, 4)
    assert expected_lookup_hit(0, 100, [full([T] * 6), drafter]) == 32


def test_max_load_tokens_rule():
    # whole chunks within the request's max_load_tokens
    assert expected_lookup_hit(0, 84, [full([T] * 5)], max_load=40) == 32
    assert expected_lookup_hit(16, 84, [full([T] * 5)], max_load=40) == 32
    assert expected_lookup_hit(0, 84, [full([T] * 5)], max_load=8) == 0


def test_gpu_group_bound_rule():
    assert expected_lookup_hit(0, 84, [full([T] * 5)], bound=20) == 20
    assert expected_lookup_hit(0, 84, [full([T] * 5)], bound=0) == 0


def test_findings_name_their_first_bad_operation():
    assert set(inv.INV_OPS) == set(inv.INVARIANTS)
    f = inv.InvariantViolation("INV-6", 3, "block 4 written").to_finding()
    assert f["op"] == "write" and f["inv_id"] == "INV-6" and f["what"] == inv.INVARIANTS["INV-6"]
    assert inv.InvariantViolation("INV-8", 3, "x", "lookup").to_finding()["op"] == "lookup"
    assert "op" not in inv.InvariantViolation("INV-1", 0, "x").to_json()   # the model's shape


# --- on the real releases ---------------------------------------------------------------------

VERSIONS = ["0.30.0", "0.33.0"]

@pytest.fixture(scope="module")
def pool():
    with Releases.installed(VERSIONS, timeout=120) as p:
        yield p


def _loads(res: dict) -> list[str]:
    return [x for x in res["trace"] if x.startswith("load ")]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", ["load", "reserve", "abort_load", "promote", "mamba_load",
                                  "spec_eagle_hit", "window_load"])
def test_real_lookups_meet_the_oracle(pool, version, name):
    case = HANDMADE[name]
    res = run_real(Case.from_json(case), version, pool)
    assert res["status"] == "ok" and not res["findings"], res["findings"]


@pytest.mark.parametrize("version", VERSIONS)
def test_max_load_tokens_only_where_the_release_reads_it(pool, version):
    case = dict(HANDMADE["load"])
    case["requests"] = [dict(r, max_load_tokens=32) if r["id"] == "b" else r
                        for r in case["requests"]]
    res = run_real(Case.from_json(case), version, pool)
    assert res["status"] == "ok" and not res["findings"], res["findings"]
    # b's GPU hit is its first block: 0.33.0 loads two chunks (max_load_tokens 32), 0.30.0
    # does not read the field and loads the three ready ones
    [load] = _loads(res)
    assert load.count("g0:") == (2 if version == "0.33.0" else 3), load


@pytest.mark.parametrize("version", VERSIONS)
def test_real_findings_carry_op(pool, version):
    # a store completion never processed: the request sharing its chunks waits forever
    res = run_real(Case.from_json(HANDMADE["load"]), version, pool, mutant="lost_completion")
    [f] = res["findings"]
    assert (f["kind"], f["inv_id"], f["op"]) == ("invariant", "INV-8", "liveness"), f
    assert set(f) >= {"kind", "inv_id", "step", "detail", "what", "op"}


def test_real_crash_findings_carry_op(pool):
    res = run_real(Case.from_json(HANDMADE["ring_fence"]), "0.30.0", pool)
    [f] = res["findings"]
    assert (f["kind"], f["op"], f["function"]) == ("crash", "boot", "build_offloading_config")


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_real_max_load_tokens_with_a_window_loses_a_chunk(pool, version):
    """A finding on the real releases (docs/invariants.md; vLLM alone:
    docs/repro/max_load_window_hit_loss.py): 0.33.0's _lookup_complete_chunks takes the
    last-token 1 off b's max_load_tokens cap (48 -> 47 -> 32 in whole chunks), and the window at
    32 needs a's chunk 0, which a's store left out: no hit, where the window at 48 is ready.
    0.30.0 does not read max_load_tokens and loads the 48 tokens."""
    res = run_real(Case.from_json(HANDMADE["max_load_window"]), version, pool)
    if version == "0.30.0":
        assert not res["findings"] and len(_loads(res)) == 1, res["findings"]
        return
    [f] = res["findings"]
    assert (f["inv_id"], f["op"]) == ("INV-9", "lookup"), f
    assert "b: ready chunks cover 48 tokens beyond the GPU hit of 0, lookup found 0" \
        in f["detail"], f


@pytest.mark.parametrize("version", VERSIONS)
def test_real_chunked_local_group_looked_up_as_a_window(pool, version):
    """A finding on the real releases (docs/invariants.md; vLLM alone:
    docs/repro/chunked_local_window_hit_loss.py): r7 stored its full-attention chunks only; r5
    resuming at 64 (an attention-chunk boundary) needs no chunked-local KV, but the connector
    demands cdiv(attention_chunk_size, tokens_per_chunk) = 4 ready chunks of that group."""
    res = run_real(Case.from_json(HANDMADE["chunked_local_reach"]), version, pool)
    [f] = res["findings"]
    assert (f["inv_id"], f["op"]) == ("INV-9", "lookup"), f
    assert "r5: ready chunks cover 64 tokens beyond the GPU hit of 0, lookup found 0" \
        in f["detail"], f


# EAGLE with no drafter group marked: the drafter's layers share the target's groups
EAGLE_SHARED = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                      {"kind": "sliding_window", "block_size": 16,
                                       "sliding_window": 128}],
                           "engine": {"speculative": {"method": "eagle", "num_tokens": 1},
                                      "num_gpu_blocks": 13}},
                "requests": [{"id": "r0", "prompt": [[0, 64]]},
                             {"id": "r1", "prompt": [[0, 64]]}]}


def test_real_eagle_tail_on_every_group_when_none_is_marked_0290():
    """0.25.1-0.29.0 take every group for a drafter group when speculative decoding uses
    EAGLE and no group is marked (OffloadingConnectorScheduler.__init__: ``eagle_groups =
    set(range(...))``), so each group proves its hit with the chunk after it: r1 (GPU hit 32,
    r0's 4 chunks of both groups stored and ready) loads chunk 2 only, 16 tokens, where the
    ready chunks would give 31 without that rule. INV-9's oracle follows the release's drafter
    groups (a campaign's INV-9-lookup-full+sliding_window on 0.25.1-0.29.0 was this rule)."""
    version = "0.29.0"
    with Releases.installed([version], timeout=120) as pool:
        res = run_real(Case.from_json(EAGLE_SHARED), version, pool)
    assert res["status"] == "ok" and not res["findings"], res["findings"]
    [store] = [x for x in res["trace"] if x.startswith("store ")]
    assert "g0:3=" in store and "g1:3=" in store, store     # every chunk ready
    [load] = _loads(res)
    assert load.split()[2] == "r1", load
    chunks = sorted({int(x.split("=")[0].split(":")[1]) for x in load.split()[3:]})
    assert chunks == [2], load


#: a one-token offload chunk (block size 1): b's one-token prompt is a's first token, stored
ONE_TOKEN = {"layout": {"groups": [{"kind": "mla", "block_size": 1}],
                        "engine": {"num_gpu_blocks": 64}},
             "requests": [{"id": "a", "prompt": [[1, 8]], "decode": 1},
                          {"id": "b", "prompt": [[1, 1]], "arrival": 3, "decode": 4}]}


@pytest.mark.parametrize("version", VERSIONS)
def test_real_one_token_prompt_is_loaded_forever(pool, version):
    """A finding on the real releases (docs/invariants.md; vLLM alone:
    docs/repro/one_token_prompt_load_livelock.py): b's full prompt hit of 1 is loaded, then
    _update_waiting_for_remote_kv sets num_computed_tokens = num_tokens - 1 = 0 and the next
    schedule() looks b up and loads it again; b is never scheduled. INV-8 fires at b's third
    load without a step of it in between (MAX_LOADS_UNSCHEDULED), not at the step cap."""
    worker = pool.worker(version, True)
    res = worker.call("run_case", timeout=600, case=Case.from_json(ONE_TOKEN).to_json(),
                      step_cap=300)
    [f] = res["findings"]
    assert (f["inv_id"], f["op"]) == ("INV-8", "load"), f
    assert "b: loaded 3 times without being scheduled in between" in f["detail"], f
    assert f["step"] < 30, f
    loads = [x for x in _loads(res) if x.split()[2] == "b"]
    assert len(loads) == 3, loads
    assert not any(x.startswith("sched b ") for x in res["trace"])
