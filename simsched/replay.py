"""Running one case on chosen targets and naming what it shows: the core of ``simsched replay``.

:func:`observe` is the one place that turns outcomes into finding signatures. Three levels:

* the model runs the whole case (every step, every invariant) under each profile given;
* a release's **config chain** (boot and the first ``update_offload_keys``, batched and cheap):
  a crash, and a divergence wherever it differs from the model under the release's profile;
* a release's **real Scheduler, step by step** (:mod:`simsched.lockstep`): its crashes, the
  invariants its real run breaks (checked on a content shadow of the real run, not on the
  model), and the first step where its trace differs from the model's.

A release's step run is what a claim about the release rests on: ``releases_clean`` means it ran
every step there and nothing showed. Its outcome (``outcomes[version]``) has status ``ran``, or
says why the case could not run (``unsupported``, ``refused``, ``worker``, ``invalid``).
"""

from __future__ import annotations

from simsched.case import Case
from simsched.model import predicts_config, unmodelled_path
from simsched.outcome import (Observation, Signature, crash_signature, describe, diff_config,
                              finding_signature)
from simsched.targets import ModelTarget, ReleaseTarget, SharedModelRuns

__all__ = ["Observation", "observe", "shows", "run_release", "step_outcome"]


def run_release(target: ReleaseTarget, case: Case) -> dict:
    """A release's config outcome; a worker that died or hung becomes an error outcome."""
    try:
        return target.config(case)
    except Exception as e:
        first = str(e).splitlines()[0][:300] if str(e) else ""
        return {"status": "error", "stage": "worker", "exception": type(e).__name__,
                "function": "release_worker", "file": None, "message": first}


def _observe_models(case: Case, models: list[ModelTarget], outcomes: dict,
                    predicted: dict) -> list[Observation]:
    obs = []
    runs = SharedModelRuns(case)
    for t in models:
        outcome, findings, steps = runs.outcome(t)
        predicted[t.profile.name] = outcome
        outcomes[t.name] = dict(outcome, findings=findings, steps=steps)
        for f in findings:
            obs.append(Observation(finding_signature(f), t.name, dict(f, steps=steps), "model"))
    return obs


def _observe_configs(case: Case, releases: list[ReleaseTarget], outcomes: dict,
                     predicted: dict) -> list[Observation]:
    obs = []
    for t in releases:
        outcome = outcomes[t.name] = run_release(t, case)
        if sig := crash_signature(outcome):
            obs.append(Observation(sig, t.name, outcome))
        model = (predicted.get(t.profile.name) or outcomes.get(f"model:{t.profile.name}")
                 or ModelTarget(t.profile).config(case))
        for f in diff_config(model, outcome):
            obs.append(Observation(Signature("divergence", function=f"config.{f}"), t.name,
                                   {"model": model, "release": outcome}))
    return obs


def step_outcome(res) -> dict:
    """A :class:`simsched.lockstep.LockstepResult` as the outcome of a release's step run."""
    real = res.real
    status = real.get("status")
    if status != "ok":
        out = {k: v for k, v in real.items() if k not in ("trace", "counters")}
        if "counters" in real:  # stopped on a step (a failed transfer): its steps were real
            out["steps"] = real["counters"].get("steps", 0)
        return out
    gap = res.divergence.to_json() if res.divergence is not None else None
    return {"status": "ran", "steps": real.get("counters", {}).get("steps", 0),
            "findings": real.get("findings", []), "counters": real.get("counters", {}),
            "divergence": gap and {"step": gap["step"], "kind": gap["kind"]},
            "wall": real.get("wall")}


def _observe_steps(case: Case, releases: list[ReleaseTarget], outcomes: dict,
                   traces: dict | None) -> list[Observation]:
    from simsched.lockstep import lockstep
    obs = []
    for t in releases:
        res = lockstep(case, t.version, t.pool)
        outcomes[t.name] = dict(step_outcome(res), config=outcomes.get(t.name))
        if traces is not None:
            traces[t.name] = res
        obs.extend(Observation(o.signature, o.target, o.outcome, "steps")
                   for o in res.observations)
    return obs


def observe(case: Case, models: list[ModelTarget], releases: list[ReleaseTarget],
            outcomes: dict | None = None, *, config: bool = True,
            steps: list[ReleaseTarget] | None = None,
            traces: dict | None = None) -> list[Observation]:
    """Run ``case`` on every target; ``outcomes`` (target name -> outcome) is filled if given.

    ``config``: run the config chain of every release of ``releases``; ``steps``: the releases
    to run step by step on the real Scheduler (default: every release of ``releases``). A
    release's step outcome replaces its config outcome in ``outcomes`` (keeping it under
    ``config``). ``traces`` gets each step run's :class:`~simsched.lockstep.LockstepResult`.
    """
    outcomes = {} if outcomes is None else outcomes
    predicted: dict[str, dict] = {}
    # a connector path the model does not mirror (on a profile): the real run's own checks are
    # all there is. The config chain is the OffloadingConnector's, and so is the model's
    # prediction of it: compared where the case's connector is that one
    models = [t for t in models if unmodelled_path(case.layout, t.profile) is None]
    config = config and predicts_config(case.layout)
    obs = _observe_models(case, models, outcomes, predicted)
    if config:
        obs += _observe_configs(case, releases, outcomes, predicted)
    obs += _observe_steps(case, releases if steps is None else steps, outcomes, traces)
    return obs


def shows(case: Case, target: ReleaseTarget,
          signature: str | Signature) -> tuple[bool, bool, str]:
    """Does ``case`` on ``target``'s real Scheduler, run step by step, show ``signature``? Did
    it run there at all (not ``unsupported``, ``refused`` at start-up, a failed worker)? And
    the outcome in one line."""
    sig = Signature.parse(signature) if isinstance(signature, str) else signature
    outcomes: dict = {}
    obs = observe(case, [], [target], outcomes, config=False)
    outcome = outcomes[target.name]
    present = any(o.signature == sig for o in obs)
    return present, present or outcome.get("status") == "ran", describe(outcome)
