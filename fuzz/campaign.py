"""A time-boxed fuzz campaign: generate cases, run them on every target, shrink each new finding.

One campaign round is one hypothesis run. The test body runs a case on every target and turns the
outcomes into signatures. While no finding is being hunted, a signature the campaign has not seen
makes the body fail, and hypothesis shrinks the case; while shrinking, the body fails only when the
hunted signature is still present, on the same targets and with the same model fingerprint (the
profiles showing it, see :meth:`Campaign.fingerprint`), so the shrunk case shows the same finding.
Each shrunk finding is replayed on every installed release and every profile, written to disk at
once (case, pytest repro, report) and becomes known; the next round looks for the next one.

Nothing is kept only in memory: ``report.json`` is rewritten atomically after every finding, and
a campaign started on an output folder that already holds findings resumes from them (and from the
hypothesis example database kept beside them).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable
from unittest import mock

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings, target
from hypothesis.internal.conjecture import engine as hypothesis_engine

from fuzz import report as report_mod
from fuzz import repro as repro_mod
from fuzz.database import open_database
from fuzz.strategies import cases, edge_scores, family_of
from simsched.case import Case, Timing
from simsched.layout import Engine, Layout, LayoutError
from simsched.geometry import PROFILES
from simsched.outcome import Signature, crash_signature, describe
from simsched.replay import Observation, observe
from simsched.targets import ModelTarget, Releases, ReleaseTarget

TARGET_CHOICES = "model, a release such as 0.30.0, releases, lockstep, or all"

# How generation is steered toward the edges (``--steer``): ``target`` scores each case with
# :func:`fuzz.strategies.edge_scores` through ``hypothesis.target``; ``coverage`` scores it with
# the arc coverage it reaches in vLLM's offloading code inside the release workers (arcs new to
# the campaign, and a rarity score: see :mod:`simsched.vllm.inside.coverage`); ``both``; ``none``.
STEER_CHOICES = ("target", "coverage", "both", "none")
DEFAULT_STEER = "target"


class CampaignError(Exception):
    pass


@dataclass
class Finding:
    id: str
    signature: Signature
    case: Case
    present_on: tuple[str, ...]    # the campaign's targets showing it when found: part of its key
    fingerprint: tuple[str, ...]   # the profiles whose config stage shows it: part of its key
    first_target: str
    outcome: dict
    found_after_s: float
    examples_before: int
    releases_affected: list[str] = field(default_factory=list)
    releases_clean: list[str] = field(default_factory=list)
    profiles_affected: list[str] = field(default_factory=list)
    releases_not_run: dict = field(default_factory=dict)  # release -> why (unsupported, worker)
    outcomes: dict = field(default_factory=dict)     # target -> outcome of the shrunk case

    def to_json(self) -> dict:
        o = self.outcome
        return {
            "id": self.id, "signature": str(self.signature), "kind": self.signature.kind,
            "exception": self.signature.exception or None,
            "function": (self.signature.function if self.signature.kind == "crash" else None),
            "field": (self.signature.function if self.signature.kind == "divergence" else None),
            "invariant": self.signature.invariant or None,
            "file": o.get("file"), "line": o.get("line"), "stage": o.get("stage"),
            "message": o.get("message"),
            "asserts": self.case.asserts,
            "releases_affected": self.releases_affected, "releases_clean": self.releases_clean,
            "profiles_affected": self.profiles_affected,
            "releases_not_run": self.releases_not_run,
            "present_on": list(self.present_on),
            "fingerprint": list(self.fingerprint),
            "first_target": self.first_target,
            "layout": self.case.layout.describe(),
            "case": f"repros/{self.id}/case.json",
            "groups": len(self.case.layout.groups), "requests": len(self.case.requests),
            "steps": o.get("steps", 1),
            "found_after_s": round(self.found_after_s, 3),
            "examples_before": self.examples_before,
        }


SHRINK_SECONDS = 10.0


def simplify(case: Case, still_shows, obs):
    """What hypothesis's shrinker cannot do across layout families: drop whole groups, requests
    and engine knobs, one at a time, keeping each change under which the finding still shows."""
    def candidates(c: Case):
        groups = c.layout.groups
        for i in range(len(groups)):
            if len(groups) > 1:
                rest = groups[:i] + groups[i + 1:]
                if not any(g.drafter for g in rest) or c.layout.engine.speculative is not None:
                    yield replace(c, layout=replace(c.layout, groups=rest))
        for i in range(1, len(c.requests)):
            yield replace(c, requests=c.requests[:i] + c.requests[i + 1:])
        default = Engine()
        for f in fields(Engine):
            if getattr(c.layout.engine, f.name) != getattr(default, f.name):
                yield replace(c, layout=c.layout.with_engine(**{f.name: getattr(default, f.name)}))
        if c.timing != Timing():
            yield replace(c, timing=Timing())

    improved = True
    while improved:
        improved = False
        for cand in candidates(case):
            try:
                Layout.from_json(cand.layout.to_json())   # still a valid layout
            except LayoutError:
                continue
            found = still_shows(cand)
            if found is not None:
                case, obs, improved = cand, found, True
                break
    return case, obs


def load_findings(out: Path) -> tuple[list[dict], list[tuple[Path, str]]]:
    """Every finding on disk (``repros/<id>/finding.json``, the durable record, written before
    the report), and the files that could not be read (named, left in place, never deleted)."""
    found, damaged = [], []
    for path in sorted((Path(out) / "repros").glob("*/finding.json")):
        try:
            data = json.loads(path.read_text())
            finding_key(data)
        except (OSError, ValueError, KeyError, TypeError) as e:
            damaged.append((path, str(e)))
            continue
        found.append(data)
    return found, damaged


def present_on(targets: list[str]) -> tuple[str, ...]:
    """Where a finding shows, as part of its key: the releases if any, else the model profiles."""
    releases = sorted({t for t in targets if not t.startswith("model:")})
    return tuple(releases) if releases else tuple(sorted(set(targets)))


def finding_id(sig: Signature, present_on: tuple[str, ...],
               fingerprint: tuple[str, ...] = ()) -> str:
    """A stable, readable id: the signature, then a digest of the targets it was found on (and
    of its fingerprint, when it has one)."""
    text = str(sig).replace(":", "-").replace(".", "_")
    slug = "".join(ch for ch in text if ch.isalnum() or ch in "-_")[:72]
    where = " ".join(present_on) + (" | " + " ".join(fingerprint) if fingerprint else "")
    return f"{slug}-{hashlib.sha1(where.encode()).hexdigest()[:6]}"


def finding_key(data: dict) -> tuple:
    """The key of a finding read from disk (a finding written before fingerprints has none)."""
    return (Signature.parse(data["signature"]), tuple(data["present_on"]),
            tuple(data.get("fingerprint", ())))


def parse_target(target: str, installed: list[str]) -> tuple[bool, list[str]]:
    """(run the model?, releases to run) for a ``--target`` value."""
    if target == "all":
        return True, installed
    if target == "model":
        return True, []
    if target == "releases":
        if not installed:
            raise CampaignError("--target releases: no vLLM release is installed "
                                "(run: simsched releases install)")
        return False, installed
    if target == "lockstep":
        if not installed:
            raise CampaignError("--target lockstep: no vLLM release is installed "
                                "(run: simsched releases install)")
        return True, installed
    if target.count(".") == 2 and all(p.isdigit() for p in target.split(".")):
        if target not in installed:
            raise CampaignError(f"--target {target}: release not installed "
                                f"(installed: {', '.join(installed) or 'none'}); "
                                f"run: simsched releases install {target}")
        return False, [target]
    raise CampaignError(f"--target {target!r}: expected {TARGET_CHOICES}")


class Campaign:
    def __init__(self, out: Path, releases: Releases, *, model: bool = True,
                 run_releases: list[str] | None = None, budget: float = 120.0, seed_: int = 0,
                 asserts: bool | None = True, progress: Callable[[str], None] | None = None,
                 round_examples: int = 300, lockstep: bool = False,
                 steer: str | bool = DEFAULT_STEER,
                 database=None, stats_name: str = "report",
                 stop_when: Callable[[Finding], bool] | None = None):
        self.out = Path(out)
        self.pool = releases
        self.model_targets = [ModelTarget(p) for p in PROFILES.values()] if model else []
        self.fingerprint_targets = [ModelTarget(p) for p in PROFILES.values()]
        self.release_targets = [ReleaseTarget(v, releases) for v in (run_releases or [])]
        # Each shrunk finding is replayed on every installed release, unless only the model runs.
        self.all_release_targets = ([ReleaseTarget(v, releases) for v in releases.versions]
                                    if run_releases else [])
        self.budget = budget
        self.seed = seed_
        self.asserts = asserts
        self.progress = progress or (lambda s: print(s, file=sys.stderr, flush=True))
        self.round_examples = round_examples
        self.lockstep = lockstep
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
        self.steps = 0
        self.findings: dict[tuple, Finding] = {}
        self.prior: list[dict] = []
        self.damaged: set[Path] = set()
        self.examples = 0
        self.families: dict[str, int] = {}
        self.knobs: dict[str, int] = {}
        self.timeline: list[dict] = []
        self.started = 0.0
        self.warmup_s = 0.0

    # --- evaluating one case ---------------------------------------------------------------

    def observe(self, case: Case, releases: list[ReleaseTarget] | None = None,
                outcomes: dict | None = None) -> list[Observation]:
        return observe(case, self.model_targets,
                       self.release_targets if releases is None else releases, outcomes,
                       lockstep=self.lockstep)

    def fingerprint(self, case: Case, sig: Signature,
                    outcomes: dict | None = None) -> tuple[str, ...]:
        """The profiles whose config stage shows the crash ``sig`` on ``case`` (empty for findings
        that are not configuration crashes): part of a finding's key, and kept fixed by shrinking.

        Different bugs can raise from the same vLLM function, so that on one release they share
        a signature, while the releases they are present in differ: on 0.30.0 the ring group of
        upstream PR #55037 (present in 0.29.0-0.30.0), a lone Mamba group under DCP (0.27.0-
        0.30.0) and ``offload_block_size`` with mixed block sizes all fail an assert of
        ``build_offloading_config``. The model's profiles tell them apart (the issue's "affected
        release set", predicted), so each becomes its own finding, and a shrunk case does not
        slip from one to another (hypothesis guards against slips only by the line a test fails
        at, which is the same here). Cheap: the config stage only, no step runs, and none at
        all for a profile whose outcome ``outcomes`` (target name -> outcome, as
        :func:`simsched.replay.observe` fills it) already holds.
        """
        if sig.kind != "crash":
            return ()
        outcomes = outcomes or {}
        return tuple(t.profile.name for t in self.fingerprint_targets
                     if crash_signature(outcomes.get(t.name) or t.config(case)) == sig)

    def same_bug(self, case: Case, hunt: tuple) -> bool:
        return self.fingerprint(case, hunt[0]) == hunt[3]

    # --- the rounds -----------------------------------------------------------------------

    def _count(self, case: Case) -> None:
        self.examples += 1
        self._sample()
        fam = family_of(case.layout)
        self.families[fam] = self.families.get(fam, 0) + 1
        for k in case.layout.engine.to_json():
            self.knobs[k] = self.knobs.get(k, 0) + 1
        kinds = {g.kind for g in case.layout.groups}
        for k in kinds:
            self.knobs[f"kind:{k}"] = self.knobs.get(f"kind:{k}", 0) + 1

    def _round(self, round_no: int, deadline: float, db) -> Finding | None:
        state = {"hunting": None, "case": None, "obs": None, "t": 0.0, "n": 0}
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
        @given(cases(asserts=self.asserts))
        def body(case: Case) -> None:
            if state["hunting"] is None:
                if time.monotonic() > deadline:
                    return
                self._count(case)
                self._maybe_progress()
                if self.steer in ("target", "both"):
                    for label, score in edge_scores(case).items():
                        target(score, label=label)
            hunt = state["hunting"]
            if hunt is None:
                outcomes: dict = {}
                obs = self.observe(case, outcomes=outcomes)
                self.steps += sum(o.get("steps", 0) for o in outcomes.values())
                if self.collect_coverage:
                    cov = self._take_coverage()
                    if self.steer in ("coverage", "both"):
                        target(float(cov["new"]), label="coverage-new")
                        target(float(cov["rare"]), label="coverage-rare")
            else:   # while shrinking, run only the targets the hunted finding showed on
                obs = observe(case, [t for t in self.model_targets if t.name in hunt[2]],
                              [t for t in self.release_targets if t.name in hunt[2]],
                              lockstep=self.lockstep)
                if self.collect_coverage:
                    self._take_coverage()    # what shrinking covers is nobody's novelty
            where: dict[Signature, list[str]] = {}
            for o in obs:
                where.setdefault(o.signature, []).append(o.target)
            if hunt is None:
                keys = {(sig, present_on(ts), self.fingerprint(case, sig, outcomes)): ts
                        for sig, ts in where.items()}
                # the most specific first: a finding on fewer targets tells releases apart
                new = sorted(set(keys) - known, key=lambda k: (len(k[1]), k))
                if not new:
                    return
                state["t"] = time.monotonic() - self.started
                state["n"] = self.examples
                sig, shown_on, fp = new[0]
                hunt = state["hunting"] = (sig, shown_on, frozenset(keys[new[0]]), fp)
            elif not self.same_bug(case, hunt):
                return
            if hunt[2] <= set(where.get(hunt[0], ())):   # still shows on every hunted target
                state["case"] = case
                state["obs"] = next(o for o in obs if o.signature == hunt[0])
                raise Found(str(hunt[0]))

        # Shrinking is bounded by hypothesis's own MAX_SHRINKING_SECONDS (300 s); a campaign keeps
        # its budget and looks for more than one finding, so a round shrinks for at most
        # SHRINK_SECONDS (and never past the budget by more than 5 s); simplify() finishes the job.
        shrink_s = max(5.0, min(SHRINK_SECONDS, deadline - time.monotonic()))
        try:
            with mock.patch.object(hypothesis_engine, "MAX_SHRINKING_SECONDS", shrink_s):
                body()
        except Found:
            sig, shown_on, targets, fp = hunt = state["hunting"]

            def still_shows(case: Case) -> Observation | None:
                if not self.same_bug(case, hunt):
                    return None
                obs = observe(case, [t for t in self.model_targets if t.name in targets],
                              [t for t in self.release_targets if t.name in targets],
                              lockstep=self.lockstep)
                where = {o.target for o in obs if o.signature == sig}
                return next((o for o in obs if o.signature == sig), None) \
                    if targets <= where else None

            case, o = simplify(state["case"], still_shows, state["obs"])
            return Finding(id=finding_id(sig, shown_on, fp), signature=sig, case=case,
                           present_on=shown_on, fingerprint=fp, first_target=o.target,
                           outcome=o.outcome, found_after_s=state["t"],
                           examples_before=state["n"])
        return None

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
        self.progress(f"[{el:6.1f}s] {self.examples} examples ({self.examples / max(el, 1e-9):.0f}/s)"
                      f", {self.steps / max(el, 1e-9):,.0f} model steps/s, "
                      f"{len(self.findings) + len(self.prior)} findings, families "
                      f"{len(self.families)}/7, kinds {kinds}/8, knobs {knobs}"
                      + (f", {self.arcs} vLLM arcs" if self.collect_coverage else ""))

    def replay_everywhere(self, finding: Finding) -> None:
        """Fill in where a shrunk finding's signature is present and where it is absent."""
        saved, self.model_targets = self.model_targets, self.fingerprint_targets
        try:
            obs = self.observe(finding.case, self.all_release_targets, finding.outcomes)
        finally:
            self.model_targets = saved
        hit = {o.target for o in obs if o.signature == finding.signature}
        finding.profiles_affected = [p for p in PROFILES if f"model:{p}" in hit]
        for t in self.all_release_targets:
            outcome = finding.outcomes[t.name]
            if t.name in hit:
                finding.releases_affected.append(t.name)
            elif outcome.get("status") == "unsupported" or outcome.get("stage") == "worker":
                finding.releases_not_run[t.name] = describe(outcome)
            else:
                finding.releases_clean.append(t.name)

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
        self.load_prior()   # other worker processes may have written findings since
        return set(self.findings) | {finding_key(f) for f in self.prior}

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
        self.findings[(finding.signature, finding.present_on, finding.fingerprint)] = finding
        repro_mod.write_repro(self.out, finding)     # the durable record, first
        self.timeline.append({"t": round(finding.found_after_s, 3), "id": finding.id,
                              "examples": finding.examples_before})
        self.write_report()
        self.progress(f"[{time.monotonic() - self.started:6.1f}s] finding {finding.id}: "
                      f"{finding.case.layout.describe()} | affected "
                      f"{', '.join(finding.releases_affected) or '-'} | profiles "
                      f"{', '.join(finding.profiles_affected) or '-'}")

    def write_report(self, final: bool = False) -> dict:
        """report.json and report.md (and, when ``final``, the plots report.md links); a worker
        process writes its figures to workers/<n>.json instead, and the parent merges them
        (:func:`fuzz.report.merge`)."""
        el = time.monotonic() - self.started if self.started else 0.0
        new = [f.to_json() for f in self.findings.values()]
        new_ids = {f["id"] for f in new}
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
            "releases_installed": list(self.pool.versions),
            "families": dict(sorted(self.families.items())),
            "knobs": dict(sorted(self.knobs.items())),
            "timeline": self.timeline,
            "samples": self.samples + [{"t": round(el, 3), "examples": self.examples,
                                        "findings": len(self.findings)}],
            "steer": self.steer,
            "findings": [f for f in self.prior if f["id"] not in new_ids] + new,
        }
        if self.collect_coverage:
            data["vllm_arcs"] = self.arcs
            data["arcs_timeline"] = self.arcs_timeline + [
                {"t": round(el, 3), "examples": self.examples, "arcs": self.arcs}]
        if self.stats_name == "report":
            report_mod.write(self.out, data, plots=final)
        else:
            report_mod.write_worker_stats(self.out, self.stats_name, data)
        return data
