"""The offloading worker as the harness plays it: the transfer jobs a step hands the worker,
in flight until their completion is due, and what they move between the GPU blocks and the
CPU tier in the content shadow.

A job created at time ``t`` is reported in the output of the step at ``t + latency - 1`` (so
the scheduler sees it before the step at ``t + latency``, as the model's
``STORE_DONE``/``LOAD_DONE`` events); jobs named in ``jobs_to_flush`` complete in the step that
flushes them. A job of latency null (``timing.jobs``) is never reported: a step that flushes it
never ends (:class:`simsched.vllm.inside.stops.Ended`). Checked here: INV-10 where a job is
built (its chunks against the request's caps), INV-3/4 when a store reads its source blocks
(the tokens their keys name), INV-5/6 when a load writes its destination blocks, INV-7 (slots
and chunks a job may not use yet: :class:`simsched.vllm.inside.cpu_tier.CpuTier`). What reads
the connector's own objects is its driver's (:mod:`simsched.vllm.inside.offloading`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from simsched import invariants as inv
from simsched.model.block_pool import NULL
from simsched.trace import fmt_hung_flush, fmt_job
from simsched.vllm.inside.pool_checks import block_tables
from simsched.vllm.inside.stops import Ended


class TransferJob:
    """One real transfer job as the shadow sees it: ``items`` like the model's
    ``(group_id, chunk_idx, hash_idx, key, [(block_index, block_id), ...])``; ``due`` None: the
    worker never reports it (it hangs)."""

    __slots__ = ("jid", "rid", "is_store", "items", "due", "read", "contents", "done")

    def __init__(self, jid, rid, is_store, items, due):
        self.jid, self.rid, self.is_store, self.items, self.due = jid, rid, is_store, items, due
        self.read = False
        self.contents: dict = {}
        self.done = False

    @property
    def kind(self) -> str:
        return "store" if self.is_store else "load"


def due_at(t: int, latency: int | None) -> int | None:
    """When the worker reports a job created at ``t``: None for one that never completes."""
    return None if latency is None else t + latency


class OffloadWorker:
    """``walks``: job ID -> its keys in the order of its key set (the run's result hands it
    to the model). ``tier``, ``tails``: :class:`~simsched.vllm.inside.cpu_tier.CpuTier`,
    :class:`~simsched.vllm.inside.partial_tails.PartialTails`."""

    def __init__(self, run, driver, tier, tails, walks: dict):
        self.eng, self.case, self.sched = run.eng, run.case, run.sched
        self.vc, self.kvc = run.vc, run.kvc
        self.requests, self.shadow = run.requests, run.shadow
        self.driver, self.tier, self.tails, self.walks = driver, tier, tails, walks
        self.geo, self.tph = driver.geometry, driver.tph
        self.tpbs = {g.group_id: g.tokens_per_block for g in driver.groups}
        self.jobs: dict[int, TransferJob] = {}
        # block -> the pending stores that have not read it yet (INV-6)
        self.pending_reads: dict[int, set[int]] = {}
        # the case's faults: job ID -> (store | load, the connector metadata that created it);
        # the failed job and why the run stopped there
        self.faulted: dict[int, tuple[str, Any]] = {}
        self.failed: tuple[TransferJob, str] | None = None

    # -- new jobs --------------------------------------------------------------------------
    def _job(self, t: int, sj, jid: int, is_store: bool, n: int) -> TransferJob:
        """The job ``jid`` of the step's ``sj`` (``driver.scheduled_jobs``), the ``n``-th of its
        kind: the worker reports it done its latency after (``Timing.jobs``: by order of
        creation), or fails it (``Case.fault``)."""
        kind = "store" if is_store else "load"
        tj = (sj.stores if is_store else sj.loads)[jid]
        items, walk = self.driver.job_items(jid, tj, is_store, self.requests)
        if walk is not None:
            self.walks[jid] = walk
        job = TransferJob(jid, tj.req_id, is_store, items,
                          due_at(t, self.case.timing.latency(kind, n)))
        self.jobs[jid] = job
        if self.case.fault(kind, n) is not None:
            self.faulted[jid] = (kind, sj.meta)
        return job

    def new_loads(self, step: int, t: int, sj, first: int, emit) -> None:
        """The step's load jobs (``first``: how many loads came before)."""
        for n, jid in enumerate(sorted(sj.loads), first):
            job = self._job(t, sj, jid, False, n)
            emit(fmt_job(job))
            self._check_caps(step, job)
            self.tier.bind(step, job, self.driver.job_slots(sj.loads[jid], False))
            self.tier.check_load(step, job)

    def new_stores(self, step: int, t: int, sj, first: int, emit) -> list[TransferJob]:
        """The step's store jobs (``first``: how many stores came before); INV-3 on the keys
        each names for its chunks."""
        new = []
        for n, jid in enumerate(sorted(sj.stores), first):
            job = self._job(t, sj, jid, True, n)
            new.append(job)
            emit(fmt_job(job))
            self._check_caps(step, job)
            self.tier.bind(step, job, self.driver.job_slots(sj.stores[jid], True))
            v = inv.check_store_job(step, self.tails.chunk_items(job), self.geo)
            if v is not None:
                raise v
        return new

    def flush(self, step: int, t: int, ids: set, emit) -> None:
        """``jobs_to_flush``: the worker waits for these jobs before the step runs
        (``handle_preemptions``: ``worker.wait(jobs_to_flush)``, a CUDA event synchronize), so
        a flushed store reads its blocks now and completes in this step."""
        if not ids:
            return
        emit("flush " + ",".join(map(str, sorted(ids))))
        for jid in sorted(ids):
            job = self.jobs.get(jid)
            if job is not None and not job.done and job.due is None:
                # on one that never completes it waits forever, and the engine never
                # finishes this step
                raise Ended(fmt_hung_flush(jid, job.is_store))
        for jid in sorted(ids):
            job = self.jobs.get(jid)
            if job is not None and job.is_store and not job.done:
                self.read_store(step, job)
                job.due = t          # the worker finishes it in this step

    def pin_unread(self, new: list[TransferJob]) -> None:
        """The blocks the step's new stores have not read yet: a forward writing one before
        they do is INV-6."""
        pr = self.pending_reads
        for job in new:
            if not job.read:
                for item in job.items:
                    for _, b in item[4]:
                        pr.setdefault(b, set()).add(job.jid)
                    self.tails.pending(job.rid, item)

    # -- per-request caps (INV-10) ---------------------------------------------------------
    def _cap(self, rid: str, name: str) -> int | None:
        """The request's cap ``name`` as the case gives it (not as the release parsed it), or
        None when it has none or the release does not support it. 0 is a cap: the release's
        ``_calc_num_offloadable_tokens`` takes ``min(n, 0)`` (nothing stored) and
        ``_lookup_complete_chunks`` ``num_computed_tokens + 0`` (nothing loaded)."""
        if not self.driver.caps_supported.get(name):
            return None
        return getattr(self.requests.spec(rid), name)

    def _check_caps(self, step: int, job: TransferJob) -> None:
        """INV-10 where the job is built: the token positions its chunks cover against the
        request's cap (a store's against ``max_offload_tokens``, a load's against
        ``max_load_tokens``)."""
        if job.is_store:
            v = inv.check_store_cap(step, job, self._cap(job.rid, "max_offload_tokens"),
                                    self.tph)
        else:
            v = inv.check_load_cap(step, job, self._cap(job.rid, "max_load_tokens"),
                                   self.tph, self.tpbs)
        if v is not None:
            raise v

    # -- completions -----------------------------------------------------------------------
    def complete_due(self, step: int, t: int) -> list[TransferJob]:
        """The jobs the output of the step at ``t`` reports done (due before the step at
        ``t + 1``), in job order, completed; none where one of them is a faulted job."""
        done = [j for j in self.jobs.values()
                if not j.done and j.due is not None and j.due <= t + 1]
        done.sort(key=lambda j: j.jid)
        failing = [j for j in done if j.jid in self.faulted]
        if failing:
            self._fail(failing[0])
            done = []           # the worker raised before it reported any job of the step
        for job in done:
            self._complete(step, job)
        return done

    def _fail(self, job: TransferJob) -> None:
        """A job of the case's faults is due: the release's own offloading worker is handed
        its failure (:mod:`transfer_faults`). Where it raises, the run stops after this step
        (``Run._end_call``), as the engine would; a release whose worker takes the failure
        would go on to recover, which the harness does not play yet: unsupported."""
        kind, meta = self.faulted[job.jid]
        raised = self.driver.worker_refusal(self.vc, self.kvc, meta, job.jid)
        if raised is None:
            raise self.eng.Unsupported(
                f"{kind} job {job.jid} failed and this release's offloading worker took the "
                "failure without raising; simsched does not drive the recovery that follows")
        self.failed = (job, f"the offloading worker does not support failed transfers: {kind} "
                            f"job {job.jid} failed ({raised})")

    def read_store(self, step: int, job: TransferJob) -> None:
        """A store reads its source blocks (at its completion, or when flushed): INV-3/4 on
        what they hold."""
        if job.read:
            return
        job.read = True
        pr = self.pending_reads
        ident = self.requests.ident[job.rid]
        for item in job.items:
            content = self.shadow.read(item[4])
            job.contents[item[3]] = content
            self.tails.read(job.rid, item)
            for _, b in item[4]:
                s = pr.get(b)
                if s is not None:
                    s.discard(job.jid)
                    if not s:
                        del pr[b]
            if self.tails.is_tail(item):
                v = self.tails.check(step, job, item, content, ident, self.requests.ident)
            else:
                v = inv.check_stored_chunk(step, job, item, content, ident, self.geo)
            if v is not None:
                raise v

    def _complete(self, step: int, job: TransferJob) -> None:
        job.done = True
        if job.is_store:
            self.read_store(step, job)
            self.tier.stored(job)
            return
        written = []
        for x, item in enumerate(job.items):
            content = self.tier.read(job, x, item)
            self.shadow.write(item[4], content or ())
            written.extend(b for _, b in item[4])
        v = inv.check_writes(step, written, self.pending_reads, f"load {job.jid}")
        if v is not None:
            raise v
        if not self.requests.reqs[job.rid].is_finished():
            self._check_loaded(step, job)

    def _check_loaded(self, step: int, job: TransferJob) -> None:
        """INV-5 against where each destination block really sits in the request's table."""
        tables = block_tables(self.sched, job.rid)
        pos = [{b: i for i, b in enumerate(t) if b != NULL} for t in tables]
        true = SimpleNamespace(jid=job.jid, items=[
            (gid, c, hidx, key, [(pos[gid].get(b, i), b) for i, b in blocks])
            for gid, c, hidx, key, blocks in job.items])
        ident = self.requests.ident[job.rid]
        v = inv.check_loaded(step, true, ident, self.shadow, self.geo)
        if v is not None:
            raise v

    # -- in flight -------------------------------------------------------------------------
    def live(self) -> bool:
        """A transfer is in flight that the worker will report (a job that never completes is
        none: it keeps the release's engine stepping, has_pending_push_work, and nothing
        else)."""
        return any(not j.done and j.due is not None for j in self.jobs.values())

    def in_flight(self) -> list[TransferJob]:
        """The jobs not done, in job order."""
        return sorted((j for j in self.jobs.values() if not j.done), key=lambda j: j.jid)

    def hung(self) -> list[TransferJob]:
        """The jobs in flight that never complete (``timing.jobs``, latency null)."""
        return [j for j in self.jobs.values() if j.due is None and not j.done]
