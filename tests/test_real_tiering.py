"""Tiered offloading on real vLLM (issue 21): the ``OffloadingConnector`` with
``TieringOffloadingSpec``, the CPU tier as primary and an ``fs`` tier writing real files
(:mod:`simsched.vllm.inside.tiering`), on the real v1 Scheduler of 0.30.0 and 0.33.0.
Real-vLLM tests FAIL (never skip) when a release is missing.

What each test would miss if the harness did not drive the path: the fs I/O (run by the
harness before every ``schedule()``: without it no cascade writes a file, no promotion lands and
B never loads A's prefix), the bytes (the worker's signatures in the shared CPU region, checked
in the files at cascade completion, INV-T1, in the promoted slots, INV-T2, and at the load,
INV-5: the mutants), the promotion thrash (INV-8), and the cleanup of what a run puts on disk."""

from __future__ import annotations

import glob
import os
import sys
import tempfile
from pathlib import Path

import pytest

from simsched.case import Case
from simsched.lockstep import lockstep
from simsched.targets import Releases

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_paths import (RELEASES, distinct_drawn_cases, mutant_catches,  # noqa: E402
                        run_real as _run)



def _case(cpu: int = 4, latency: int = 1, a_len: int = 64, fillers: int = 2,
          gpu: int = 8, batch: int = 256) -> Case:
    """A stored and cascaded to the fs tier, fillers F* evicting it from the CPU tier of
    ``cpu`` chunks, then B = A + 20 tokens: B finds A on the fs tier only."""
    reqs = [{"id": "A", "prompt": [[1, a_len]], "decode": 2}]
    reqs += [{"id": f"F{i}", "prompt": [[10 + i, 64]], "decode": 2, "arrival": 10 + 8 * i}
             for i in range(fillers)]
    reqs.append({"id": "B", "prompt": [[1, a_len], [99, 20]], "decode": 2,
                 "arrival": 12 + 8 * fillers})
    return Case.from_json({
        "layout": {"groups": [{"kind": "full", "block_size": 16}],
                   "engine": {"num_gpu_blocks": gpu, "cpu_chunks": cpu,
                              "secondary_tiers": [{"kind": "fs", "io_latency": latency}]}},
        "timing": {"max_num_batched_tokens": batch, "max_num_seqs": 4},
        "requests": reqs})


#: A's prefix (6 chunks) on the fs tier, a CPU tier of 4: B never gets all of it at once
OVERSIZE = dict(cpu=4, a_len=96, fillers=4, gpu=16, batch=32)


def _leftovers() -> list[str]:
    """What the runs of this process's worker pools left on disk (the names carry its pid)."""
    pid = os.getpid()
    return (glob.glob(f"/dev/shm/vllm_offload_simsched-tier-{pid}-*")
            + glob.glob(os.path.join(tempfile.gettempdir(), f"simsched-tier-fs-{pid}-*", "*")))


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(RELEASES, timeout=120) as p:
        yield p


@pytest.mark.parametrize("version", RELEASES)
def test_a_chunk_cascaded_evicted_promoted_and_loaded_with_its_bytes(pool, version):
    """A's 4 chunks are written to files (cascade, checked against the CPU slots), evicted from
    the CPU tier by F0/F1, promoted back for B (checked against the files) and loaded (INV-5 on
    the region's bytes). Without the harness's fs I/O no ``tier`` line appears and B's lookup
    never hits; the read lands two steps after its submission (``io_latency`` 2)."""
    real = _run(pool, version, _case(latency=2))
    trace = real["trace"]
    assert real["findings"] == [], real["findings"]
    promote = [i for i, x in enumerate(trace) if x.startswith("tier promote ")]
    loads = [i for i, x in enumerate(trace) if x.startswith("load ") and " B " in x]
    assert len(promote) == 1 and trace[promote[0]].endswith(" 4 checked"), trace
    assert sum(x.startswith("tier cascade ") for x in trace) >= 3
    # B's load of A's four chunks comes after the promotion's read was checked
    assert len(loads) == 1 and loads[0] > promote[0] and loads[0] - promote[0] < 6
    assert trace[loads[0]].count("=") == 4 and "finish B finished" in trace


