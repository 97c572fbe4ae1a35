"""The harness's driver of tiered offloading (``engine.secondary_tiers``, :mod:`simsched.connectors`):
the ``OffloadingConnector`` with ``TieringOffloadingSpec`` (``vllm/v1/kv_offload/tiering/``), the
CPU tier as primary and each ``{"kind": "fs", "io_latency": n}`` a file-system tier writing real
files into a directory the harness owns.

What the harness plays, beside what :class:`~simsched.vllm.inside.offloading.
OffloadingConnectorDriver` (reused whole, by composition) plays of the connector:

* The worker's bytes. The GPU worker copies a store's blocks into its view of the shared CPU
  region (``SharedOffloadRegion``, ``/dev/shm/vllm_offload_<engine_id>.mmap``; 0.30.0
  ``tiering/spec.py:386-413``); the fs tier ``os.write``\\ s those rows to files when the store
  is cascaded (``complete_store`` -> ``submit_store``, 0.30.0 ``tiering/manager.py:662-705``)
  and ``os.readv``\\ s them back into a slot on a promotion (``_initiate_promotion``,
  ``:420-468``). The harness writes each stored chunk's content signature (of its shadow
  content) through a joiner worker view of the same region (:class:`RegionTier`), and reads
  the region at a load: INV-5 judges vLLM's own bytes; INV-T1 (a file holds its key's bytes
  when its cascade completes) and INV-T2 (a promoted slot holds its key's bytes when the read
  completes) are checked where the harness runs the tier's I/O.
* The tier's I/O clock (:meth:`TieringDriver.before_schedule`). Each fs tier is built with
  ``n_read_threads``/``n_write_threads`` 0 (``DualQueueThreadPool`` then starts none) and the
  harness runs its queued tasks itself before every ``schedule()``: a job first seen before
  step ``s`` runs before step ``s + io_latency - 1``, FIFO, loads first (the pool's
  ``_worker`` body, 0.30.0 ``fs/thread_pool.py:165-195``, on the real task callables). The
  tier's lookup thread (``AsyncLookupManager``) runs for real; at the same point the harness
  waits until it has answered every probe. A real thread finishing between ``on_schedule_end``
  and ``_build_store_jobs`` would make a promotion visible a step early or not (0.30.0
  ``tiering/manager.py:823-825`` then ``scheduler.py:1776``): the fixed point removes that.
* Liveness of promotions (INV-8, op ``lookup``): a waiting request whose prefix on the fs tier
  is longer than the CPU tier promotes its chunks round after round, each promotion evicting
  its own promoted chunks (``prepare_write`` protects only the promoted key), and is never
  admitted (every release 0.25.1-0.33.0). A chunk promoted for the same waiting request more
  than ``invariants.PROMOTION_ROUNDS`` times is the finding.
* Ownership: the fs root (a fresh directory per build, under one folder per worker process),
  size-capped (``SIMSCHED_FS_MAX_BYTES``, default 64 MiB: the run stops, unsupported, before
  the tier writes more) and removed with the ``/dev/shm`` region at the run's end
  (:meth:`TieringDriver.close`), or at the next build, or at the worker's exit.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import inspect
import os
import shutil
import tempfile
import time
import uuid

from simsched import invariants as inv
from simsched.vllm.inside.cpu_tier import CpuTier
from simsched.vllm.inside.offloading import OffloadingConnectorDriver

#: the bytes the harness lets the fs tiers of one run write (SIMSCHED_FS_MAX_BYTES)
FS_MAX_BYTES = int(os.environ.get("SIMSCHED_FS_MAX_BYTES", str(64 << 20)))
SIG = 16                  # bytes of a content signature, repeated over the worker's page
ENGINE_PREFIX = "simsched-tier-"

# -- what the harness owns on disk ------------------------------------------------------------
_issued: dict[str, list[str]] = {}     # engine id -> [shm path, fs roots...] not yet removed
_live: set[str] = set()                # engine ids of drivers not closed yet
_parent: list[str] = []


def _root_parent() -> str:
    if not _parent:
        _parent.append(tempfile.mkdtemp(prefix=f"simsched-tier-fs-{os.getppid()}-"))
        atexit.register(_sweep, True)
    return _parent[0]


def shm_path(engine_id: str) -> str:
    """The region the scheduler creates (``SharedOffloadRegion``: 0.30.0
    ``cpu/shared_offload_region.py:111``, named by ``engine_id``; 0.25.1 by ``instance_id``)."""
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


def _remove(engine_id: str) -> None:
    for path in _issued.pop(engine_id, ()):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)


def _sweep(everything: bool = False) -> None:
    """Remove what earlier builds named and no open driver holds (a build whose engine never
    booted, a boot that failed, ``boot_retention``); at exit, the folder too."""
    for engine_id in list(_issued):
        if everything or engine_id not in _live:
            _remove(engine_id)
    if everything and _parent:
        shutil.rmtree(_parent[0], ignore_errors=True)


# -- the kv_transfer_config ------------------------------------------------------------------
def kv_transfer(builder, layout, vc, kvc) -> None:
    """The OffloadingConnector's extra config as :meth:`ConfigBuilder.offloading` builds it,
    with ``spec_name: TieringOffloadingSpec`` (registered: 0.30.0 ``kv_offload/factory.py:65-69``)
    and per case tier ``{"type": "fs", "root_dir": <fresh>, "n_read_threads": 0,
    "n_write_threads": 0}`` (``SecondaryTierFactory``, every other key a constructor argument of
    ``FileSystemTierManager``, 0.30.0 ``fs/manager.py:110-120``); a unique ``engine_id`` (and
    ``instance_id`` on 0.25.1): the region is named by it, and a second engine on the same name
    joins a stale region."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    _sweep()
    builder.offloading(layout, vc, kvc)
    kt = copy.copy(vc.kv_transfer_config)
    extra = dict(kt.kv_connector_extra_config)
    # the region pads each chunk row to its alignment (0.25.1's CPU spec names none: the
    # builder's sizing would give one chunk)
    align = max(builder.cpu_alignment, int(getattr(SharedOffloadRegion, "BLOCK_SIZE_ALIGNMENT",
                                                   os.sysconf("SC_PAGE_SIZE"))))
    bpc = extra.get("blocks_per_chunk") or max(1, (layout.engine.offload_block_size or 0)
                                               // layout.groups[0].block_size)
    row = -(-builder.kv_bytes_per_block(kvc) * bpc // align) * align
    extra["cpu_bytes_to_use"] = row * layout.engine.cpu_chunks
    # named after the process that runs the worker pool too: its leftovers are told apart from
    # those of another campaign or test run on the machine
    engine_id = f"{ENGINE_PREFIX}{os.getppid()}-{uuid.uuid4().hex[:16]}"
    roots = [os.path.join(_root_parent(), f"{engine_id}-{i}")
             for i in range(len(layout.engine.secondary_tiers))]
    _issued[engine_id] = [shm_path(engine_id)] + roots
    extra["spec_name"] = "TieringOffloadingSpec"
    extra["secondary_tiers"] = [{"type": t.kind, "root_dir": root, "n_read_threads": 0,
                                 "n_write_threads": 0}
                                for t, root in zip(layout.engine.secondary_tiers, roots)]
    kt.kv_connector_extra_config = extra
    kt.engine_id = engine_id
    vc.kv_transfer_config = kt
    if hasattr(vc, "instance_id"):
        vc.instance_id = engine_id


def driver(sched, tph: int, case):
    return TieringDriver(sched, tph, case)


# -- jobs of the tiering manager, across releases ----------------------------------------------
def _cid(chunk) -> int:
    return int(chunk.chunk_id if hasattr(chunk, "chunk_id") else chunk.block_id)


def job_view(meta):
    """(is_promotion, keys, chunk ids, request id) of a tiering manager job (0.30.0+:
    ``JobMetadata(transfer_job, tier_idx)``; 0.25.1: the job; chunks were "blocks")."""
    tj = getattr(meta, "transfer_job", meta)
    ids = tj.chunk_ids if hasattr(tj, "chunk_ids") else tj.block_ids
    rid = getattr(getattr(tj, "req_context", None), "req_id", None)
    return tj.is_promotion, [bytes(k) for k in tj.keys], [int(c) for c in ids], rid


class FsIo:
    """One fs tier's I/O queue, run by the harness (the tier has no threads): ``run(step)``
    runs the tasks due before ``step``, FIFO, the load queue first (the load-priority worker
    of ``DualQueueThreadPool._worker``, 0.30.0 ``fs/thread_pool.py:165-195``); ``done(job_id,
    is_load, ok)`` is told of every job whose last task ran."""

    def __init__(self, tier, latency: int, done):
        from vllm.v1.kv_offload.tiering.fs.thread_pool import JobState
        self.tier, self.pool, self.latency, self.done = tier, tier._pool, latency, done
        # 0.30.0+: task_done(success, transfer_time) -> (finished, success, time)
        self.timed = len(inspect.signature(JobState.task_done).parameters) == 3
        # job id -> the step before which the harness first saw it queued (by id, not by the
        # JobState object: a freed object's address is reused)
        self.first_seen: dict[int, int] = {}

    def _next(self, step: int, final: bool):
        pool = self.pool
        with pool._condition:
            for q in (pool._load_q, pool._store_q):
                for _, state in q:
                    self.first_seen.setdefault(state.job_id, step)
            for q in (pool._load_q, pool._store_q):
                if q and (final or self.first_seen[q[0][1].job_id] + self.latency - 1 <= step):
                    task, state = q.popleft()
                    return task, state, q is pool._load_q
        return None

    def run(self, step: int, final: bool = False) -> int:
        n = 0
        while (nxt := self._next(step, final)) is not None:
            task, state, is_load = nxt
            t0 = time.monotonic()
            try:
                task()
                ok = True
            except Exception:   # noqa: BLE001 - what the pool does: the job fails
                ok = False
            res = (state.task_done(ok, time.monotonic() - t0) if self.timed
                   else state.task_done(ok))
            if res[0]:
                with self.pool._condition:
                    # 0.30.0+: (job_id, success, transfer_time); 0.25.1: (job_id, success)
                    self.pool._finished_q.append((state.job_id,) + tuple(res[1:]))
                    self.pool._inflight_jobs -= 1
                self.first_seen.pop(state.job_id, None)
                self.done(state.job_id, is_load, bool(res[1]))
            n += 1
        return n

    def busy(self) -> bool:
        """A task is queued or a job not finished."""
        pool = self.pool
        with pool._condition:
            return bool(pool._load_q or pool._store_q or self.first_seen)

    def answer_lookups(self) -> None:
        """Wait until the tier's lookup thread has answered every probe, applying the answers
        as vLLM's next ``lookup`` would (``AsyncLookupManager.drain_results``, 0.30.0
        ``async_lookup.py:143-188``): a probe's answer is a function of the files, which the
        I/O clock fixed."""
        import vllm.v1.kv_offload.tiering.async_lookup as alk
        lm = self.tier._lookup_manager
        phase = getattr(alk, "LookupPhase", None)      # 0.30.0+; 0.25.1: result None
        deadline = time.monotonic() + 10
        while True:
            lm.drain_results()
            states = list(lm._lookup_state.values())
            busy = any((s.phase is phase.IN_FLIGHT) if phase is not None else s.result is None
                       for s in states)
            if not busy:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("harness: the fs tier's lookup thread did not answer in 10 s")
            time.sleep(0.0005)


class WorkerRegion:
    """The GPU worker's view of the shared CPU region (a joiner of the scheduler's
    ``/dev/shm`` file, rank 0: 0.30.0 ``tiering/spec.py:386-413`` ->
    ``create_next_worker_view``), where a chunk's row is what the fs tier writes to its file
    and reads back. A chunk's content is kept as a signature of its shadow content, repeated
    over the worker's page; ``contents`` maps a signature back to the content."""

    def __init__(self, vc, kvc, engine_id: str):
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        try:    # 0.26.0+: the spec takes the normalized OffloadingConfig
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
                build_offloading_config)
            spec = OffloadingSpecFactory.create_spec(build_offloading_config(vc, kvc))
        except ImportError:
            spec = OffloadingSpecFactory.create_spec(vc, kvc)
        n = getattr(spec, "num_chunks", None) or spec.num_blocks
        row = getattr(spec, "kv_bytes_per_chunk", None) or spec.kv_bytes_per_offloaded_block
        params = set(inspect.signature(SharedOffloadRegion.__init__).parameters)
        self.page = spec.cpu_page_size_per_worker
        kw = {("engine_id" if "engine_id" in params else "instance_id"): engine_id,
              ("num_chunks" if "num_chunks" in params else "num_blocks"): n,
              ("kv_bytes_per_chunk" if "kv_bytes_per_chunk" in params
               else "kv_bytes_per_block"): row,
              "rank": 0, "cpu_page_size": self.page}
        self.region = SharedOffloadRegion(**kw)
        self.view = (self.region.create_next_worker_view(self.page)
                     if hasattr(self.region, "create_next_worker_view")
                     else self.region.create_next_view(self.page))
        self.contents: dict[bytes, tuple] = {}

    def pattern(self, sig: bytes) -> bytes:
        return (sig * (self.page // SIG + 1))[:self.page]

    def write(self, slot: int, content) -> bytes:
        import torch
        sig = hashlib.sha256(repr(content).encode()).digest()[:SIG]
        self.contents[sig] = content
        self.view[slot].copy_(torch.frombuffer(bytearray(self.pattern(sig)), dtype=torch.int8))
        return sig

    def sig_of(self, raw: bytes) -> bytes:
        """The signature a page holds, or ``b"torn:"`` + its head when it is not one."""
        head = raw[:SIG]
        return head if raw[:self.page] == self.pattern(head) else b"torn:" + head

    def read(self, slot: int) -> bytes:
        return self.sig_of(self.view[slot].numpy().tobytes())

    def content(self, sig: bytes, n_blocks: int):
        """The content a signature stands for; bytes no store wrote read as blocks that hold
        no token of any request (INV-5 then names them)."""
        if sig in self.contents:
            return self.contents[sig]
        return ("bytes " + sig.hex()[:16], None, None) * max(1, n_blocks)

    def close(self) -> None:
        self.view = None        # the worker's export of the mmap, before the region closes it
        self.region.cleanup()


class RegionTier(CpuTier):
    """The CPU tier as the worker sees it, in the shared region's bytes: a completed store
    writes its chunks' signatures into their slots; a load reads its slots' bytes (whatever a
    store or a promotion put there); the slot bookkeeping (INV-7) is :class:`CpuTier`'s."""

    def __init__(self, region: WorkerRegion, blocks_per_chunk: int):
        super().__init__()
        self.region, self.bpc = region, blocks_per_chunk
        self.slot_sig: dict[int, bytes] = {}      # slot -> the signature the worker wrote

    def stored(self, job) -> None:
        slots = self.job_slots.get(job.jid)
        super().stored(job)
        for item, s in zip(job.items, slots or ()):
            self.slot_sig[s] = self.region.write(s, job.contents.get(item[3]))

    def read(self, job, x: int, item):
        slots = self.job_slots.get(job.jid)
        fallback = super().read(job, x, item)
        if slots is None:
            return fallback
        return self.region.content(self.region.read(slots[x]), self.bpc)


class TieringDriver:
    """The ``OffloadingConnector`` over a ``TieringOffloadingManager`` (a
    :class:`~simsched.vllm.inside.connector.ConnectorDriver`): what the connector itself is
    read and answered by is :class:`OffloadingConnectorDriver`'s (``base``); this adds the
    tiers' I/O clock, the worker's bytes, the promotion liveness and the cleanup."""

    def __init__(self, sched, tph: int, case):
        self.base = OffloadingConnectorDriver(sched, tph)
        self.mgr = self.base.cs.manager
        self.engine_id = sched.vllm_config.kv_transfer_config.engine_id
        self.primary = self.mgr.primary_tier
        tiers = case.layout.engine.secondary_tiers
        self.io = [FsIo(t, spec.io_latency, self._io_done(i))
                   for i, (t, spec) in enumerate(zip(self.mgr.secondary_tiers, tiers))]
        # a deferral may also wait on the fs probe (a key's first fs lookup answers RETRY,
        # 0.30.0 async_lookup.py:156-164), the read and the step that loads
        self.lookup_defer_steps = 2 + max(spec.io_latency for spec in tiers)
        self.region = WorkerRegion(sched.vllm_config, sched.kv_cache_config, self.engine_id)
        self.tier = RegionTier(self.region, self.base.blocks_per_chunk)
        self.file_sig: dict[bytes, bytes] = {}      # offload key -> what its file holds
        self.seen: set[int] = set()                 # tier job ids seen
        self.promoted: dict[str, dict[bytes, int]] = {}   # waiting rid -> key -> promotions
        self.step, self.lines = 0, []
        _live.add(self.engine_id)

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        # everything else a run reads of the connector is the OffloadingConnector's own
        return getattr(self.base, name)

    def cpu_tier(self) -> CpuTier:
        return self.tier

    def tier_holds(self, request, block_hash, gid: int) -> bool:
        """The CPU (primary) tier holds the chunk ready, read from its own policy: the tiering
        manager's ``lookup`` would probe the fs tier and promote (``_initiate_promotion``)."""
        if self.base.offload_key is None:
            return True
        chunk = self.primary._policy.get(self.base.offload_key(block_hash, gid))
        return chunk is not None and chunk.is_ready

    # -- lookups: which waiting request promotes what ---------------------------------------
    def observe_lookups(self, observer) -> None:
        def seen(request, num_computed_tokens, out, bound):
            got = out[0] if isinstance(out, tuple) else out
            if got is not None:
                self.promoted.pop(request.request_id, None)   # it stops waiting on the tier
            observer(request, num_computed_tokens, out, bound)
        self.base.observe_lookups(seen)

    def _tier_jobs(self) -> dict:
        """The tiering manager's jobs in flight, job id -> job (0.25.1: ``_transfer_jobs``)."""
        jobs = getattr(self.mgr, "_jobs", None)
        return self.mgr._transfer_jobs if jobs is None else jobs

    def _new_jobs(self) -> None:
        """The tier jobs submitted since the last step (promotions at ``on_schedule_end``,
        cascades at ``complete_store``), before any of them runs; INV-8 when a chunk is
        promoted again and again for a request still waiting."""
        for jid, meta in sorted(self._tier_jobs().items()):
            if jid in self.seen:
                continue
            self.seen.add(jid)
            is_promotion, keys, _, rid = job_view(meta)
            if not is_promotion or rid is None:
                continue
            counts = self.promoted.setdefault(rid, {})
            for k in keys:
                counts[k] = counts.get(k, 0) + 1
                if counts[k] > inv.PROMOTION_ROUNDS:
                    raise self._thrash(rid, counts[k])

    def _thrash(self, rid: str, rounds: int) -> inv.InvariantViolation:
        n_cpu = len(self.tier.region.view) if self.tier.region.view is not None else "?"
        return inv.promotion_thrash(self.step, rid, rounds, n_cpu)

    # -- the I/O clock ----------------------------------------------------------------------
    def tier_io_live(self) -> bool:
        """A cascade or promotion of an fs tier is queued: a lookup waiting on a promotion of
        several reads (one ``io_latency`` each) is no stall."""
        return any(io.busy() for io in self.io)

    def before_schedule(self, step: int) -> list[str]:
        """Before ``schedule()`` of ``step``: the tier jobs submitted since, then the fs I/O
        due (its checks), then the lookup probes answered; the files' size bounded. The trace
        lines of the tier jobs that completed (``tier <cascade|promote> <job> <keys>
        checked``)."""
        self.step, self.lines = step, []
        self._new_jobs()
        self._check_size()
        for io in self.io:
            io.run(step)
            io.answer_lookups()
        return self.lines

    def _check_size(self) -> None:
        used = self._root_bytes()
        if used > FS_MAX_BYTES:
            from simsched.vllm.inside.build import Unsupported
            raise Unsupported(f"harness: the fs tier's files hold {used} bytes, over the "
                              f"harness's bound of {FS_MAX_BYTES} (SIMSCHED_FS_MAX_BYTES); "
                              "the run stops before the tier writes more")

    def _root_bytes(self) -> int:
        roots = _issued.get(self.engine_id, [])[1:]
        return sum(os.path.getsize(os.path.join(d, f)) for r in roots
                   for d, _, files in os.walk(r) for f in files)

    def _io_done(self, tier_idx: int):
        def done(job_id: int, is_load: bool, ok: bool) -> None:
            meta = self._tier_jobs().get(job_id)
            if meta is None or not ok:
                return
            _, keys, _, _ = job_view(meta)
            if is_load:
                self._promoted(job_id, keys)
            else:
                self._cascaded(tier_idx, job_id, keys)
        return done

    def _slot(self, key: bytes) -> int | None:
        """The CPU slot the primary tier itself records for ``key`` (not the job's: a job
        pairing a key with another slot is what INV-T1/T2 catch)."""
        chunk = self.primary._policy.get(key)
        return None if chunk is None else _cid(chunk)

    def _cascaded(self, tier_idx: int, job_id: int, keys: list) -> None:
        """INV-T1: the file of each key of a completed cascade holds what the worker wrote
        into the key's slot (pinned by ``prepare_read`` while the file is written), or, for a
        key whose file an earlier cascade wrote, what it held then: the tier writes a key once
        (``_store_block``: "Check if block already exists to avoid redundant writes", 0.30.0
        ``fs/io.py:100-102``, every release). A key names its tokens, but not which blocks of
        them a store holds: a sliding-window chunk stored again past its window has null
        blocks the first store filled, and its bytes differ."""
        tier, region = self.mgr.secondary_tiers[tier_idx], self.region
        for k in keys:
            s = self._slot(k)
            want = self.file_sig.get(k, self.tier.slot_sig.get(s))
            with open(tier.file_mapper.get_file_name(k), "rb") as f:
                got = region.sig_of(f.read(region.page))
            if want is not None and got != want:
                was = "held before" if k in self.file_sig else f"the slot {want.hex()[:16]}"
                raise inv.InvariantViolation(
                    "INV-T1", self.step, f"cascade {job_id}: the file of a key in CPU slot {s} "
                    f"holds {got.hex()[:16]}, {was}", "cascade")
            self.file_sig[k] = got
        self.lines.append(f"tier cascade {job_id} {len(keys)} checked")

    def _promoted(self, job_id: int, keys: list) -> None:
        """INV-T2: when a promotion's read completes, the slot the primary tier allocated for
        each key holds what the key's file held when its cascade completed."""
        for k in keys:
            s = self._slot(k)
            want = self.file_sig.get(k)
            got = self.region.read(s) if s is not None else None
            if want is not None and got != want:
                raise inv.InvariantViolation(
                    "INV-T2", self.step, f"promotion {job_id}: CPU slot {s} holds "
                    f"{got.hex()[:16] if got else None} after the read, its key's file "
                    f"{want.hex()[:16]}", "promote")
            if s is not None and got is not None:
                self.tier.slot_sig[s] = got
        self.lines.append(f"tier promote {job_id} {len(keys)} checked")

    # -- the end of the run -----------------------------------------------------------------
    def close(self) -> None:
        """Stop the tiers' lookup threads and queues, close both views of the region, and
        remove the region's ``/dev/shm`` file and the fs roots, whatever the run ended in."""
        try:
            for t in self.mgr.secondary_tiers:
                t.shutdown()
            self.primary.shutdown()
            self.region.close()
        finally:
            _live.discard(self.engine_id)
            _remove(self.engine_id)
