"""The ``multi`` connector path on real vLLM (issue 21): a P/D decode instance that receives
prefills through NIXL while it offloads to CPU, ``MultiConnector[OffloadingConnector,
NixlConnector]`` on the real v1 Scheduler, its workers played
(:mod:`simsched.vllm.inside.multi`, :mod:`simsched.vllm.inside.external_kv`), on 0.30.0 and
0.33.0. Real-vLLM tests FAIL (never skip) when a release is missing.

Each test names what it would miss if the harness did not drive the path: the NIXL pull and its
landing (the request parks in ``WAITING_FOR_REMOTE_KVS`` until the union ``finished_recving``
names it), the content it writes (the store of the received blocks is judged by INV-4 on what
the landing wrote), the ``MultiKVConnectorWorkerMetadata`` routing (the offloading child's
completions reach it, or its stores never complete and the later lookup defers forever)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from simsched.case import Case
from simsched.connectors import Connector
from simsched.lockstep import lockstep
from simsched.targets import Releases

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_paths import (RELEASES, distinct_drawn_cases, drawn_lockstep,  # noqa: E402
                        run_checked, run_real as _run)



def _case(requests: list, blocks: int, order=("offloading", "nixl"), store: int = 4) -> Case:
    return Case.from_json({
        "layout": {"groups": [{"kind": "full", "block_size": 16}],
                   "engine": {"num_gpu_blocks": blocks, "cpu_chunks": 64,
                              "connector": {"kind": "multi", "order": list(order)}}},
        "timing": {"store_latency": store, "load_latency": 2},
        "requests": requests})


#: R's 64-token prompt is pulled through NIXL (lands 2 steps after its admission); the
#: OffloadingConnector stores R's received blocks; D (160 tokens, 11 blocks of a pool of 11)
#: evicts them from the GPU prefix cache; C (R's 64 tokens + 16) loads R's chunks from CPU
BASIC = [{"id": "R", "prompt": [[1, 64]], "decode": 3, "remote_prefill": 2},
         {"id": "D", "prompt": [[2, 160]], "arrival": 8},
         {"id": "C", "prompt": [[1, 64], [3, 16]], "arrival": 12, "decode": 2}]
#: vLLM #46951: A's store (4 steps) is pending when A finishes; R, pulled through NIXL, gets
#: A's freed blocks (a pool of 5); NIXL lands before A's store reads them
STALE = [{"id": "A", "prompt": [[4, 64]]},
         {"id": "R", "prompt": [[5, 64]], "arrival": 1, "decode": 2, "remote_prefill": 2},
         {"id": "A2", "prompt": [[4, 64], [6, 8]], "arrival": 8}]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(RELEASES, timeout=120) as p:
        yield p


def _after(trace: list[str], line: str) -> list[str]:
    return trace[trace.index(line) + 1:]


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("order", [("offloading", "nixl"), ("nixl", "offloading")])
def test_received_blocks_are_offloaded_and_loaded_back(pool, version, order):
    """R is served by NIXL, parked until its pull lands, promoted with N-1 tokens computed (its
    last token recomputed: one token scheduled); the OffloadingConnector stores R's received
    blocks in the promotion step (keys of R's own hashes), and C, sharing R's prefix, loads them
    back from CPU. INV-4 judges the store by what the landing wrote in the shadow and INV-5 the
    load: without the harness's write of the landed KV the store reads blocks never written."""
    real = _run(pool, version, _case(BASIC, 12, order))
    trace = real["trace"]
    assert real["findings"] == [], trace
    assert "recv R g0=1,2,3,4" in trace, trace
    # parked: nothing of R is scheduled before its KV lands
    assert not any(x.startswith("sched R") for x in trace[:trace.index("landed R")]), trace
    promoted = _after(trace, "landed R")
    sched_r = next(x for x in promoted if x.startswith("sched R"))
    assert sched_r == "sched R 1", trace
    store = next(x for x in promoted if x.startswith("store ") and " R " in x)
    assert store.endswith("R g0:0=1 g0:1=2 g0:2=3 g0:3=4"), store
    jid = store.split()[1]
    assert f"done {jid} store" in trace
    load = next(x for x in trace if x.startswith("load ") and " C " in x)
    assert "g0:3=" in load, load          # R's last received chunk, from CPU
    assert f"done {load.split()[1]} load" in trace
    assert real["counters"]["finished"] == 3


@pytest.mark.parametrize("version", RELEASES)
def test_a_cpu_hit_routes_to_the_first_child(pool, version):
    """R2 is a P/D request whose 64-token prefix is on CPU: in the order [offloading, nixl] the
    OffloadingConnector serves it (NIXL only notifies: no pull, no recv line) and the decode
    instance recomputes the suffix; in [nixl, offloading] NIXL pulls all of it."""
    both = [BASIC[0], BASIC[1],
            {"id": "R2", "prompt": [[1, 64], [7, 32]], "arrival": 12, "decode": 2,
             "remote_prefill": 2}]
    on = _run(pool, version, _case(both, 12, ("offloading", "nixl")))
    no = _run(pool, version, _case(both, 12, ("nixl", "offloading")))
    assert on["findings"] == [] and no["findings"] == [], (on["trace"], no["trace"])
    assert not any(x.startswith("recv R2") for x in on["trace"])
    assert any(x.startswith("load ") and " R2 " in x for x in on["trace"])
    assert any(x.startswith("recv R2") for x in no["trace"])
    assert not any(x.startswith("load ") and " R2 " in x for x in no["trace"])


#: R is aborted while NIXL pulls its KV; F arrives meanwhile, into a pool of 6
ABORTED = [{"id": "R", "prompt": [[8, 64]], "decode": 2, "remote_prefill": 4, "abort_at": 1},
           {"id": "F", "prompt": [[9, 64]], "arrival": 1, "decode": 2}]


@pytest.mark.parametrize("version", RELEASES)
def test_aborted_while_receiving_keeps_its_blocks_until_the_landing(pool, version):
    """R is aborted while NIXL pulls its KV: its blocks stay held until the late landing
    (``delay_free_blocks``), F, admitted meanwhile, never gets one of them (INV-6b/INV-1), and
    nothing of R is stored."""
    real = _run(pool, version, _case(ABORTED, 6))
    trace = real["trace"]
    assert real["findings"] == [], trace
    assert "finish R aborted" in trace and "landed R" in trace
    assert not any(x.startswith("store ") and " R " in x for x in trace)
    # F runs only after the landing frees R's blocks
    assert trace.index("landed R") < next(i for i, x in enumerate(trace) if x.startswith("sched F"))


def test_stale_store_46951_reproduces_on_0300_not_0330(pool):
    """vLLM #46951 ("Offloading connector possibly offloading stale KV data",
    https://github.com/vllm-project/vllm/issues/46951, open; fix PRs #46960 and #47046, after
    #46865 gave non-chosen children the real blocks): ``OffloadingConnectorScheduler.
    update_state_after_alloc`` returns on ``num_external_tokens == 0`` before it records the
    blocks (0.30.0 ``offloading/scheduler.py:1076-1080``), so the blocks NIXL pulls into are
    missing from ``_current_batch_allocated_block_ids`` and ``build_connector_meta`` does not
    flush the pending store over them. 0.33.0 records them first (``:1351-1363``) and flushes
    store 0 in R's admission step."""
    case = _case(STALE, 6)
    old = _run(pool, "0.30.0", case)
    f = old["findings"]
    assert [x["inv_id"] for x in f] == ["INV-6"], (
        "vLLM #46951 on 0.30.0: a P/D decode instance with CPU offloading "
        "(MultiConnector[OffloadingConnector, NixlConnector]) under GPU pool pressure gives a "
        "just-finished request's blocks to a remote-prefill request while that request's CPU "
        "store is in flight; the NIXL READ overwrites them before the store copies them, and "
        f"the CPU tier keeps another prompt's KV under A's prefix: {old['trace']}")
    assert f[0]["detail"] == ("block 4 written by NIXL recv of R while store job 0 still "
                              "reads it"), f
    assert "flush 0" not in old["trace"]
    new = _run(pool, "0.33.0", case)
    assert new["findings"] == [], new["trace"]
    recv = new["trace"].index("recv R g0=5,4,3,2")
    assert new["trace"][recv + 1] == "flush 0", new["trace"]
    # A2 loads A's chunks, stored before R's KV landed: INV-5 judged them A's
    assert any(x.startswith("load ") and " A2 " in x for x in new["trace"])


# -- mutants of the path's real code, each caught by an invariant -----------------------------

def test_gate_open_is_caught_by_inv_6b(pool):
    """A WAITING_FOR_REMOTE_KVS request promoted before NIXL reports it: the store of its
    blocks is issued over KV that has not landed (what PR #35092 / issue #34526 guarded)."""
    real = _run(pool, "0.33.0", _case(BASIC, 12), mutant="gate_open")
    f = real["findings"]
    assert [x["inv_id"] for x in f] == ["INV-6b"], real["trace"]
    assert "before NIXL recv of R has landed" in f[0]["detail"], f


def test_recv_swallowed_is_caught_by_inv_8(pool):
    """``get_transfer_results`` keeps the last child's ``finished_recving``: C's CPU load
    (the offloading child's) is reported done, but NIXL's empty set replaces it, and C waits
    in WAITING_FOR_REMOTE_KVS forever."""
    real = _run(pool, "0.33.0", _case(BASIC, 12), mutant="recv_swallowed")
    f = real["findings"]
    assert [x["inv_id"] for x in f] == ["INV-8"], real["trace"]
    assert "'C'" in f[0]["detail"], f


def test_no_alloc_track_is_caught_by_inv_6(pool):
    """0.33.0 with its #46951 fix reverted behaves as 0.30.0: INV-6 at the landing."""
    real = _run(pool, "0.33.0", _case(STALE, 6), mutant="no_alloc_track")
    assert [x["inv_id"] for x in real["findings"]] == ["INV-6"], real["trace"]


#: the campaign's shrunk case: one chunked-local group (attention chunks of 64 tokens) and a
#: 64-token prompt pulled through NIXL. Every block of the prompt lies before the attention
#: chunk its next token opens, so the scheduler allocates none to pull into: R waits in
#: WAITING_FOR_REMOTE_KVS for a pull with no blocks
CHUNK_EDGE = {"layout": {"groups": [{"kind": "chunked_local", "block_size": 16,
                                     "attention_chunk_size": 64}],
                         "engine": {"connector": {"kind": "multi",
                                                  "order": ["offloading", "nixl"]}}},
              "requests": [{"id": "R", "prompt": [[0, 64]], "remote_prefill": 1}]}


@pytest.mark.parametrize("version", RELEASES)
def test_a_pull_with_no_blocks_awaited_is_reported_done(pool, version):
    """0.30.0+ flag such an entry of ``reqs_to_recv`` ``awaiting_kvs`` and the NIXL worker
    reports it in ``finished_recving`` with no transfer (``pull_worker.py`` 0.30.0:450): R is
    admitted and finishes. The harness once skipped every pull without blocks (a full local
    hit only notifies the prefill instance), and a campaign reported R stuck (INV-8) on
    0.28.0-0.33.0."""
    real = _run(pool, version, Case.from_json(CHUNK_EDGE))
    assert real["findings"] == [] and "finish R finished" in real["trace"], real["trace"]


def test_a_pull_with_no_blocks_strands_its_request_on_0290():
    """A real vLLM bug of 0.28.0-0.29.0, fixed in 0.30.0 (upstream PR vllm#56640, reopening
    #54714, "[Bugfix][NIXL] Report a full prefix cache hit as finished"): the NIXL worker
    takes the notify-only path for a pull with no local blocks and never reports it, so the
    request parked in WAITING_FOR_REMOTE_KVS holds its place for the life of the process
    (INV-8). Upstream met it through failed notifications; here a P/D decode instance of a
    chunked-local-attention model gets there on any prompt that ends on an attention-chunk
    boundary. 0.25.1-0.27.1 refuse the layout at start-up."""
    with Releases.installed(["0.29.0"], timeout=120) as p:
        res = lockstep(Case.from_json(CHUNK_EDGE), "0.29.0", p)
    real = res.real
    assert [f["inv_id"] for f in real["findings"]] == ["INV-8"], real["trace"]
    assert "stuck: ['R']" in real["findings"][0]["detail"]
    # the model strands R the same way (no awaiting_kvs before 0.30.0: nixl_scheduler.Recv)
    assert res.model is not None and res.divergence is None, res.divergence


# -- the model beside the release --------------------------------------------------------------

#: the hand-made cases above, by name
HANDMADE = {"basic": lambda: _case(BASIC, 12),
            "basic, nixl first": lambda: _case(BASIC, 12, ("nixl", "offloading")),
            "stale store": lambda: _case(STALE, 6),
            "aborted while receiving": lambda: _case(ABORTED, 6),
            "pull with no blocks": lambda: Case.from_json(CHUNK_EDGE),
            # under async scheduling a landing is reported with its batch's output, a step on
            "basic, async scheduling": lambda: dataclasses.replace(
                _case(BASIC, 12), layout=_case(BASIC, 12).layout.with_engine(
                    async_scheduling=True))}


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("name", sorted(HANDMADE))
def test_the_model_steps_with_the_release(pool, version, name):
    """The model of the path (``model/multi_connector.py``, ``model/nixl_scheduler.py``) runs
    each case step for step as the release does: the same pulls and landings, loads, stores
    and flushes. On 0.30.0 the stale store (#46951) breaks INV-6 at the landing on both
    sides; without the model's pulls every case diverges at its first recv line."""
    res = lockstep(HANDMADE[name](), version, pool)
    assert res.model is not None, res.observations
    assert res.divergence is None, res.divergence.describe()
    assert any(x.startswith("recv ") for x in res.model.trace), res.model.trace


@pytest.mark.parametrize("version", RELEASES)
def test_drawn_multi_cases_step_with_the_model(pool, version):
    """30 cases the strategy draws on the path (``cases(path="multi")``): every one the model
    covers (multi-module MTP aside: ``unmodelled_path``) and the release runs step by step
    agrees with the model, line for line, step for step (Mamba models among them: a pull keeps
    the state block, the decoder recomputes the prompt's last token)."""
    agreed, unmodelled, diverged = drawn_lockstep(pool, version, 30, "multi")
    assert diverged == []
    assert agreed >= 24, (agreed, unmodelled)     # 30 of 30 when written


# -- generated cases ---------------------------------------------------------------------------

def _generated(n: int) -> list[Case]:
    """``n`` cases the campaign's strategies draw, their connector forced to the multi path
    (both orders), every other request pulled through NIXL (1, 2 or 4 steps)."""
    out = []
    for k, case in enumerate(distinct_drawn_cases(n)):
        order = ("offloading", "nixl") if k % 2 else ("nixl", "offloading")
        reqs = tuple(dataclasses.replace(r, remote_prefill=(1, 2, 4)[(i + k) % 3])
                     if i % 2 == 0 else r for i, r in enumerate(case.requests))
        layout = case.layout.with_engine(connector=Connector("multi", order=order),
                                         secondary_tiers=())
        out.append(dataclasses.replace(case, layout=layout, requests=reqs))
    return out


@pytest.mark.parametrize("version", RELEASES)
def test_generated_multi_cases_run_step_by_step(pool, version):
    """30 drawn cases of the path: none ends in an error of the harness; most run step by
    step, and NIXL pulls land in them (``landed`` lines of the real trace)."""
    ran, landed, outcomes = 0, 0, []
    for case in _generated(30):
        real, summary = run_checked(pool, version, case)
        outcomes.append(summary)
        if real.get("status") == "ok" and real["counters"]["steps"] > 0:
            ran += 1
            landed += sum(x.startswith("landed ") for x in real["trace"])
    print(version, f"{ran} of 30 ran, {landed} pulls landed", outcomes)
    assert ran >= 16 and landed >= 16, outcomes


@pytest.mark.parametrize("mutant, inv_id", [("gate_open", "INV-6b"), ("recv_swallowed", "INV-8")])
def test_mutants_are_caught_on_generated_cases(pool, mutant, inv_id):
    """The drawn cases above (clean on 0.33.0 without a mutant: test above) with a mutant of
    the path's real code patched in: its invariant fires on several of them (gate_open: 22 of
    30 when written, every case whose pull takes 2 steps or more; recv_swallowed: 14, a
    request whose KV one child brings is swallowed by the other's empty set). no_alloc_track
    needs pool pressure and a store outlasting the pull: the handmade STALE case above."""
    caught, outcomes = 0, []
    for case in _generated(30):
        real = lockstep(case, "0.33.0", pool, mutant=mutant).real
        found = [f.get("inv_id") or f.get("exception") for f in real.get("findings", [])]
        outcomes.append(found)
        assert real.get("status") == "ok", real
        caught += found == [inv_id]
    print(mutant, f"caught on {caught} of 30", outcomes)
    assert caught >= 8, outcomes
