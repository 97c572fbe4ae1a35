"""Tiered offloading: ``TieringOffloadingManager`` (``vllm/v1/kv_offload/tiering/manager.py``)
over the CPU tier, with file-system secondary tiers (``FileSystemTierManager``,
``tiering/fs/manager.py``; ``engine.secondary_tiers``), as 0.25.1-0.33.0 write them (one
design; what changed is a profile extra: ``tier_promotion_retry`` before 0.28.0,
``tier_schedule_end_last`` from 0.33.0).

The CPU tier stays the gateway to the GPU (:mod:`simsched.model.cpu_manager`): the connector
stores to it and loads from it as without tiers. Around it the manager

* cascades every chunk a store completed to each fs tier (``complete_store`` ->
  ``create_store_job``: the CPU chunks are pinned, ``prepare_read``, until the file is written);
* answers a lookup the CPU tier misses from the fs tiers: an fs tier knows whether a key has a
  file only once its lookup thread probed it (``AsyncLookupManager``: the first lookup of a key
  answers RETRY, the probe is posted at ``on_schedule_end``), and a key found there is promoted
  (``_initiate_promotion``: a CPU chunk allocated at once, the read submitted at
  ``on_schedule_end``), its lookup HIT_PENDING until the read completes;
* polls the tiers for finished jobs at most once per step (``_maybe_process_finished_jobs``),
  unconditionally before a store prepares from 0.33.0.

An fs tier's I/O runs on the clock the harness gives it (:mod:`simsched.vllm.inside.tiering`):
before every ``schedule()`` the tier's lookup probes are answered, then the reads and writes due
(a job first seen before step ``s`` runs before step ``s + io_latency - 1``, reads first, FIFO).
A probe is answered from the files as they were when it was posted (the tier's lookup thread
runs during the step that posted it; a file it could race with belongs to a key the CPU tier
holds, whose lookups never reach the fs tier).

Nothing here fails
(the fs tier's I/O succeeds; a failed GPU transfer ends the run), no backpressure detector is
configured (none by default), and a case's prefix-cache reset leaves the connector alone.
"""

from __future__ import annotations

from simsched import invariants as inv
from simsched.model.cpu_manager import HIT, HIT_PENDING, MISS, RETRY, walk_order
from simsched.model.fs_tier import FileSystemTierManager, TransferJob
from simsched.model.request import Key


class RequestState:
    """``RequestState``: the request's stores prepared but not completed (each may still
    cascade), and whether it finished; the tiers forget its probes once both are over."""

    __slots__ = ("pending_primary_stores", "is_finished")

    def __init__(self) -> None:
        self.pending_primary_stores = 0
        self.is_finished = False


