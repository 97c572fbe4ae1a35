"""Running one case on chosen targets and naming what it shows: the core of ``simsched replay``.

:func:`observe` is the one place that turns outcomes into finding signatures: a crash on any
target, and a divergence wherever a release's outcome differs from the model's prediction under
the profile that stands for that release. Campaigns and repro files call it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from simsched.case import Case
from simsched.outcome import (Signature, crash_signature, describe, diff_config,
                              finding_signature)
from simsched.targets import ModelTarget, ReleaseTarget


@dataclass
class Observation:
    """One signature seen on one target for one case."""

    signature: Signature
    target: str
    outcome: dict


def run_release(target: ReleaseTarget, case: Case) -> dict:
    """A release's outcome; a worker that died or hung becomes an error outcome, not a stop."""
    try:
        return target.config(case)
    except Exception as e:
        first = str(e).splitlines()[0][:300] if str(e) else ""
        return {"status": "error", "stage": "worker", "exception": type(e).__name__,
                "function": "release_worker", "file": None, "message": first}


def observe(case: Case, models: list[ModelTarget], releases: list[ReleaseTarget],
            outcomes: dict | None = None, lockstep: bool = False) -> list[Observation]:
    """Run ``case`` on every target; ``outcomes`` (target name -> outcome) is filled if given.

    The model runs the whole case (every step, every invariant) under each profile. A release
    runs the config-level chain, compared with the model's prediction under the release's
    profile, or, with ``lockstep``, the whole case on the real Scheduler, step by step.
    """
    obs: list[Observation] = []
    predicted: dict[str, dict] = {}
    for t in models:
        outcome = predicted[t.profile.name] = t.config(case)
        if outcome["status"] == "error":   # fails while configuring: no step would run
            findings, steps = [dict(outcome, kind="crash")], 1
        else:
            findings, steps = t.run(case)
        if outcomes is not None:
            outcomes[t.name] = dict(outcome, findings=findings, steps=steps)
        for f in findings:
            obs.append(Observation(finding_signature(f), t.name, dict(f, steps=steps)))
    if lockstep:
        from simsched.lockstep import lockstep_observations
        for t in releases:
            found = lockstep_observations(case, t)
            if outcomes is not None:
                outcomes[t.name] = {"status": "lockstep",
                                    "signatures": [str(o.signature) for o in found]}
            obs.extend(found)
        return obs
    for t in releases:
        outcome = run_release(t, case)
        if outcomes is not None:
            outcomes[t.name] = outcome
        if sig := crash_signature(outcome):
            obs.append(Observation(sig, t.name, outcome))
        model = predicted.get(t.profile.name) or ModelTarget(t.profile).config(case)
        for f in diff_config(model, outcome):
            obs.append(Observation(Signature("divergence", function=f), t.name,
                                   {"model": model, "release": outcome}))
    return obs


def shows(case: Case, target: ReleaseTarget, signature: str | Signature) -> tuple[bool, str]:
    """Does ``case`` on ``target`` show ``signature``? And the outcome in one line."""
    sig = Signature.parse(signature) if isinstance(signature, str) else signature
    outcomes: dict = {}
    obs = observe(case, [], [target], outcomes)
    return any(o.signature == sig for o in obs), describe(outcomes[target.name])
