"""Async scheduling (``SchedulerConfig.async_scheduling``): ``AsyncRun``.

Mirrors ``v1/core/sched/async_scheduler.py`` (``AsyncScheduler``: output placeholders set after
a step is scheduled, ``_update_after_schedule``; tokens known once a batch's output arrives,
``_update_request_with_output``), the ``Scheduler`` rules vLLM applies only with more than one
batch in flight (deferred block frees, ``_request_blocks_can_be_freed``), and the engine core's
batch queue that drives them (``EngineCore.step_with_batch_queue``, ``v1/engine/core.py``).
The scheduler it drives is :class:`~simsched.model.scheduler.Model`, which makes one
``AsyncRun`` when the case's engine schedules asynchronously; this module sees it only as the
:class:`Scheduler` below, so that neither module imports the other both ways.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from simsched.model.block_pool import NULL
from simsched.model.kv_cache_manager import KVCacheManager
from simsched.model.offloading_common import Job
from simsched.model.offloading_scheduler import OffloadingConnectorScheduler
from simsched.model.request import RUNNING, Request
from simsched.profiles import Profile


class Scheduler(Protocol):
    """The scheduler with its model runner (``Model``) as the batch queue drives it: it
    schedules a batch (``schedule``), executes it (``execute_model``, sampled tokens held back
    in the batch) and, when the batch's output is processed, is told of its sampled tokens (a
    request finished, blocks cached) and of the transfer jobs the worker reported
    (``transfers_done``) and the NIXL pulls that landed (``land``, ``pull_reported``)."""

    kv: KVCacheManager
    off: OffloadingConnectorScheduler
    profile: Profile
    step_no: int            # the step being scheduled (``schedule`` counts it)
    num_spec: int           # drafts per step (speculative decoding; 0: none)
    drafts: dict[str, int]          # Request.spec_token_ids (counts)
    sched_drafts: dict[str, int]    # the step's scheduled_spec_decode_tokens (counts)
    progress: bool          # something moved in this step (the stall count of INV-8)

    def has_requests(self) -> bool: ...

    def connector_quiet(self) -> bool: ...

    def land(self, rid: str) -> None: ...

    def pull_reported(self, rid: str) -> None: ...

    def _emit(self, line: str) -> None: ...

    def schedule(self, t: int) -> tuple[list, list[Job]]: ...

    def execute_model(self, t: int, step: int, sched_reqs: list, stores: list[Job]) -> None: ...

    def finish_request(self, req: Request) -> None: ...

    def transfers_done(self, jids: list[int]) -> bool: ...


class _Batch:
    """One scheduled batch in the engine's batch queue, until its output is processed."""

    __slots__ = ("sched", "tokens", "rejected", "jobs", "landed", "executed")

    def __init__(self, sched: list, executed: bool):
        self.sched = sched          # [(request, tokens scheduled)]
        # [(request, tokens)]: the worker's accepted drafts and sampled token
        self.tokens: list[tuple[Request, list[int]]] = []
        self.rejected: dict[str, int] = {}  # request ID -> drafts the worker rejected
        self.jobs: list[int] = []   # transfer jobs the worker reports done in this output
        self.landed: list[str] = []     # requests whose NIXL pull it reports (finished_recving)
        self.executed = executed


