"""A time-boxed fuzz campaign: generate cases, run them on every target, shrink each new cause.

One campaign round is one hypothesis run. The test body runs a case on the model under every
behaviour profile (the fast pre-screen), every release's config chain, and the real Scheduler,
step by step, of the releases the pre-screen points at and of the newest release on a steady
share of all cases (:meth:`Campaign.evaluate`, :mod:`fuzz.evaluate`).

Each observation is triaged (:mod:`fuzz.triage`): a class (bug, validation, model-gap,
proposal, predicted, tool-error) and a cluster key, the cause it stands for. While no cause is
being hunted, a cluster the campaign has not seen makes the body fail and hypothesis shrinks the
case; while shrinking, the body fails only when the hunted cluster still shows on the same
targets (and, for a crash, the same profiles' config stage shows it: see
:meth:`Campaign.fingerprint`; :mod:`fuzz.shrink`). Each shrunk finding is then run step by step
on every installed release and every profile (so ``releases_clean`` means: ran every step there,
nothing showed; :mod:`fuzz.clustering`), written to disk at once (case, pytest repro, report:
:mod:`fuzz.finding`, :mod:`fuzz.repro`, :mod:`fuzz.report`) and becomes known; a known cluster seen
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
from pathlib import Path
from typing import Callable
from unittest import mock

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings, target
from hypothesis.errors import Flaky
from hypothesis.internal.conjecture import engine as hypothesis_engine

from fuzz import clustering
from fuzz import report as report_mod
from fuzz import repro as repro_mod
from fuzz import triage as tri
from fuzz.database import open_database
from fuzz.evaluate import REAL_SHARE, CampaignError, Evaluator
from fuzz.finding import MAX_VARIANTS, Finding, finding_id, finding_keys, load_findings, present_on
from fuzz.shrink import SHRINK_SECONDS, Hunt, simplify
from fuzz.strategies import cases, edge_scores, family_of, planned_cases
from fuzz.triage import Seen
from simsched.case import Case
from simsched.outcome import Observation, Signature
from simsched.planning import plan
from simsched.targets import Releases

TARGET_CHOICES = "all, config, lockstep, model, releases, or a release such as 0.30.0"

# How generation is steered toward the edges (``--steer``): ``target`` scores each case with
# :func:`fuzz.strategies.edge_scores` through ``hypothesis.target``; ``coverage`` scores it with
# the arc coverage it reaches in vLLM's offloading code inside the release workers (arcs new to
# the campaign, and a rarity score: see :mod:`simsched.vllm.inside.coverage`); ``both``; ``none``.
STEER_CHOICES = ("target", "coverage", "both", "none")
DEFAULT_STEER = "target"

#: every fourth round draws model families as their layers, planned by a release (issue 20:
#: the layouts real deployments of those models get)
LAYERS_EVERY = 4


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
            | {f"kind:{g.kind}" for g in case.layout.groups}
            # the connector path (simsched.connectors): which connector, which tiers
            | {f"connector:{case.layout.engine.connector.describe()}"}
            | {f"tier:{t.kind}" for t in case.layout.engine.secondary_tiers})


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


class Campaign(Evaluator):
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
        super().__init__(releases, model=model, run_releases=run_releases, steps=steps,
                         real_share=real_share)
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
        clustering.replay_everywhere(self, finding)
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
            # real step runs and steps per connector path (simsched.connectors)
            "per_path": {p: {k: round(x, 3) for k, x in st.items()}
                         for p, st in sorted(self.per_path.items())},
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
