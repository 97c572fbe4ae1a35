"""Test-only mutants of the real vLLM offloading scheduler (applied inside a release worker).

A mutant is a deliberate bug patched into the release's own functions, to show that the lockstep
harness (content shadow + invariants + trace diff) detects that kind of bug on real code. They are
reachable only through the explicit ``mutant`` argument of the worker's ``run_case`` op;
:func:`apply` returns the function that undoes the patch (the engine calls it after the case).

=======================  ==========================================================  ==========
name                     bug                                                         caught by
=======================  ==========================================================  ==========
store_shift_chunk        a store job's source blocks taken one chunk too early       INV-4
drop_fence               ``jobs_to_flush`` dropped: re-allocated blocks are written  INV-6
                         before the store that reads them
load_reverse             a load's destination blocks reversed                        INV-5
key_wrong_hash           chunk 0's offload key built from block hash 1 (and back)    INV-3
lookup_first_chunk_only  the lookup stops after the first chunk past the GPU hit     INV-9
                         (``_lookup_complete_chunks``)
lookup_defer_forever     once a hit exists, the lookup defers (``None``) forever     INV-8, op
                         (``get_num_new_matched_tokens``)                            ``lookup``
lookup_refuse_window     no hit at all when a sliding-window group is offloaded      INV-9
                         (``_lookup_complete_chunks``)
store_key_late           a store job keyed one chunk late: chunk ``c``'s blocks      INV-4
                         stored under chunk ``c + 1``'s key
fence_skip_group         the fence (``_current_batch_allocated_block_ids`` against   INV-6
                         ``_block_id_to_pending_jobs``) ignores the last group's
                         blocks (no-op with one group)
max_offload_ignored      ``max_offload_tokens`` parsed, then dropped                 INV-10
max_load_ignored         ``max_load_tokens`` parsed, then dropped (refused by a      INV-10
                         release that has none: 0.30.0)
load_into_pending_store  a load's destination blocks not fenced: a pending store     INV-6
                         still reads them when the load writes them
evict_in_use             the CPU tier does not pin a chunk being loaded              INV-7
                         (``prepare_load``'s ``ref_cnt``): LRU eviction hands its
                         slot to a new store while the load still reads it
lost_completion          the first store completion the worker reports is never      INV-8
                         processed: its chunks stay pending, a request sharing them
                         waits forever
touch_double_ref         ``BlockPool.touch`` (a GPU prefix hit taking its blocks)    INV-1
                         counts every block twice: freed once, it never returns to the
                         free queue
early_ready              (tiering) a promotion marks its CPU slot ready when it      INV-5
                         submits the fs read, before the bytes land
cascade_wrong_chunk      (tiering) a cascade writes key i's file from key i + 1's    INV-T1
                         CPU slot
promote_wrong_slot       (tiering) a promotion reads key i's file into key i + 1's   INV-T2
                         slot
recv_swallowed           ``MultiConnector.get_transfer_results``: a child's          INV-8
                         ``finished_recving`` replaces the others' (the last child
                         wins): a request loaded by another child stays in
                         ``WAITING_FOR_REMOTE_KVS``
gate_open                a ``WAITING_FOR_REMOTE_KVS`` request promoted without its   INV-6b
                         ``finished_recving`` (``Scheduler``): forward and store
                         over blocks NIXL has not written yet
no_alloc_track           0.33.0's fix of vLLM #46951 reverted: the offloading        INV-6
                         scheduler ignores the blocks another child allocates
                         (``update_state_after_alloc`` with 0 tokens), so a pending
                         store over them is not flushed before NIXL writes them
simple_cpu_reversed      (simple_cpu) a store event's CPU blocks reversed: a block     INV-4
                         lands in another CPU block than its hash's
simple_hit_plus_block    (simple_cpu) the CPU hit over-claims one scheduler block:     INV-4
                         never loaded, the block is stored with what it held before
simple_unpinned_load     (simple_cpu) a load's CPU blocks not pinned: a store evicts   INV-7
                         one while the load reads it
=======================  ==========================================================  ==========

``recv_swallowed``, ``gate_open`` and ``no_alloc_track`` are of the ``multi`` connector path
(:mod:`simsched.vllm.inside.multi`), the ``simple_`` ones of the ``simple_cpu`` path
(:mod:`simsched.vllm.inside.simple_cpu`).
"""

from __future__ import annotations

from typing import Callable

_SCHED = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
_MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"


def _mod():
    import importlib
    return importlib.import_module(_SCHED)


