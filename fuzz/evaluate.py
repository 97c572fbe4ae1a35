"""One generated case on a campaign's targets, triaged: the model under every behaviour profile
(the fast pre-screen), every release's config chain (boot and the first
``update_offload_keys``), and the **real Scheduler, step by step**, of the releases the pre-screen
points at (the model under the release's profile shows something, or the release's config
differs from the model's), and of the newest release on a steady share of all cases whatever the
model says (:data:`REAL_SHARE`), so that bugs the model does not foresee are still found.

:class:`Evaluator` holds the targets (:class:`~simsched.targets.ModelTarget` per profile,
:class:`~simsched.targets.ReleaseTarget` per release worker of the pool) and counts what each
release ran (cases, real steps, seconds) whatever the phase: generating, shrinking, replaying a
finding. The campaign (:mod:`fuzz.campaign`) is an Evaluator with a loop around it.
"""

from __future__ import annotations

import time

from fuzz import triage as tri
from fuzz.shrink import Hunt
from fuzz.triage import Seen
from simsched.case import Case
from simsched.layout import deployment_refusal
from simsched.model import predicts_config
from simsched.outcome import Observation, Signature, crash_signature
from simsched.profiles import PROFILES
from simsched.replay import observe
from simsched.targets import ModelTarget, Releases, ReleaseTarget

#: the share of generated cases run step by step on the newest release whatever the pre-screen
#: says (BENCHMARKS.md, "The real side in the main campaign", measures the choice)
REAL_SHARE = 0.25

#: how the releases run each case: ``screen`` (the pre-screen and the share, the default),
#: ``every`` (every case step by step on every release), ``none`` (the config chain only)
STEP_MODES = ("screen", "every", "none")


def connector_path(layout) -> str:
    """The connector path a case runs on, as the report counts real steps on each: the
    connector, and its secondary tiers."""
    engine = layout.engine
    return "+".join([engine.connector.describe()] + [t.kind for t in engine.secondary_tiers])


class CampaignError(Exception):
    """A campaign that cannot run as asked (a target, steps mode or steering it cannot do)."""


