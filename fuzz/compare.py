"""``simsched compare A B``: what a change of vLLM changes, found on the same generated cases.

A and B are targets: a release (``0.30.0``), a derived target (``simsched releases add``: a
patched release or a source tree) or the model under a profile (``model:prefix-cacheable``).
Typically A is a patch and B its base. Every case runs on both, step by step on a real target's
Scheduler (after its config chain), and the two runs are set side by side:

``fixed``
    a bug B shows and A does not (a crash that is not a clean refusal, a broken invariant);
``introduced``
    a bug A shows and B does not;
``unmasked`` / ``masked``
    a bug A shows (B shows) on a case where the other crashes at start-up before it: the crash
    hides it, and a fix of the crash makes it reachable (the upstream fix of the ring boot assert lets
    0.30.0 reach a fence bug of rings that 0.31.0 and 0.32.0 have and 0.33.0 fixed);
``changed``
    no bug differs, but the behaviour does: one refuses at start-up what the other runs, or
    the step traces differ (more or fewer loads and stores, other blocks, a request finishing
    later), named by the first differing step.

Each difference is a key (the finding's signature, with the group kinds as the scheduler's
managers see them for an invariant; for a change, what differs and the group kinds); the first
case showing a new key is shrunk while the same key shows (hypothesis's shrinker, then whole
groups, requests and knobs dropped), and later cases showing it are counted as its variants.
Cases come from :func:`fuzz.strategies.cases` with a fixed seed, after a few seed cases (the
reference PR's ring layouts, and the hand-made load, fence and abort cases), so the same seed
gives the same cases. simsched's own failures (the model's crash, a worker that died or hung)
are listed as tool errors, never as differences.

Writes ``OUT/compare.json`` (the lists above, and ``tool_errors``),
``OUT/compare.md`` and the shrunk cases under ``OUT/cases/``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from unittest import mock

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis.errors import Flaky
from hypothesis.internal.conjecture import engine as hypothesis_engine

from fuzz import triage as tri
from fuzz.shrink import simplify
from fuzz.strategies import cases
from simsched.case import Case
from simsched.lockstep import HANDMADE, diff_traces
from simsched.model import unmodelled_path
from simsched.outcome import Observation, describe
from simsched.profiles import get_profile
from simsched.replay import observe
from simsched.targets import ModelTarget, Releases, ReleaseTarget

FORMAT = "simsched-compare/1"
ROUND_EXAMPLES = 200
SHRINK_SECONDS = 20.0
MAX_CHANGED = 20        # change keys kept: beyond them a change is counted, not shrunk
MAX_LAYOUTS = 12        # the layouts of a difference's variants listed
WHATS = ("fixed", "introduced", "unmasked", "masked", "changed")


class CompareError(Exception):
    """Bad arguments to ``simsched compare``; the message says what is wrong."""


def seed_cases(asserts: bool) -> list[Case]:
    """The cases every comparison starts with: the reference PR's ring layouts (a boot assert
    on 0.29.0 and 0.30.0), then the hand-made cases of loads, fences (``ring_fence``: a ring's
    block written while a store still reads it, on 0.31.0 and 0.32.0) and aborts."""
    prompt = [{"id": "a", "prompt": [[7, 64]], "decode": 2}]
    rings = [{"layout": {"groups": groups}, "requests": prompt}
             for groups in ([{"kind": "full", "block_size": 16},
                             {"kind": "ring", "block_size": 4}],
                            [{"kind": "mla", "block_size": 64},
                             {"kind": "ring", "block_size": 4}])]
    made = [HANDMADE[name] for name in ("load", "fence", "ring_fence", "abort_load")]
    return [Case.from_json(dict(c, asserts=asserts)) for c in rings + made]


@dataclass
class Side:
    """One target's run of one case: its status, its findings by key, its step trace."""

    status: str                  # ran, refused, crashed; unsupported, worker (releases)
    outcome: dict
    bugs: dict[tuple, Observation] = field(default_factory=dict)
    tool: list[Observation] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)

    @property
    def stopped_at(self) -> int | None:
        """Where a bug crashed the engine at start-up (its place in ``STAGES``; nothing after it
        ran), or None."""
        places = [position(o) for o in self.bugs.values()]
        return min((p for p in places if p < len(STAGES)), default=None)


