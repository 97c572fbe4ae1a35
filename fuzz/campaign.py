"""A time-boxed fuzz campaign: generate cases, run them on every target, shrink each new cause.

One campaign round is one hypothesis run. The test body runs a case (:meth:`Campaign.evaluate`):

* the model under every behaviour profile, every step: the fast pre-screen;
* every release's config chain (boot and the first ``update_offload_keys``);
* the **real Scheduler, step by step**, of the releases the pre-screen points at (the model
  under the release's profile shows something, or the release's config differs from the
  model's), and of the newest release on a steady share of all cases whatever the model says
  (:data:`REAL_SHARE`), so that bugs the model does not foresee are still found.

Each observation is triaged (:mod:`fuzz.triage`): a class (bug, validation, model-gap,
proposal, predicted, tool-error) and a cluster key, the cause it stands for. While no cause is
being hunted, a cluster the campaign has not seen makes the body fail and hypothesis shrinks the
case; while shrinking, the body fails only when the hunted cluster still shows on the same
targets (and, for a crash, the same profiles' config stage shows it: see
:meth:`Campaign.fingerprint`). Each shrunk finding is then run step by step on every installed
release and every profile (so ``releases_clean`` means: ran every step there, nothing showed),
written to disk at once (case, pytest repro, report) and becomes known; a known cluster seen
again on another layout is a variant of it. A tool error (simsched itself raised) is never a
finding: its case is saved under ``tool-errors/`` and ``simsched fuzz`` exits non-zero.

Nothing is kept only in memory: ``report.json`` is rewritten atomically after every finding, and
a campaign started on an output folder that already holds findings resumes from them (and from the
hypothesis example database kept beside them).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable
from unittest import mock

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings, target
from hypothesis.errors import Flaky
from hypothesis.internal.conjecture import engine as hypothesis_engine

from fuzz import report as report_mod
from fuzz import repro as repro_mod
from fuzz import triage as tri
from fuzz.database import open_database
from fuzz.strategies import cases, edge_scores, family_of, planned_cases
from simsched.case import Case, Timing
from simsched.invariants import INV_OPS
from simsched.layout import Engine, Layout, LayoutError, deployment_refusal
from simsched.outcome import Observation, Signature, crash_signature, describe
from simsched.planning import REACHED, SYNTHETIC, deployment_reach, group_layout_reach, plan
from simsched.profiles import PROFILES
from simsched.replay import observe
from simsched.targets import ModelTarget, Releases, ReleaseTarget

TARGET_CHOICES = "all, config, lockstep, model, releases, or a release such as 0.30.0"

# How generation is steered toward the edges (``--steer``): ``target`` scores each case with
# :func:`fuzz.strategies.edge_scores` through ``hypothesis.target``; ``coverage`` scores it with
# the arc coverage it reaches in vLLM's offloading code inside the release workers (arcs new to
# the campaign, and a rarity score: see :mod:`simsched.vllm.inside.coverage`); ``both``; ``none``.
STEER_CHOICES = ("target", "coverage", "both", "none")
DEFAULT_STEER = "target"

#: the share of generated cases run step by step on the newest release whatever the pre-screen
#: says (BENCHMARKS.md, "The real side in the main campaign", measures the choice)
REAL_SHARE = 0.25

#: every fourth round draws model families as their layers, planned by a release (issue 20:
#: the layouts real deployments of those models get)
LAYERS_EVERY = 4

#: how the releases run each case: ``screen`` (the pre-screen and the share, the default),
#: ``every`` (every case step by step on every release), ``none`` (the config chain only)
STEP_MODES = ("screen", "every", "none")


class CampaignError(Exception):
    pass


@dataclass
class Finding:
    id: str
    key: tuple                     # the cluster key (fuzz.triage): one cause
    klass: str                     # bug, validation, model-gap, proposal, predicted
    signature: Signature
    case: Case
    present_on: tuple[str, ...]    # the campaign's targets showing it when found
    fingerprint: tuple[str, ...]   # the profiles whose config stage shows it (a shrink guard)
    first_target: str
    outcome: dict
    found_after_s: float
    examples_before: int
    releases_affected: list[str] = field(default_factory=list)
    releases_clean: list[str] = field(default_factory=list)
    profiles_affected: list[str] = field(default_factory=list)
    releases_not_run: dict = field(default_factory=dict)  # release -> why it did not run
    releases_other: dict = field(default_factory=dict)    # release -> what it shows instead
    releases_refused: dict = field(default_factory=dict)  # release -> its clean refusal
    outcomes: dict = field(default_factory=dict)     # target -> outcome of the shrunk case
    aliases: list[tuple] = field(default_factory=list)   # keys of the same cause (asserts twins)
    variants: list[dict] = field(default_factory=list)   # other cases showing it, unshrunk
    installed: tuple[str, ...] = ()
    cluster: str = ""              # the cluster it joins; default: its own key's
    deployment: str = ""           # how a deployment reaches it; default: planning.deployment_reach

    def to_json(self) -> dict:
        o = self.outcome
        step = o.get("step") if o.get("stage") not in tri.START_UP_STAGES else None
        return {
            "id": self.id, "class": self.klass,
            "cluster": self.cluster or tri.cluster_name(self.key),
            "cluster_key": _as_list(self.key), "aliases": [_as_list(a) for a in self.aliases],
            "signature": str(self.signature), "kind": self.signature.kind,
            "exception": self.signature.exception or None,
            "function": (self.signature.function if self.signature.kind == "crash" else None),
            "field": (self.signature.function if self.signature.kind == "divergence" else None),
            "invariant": self.signature.invariant or None,
            "op": o.get("op") or INV_OPS.get(self.signature.invariant),
            "file": o.get("file"), "line": o.get("line"), "source": o.get("source"),
            "stage": o.get("stage"), "message": o.get("message") or o.get("detail"),
            "first_bad_step": step,
            "asserts": self.case.asserts,
            "releases_affected": self.releases_affected, "releases_clean": self.releases_clean,
            "releases_not_run": self.releases_not_run,
            "releases_other": self.releases_other,
            "releases_refused": self.releases_refused,
            "range": tri.regressed_fixed(self.releases_affected, self.releases_clean,
                                         list(self.installed), list(self.releases_refused)),
            "profiles_affected": self.profiles_affected,
            "present_on": list(self.present_on),
            "fingerprint": list(self.fingerprint),
            "first_target": self.first_target,
            "layout": self.case.layout.describe(),
            "deployment": self.deployment or deployment_reach(self.case.layout),
            "case": f"repros/{self.id}/case.json",
            "groups": len(self.case.layout.groups), "requests": len(self.case.requests),
            "steps": o.get("steps", 1),
            "variants": self.variants,
            "found_after_s": round(self.found_after_s, 3),
            "examples_before": self.examples_before,
        }


SHRINK_SECONDS = 10.0
MAX_VARIANTS = 12


def simplify(case: Case, still_shows, obs, seconds: float = SHRINK_SECONDS):
    """What hypothesis's shrinker cannot do across layout families: drop whole groups, requests
    and engine knobs, one at a time, keeping each change under which the finding still shows;
    for at most ``seconds`` (each try may run real releases step by step)."""
    stop = time.monotonic() + seconds
    def candidates(c: Case):
        # a layout of layers is a model as a deployment declares it, its groups the planner's:
        # it stays whole (a group dropped or a flag reset would pair the layers with groups no
        # planner builds from them), and only the workload shrinks
        groups = () if c.layout.layers else c.layout.groups
        for i in range(len(groups)):
            if len(groups) > 1:
                rest = groups[:i] + groups[i + 1:]
                if not any(g.drafter for g in rest) or c.layout.engine.speculative is not None:
                    yield replace(c, layout=replace(c.layout, groups=rest))
        for i in range(1, len(c.requests)):
            yield replace(c, requests=c.requests[:i] + c.requests[i + 1:])
        for i in range(len(c.events)):
            yield replace(c, events=c.events[:i] + c.events[i + 1:])
        if c.faults:
            yield replace(c, faults=())
        if c.timing.jobs:
            yield replace(c, timing=replace(c.timing, jobs=()))
        for i, r in enumerate(c.requests):
            if r.skip_reading_prefix_cache:
                plain = replace(r, skip_reading_prefix_cache=False)
                yield replace(c, requests=c.requests[:i] + (plain,) + c.requests[i + 1:])
        default = Engine()
        for f in fields(Engine) if not c.layout.layers else ():
            if getattr(c.layout.engine, f.name) != getattr(default, f.name):
                yield replace(c, layout=c.layout.with_engine(**{f.name: getattr(default, f.name)}))
        if c.timing != Timing():
            yield replace(c, timing=Timing())

    improved = True
    while improved:
        improved = False
        for cand in candidates(case):
            if time.monotonic() > stop:
                return case, obs
            try:
                Layout.from_json(cand.layout.to_json())   # still a valid layout
            except LayoutError:
                continue
            found = still_shows(cand)
            if found is not None:
                case, obs, improved = cand, found, True
                break
    return case, obs


def knobs_of(case: Case) -> set[str]:
    """The knobs a case sets, for the report's ``knobs`` coverage: the engine's, the requests'
    (``requests.<field>``), per-job timings, events, faults, and the kinds of its groups (``kind:``)."""
    return (set(case.layout.engine.to_json())
            | {f"requests.{k}" for r in case.requests for k in r.to_json()
               if k not in ("id", "prompt")}
            | {f"timing.jobs.{j.kind}" for j in case.timing.jobs}
            | {"timing.jobs.never" for j in case.timing.jobs if j.latency is None}
            | {f"events.{e.do}" for e in case.events}
            | {f"faults.{f.kind}" for f in case.faults}
            | ({"requests.prompt.sampled"} if case.repeated_outputs() else set())
            | {"groups.extra_retained_tokens" for g in case.layout.groups
               if g.extra_retained_tokens}
            # a Mamba group's speculative state blocks: a deployment's, whenever it drafts
            | ({"groups.num_speculative_blocks"} if case.layout.num_speculative_blocks
               and any(g.kind == "mamba" for g in case.layout.groups) else set())
            | {f"kind:{g.kind}" for g in case.layout.groups})


def load_findings(out: Path) -> tuple[list[dict], list[tuple[Path, str]]]:
    """Every finding on disk (``repros/<id>/finding.json``, the durable record, written before
    the report), and the files that could not be read (named, left in place, never deleted)."""
    found, damaged = [], []
    for path in sorted((Path(out) / "repros").glob("*/finding.json")):
        try:
            data = json.loads(path.read_text())
            finding_keys(data)
        except (OSError, ValueError, KeyError, TypeError) as e:
            damaged.append((path, str(e)))
            continue
        found.append(data)
    return found, damaged


def present_on(targets) -> tuple[str, ...]:
    """Where a finding shows: the releases if any, else the model profiles."""
    releases = sorted({t for t in targets if not t.startswith("model:")})
    return tuple(releases) if releases else tuple(sorted(set(targets)))


def finding_id(key: tuple) -> str:
    """A stable, readable id: the cluster's name."""
    return tri.cluster_name(key)