@pytest.mark.parametrize("version", RELEASES)
def test_a_lookup_waiting_on_the_fs_read_is_not_a_deferral_finding(pool, version):
    """B's first chunk past its GPU hit is ready in the CPU tier, the next on the fs tier only
    (a CPU tier of 6: F0 evicted it), whose read takes 4 steps: B's lookup defers through the
    probe (RETRY) and the read (HIT_PENDING), longer than the case's transfer latencies allow
    (INV-8 "lookup deferred 4 steps (bound 3)" without the driver's ``lookup_defer_steps``),
    and then loads."""
    real = _run(pool, version, _case(cpu=6, fillers=1, latency=4))
    assert real["findings"] == [], real["findings"]
    trace = real["trace"]
    promote = [i for i, x in enumerate(trace) if x.startswith("tier promote ")]
    loads = [i for i, x in enumerate(trace) if x.startswith("load ") and " B " in x]
    assert promote and loads and promote[0] < loads[0] and "finish B finished" in trace


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("mutant,latency,inv_id", [("early_ready", 2, "INV-5"),
                                                   ("cascade_wrong_chunk", 1, "INV-T1"),
                                                   ("promote_wrong_slot", 1, "INV-T2")])
def test_tiering_mutants_are_caught(pool, version, mutant, latency, inv_id):
    real = _run(pool, version, _case(latency=latency), mutant)
    assert [f["inv_id"] for f in real["findings"]] == [inv_id], real["findings"]


@pytest.mark.parametrize("version", RELEASES)
def test_promotion_thrash_never_admits_a_prefix_longer_than_the_cpu_tier(pool, version):
    """vLLM bug (every release with tiering, 0.25.1-0.33.0): B's prefix on the fs tier (6
    chunks) is longer than the CPU tier (4). Each lookup promotes the chunks it finds on fs,
    evicting B's own promoted chunks (``prepare_write`` protects only the promoted key), and
    any HIT_PENDING defers the whole request: B is never admitted (the engine steps on,
    re-reading the files). Related upstream: vllm#49902, PR vllm#50014 and RFC vllm#51240
    (promotions of *other* requests evicting unconsumed promotions); the self-thrash of one
    request is not reported there. With a CPU tier of 6 chunks B loads its prefix."""
    real = _run(pool, version, _case(**OVERSIZE))
    f = real["findings"]
    assert [(x["inv_id"], x["op"]) for x in f] == [("INV-8", "lookup")], f
    assert "promoted from the fs tier 3 times" in f[0]["detail"]
    assert "cpu_bytes_to_use smaller than a prompt's prefix" in f[0]["detail"]
    assert f[0]["step"] < 40
    ok = _run(pool, version, _case(**dict(OVERSIZE, cpu=6)))
    assert ok["findings"] == [] and "finish B finished" in ok["trace"]


@pytest.mark.parametrize("version", RELEASES)
def test_nothing_left_on_disk_after_runs(pool, version):
    """The fs root and the region's /dev/shm file go after a clean run, a finding (the thrash)
    and a run a mutant stops."""
    _run(pool, version, _case())
    _run(pool, version, _case(**OVERSIZE))
    _run(pool, version, _case(), "cascade_wrong_chunk")
    assert _leftovers() == []


def test_the_size_cap_stops_the_run_and_cleans_up(monkeypatch):
    """An exception out of the run (the harness's size bound on the fs files, here 8 KiB:
    SIMSCHED_FS_MAX_BYTES, read by the worker) ends it unsupported, naming the bound; nothing
    is left on disk."""
    monkeypatch.setenv("SIMSCHED_FS_MAX_BYTES", "8192")
    with Releases.installed(["0.33.0"], timeout=120) as p:
        real = lockstep(_case(), "0.33.0", p).real
        assert real["status"] == "unsupported", real
        assert "over the harness's bound of 8192" in real["reason"]
        assert _leftovers() == []


# -- generated cases ---------------------------------------------------------------------------

#: why a drawn case may be unsupported here, as on the CPU-only path
UNSUPPORTED = ("mamba_cache_mode align", "does not support failed transfers")


def _generated(n: int) -> list[Case]:
    """``n`` cases the campaign's strategies draw on the fs path (most of them come back to a
    conversation once another request took its GPU blocks and its CPU chunks)."""
    return distinct_drawn_cases(n, path="fs")


