"""Targets: what a case runs on. The model under a profile, or a real release in its worker.

Both answer ``config(case)`` with an outcome in the same format (see :mod:`simsched.outcome`).
A :class:`Releases` pool owns the release workers (one per release and assert mode, started on
first use) and closes them; nothing else in the project talks to a worker directly.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path

from simsched.case import Case
from simsched.geometry import config_outcome
from simsched.profiles import (Profile, RecordingProfile, answers_alike, get_profile,
                               profile_for_release)


#: why the model does not run a layout of layers by itself
UNPLANNED = ("a layout of layers: its groups are what each release's planner builds "
             "(simsched.planning); the model runs them in lockstep with that release")


def config_item(case: Case) -> dict:
    """The config-level request for a case: its layout and the length of the request to key."""
    num_tokens = case.requests[0].prompt_len if case.requests else 0
    return {"layout": case.layout.to_json(), "num_tokens": num_tokens}


def model_crash(exc: BaseException) -> dict:
    """An unexpected exception inside the model, as an error outcome naming the model's code."""
    root = Path(__file__).resolve().parent.parent
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).resolve().is_relative_to(root)]
    last = frames[-1] if frames else None
    return {"status": "error", "stage": "model", "exception": type(exc).__name__,
            "function": f"simsched.{last.name}" if last else "simsched",
            "file": str(Path(last.filename).resolve().relative_to(root)) if last else None,
            "line": last.lineno if last else None, "message": str(exc)[:300]}


@dataclass
class ModelTarget:
    profile: Profile

    @property
    def name(self) -> str:
        return f"model:{self.profile.name}"

    def config(self, case: Case) -> dict:
        if not case.layout.planned:     # the groups are each release's planner's to build
            return {"status": "unsupported", "reason": UNPLANNED}
        item = config_item(case)
        try:
            return config_outcome(case.layout, item["num_tokens"], self.profile, case.asserts)
        except Exception as e:   # a bug in the model is a finding of its own
            return model_crash(e)

    def config_many(self, cases: list[Case]) -> list[dict]:
        return [self.config(c) for c in cases]

    def run(self, case: Case) -> tuple[list[dict], int]:
        """Run the whole case on the model: its findings (crash, invariant) and steps taken
        (none, no step, for a case the engine refuses at start-up: ``RunResult.refused``)."""
        from simsched.model import run_case
        try:
            result = run_case(case, self.profile, trace=False)
        except Exception as e:   # a bug in the model is a finding of its own
            return [dict(model_crash(e), kind="crash")], 0
        return result.findings, result.counters.get("steps", 0)

    def outcome(self, case: Case) -> tuple[dict, list[dict], int]:
        """The config outcome, the findings and the steps of ``case``: a config stage that
        fails is a crash finding of one step, and no step runs. The config stage is the
        OffloadingConnector's, but on the SimpleCPU path (no such chain: its geometry, and its
        manager's start-up asserts in the model run, ``simple_cpu_scheduler``)."""
        if case.layout.planned and case.layout.engine.connector.kind == "simple_cpu":
            from simsched.model.simple_cpu_scheduler import config_outcome
            config = config_outcome(case.layout, self.profile)
        else:
            config = self.config(case)
        if config["status"] == "error":
            return config, [dict(config, kind="crash")], 1
        if config["status"] == "unsupported":
            return config, [], 0
        findings, steps = self.run(case)
        return config, findings, steps

    @classmethod
    def named(cls, profile: str) -> "ModelTarget":
        return cls(get_profile(profile))


class SharedModelRuns:
    """One case on the model under several profiles, run once per distinct behaviour: a profile
    that gives every answer an earlier run got from its own profile (see
    :func:`~simsched.profiles.answers_alike`) takes that run's outcome."""

    def __init__(self, case: Case):
        self.case = case
        self.runs: list[tuple[list, tuple[dict, list[dict], int]]] = []

    def outcome(self, target: ModelTarget) -> tuple[dict, list[dict], int]:
        for answers, outcome in self.runs:
            if answers_alike(answers, target.profile):
                return _copied(outcome)
        recording = RecordingProfile(target.profile)
        outcome = ModelTarget(recording).outcome(self.case)
        self.runs.append((recording.answers, outcome))
        return _copied(outcome)


def _copied(outcome: tuple[dict, list[dict], int]) -> tuple[dict, list[dict], int]:
    """An outcome each profile can keep as its own (its config and its findings' dicts)."""
    config, findings, steps = outcome
    return dict(config), [dict(f) for f in findings], steps


@dataclass
class ReleaseTarget:
    version: str
    pool: "Releases"

    @property
    def name(self) -> str:
        return self.version

    @property
    def profile(self) -> Profile:
        return profile_for_release(self.pool.release_of(self.version))

    def config(self, case: Case) -> dict:
        return self.config_many([case])[0]

    def config_many(self, cases: list[Case]) -> list[dict]:
        """Run cases in batches, one batch per assert mode, answers in the order given."""
        out: list[dict | None] = [None] * len(cases)
        for asserts in (True, False):
            idx = [i for i, c in enumerate(cases) if c.asserts == asserts]
            if not idx:
                continue
            worker = self.pool.worker(self.version, asserts)
            results = worker.call("config_batch", items=[config_item(cases[i]) for i in idx])
            for i, r in zip(idx, results):
                out[i] = r
        return out  # type: ignore[return-value]