def _as_list(key: tuple) -> list:
    """A cluster key as JSON holds it (its nested tuples as lists)."""
    return [_as_list(v) if isinstance(v, tuple) else v for v in key]


def _as_key(value) -> tuple:
    return tuple(_as_key(v) if isinstance(v, list) else v for v in value)


def finding_keys(data: dict) -> set[tuple]:
    """The cluster keys a finding read from disk stands for (its own and its aliases')."""
    return {_as_key(data["cluster_key"])} | {_as_key(a) for a in data.get("aliases", [])}


def parse_target(target: str, installed: list[str]) -> tuple[bool, list[str], str]:
    """(run the model?, releases to run, step mode) for a ``--target`` value."""
    def need(what: str) -> None:
        if not installed:
            raise CampaignError(f"--target {what}: no vLLM release is installed "
                                "(run: simsched releases install)")
    if target == "all":
        return True, installed, "screen" if installed else "none"
    if target == "model":
        return True, [], "none"
    if target == "config":
        return True, installed, "none"
    if target in ("releases", "lockstep"):
        need(target)
        return target == "lockstep", installed, "every"
    if target.count(".") == 2 and all(p.isdigit() for p in target.split(".")):
        if target not in installed:
            raise CampaignError(f"--target {target}: release not installed "
                                f"(installed: {', '.join(installed) or 'none'}); "
                                f"run: simsched releases install {target}")
        return False, [target], "every"
    raise CampaignError(f"--target {target!r}: expected {TARGET_CHOICES}")