#: the start-up stages in the order the engine (and the config chain) goes through them
STAGES = ("resolve", "build_offloading_config", "spec", "from_spec", "scheduler", "boot",
          "add_request")


def position(o: Observation) -> int:
    """Where a bug shows: its start-up stage's place in ``STAGES``, or after them all."""
    stage = o.outcome.get("stage")
    return STAGES.index(stage) if o.signature.kind == "crash" and stage in STAGES \
        else len(STAGES)


def finding_key(o: Observation, case: Case, by_layout: bool = False) -> tuple:
    """What a finding is compared by: its signature, and for an invariant the group kinds as the
    managers see them (one cause per kinds): the groups where it broke, as a campaign clusters
    it, or with ``by_layout`` the layout's (the model and the releases' harness name the groups
    of one break differently: INV-6 on ``full/16 + ring/4`` is ``full+ring`` in the model and
    ``ring`` on a release)."""
    if o.signature.kind == "invariant":
        kinds = (None if by_layout else o.outcome.get("group_kinds")) \
            or tri.group_kinds(case.layout)
        return (str(o.signature), tri.manager_kinds(kinds))
    return (str(o.signature),)


def klass(o: Observation, case: Case, real: bool) -> str:
    """``bug``, ``validation`` (a clean refusal at start-up) or ``tool-error``: on a release as
    a campaign triages it; on the model, whose outcomes carry no source line, a named exception
    of a start-up stage with a message is a refusal."""
    if real:
        return tri.triage_release(o, case.layout, None).klass
    out = o.outcome
    if tri.model_failed(out):
        return tri.TOOL_ERROR
    refusal = (out.get("stage") in tri.START_UP_STAGES and bool(out.get("message"))
               and out.get("exception") in tri.REFUSAL_EXCEPTIONS)
    return tri.VALIDATION if refusal else tri.BUG