def _set_block_ids(spec, ids: list[int]) -> None:
    old = spec.block_ids
    try:
        import numpy as np
        if isinstance(old, np.ndarray):
            spec.block_ids = np.array(ids, dtype=old.dtype)
            return
    except ImportError:
        pass
    spec.block_ids = type(old)(ids) if isinstance(old, (list, tuple)) else list(ids)


def _patch(cls, name: str, make: Callable) -> Callable[[], None]:
    orig = cls.__dict__[name]
    setattr(cls, name, make(orig))
    return lambda: setattr(cls, name, orig)


def store_shift_chunk():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def _build_store_jobs(self, *args, **kw):
            jobs = orig(self, *args, **kw)
            bpc = self.config.blocks_per_chunk
            for tj in jobs.values():
                st = self._req_status.get(tj.req_id)
                if st is None:
                    continue
                pos = {}
                for gs in st.group_states:
                    for i, b in enumerate(gs.block_ids):
                        pos.setdefault(b, (gs, i))
                new = []
                for b in tj.src_spec.block_ids:
                    gs, i = pos.get(int(b), (None, None))
                    new.append(int(gs.block_ids[i - bpc]) if gs is not None and i >= bpc
                               and gs.block_ids[i - bpc] else int(b))
                _set_block_ids(tj.src_spec, new)
            return jobs
        return _build_store_jobs
    return _patch(cls, "_build_store_jobs", make)


def drop_fence():
    cls = _mod().OffloadingConnectorScheduler
    name = "_build_connector_meta" if "_build_connector_meta" in cls.__dict__ \
        else "build_connector_meta"

    def make(orig):
        def build(self, *args, **kw):
            meta = orig(self, *args, **kw)
            if getattr(meta, "jobs_to_flush", None):
                meta.jobs_to_flush = set()
            return meta
        return build
    return _patch(cls, name, make)


def load_reverse():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def update_state_after_alloc(self, request, *args, **kw):
            before = set(self._current_batch_load_jobs)
            out = orig(self, request, *args, **kw)
            for jid in set(self._current_batch_load_jobs) - before:
                spec = self._current_batch_load_jobs[jid].dst_spec
                _set_block_ids(spec, [int(b) for b in spec.block_ids][::-1])
            return out
        return update_state_after_alloc
    return _patch(cls, "update_state_after_alloc", make)


def key_wrong_hash():
    m = _mod()
    cls = m.RequestOffloadState
    seen: set[int] = set()

    def make(orig):
        def update_offload_keys(self, *args, **kw):
            out = orig(self, *args, **kw)
            for gs in self.group_states:
                keys = gs.offload_keys
                if id(gs) not in seen and len(keys) >= 2:
                    seen.add(id(gs))
                    keys[0], keys[1] = keys[1], keys[0]
            return out
        return update_offload_keys
    return _patch(cls, "update_offload_keys", make)


def store_key_late():
    """``_build_store_jobs`` run on offload keys shifted by one chunk (every group's
    ``offload_keys[1:]``), restored afterwards: chunk ``c``'s blocks go under chunk ``c + 1``'s
    key, and a later request hitting that key loads the wrong tokens."""
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def _build_store_jobs(self, *args, **kw):
            saved = []
            for st in self._req_status.values():
                for gs in st.group_states:
                    saved.append((gs, gs.offload_keys))
                    gs.offload_keys = gs.offload_keys[1:]
            try:
                return orig(self, *args, **kw)
            finally:
                for gs, keys in saved:
                    gs.offload_keys = keys
        return _build_store_jobs
    return _patch(cls, "_build_store_jobs", make)


def _unfence(self, block_ids) -> None:
    """Take ``block_ids`` out of this step's allocated blocks: no pending store reading one of
    them is flushed (build_connector_meta: "Flush jobs that contain re-allocated blocks")."""
    self._current_batch_allocated_block_ids.difference_update(int(b) for b in block_ids)


def fence_skip_group():
    m = _mod()
    cls = m.OffloadingConnectorScheduler

    def skipped(self) -> int | None:
        cfgs = self.config.kv_group_configs
        return cfgs[-1].group_idx if len(cfgs) > 1 else None

    def make_update(orig):
        def _update_req_states(self, scheduler_output, *args, **kw):
            out = orig(self, scheduler_output, *args, **kw)
            gid = skipped(self)
            if gid is not None:
                for _, groups, _ in m.yield_req_data(scheduler_output):
                    if groups:
                        _unfence(self, groups[gid])
            return out
        return _update_req_states

    def make_alloc(orig):
        def update_state_after_alloc(self, request, blocks, *args, **kw):
            out = orig(self, request, blocks, *args, **kw)
            gid = skipped(self)
            if gid is not None:
                _unfence(self, [b.block_id for b in blocks.blocks[gid]])
            return out
        return update_state_after_alloc
    undo = [_patch(cls, "_update_req_states", make_update),
            _patch(cls, "update_state_after_alloc", make_alloc)]
    return lambda: [u() for u in undo]