@dataclass
class Seen:
    """One triaged observation of a case: the observation, its class and its cluster key."""

    obs: Observation
    klass: str
    key: tuple


class Campaign:
    def __init__(self, out: Path, releases: Releases, *, model: bool = True,
                 run_releases: list[str] | None = None, budget: float = 120.0, seed_: int = 0,
                 asserts: bool | None = True, progress: Callable[[str], None] | None = None,
                 round_examples: int = 300, steps: str | None = None,
                 steer: str | bool = DEFAULT_STEER, real_share: float = REAL_SHARE,
                 database=None, stats_name: str = "report",
                 stop_when: Callable[[Finding], bool] | None = None,
                 verify_repros: bool = False):
        self.out = Path(out)
        # a bug's vLLM-only test is always written; running it on every installed release
        # (about 20 s a release) only when asked
        self.verify_repros = verify_repros
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
        self.budget = budget
        self.seed = seed_
        self.asserts = asserts
        self.progress = progress or (lambda s: print(s, file=sys.stderr, flush=True))
        self.round_examples = round_examples
        if steer is True or steer is False:
            steer = DEFAULT_STEER if steer else "none"
        if steer not in STEER_CHOICES:
            raise CampaignError(f"--steer {steer!r}: expected one of {', '.join(STEER_CHOICES)}")
        if steer in ("coverage", "both") and not self.release_targets:
            raise CampaignError(f"--steer {steer}: coverage steering measures vLLM's code inside "
                                "the release workers; this campaign runs no release (use "
                                "--steer target with --target model)")
        if steer in ("coverage", "both") and not releases.coverage:
            raise CampaignError(f"--steer {steer}: the release pool does not collect coverage "
                                "(Releases(..., coverage=True))")
        self.steer = steer
        # arcs of vLLM's offloading code covered (only with a coverage-collecting pool)
        self.collect_coverage = bool(releases.coverage and self.release_targets)
        self.arcs = 0
        self.arcs_timeline: list[dict] = []
        self.samples: list[dict] = []     # progress over time, for the report's plots
        self.shrinking_s = 0.0            # seconds spent shrinking and recording findings
        self._sample_every = 1.0
        self.database = database
        self.stats_name = stats_name     # a worker process writes workers/<name>.json instead
        self.stop_when = stop_when       # ends the campaign early (benchmarks)
        self.interrupted = False
        self.steps = 0                   # model steps
        self.per_release: dict[str, dict] = {}   # version -> cases, real steps, seconds
        self.model_s = 0.0               # seconds in the model under every profile
        self.findings: dict[tuple, Finding] = {}
        self.written: set[tuple] = set()   # keys whose folder write_repro finished
        self.prior: list[dict] = []
        self.damaged: set[Path] = set()
        self.tool_errors: dict[tuple, dict] = {}
        self.set_aside: set[tuple] = set()   # causes not hunted again (flaky, or aliases)
        self.examples = 0
        self.families: dict[str, int] = {}
        self.knobs: dict[str, int] = {}
        self.layers: dict[str, int] = {}   # layouts of layers: planned, refused, unsupported
        self.timeline: list[dict] = []
        self.started = 0.0
        self.warmup_s = 0.0
        self._stepped_last: set[str] = set()
        self._sampled_n = 0              # cases of the share so far (the older releases' turn)

    # --- evaluating one case ---------------------------------------------------------------

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
        older = self._older_in_turn() if sampled else None
        out = []
        for t in self.release_targets:
            if outcomes.get(t.name, {}).get("status") != "ok":
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
        obs += self._step(case, stepped, outcomes)
        self._account(outcomes)
        return self.triage(case, obs, outcomes)

    def _step(self, case: Case, targets: list[ReleaseTarget], outcomes: dict,
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

    def same_bug(self, case: Case, hunt: "Hunt") -> bool:
        return self.fingerprint(case, hunt.signature) == hunt.fingerprint

    # --- the rounds -----------------------------------------------------------------------

    def _count(self, case: Case) -> None:
        self.examples += 1
        self._sample()
        fam = family_of(case.layout)
        self.families[fam] = self.families.get(fam, 0) + 1
        for k in knobs_of(case):
            self.knobs[k] = self.knobs.get(k, 0) + 1

    def _sampled(self) -> bool:
        """Is the current example one of the share run on the newest release regardless?"""
        every = max(1, round(1 / self.real_share)) if self.real_share > 0 else 0
        return bool(every) and self.examples % every == 1 % every

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

    def _note_tool_error(self, case: Case, s: Seen) -> None:
        """simsched's own failure: the case saved under tool-errors/, never a finding."""
        if s.key in self.tool_errors:
            self.tool_errors[s.key]["count"] += 1
            return
        name = tri.cluster_name(s.key)
        folder = self.out / "tool-errors" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "case.json").write_text(case.dumps())
        entry = {"id": name, "exception": s.obs.signature.exception,
                 "function": s.obs.signature.function, "target": s.obs.target,
                 "message": s.obs.outcome.get("message"), "layout": case.layout.describe(),
                 "case": f"tool-errors/{name}/case.json", "count": 1}
        (folder / "error.json").write_text(json.dumps(entry, indent=1) + "\n")
        self.tool_errors[s.key] = entry
        self.progress(f"tool error (simsched, not vLLM): {entry['exception']} in "
                      f"{entry['function']} on {entry['target']}; case saved in {entry['case']}")

    def _note_variant(self, case: Case, s: Seen) -> None:
        f = next((f for f in self.findings.values() if s.key == f.key or s.key in f.aliases),
                 None)
        if f is None or len(f.variants) >= MAX_VARIANTS:
            return
        v = {"layout": case.layout.describe(), "asserts": case.asserts, "target": s.obs.target,
             "signature": str(s.obs.signature)}
        if v not in f.variants:
            f.variants.append(v)

    def _strategy(self, round_no: int):
        """Every LAYERS_EVERY-th round draws model families as their layers
        (:func:`fuzz.strategies.planned_cases`) when a release can plan them; the others draw
        layouts of groups."""
        if self.newest is not None and round_no % LAYERS_EVERY == LAYERS_EVERY - 1:
            return planned_cases(asserts=self.asserts)
        return cases(asserts=self.asserts)

    def _planned(self, case: Case) -> Case | None:
        """A layout of layers with the groups the newest stepped release's planner builds (the
        harness of every other release plans it again: ``unsupported`` where its planner
        builds other groups). None where that release's engine does not start (counted in the
        report's ``layers``), or it cannot plan the case."""
        planned, out = plan(case, self.newest.version, self.pool)
        status = out["status"] if planned is None else "planned"
        self.layers[status] = self.layers.get(status, 0) + 1
        return planned

    def _round(self, round_no: int, deadline: float, db) -> Finding | None:
        state: dict = {"hunt": None, "case": None, "seen": None, "t": 0.0, "n": 0, "first": None}
        known = self.known_keys()
        if self.collect_coverage:
            self._take_coverage()   # replaying the last finding is no generated case's novelty

        class Found(Exception):
            pass

        # @settings above @seed: @seed alone turns the example database off.
        @settings(database=db, max_examples=self.round_examples, deadline=None,
                  report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet,
                  suppress_health_check=list(HealthCheck),
                  phases=(Phase.reuse, Phase.generate, Phase.target, Phase.shrink))
        @seed(self.seed * 1_000_003 + round_no)
        @given(self._strategy(round_no))
        def body(case: Case) -> None:
            if not case.layout.planned:
                case = self._planned(case)
                if case is None:
                    return
            hunt: Hunt | None = state["hunt"]
            if hunt is None:
                if time.monotonic() > deadline:
                    return
                self._count(case)
                self._maybe_progress()
                if self.steer in ("target", "both"):
                    for label, score in edge_scores(case).items():
                        target(score, label=label)
                seen = self.evaluate(case, sampled=self._sampled())
                if self.collect_coverage:
                    cov = self._take_coverage()
                    if self.steer in ("coverage", "both"):
                        target(float(cov["new"]), label="coverage-new")
                        target(float(cov["rare"]), label="coverage-rare")
                for s in seen:
                    if s.klass == tri.TOOL_ERROR:
                        self._note_tool_error(case, s)
                    elif s.key in known:
                        self._note_variant(case, s)
                new = sorted({(tri.CLASSES.index(s.klass), s.key): s for s in seen
                              if s.klass != tri.TOOL_ERROR and s.key not in known}.items(),
                             key=lambda kv: (kv[0][0], repr(kv[0][1])))
                if not new:
                    return
                first = new[0][1]
                state["t"] = time.monotonic() - self.started
                state["n"] = self.examples
                state["first"] = (case, first)
                models, configs, steps, shown = self._hunt_targets(seen, first.key)
                hunt = state["hunt"] = Hunt(first.key, first.klass, first.obs.signature,
                                            self.fingerprint(case, first.obs.signature),
                                            models, configs, steps, frozenset(shown))
                self.progress(f"[{state['t']:6.1f}s] new {first.klass}: {first.obs.signature} "
                              f"on {', '.join(sorted(shown))}; shrinking ...")
            else:   # while shrinking, run only the targets the hunted cause needs
                if not self.same_bug(case, hunt):
                    return
                seen = self.shrink_run(case, hunt)
                if self.collect_coverage:
                    self._take_coverage()    # what shrinking covers is nobody's novelty
            shown = hunt.showing(seen)
            if shown is not None:
                state["case"] = case
                state["seen"] = shown
                raise Found(repr(hunt.key))

        # Shrinking is bounded by hypothesis's own MAX_SHRINKING_SECONDS (300 s); a campaign keeps
        # its budget and looks for more than one finding, so a round shrinks for at most
        # SHRINK_SECONDS (and never past the budget by more than 5 s); simplify() finishes the job.
        shrink_s = max(5.0, min(SHRINK_SECONDS, deadline - time.monotonic()))
        try:
            with mock.patch.object(hypothesis_engine, "MAX_SHRINKING_SECONDS", shrink_s):
                body()
        except Flaky:
            # shown once, not again on the same case: a run that is not deterministic (the
            # harness's or vLLM's). Never a finding; its case is kept as a tool error
            case, first = state["first"]
            self._note_tool_error(case, Seen(Observation(
                Signature("crash", "Nondeterministic", str(first.obs.signature)),
                first.obs.target, {"message": f"{first.klass} {tri.cluster_name(first.key)} "
                                   "showed once and not again on the same case"}),
                tri.TOOL_ERROR, ("tool", "Nondeterministic", repr(first.key))))
            self.set_aside.add(first.key)
            return None
        except Found:
            hunt = state["hunt"]

            def still_shows(case: Case) -> Seen | None:
                if not self.same_bug(case, hunt):
                    return None
                return hunt.showing(self.shrink_run(case, hunt))

            case, s = simplify(state["case"], still_shows, state["seen"])
            if s.key != hunt.key and s.key in self.known_keys():
                # shrunk onto a cause found already (an invariant on fewer group kinds): a
                # variant of it, and the hunted key its alias, never hunted again
                f = self.findings.get(s.key)
                if f is not None:
                    f.aliases.append(hunt.key)
                else:
                    self.set_aside.add(hunt.key)
                self._note_variant(state["case"], s)
                return None
            # the cause under its key on the shrunk case (an invariant's, on fewer group kinds)
            return Finding(id=finding_id(s.key), key=s.key, klass=hunt.klass,
                           aliases=[hunt.key] if s.key != hunt.key else [],
                           signature=s.obs.signature, case=case,
                           present_on=present_on(hunt.shown), fingerprint=hunt.fingerprint,
                           first_target=s.obs.target, outcome=s.obs.outcome,
                           found_after_s=state["t"], examples_before=state["n"],
                           installed=tuple(self.pool.versions))
        return None

    def shrink_run(self, case: Case, hunt: "Hunt") -> list[Seen]:
        outcomes: dict = {}
        obs = observe(case, hunt.models, hunt.configs, outcomes, steps=[])
        obs += self._step(case, hunt.steps, outcomes)
        return self.triage(case, obs, outcomes)

    def replay_everywhere(self, finding: Finding) -> None:
        """Run a shrunk finding on every profile and, step by step, on every installed release;
        fill in where its cause shows, where it ran clean, and where it could not run. A bug seen
        with asserts stripped is run with asserts on too (and the other way round): what the
        other mode shows on the same releases is the same cause (its aliases)."""
        outcomes: dict = {}
        obs = observe(finding.case, self.fingerprint_targets, self.all_release_targets, outcomes,
                      steps=[])
        obs += self._step(finding.case, self.all_release_targets, outcomes)
        seen = self.triage(finding.case, obs, outcomes)
        finding.outcomes = outcomes
        classes = [s.klass for s in seen if s.key == finding.key]
        if classes:   # every release and profile ran now: the class they say
            finding.klass = min(classes, key=lambda k: (tri.CLASSES + (tri.TOOL_ERROR,)).index(k))
        if finding.signature.kind == "crash" and finding.klass == tri.BUG:
            finding.aliases = self._moved(finding, seen)
        refusals = self._refusals(finding, seen)
        finding.aliases = sorted(set(finding.aliases) | {s.key for s in refusals.values()},
                                 key=repr)
        keys = {finding.key, *finding.aliases}
        hit = {s.obs.target for s in seen if s.key in keys}
        finding.profiles_affected = [p for p in PROFILES if any(
            o.target == f"model:{p}" and o.signature == finding.signature for o in obs)]
        # a release where the case shows another crash or broken invariant is not clean:
        # clean means it ran every step there and nothing showed
        other = {s.obs.target: str(s.obs.signature) for s in seen
                 if s.obs.level != "model" and s.key not in keys
                 and s.klass in (tri.BUG, tri.VALIDATION)}
        for t in self.all_release_targets:
            outcome = outcomes[t.name]
            if t.name in refusals:
                sig = refusals[t.name].obs.signature
                finding.releases_refused[t.name] = f"refuses it at start-up: {sig}"
            elif t.name in hit:
                finding.releases_affected.append(t.name)
            elif t.name in other:
                finding.releases_other[t.name] = f"shows {other[t.name]} instead"
            elif outcome.get("status") == "ran":
                finding.releases_clean.append(t.name)
            else:
                finding.releases_not_run[t.name] = describe(outcome)
        if finding.klass == tri.BUG and finding.releases_affected:
            finding.aliases = sorted(set(finding.aliases) | set(self._twins(finding)), key=repr)
            self._judge_reach(finding)

    def _judge_reach(self, finding: Finding) -> None:
        """A bug on a layout of groups written by hand: each affected release's planner says
        whether it builds those groups for some model (``planning.group_layout_reach``). Where
        none does, no deployment reaches the state: the finding is ``synthetic``, with the
        planner's answer as its reason."""
        if finding.case.layout.layers:
            return
        by_version = {t.version: t for t in self.all_release_targets}
        answers = {v: group_layout_reach(finding.case, v, by_version[v].pool)
                   for v in finding.releases_affected if v in by_version}
        reached = [why for how, why in answers.values() if how == REACHED]
        if reached:
            finding.deployment = f"reached: {reached[-1]}"
        elif answers and all(how == SYNTHETIC for how, _ in answers.values()):
            finding.klass = tri.SYNTHETIC
            finding.deployment = f"synthetic: {list(answers.values())[-1][1]}"
        elif answers:
            finding.deployment = (f"written as groups, not checked against a planner: "
                                  f"{list(answers.values())[-1][1]}")

    @staticmethod
    def _moved(finding: Finding, seen: list[Seen]) -> list[tuple]:
        """The same crash where a release's code has it elsewhere: the shrunk case raises the
        same exception on another release from the same function in another file or line
        (0.33.0 moved ``get_sliding_window_size_in_chunks`` into ``offloading/config.py``), or
        from the same statement in another function (0.25.1 keeps the offload checks in
        ``OffloadingSpec.__init__``), or with the same message, its numbers aside (a check
        rewritten with the same words), or at the same start-up stage (a check moved and
        rewritten: 0.25.1's ``OffloadingSpec.__init__`` asserts ``offloaded_block_size %
        gpu_block_size == 0`` where 0.26.0's ``build_offloading_config`` asserts
        ``tokens_per_chunk % tokens_per_block == 0``; the shrunk case is the one configuration
        both refuse). Another exception (an assert that became a ``ValueError``), statement,
        function, message and stage is another finding."""
        _, exc, _, function, source = finding.key
        words = tri.message_words(finding.outcome.get("message"))
        stage = finding.outcome.get("stage")
        start_up = stage in tri.START_UP_STAGES
        return sorted({s.key for s in seen if s.klass == tri.BUG and s.obs.level != "model"
                       and s.key[0] == "crash" and s.key != finding.key and s.key[1] == exc
                       and (s.key[3] == function or s.key[4] == source
                            or (words and tri.message_words(s.obs.outcome.get("message"))
                                == words)
                            or (start_up and s.obs.outcome.get("stage") == stage))},
                      key=repr)

    @staticmethod
    def _refusals(finding: Finding, seen: list[Seen]) -> dict[str, Seen]:
        """Releases that refuse a start-up crash's shrunk case with a clean error: one cause
        with the crash, its fix where they come after it (the offload block smaller than the
        GPU block: 0.25.1-0.29.0 assert in ``build_offloading_config``, 0.30.0 raises a
        ``ValueError`` saying which block size to use; a lone ring group: 0.29.0-0.30.0 assert
        in ``get_sliding_window_size_in_chunks``, 0.31.0 finds no eligible cache group), and
        where they come before it, the check the crash replaced (the range says "regressed
        in")."""
        if (finding.klass != tri.BUG or finding.signature.kind != "crash"
                or finding.outcome.get("stage") not in tri.START_UP_STAGES):
            return {}
        return {s.obs.target: s for s in seen
                if s.obs.level != "model" and s.klass == tri.VALIDATION}

    def _twins(self, finding: Finding) -> list[tuple]:
        """The bug keys the case shows in the other asserts mode on the affected releases: one
        cause, seen once as the assert that guards against it and once as what breaks where
        ``python -O`` strips that assert (a ring group offloaded: 0.29.0's boot assert with
        asserts on, its one block stored under a prefix key without them)."""
        other = replace(finding.case, asserts=not finding.case.asserts)
        targets = [t for t in self.all_release_targets if t.name in finding.releases_affected]
        outcomes: dict = {}
        seen = self.triage(other, self._step(other, targets, outcomes), outcomes)
        return sorted({s.key for s in seen if s.klass == tri.BUG and s.key != finding.key},
                      key=repr)

    def _sample(self) -> None:
        """Record (seconds, examples, findings) about every second; past 400 samples, every
        other one is dropped and the interval doubles, so an overnight run keeps a short list."""
        t = time.monotonic() - self.started
        if self.samples and t - self.samples[-1]["t"] < self._sample_every:
            return
        self.samples.append({"t": round(t, 3), "examples": self.examples,
                             "findings": len(self.findings)})
        if len(self.samples) > 400:
            self.samples = self.samples[::2]
            self._sample_every *= 2

    def _take_coverage(self) -> dict:
        cov = self.pool.take_coverage([t.version for t in self.release_targets])
        self.arcs = cov["total"]
        t = round(time.monotonic() - self.started, 3)
        if not self.arcs_timeline or t - self.arcs_timeline[-1]["t"] >= 1.0:
            self.arcs_timeline.append({"t": t, "examples": self.examples, "arcs": self.arcs})
        return cov

    def _maybe_progress(self) -> None:
        now = time.monotonic()
        if now - getattr(self, "_last_progress", 0.0) < 5.0:
            return
        self._last_progress = now
        el = now - self.started
        kinds = sum(1 for k in self.knobs if k.startswith("kind:"))
        knobs = sum(1 for k in self.knobs if not k.startswith("kind:"))
        real = sum(st["real_steps"] for st in self.per_release.values())
        self.progress(f"[{el:6.1f}s] {self.examples} examples ({self.examples / max(el, 1e-9):.0f}/s)"
                      f", {self.steps / max(el, 1e-9):,.0f} model steps/s, "
                      f"{real / max(el, 1e-9):,.0f} real steps/s, "
                      f"{len(self.findings) + len(self.prior)} findings, families "
                      f"{len(self.families)}, kinds {kinds}/8, knobs {knobs}"
                      + (f", {self.arcs} vLLM arcs" if self.collect_coverage else ""))

    def load_prior(self) -> None:
        """Findings already on disk, from this or another process (see :func:`load_findings`)."""
        seen = {f.id for f in self.findings.values()}
        found, damaged = load_findings(self.out)
        for path, why in damaged:
            if path not in self.damaged:
                self.damaged.add(path)
                self.progress(f"warning: {path}: not a readable finding ({why}); left as is")
        self.prior = [f for f in found if f["id"] not in seen]

    def known_keys(self) -> set:
        """The cluster keys found so far, here and by other worker processes (on disk)."""
        self.load_prior()
        keys = set(self.findings) | self.set_aside
        for f in self.findings.values():
            keys.update(f.aliases)
        for data in self.prior:
            keys |= finding_keys(data)
        return keys

    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        self.load_prior()
        if self.release_targets or self.all_release_targets:
            modes = (True, False) if self.asserts is None else (self.asserts,)
            self.progress(f"starting {len(self.pool.versions) * len(modes)} release workers "
                          f"({', '.join(self.pool.versions)}) ...")
            self.warmup_s, errors = self.pool.warm(modes)
            for e in errors:   # the worker restarts on first use; what it does then is recorded
                self.progress(f"warning: {e}")
            if self.collect_coverage:   # count what the campaign's cases cover, not start-up
                self.pool.reset_coverage()
            self.progress(f"workers ready in {self.warmup_s:.1f} s; fuzzing for {self.budget:g} s")
        self.started = time.monotonic()
        deadline = self.started + self.budget
        db = self.database if self.database is not None else open_database(None, self.out)
        if self.prior:
            self.progress(f"resuming: {len(self.prior)} findings already in {self.out}")
        round_no = 0
        self.write_report()
        try:
            while time.monotonic() < deadline:
                finding = self._round(round_no, deadline, db)
                round_no += 1
                if finding is not None:
                    self._record(finding)
                    # from the case that showed it to its files on disk: no generation meanwhile
                    self.shrinking_s += time.monotonic() - self.started - finding.found_after_s
                    if self.stop_when is not None and self.stop_when(finding):
                        break
        except KeyboardInterrupt:
            self.interrupted = True
            self.progress("interrupted: every finding so far is on disk; run the same command "
                          "again to resume")
        return self.write_report(final=True)

    def _record(self, finding: Finding) -> None:
        self.replay_everywhere(finding)
        # an alias already found on its own (the crash as an older release raises it, the other
        # asserts mode): this finding is a variant of that cluster
        for data in [f.to_json() for f in self.findings.values()] + self.prior:
            if finding_keys(data) & set(finding.aliases):
                finding.cluster = data["cluster"]
                break
        self.findings[finding.key] = finding
        repro_mod.write_repro(self.out, finding,      # the durable record, first
                              verify=self.verify_repros)
        self.written.add(finding.key)
        self.timeline.append({"t": round(finding.found_after_s, 3), "id": finding.id,
                              "examples": finding.examples_before})
        self.write_report()
        self.progress(f"[{time.monotonic() - self.started:6.1f}s] finding {finding.id}: "
                      f"[{finding.klass}] {finding.case.layout.describe()} | affected "
                      f"{', '.join(finding.releases_affected) or '-'} | profiles "
                      f"{', '.join(finding.profiles_affected) or '-'}")

    def write_report(self, final: bool = False) -> dict:
        """report.json and report.md (and, when ``final``, the plots report.md links); a worker
        process writes its figures to workers/<n>.json instead, and the parent merges them
        (:func:`fuzz.report.merge`)."""
        el = time.monotonic() - self.started if self.started else 0.0
        new = [f.to_json() for f in self.findings.values()]
        new_ids = {f["id"] for f in new}
        findings = [f for f in self.prior if f["id"] not in new_ids] + new
        data = {
            "format": "simsched-report/1",
            "seed": self.seed, "budget_s": self.budget, "elapsed_s": round(el, 3),
            "interrupted": self.interrupted,
            "worker_startup_s": round(self.warmup_s, 3),
            "examples": self.examples,
            "examples_per_s": round(self.examples / el, 1) if el else 0.0,
            "shrinking_s": round(self.shrinking_s, 3),
            "model_steps": self.steps,
            "model_steps_per_s": round(self.steps / el, 1) if el else 0.0,
            "targets": ([t.name for t in self.model_targets]
                        + [t.name for t in self.release_targets]),
            "steps_mode": self.steps_mode, "real_share": self.real_share,
            "releases_installed": list(self.pool.versions),
            "families": dict(sorted(self.families.items())),
            "knobs": dict(sorted(self.knobs.items())),
            "layers": dict(sorted(self.layers.items())),
            "timeline": self.timeline,
            "samples": self.samples + [{"t": round(el, 3), "examples": self.examples,
                                        "findings": len(self.findings)}],
            "steer": self.steer,
            # step_seconds: the real run and the model's trace it is diffed with (lockstep)
            "per_release": {v: {k: round(x, 3) for k, x in st.items()}
                            for v, st in sorted(self.per_release.items(),
                                                key=lambda kv: tri._vkey(kv[0]))},
            "seconds": {"model": round(self.model_s, 3), "shrinking": round(self.shrinking_s, 3),
                        **{v: round(st["config_seconds"] + st["step_seconds"], 3)
                           for v, st in self.per_release.items()}},
            "tool_errors": list(self.tool_errors.values()),
            "findings": findings,
        }
        data["summary"] = report_mod.summary(data)
        if self.collect_coverage:
            data["vllm_arcs"] = self.arcs
            data["arcs_timeline"] = self.arcs_timeline + [
                {"t": round(el, 3), "examples": self.examples, "arcs": self.arcs}]
        if final:   # the variants seen since each finding was written
            for f in self.findings.values():
                if f.key in self.written:
                    repro_mod.write_finding(self.out, f)
                else:   # interrupted while its folder was written: finish it, finding.json last
                    repro_mod.write_repro(self.out, f)
        if self.stats_name == "report":
            report_mod.write(self.out, data, plots=final)
        else:
            report_mod.write_worker_stats(self.out, self.stats_name, data)
        return data


