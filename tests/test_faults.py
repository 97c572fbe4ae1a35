"""Failed transfers (``faults``): the case format, the model's rule, and the release's own
offloading worker taking the failure. Real-vLLM tests FAIL (never skip) when a release is
missing."""

import re

import pytest

from simsched.case import Case
from simsched.layout import LayoutError
from simsched.lockstep import lockstep
from simsched.model import run_case
from simsched.profiles import profile_for_release
from simsched.targets import Releases

VERSIONS = ["0.25.1", "0.30.0", "0.33.0"]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(VERSIONS, timeout=120) as p:
        yield p


def _case(*faults, **timing) -> Case:
    """a's 48 tokens are stored (store job 0, three chunks of 16); the operator's reset drops
    them from the GPU prefix cache, so b, a's prompt and one token more, loads them back from
    the CPU tier (load job 1)."""
    return Case.from_json({
        "layout": {"groups": [{"kind": "full", "block_size": 16}],
                   "engine": {"num_gpu_blocks": 64}},
        "requests": [{"id": "a", "prompt": [[1, 48]]},
                     {"id": "b", "prompt": [[1, 48], [2, 1]], "arrival": 4}],
        "events": [{"step": 4, "do": "reset_prefix_cache"}],
        "timing": timing,
        "faults": [dict(zip(("kind", "job"), f)) for f in faults]})


def test_faults_are_validated():
    case = _case(("store_failed", 0)).to_json()
    assert case["faults"] == [{"job": 0, "kind": "store_failed"}]
    assert Case.from_json(case) == _case(("store_failed", 0))
    for bad, where in (([{"job": 0, "kind": "lost"}], r"faults\[0\]\.kind"),
                       ([{"job": -1, "kind": "load_failed"}], r"faults\[0\]\.job"),
                       ([{"kind": "load_failed"}], r"faults\[0\]\.job"),
                       ([{"job": 0, "kind": "load_failed", "step": 3}], r"faults\[0\]"),
                       ({"job": 0}, r"^faults: expected a list"),
                       ([{"job": 0, "kind": "store_failed"}] * 2,
                        r"faults: store_failed of job 0 given twice")):
        with pytest.raises(LayoutError, match=where):
            Case.from_json(dict(case, faults=bad))


@pytest.mark.parametrize("kind,jid", [("store_failed", 0), ("load_failed", 1)])
def test_the_model_stops_where_the_worker_learns_of_the_failure(kind, jid):
    """The model runs the case as without faults until the job would have completed, then
    stops with ``failed`` and no finding."""
    plain = run_case(_case(), "every-group-no-clamp")
    assert plain.unsupported is None and not plain.findings
    assert f"done {jid} {kind[:-7]}" in plain.trace
    cut = run_case(_case((kind, 0)), "every-group-no-clamp")
    assert cut.findings == [] and cut.refused is None
    assert cut.trace[-1] == f"failed {jid} {kind[:-7]}"
    assert "does not support failed transfers" in cut.unsupported
    # everything before the failure is the plain run's
    assert cut.trace[:-1] == plain.trace[:len(cut.trace) - 1]


def test_a_fault_on_a_job_never_created_changes_nothing():
    assert run_case(_case(("load_failed", 5)), "every-group-no-clamp").trace == \
        run_case(_case(), "every-group-no-clamp").trace


def test_a_later_latency_moves_the_failure_with_it():
    """The failure arrives when the job would have completed: nine steps after its store."""
    soon = run_case(_case(("store_failed", 0)), "every-group-no-clamp").trace
    late = run_case(_case(("store_failed", 0), jobs=[{"store": 0, "latency": 9}]),
                    "every-group-no-clamp").trace
    steps = [sum(1 for x in t if x.startswith("step ")) for t in (soon, late)]
    assert steps[1] == steps[0] + 8, steps


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind,jid", [("store_failed", 0), ("load_failed", 1)])
def test_the_release_worker_raises_on_a_failed_transfer(pool, version, kind, jid):
    """The release's own worker-side connector is handed the failure and asserts in
    get_finished (``offloading/worker.py``); the run stops there on both sides, step for step
    alike. Without the fault passed through, the release would run the case to its end."""
    res = lockstep(_case((kind, 0)), version, pool)
    assert res.real["status"] == "unsupported", res.summary()
    assert re.search(r"offloading/worker\.py:\d+ get_finished: assert transfer_result\.success",
                     res.real["reason"]), res.real["reason"]
    assert f"{kind[:-7]} job {jid} failed" in res.real["reason"]
    assert res.real["trace"][-1] == f"failed {jid} {kind[:-7]}"
    assert res.real["findings"] == []
    assert res.divergence is None and res.observations == [], res.summary()
    assert res.model.unsupported is not None
    assert profile_for_release(pool.release_of(version)).name == res.profile


@pytest.mark.parametrize("version", ["0.33.0"])
def test_without_the_fault_the_release_completes_the_same_case(pool, version):
    res = lockstep(_case(), version, pool)
    assert res.agree, res.summary()
    assert res.real["counters"]["loads"] == 1 and res.real["counters"]["finished"] == 2


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
@pytest.mark.parametrize("kind,jid", [("store_failed", 0), ("load_failed", 1)])
def test_under_async_scheduling_the_run_stops_at_the_same_step(pool, version, kind, jid):
    """With the batch queue the failure reaches the scheduler with its batch's output: both
    sides end that step with its check, then ``failed``."""
    case = _case((kind, 0)).to_json()
    case["layout"]["engine"]["async_scheduling"] = True
    res = lockstep(Case.from_json(case), version, pool)
    assert res.real["status"] == "unsupported", res.summary()
    assert res.real["trace"][-1] == f"failed {jid} {kind[:-7]}"
    assert res.divergence is None and res.observations == [], res.summary()


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_under_async_scheduling_the_failure_is_the_failing_batchs(pool, version):
    """The campaign's gap-trace_failed-f3361d: store 1 is created and fails in step 1, while
    step 0's batch is still to be collected. The engine collects step 0's output (store 0 done)
    and meets the failure when it collects step 1's, after scheduling step 2: the harness had
    stopped at step 0's output."""
    case = Case.from_json({"layout": {"groups": [{"kind": "full", "block_size": 16}],
                                      "engine": {"async_scheduling": True}},
                           "requests": [{"id": "r0", "prompt": [[0, 2304]]}],
                           "faults": [{"job": 1, "kind": "store_failed"}]})
    res = lockstep(case, version, pool)
    assert res.real["status"] == "unsupported", res.summary()
    trace = res.real["trace"]
    assert trace.index("done 0 store") < trace.index("step 2") < trace.index("failed 1 store")
    assert res.divergence is None and res.observations == [], res.summary()