def _cap_ignored(name: str):
    """``RequestOffloadState.__post_init__`` parses ``kv_transfer_params[name]``, then the cap
    is dropped (None: no cap). Refused where the release has no such field."""
    import dataclasses
    cls = _mod().RequestOffloadState
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise ValueError(f"mutant: this release's RequestOffloadState has no {name}")

    def make(orig):
        def __post_init__(self):
            orig(self)
            setattr(self, name, None)
        return __post_init__
    return _patch(cls, "__post_init__", make)


def max_offload_ignored():
    return _cap_ignored("max_offload_tokens")


def max_load_ignored():
    return _cap_ignored("max_load_tokens")


def load_into_pending_store():
    """``update_state_after_alloc`` keeps the request's blocks out of this step's allocated
    blocks: a load's destination block that a finished request's pending store still reads is
    not flushed, and the load overwrites it first."""
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def update_state_after_alloc(self, request, blocks, *args, **kw):
            before = set(self._current_batch_allocated_block_ids)
            out = orig(self, request, blocks, *args, **kw)
            _unfence(self, self._current_batch_allocated_block_ids - before)
            return out
        return update_state_after_alloc
    return _patch(cls, "update_state_after_alloc", make)


def evict_in_use():
    """``CPUOffloadingManager.prepare_load`` unpins what it pinned (``ref_cnt`` back to 0, the
    chunk evictable again) and ``complete_load`` has nothing to unpin: the eviction policy may
    pick a chunk a load is still reading and hand its slot to a new store."""
    import importlib
    cls = importlib.import_module("vllm.v1.kv_offload.cpu.manager").CPUOffloadingManager

    def make_prepare(orig):
        def prepare_load(self, keys, *args, **kw):
            keys = list(keys)
            spec = orig(self, keys, *args, **kw)
            for key in keys:
                chunk = self._policy.get(key)
                chunk.ref_cnt -= 1
                if chunk.ref_cnt == 0:
                    self._num_evictable_cache_chunks += 1
                    self._policy.mark_evictable(key)
            return spec
        return prepare_load

    def make_complete(orig):
        def complete_load(self, keys, *args, **kw):
            return None
        return complete_load
    undo = [_patch(cls, "prepare_load", make_prepare),
            _patch(cls, "complete_load", make_complete)]
    return lambda: [u() for u in undo]


def lost_completion():
    """The first store completion the worker reports (``OffloadingWorkerMetadata.
    completed_jobs``) is dropped before the scheduler processes it: the job never completes,
    its chunks stay write-pending in the CPU tier."""
    cls = _mod().OffloadingConnectorScheduler
    name = "_update_connector_output" if "_update_connector_output" in cls.__dict__ \
        else "update_connector_output"
    lost: list[int] = []        # (per applied mutant: the one job lost)

    def make(orig):
        def update(self, connector_output, *args, **kw):
            meta = connector_output.kv_connector_worker_meta
            done = getattr(meta, "completed_jobs", None)
            if done and not lost:
                stores = sorted(j for j in done if j in self._jobs and self._jobs[j].is_store)
                if stores:
                    lost.append(stores[0])
                    meta.completed_jobs = {j: n for j, n in done.items() if j != stores[0]}
            return orig(self, connector_output, *args, **kw)
        return update
    return _patch(cls, name, make)
