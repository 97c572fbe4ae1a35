"""The harness's driver of vLLM's ``SimpleCPUOffloadConnector`` (``engine.connector: {"kind":
"simple_cpu", "lazy_offload": bool}``, :mod:`simsched.connectors`; 0.25.1+), as the research of
issue 21 read it (0.30.0 ``vllm/v1/simple_kv_offload/manager.py``, **mgr**; ``worker.py``, **wrk**).

Scheduler side, nothing played: the real ``Scheduler`` builds the real connector, whose
``scheduler_manager`` (``SimpleCPUOffloadScheduler``) keeps a CPU ``BlockPool`` of
``cpu_bytes_to_use`` / the pool's bytes per block blocks (block 0 its null block: a tier of N
blocks holds N - 1). Its metadata is flat (``SimpleCPUOffloadMetadata``): one store event per
step (``store_gpu_blocks[i] -> store_cpu_blocks[i]``, every request's and group's blocks, or in
lazy mode the GPU free queue's hashed blocks), one load event (``load_cpu_blocks[i] ->
load_gpu_blocks[i]``) and ``load_event_to_reqs``, ``need_flush`` on a preemption.

Worker side, played as ``SimpleCPUOffloadWorker`` does (wrk 0.30.0:246-346): an event is cut
into one transfer job per request (the run's jobs are a request's), each item one GPU block
named by the chunk identity the content shadow judges by: the block's own hash in the GPU pool
(``BlockHashWithGroupId``: its group, and its position in any request whose hash chain holds
it; a lazy store names free blocks of finished requests) for a store, the block's position in
the loading request's table for a load; the job's slots are the event's CPU blocks. A store
event is reported done (``SimpleCPUOffloadWorkerMetadata.completed_store_events``) once all its
jobs are done and every earlier event was reported (the worker's FIFO high-water mark, wrk
368-382); a load through ``finished_recving`` (the request ids ``load_event_to_reqs`` names);
never ``finished_sending``. The connector's own GPU pins (stores in flight, loads issued) are
holders for INV-1 (``held_blocks``).

Checked on this path: INV-1/2 with the connector's pins, INV-3/4 (a stored block's content
against the hash it is stored under, read when the store completes; a prompt's partial tail,
cached under a hash boundary inside its block, by content alone:
:mod:`~simsched.vllm.inside.partial_tails`), INV-5 (a load writes what
its CPU block holds: the last completed store there, whatever hash the CPU pool maps to it now),
INV-4 on the CPU pool (a CPU block the manager registered under a hash holds what the worker
wrote there of that hash's block), INV-6, INV-7 (a load of a CPU block no completed store
wrote; a store into a CPU block a load still reads), INV-8 (the engine idles with nothing pending, within the step cap), INV-9 (the
hit is at least what the real CPU pool holds of the completed stores, ``tier_holds``, less the
eagle tail its coordinator drops with an EAGLE/MTP drafter: ``drafter_groups``).
Not checked yet: INV-9's upper bound (a hit over-claiming is caught by INV-5 on the block never
loaded); the CPU pool's refcounts (INV-1 covers the GPU pool only); world size > 1 (one worker
reports each event); a ``need_flush`` step completes the stores in flight but not the loads
(their report waits for their latency, as without a flush); ``reset_prefix_cache
(reset_connector=True)`` (the case format has no connector reset); the 0.25.1 launch points
(copies in ``get_finished``); between two requests of 0.25.1-0.29.0 the run steps while a job
is in flight, where the engine idles (their keep-alive hook is misnamed,
``has_pending_transfers``; after the last request the run ends idle with them, as the engine:
``strands_at_idle``); the ring group's content after a CPU hit (only the full-attention groups
are loaded; 0.30.0's eager mode crashes on a ring first).

Findings on this path (``tests/test_real_simple_cpu.py``, ``docs/invariants.md``): lazy offload
never lets the engine idle (0.30.0-0.33.0, INV-8 at the step cap), eager offload with a ring
group crashes 0.30.0's ``schedule()``."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from simsched import invariants as inv
from simsched.model.request import make_key
from simsched.vllm.inside import connector as seam
from simsched.vllm.inside.connector import ScheduledJobs
from simsched.vllm.inside.cpu_tier import CpuTier
from simsched.vllm.inside.pool_checks import block_tables


def kv_transfer(builder, layout, vc, kvc) -> None:
    """``KVTransferConfig(kv_connector="SimpleCPUOffloadConnector")`` as a deployment passes it:
    a CPU tier of ``engine.cpu_chunks`` blocks of the GPU pool's bytes per block (the ratio
    ``_derive_cpu_config`` takes, mgr 0.30.0:266-272) and the case's ``lazy_offload``."""
    eng = layout.engine
    extra = {"cpu_bytes_to_use": builder.kv_bytes_per_block(kvc) * eng.cpu_chunks,
             "lazy_offload": bool(eng.connector.lazy_offload)}
    vc.kv_transfer_config = builder.KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both", engine_id="simsched",
        kv_connector_extra_config=extra)


