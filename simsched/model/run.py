"""Running a case on the model: ``run_case`` and its ``RunResult``, and ``simsched run``.

``run_case`` does what the engine does before and around the scheduler: it applies vLLM's
start-up checks (the KV cache pool, ``check_enough_kv_cache_memory``; the block size,
``validate_block_size``), builds the model (:class:`~simsched.model.scheduler.Model`), runs it
to the end of the case or to its first finding (a crash or an invariant violation), and
returns the trace, the findings and the counters. ``cli_run`` is the command ``simsched run``.
"""

from __future__ import annotations

import gc
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from simsched import invariants as inv
from simsched.case import Case, load_case
from simsched.geometry import check_enough_kv_cache_memory, validate_block_size
from simsched.layout import LayoutError
from simsched.model.scheduler import Model, RunEnded, TransferFailed
from simsched.profiles import DEFAULT_PROFILE, PROFILES, ConfigError, Profile
from simsched.trace import header


def resolve_profile(profile: Profile | str | None) -> Profile:
    if isinstance(profile, Profile):
        return profile
    name = profile or DEFAULT_PROFILE
    if name in PROFILES:
        return PROFILES[name]
    raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")


@dataclass
class RunResult:
    profile: str
    trace: list[str] = field(default_factory=list)
    findings: list[dict] = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    # why the engine refused to start (check_enough_kv_cache_memory): the case did not run
    refused: str | None = None
    # why the run stopped short of the case's end without a finding (a failed transfer)
    unsupported: str | None = None

    @property
    def ok(self) -> bool:
        return not self.findings

    def trace_text(self) -> str:
        return "\n".join(self.trace) + "\n"


def crash_finding(e: ConfigError, step: int | None) -> dict:
    out = {"kind": "crash", "exception": e.exception, "function": e.function, "file": e.file,
           "stage": e.stage, "message": e.message, "step": step,
           "caller": getattr(e, "caller", "") or None}
    return out


def run_case(case: Case, profile: Profile | str | None = None, *, checks: str = "full",
             trace: bool = True, observed_walks: dict[int, list] | None = None) -> RunResult:
    """Run ``case`` under ``profile`` (a name from ``PROFILES`` or a Profile).

    ``checks="full"`` checks every invariant (INV-1/2 walk the pool every step); ``"fast"``
    skips the O(pool) walk and the INV-9 oracle. ``trace=False`` keeps no trace lines.
    ``observed_walks``: job ID -> the order a release's run walked the job's key set in, the
    one order vLLM leaves unspecified (``cpu_manager.walk_order``), for a run compared with it.

    The run pauses the cyclic garbage collector (:func:`collector_paused`).
    """
    with collector_paused():
        return _run_case(case, profile, checks, trace, observed_walks)


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused, and resumed on exit if it was on, around a run: a
    run leaves no cyclic garbage (``Model.release`` breaks the model's own cycles; see
    ``tests/test_model.py::test_run_leaves_no_cyclic_garbage``), so the collector's automatic
    passes, one every few hundred container allocations, walked the run's live objects and
    freed nothing. Reference counting frees everything the run drops, as before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _run_case(case: Case, profile: Profile | str | None, checks: str, trace: bool,
              observed_walks: dict[int, list] | None = None) -> RunResult:
    if not case.layout.planned:
        raise LayoutError("layout.groups", "a layout of layers runs once a release's planner "
                          "built its groups (simsched.planning.plan)")
    prof = resolve_profile(profile)
    result = RunResult(profile=prof.name)
    # the engine checks its KV cache pool (get_kv_cache_configs), then the block size
    # (validate_block_size), before it builds the scheduler
    refusal = check_enough_kv_cache_memory(case, prof) or validate_block_size(case, prof)
    if refusal is not None:
        result.refused = refusal
        result.trace = [header(prof.name, case.asserts), f"refused at start-up: {refusal}"]
        result.counters = {"steps": 0, "stores": 0, "loads": 0, "preemptions": 0}
        return result
    try:
        model = Model(case, prof, checks=checks, trace=trace, observed_walks=observed_walks)
    except ConfigError as e:
        result.trace = [header(prof.name, case.asserts),
                        f"crash {e.exception} {e.function} {e.stage}"]
        result.findings.append(crash_finding(e, None))
        result.counters = {"steps": 0, "stores": 0, "loads": 0, "preemptions": 0}
        return result
    try:
        model.run()
    except ConfigError as e:
        model.lines.append(f"crash {e.exception} {e.function} {e.stage}")
        result.findings.append(crash_finding(e, model.step_no))
        e.__traceback__ = None      # (see below)
    except TransferFailed as e:
        result.unsupported = str(e)
        e.__traceback__ = None
    except RunEnded as e:      # a job that never completes: the last line says so
        e.__traceback__ = None
    except inv.InvariantViolation as v:
        model.lines.append(f"violation {v.inv_id} {v.detail}")
        result.findings.append(v.to_json())
        # the finding is kept as data: drop the traceback, whose frames hold the model and, where
        # a check's result was raised (``raise v``), the exception itself (a cycle that only the
        # cyclic collector would free)
        v.__traceback__ = None
    model.counters["cpu_evictions"] = model.off.tier.evictions
    result.trace = model.lines
    result.counters = model.counters
    model.release()
    return result


def cli_run(case_path: str, profile: str | None = None, out=sys.stdout) -> int:
    """``simsched run CASE.json``: print the trace; 0 when clean, 1 when a finding occurred."""
    case = load_case(case_path)
    result = run_case(case, profile)
    out.write(result.trace_text())
    if result.refused is not None:
        return 0            # not run: no finding
    if result.unsupported is not None:
        out.write(f"UNSUPPORTED {result.unsupported}\n")
        return 0
    if result.findings:
        f = result.findings[0]
        if f["kind"] == "crash":
            out.write(f"FINDING crash: {f['exception']} in {f['function']} (stage {f['stage']}, "
                      f"step {f['step']}): {f['message']}\n")
        else:
            out.write(f"FINDING {f['inv_id']} at step {f['step']}: {f['detail']}\n")
        return 1
    c = result.counters
    out.write(f"CLEAN steps={c['steps']} stores={c['stores']} loads={c['loads']} "
              f"preemptions={c['preemptions']}\n")
    return 0
