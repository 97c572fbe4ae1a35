"""Profiles that behave alike on a case share one model run (``targets.SharedModelRuns``): the
shared outcomes must be the outcomes each profile gives when it runs the case on its own."""

import sys
from dataclasses import replace
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from fuzz.strategies import cases
from simsched.case import Case
from simsched.lockstep import generate_case
from simsched.profiles import PROFILES, RecordingProfile, answers_alike
from simsched.targets import ModelTarget, SharedModelRuns

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_corpus import generated  # noqa: E402

TARGETS = [ModelTarget(p) for p in PROFILES.values()]


def _draw(n: int) -> list[Case]:
    drawn: list[Case] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def draw(case):
        drawn.append(case)

    draw()
    return drawn


def test_shared_runs_give_every_profile_its_own_outcome():
    """On generated cases (the campaign's strategy, and the golden corpus's generator, whose
    cases break invariants under some profiles), each profile's shared outcome is the one it
    gives alone; and runs are shared."""
    n_runs = n_outcomes = 0
    kinds = set()
    for case in _draw(100) + [Case.from_json(data) for _, data, _ in generated()]:
        shared = SharedModelRuns(case)
        for t in TARGETS:
            alone = t.outcome(case)
            assert shared.outcome(t) == alone, (t.profile.name, case.to_json())
            kinds |= {f.get("kind") for f in alone[1]}
        n_runs += len(shared.runs)
        n_outcomes += len(TARGETS)
    assert {"crash", "invariant"} <= kinds      # the comparison covered findings of both kinds
    assert n_runs < 0.75 * n_outcomes           # a quarter of the outcomes at least are shared


def test_a_profile_that_answers_a_question_otherwise_does_not_share():
    """A profile that differs from the recorded one only in an answer the run needed (0.30.0's
    keyed-chunk clamp, read by every store) gets a run of its own; one that differs only in a
    question the run never asked (the window policy, on a layout with no window) shares."""
    case = generate_case(0, "full16")
    base = PROFILES["every-group"]
    recording = RecordingProfile(base)
    ModelTarget(recording).outcome(case)
    assert recording.answers
    assert answers_alike(recording.answers, base)
    assert not answers_alike(recording.answers, replace(base, keyed_chunk_clamp=False))
    assert answers_alike(recording.answers, PROFILES["fix-assert-and-window"])


def test_a_recorded_policy_that_raises_is_an_answer():
    """A policy that raises (the window helper's assert on a ring, PR #55037 alone) is an answer
    too: a profile whose policy returns there (PR #55038's ring-is-one-block) does not share,
    and one that differs only in a rule the crashed start-up never reached does."""
    case = generate_case(0, "full16+ring4")
    base = PROFILES["fix-assert-only"]
    recording = RecordingProfile(base)
    config, findings, _ = ModelTarget(recording).outcome(case)
    assert config["status"] == "error" and config["function"] == base.window_function
    assert findings[0]["kind"] == "crash"
    assert any(a[2][0] == "raised" for a in recording.answers if a[1] is not None)
    assert not answers_alike(recording.answers, PROFILES["fix-assert-and-window"])
    assert answers_alike(recording.answers, replace(base, name="no clamp",
                                                    keyed_chunk_clamp=False))