class TieringOffloadingManager:
    """``TieringOffloadingManager`` over ``primary`` (the CPU tier's manager)
    and fs ``tiers``. ``schedule_end_last`` (0.33.0): ``on_schedule_end`` is the manager's last
    call of the step, and ``prepare_store`` polls the tiers unconditionally."""

    def __init__(self, primary, io_latencies: list[int], schedule_end_last: bool,
                 promotion_retry: bool = False):
        self.primary = primary
        # before 0.28.0 a lookup that starts a promotion answers RETRY, not HIT_PENDING
        self.promotion_retry = promotion_retry
        self.tiers = [FileSystemTierManager(n) for n in io_latencies]
        self.schedule_end_last = schedule_end_last
        self.job_id_counter = 0
        self.jobs: dict[int, TransferJob] = {}
        # promotions awaiting submit_load: tier index -> request ID -> the job being gathered
        self.pending_load_submissions: dict[int, dict[str, TransferJob]] = {}
        self.processed_jobs_this_step = False
        self.req_state: dict[str, RequestState] = {}
        # the harness's promotion liveness: waiting request -> key -> promotions (INV-8)
        self.promoted: dict[str, dict[Key, int]] = {}
        self.seen_jobs = 0

    # -- what the connector reads of the CPU tier -------------------------------------------
    @property
    def touches(self) -> bool:
        return self.primary.touches

    @property
    def evictions(self) -> int:
        return self.primary.evictions

    def is_ready(self, key) -> bool:
        return self.primary.is_ready(key)

    def chunks_of(self, keys: list) -> list:
        return self.primary.chunks_of(keys)

    def touch_range(self, keys: list, lo: int, hi: int) -> None:
        """``touch``: the CPU tier's (an fs tier keeps no recency)."""
        self.primary.touch_range(keys, lo, hi)

    # -- jobs ----------------------------------------------------------------------------------
    def _next_job_id(self) -> int:
        job_id = self.job_id_counter
        self.job_id_counter += 1
        return job_id

    def _maybe_process_finished_jobs(self) -> None:
        """At most once per step: the gate ``on_schedule_end`` reopens."""
        if self.processed_jobs_this_step:
            return
        self.processed_jobs_this_step = True
        self._process_finished_jobs()

    def _process_finished_jobs(self) -> None:
        """A promotion's chunks become ready holding what their files held
        (``complete_write``, in the job's key order); a cascade unpins its chunks
        (``complete_read``, in the order the store walked its key set)."""
        for tier in self.tiers:
            for job in tier.get_finished_jobs():
                del self.jobs[job.job_id]
                if job.is_promotion:
                    self.primary.complete_store(job.keys, job.contents, job.chunks, job.keys)
                else:
                    self.primary.complete_load(job.keys, job.chunks, job.keys)

    # -- lookups and promotions ---------------------------------------------------------------
    def lookup(self, key: Key, st) -> int:
        """The CPU tier first (a hit or a chunk in flight answers); on a miss each fs tier in
        turn: the first that has the key promotes it (HIT_PENDING, or MISS when the CPU tier
        has no room), else RETRY if a probe is out."""
        self._maybe_process_finished_jobs()
        result = self.primary.lookup(key)
        if result != MISS:
            return result
        any_retry = False
        for i, tier in enumerate(self.tiers):
            found = tier.lookup(key, st.req.rid)
            if found == HIT:
                if not self._initiate_promotion(i, key, st):
                    return MISS
                return RETRY if self.promotion_retry else HIT_PENDING
            any_retry = any_retry or found == RETRY
        return RETRY if any_retry else MISS

    def _initiate_promotion(self, tier_idx: int, key: Key, st) -> bool:
        """A CPU chunk for the key at once (``prepare_write``: evicting as a store would; its
        lookups HIT_PENDING from now on), the read gathered per tier and request until
        ``on_schedule_end``. False when the CPU tier has no chunk to give."""
        to_store = self.primary.prepare_store([key], st)
        if to_store is None:
            return False
        rid = st.req.rid
        pending = self.pending_load_submissions.setdefault(tier_idx, {})
        job = pending.get(rid)
        if job is None:
            job = pending[rid] = TransferJob(-1, [], [], True, rid)
        job.keys.extend(to_store)
        job.chunks.extend(self.primary.chunks_of(to_store))
        return True

    def _flush_pending_promotions(self) -> None:
        """One read per tier and request, numbered as submitted."""
        for tier_idx, by_request in self.pending_load_submissions.items():
            for job in by_request.values():
                job.job_id = self._next_job_id()
                self.jobs[job.job_id] = job
                self.tiers[tier_idx].submit_load(job)
        self.pending_load_submissions.clear()

    # -- the connector's stores and loads ----------------------------------------------------
    def prepare_store(self, keys, st=None) -> list | None:
        """The tiers polled first, so that completed cascades and promotions free or fill
        chunks before the CPU tier evicts (0.33.0: whatever the step's gate says; under the
        harness's clock, I/O completing before ``schedule()`` only, the step's first poll has
        seen them all)."""
        if self.schedule_end_last:
            self.processed_jobs_this_step = True
            self._process_finished_jobs()
        else:
            self._maybe_process_finished_jobs()
        to_store = self.primary.prepare_store(keys, st)
        if to_store:
            self.req_state[st.req.rid].pending_primary_stores += 1
        return to_store

    def complete_store(self, keys: list, contents: list, chunks: list | None = None,
                       observed: list | None = None, st=None) -> None:
        """The CPU tier's chunks are ready; each fs tier gets a cascade of the job's key set
        (in the order the CPU tier walked it: vLLM's job keeps the set)."""
        self.primary.complete_store(keys, contents, chunks, observed)
        key_set = walk_order(keys, observed)
        for tier in self.tiers:
            tier.submit_store(self.create_store_job(key_set, st))
        state = self.req_state[st.req.rid]
        state.pending_primary_stores -= 1
        self._maybe_finalize_request(st.req.rid)

    def create_store_job(self, keys: list, st) -> TransferJob:
        """A cascade of ``keys``, their CPU chunks pinned until the file is written
        (``prepare_read``: a load that is no request's access), tracked until the tier
        reports it."""
        job = TransferJob(self._next_job_id(), keys, self.primary.prepare_load(keys), False,
                          st.req.rid)
        self.jobs[job.job_id] = job
        return job

    def prepare_load(self, keys: list, st=None) -> list:
        return self.primary.prepare_load(keys, st)

    def complete_load(self, keys: list, chunks: list | None = None,
                      observed: list | None = None) -> None:
        self.primary.complete_load(keys, chunks, observed)

    # -- requests -------------------------------------------------------------------------------
    def on_new_request(self, st) -> None:
        self.req_state[st.req.rid] = RequestState()

    def on_request_finished(self, st) -> None:
        self.primary.on_request_finished(st)
        self.req_state[st.req.rid].is_finished = True
        self._maybe_finalize_request(st.req.rid)

    def _maybe_finalize_request(self, rid: str) -> None:
        """The tiers forget a finished request's probes once none of its stores can still
        cascade."""
        state = self.req_state[rid]
        if not state.is_finished or state.pending_primary_stores:
            return
        for tier in self.tiers:
            tier.lookups.cleanup(rid)
        del self.req_state[rid]

    # -- the step ---------------------------------------------------------------------------------
    def on_schedule_end(self) -> None:
        """Poll (if not yet this step), reopen the gate, submit the step's promotions, post
        its probes."""
        self._maybe_process_finished_jobs()
        self.processed_jobs_this_step = False
        self._flush_pending_promotions()
        for tier in self.tiers:
            tier.lookups.flush()

    def has_pending_work(self) -> bool:
        """The engine keeps stepping while a tier job is tracked (``has_pending_push_work``)."""
        return bool(self.jobs)

    def before_schedule(self, step: int) -> list[str]:
        """The harness's fixed point before ``schedule()``: the promotions submitted since
        (INV-8 when one request's chunk is promoted again and again), then per tier its
        probes answered and its I/O due. The trace lines of the jobs whose I/O ran."""
        self._count_promotions(step)
        lines = []
        for tier in self.tiers:
            tier.lookups.drain_results()
            for job in tier.run_io(step):
                kind = "promote" if job.is_promotion else "cascade"
                lines.append(f"tier {kind} {job.job_id} {len(job.keys)} checked")
        return lines

    def _count_promotions(self, step: int) -> None:
        for job_id in range(self.seen_jobs, self.job_id_counter):
            job = self.jobs.get(job_id)
            if job is None or not job.is_promotion:
                continue
            counts = self.promoted.setdefault(job.rid, {})
            for k in job.keys:
                counts[k] = counts.get(k, 0) + 1
                if counts[k] > inv.PROMOTION_ROUNDS:
                    raise inv.promotion_thrash(step, job.rid, counts[k],
                                               self.primary.capacity)
        self.seen_jobs = self.job_id_counter

    def lookup_answered(self, rid: str) -> None:
        """The request's lookup gave an answer: it no longer waits on promotions."""
        self.promoted.pop(rid, None)
