"""Lockstep replay: one case on the model and on a real vLLM release, traces diffed step by step.

::

    with Releases.installed(["0.33.0"]) as pool:
        res = lockstep(case, "0.33.0", pool)        # -> LockstepResult
        res.agree, res.divergence, res.observations

The release side runs in the release's worker (op ``run_case``,
:mod:`simsched.vllm.inside.run`): the real ``Scheduler`` and ``OffloadingConnector`` driven
through the case, emitting ``simsched-trace/1`` and checking the invariants on a content shadow
of the real run. The model side is :func:`simsched.model.run_case` under
``profile_for_release(version)`` (a derived target: its base release's).

Comparison (:func:`diff_traces`) is per step: the trace is cut into segments at ``step`` lines and
each segment is put in a canonical order (lines of one kind keep their order;
``finish``/``done``/``landed`` lines, whose order inside a step is an artefact of event
priorities, are sorted, and so are
``preempt`` lines: the release side lists them in request-ID order, as
``SchedulerOutput.preempted_req_ids`` is a set and keeps no preemption order). ``crash`` lines
compare on exception and function (not stage), ``violation`` lines on the invariant ID.

Findings (:func:`lockstep_observations`, :class:`simsched.replay.Observation`):

* ``crash:<Exception>:<function>`` on the release (innermost vLLM frame; file and release in the
  outcome), also ``crash:WorkerDied:release_worker`` / ``crash:WorkerTimeout:release_worker``
  when the worker died, ran out of memory or hung (the case is recorded, never lost);
* ``invariant:INV-n`` broken by the real release (content shadow of the real run);
* ``divergence:trace.<kind>`` where model and release first differ (``kind`` of the first
  differing line: sched, alloc, preempt, recv, load, store, flush, done, landed, finish,
  crash, violation, end);
* a crash inside the model's own code: ``crash:<Exception>:simsched.<function>`` on target
  ``model:<profile>``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from simsched.case import Case
from simsched.outcome import Observation, Signature
from simsched.profiles import profile_for_release
from simsched.targets import model_crash

DEFAULT_CASE_TIMEOUT = 120.0
CONTEXT_STEPS = 3

#: canonical order of line kinds inside a step segment
_RANK = {"step": 0, "preempt": 1, "recv": 2, "load": 3, "sched": 4, "alloc": 4, "store": 5,
         "flush": 6, "check": 7, "violation": 7, "crash": 7, "finish": 8, "done": 8,
         "failed": 8, "landed": 8}

HINTS = {
    "sched": "scheduling: token budget, running-before-waiting order, prefill chunking, "
             "admission after a load (model._step / Scheduler.schedule)",
    "alloc": "block allocation: free-queue order (LIFO for unhashed blocks), GPU prefix-hit "
             "length, sliding-window null placeholders (model/kv_cache_manager.py / block_pool.py, "
             "single_type_kv_cache_manager.py)",
    "preempt": "preemption order: which running request is preempted when the pool runs dry",
    "store": "store job chunking: storable_chunks, reachable-block mask, keys chosen per chunk "
             "(offload._build_store_jobs / scheduler._build_store_jobs)",
    "load": "load hit length: _lookup_complete_chunks, window reach, max_load_tokens; "
            "destination blocks in update_state_after_alloc",
    "recv": "NIXL pulls: the child that serves a request, the unhashed blocks it pulls "
            "(model/multi_connector.py, nixl_scheduler.py)",
    "landed": "a NIXL pull lands remote_prefill steps after its start (Model.recv_done)",
    "flush": "fences: _block_id_to_pending_jobs / jobs_to_flush on re-allocated blocks or "
             "preemption",
    "done": "transfer completion timing (store/load latency, flushed jobs)",
    "finish": "request finish or abort timing (max_tokens, abort_at, delayed frees)",
    "crash": "an exception: compare the raising function on both sides",
    "violation": "an invariant: one side breaks it",
    "end": "one side ran more steps than the other (liveness, stall detection, trailing step)",
    "check": "invariant checks",
    "refused": "the start-up checks: the KV cache pool for max_model_len "
               "(geometry.check_enough_kv_cache_memory / check_enough_kv_cache_memory), the "
               "block size (geometry.validate_block_size / VllmConfig.validate_block_size)",
}


def _kind(line: str) -> str:
    return line.split(" ", 1)[0]


def _norm(line: str) -> str:
    parts = line.split(" ")
    k = parts[0]
    if k == "crash":
        return " ".join(parts[:3])
    if k == "violation":
        return " ".join(parts[:2])
    return line


def segments(trace: list[str]) -> list[list[str]]:
    """The trace cut at ``step`` lines (segment 0: before the first step), header dropped.

    Empty steps (``step n`` + ``check ok`` only) are dropped and step numbers are not compared:
    the model takes one more step at ``t + 1`` when a transfer is still pending at the end of the
    step at ``t``, even when its completion is reported before that step, while the real engine
    (nothing scheduled, nothing pending once the output is processed) idles until the next
    arrival. Such a step changes nothing but the numbering of the following steps.
    """
    out: list[list[str]] = [[]]
    for line in trace:
        if line.startswith("#"):
            continue
        if line.startswith("step "):
            out.append([line])
        else:
            out[-1].append(line)
    return [seg for i, seg in enumerate(out)
            if i == 0 or not (len(seg) == 2 and seg[1] == "check ok")]


#: ranks of the line kinds sorted inside a step (preempt; finish, done and landed)
_SORTED_RANKS = (1, 8)


def canonical(seg: list[str]) -> list[str]:
    """``seg`` in canonical order. A step that ends on a broken invariant compares on what it
    scheduled and the invariant alone: the model finds a completion's violation between steps
    (after the step's check), the harness in the step's worker output (before it)."""
    lines = ["step" if x.startswith("step ") else _norm(x) for x in seg]
    if any(x.startswith("violation ") for x in lines):
        lines = [x for x in lines if _RANK.get(_kind(x), 9) < 7 or _kind(x) == "violation"]
    keyed = [(_RANK.get(_kind(x), 9), (x if _RANK.get(_kind(x)) in _SORTED_RANKS else ""), i, x)
             for i, x in enumerate(lines)]
    keyed.sort()
    return [k[3] for k in keyed]


@dataclass
class Divergence:
    step: int                    # the model's step number where the traces differ
    kind: str                    # kind of the first differing line
    model_line: str | None
    real_line: str | None
    model_segment: list[str]
    real_segment: list[str]
    context: list[str]           # the few steps before (model side; they agree)
    hint: str

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def describe(self) -> str:
        out = [f"first divergence at step {self.step}: {self.kind} ({self.hint})",
               "  context (both sides agree):"]
        out += [f"    {x}" for x in self.context]
        out.append(f"  model: {self.model_line}")
        out.append(f"  real:  {self.real_line}")
        out.append("  model step:")
        out += [f"    {x}" for x in self.model_segment]
        out.append("  real step:")
        out += [f"    {x}" for x in self.real_segment]
        return "\n".join(out)


def diff_traces(model: list[str], real: list[str], context_steps: int = CONTEXT_STEPS
                ) -> Divergence | None:
    """The first step where the two traces differ, or None when they agree."""
    ms, rs = segments(model), segments(real)
    for i in range(max(len(ms), len(rs))):
        m = canonical(ms[i]) if i < len(ms) else None
        r = canonical(rs[i]) if i < len(rs) else None
        if m == r:
            continue
        if m is None or r is None:
            kind = "end"
            ml = m[0] if m else None
            rl = r[0] if r else None
            # one side stopped: its last lines say why (crash, violation)
            last = (ms if m is None else rs)[-1]
            tail = [x for x in last if _kind(x) in ("crash", "violation")]
            if tail:
                kind = _kind(tail[0])
        else:
            j = next((j for j in range(max(len(m), len(r)))
                      if j >= len(m) or j >= len(r) or m[j] != r[j]))
            ml = m[j] if j < len(m) else None
            rl = r[j] if j < len(r) else None
            kind = _kind(ml or rl or "end")
            if {_kind(ml or ""), _kind(rl or "")} & {"crash", "violation"}:
                kind = "crash" if "crash" in (_kind(ml or ""), _kind(rl or "")) \
                    else "violation"
            elif ml is not None and rl is not None and _kind(ml) != _kind(rl):
                # a line present on one side only: name the kind that is missing or extra
                kind = min(_kind(ml), _kind(rl), key=lambda k: _RANK.get(k, 9))
        ctx = [x for seg in ms[max(1, i - context_steps):i] for x in seg]
        ref = ms[i] if i < len(ms) else (rs[i] if i < len(rs) else [])
        step = int(ref[0].split()[1]) if ref and ref[0].startswith("step ") else -1
        return Divergence(step=step, kind=kind, model_line=ml, real_line=rl,
                          model_segment=ms[i] if i < len(ms) else [],
                          real_segment=rs[i] if i < len(rs) else [], context=ctx,
                          hint=HINTS.get(kind, ""))
    return None


@dataclass
class LockstepResult:
    case: Case
    version: str
    profile: str
    model: Any                   # simsched.model.RunResult (or None if the model crashed)
    real: dict                   # the worker's result (status, trace, findings, counters, wall)
    divergence: Divergence | None
    observations: list[Observation] = field(default_factory=list)
    model_seconds: float = 0.0
    real_seconds: float = 0.0

    @property
    def agree(self) -> bool:
        return self.divergence is None and self.real.get("status") == "ok"

    def summary(self) -> str:
        if self.real.get("status") == "unsupported" and self.divergence is not None:
            return f"{self.version}: {self.divergence.describe()}"
        if self.real.get("status") == "refused" and self.divergence is None:
            return f"{self.version}: not run: refused at start-up: {self.real.get('reason', '')}"
        if self.real.get("status") not in ("ok",):
            return f"{self.version}: {self.real.get('status')}: {self.real.get('reason', '')}"
        if self.agree:
            c = self.real.get("counters", {})
            return (f"{self.version}: agree ({c.get('steps')} steps, {c.get('stores')} stores, "
                    f"{c.get('loads')} loads)")
        return f"{self.version}: {self.divergence.describe()}"


def run_real(case: Case, version: str, pool, mutant: str | None = None,
             timeout: float | None = DEFAULT_CASE_TIMEOUT) -> dict:
    """The release side; a worker that died, hung or broke becomes a ``worker`` outcome."""
    from simsched.vllm.worker import HarnessError, WorkerDied, WorkerError, WorkerTimeout

    worker = pool.worker(version, case.asserts)
    try:
        return worker.call("run_case", timeout=timeout, case=case.to_json(), mutant=mutant)
    except (WorkerDied, WorkerTimeout, HarnessError, WorkerError) as e:
        first = str(e).splitlines()[0][:300] if str(e) else ""
        return {"status": "worker", "exception": type(e).__name__, "function": "release_worker",
                "message": first, "trace": [], "findings": [], "counters": {},
                "signal": getattr(e, "signal", None)}


def lockstep(case: Case, version: str, pool, mutant: str | None = None,
             timeout: float | None = DEFAULT_CASE_TIMEOUT) -> LockstepResult:
    from simsched.model import run_case, unmodelled_path
    from simsched.planning import plan

    profile = profile_for_release(pool.release_of(version))
    planned, outcome = plan(case, version, pool, timeout=timeout)
    if planned is None:         # a layout of layers whose engine does not start: no run
        res = LockstepResult(case, version, profile.name, None, outcome, None)
        res.observations = _observations(res, None)
        return res
    case = planned
    t0 = time.perf_counter()
    real = run_real(case, version, pool, mutant=mutant, timeout=timeout)
    t1 = time.perf_counter()
    model, model_err = None, None
    try:
        # the order each job's key set was walked in is vLLM's to leave unspecified: the model
        # takes the release's (cpu_manager.walk_order) and is compared on everything else. A
        # connector path the model does not mirror is checked on the real run alone
        if unmodelled_path(case.layout, profile) is None:
            model = run_case(case, profile, observed_walks=dict(real.get("walks") or ()))
    except Exception as e:   # a bug in the model is a finding of its own
        model_err = model_crash(e)
    t2 = time.perf_counter()
    div = None
    if model is not None and stepped(real):
        div = diff_traces(model.trace, real["trace"])
    elif real.get("status") == "refused" and model is not None and model.refused is None:
        div = _refused_by_release_only(real)
    res = LockstepResult(case, version, profile.name, model, real, div,
                         model_seconds=t2 - t1, real_seconds=t1 - t0)
    res.observations = _observations(res, model_err)
    return res


def stepped(real: dict) -> bool:
    """The release ran the case step by step: to its end (``ok``), or until a step where it
    stopped short of a finding (``unsupported`` with a trace: a failed transfer, case.faults)."""
    return real.get("status") == "ok" or (real.get("status") == "unsupported"
                                          and bool(real.get("trace")))


def _refused_by_release_only(real: dict) -> Divergence:
    """The release refused at start-up a case the model runs."""
    return Divergence(step=-1, kind="refused", model_line=None,
                      real_line=f"refused at start-up: {real.get('reason', '')}",
                      model_segment=[], real_segment=[], context=[], hint=HINTS["refused"])


def _observations(res: LockstepResult, model_err: dict | None) -> list[Observation]:
    obs: list[Observation] = []
    real, version = res.real, res.version
    if model_err is not None:
        obs.append(Observation(Signature("crash", model_err["exception"], model_err["function"]),
                               f"model:{res.profile}", model_err))
    status = real.get("status")
    if status == "worker":
        obs.append(Observation(Signature("crash", real["exception"], "release_worker"), version,
                               dict(real, release=version)))
        return obs
    if not stepped(real):   # refused at start-up (check_enough_kv_cache_memory), unsupported:
        if res.divergence is not None:          # not run, no finding: unless the model ran it
            obs.append(Observation(Signature("divergence", function="trace.refused"), version,
                                   {"divergence": res.divergence.to_json(), "release": version,
                                    "profile": res.profile}))
        return obs
    for f in real.get("findings", []):
        if f.get("kind") == "crash":
            out = dict(f, release=version)
            obs.append(Observation(Signature("crash", f["exception"], f.get("function") or "?"),
                                   version, out))
        elif f.get("kind") == "invariant":
            obs.append(Observation(Signature("invariant", invariant=f["inv_id"]), version,
                                   dict(f, release=version)))
    if res.divergence is not None:
        d = res.divergence
        obs.append(Observation(Signature("divergence", function=f"trace.{d.kind}"), version,
                               {"divergence": d.to_json(), "release": version,
                                "profile": res.profile}))
    return obs


def lockstep_observations(case: Case, target, mutant: str | None = None) -> list[Observation]:
    """For :mod:`simsched.replay` and campaigns: ``target`` a ``ReleaseTarget``."""
    return lockstep(case, target.version, target.pool, mutant=mutant).observations


# --- generated cases ---------------------------------------------------------------------------

LAYOUTS: dict[str, list[dict]] = {
    "full16": [{"kind": "full", "block_size": 16}],
    "full16+sw16w128+full16": [{"kind": "full", "block_size": 16},
                               {"kind": "sliding_window", "block_size": 16,
                                "sliding_window": 128},
                               {"kind": "full", "block_size": 16}],
    "full16+ring4": [{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}],
    "full32": [{"kind": "full", "block_size": 32}],
    "full16+sw16w64": [{"kind": "full", "block_size": 16},
                       {"kind": "sliding_window", "block_size": 16, "sliding_window": 64}],
    "mla16": [{"kind": "mla", "block_size": 16}],
    "mla64": [{"kind": "mla", "block_size": 64}],
    "full16+chunked16c64": [{"kind": "full", "block_size": 16},
                            {"kind": "chunked_local", "block_size": 16,
                             "attention_chunk_size": 64}],
    # Mamba in "align" mode: the mode the offloading connector supports (outside it the boot
    # assert of build_offloading_config fires on every release)
    "full16+mamba16align": [{"kind": "full", "block_size": 16},
                            {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}],
    # speculative decoding (engine knobs in LAYOUT_ENGINE): n-gram drafts (no drafter group,
    # no lookahead slots) and EAGLE with a drafter group beside its target (lookahead slots)
    "full16+ngram2": [{"kind": "full", "block_size": 16}],
    "full16+full16drafter+eagle2": [{"kind": "full", "block_size": 16},
                                    {"kind": "full", "block_size": 16, "drafter": True}],
}

#: engine knobs of a generated layout beside the pool and tier sizes
LAYOUT_ENGINE: dict[str, dict] = {
    "full16+ngram2": {"speculative": {"method": "ngram", "num_tokens": 2}},
    "full16+full16drafter+eagle2": {"speculative": {"method": "eagle", "num_tokens": 2}},
}
_MAMBA_ALIGN = LAYOUTS["full16+mamba16align"]


def generate_case(seed: int, layout: str = "full16", n_requests: int | None = None,
                  async_scheduling: bool = False) -> Case:
    """A small random workload: shared prefixes, a small GPU pool (so that the CPU tier serves
    hits), short decodes, arrivals spread over a few steps, now and then an abort.
    ``async_scheduling``: the same workload under the engine's async scheduling (the
    ``AsyncScheduler`` and a batch queue of depth 2); it draws nothing from the seed's stream."""
    import random

    rng = random.Random(seed)
    n = n_requests or rng.randint(2, 8)
    groups = LAYOUTS[layout]
    knobs = LAYOUT_ENGINE.get(layout, {})
    reqs = random_requests(rng, seed, n, knobs.get("speculative"))
    per_token_blocks = len([g for g in groups if g["kind"] != "ring"])
    blocks = rng.choice([24, 32, 48, 96]) * per_token_blocks
    return Case.from_json({
        "layout": {"groups": groups, "engine": dict(
            {"num_gpu_blocks": blocks, "cpu_chunks": rng.choice([16, 64, 256])}, **knobs,
            **({"async_scheduling": True} if async_scheduling else {}))},
        "requests": reqs, "seed": seed, "timing": random_timing(rng)})