def lookup_first_chunk_only():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def _lookup_complete_chunks(self, req_status, *args, **kw):
            hit = orig(self, req_status, *args, **kw)
            if not hit:
                return hit
            tpc = max(g.tokens_per_chunk for g in self.config.kv_group_configs)
            start = req_status.num_locally_computed_tokens
            return min(hit, (start // tpc + 1) * tpc - start)
        return _lookup_complete_chunks
    return _patch(cls, "_lookup_complete_chunks", make)


def lookup_defer_forever():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def get_num_new_matched_tokens(self, *args, **kw):
            hit, load_async = orig(self, *args, **kw)
            return (None, False) if hit else (hit, load_async)
        return get_num_new_matched_tokens
    return _patch(cls, "get_num_new_matched_tokens", make)


def lookup_refuse_window():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def _lookup_complete_chunks(self, req_status, *args, **kw):
            hit = orig(self, req_status, *args, **kw)
            return 0 if hit and self._sliding_window_groups else hit
        return _lookup_complete_chunks
    return _patch(cls, "_lookup_complete_chunks", make)


def touch_double_ref():
    """``BlockPool.touch`` takes two references on each block of a GPU prefix hit: the request
    frees one, the block stays out of the free queue with nobody holding it."""
    import importlib
    cls = importlib.import_module("vllm.v1.core.block_pool").BlockPool

    def make(orig):
        def touch(self, blocks, *args, **kw):
            blocks = list(blocks)
            orig(self, blocks, *args, **kw)
            for block in blocks:
                if not block.is_null:
                    block.ref_cnt += 1
        return touch
    return _patch(cls, "touch", make)


def recv_swallowed():
    """``MultiConnector.get_transfer_results`` (0.30.0 ``multi_connector.py:339-357``): each
    child's ``finished_recving`` replaces the union instead of joining it."""
    import importlib
    cls = importlib.import_module(_MULTI).MultiConnector
    results_cls = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.base").KVConnectorTransferResults

    def make(orig):
        def get_transfer_results(self, finished_req_ids):
            results = results_cls()
            for connector in self._connectors:
                child = connector.get_transfer_results(finished_req_ids)
                results.finished_recving = set(child.finished_recving)        # MUTANT
                results.failed_recving.update(child.failed_recving)
                results.finished_sending.update(child.finished_sending)
            return results
        return get_transfer_results
    return _patch(cls, "get_transfer_results", make)


def gate_open():
    """The Scheduler promotes a ``WAITING_FOR_REMOTE_KVS`` request before its
    ``finished_recving`` (0.30.0 ``_try_promote_blocked_waiting_request``, 0.33.0
    ``_handle_blocked_waiting_request``: the gate is ``finished_recving_kv_req_ids``)."""
    import importlib
    sched = importlib.import_module("vllm.v1.core.sched.scheduler")
    cls = sched.Scheduler
    name = next(n for n in ("_handle_blocked_waiting_request",
                            "_try_promote_blocked_waiting_request") if n in cls.__dict__)

    def make(orig):
        def promote(self, request, *args, **kw):
            if request.status == sched.RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(request.request_id)     # MUTANT
            return orig(self, request, *args, **kw)
        return promote
    return _patch(cls, name, make)


def no_alloc_track():
    """0.33.0's ``update_state_after_alloc`` records the blocks of every allocation, also one
    another connector serves (``num_external_tokens == 0``), so that ``build_connector_meta``
    flushes a pending store over them (the fix of vLLM #46951): reverted, it returns first."""
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def update_state_after_alloc(self, request, blocks, num_external_tokens, *a, **kw):
            if num_external_tokens == 0:
                return                                                       # MUTANT
            return orig(self, request, blocks, num_external_tokens, *a, **kw)
        return update_state_after_alloc
    return _patch(cls, "update_state_after_alloc", make)


# -- tiered offloading (TieringOffloadingSpec with an fs tier: simsched.vllm.inside.tiering) ----
def _rotate_chunks(job) -> None:
    """A tier job's chunk ids shifted by one (key i paired with key i + 1's slot)."""
    name = "chunk_ids" if hasattr(job, "chunk_ids") else "block_ids"    # 0.25.1: blocks
    ids = [int(c) for c in getattr(job, name)]
    if len(ids) > 1:
        import numpy as np
        setattr(job, name, np.array(ids[1:] + ids[:1], dtype=np.int64))


def early_ready():
    """``TieringOffloadingManager._flush_pending_promotions`` marks each promoted slot ready
    (``primary_tier.complete_write``) as it submits the read (0.30.0
    ``tiering/manager.py:470-493``): a load of the chunk reads the slot before the file's bytes
    land (seen with ``io_latency`` >= 2)."""
    import vllm.v1.kv_offload.tiering.manager as tm

    def make(orig):
        def _flush_pending_promotions(self):
            pending = [e for by_req in self._pending_load_submissions.values()
                       for e in by_req.values()]
            orig(self)
            for entry in pending:
                self.primary_tier.complete_write(entry.keys, entry.req_context, True)
        return _flush_pending_promotions
    return _patch(tm.TieringOffloadingManager, "_flush_pending_promotions", make)


def _fs_rotating(name: str):
    import vllm.v1.kv_offload.tiering.fs.manager as fsm

    def make(orig):
        def submit(self, job, *args, **kw):
            _rotate_chunks(job)
            return orig(self, job, *args, **kw)
        return submit
    return _patch(fsm.FileSystemTierManager, name, make)


def cascade_wrong_chunk():
    """``FileSystemTierManager.submit_store`` writes key i's file from key i + 1's CPU slot
    (0.30.0 ``fs/manager.py:217-230``)."""
    return _fs_rotating("submit_store")


def promote_wrong_slot():
    """``FileSystemTierManager.submit_load`` reads key i's file into the slot allocated for key
    i + 1 (0.30.0 ``fs/manager.py:232-269``)."""
    return _fs_rotating("submit_load")


# -- the simple_cpu connector path (SimpleCPUOffloadScheduler, vllm/v1/simple_kv_offload) -------
_SIMPLE = "vllm.v1.simple_kv_offload.manager"


def _simple():
    import importlib
    return importlib.import_module(_SIMPLE).SimpleCPUOffloadScheduler


def simple_cpu_reversed():
    """``build_connector_meta`` hands the worker the store event's CPU blocks in reverse order
    (0.30.0 ``manager.py:547``): GPU block i lands in another CPU block than the one the
    scheduler registers under i's hash."""
    def make(orig):
        def f(self, scheduler_output):
            meta = orig(self, scheduler_output)
            if len(meta.store_cpu_blocks) > 1:
                meta.store_cpu_blocks = list(reversed(meta.store_cpu_blocks))
            return meta
        return f
    return _patch(_simple(), "build_connector_meta", make)


def simple_hit_plus_block():
    """``get_num_new_matched_tokens`` claims one scheduler block more than the CPU pool
    matched (0.30.0 ``manager.py:373``), where the request has room for it: the claimed block
    is never loaded."""
    def make(orig):
        def f(self, request, num_computed_tokens):
            n, is_async = orig(self, request, num_computed_tokens)
            room = (request.num_tokens - 1 - num_computed_tokens) // self.block_size
            if n and n + self.block_size <= room * self.block_size:
                n += self.block_size
            return n, is_async
        return f
    return _patch(_simple(), "get_num_new_matched_tokens", make)


def simple_unpinned_load():
    """The CPU blocks a load reads are not pinned while it is in flight:
    ``update_state_after_alloc``'s touch (0.30.0 ``manager.py:473``) undone at once, and the
    matching free in ``_cleanup_load_request`` skipped: LRU eviction hands them to a store."""
    from dataclasses import replace
    cls = _simple()

    def make_alloc(orig):
        def f(self, request, blocks, num_external_tokens):
            orig(self, request, blocks, num_external_tokens)
            st = self._reqs_to_load.get(request.request_id)
            if st is not None and st.transfer_meta.cpu_block_ids:
                self.cpu_block_pool.free_blocks(
                    [self.cpu_block_pool.blocks[c] for c in st.transfer_meta.cpu_block_ids])
                st._mutant_unpinned = True
        return f

    def make_cleanup(orig):
        def f(self, req_id):
            st = self._reqs_to_load.get(req_id) or self._abandoned_reqs_to_load.get(req_id)
            if st is not None and getattr(st, "_mutant_unpinned", False):
                st.transfer_meta = replace(st.transfer_meta, cpu_block_ids=[])
            return orig(self, req_id)
        return f
    undo = [_patch(cls, "update_state_after_alloc", make_alloc),
            _patch(cls, "_cleanup_load_request", make_cleanup)]
    return lambda: [u() for u in reversed(undo)]


MUTANTS: dict[str, Callable[[], Callable[[], None]]] = {
    "store_shift_chunk": store_shift_chunk,
    "drop_fence": drop_fence,
    "load_reverse": load_reverse,
    "key_wrong_hash": key_wrong_hash,
    "store_key_late": store_key_late,
    "fence_skip_group": fence_skip_group,
    "max_offload_ignored": max_offload_ignored,
    "max_load_ignored": max_load_ignored,
    "load_into_pending_store": load_into_pending_store,
    "evict_in_use": evict_in_use,
    "lost_completion": lost_completion,
    "touch_double_ref": touch_double_ref,
    "lookup_first_chunk_only": lookup_first_chunk_only,
    "lookup_defer_forever": lookup_defer_forever,
    "lookup_refuse_window": lookup_refuse_window,
    "early_ready": early_ready,
    "cascade_wrong_chunk": cascade_wrong_chunk,
    "promote_wrong_slot": promote_wrong_slot,
    "recv_swallowed": recv_swallowed,
    "gate_open": gate_open,
    "no_alloc_track": no_alloc_track,
    "simple_cpu_reversed": simple_cpu_reversed,
    "simple_hit_plus_block": simple_hit_plus_block,
    "simple_unpinned_load": simple_unpinned_load,
}


def apply(name: str) -> Callable[[], None]:
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}")
    return MUTANTS[name]()