@dataclass
class Releases:
    """The installed releases and their workers. Use as a context manager."""

    versions: tuple[str, ...]
    timeout: float = 60.0
    coverage: bool = False      # workers collect arc coverage of vLLM's offloading code
    mutant: str | None = None   # workers run their release with this mutant (benchmarks)
    bases: dict[str, str] = field(default_factory=dict)   # derived target -> its release
    _workers: dict = field(default_factory=dict)

    def release_of(self, name: str) -> str:
        """The pinned release of a target: itself, or the base of a derived target."""
        return self.bases.get(name, name)

    @classmethod
    def installed(cls, only: list[str] | None = None, timeout: float = 60.0,
                  coverage: bool = False, mutant: str | None = None) -> "Releases":
        """The installed releases (``only``: these, by name; derived targets are used only
        when named, and a ``--tree`` one is rebuilt first if its tree changed)."""
        import sys

        from simsched.vllm import derived, releases
        have = [r.version for r in releases.installed()]
        bases = {}
        for t in releases.installed_derived():
            if only is not None and t.version in only:
                derived.refresh(t, progress=lambda s: print(s, file=sys.stderr, flush=True))
                have.append(t.version)
                bases[t.version] = t.release
        if only is not None:
            missing = [v for v in only if v not in have]
            # only a release simsched pins a wheel for (releases.json) can be installed
            unknown = [v for v in missing if v not in releases.KNOWN_RELEASES]
            if unknown:
                known = ", ".join(releases.KNOWN_RELEASES)
                raise releases.ReleaseError(
                    f"{', '.join(unknown)}: not a known vLLM release (known: {known}; "
                    f"installed: {', '.join(have) or 'none'}; a target of your own: "
                    f"simsched releases add)")
            if missing:
                raise releases.ReleaseError(
                    f"vLLM release(s) {', '.join(missing)} not installed "
                    f"(installed: {', '.join(have) or 'none'}); run: simsched releases install "
                    + " ".join(missing))
            have = [v for v in have if v in only]
        return cls(tuple(have), timeout, coverage, mutant, bases)

    def targets(self) -> list[ReleaseTarget]:
        return [ReleaseTarget(v, self) for v in self.versions]

    def worker(self, version: str, asserts: bool = True):
        key = (version, asserts)
        if key not in self._workers:
            from simsched.vllm.worker import ReleaseWorker, spec_for
            self._workers[key] = ReleaseWorker(
                spec_for(version, asserts=asserts, coverage=self.coverage, mutant=self.mutant),
                timeout=self.timeout)
        return self._workers[key]

    def take_coverage(self, versions=None) -> dict:
        """Arc coverage since the last call, summed over the running workers of ``versions``
        (default: all) (``hit``, ``new``, ``rare``, ``total``; see
        :mod:`simsched.vllm.inside.coverage`). Zeros without coverage; a worker that fails to
        answer counts as nothing covered (its next call restarts it)."""
        out = {"hit": 0, "new": 0, "rare": 0.0, "total": 0}
        if not self.coverage:
            return out
        for (version, _), w in self._workers.items():
            if w.pid is None or (versions is not None and version not in versions):
                continue
            try:
                got = w.call("coverage", action="take")
            except Exception:   # noqa: BLE001 - coverage is a measurement, never a stop
                continue
            for k in out:
                out[k] += got.get(k, 0)
        return out

    def reset_coverage(self) -> None:
        """Forget the coverage collected so far in every running worker."""
        for w in self._workers.values():
            if self.coverage and w.pid is not None:
                w.call("coverage", action="reset")

    def warm(self, asserts_modes: tuple[bool, ...] = (True,),
             versions=None) -> tuple[float, list[BaseException]]:
        """Start the workers (in parallel) and build each one's base config: the seconds taken,
        and what went wrong (a worker that failed to start restarts on its first call)."""
        import os
        import threading
        import time
        t0 = time.monotonic()
        probe = {"layout": {"groups": [{"kind": "full", "block_size": 16}]}, "num_tokens": 16}
        errors: list[BaseException] = []

        # at most one start per core at a time: twenty workers importing torch and vLLM at
        # once on two cores each take minutes, past their start-up time limit
        slots = threading.Semaphore(max(1, os.cpu_count() or 1))

        def start(version: str, asserts: bool) -> None:
            with slots:
                try:
                    self.worker(version, asserts).call("config_batch", items=[probe])
                except BaseException as e:   # reported below; the campaign records failures
                    errors.append(e)

        keys = [(v, a) for v in (versions or self.versions) for a in asserts_modes]
        for key in keys:   # create serially: the dict is not shared across threads
            self.worker(*key)
        threads = [threading.Thread(target=start, args=key) for key in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0, errors

    def close(self) -> None:
        """Close every worker, in parallel: each takes a second or two to exit."""
        import threading
        threads = [threading.Thread(target=w.close) for w in self._workers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._workers.clear()

    def __enter__(self) -> "Releases":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