class AsyncRun:
    """Async scheduling (``SchedulerConfig.async_scheduling``): ``EngineCore.
    step_with_batch_queue`` with a batch queue of depth 2 (``max_concurrent_batches``) over the
    ``AsyncScheduler``. Each engine step (a ``STEP`` event, :meth:`call`) schedules a batch
    while there is something to schedule and, once two batches are in flight (or nothing more
    can be scheduled), processes the output of the oldest one (``update_from_output``): the
    scheduler sees a step's sampled tokens and transfer completions only after it has
    scheduled the next step.

    Scheduler rules it adds (vLLM's ``AsyncScheduler`` and ``Scheduler``):

    * ``num_output_placeholders`` (``ph``): a request scheduled past its prefill gets one
      (``_update_after_schedule``) and is scheduled again for ``num_tokens + ph -
      num_computed`` tokens before its token is known; it is skipped when its last token is
      in flight (``num_computed + 2 - ph >= num_prompt + max_tokens``);
    * speculative decoding: a request scheduled past its prefill gets ``k`` placeholder drafts
      (``spec_token_ids = [-1] * k``) and a placeholder for each draft scheduled; the worker
      verifies its own drafts, the ones the drafter proposed after the request's last step
      (``proposed``; a request not in the previous batch verifies the placeholders, which
      never match); the output rolls ``num_computed_tokens`` and the placeholders back over the
      rejected ones (``update_from_output``), before the next step executes, as the worker
      corrects its own count (``gpu_model_runner``: ``prev_num_draft_len``);
    * ``allocate_slots`` caches only blocks of known tokens; the rest are cached when the
      tokens arrive, up to ``num_computed - num_in_flight_tokens``
      (``update_from_output``; 0.30.0's ``AsyncScheduler._update_request_with_output`` says
      ``num_computed - num_output_placeholders``, the same count without speculative tokens);
    * blocks out of a window are freed on the processed tokens, ``num_computed -
      num_in_flight_tokens`` (``allocate_slots`` and ``_connector_finished`` call
      ``remove_skipped_blocks`` on that basis), the blocks to add still count every computed
      token;
    * ``defer_block_free`` (set with more than one concurrent batch and a connector that can
      be a KV consumer, as the OffloadingConnector's ``kv_both``): the freed blocks of a request
      scheduled in a batch still in flight return to the pool when that batch's output is
      processed (``_free_request_blocks``, ``deferred_frees``, in reverse allocation order).
      From 0.30.0 such a request is never a preemption victim (``_request_blocks_can_be_freed``
      in the preemption loop): no in-flight output ever becomes stale. 0.25.1-0.29.0
      (``preempt_in_flight``) preempt it all the same; the output of its batch is still
      delivered (appended, stop checked, 0.29.0's ``num_stale_output_tokens`` not dropped as the
      OffloadingConnector's ``requires_kv_delivery`` is False) but caches no block, and the
      preempted request cannot resume before it, as it is preempted in a step that schedules no
      waiting request.

    The worker reports a transfer job in the output of the first step executed at or after
    ``due - 1`` (``due`` = creation + latency; a flushed job in the step that flushes it), as
    the harness's worker does (:mod:`simsched.vllm.inside.offload_worker`)."""

    DEPTH = 2

    def __init__(self, model: Scheduler):
        self.m = model
        self.queue: deque[_Batch] = deque()
        self.ph: dict[str, int] = {}          # num_output_placeholders
        self.in_flight: dict[str, int] = {}   # num_in_flight_tokens
        self.last_seq: dict[str, int] = {}    # Request.last_sched_seq
        self.sched_seq = 0                    # Scheduler.sched_step_seq
        self.processed_seq = 0                # Scheduler.processed_step_seq
        self.deferred: deque = deque()        # (fence, blocks in allocation order)
        self.due: dict[int, int] = {}         # job ID -> due time
        self.pulls_due: dict[str, int] = {}   # request ID -> due time of its NIXL pull
        self.batch: _Batch | None = None
        # the requests of the last executed batch that sampled: the drafter proposed their
        # drafts for the next step (the worker's persistent batch drops the others)
        self.proposed: set[str] = set()
        # 0.25.1-0.29.0: no _request_blocks_can_be_freed check in Scheduler.schedule's
        # preemption loop (0.30.0+), a request whose batch is in flight can be preempted
        self.preempt_in_flight: bool = model.profile.extra.get("preempt_in_flight", False)
        self.window_frees_on_processed: bool = model.profile.extra.get(
            "window_frees_on_processed", True)
        # 0.33.0: update_from_output caches a request's blocks (and resolves every returned
        # token's placeholder), the AsyncScheduler no longer does
        self.cache_past_in_flight: bool = model.profile.extra.get("spec_cache_on_output", False)

    def has_requests(self) -> bool:
        return self.m.has_requests()

    def busy(self) -> bool:
        """The engine steps again: something to schedule, a job pending, a batch in flight."""
        return self.has_requests() or not self.m.connector_quiet() or bool(self.queue)

    def processed(self, req: Request) -> int:
        """``num_computed_tokens - num_in_flight_tokens``: the tokens of batches whose output is
        processed, the basis on which blocks out of a window are freed (``allocate_slots``,
        ``_connector_finished``: "in-flight steps' attention windows still read blocks below
        the optimistic boundary"). 0.25.1 has no ``num_in_flight_tokens``: both free them on
        ``num_computed_tokens``, in-flight tokens included."""
        if not self.window_frees_on_processed:
            return req.num_computed
        return max(0, req.num_computed - self.in_flight.get(req.rid, 0))

    def can_free(self, req: Request) -> bool:
        return self.last_seq.get(req.rid, 0) <= self.processed_seq

    def defer_free(self, req: Request) -> None:
        self.m.kv.forget(req)
        blocks = [b for table in req.tables for b in table if b != NULL]
        for table in req.tables:
            table.clear()
        req.quiet_until = -1
        req.num_cached_blocks = [0] * len(req.tables)
        if blocks:
            self.deferred.append((self.sched_seq, blocks))

    def held(self) -> list:
        """The deferred blocks as holders for the pool check."""
        return [_Held(blocks) for _, blocks in self.deferred]

    def after_schedule(self, sched_reqs: list) -> None:
        """``_update_after_schedule`` (num_computed itself advances when the batch executes).
        (No quiet decodes with async scheduling: every entry is a ``Sched`` tuple.)"""
        self.batch = _Batch([(req, n) for req, n, _ in sched_reqs], bool(sched_reqs))
        if sched_reqs:
            self.sched_seq += 1
        ph, in_flight, seq = self.ph, self.in_flight, self.sched_seq
        m = self.m
        k, drafts, sched_drafts = m.num_spec, m.drafts, m.sched_drafts
        for req, n, _ in sched_reqs:
            rid = req.rid
            in_flight[rid] = in_flight.get(rid, 0) + n
            self.last_seq[rid] = seq
            if req.num_computed + n >= len(req.tokens) + ph.get(rid, 0):   # not a prefill chunk
                ph[rid] = ph.get(rid, 0) + 1 + sched_drafts.get(rid, 0)
                if k:
                    drafts[rid] = k         # the placeholders of the next step's drafts

    def call(self, t: int) -> None:
        """One engine step at ``t`` (the scheduler's ``after_step`` follows it)."""
        m = self.m
        queue = self.queue
        if self.has_requests() or not m.connector_quiet():
            sched_reqs, stores = m.schedule(t)
            batch = self.batch
            assert batch is not None                 # (m.schedule's after_schedule made it)
            queue.appendleft(batch)
            if len(queue) < self.DEPTH and (batch.executed or self.has_requests()):
                self._execute(batch, t, sched_reqs, stores)
            elif queue[-1] is batch:
                queue.pop()
                self._execute(batch, t, sched_reqs, stores)
                self._apply(batch)
            else:
                self._apply(queue.pop(), batch)
                self._execute(batch, t, sched_reqs, stores)
        elif queue:
            self._apply(queue.pop())

    def _execute(self, batch: _Batch, t: int, sched_reqs: list, stores: list) -> None:
        m = self.m
        m.execute_model(t, m.step_no, sched_reqs, stores)
        self.proposed = {req.rid for req, _ in batch.tokens}
        due = self.due
        batch.jobs = sorted([j for j, d in due.items() if d <= t + 1])
        for j in batch.jobs:
            del due[j]
        # the NIXL pulls that land in this step (reported with its output)
        pulls = self.pulls_due
        batch.landed = [r for r, d in pulls.items() if d <= t + 1]
        for r in batch.landed:
            del pulls[r]
            m._emit(f"landed {r}")

    def _apply(self, batch: _Batch, scheduled: _Batch | None = None) -> None:
        """``update_from_output``: deferred frees, sampled tokens (stops), then the connector's
        output (loads through ``finished_recving``, store and load jobs completed).
        ``scheduled``: the batch scheduled since, which executes after this (the scheduler
        advanced ``num_computed_tokens`` by its tokens when it scheduled it)."""
        ahead = {req.rid: n for req, n in scheduled.sched} if scheduled is not None else {}
        m = self.m
        pool = m.kv.pool
        if batch.executed:
            self.processed_seq += 1
            deferred = self.deferred
            while deferred and deferred[0][0] <= self.processed_seq:
                pool.free_blocks(reversed(deferred.popleft()[1]))
        in_flight, ph = self.in_flight, self.ph
        for req, n in batch.sched:
            in_flight[req.rid] -= n
        for req, tokens in batch.tokens:
            if req.finished:
                continue            # aborted while the batch was in flight
            running = req.status == RUNNING
            rejected = batch.rejected.get(req.rid, 0)
            if rejected:
                # (a request preempted in flight was rolled back to 0 already)
                if req.num_computed > 0:
                    req.num_computed -= rejected
                if ph[req.rid] > 0:
                    ph[req.rid] -= rejected
            new = tokens[:max(0, req.max_tokens - len(req.tokens))]   # the stop check
            req.append_tokens(new)
            if self.cache_past_in_flight:
                # 0.33.0 _update_request_with_output: every returned token resolves its
                # placeholder, and the tokens trimmed at a stop leave num_computed_tokens
                ph[req.rid] -= len(tokens)
                req.num_computed -= len(tokens) - len(new)
            else:
                ph[req.rid] -= len(new)
            if running:
                # the tokens no batch in flight holds: 0.33.0's update_from_output counts
                # num_in_flight_tokens; 0.25.1-0.32.0's _update_request_with_output the
                # placeholders (the same, but after a stop trimmed drafts: their placeholders stay)
                held = in_flight[req.rid] if self.cache_past_in_flight else ph[req.rid]
                m.kv.cache_blocks(req, req.num_computed + ahead.get(req.rid, 0) - held)
            if len(req.tokens) >= req.max_tokens:
                m.finish_request(req)
        if not m.transfers_done(batch.jobs):
            return          # a failed job: the run stops after the step's check
        for r in batch.landed:      # (after the stores completed in the step read their blocks)
            m.land(r)
            m.pull_reported(r)
        m.progress = m.progress or batch.executed or bool(batch.jobs)


class _Held:
    __slots__ = ("tables",)

    def __init__(self, blocks: list[int]):
        self.tables = [blocks]