class Compare:
    def __init__(self, a: str, b: str, pool: Releases, out: Path, *, budget: float = 120.0,
                 seed_: int = 0, asserts: bool | None = True, max_cases: int | None = None,
                 progress: Callable[[str], None] = print):
        if a == b:
            raise CompareError(f"compare {a} with itself: give two different targets")
        self.names = (a, b)
        # exactly one side the model: findings keyed alike on both sides (``finding_key``)
        self.with_model = a.startswith("model:") != b.startswith("model:")
        self.targets = {n: self._target(n, pool) for n in (a, b)}
        self.pool, self.out, self.budget, self.seed = pool, Path(out), budget, seed_
        self.asserts, self.progress = asserts, progress
        self.max_cases = max_cases     # stop after this many cases, budget or not
        self.found: dict[tuple, dict] = {}     # key -> its entry (one of WHATS)
        self.tool_errors: dict[tuple, dict] = {}
        self.examples = 0
        self.seconds: dict[str, float] = {a: 0.0, b: 0.0}
        self.real_steps: dict[str, int] = {a: 0, b: 0}
        self.started = 0.0
        self.interrupted = False

    @staticmethod
    def _target(name: str, pool: Releases) -> ModelTarget | ReleaseTarget:
        if name.startswith("model:"):
            try:
                return ModelTarget(get_profile(name.split(":", 1)[1]))
            except KeyError as e:
                raise CompareError(str(e.args[0])) from None
        if name not in pool.versions:
            raise CompareError(f"{name}: not an installed release or derived target")
        return ReleaseTarget(name, pool)

    # --- one case on one side ------------------------------------------------------------

    def side(self, case: Case, name: str) -> Side:
        """Run ``case`` on one target. Its status, in words both kinds of target share:
        ``ran``, ``refused`` (a clean refusal at start-up: a named exception of the config
        chain, or the engine's start-up checks), ``crashed`` (at start-up, a bug), and for a
        release ``unsupported`` (it cannot express the layout) or ``worker`` (simsched's)."""
        t = self.targets[name]
        t0 = time.perf_counter()
        outcomes: dict = {}
        traces: dict = {}
        if isinstance(t, ModelTarget):
            obs = observe(case, [t], [], outcomes)
            outcome = outcomes[t.name]
            status, trace = self._model_run(case, t, outcome)
        else:
            obs = [o for o in observe(case, [], [t], outcomes, steps=[t], traces=traces)
                   if o.target == t.name and o.signature.kind != "divergence"]
            outcome = outcomes[t.name]
            status = outcome.get("status", "?")
            if status == "ran":
                self.real_steps[name] += outcome.get("steps", 0)
            res = traces.get(t.name)
            trace = (res.real.get("trace") or []) if res is not None else []
        self.seconds[name] += time.perf_counter() - t0
        s = Side(status, outcome, trace=trace)
        for o in obs:
            what = klass(o, case, real=not isinstance(t, ModelTarget))
            if what == tri.TOOL_ERROR:
                s.tool.append(o)
            elif what == tri.BUG:
                s.bugs.setdefault(finding_key(o, case, by_layout=self.with_model), o)
            else:
                s.status, s.trace = "refused", []   # a clean refusal in the config chain
        return s

    @staticmethod
    def _model_run(case: Case, t: ModelTarget, outcome: dict) -> tuple[str, list[str]]:
        """The model's status and step trace (its findings come from ``observe``)."""
        from simsched.model import run_case
        if outcome.get("status") == "error":
            return "crashed", []
        try:
            result = run_case(case, t.profile)
        except Exception:        # the model's crash: a tool error, reported by observe
            return "crashed", []
        return ("refused", []) if result.refused is not None else ("ran", result.trace)

    # --- the two sides of one case ---------------------------------------------------------

    def _model_blind(self, case: Case) -> bool:
        """A side is the model and ``case`` is on a connector path the model does not mirror
        (:func:`simsched.model.unmodelled_path`): the model has no run of it to compare."""
        return any(isinstance(t, ModelTarget)
                   and unmodelled_path(case.layout, t.profile) is not None
                   for t in self.targets.values())

    def differences(self, case: Case) -> tuple[list[tuple], Side, Side]:
        """The keys in which A's run of ``case`` differs from B's, and the two runs."""
        a, b = (self.side(case, n) for n in self.names)
        for s, name in ((a, self.names[0]), (b, self.names[1])):
            for o in s.tool:
                self._note_tool_error(case, o, name)
        if a.tool or b.tool:
            return [], a, b
        # a bug the other side does not reach, because it crashes at start-up before it on this
        # case, is not fixed or introduced: the crash masks it, and a fix of the crash unmasks
        # it. Where both stop in one stage, the later crash is read as the one A got to (a
        # fix of B's crash that meets the next one, as PR #55037 met them one at a time)
        keys = [("masked" if a.stopped_at is not None and a.stopped_at < position(o)
                 else "fixed",) + k for k, o in sorted(b.bugs.items()) if k not in a.bugs]
        keys += [("unmasked" if b.stopped_at is not None and b.stopped_at <= position(o)
                  else "introduced",) + k for k, o in sorted(a.bugs.items()) if k not in b.bugs]
        if keys or a.bugs or b.bugs:
            return keys, a, b
        kinds = tri.manager_kinds(tri.group_kinds(case.layout))
        if self.with_model and "unsupported" in (a.status, b.status):
            return [], a, b      # a layout the release cannot express: the model cannot tell
        if a.status != b.status:
            return [("changed", f"{b.status} -> {a.status}", kinds)], a, b
        if a.status == "ran":
            div = diff_traces(b.trace, a.trace)
            if div is not None:
                return [("changed", f"trace.{div.kind}", kinds)], a, b
        return [], a, b

    def _note_tool_error(self, case: Case, o: Observation, name: str) -> None:
        key = (str(o.signature), name)
        if key not in self.tool_errors:
            path = self._save(case, "tool-" + tri.cluster_name(key))
            self.tool_errors[key] = {"signature": str(o.signature), "target": name,
                                     "message": (o.outcome.get("message") or "")[:300],
                                     "case": path}
            self.progress(f"tool error (simsched, not vLLM) on {name}: {o.signature}; "
                          f"case {path}")

    # --- search and shrink -----------------------------------------------------------------

    def _round(self, round_no: int, deadline: float) -> None:
        state: dict = {"key": None, "case": None}

        class Found(Exception):
            pass

        @settings(database=None, max_examples=ROUND_EXAMPLES, deadline=None,
                  report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet,
                  suppress_health_check=list(HealthCheck),
                  phases=(Phase.generate, Phase.shrink))
        @seed(self.seed * 1_000_003 + round_no)
        @given(cases(asserts=self.asserts))
        def body(case: Case) -> None:
            if self._model_blind(case):
                return      # a connector path the model does not mirror: nothing to compare
            if state["key"] is None:
                if self._done(deadline):
                    return
                self.examples += 1
                keys, _, _ = self.differences(case)
                new = [k for k in keys if not self._known(k, case)]
                if not new:
                    return
                state["key"] = new[0]
                self.progress(f"[{time.monotonic() - self.started:6.1f}s] {new[0][0]}: "
                              f"{' '.join(new[0][1:])}; shrinking ...")
            elif state["key"] not in self.differences(case)[0]:
                return
            state["case"] = case
            raise Found

        shrink_s = max(5.0, min(SHRINK_SECONDS, deadline - time.monotonic()))
        try:
            with mock.patch.object(hypothesis_engine, "MAX_SHRINKING_SECONDS", shrink_s):
                body()
        except Flaky:     # shown once, not again on the same case: never a difference
            self.progress(f"set aside (not reproducible): {state['key']}")
            if state["key"] is not None:
                self.found.setdefault(state["key"], {"unreproducible": True})
        except Found:
            self._record(state["key"], state["case"])

    def _known(self, key: tuple, case: Case) -> bool:
        """A key found already (counted as its variant) or a change past the cap."""
        if key in self.found:
            entry = self.found[key]
            entry["variants"] = entry.get("variants", 0) + 1
            layouts = entry.setdefault("variant_layouts", [])
            if case.layout.describe() not in layouts and len(layouts) < MAX_LAYOUTS:
                layouts.append(case.layout.describe())
            return True
        changed = sum(1 for k in self.found if k[0] == "changed")
        return key[0] == "changed" and changed >= MAX_CHANGED

    def _record(self, key: tuple, case: Case) -> None:
        def still_shows(c: Case):
            runs = self.differences(c)
            return runs if key in runs[0] else None
        # the shrunk case's two runs: those of simplify's last step, or run here if it kept
        # the case as it was
        case, runs = simplify(case, still_shows, None, seconds=SHRINK_SECONDS)
        keys, a, b = runs or self.differences(case)
        entry_id = tri.cluster_name(key)
        shown_on = {"fixed": self.names[1], "masked": self.names[1],
                    "introduced": self.names[0], "unmasked": self.names[0]}.get(key[0])
        side = a if key[0] in ("introduced", "unmasked") else b
        obs = side.bugs.get(key[1:]) if shown_on else None
        div = diff_traces(b.trace, a.trace) if a.trace or b.trace else None
        self.found[key] = {
            "id": entry_id, "what": key[0], "key": list(key[1:]),
            "signature": key[1] if shown_on else None,
            "shown_on": shown_on, "reproduced": key in keys,
            "case": self._save(case, entry_id), "layout": case.layout.describe(),
            "requests": len(case.requests),
            "detail": (obs.outcome.get("detail") or obs.outcome.get("message") or "")[:300]
                      if obs else "",
            "a": describe(a.outcome), "b": describe(b.outcome),
            "counters": {n: {k: v for k, v in (s.outcome.get("counters") or {}).items()
                             if k in ("steps", "stores", "loads", "preemptions")}
                         for n, s in zip(self.names, (a, b))},
            "first_difference": div and {"step": div.step, "kind": div.kind,
                                         "a": div.real_line, "b": div.model_line},
            "found_after_s": round(time.monotonic() - self.started, 1),
            "examples_before": self.examples,
            "variants": self.found.get(key, {}).get("variants", 0),
            "variant_layouts": self.found.get(key, {}).get("variant_layouts", [])}
        self.progress(f"  -> {key[0]} {entry_id}: {case.layout.describe()}")

    def _save(self, case: Case, name: str) -> str:
        folder = self.out / "cases"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps(case.to_json(), indent=1) + "\n")
        return f"cases/{name}.json"

    # --- the whole comparison ------------------------------------------------------------

    def run(self) -> dict:
        """Seed cases, then generated ones until the budget; Ctrl-C writes what was found."""
        self.started = time.monotonic()
        deadline = self.started + self.budget
        try:
            for asserts in ((True, False) if self.asserts is None else (self.asserts,)):
                for case in seed_cases(asserts):
                    self.examples += 1
                    for key in self.differences(case)[0]:
                        if not self._known(key, case):
                            self._record(key, case)
            round_no = 0
            while not self._done(deadline):
                self._round(round_no, deadline)
                round_no += 1
        except KeyboardInterrupt:
            self.interrupted = True
        return self.write()

    def _done(self, deadline: float) -> bool:
        return time.monotonic() > deadline or (self.max_cases is not None
                                               and self.examples >= self.max_cases)

    def write(self) -> dict:
        entries = [e for e in self.found.values() if "id" in e]
        data = {
            "format": FORMAT, "a": self.names[0], "b": self.names[1],
            "bases": {n: self.pool.release_of(n) for n in self.names
                      if not n.startswith("model:")},
            "budget_s": self.budget, "seed": self.seed, "examples": self.examples,
            "seconds": {n: round(s, 1) for n, s in self.seconds.items()},
            "real_steps": self.real_steps,
            **{what: [e for e in entries if e["what"] == what] for what in WHATS},
            "tool_errors": list(self.tool_errors.values()),
            "interrupted": self.interrupted,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "compare.json").write_text(json.dumps(data, indent=1) + "\n")
        (self.out / "compare.md").write_text(markdown(data))
        return data