def random_requests(rng, seed: int, n: int, spec: dict | None) -> list[dict]:
    """``n`` requests of :func:`generate_case`: prompts of one of three shared prefixes and a
    private tail, arrivals over ``3n`` steps, short decodes, now and then an abort, and under
    speculative decoding the drafts each verification step accepts."""
    reqs = []
    for i in range(n):
        prefix = rng.randrange(3)
        plen = rng.choice([16, 32, 48, 64, 100])
        prompt = [[100 + prefix, plen]]
        if rng.random() < 0.7:
            prompt.append([1000 + seed * 31 + i, rng.randint(1, 90)])
        r: dict = {"id": f"r{i}", "prompt": prompt, "arrival": rng.randint(0, 3 * n),
                   "decode": rng.randint(1, 24)}
        if rng.random() < 0.1:
            r["abort_at"] = r["arrival"] + rng.randint(0, 6)
        if spec is not None and rng.random() < 0.8:
            # drafts accepted per verification step (the rest rejected)
            r["accept"] = [rng.randint(0, spec["num_tokens"])
                           for _ in range(rng.randint(1, 4))]
        reqs.append(r)
    return reqs


def random_timing(rng) -> dict:
    """Transfer latencies of 0 to 3 steps and one of three token budgets and batch sizes."""
    return {"store_latency": rng.randint(0, 3), "load_latency": rng.randint(0, 3),
            "max_num_batched_tokens": rng.choice([64, 128, 2048]),
            "max_num_seqs": rng.choice([2, 4, 32])}