@pytest.mark.parametrize("version", RELEASES)
def test_generated_tiering_cases_run_step_by_step(pool, version):
    """30 drawn cases of the path: none is a harness error; those that do not step are
    refused at boot by the OffloadingConnector's own checks (``build_offloading_config``: group
    block sizes it cannot chunk; ``get_sliding_window_size_in_chunks``: a group it cannot
    window), or are layouts the harness does not build (a Mamba
    align block other than the engine's), or stop where the release's worker does (a drawn
    failed transfer), as on the CPU-only path. The fs tier is driven:
    files written and checked at cascade completion, and chunks promoted back for a request
    that came back to its prefix. The model agrees with each, step by step."""
    ran, outcomes, tier_jobs = 0, [], {"cascade": 0, "promote": 0}
    for case in _generated(30):
        res = lockstep(case, version, pool)
        real = res.real
        found = real.get("findings", [])
        # the model of the tiers (simsched/model/tiering_manager.py) agrees step by step
        assert res.divergence is None, (case.to_json(), res.divergence.describe())
        outcomes.append((real.get("status"), [f.get("inv_id") or f.get("exception")
                                              for f in found]))
        for line in real.get("trace", []):
            if line.startswith("tier "):
                tier_jobs[line.split()[1]] += 1
        assert real.get("status") not in ("worker", "error"), real
        assert not any(f.get("kind") == "harness" for f in found), real
        if real.get("status") == "unsupported":
            assert any(why in real["reason"] for why in UNSUPPORTED), real
        elif real["counters"]["steps"] > 0:
            ran += 1
        else:
            assert [f.get("op") for f in found] == ["boot"], real
    print(version, ran, tier_jobs, outcomes)
    assert ran >= 10, outcomes
    assert tier_jobs["cascade"] >= 10 and tier_jobs["promote"] >= 2, tier_jobs
    assert _leftovers() == []


#: the campaign's INV-T1 "bug" on 0.26.0-0.32.0: r5 comes back to r3's prompt, stores its last
#: chunk again with the sliding-window group's block out of the window null (r3 stored it whole),
#: and the tier keeps r3's file (a key's file is written once, fs/io.py ``_store_block``)
SLIDING_CHUNK_AGAIN = {
    "layout": {"groups": [{"kind": "mla", "block_size": 64}, {"kind": "mla", "block_size": 256},
                          {"kind": "sliding_window_mla", "block_size": 64, "sliding_window": 128}],
               "engine": {"blocks_per_chunk": 3, "cpu_chunks": 4,
                          "secondary_tiers": [{"kind": "fs", "io_latency": 2}]}},
    "requests": [{"id": "r0", "prompt": [[0, 64]]},
                 {"id": "r3", "prompt": [[300, 384]], "arrival": 21, "decode": 2},
                 {"id": "r4", "prompt": [[301, 624]], "arrival": 30, "decode": 2},
                 {"id": "r5", "prompt": [[300, 384], [302, 208]], "arrival": 40, "decode": 4}],
    "timing": {"max_num_batched_tokens": 256}}


@pytest.mark.parametrize("version", RELEASES)
def test_a_key_written_once_is_no_cascade_finding(pool, version):
    """The fs tier writes a key's file once ("Check if block already exists to avoid redundant
    writes"): a chunk stored again, with other blocks null, leaves the first file, and INV-T1
    judges the file against what it held (0.30.0 reported INV-T1 before; 0.33.0 does not
    store the chunk again). The model agrees."""
    res = lockstep(Case.from_json(SLIDING_CHUNK_AGAIN), version, pool)
    assert res.real["findings"] == [], res.real["findings"]
    assert res.divergence is None, res.divergence.describe()


def _sliding_case() -> Case:
    """A (96 tokens) in full-attention and sliding-window (2 blocks) groups stored and
    cascaded, three fillers evicting it from a CPU tier of 16 chunks, then B = A + 20 tokens."""
    reqs = [{"id": "A", "prompt": [[1, 96]], "decode": 2}]
    reqs += [{"id": f"F{i}", "prompt": [[10 + i, 64]], "decode": 2, "arrival": 10 + 8 * i}
             for i in range(3)]
    reqs.append({"id": "B", "prompt": [[1, 96], [99, 20]], "decode": 2, "arrival": 36})
    return Case.from_json({
        "layout": {"groups": [{"kind": "full", "block_size": 16},
                              {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}],
                   "engine": {"num_gpu_blocks": 24, "cpu_chunks": 16,
                              "secondary_tiers": [{"kind": "fs", "io_latency": 1}]}},
        "timing": {"max_num_batched_tokens": 256, "max_num_seqs": 4}, "requests": reqs})


