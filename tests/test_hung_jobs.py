"""Transfer jobs that never complete (``timing.jobs``, ``"latency": null``): the model's rule, the
strategies, the campaign's coverage and the repro generator. What the releases do is in
tests/test_knobs_real.py (0.30.0, 0.33.0, and 0.28.0 for a stall the hang does not explain);
the expected lines below are those real runs' (see there for vLLM's reasons)."""

import pytest
from hypothesis import HealthCheck, find, settings

from fuzz.campaign import knobs_of
from fuzz.strategies import cases
from fuzz.vllm_repro import NotGenerated, supported
from simsched.case import Case
from simsched.model import run_case
from simsched.profiles import profile_for_release


def _case(jobs: list[dict], big: bool = True, **engine) -> Case:
    """a stores 64 tokens (store 0), c its own 96 (store 1), b repeats a's prompt at 6 and loads
    a's last chunk (load 2); with ``big``, d, 176 tokens at 8, which needs 12 of the pool's 15
    blocks."""
    requests = [{"id": "a", "prompt": [[1, 64]], "decode": 2},
                {"id": "c", "prompt": [[2, 96]], "decode": 2, "arrival": 3},
                {"id": "b", "prompt": [[1, 64]], "decode": 2, "arrival": 6}]
    if big:
        requests.append({"id": "d", "prompt": [[3, 176]], "decode": 2, "arrival": 8})
    return Case.from_json({
        "layout": {"groups": [{"kind": "full", "block_size": 16}],
                   "engine": dict({"num_gpu_blocks": 16}, **engine)},
        "requests": requests, "timing": {"jobs": jobs}})


PROFILES = [profile_for_release("0.30.0"), profile_for_release("0.33.0")]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("jobs, big, last", [
    # b's lookup defers on a's chunk, written but never ready
    ([{"store": 0, "latency": None}], False,
     ["check ok", "end waiting on store 0 (never completes); held back: b=lookup"]),
    # d's allocation takes a's freed blocks, which the store fences: flushed, waited for forever
    ([{"store": 0, "latency": None}], True,
     ["flush 0", "end flush waits on store 0 (never completes)"]),
    # b waits for its load, holding the blocks d needs
    ([{"load": 0, "latency": None}], True,
     ["check ok", "end waiting on load 2 (never completes); held back: b=load,d=blocks"]),
])
def test_the_run_stops_on_what_never_completes(profile, async_scheduling, jobs, big, last):
    """Clean (no finding) where a release's run stops, naming the job and how each unfinished
    request is held back; the same case twice gives the same trace."""
    case = _case(jobs, big, **({"async_scheduling": True} if async_scheduling else {}))
    res = run_case(case, profile)
    assert res.findings == [] and res.unsupported is None, res.findings
    assert res.trace[-2:] == last, res.trace[-6:]
    assert run_case(case, profile).trace == res.trace


@pytest.mark.parametrize("profile", PROFILES)
def test_a_flushed_job_that_never_completes_ends_the_step(profile):
    res = run_case(_case([{"store": 0, "latency": None}], enable_prefix_caching=False), profile)
    assert res.findings == []
    assert res.trace[-2:] == ["flush 0", "end flush waits on store 0 (never completes)"]


def test_without_the_hang_the_same_case_finishes():
    res = run_case(_case([]), PROFILES[0])
    assert res.findings == [] and res.counters["finished"] == 4
    assert not any(x.startswith("end ") for x in res.trace)


def test_a_job_never_created_changes_nothing():
    plain = run_case(_case([]), PROFILES[1])
    assert run_case(_case([{"load": 7, "latency": None}]), PROFILES[1]).trace == plain.trace


def test_a_stall_the_hang_does_not_explain_is_inv8():
    """As 0.28.0 runs it (test_knobs_real): r never fits the pool the null block shrinks; s's
    store hanging does not hold r back."""
    res = run_case(Case.from_json({
        "layout": {"groups": [{"kind": "full", "block_size": 16}],
                   "engine": {"num_gpu_blocks": 8}},
        "requests": [{"id": "s", "prompt": [[1, 32]], "decode": 2},
                     {"id": "r", "prompt": [[2, 126]], "decode": 2, "arrival": 4}],
        "timing": {"jobs": [{"store": 0, "latency": None}]}}), profile_for_release("0.28.0"))
    assert [f["inv_id"] for f in res.findings] == ["INV-8"]
    assert "not held back by them: ['r']" in res.findings[0]["detail"]


def test_fast_runs_without_a_trace_stop_alike():
    res = run_case(_case([{"load": 0, "latency": None}]), PROFILES[0], checks="fast",
                   trace=False)
    assert res.findings == [] and res.unsupported is None


def test_the_strategies_draw_a_job_that_never_completes():
    case = find(cases(), lambda c: any(j.latency is None for j in c.timing.jobs),
                settings=settings(max_examples=5000, database=None, deadline=None,
                                  suppress_health_check=list(HealthCheck)))
    assert "timing.jobs.never" in knobs_of(case)
    assert "timing.jobs.never" not in knobs_of(_case([{"store": 0, "latency": 3}]))


def test_the_vllm_only_repro_generator_refuses_it():
    with pytest.raises(NotGenerated, match=r"timing\.jobs"):
        supported(_case([{"store": 0, "latency": None}]),
                  {"kind": "invariant", "invariant": "INV-8", "op": "liveness"})


def test_a_store_holds_blocks_only_where_the_connector_pins_them():
    from simsched.invariants import held_back
    hung = [(0, True, "A")]
    assert held_back("B", False, False, hung) is None
    assert held_back("B", False, False, hung, stores_pin=True) == "blocks"
    assert held_back("B", True, False, hung, stores_pin=True) is None    # B runs: not waiting