def driver(sched, tph: int, case) -> "SimpleCPUDriver":
    return SimpleCPUDriver(sched, tph, case)


class SimpleCPUDriver:
    """A :class:`~simsched.vllm.inside.connector.ConnectorDriver` of the
    ``SimpleCPUOffloadConnector``: every KV cache group offloaded, one GPU block a chunk."""

    blocks_per_chunk = 1
    # the lazy walk stores any hashed GPU block, also a prompt's partial tail (a hash boundary
    # inside the block): INV-4 by content on such a block, not INV-3 (PartialTails)
    partial_tails = True
    caps_supported = {"max_offload_tokens": False, "max_load_tokens": False}
    lookup_defer_steps = 0

    def __init__(self, sched, tph: int, case):
        import vllm.v1.core.kv_cache_utils as kcu
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
        self.kcu, self.KVConnectorOutput = kcu, KVConnectorOutput
        self.WorkerMeta = SimpleCPUOffloadWorkerMetadata
        self.sched, self.tph, self.case = sched, tph, case
        self.mgr = getattr(sched.connector, "scheduler_manager", None)
        if self.mgr is None:
            raise RuntimeError("harness: the SimpleCPUOffloadConnector built no scheduler "
                               "manager (prefix caching off?)")
        mgrs = sched.kv_cache_manager.coordinator.single_type_managers
        self.groups = [SimpleNamespace(group_id=g, tokens_per_block=int(m.block_size),
                                       tokens_per_chunk=int(m.block_size), cow_source=False)
                       for g, m in enumerate(mgrs)]
        self.group_by_id = {g.group_id: g for g in self.groups}
        self.geometry = SimpleNamespace(tokens_per_hash=tph, groups=self.groups)
        # the CPU coordinator's hits end on its scheduler block, or on the hash unit where it
        # enables partial hash hits (0.30.0+: eager mode beside an align-mode Mamba group)
        coord = self.mgr.cpu_coordinator
        # 0.25.1-0.29.0 name the connector's keep-alive hook has_pending_transfers, which no
        # one calls: has_pending_push_work is the base's (False), and the engine idles with the
        # last stores in flight (0.30.0+ override it: has_pending_stores)
        self.strands_at_idle = "has_pending_push_work" not in vars(type(sched.connector))
        self.hit_alignment = (tph if getattr(coord, "enable_partial_hash_hits", False)
                              else int(coord.scheduler_block_size))
        self.seen: dict[str, object] = {}        # rid -> vllm Request, every one scheduled
        self.hash_at: dict[bytes, tuple[str, int]] = {}   # block hash -> (rid, hash index)
        self.next_jid = 0
        self.job_event: dict[int, tuple[bool, int]] = {}  # job -> (is store, event index)
        self.store_jobs: dict[int, set[int]] = {}  # store event -> its jobs not done
        self.store_order: list[int] = []           # store events not yet reported, FIFO
        self.open_loads: set[int] = set()          # load jobs not done
        # INV-4 on the CPU pool: CPU block -> the key of what the last completed store wrote
        # there; the keys each store job writes; the run's requests; the step being scheduled
        self.slot_key: dict[int, int] = {}
        self.writes: dict[int, list] = {}
        self.requests = None
        self.step = -1

    # -- boot-time answers --------------------------------------------------------------------
    def drafter_groups(self, case) -> set[int]:
        """The groups whose CPU lookup drops the volatile trailing block of an EAGLE/MTP
        drafter, for INV-9's eagle-tail rule: every group when the manager's CPU coordinator
        was built with ``use_eagle`` (``spec_config.use_eagle_block_drop()``, 0.30.0
        ``manager.py:186-193``; 0.25.1 builds it with ``use_eagle=False``), read from its
        managers."""
        managers = self.mgr.cpu_coordinator.single_type_managers
        return {g for g, m in enumerate(managers) if getattr(m, "use_eagle", False)}

    def kv_transfer_params(self, spec) -> dict:
        return {}

    def reads_load_cap(self, rid: str) -> bool:
        return False

    def cpu_tier(self) -> CpuTier:
        """The CPU pool's blocks as the content shadow keeps them (slot = CPU block id)."""
        return CpuTier()

    def tier_io_live(self) -> bool:
        return False

    def before_schedule(self, step: int) -> list[str]:
        return []

    def close(self) -> None:
        """Nothing outside the process."""

    def worker_refusal(self, vc, kvc, meta, jid: int) -> str | None:
        """A failed transfer: ``SimpleCPUOffloadWorker`` has no failure report (a CUDA copy
        either runs or raises in the engine); not played."""
        from simsched.vllm.inside.build import Unsupported
        raise Unsupported("a failed transfer on the SimpleCPUOffloadConnector: not played")

    # -- lookups ------------------------------------------------------------------------------
    def observe_lookups(self, observer) -> None:
        """Every lookup the manager answers, handed to ``observer``
        (:func:`~simsched.vllm.inside.connector.observe_lookups`)."""
        seam.observe_lookups(self.mgr, observer)

    def stop_observing(self) -> None:
        seam.stop_observing(self.mgr)

    def tier_holds(self, request, block_hash, gid: int) -> bool:
        """The CPU pool holds the block: its hash with the group registered (a completed
        store, ``_process_store_completion`` mgr 0.30.0:1024-1037) and not evicted since
        (``get_new_blocks`` of a later store)."""
        key = self.kcu.make_block_hash_with_group_id(block_hash, gid)
        return self.mgr.cpu_block_pool.cached_block_hash_to_block.get_one_block(key) is not None

    # -- the jobs of a step -------------------------------------------------------------------
    def has_jobs(self) -> bool:
        """Stores not reported (or queued by a finish flush), loads not done."""
        return bool(self.store_order or self.open_loads or self.mgr.has_pending_stores())

    def _remember(self) -> None:
        """Every live request, kept after it leaves: a lazy store names its freed blocks."""
        for rid, req in self.sched.requests.items():
            self.seen.setdefault(rid, req)
        for rid, req in self.seen.items():
            for j, h in enumerate(req.block_hashes):
                self.hash_at.setdefault(bytes(h), (rid, j))

    def _new_jid(self, is_store: bool, event: int) -> int:
        jid = self.next_jid
        self.next_jid += 1
        self.job_event[jid] = (is_store, event)
        return jid

    def scheduled_jobs(self, out) -> ScheduledJobs:
        """The step's store event and load event, one job per request."""
        meta = getattr(out, "kv_connector_metadata", None)
        if meta is None:
            return ScheduledJobs(None, {}, {}, set())
        self._remember()
        self.step += 1
        self._check_registered()
        flush = set()
        if getattr(meta, "need_flush", False):
            # handle_preemptions (wrk 0.30.0:348-366): every event in flight synchronized
            flush = {j for jobs in self.store_jobs.values() for j in jobs}
        stores = self._store_jobs(meta)
        loads = self._load_jobs(meta)
        return ScheduledJobs(meta, loads, stores, flush)

    def _store_jobs(self, meta) -> dict:
        """Per request (the one whose hash chain holds the block's hash) its part of the
        store event: ``(group, block index, hash index, gpu block)`` and the CPU block."""
        ev = int(meta.store_event)
        if ev < 0 or not meta.store_gpu_blocks:
            return {}
        blocks = self.sched.kv_cache_manager.block_pool.blocks
        per_rid: dict[str, SimpleNamespace] = {}
        for g, c in zip(meta.store_gpu_blocks, meta.store_cpu_blocks):
            bh = blocks[int(g)].block_hash
            if bh is None:
                raise RuntimeError(f"harness: store event {ev} names GPU block {g}, unhashed")
            gid = int(self.kcu.get_group_id(bh))
            at = self.hash_at.get(bytes(self.kcu.get_block_hash(bh)))
            if at is None:
                raise RuntimeError(f"harness: store event {ev}: GPU block {g}'s hash is no "
                                   "request's")
            rid, hidx = at
            tpb = self.group_by_id[gid].tokens_per_block
            part = per_rid.setdefault(rid, SimpleNamespace(req_id=rid, raw=[], slots=[]))
            # the block that ends the hash's prefix: a complete block, or the prompt's partial
            # tail the GPU manager caches under a hash boundary inside it
            # (``_cache_partial_tail_block``, 0.26.0+), which the lazy walk stores as it is
            part.raw.append((gid, ((hidx + 1) * self.tph - 1) // tpb, hidx, int(g)))
            part.slots.append(int(c))
        jobs = {}
        for part in per_rid.values():
            jid = self._new_jid(True, ev)
            jobs[jid] = part
            self.store_jobs.setdefault(ev, set()).add(jid)
        if ev not in self.store_order:
            self.store_order.append(ev)
        return jobs

    def _load_jobs(self, meta) -> dict:
        """Per request of the new load event, its destination blocks by their position in
        its block table (``update_state_after_alloc`` pairs CPU hit block i with GPU block
        ``num_local // block_size + i``, mgr 0.30.0:461-470)."""
        ev = int(meta.load_event)
        if ev < 0:
            return {}
        rids = list((meta.load_event_to_reqs or {}).get(ev, ()))
        parts = {rid: SimpleNamespace(req_id=rid, raw=[], slots=[]) for rid in rids}
        tables = {rid: block_tables(self.sched, rid) for rid in rids}
        for g, c in zip(meta.load_gpu_blocks, meta.load_cpu_blocks):
            g = int(g)
            for rid in rids:
                hit = [(gid, t.index(g)) for gid, t in enumerate(tables[rid]) if g in t]
                if hit:
                    gid, i = hit[0]
                    tpb = self.group_by_id[gid].tokens_per_block
                    parts[rid].raw.append((gid, i, (i + 1) * tpb // self.tph - 1, g))
                    parts[rid].slots.append(int(c))
                    break
            else:
                raise RuntimeError(f"harness: load event {ev} writes GPU block {g}, in no "
                                   f"table of {rids}")
        jobs = {}
        for rid in rids:
            jid = self._new_jid(False, ev)
            jobs[jid] = parts[rid]
            self.open_loads.add(jid)
        return jobs

    def job_items(self, jid: int, tjob, is_store: bool, requests) -> tuple[list, None]:
        """Per GPU block ``(group, block index, hash index, key, [(block index, block)])``,
        the key the model's of the prefix the block ends (of the request the job names)."""
        self.requests = requests
        ident = requests.ident[tjob.req_id]
        items = [(gid, i, hidx, make_key(gid, ident.ident_at((hidx + 1) * self.tph)),
                  [(i, b)]) for gid, i, hidx, b in tjob.raw]
        if is_store:
            self.writes[jid] = [(c, it[3]) for c, it in zip(tjob.slots, items)]
        return items, None

    def _check_registered(self) -> None:
        """INV-4 on the CPU pool, once the manager processed a store's completion: a CPU block
        registered under a hash (``_process_store_completion``, mgr 0.30.0:1024-1037) holds
        the KV of that hash's prefix, i.e. the worker wrote there the block of that hash.
        Registered: in the pool's hash map, where a lookup finds it; 0.25.1-0.29.0 stamp the
        hash on the CPU block when they allocate it for a store (``_prepare_*_store_specs``,
        mgr 0.29.0:637-642) and map it only at the store's completion."""
        pool = self.mgr.cpu_block_pool
        blocks, registered = pool.blocks, pool.cached_block_hash_to_block
        for c, key in self.slot_key.items():
            bh = blocks[c].block_hash
            if bh is None or not registered.contain(bh, c):
                continue
            at = self.hash_at.get(bytes(self.kcu.get_block_hash(bh)))
            if not at:
                continue
            rid, hidx = at
            gid = int(self.kcu.get_group_id(bh))
            want = make_key(gid, self.requests.ident[rid].ident_at((hidx + 1) * self.tph))
            if key != want:
                raise inv.InvariantViolation(
                    "INV-4", self.step, f"CPU block {c} registered under g{gid}:{hidx} of "
                    f"{rid} holds what a store wrote of another prefix", "store")

    def job_slots(self, tjob, is_store: bool):
        """The CPU blocks the job writes or reads, one per item."""
        return tjob.slots

    def external_writes(self, out, t: int) -> list:
        return []

    # -- their completion ---------------------------------------------------------------------
    def connector_output(self, completed_jobs: list[int], finished_recving: set[str]):
        """``SimpleCPUOffloadWorkerMetadata.completed_store_events`` of the store events whose
        jobs are all done, in FIFO order (wrk 0.30.0:368-382: the high-water mark), and the
        loads' requests in ``finished_recving``; never ``finished_sending``."""
        for jid in completed_jobs:
            is_store, ev = self.job_event.get(jid, (None, None))
            if is_store:
                self.store_jobs.get(ev, set()).discard(jid)
                self.slot_key.update(self.writes.pop(jid, ()))
            elif is_store is False:
                self.open_loads.discard(jid)
        done = []
        while self.store_order and not self.store_jobs.get(self.store_order[0]):
            ev = self.store_order.pop(0)
            self.store_jobs.pop(ev, None)
            done.append(ev)
        if not done and not finished_recving:
            return None
        wm = self.WorkerMeta(completed_store_events=dict.fromkeys(done, 1)) if done else None
        return self.KVConnectorOutput(finished_recving=set(finished_recving) or None,
                                      kv_connector_worker_meta=wm)

    # -- the connector's own GPU pins (INV-1) -----------------------------------------------
    def held_blocks(self) -> Counter:
        """The GPU blocks the manager touched and has not freed: the sources of stores in
        flight or queued, abandoned ones, the destinations of loads issued (mgr 0.30.0:
        473-481, 766, 1000-1007)."""
        m, held = self.mgr, Counter()
        metas = list(m._store_event_to_blocks.values())
        metas += list(getattr(m, "_abandoned_store_event_to_blocks", {}).values())
        metas += list(getattr(m, "_pending_finished_stores", ()))
        for st in list(m._reqs_to_load.values()) + list(
                getattr(m, "_abandoned_reqs_to_load", {}).values()):
            metas.append(st.transfer_meta)
        for tm in metas:
            held.update(int(b) for b in tm.gpu_block_ids)
        held.pop(0, None)
        return held