#: hand-made cases: ``load`` (a prefix stored, evicted from the GPU by a filler, loaded back
#: from the CPU tier), ``fence`` (a finished request's blocks re-allocated while its store is
#: still pending: the store is flushed) and one per scheduler rule the model mirrors:
#: ``abort_load`` (b aborted while its load is in flight keeps its blocks until the load
#: completes: Scheduler.finish_requests, delay_free_blocks), ``full_seq`` (b is admitted only
#: once blocks for its whole prompt are free: allocate_slots(full_sequence_must_fit)) and
#: ``reserve`` (l2's load is admitted only within the blocks left beyond l1's reservation:
#: Scheduler._inflight_prefill_reserved_blocks) and ``promote`` (b's load completes, b is
#: aborted before the waiting loop reaches it: its loaded blocks were never cached, so they go
#: back to the front of the free queue: _update_waiting_for_remote_kv caches them only then)
#: and ``window_finish`` (a's sliding-window block that leaves the window with a's last token
#: is freed before the rest of a's blocks: Scheduler._connector_finished) and ``mamba_load``
#: (align-mode Mamba: a's state at 64 is stored as a job of its own, before a's chunk job, and
#: loaded back into one state block for b) and ``mamba_stall`` (the same with two blocks less:
#: a pool vLLM's start-up check refuses, f's 97 tokens needing 9 blocks of the 7 usable ones;
#: it used to stall, see docs/invariants.md); under async
#: scheduling: ``async_decode`` (a's decode is scheduled before its previous token is known, its
#: finish and its store's completion are seen one step later: AsyncScheduler, the engine's batch
#: queue) and ``async_abort`` (a, aborted while its batch is in flight, keeps its blocks until
#: that batch's output is processed: Scheduler.defer_block_free / deferred_frees);
#: ``async_window`` (a's sliding-window block that leaves the window with a's first decode is
#: freed only once the prefill's output is processed, so b, which needs that block, is admitted
#: one step later: allocate_slots frees on num_computed_tokens - num_in_flight_tokens); and
#: ``ring_fence`` (b's ring block is a's full-attention block that a's pending store still reads:
#: 0.33.0 flushes the store, its update_state_after_alloc counting every group's blocks; up to
#: 0.32.0 a ring block is not watched and b's step writes the block, INV-6); speculative
#: decoding: ``spec_reject`` (n-gram drafts, some rejected: num_computed_tokens rolls back in
#: update_from_output), ``spec_lookahead`` (the same under EAGLE with a drafter group:
#: allocate_slots reserves num_lookahead_tokens slots), ``spec_pad`` (b, a full GPU prefix hit
#: but its last token, is padded to 1 + k tokens of which the k padding drafts are rejected) and
#: ``spec_eagle_hit`` (EAGLE drops the last block of a GPU prefix hit; 0.32.0+ hybrid layouts
#: match one block further first); ``window_load`` (``load`` with a sliding-window group: a's
#: window chunks that b's hit needs are stored, b loads the three chunks whose window is ready)
#: and ``max_load_window`` (the same with b's max_load_tokens 48: 0.33.0 takes the last-token 1
#: off that cap too, and its 32-token hit needs a window chunk a never stored: b loads nothing,
#: INV-9; see docs/invariants.md) and ``chunked_local_reach`` (found by
#: ``bench/bench_real_oracles.py``, heavy seed 6 under async scheduling: r7 stores its
#: full-attention chunks only; r5 resumes at 64, where its chunked-local layers need no KV, but
#: the connector looks that group up as a 4-chunk sliding window: no hit, INV-9; see
#: docs/invariants.md)
HANDMADE: dict[str, dict] = {
    "load": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                        "engine": {"num_gpu_blocks": 8}},
             "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                          {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                          {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8, "decode": 2}]},
    "window_load": {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                          {"kind": "sliding_window", "block_size": 16,
                                           "sliding_window": 32}],
                               "engine": {"num_gpu_blocks": 16}},
                    "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                                 {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                                 {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8,
                                  "decode": 2}]},
    "max_load_window": {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                              {"kind": "sliding_window", "block_size": 16,
                                               "sliding_window": 32}],
                                   "engine": {"num_gpu_blocks": 16}},
                        "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                                     {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                                     {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8,
                                      "decode": 2, "max_load_tokens": 48}]},
    "chunked_local_reach": {
        "layout": {"groups": [{"kind": "full", "block_size": 16},
                              {"kind": "chunked_local", "block_size": 16,
                               "attention_chunk_size": 64}],
                   "engine": {"async_scheduling": True, "num_gpu_blocks": 40, "cpu_chunks": 8}},
        "timing": {"store_latency": 2, "max_num_seqs": 4}, "seed": 6,
        "requests": [
            {"id": "r0", "prompt": [[102, 48], [1186, 34]], "arrival": 1, "max_load_tokens": 32},
            {"id": "r1", "prompt": [[102, 128]], "arrival": 23, "decode": 12},
            {"id": "r2", "prompt": [[100, 48], [1188, 26]], "arrival": 23, "decode": 14},
            {"id": "r3", "prompt": [[102, 128], [1189, 71]], "arrival": 22, "decode": 24},
            {"id": "r4", "prompt": [[102, 160]], "arrival": 10, "decode": 3},
            {"id": "r5", "prompt": [[101, 96], [1191, 13]], "arrival": 24, "decode": 7},
            {"id": "r6", "prompt": [[101, 160]], "arrival": 18, "decode": 7},
            {"id": "r7", "prompt": [[101, 128]], "arrival": 6, "decode": 17}]},
    "fence": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                         "engine": {"num_gpu_blocks": 8}},
              "timing": {"store_latency": 8},
              "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 1},
                           {"id": "f", "prompt": [[9, 96]], "arrival": 3, "decode": 1}]},
    "abort_load": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                              "engine": {"num_gpu_blocks": 8}},
                   "timing": {"load_latency": 4},
                   "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                                {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                                {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8,
                                 "decode": 2, "abort_at": 9},
                                {"id": "c", "prompt": [[11, 40]], "arrival": 10, "decode": 1}]},
    "full_seq": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                            "engine": {"num_gpu_blocks": 8}},
                 "timing": {"max_num_batched_tokens": 32},
                 "requests": [{"id": "a", "prompt": [[7, 48]], "decode": 10},
                              {"id": "b", "prompt": [[9, 64]], "arrival": 2, "decode": 1}]},
    "reserve": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                           "engine": {"num_gpu_blocks": 16}},
                "timing": {"load_latency": 2},
                "requests": [{"id": "s1", "prompt": [[7, 96]], "decode": 1},
                             {"id": "s2", "prompt": [[12, 96]], "arrival": 2, "decode": 1},
                             {"id": "f", "prompt": [[9, 224]], "arrival": 4, "decode": 1},
                             {"id": "l1", "prompt": [[7, 96], [8, 100]], "arrival": 7,
                              "decode": 1},
                             {"id": "l2", "prompt": [[12, 96], [13, 5]], "arrival": 7,
                              "decode": 1}]},
    "promote": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                           "engine": {"num_gpu_blocks": 8}},
                "timing": {"load_latency": 1},
                "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                             {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                             {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8, "decode": 2,
                              "abort_at": 9},
                             {"id": "c", "prompt": [[11, 40]], "arrival": 9, "decode": 1}]},
    "async_decode": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                                "engine": {"num_gpu_blocks": 8, "async_scheduling": True}},
                     "timing": {"store_latency": 1},
                     "requests": [{"id": "a", "prompt": [[7, 32]], "decode": 3}]},
    "async_abort": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                               "engine": {"num_gpu_blocks": 8, "async_scheduling": True}},
                    "requests": [{"id": "a", "prompt": [[7, 40]], "decode": 10, "abort_at": 3},
                                 {"id": "b", "prompt": [[9, 20]], "arrival": 3, "decode": 1}]},
    "async_window": {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                           {"kind": "sliding_window", "block_size": 16,
                                            "sliding_window": 32}],
                                "engine": {"num_gpu_blocks": 12, "async_scheduling": True}},
                     "requests": [{"id": "a", "prompt": [[7, 48]], "decode": 5},
                                  {"id": "b", "prompt": [[9, 32]], "arrival": 1, "decode": 1}]},
    "ring_fence": {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                         {"kind": "ring", "block_size": 4}],
                              "engine": {"num_gpu_blocks": 8}},
                   "timing": {"store_latency": 6},
                   "requests": [{"id": "a", "prompt": [[7, 32]], "decode": 1},
                                {"id": "b", "prompt": [[9, 70]], "arrival": 1, "decode": 1}]},
    "spec_reject": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                               "engine": {"num_gpu_blocks": 16, "speculative": {
                                   "method": "ngram", "num_tokens": 2}}},
                    "requests": [{"id": "a", "prompt": [[7, 40]], "decode": 9,
                                  "accept": [0, 2, 1]}]},
    "spec_lookahead": {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                             {"kind": "full", "block_size": 16,
                                              "drafter": True}],
                                  "engine": {"num_gpu_blocks": 16, "speculative": {
                                      "method": "eagle", "num_tokens": 2}}},
                       "requests": [{"id": "a", "prompt": [[7, 40]], "decode": 9,
                                     "accept": [0, 2, 1]}]},
    "spec_pad": {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                            "engine": {"num_gpu_blocks": 16, "speculative": {
                                "method": "ngram", "num_tokens": 2}}},
                 "requests": [{"id": "a", "prompt": [[7, 32]], "decode": 12},
                              {"id": "b", "prompt": [[7, 32], [8, 1]], "arrival": 3,
                               "decode": 3}]},
    "spec_eagle_hit": {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                             {"kind": "full", "block_size": 16,
                                              "drafter": True}],
                                  "engine": {"num_gpu_blocks": 32, "speculative": {
                                      "method": "eagle", "num_tokens": 2}}},
                       "requests": [{"id": "a", "prompt": [[7, 48]], "decode": 3},
                                    {"id": "b", "prompt": [[7, 48]], "arrival": 4,
                                     "decode": 1}]},
    "window_finish": {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                            {"kind": "sliding_window", "block_size": 16,
                                             "sliding_window": 32}],
                                 "engine": {"num_gpu_blocks": 12}},
                      "requests": [{"id": "a", "prompt": [[7, 48]], "decode": 16},
                                   {"id": "b", "prompt": [[9, 64]], "arrival": 20,
                                    "decode": 1}]},
    "mamba_load": {"layout": {"groups": _MAMBA_ALIGN, "engine": {"num_gpu_blocks": 10}},
                   "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                                {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                                {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8,
                                 "decode": 2}]},
    "mamba_stall": {"layout": {"groups": _MAMBA_ALIGN, "engine": {"num_gpu_blocks": 8}},
                    "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                                 {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                                 {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8,
                                  "decode": 2}]},
}