class Evaluator:
    """The targets a case runs on, what the pre-screen sends to real steps, and the triage."""

    def __init__(self, releases: Releases, *, model: bool = True,
                 run_releases: list[str] | None = None, steps: str | None = None,
                 real_share: float = REAL_SHARE):
        self.pool = releases
        self.model_targets = [ModelTarget(p) for p in PROFILES.values()] if model else []
        self.fingerprint_targets = [ModelTarget(p) for p in PROFILES.values()]
        self.release_targets = [ReleaseTarget(v, releases) for v in (run_releases or [])]
        # Each shrunk finding is replayed on every installed release, unless only the model runs.
        self.all_release_targets = ([ReleaseTarget(v, releases) for v in releases.versions]
                                    if run_releases else [])
        self.steps_mode = steps or ("screen" if self.release_targets else "none")
        if self.steps_mode not in STEP_MODES:
            raise CampaignError(f"steps {self.steps_mode!r}: expected one of {STEP_MODES}")
        self.newest = (max(self.release_targets, key=lambda t: tri._vkey(t.version))
                       if self.release_targets else None)
        self.real_share = real_share
        self.steps = 0                   # model steps
        self.per_release: dict[str, dict] = {}   # version -> cases, real steps, seconds
        self.model_s = 0.0               # seconds in the model under every profile
        # connector path (simsched.connectors) -> step runs, real steps and their seconds
        self.per_path: dict[str, dict[str, float]] = {}
        self._stepped_last: set[str] = set()
        self._sampled_n = 0              # cases of the share so far (the older releases' turn)

    def _release_stats(self, version: str) -> dict:
        return self.per_release.setdefault(version, {
            "config_cases": 0, "step_cases": 0, "real_steps": 0,
            "config_seconds": 0.0, "step_seconds": 0.0})

    def _account(self, outcomes: dict) -> None:
        """Count a generated case: its model steps, and a config chain per release."""
        for name, out in outcomes.items():
            if name.startswith("model:"):
                self.steps += out.get("steps", 0)
        for t in self.release_targets:
            self._release_stats(t.version)["config_cases"] += 1

    def screen(self, case: Case, obs: list[Observation], outcomes: dict,
               sampled: bool) -> list[ReleaseTarget]:
        """The releases worth real steps for ``case``: where the model under the release's
        profile shows something, or the release's config differs from the model's; and the
        newest release on ``sampled`` cases. A release whose config chain already crashed or
        cannot express the case boots no Scheduler worth stepping."""
        if self.steps_mode == "none":
            return []
        if self.steps_mode == "every":
            return list(self.release_targets)
        shown_models = {o.target for o in obs if o.level == "model"}
        shown_configs = {o.target for o in obs if o.level == "config"}
        # a connector path with no config chain the model predicts (one it does not mirror, or
        # the SimpleCPUOffloadConnector's) has no config outcome to point at releases: every
        # such case runs on the newest release, and in turn on an older one (and where the
        # model under a release's profile shows something)
        unscreened = not predicts_config(case.layout)
        sampled = sampled or unscreened
        older = self._older_in_turn() if sampled else None
        out = []
        for t in self.release_targets:
            if not unscreened and outcomes.get(t.name, {}).get("status") != "ok":
                continue
            if (f"model:{t.profile.name}" in shown_models or t.name in shown_configs
                    or (sampled and t is self.newest) or t is older):
                out.append(t)
        return out

    def _older_in_turn(self) -> ReleaseTarget | None:
        """Every fourth case of the share also runs on one older release, in turn, so that
        every release gets real steps the model did not ask for."""
        self._sampled_n += 1
        older = [t for t in self.release_targets if t is not self.newest]
        if not older or self._sampled_n % 4:
            return None
        return older[(self._sampled_n // 4) % len(older)]

    def evaluate(self, case: Case, sampled: bool = False) -> list[Seen]:
        """Run ``case`` on the model and the releases as :meth:`screen` decides; triaged."""
        outcomes: dict = {}
        t0 = time.perf_counter()
        obs = observe(case, self.model_targets, [], outcomes, steps=[])
        self.model_s += time.perf_counter() - t0
        for t in self.release_targets:
            t0 = time.perf_counter()
            obs += observe(case, [], [t], outcomes, steps=[])
            self._release_stats(t.version)["config_seconds"] += time.perf_counter() - t0
        stepped = self.screen(case, obs, outcomes, sampled)
        self._stepped_last = {t.name for t in stepped}
        obs += self.run_steps(case, stepped, outcomes)
        self._account(outcomes)
        return self.triage(case, obs, outcomes)

    def run_steps(self, case: Case, targets: list[ReleaseTarget], outcomes: dict,
                  traces: dict | None = None) -> list[Observation]:
        """Run ``case`` step by step on each of ``targets``' real Scheduler, counted per
        release (cases, real steps, seconds) whatever the phase: generating, shrinking,
        replaying a finding."""
        obs: list[Observation] = []
        for t in targets:
            t0 = time.perf_counter()
            obs += observe(case, [], [t], outcomes, config=False, traces=traces)
            st = self._release_stats(t.version)
            st["step_seconds"] += time.perf_counter() - t0
            st["step_cases"] += 1
            out = outcomes.get(t.name) or {}
            st["real_steps"] += out.get("steps", 0)
            path = self.per_path.setdefault(connector_path(case.layout),
                                            {"step_cases": 0, "real_steps": 0, "seconds": 0.0})
            path["step_cases"] += 1
            path["real_steps"] += out.get("steps", 0)
            path["seconds"] += time.perf_counter() - t0
        return obs

    def triage(self, case: Case, obs: list[Observation], outcomes: dict) -> list[Seen]:
        ran = {name: not out.get("findings") for name, out in outcomes.items()
               if not name.startswith("model:") and out.get("status") == "ran"}
        # a layout no engine builds (every release answers unsupported): what the model alone
        # shows on it, under a release's profile or a fix proposal's, is no deployment's
        undeployable = deployment_refusal(case.layout) is not None
        seen = []
        for o in obs:
            if o.level == "model":
                if undeployable:
                    continue
                t = tri.triage_model(o, ran, self.steps_mode != "none")
            else:
                t = tri.triage_release(o, case.layout, ran.get(o.target))
            if t is not None:
                seen.append(Seen(o, t.klass, t.key))
        # with no real step to tell, a prediction is told apart by the profiles that make it
        # (the release ranges the model predicts: on 0.30.0's profile the ring of PR #55037
        # and a lone Mamba group under DCP fail the same check, on different older profiles)
        shown: dict[str, list[str]] = {}
        for s in seen:
            if s.klass == tri.PREDICTED:
                shown.setdefault(str(s.obs.signature), []).append(s.obs.target)
        for s in seen:
            if s.klass == tri.PREDICTED:
                s.key = s.key + (tuple(sorted(shown[str(s.obs.signature)])),)
        return tri.only_proposals(seen)

    def fingerprint(self, case: Case, sig: Signature,
                    outcomes: dict | None = None) -> tuple[str, ...]:
        """The profiles whose config stage shows the crash ``sig`` on ``case`` (empty for findings
        that are not configuration crashes): kept fixed while shrinking a crash.

        Different bugs can raise from the same line of vLLM: on 0.30.0 the ring group of
        upstream PR #55037 (present in 0.29.0-0.30.0) and a lone Mamba group under DCP (0.27.0-
        0.30.0) fail the same assert of ``build_offloading_config``. They are one cluster (one
        crash state), with the release ranges of its variants listed; the model's profiles tell
        the variants apart, so a shrunk case does not slip from one variant to another
        (hypothesis guards against slips only by the line a test fails at, which is the same).
        Cheap: the config stage only, no step runs.
        """
        if sig.kind != "crash":
            return ()
        outcomes = outcomes or {}
        return tuple(t.profile.name for t in self.fingerprint_targets
                     if crash_signature(outcomes.get(t.name) or t.config(case)) == sig)

    def same_bug(self, case: Case, hunt: Hunt) -> bool:
        return self.fingerprint(case, hunt.signature) == hunt.fingerprint
    def _hunt_targets(self, seen: list[Seen], key: tuple) -> tuple[list, list, list, set]:
        """What to run while shrinking toward ``key``: the model targets, the releases' config
        chains and step runs that showed it (a model prediction also needs the step runs of
        its profile's releases, which tell a gap from a bug), and the targets that must still
        show it."""
        shown = {s.obs.target for s in seen if s.key == key}
        levels = {(s.obs.target, s.obs.level) for s in seen if s.key == key}
        models = [t for t in self.model_targets if t.name in shown]
        configs = [t for t in self.release_targets if (t.name, "config") in levels]
        # a cause the config chain already shows there needs no step run there to show it
        step_names = {name for name, lvl in levels
                      if lvl == "steps" and (name, "config") not in levels}
        for m in models:
            step_names |= {v for v in m.profile.releases if v in self._stepped_last}
        steps = [t for t in self.release_targets if t.name in step_names]
        return models, configs, steps, shown

    def shrink_run(self, case: Case, hunt: Hunt) -> list[Seen]:
        outcomes: dict = {}
        obs = observe(case, hunt.models, hunt.configs, outcomes, steps=[])
        obs += self.run_steps(case, hunt.steps, outcomes)
        return self.triage(case, obs, outcomes)
