"""One checked run of a case: the real vLLM ``Scheduler`` (with the real ``OffloadingConnector``)
driven through it step by step, as the engine core drives it, inside a release worker (op
``run_case``).

Nothing under test is mocked: the ``VllmConfig`` holds a real ``ModelConfig`` (tiny local HF
config, :mod:`~simsched.vllm.inside.build`), the ``KVCacheConfig`` has one real group per layout
group (the hybrid KV cache manager is switched back on: the scheduler sees every group, checked
at boot), the connector builds its real CPU offloading manager. The harness plays the GPU
worker only, and each of its parts is a module of this package:

* :mod:`~simsched.vllm.inside.case_requests`: the case's requests, sent as they arrive;
* :mod:`~simsched.vllm.inside.model_runner`: the forward pass on the content shadow
  (:class:`simsched.shadow.Shadow`), sampled tokens, speculative drafts;
* :mod:`~simsched.vllm.inside.offload_worker`: the transfer jobs in flight, their completion
  due after the case's latencies, what they move between the GPU blocks and the CPU tier
  (:mod:`~simsched.vllm.inside.cpu_tier`, :mod:`~simsched.vllm.inside.partial_tails`);
* :mod:`~simsched.vllm.inside.offloading`: the connector's own objects, read and answered
  (its driver: :mod:`~simsched.vllm.inside.connector` is the seam);
* the checks: INV-1/2 on the real block pool (:mod:`~simsched.vllm.inside.pool_checks`),
  INV-3 to INV-7 and INV-10 on the jobs (:mod:`~simsched.vllm.inside.offload_worker`), INV-9 at
  every lookup the connector answers and INV-8 on deferrals
  (:mod:`~simsched.vllm.inside.hit_oracle`), INV-8 on the run
  (:mod:`~simsched.vllm.inside.liveness`).

With ``engine.async_scheduling`` the run plays the engine core's batch queue of depth 2
(``EngineCore.step_with_batch_queue``): it schedules step N+1 before it applies the output of
step N. It emits ``simsched-trace/1`` lines (see :mod:`simsched.trace`) from what the real
scheduler did.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from types import SimpleNamespace

from simsched import invariants as inv
from simsched.case import Case
from simsched.shadow import Shadow
from simsched.trace import fmt_alloc, header
from simsched.vllm.inside.case_requests import CaseRequests
from simsched.vllm.inside.connector import ConnectorDriver
from simsched.vllm.inside.external_kv import ExternalKV
from simsched.vllm.inside.hit_oracle import HitOracle
from simsched.vllm.inside.liveness import Liveness
from simsched.vllm.inside.model_runner import ModelRunner
from simsched.vllm.inside.offload_worker import OffloadWorker
from simsched.vllm.inside.partial_tails import PartialTails
from simsched.vllm.inside.pool_checks import block_tables, check_pool
from simsched.vllm.inside.stops import Crash, Ended, TransferFailed


class _Workload:
    """The case's arrivals, aborts and events in time order, taken as the run's clock passes
    them. A request aborted before it arrives is never sent (``RequestSpec.withdrawn``); its
    abort counts it aborted."""

    def __init__(self, case: Case):
        self.arrivals = sorted(((r.arrival, i, r) for i, r in enumerate(case.requests)
                                if not r.withdrawn), key=lambda x: (x[0], x[1]))
        self.aborts = sorted(((r.abort_at, i, r.id) for i, r in enumerate(case.requests)
                              if r.abort_at is not None))
        self.events = sorted(case.events, key=lambda e: e.step)
        self.ai = self.bi = self.ei = 0

    def start(self) -> int:
        return self.arrivals[0][0] if self.arrivals else 0

    def arriving(self, t: int):
        while self.ai < len(self.arrivals) and self.arrivals[self.ai][0] <= t:
            yield self.arrivals[self.ai][1], self.arrivals[self.ai][2]
            self.ai += 1

    def aborting(self, t: int):
        while self.bi < len(self.aborts) and self.aborts[self.bi][0] <= t:
            rid = self.aborts[self.bi][2]
            self.bi += 1
            yield rid

    def happening(self, t: int):
        while self.ei < len(self.events) and self.events[self.ei].step <= t:
            yield self.events[self.ei]
            self.ei += 1

    def to_come(self) -> bool:
        """A request is still to arrive or to be aborted."""
        return self.ai < len(self.arrivals) or self.bi < len(self.aborts)

    def next_times(self) -> list[int]:
        return ([x[0] for x in self.arrivals[self.ai:self.ai + 1]]
                + [x[0] for x in self.aborts[self.bi:self.bi + 1]]
                + [e.step for e in self.events[self.ei:self.ei + 1]])


class Run:
    """``checks``: ``"full"`` checks the block pool after every step; the content shadow and
    every other check run whatever it says."""

    def __init__(self, eng, case: Case, step_cap: int, checks: str):
        self.eng, self.case, self.step_cap, self.checks = eng, case, step_cap, checks
        self.lines = [header("vllm-" + _vllm_version(), case.asserts)]
        self.findings: list[dict] = []
        self.counters = {"steps": 0, "stores": 0, "loads": 0, "preemptions": 0, "finished": 0,
                         "aborted": 0, "scheduled_tokens": 0}
        self.step_no = 0
        self.loop_t0: float | None = None
        self.loop_c0 = 0.0
        # lookups the connector answered and checked: how many, how many the tier's ready
        # chunks gave a hit (the oracle's want > 0), how many deferred
        self.lookup_counts = {"checked": 0, "expected_hit": 0, "deferred": 0}
        self.unsupported: str | None = None
        # job ID -> its keys (as the model's keys) in the order of the job's key set
        # (TransferJobStatus.keys), which complete_store / complete_load walk: an order vLLM
        # leaves to the set (simsched.model.cpu_manager.walk_order); lockstep hands it to the model
        self.walks: dict[int, list] = {}
        self.driver: ConnectorDriver | None = None
        self.requests: CaseRequests | None = None
        self.unfinished = len(case.requests)

    # -- the outcome -----------------------------------------------------------------------
    def emit(self, line: str) -> None:
        self.lines.append(line)

    def result(self) -> dict:
        # loop_wall, loop_cpu: the Scheduler loop with the worker side, shadow and checks, boot
        # excluded (as BareRun's), for bench/bench_real_side.py
        started = self.loop_t0 is not None
        stopped = {} if self.unsupported is None else {"reason": self.unsupported}
        return {"status": "ok" if self.unsupported is None else "unsupported", **stopped,
                "trace": self.lines, "findings": self.findings,
                "counters": self.counters, "lookups": self.lookup_counts,
                "walks": sorted(self.walks.items()),
                "loop_wall": time.perf_counter() - self.loop_t0 if started else None,
                "loop_cpu": time.process_time() - self.loop_c0 if started else None}

    def go(self) -> None:
        try:
            self._go()
        except Crash as c:
            info = self.eng.crash_info(c.stage, c.exc)
            self.lines.append(f"crash {info['exception']} {info['function'] or '?'} {c.stage}")
            info.update(kind="crash", step=self.step_no, op=c.stage)
            self.findings.append(info)
        except inv.InvariantViolation as v:
            self.lines.append(f"violation {v.inv_id} {v.detail}")
            self.findings.append(dict(v.to_finding(),
                                      group_kinds=self._kinds_named(v.detail)))
        except TransferFailed as f:
            self.unsupported = f.reason
        except Ended as e:
            self.lines.append(e.line)
        finally:
            # the observed lookup was this connector's own attribute: drop it; what the
            # connector holds outside the process goes, whatever the run ended in
            if self.driver is not None:
                try:
                    self.driver.stop_observing()
                finally:
                    self.driver.close()

    def _kinds_named(self, detail: str) -> str | None:
        """The kinds of the KV cache groups a violation names (``group 2``, ``g1:3``, or a
        block some request's table of that group holds), for the finding's cluster; None
        where it names none."""
        groups = {int(a or b) for a, b in re.findall(r"\bgroup (\d+)|\bg(\d+):", detail)}
        blocks = {int(b) for b in re.findall(r"\bblock (\d+)", detail)}
        if blocks and self.requests is not None:
            for rid in self.requests.reqs:
                for gid, table in enumerate(block_tables(self.sched, rid)):
                    if blocks & set(table):
                        groups.add(gid)
        layout = self.case.layout.groups
        kinds = sorted({layout[g].kind + ("-drafter" if layout[g].drafter else "")
                        for g in groups if g < len(layout)})
        return "+".join(kinds) or None

    def call(self, stage: str, fn, *args, **kw):
        """A call into vLLM: what it raises is a crash of ``stage`` (an observation), but
        the harness's refusal of a case (``Unsupported``)."""
        try:
            return fn(*args, **kw)
        except self.eng.Unsupported:
            raise
        except Exception as e:   # noqa: BLE001 - vLLM's failure is the observation
            raise Crash(stage, e) from e

    # -- boot ------------------------------------------------------------------------------
    def _boot(self) -> None:
        eng, case = self.eng, self.case
        vc, kvc, sched, sbs, tph = self.call("boot", eng.boot, case)
        self.sched, self.tph, self.vc, self.kvc = sched, tph, vc, kvc
        driver = self.driver = eng.connector_driver(sched, tph, case)
        layout = case.layout
        mgrs = sched.kv_cache_manager.coordinator.single_type_managers
        block_sizes = [int(m.block_size) for m in mgrs]
        # per group, what the shadow writes by: the block size, and whether it is a ring
        self.shadow_groups = [(bs, g.kind == "ring")
                              for g, bs in zip(layout.groups, block_sizes)]
        self.shadow = Shadow(layout.engine.num_gpu_blocks, driver.blocks_per_chunk)
        self.requests = CaseRequests(eng, case, sched, eng.probe.hasher(vc, tph),
                                     math.gcd(tph, *block_sizes), self.call,
                                     driver.kv_transfer_params)
        self.tails = PartialTails(driver.partial_tails, tph, driver.group_by_id)
        self.worker = OffloadWorker(self, driver, driver.cpu_tier(), self.tails, self.walks)
        self.oracle = HitOracle(case, self.requests, driver, self.worker.hung,
                                lambda: self.step_no, self.lookup_counts)
        # speculative decoding (sync scheduling): the worker proposes drafts after each
        # executed step (EngineCore.post_step -> Scheduler.update_draft_token_ids)
        spec = layout.engine.speculative
        num_spec = (spec.num_tokens if spec is not None and not layout.engine.async_scheduling
                    else 0)
        self.runner = ModelRunner(self, self.tails, self.worker.pending_reads, num_spec)
        # KV another connector writes into GPU blocks (a remote prefill pulled through NIXL)
        self.external = ExternalKV(self, driver, self.worker.pending_reads)
        self.liveness = Liveness(self.requests, self.worker, self.oracle, driver,
                                 eng.RequestStatus.RUNNING, self.step_cap)
        # every lookup the connector answers is checked (INV-9, deferrals)
        driver.observe_lookups(self.oracle.observe)

    # -- the loop --------------------------------------------------------------------------
    def _go(self) -> None:
        self._boot()
        self.loop_t0, self.loop_c0 = time.perf_counter(), time.process_time()
        sched, work = self.sched, _Workload(self.case)
        t = work.start()
        # EngineCore's batch queue: depth 2 with async scheduling (step_with_batch_queue,
        # VllmConfig.max_concurrent_batches), else 1 (EngineCore.step)
        depth = 2 if self.case.layout.engine.async_scheduling else 1
        queue: deque = deque()
        while (self.unfinished > 0 or sched.has_requests() or self.worker.live() or queue
               or self.external.live()):
            # completions are delivered in update_from_output; arrivals and aborts at t
            self._arrive(work, t)
            if self.unfinished <= 0 and not sched.has_requests() and not queue:
                if not self.worker.live():
                    break
                if self.driver.strands_at_idle:
                    self.emit("end idle with jobs in flight: " + ", ".join(
                        f"{j.kind} {j.jid}" for j in self.worker.in_flight()))
                    break
            if (not sched.has_requests() and not self.driver.has_jobs()
                    and not self.worker.live() and not self.external.live()):
                t = self._idle(work, t, queue)
                continue
            batch = self._schedule_execute(t)
            queue.appendleft(batch)
            if len(queue) < depth and (batch.executed or sched.has_requests()):
                # the batch queue is not full: schedule the next batch before collecting this one
                self._check_step()
                self.liveness.check(self.step_no, self.counters["steps"],
                                    batch.executed or self.external.live(), work.to_come(),
                                    self.unfinished)
                t += 1
                continue
            progress, done, failed = self._update(queue.pop())
            self._end_call(progress or batch.executed or self.external.live(), done, failed,
                           work.to_come())
            t += 1

    def _arrive(self, work: _Workload, t: int) -> None:
        """The requests arriving at ``t``, the aborts due, and the case's events."""
        for i, spec in work.arriving(t):
            self.requests.add(i, spec)
        for rid in work.aborting(t):
            self._abort(rid)
        for event in work.happening(t):
            if self.unfinished > 0:      # (as the model: an event while the case is running)
                self._case_event(event)

    def _abort(self, rid: str) -> None:
        """``Scheduler.finish_requests(FINISHED_ABORTED)``; a request never sent is counted
        aborted, one finished already is left alone."""
        req, finished = self.requests.reqs.get(rid), self.requests.finished
        if req is None:
            self.unfinished -= 1
            self.counters["aborted"] += 1
            return
        if rid in finished:
            return
        self.call("finish_requests", self.sched.finish_requests, [rid],
                  self.eng.RequestStatus.FINISHED_ABORTED)
        finished.add(rid)
        self.unfinished -= 1
        self.counters["aborted"] += 1
        self.emit(f"finish {rid} aborted")

    def _case_event(self, event) -> None:
        """``Scheduler.reset_prefix_cache()`` between two steps, as the engine core runs an
        operator's ``reset_prefix_cache`` call: its defaults (no running request reset, no
        connector reset)."""
        done = self.call("reset_prefix_cache", self.sched.reset_prefix_cache)
        self.emit(f"reset_prefix_cache {'ok' if done else 'refused'}")

    def _idle(self, work: _Workload, t: int, queue: deque) -> int:
        """Nothing to schedule and nothing in flight: the batch in flight is collected
        (``EngineCore.step_with_batch_queue``), else the clock jumps to the next arrival,
        abort or event. The next ``t``."""
        if queue:
            progress, done, failed = self._update(queue.pop())
            self._end_call(progress, done, failed, work.to_come())
            return t + 1
        nxt = work.next_times()
        if not nxt:
            raise inv.InvariantViolation("INV-8", self.step_no,
                                         f"{self.unfinished} requests never finished")
        return max(t + 1, min(nxt))

    def _check_step(self) -> None:
        if self.checks == "full":
            check_pool(self.sched, self.requests.reqs, self.step_no,
                       self.driver.held_blocks())
        self.emit("check ok")

    def _end_call(self, progress: bool, done: list, failed: bool,
                  future: bool = False) -> None:
        """After ``update_from_output``: finished requests, pool check, trace, liveness;
        ``failed``: the batch's worker raised on a failed job of the case's faults (the run
        stops after the step, as the engine would)."""
        tail = []
        for rid, req in self.requests.reqs.items():
            if rid not in self.requests.finished and req.is_finished():
                self.requests.finished.add(rid)
                self.unfinished -= 1
                self.counters["finished"] += 1
                tail.append(f"finish {rid} finished")
        self._check_step()
        # the model's order: FINISH events of step t, then completions due at t + 1
        self.lines.extend(tail)
        for job in done:
            self.emit(f"done {job.jid} {job.kind}")
        if failed:
            assert self.worker.failed is not None
            job, reason = self.worker.failed
            self.emit(f"failed {job.jid} {job.kind}")
            raise TransferFailed(reason)
        self.liveness.check(self.step_no, self.counters["steps"], progress, future,
                            self.unfinished)

    # -- one step --------------------------------------------------------------------------
    def _schedule_execute(self, t: int) -> SimpleNamespace:
        """``schedule()`` and the worker's execution of the batch; its output is applied by
        :meth:`_update` (at once, or after the next schedule with async scheduling)."""
        self.step_no = step = self.counters["steps"]
        self.counters["steps"] += 1
        self.emit(f"step {step}")
        # the requests' computed counts before the step, for the shadow
        before = {rid: r.num_computed_tokens for rid, r in self.requests.reqs.items()}
        out = self._schedule()
        new_ids = self._scheduled_blocks(out, before)
        self._preempted(out)
        worker, sj = self.worker, self.driver.scheduled_jobs(out)
        self.external.started(out, t, self.emit)
        worker.new_loads(step, t, sj, self.counters["loads"], self.emit)
        self.counters["loads"] += len(sj.loads)
        scheduled = dict(out.num_scheduled_tokens)
        self._trace_scheduled(scheduled, new_ids)
        new_stores = worker.new_stores(step, t, sj, self.counters["stores"], self.emit)
        self.counters["stores"] += len(sj.stores)
        self.external.check_stores(step, new_stores)
        worker.flush(step, t, sj.flush, self.emit)
        self.tails.apply_block_copies(out, self.shadow)
        self.external.check_forward(step, scheduled)
        # execute: write what the forward pass computes; sample
        sampled = self.runner.execute(step, out, scheduled, before)
        worker.pin_unread(new_stores)
        # completions reported by this step's worker output (or the failure its worker
        # raised on: under async scheduling the engine meets it when it collects this batch)
        failing_before = worker.failed is not None
        done = worker.complete_due(step, t)
        landed = self.external.land_due(step, t, self.emit)
        return SimpleNamespace(out=out, order=list(scheduled), sampled=sampled, done=done,
                               landed=landed, executed=bool(scheduled),
                               failed=worker.failed is not None and not failing_before)

    def _schedule(self):
        """``Scheduler.schedule()``, then what the lookups it made were found to break."""
        for line in self.driver.before_schedule(self.step_no):
            self.emit(line)
        try:
            out = self.call("schedule", self.sched.schedule)
        except Crash as c:
            # a lookup that went wrong earlier in this schedule() is the first bad operation;
            # what vLLM raised after it is its consequence, named in the finding
            v = self.oracle.finding
            if v is None:
                raise
            raise inv.InvariantViolation(v.inv_id, v.step, f"{v.detail} (then "
                                         f"{type(c.exc).__name__} in {c.stage})", v.op) from c
        self.oracle.raise_kept()
        return out

    def _scheduled_blocks(self, out, before: dict) -> dict:
        """Per scheduled request the blocks newly allocated to it, per group; ``before`` takes
        the computed counts the scheduler output gives."""
        new_ids = {}
        for nr in out.scheduled_new_reqs:
            new_ids[nr.req_id] = [list(b) for b in nr.block_ids]
            before[nr.req_id] = nr.num_computed_tokens
        cached = out.scheduled_cached_reqs
        c_ids = list(getattr(cached, "req_ids", []) or [])
        for k, rid in enumerate(c_ids):
            nb = cached.new_block_ids[k]
            new_ids[rid] = ([list(b) for b in nb] if nb is not None
                            else [[] for _ in self.shadow_groups])
            before[rid] = cached.num_computed_tokens[k]
        return new_ids

    def _preempted(self, out) -> None:
        for rid in sorted(getattr(out, "preempted_req_ids", None) or ()):
            self.emit(f"preempt {rid}")
            self.counters["preemptions"] += 1

    def _trace_scheduled(self, scheduled: dict, new_ids: dict) -> None:
        for rid, n in scheduled.items():
            self.counters["scheduled_tokens"] += n
            self.emit(f"sched {rid} {n}")
            per_group = new_ids.get(rid) or [[] for _ in self.shadow_groups]
            self.emit(fmt_alloc(rid, per_group))

    def _update(self, batch: SimpleNamespace) -> tuple[bool, list, bool]:
        """``update_from_output`` with the worker output of ``batch``: sampled tokens and the
        connector's output (the driver's: which jobs completed, which requests' loads);
        whether its worker raised on a failed job."""
        done, order = batch.done, batch.order
        recving = {job.rid for job in done if not job.is_store} | batch.landed
        kvo = self.driver.connector_output([job.jid for job in done], recving)
        mro = self.runner.output(order, batch.sampled, kvo)
        self.call("update_from_output", self.sched.update_from_output, batch.out, mro)
        self.liveness.check_reloads(self.step_no, order, done)
        self.oracle.told(done, self.step_no)    # now the scheduler knows
        self.runner.propose_drafts(batch.out, order)
        return bool(order) or bool(done) or bool(batch.landed), done, batch.failed


def _vllm_version() -> str:
    try:
        import vllm
        return vllm.__version__
    except Exception:  # noqa: BLE001
        return "?"