def test_a_promotion_answers_retry_before_0280():
    """0.25.1-0.27.1's lookup answers RETRY for a chunk it starts promoting (0.28.0:
    HIT_PENDING). B's sliding-window lookup scans its keys from the end: a pending chunk counts
    toward the window and the scan stops at two, where RETRY counts nothing and the scan goes
    on to the first key, promoting every one: B's read is of A's 6 full-attention chunks and
    6 window chunks on 0.27.1, and of 6 and 2 on 0.28.0. The model, with
    ``tier_promotion_retry`` for the older releases, agrees with both."""
    promoted = {}
    with Releases.installed(["0.27.1", "0.28.0"], timeout=120) as p:
        for version in ("0.27.1", "0.28.0"):
            res = lockstep(_sliding_case(), version, p)
            assert res.divergence is None, res.divergence.describe()
            promoted[version] = [x.split()[3] for x in res.real["trace"]
                                 if x.startswith("tier promote ")]
    assert promoted == {"0.27.1": ["12"], "0.28.0": ["8"]}, promoted


#: the hand-made cases above, each run by the model beside the release
HAND_MADE = {"promoted": dict(latency=2), "read_of_4_steps": dict(cpu=6, fillers=1, latency=4),
             "thrash": OVERSIZE}


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("name", sorted(HAND_MADE))
def test_the_model_mirrors_the_tiers_step_by_step(pool, version, name):
    """The model (``simsched/model/tiering_manager.py``) traces what the release does, line
    for line: the cascades and promotions as the harness's I/O clock completes them, B's
    deferred lookups (the probe's RETRY, the read's HIT_PENDING), the load, and the thrash's
    INV-8 at the same step."""
    res = lockstep(_case(**HAND_MADE[name]), version, pool)
    assert res.divergence is None, res.divergence.describe()
    assert res.real["status"] == "ok", res.real
    model = res.model.trace
    assert sum(x.startswith("tier promote ") for x in model) >= 1
    want = ["INV-8"] if name == "thrash" else []
    assert [f["inv_id"] for f in res.model.findings] == want
    assert [f["inv_id"] for f in res.real["findings"]] == want


@pytest.mark.parametrize("mutant,inv_id,least", [("cascade_wrong_chunk", "INV-T1", 5),
                                                 ("promote_wrong_slot", "INV-T2", 2),
                                                 ("early_ready", "INV-5", 2)])
def test_mutants_are_caught_on_generated_cases(pool, mutant, inv_id, least):
    """60 drawn cases of the path on 0.33.0 with a mutant of the tiering code: its invariant
    alone fires on some, each clean unmutated. A cascade from the wrong slot wherever a chunk
    is written (INV-T1); a promotion into the wrong slot, or marked ready before its read
    lands, only where a request comes back to a prefix the CPU tier evicted (INV-T2; INV-5
    where the read takes two steps or more)."""
    caught, outcomes = mutant_catches(pool, "0.33.0", _generated(60), mutant, inv_id)
    print(mutant, f"caught on {caught} of 60", outcomes)
    assert caught >= least, outcomes


#: the campaign's shrunk case: MLA (block 64) beside a ring group, a CPU tier of 8 chunks; r6
#: comes back to r4's 4 chunks after r5 took the CPU tier, and they are promoted one read at a
#: time (2 steps each)
ONE_AT_A_TIME = {"layout": {"groups": [{"kind": "mla", "block_size": 64},
                                       {"kind": "ring", "block_size": 4}],
                            "engine": {"num_gpu_blocks": 8, "cpu_chunks": 8,
                                       "secondary_tiers": [{"kind": "fs", "io_latency": 2}]}},
                 "requests": [{"id": "r0", "prompt": [[0, 64]]},
                              {"id": "r4", "prompt": [[300, 256]], "arrival": 28, "decode": 2},
                              {"id": "r5", "prompt": [[301, 368]], "arrival": 36, "decode": 2},
                              {"id": "r6", "prompt": [[300, 256], [302, 80]], "arrival": 44,
                               "decode": 4}]}


def test_promotions_in_flight_are_no_stall():
    """r6's lookup waits nine steps and more on four promotions, each a read of 2 steps: the
    fs tier is not quiet meanwhile (``TieringDriver.tier_io_live``), and r6 loads and
    finishes. The stall check once counted those steps, and a campaign reported r6 stuck
    (INV-8 "no progress for 9 steps with the tier quiet") on 0.31.0-0.33.0 (0.30.0 refuses
    the layout at start-up)."""
    with Releases.installed(["0.33.0"], timeout=120) as p:
        real = _run(p, "0.33.0", Case.from_json(ONE_AT_A_TIME))
    trace = real["trace"]
    assert real["findings"] == [] and "finish r6 finished" in trace, real["findings"]
    assert sum(x.startswith("tier promote ") for x in trace) == 4