@dataclass
class Hunt:
    """The cause a round shrinks toward, and what must run to see it."""

    key: tuple
    klass: str
    signature: Signature
    fingerprint: tuple[str, ...]
    models: list
    configs: list
    steps: list
    shown: frozenset       # the targets that must still show it

    def matches(self, key: tuple) -> bool:
        """``key`` stands for the hunted cause: the same key; or, for an invariant, the same ID
        and operation on fewer group kinds. An invariant's key names the layout's kinds where
        the run names no group it broke in (a stall), so a shrink that drops a group whose
        kind does not matter changes the key: a Mamba block wider than the budget stalls
        0.25.1-0.26.0 alone as beside a full-attention group, one cause."""
        if key == self.key:
            return True
        return (key[0] == self.key[0] == "invariant" and key[1:3] == self.key[1:3]
                and set(key[3].split("+")) < set(self.key[3].split("+")))

    def showing(self, seen: list[Seen]) -> Seen | None:
        """The observation of the hunted cause, if every target that must still show it does."""
        hits = [s for s in seen if self.matches(s.key)]
        if not self.shown <= {s.obs.target for s in hits}:
            return None
        return next((s for s in hits if s.key == self.key), hits[0])

    def still_shown(self, seen: list[Seen]) -> bool:
        return self.showing(seen) is not None