def _cell(text: str) -> str:
    """Text for a markdown table cell (layouts hold ``|``)."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(data: dict) -> str:
    a, b = data["a"], data["b"]
    lines = [f"# simsched compare: {a} against {b}", "",
             f"{data['examples']} cases (seed {data['seed']}, budget {data['budget_s']:g} s), "
             f"each run on both, step by step on a real target. Seconds: "
             + ", ".join(f"{n} {s}" for n, s in data["seconds"].items()) + "; real steps: "
             + ", ".join(f"{n} {s:,}" for n, s in data["real_steps"].items()) + ".", ""]
    heads = {"fixed": f"Fixed: bugs of {b} that {a} does not show",
             "introduced": f"Introduced: bugs of {a} that {b} does not show",
             "unmasked": f"Unmasked: bugs of {a} on cases where {b} crashes at start-up",
             "masked": f"Masked: bugs of {b} on cases where {a} crashes at start-up",
             "changed": "Changed: no bug differs, the behaviour does"}
    for what, head in heads.items():
        rows = data[what]
        lines += [f"## {head} ({len(rows)})", ""]
        if not rows:
            lines += ["None.", ""]
            continue
        lines += ["| difference | shrunk case | layout | first differing step | "
                  f"{a} | {b} |", "|---|---|---|---|---|---|"]
        for e in rows:
            d = e.get("first_difference")
            step = (f"step {d['step']} ({d['kind']}): {a} `{d['a']}`, {b} `{d['b']}`"
                    if d else "at start-up")
            name = " ".join(map(str, e["key"]))
            also = ", ".join(f"`{x}`" for x in e["variant_layouts"][:4])
            cells = [f"{name} (+{e['variants']} variants{': ' + also if also else ''})",
                     f"[{e['case']}]({e['case']})", f"`{e['layout']}`", step, e["a"][:90],
                     e["b"][:90]]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    if data["tool_errors"]:
        lines += ["## Tool errors (simsched's own, not vLLM's)", ""]
        lines += [f"- {t['target']}: {t['signature']}: {t['message'][:120]} ({t['case']})"
                  for t in data["tool_errors"]]
        lines.append("")
    lines += [f"Replay one: `simsched replay CASE --release {a} --release {b}`.", ""]
    return "\n".join(lines)


def compare(a: str, b: str, *, budget: float, seed_: int = 0, out: str | Path = "compare-out",
            asserts: bool | None = True, timeout: float = 60.0, max_cases: int | None = None,
            progress: Callable[[str], None] = print) -> dict:
    """Run ``simsched compare A B``; returns what ``compare.json`` holds."""
    real = [n for n in (a, b) if not n.startswith("model:")]
    with Releases.installed(real, timeout=timeout) as pool:
        return Compare(a, b, pool, Path(out), budget=budget, seed_=seed_, asserts=asserts,
                       max_cases=max_cases, progress=progress).run()


__all__ = ["Compare", "CompareError", "compare", "finding_key", "markdown", "seed_cases"]
