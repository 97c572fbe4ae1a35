"""The ``SimpleCPUOffloadConnector``'s scheduler side: ``SimpleCPUOffloadScheduler``.

Mirrors ``vllm/v1/simple_kv_offload/manager.py`` of 0.30.0-0.33.0, the manager as 0.30.0
rewrote it (0.25.1-0.29.0's: :mod:`simsched.model.simple_cpu_scheduler_legacy`, a subclass that
keeps this one's CPU tier, events and jobs). The CPU tier is
a second block pool of the GPU pool's groups (``_derive_cpu_config``: ``cpu_chunks`` blocks,
block 0 its null block), looked up by the same coordinator rules as the GPU prefix cache, for
the suffix past the GPU hit (``get_num_new_matched_tokens``). One GPU block is one transfer.

* eager mode: each scheduled request's blocks are stored once their tokens are confirmed
  computed (a step after the one that computed them), cursor by cursor per group
  (``_prepare_eager_store_specs``); a finished request's last ones are queued for the next
  step (``request_finished_all_groups``);
* lazy mode: the GPU free queue is walked from a cursor and its hashed blocks the CPU pool
  lacks are stored before the allocator evicts them (``_prepare_lazy_store_specs``);
* a store pins its GPU blocks (``touch``) until its event completes; then the CPU blocks take
  the GPU blocks' hashes and both are freed (``_process_store_completion``);
* a load pins the CPU hit and the GPU destinations until it completes.

Per step there is one store event and one load event. The worker the harness plays cuts each
into one job per request (:mod:`simsched.vllm.inside.simple_cpu`): a store's blocks by the
request that first held their hash (``HashOwners``), a load's by its request; an event is
reported once all its jobs are done and every earlier one was (the worker's FIFO high-water
mark). Jobs are numbered stores first, then loads, in the step that issues them.

Size: the manager's own state and hooks, each beside the vLLM method it mirrors (the release's
module is 1,368 to 1,481 lines in 0.30.0-0.33.0), and the worker's cut of events into jobs,
which the trace names.

An align-mode Mamba group (eager mode) is not scanned by position: its states are stored as
the KV cache manager hands them over (``take_boundary_state_offloads``), in the step that
allocates them, before the step's positional picks (``_prepare_boundary_store_specs``).

Not modelled (``simsched.model.unmodelled_path``): Mamba groups under fine-grained hash hits
(the GPU side's producer partial-tail copy, on no path); the rules that only they reach are here
(the finish flush's partial tail, the lazy CPU coordinator without fine-grained hits).
"""

from __future__ import annotations

from simsched.geometry import (KV_CACHE_UTILS_PY, Geometry, GroupGeometry, effective_block_size,
                               resolve_block_sizes)
from simsched.model.block_pool import NULL, BlockPool
from simsched.model.kv_cache_manager import KVCacheManager
from simsched.model.offloading_common import Job
from simsched.model.offloading_scheduler import ModelCrash
from simsched.model.request import Request, key_group, key_ident, make_key
from simsched.model.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager, FullAttentionManager, MambaManager, SlidingWindowManager)
from simsched.profiles import ConfigError

MANAGER_PY = "v1/simple_kv_offload/manager.py"

#: the group kinds the model covers on this path
MODELLED_KINDS = ("full", "mla", "sliding_window", "sliding_window_mla", "chunked_local", "ring",
                  "mamba")


def block_geometry(layout, profile, asserts: bool = True) -> Geometry:
    """The geometry of this path: every group offloaded, one GPU block a transfer unit (a
    "chunk" of the shared trace and invariants is one block). The manager's start-up asserts
    (``SimpleCPUOffloadScheduler.__init__``, stripped under ``python -O``): a full-attention
    group exists, the scheduler block is a multiple of the hash unit and of that group's
    block (without one the manager reads the last group's, which only the partial-tail flush
    of fine-grained hits uses)."""
    scheduler_block_size, tokens_per_hash = resolve_block_sizes(layout, profile)
    # (under DCP an attention group's block spans dcp_size times its tokens)
    sizes = [effective_block_size(g, layout.engine.dcp_size) for g in layout.groups]
    groups = tuple(GroupGeometry(group_id=i, kind=g.kind, tokens_per_block=bs,
                                 tokens_per_chunk=bs, hashes_per_chunk=bs // tokens_per_hash,
                                 sliding_window_in_chunks=None, drafter=g.drafter)
                   for i, (g, bs) in enumerate(zip(layout.groups, sizes)))
    fa = [bs for g, bs in zip(layout.groups, sizes) if g.kind in ("full", "mla")]
    fa_block_size = fa[0] if fa else sizes[-1]
    if asserts and (not fa or scheduler_block_size % tokens_per_hash
                    or scheduler_block_size % fa_block_size):
        raise ConfigError("AssertionError", "__init__", MANAGER_PY, "__init__",
                          "no full-attention group, or a scheduler block not a multiple of "
                          "the hash unit and of the full-attention block")
    return Geometry(scheduler_block_size=scheduler_block_size, tokens_per_hash=tokens_per_hash,
                    blocks_per_chunk=1, alignment_tokens=None, groups=groups)


def config_outcome(layout, profile) -> dict:
    """The path's config outcome, in the worker's format: the engine's block sizes and the
    geometry above (``resolve_kv_cache_block_sizes``' error, if it refuses them). The manager's
    asserts are the model run's (``Model.__init__``), with the case's."""
    try:
        geometry = block_geometry(layout, profile, asserts=False)
    except ConfigError as e:
        return e.to_json()
    return {"status": "ok", "geometry": geometry.to_json()}


class CPUBlockContent:
    """What the worker last wrote into a CPU block (a completed store): a block's content as
    the content shadow reads it. A load reads it back (``Job.cpu_chunks``)."""

    __slots__ = ("content",)

    def __init__(self, content) -> None:
        self.content = content


class TransferMeta:
    """``TransferMeta``: GPU block ``gpu_block_ids[i]`` to or from CPU block
    ``cpu_block_ids[i]``."""

    __slots__ = ("gpu_block_ids", "cpu_block_ids")

    def __init__(self, gpu_block_ids: list[int], cpu_block_ids: list[int]) -> None:
        self.gpu_block_ids, self.cpu_block_ids = gpu_block_ids, cpu_block_ids


class LoadRequestState:
    """``LoadRequestState``: a request's load, its event once issued."""

    __slots__ = ("req", "transfer_meta", "load_event", "finished")

    def __init__(self, req: Request, transfer_meta: TransferMeta) -> None:
        self.req, self.transfer_meta = req, transfer_meta
        self.load_event: int | None = None
        self.finished = False


class StoreRequestState:
    """``StoreRequestState`` (eager mode): the request's block table as the scheduler output
    reported it, per group the blocks stored or skipped so far, its store events in flight."""

    __slots__ = ("req", "block_ids", "num_stored_blocks", "store_events", "finished")

    def __init__(self, req: Request, num_groups: int) -> None:
        self.req = req
        self.block_ids: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_stored_blocks = [0] * num_groups
        self.store_events: set[int] = set()
        self.finished = False


class HashOwners:
    """Which request a stored block's job names: the first request (in arrival order) whose
    block hashes held the block's hash, at the first step any did (the worker the harness plays
    cuts a store event by it)."""

    def __init__(self, tokens_per_hash: int) -> None:
        self.tokens_per_hash = tokens_per_hash
        self.requests: list[Request] = []
        self.known: dict[str, int] = {}             # rid -> its hashes registered so far
        self.owner: dict[int, tuple[str, int]] = {}  # prefix identity -> (rid, hash index)

    def update(self) -> None:
        tph = self.tokens_per_hash
        for req in self.requests:
            n = len(req.tokens) // tph
            for j in range(self.known.get(req.rid, 0), n):
                ident = req.ident_at((j + 1) * tph)
                if ident is not None:
                    self.owner.setdefault(ident, (req.rid, j))
            self.known[req.rid] = n


class SimpleCPUOffloadScheduler:
    """``SimpleCPUOffloadScheduler`` over the model's GPU KV cache manager ``gpu`` and a CPU
    coordinator ``cpu_coordinator`` of the same groups. ``prefix_cacheable``: per group, whether
    its spec is prefix-cacheable (a ring is not); ``prefix_cacheable_only``: only those groups
    are stored and counted by the lazy walk (0.31.0+), else every group.
    ``reset_at_preemption``: a preempted request's table and cursors are cleared when it is
    preempted (0.32.0+), not when it resumes (0.30.0-0.31.0); ``chunked_local_guard``: a lookup past a local prefix that is not a whole
    number of attention chunks finds nothing (0.33.0); ``eagle_cacheable_block``: eager stores
    reach as far as the coordinator caches, one block past the scheduler block boundary in an
    EAGLE group of several (``get_num_cacheable_tokens``, 0.32.0+), not to the boundary."""

    # the model calls update_state_after_alloc for every request it admits: eager mode
    # registers the request there
    alloc_all_groups = True
    # the engine steps on while stores are pending (has_pending_push_work, 0.30.0+)
    strands_at_idle = False
    # the CPU coordinator is built with allow_partial_hash_hits=not lazy_offload (mgr
    # 0.30.0:200): in lazy mode its lookups land on scheduler blocks only
    lazy_without_partial_hash_hits = True

    def __init__(self, geometry: Geometry, gpu: KVCacheManager, cpu_coordinator: KVCacheManager,
                 prefix_cacheable: list[bool], prefix_cacheable_only: bool, lazy_offload: bool,
                 max_num_batched_tokens: int, reset_at_preemption: bool,
                 chunked_local_guard: bool, eagle_cacheable_block: bool,
                 asserts: bool = True, cp_world_size: int = 1) -> None:
        self.block_size = geometry.scheduler_block_size
        self.hash_block_size = geometry.tokens_per_hash
        self.gpu, self.cpu_coordinator = gpu, cpu_coordinator
        self.gpu_block_pool: BlockPool = gpu.pool
        self.cpu_block_pool: BlockPool = cpu_coordinator.pool
        self.group_block_sizes = [m.block_size for m in gpu.managers]
        # the groups stored (prefix_cacheable_group_ids, 0.31.0+; every group before)
        self.stored_groups = [c or not prefix_cacheable_only for c in prefix_cacheable]
        # has_positionally_stable_blocks: an align-mode Mamba group nulls interior states and
        # moves its speculative blocks, so no positional scan follows its table; its states
        # reach the CPU pool as the KV cache manager hands them over (single_type_kv_cache_
        # manager.py 0.30.0:1444-1450; mgr 0.30.0:835)
        self.positional = [not (isinstance(m, MambaManager) and m.align) for m in gpu.managers]
        self.lazy_mode = lazy_offload
        self.reset_at_preemption = reset_at_preemption
        self.chunked_local_guard = chunked_local_guard
        self.eagle_cacheable_block = eagle_cacheable_block
        self.asserts = asserts                  # False: python -O strips vLLM's asserts
        self.cp_world_size = cp_world_size      # decode_context_parallel_size
        self.target_free = self._estimate_lazy_target_blocks(max_num_batched_tokens) \
            if lazy_offload else 0
        self.cursor = NULL                      # the lazy walk's last block (NULL: the head)
        self.pending_cpu_hits: dict[str, tuple[list[list[int]], int, int]] = {}
        self.reqs_to_load: dict[str, LoadRequestState] = {}
        self.reqs_to_store: dict[str, StoreRequestState] = {}
        self.store_event_to_blocks: dict[int, TransferMeta] = {}
        self.store_event_to_reqs: dict[int, list[str]] = {}
        self.in_flight_store_gpu_blocks: set[int] = set()
        self.pending_finished_stores: list[TransferMeta] = []
        self.load_event_counter = 0
        self.store_event_counter = 0
        # the worker's side (the harness plays it): the jobs in flight, the store events not
        # reported yet (FIFO) and each one's jobs not done, each store job's CPU blocks, what
        # each CPU block holds
        self.jobs: dict[int, Job] = {}
        self.next_jid = 0
        self.store_order: list[int] = []
        self.event_jobs: dict[int, set[int]] = {}
        self.job_event: dict[int, int] = {}
        self.job_slots: dict[int, list[int]] = {}
        self.cpu_contents: dict[int, CPUBlockContent] = {}
        self.owners = HashOwners(self.hash_block_size)
        # Request.num_output_placeholders under async scheduling (the model's AsyncRun sets it):
        # sampled tokens of batches in flight, not confirmed
        self.num_output_placeholders: dict[str, int] = {}
        self.scheduled_before: set[str] = set()  # scheduled in an earlier step
        self.resumed: set[str] = set()          # preempted, so resumed when scheduled again

    @property
    def fa_gidx(self) -> int:
        """``fa_gidx``: the first full-attention group (an MLA or drafter group is one; mgr
        0.30.0:170-175, 0.29.0:101-116); without one (asserts stripped) the index stays -1,
        the last group."""
        return next((g for g, m in enumerate(self.gpu.managers)
                     if isinstance(m, FullAttentionManager)), -1)

    def _estimate_lazy_target_blocks(self, max_num_batched_tokens: int) -> int:
        """GPU blocks the lazy walk keeps offloaded or free per step (``WATERMARK_RATIO`` 1)."""
        target = 0
        for m, stored in zip(self.gpu.managers, self.stored_groups):
            if not stored:
                continue
            if isinstance(m, MambaManager):
                target += 2                     # (mgr 0.30.0:307, 0.29.0:232)
            elif isinstance(m, SlidingWindowManager):
                target += -(-m.window // m.block_size) + 1
            else:
                target += -(-max_num_batched_tokens // m.block_size)
        return target * 2

    # --- requests -------------------------------------------------------------------------
    def on_new_request(self, req: Request) -> None:
        self.owners.requests.append(req)

    def get_num_new_matched_tokens(self, req: Request, num_computed: int) -> int:
        """Consecutive CPU hits past the ``num_computed`` local tokens, pinned until
        ``update_state_after_alloc`` takes them (a load, always asynchronous)."""
        stale = self.pending_cpu_hits.pop(req.rid, None)
        if stale is not None:
            self._free_pending_cpu_hit(stale)
        if self._declines_lookup(req, num_computed):
            return 0
        if len(req.tokens) // self.hash_block_size <= num_computed // self.hash_block_size:
            return 0                            # no block hash past the local prefix
        # the last token is recomputed (kv_cache_manager.get_computed_blocks)
        max_hit_len = req.num_tokens - 1 - num_computed
        if max_hit_len <= 0:
            return 0
        hit_blocks, hit_length = self._find_longest_cache_hit(req, num_computed, max_hit_len)
        if hit_length > 0:
            self.cpu_block_pool.touch([b for group in hit_blocks for b in group])
            self.pending_cpu_hits[req.rid] = (hit_blocks, hit_length, num_computed)
        return hit_length

    def _declines_lookup(self, req: Request, num_computed: int) -> bool:
        """No lookup for a request that skips reading the prefix cache, nor past a local prefix
        off the scheduler block (a transfer copies whole blocks; mgr 0.30.0:332-347), nor
        (0.33.0) past one that is not a whole number of attention chunks."""
        if req.skip_reading_prefix_cache or num_computed % self.block_size:
            return True
        return self.chunked_local_guard and any(
            isinstance(m, ChunkedLocalAttentionManager) and num_computed % m.chunk
            for m in self.gpu.managers)

    def _find_longest_cache_hit(self, req: Request, num_computed: int, max_hit_len: int
                                ) -> tuple[list[list[int]], int]:
        """``cpu_coordinator.find_longest_cache_hit(request.block_hashes[skipped:], ...)``: the
        lookup runs on the suffix, its positions counted from the local prefix's end; per group
        the hit's blocks, the null block where a window or chunk leaves them out."""
        def suffix_keys(gid: int, block_size: int) -> list:
            return req.keys(gid, block_size)[num_computed // block_size:]
        coordinator = self.cpu_coordinator
        if not coordinator.cacheable:           # no group is looked up: no hit
            return [[] for _ in coordinator.managers], 0
        hit_length = coordinator.find_longest_cache_hit(suffix_keys, max_hit_len)
        blocks: list[list[int]] = []
        for m in coordinator.managers:
            if not m.cacheable:
                blocks.append([])
                continue
            n = hit_length // m.block_size
            first = min(m.num_tokens_out_of_window(hit_length) // m.block_size, n)
            keys = suffix_keys(m.gid, m.block_size)
            blocks.append([NULL] * first + [coordinator.pool.get_cached_block(keys[j])
                                            for j in range(first, n)])
        return blocks, hit_length

    def _free_pending_cpu_hit(self, pending: tuple[list[list[int]], int, int]) -> None:
        self.cpu_block_pool.free_blocks([b for group in pending[0] for b in group])

    def _take_cpu_hit(self, req: Request, tables: list[list[int]], num_external: int):
        """``update_state_after_alloc``'s start, in every release: the request registered for
        eager stores, then its pending CPU hit taken (None: nothing to load; a hit the
        scheduler took no token of is released)."""
        if not self.lazy_mode and req.rid not in self.reqs_to_store:
            self.reqs_to_store[req.rid] = StoreRequestState(req, len(tables))
        pending = self.pending_cpu_hits.pop(req.rid, None)
        if pending is None:
            return None
        if num_external == 0:
            self._free_pending_cpu_hit(pending)
            return None
        return pending

    def update_state_after_alloc(self, req: Request, tables: list[list[int]],
                                 num_external: int, block_keys=None,
                                 scheduled: bool = True) -> Job | None:
        """Registers the request for eager stores; pairs the first ``num_external`` tokens'
        CPU hit blocks with the GPU blocks after the local prefix, pins both, and records the
        load (issued by the next ``build_connector_meta``). Returns no job: the load's job is
        made with the step's load event."""
        pending = self._take_cpu_hit(req, tables, num_external)
        if pending is None:
            return None
        hit_blocks, _, num_computed = pending
        gpu_block_ids: list[int] = []
        cpu_block_ids: list[int] = []
        for g, cpu_blocks in enumerate(hit_blocks):
            bs = self.group_block_sizes[g]
            start = num_computed // bs
            for i, c in enumerate(cpu_blocks[:-(-num_external // bs)]):
                if c != NULL:           # a window's or chunk's padding: nothing to load
                    gpu_block_ids.append(tables[g][start + i])
                    cpu_block_ids.append(c)
        self._record_load(req, pending, gpu_block_ids, cpu_block_ids)
        return None

    def _record_load(self, req: Request, pending: tuple[list[list[int]], int, int],
                     gpu_block_ids: list[int], cpu_block_ids: list[int]) -> None:
        """The load's CPU sources and GPU destinations pinned until it completes, the lookup's
        pin released, the load recorded for the next step's event."""
        self.cpu_block_pool.touch(cpu_block_ids)
        self._free_pending_cpu_hit(pending)
        self.gpu_block_pool.touch(gpu_block_ids)
        self.reqs_to_load[req.rid] = LoadRequestState(req, TransferMeta(gpu_block_ids,
                                                                        cpu_block_ids))

    # --- the step's events ----------------------------------------------------------------
    def build_connector_meta(self, scheduled: dict[str, int], new_blocks: dict[str, list],
                             preempted: list[str], finished: list[str], offers
                             ) -> tuple[list[Job], list[Job], set[int]]:
        """The step's store event (this step's picks, then the finished requests' queued
        blocks) and load event (every load not issued yet), each cut into jobs; on a
        preemption (``need_flush``) the worker finishes every store job in flight first."""
        self.owners.update()
        flush = {jid for event in self.store_order for jid in self.event_jobs[event]} \
            if preempted else set()
        gpu_ids, cpu_ids, req_ids = self.prepare_store_specs(scheduled, new_blocks, preempted,
                                                             finished, offers)
        for transfer in self.pending_finished_stores:
            gpu_ids += transfer.gpu_block_ids
            cpu_ids += transfer.cpu_block_ids
        self.pending_finished_stores.clear()
        stores: list[Job] = []
        if gpu_ids:
            event = self.store_event_counter
            self.store_event_counter += 1
            self.store_event_to_blocks[event] = TransferMeta(gpu_ids, cpu_ids)
            if req_ids:
                self.store_event_to_reqs[event] = req_ids
                for rid in req_ids:
                    self.reqs_to_store[rid].store_events.add(event)
            stores = self._store_jobs(event, gpu_ids, cpu_ids)
        return stores, self._load_jobs(), flush

    def prepare_store_specs(self, scheduled: dict[str, int], new_blocks: dict[str, list],
                            preempted: list[str], finished: list[str], offers
                            ) -> tuple[list[int], list[int], list[str]]:
        """The step's store picks; ``offers``: the Mamba boundary states the KV cache manager
        hands over this step (``KVCacheManager.take_offers``), which lazy mode leaves."""
        if self.lazy_mode:
            return self._prepare_lazy_store_specs()
        gpu_ids, cpu_ids, req_ids = self._prepare_boundary_store_specs(offers, preempted,
                                                                       finished)
        more = self._prepare_eager_store_specs(scheduled, new_blocks, preempted)
        # (a request with boundary and positional blocks is one ID: dict.fromkeys, 0.30.0:783)
        return gpu_ids + more[0], cpu_ids + more[1], list(dict.fromkeys(req_ids + more[2]))

    def _prepare_boundary_store_specs(self, offers, preempted: list[str], finished: list[str]
                                      ) -> tuple[list[int], list[int], list[str]]:
        """The boundary hand-offs (``_prepare_eager_store_specs``, mgr 0.30.0:657-720): per
        request in the order its first state was cached, each state block stored if it is
        ready (hashed, not in flight, not in the CPU pool) and the CPU pool has a free block
        (a hand-off declined is not retried). A request that finished or was preempted in
        this step, or is not registered, gives up its blocks: its hand-offs are dropped."""
        by_req: dict[str, list[int]] = {}
        for rid, _gid, b, _boundary in offers:
            by_req.setdefault(rid, []).append(b)
        num_free = self.cpu_block_pool.get_num_free_blocks()
        gpu_ids: list[int] = []
        req_ids: list[str] = []
        for rid, blocks in by_req.items():
            state = self.reqs_to_store.get(rid)
            if state is None or state.finished or rid in preempted or rid in finished:
                continue
            for b in blocks:
                # (_classify_store_candidate; a null block is not hashed either)
                if not self._ready_to_store(b) or num_free <= 0:
                    continue
                gpu_ids.append(b)
                self.in_flight_store_gpu_blocks.add(b)
                num_free -= 1
                if not req_ids or req_ids[-1] != rid:
                    req_ids.append(rid)
        cpu_ids = self.cpu_block_pool.get_new_blocks(len(gpu_ids))
        self.gpu_block_pool.touch(gpu_ids)
        return gpu_ids, cpu_ids, req_ids

    def _prepare_lazy_store_specs(self) -> tuple[list[int], list[int], list[str]]:
        """The walk of the GPU free queue from the cursor: up to ``target_free`` blocks, the
        hashed ones the CPU pool does not hold are stored (as many as it has free blocks)."""
        if self.target_free <= 0:
            return [], [], []
        gpu, cpu = self.gpu_block_pool, self.cpu_block_pool
        num_cpu_free = cpu.get_num_free_blocks()
        if self.cursor != NULL and gpu.ref[self.cursor] > 0:
            self.cursor = NULL                  # stale: taken out of the free queue
        next_free = gpu.free_block_queue.next_free
        gpu_ids: list[int] = []
        covered, b = 0, next_free[self.cursor]
        while b != NULL and covered < self.target_free and len(gpu_ids) < num_cpu_free:
            self.cursor = b
            key = gpu.key[b]
            if key is not None and cpu.holder(key) is None:
                gpu_ids.append(b)
            covered += 1
            b = next_free[b]
        if not gpu_ids:
            return [], [], []
        cpu_ids = cpu.get_new_blocks(len(gpu_ids))
        gpu.touch(gpu_ids)
        return gpu_ids, cpu_ids, []

    def _prepare_eager_store_specs(self, scheduled: dict[str, int],
                                   new_blocks: dict[str, list], preempted: list[str]
                                   ) -> tuple[list[int], list[int], list[str]]:
        """Per scheduled request (``yield_req_data``: the new ones, then the running and the
        resumed), its table grown by the step's new blocks and its confirmed blocks not stored
        yet; a preempted request starts over with its new table."""
        merged_gpu: list[int] = []
        merged_cpu: list[int] = []
        req_ids: list[str] = []
        for rid in preempted:
            self.resumed.add(rid)
            state = self.reqs_to_store.get(rid)
            if state is not None and self.reset_at_preemption:
                self._restart(state)
        for rid, full_table in self._yield_req_data(scheduled):
            state = self.reqs_to_store.get(rid)
            if state is None or state.finished:
                continue
            if full_table:
                # the full table replaces the stale one; 0.30.0-0.31.0 also start the cursors
                # over here, when the request resumes (0.32.0+: at its preemption, above)
                if self.reset_at_preemption:
                    state.block_ids = [[] for _ in state.block_ids]
                else:
                    self._restart(state)
            for table, new in zip(state.block_ids, new_blocks[rid]):
                table.extend(new)
            gpu_ids, advanced = self._select_eager_blocks_to_store(state, state.block_ids)
            if gpu_ids:
                cpu_ids = self.cpu_block_pool.get_new_blocks(len(gpu_ids))
                req_ids.append(rid)
                merged_gpu += gpu_ids
                merged_cpu += cpu_ids
                self.in_flight_store_gpu_blocks.update(gpu_ids)
                self.gpu_block_pool.touch(gpu_ids)
            for g, n in enumerate(advanced):
                state.num_stored_blocks[g] += n
        return merged_gpu, merged_cpu, req_ids

    def _restart(self, state: StoreRequestState) -> None:
        state.block_ids = [[] for _ in state.block_ids]
        state.num_stored_blocks = [0] * len(state.block_ids)

    def _yield_req_data(self, scheduled: dict[str, int]) -> list[tuple[str, bool]]:
        """``yield_req_data``'s order: the new requests (``scheduled_new_reqs``), then the
        cached ones, running before resumed; with whether the step reports the whole table."""
        new, running, resumed = [], [], []
        for rid in scheduled:
            if rid in self.resumed:
                resumed.append((rid, True))
            elif rid in self.scheduled_before:
                running.append((rid, False))
            else:
                new.append((rid, True))
                self.scheduled_before.add(rid)
        self.resumed.difference_update(rid for rid, _ in resumed)
        return new + running + resumed

    def _select_eager_blocks_to_store(self, state: StoreRequestState,
                                      block_ids_by_group: list[list[int]]
                                      ) -> tuple[list[int], list[int]]:
        """Per group, from its cursor to the last block of the confirmed tokens (those
        computed before this step, as far as the coordinator caches them), the blocks to
        store, as many as the CPU pool has free blocks; and how far each cursor moves. A
        windowed group's block the table already nulled is stored from the GPU prefix cache
        if it is still there; a block not hashed, in flight or already in the CPU pool is
        passed over."""
        req = state.req
        confirmed_tokens = req.num_computed - self.num_output_placeholders.get(req.rid, 0)
        num_free = self.cpu_block_pool.get_num_free_blocks()
        gpu_ids: list[int] = []
        advanced = [0] * len(block_ids_by_group)
        for g, group_ids in enumerate(block_ids_by_group):
            if not self.stored_groups[g] or not self.positional[g]:
                continue
            if len(gpu_ids) >= num_free:
                break
            bs = self.group_block_sizes[g]
            if self.asserts and bs != self.hash_block_size and bs % self.hash_block_size:
                # resolve_block_hashes: a group's hashes at its block size (0.30.0 stores a
                # ring too, whose block the hash unit of the other groups need not divide)
                raise ModelCrash("AssertionError", "resolve_block_hashes", "schedule",
                                 "assert block_size % hash_block_size == 0", KV_CACHE_UTILS_PY)
            keys = req.keys(g, bs)
            ready = min(len(group_ids), self._num_cacheable_tokens(confirmed_tokens, g) // bs)
            for i in range(state.num_stored_blocks[g], ready):
                b: int | None = group_ids[i]
                if b == NULL:
                    b = self.gpu_block_pool.holder(keys[i]) if i < len(keys) else None
                if b is None or not self._ready_to_store(b):
                    advanced[g] += 1
                    continue
                if len(gpu_ids) >= num_free:
                    break
                gpu_ids.append(b)
                advanced[g] += 1
        return gpu_ids, advanced

    def _num_cacheable_tokens(self, num_computed: int, g: int) -> int:
        """``cpu_coordinator.get_num_cacheable_tokens`` (0.32.0+; 0.30.0-0.31.0 floor to the
        scheduler block, as the coordinator does but for the EAGLE block)."""
        coordinator = self.cpu_coordinator
        aligned = coordinator.cacheable_tokens(num_computed)
        m = coordinator.managers[g]
        if (self.eagle_cacheable_block and len(coordinator.managers) > 1 and aligned > 0
                and m.use_eagle()):
            # an EAGLE group's lookup matches one block past the boundary, then drops it
            return min(num_computed, aligned + m.block_size)
        return aligned

    def _ready_to_store(self, b: int) -> bool:
        """``_classify_store_candidate`` is ``READY``: hashed, not in flight, not in the CPU
        pool."""
        key = self.gpu_block_pool.key[b]
        return (key is not None and b not in self.in_flight_store_gpu_blocks
                and self.cpu_block_pool.holder(key) is None)

    # --- the jobs the worker runs ---------------------------------------------------------
    def _new_job(self, rid: str, is_store: bool) -> Job:
        job = Job(self.next_jid, rid, is_store, [])
        self.next_jid += 1
        self.jobs[job.jid] = job
        return job

    def _store_jobs(self, event: int, gpu_ids: list[int], cpu_ids: list[int]) -> list[Job]:
        """The store event cut into one job per request: a block goes to the job of the
        request that first held its hash (``HashOwners``), in event order."""
        tph = self.hash_block_size
        parts: dict[str, Job] = {}
        for b, c in zip(gpu_ids, cpu_ids):
            key = self.gpu_block_pool.key[b]
            assert key is not None
            rid, hidx = self.owners.owner[key_ident(key)]
            job = parts.get(rid)
            if job is None:
                job = parts[rid] = self._new_job(rid, True)
                self.job_slots[job.jid] = []
            gid = key_group(key)
            i = ((hidx + 1) * tph - 1) // self.group_block_sizes[gid]
            job.add_chunk(gid, i, hidx, key, [(i, b)])
            self.job_slots[job.jid].append(c)
        jobs = list(parts.values())
        for job in jobs:
            job.keys = job.ckeys
            self.job_event[job.jid] = event
        self.event_jobs[event] = {job.jid for job in jobs}
        self.store_order.append(event)
        return jobs

    def _load_jobs(self) -> list[Job]:
        """The step's load event: every recorded load not issued yet, one job per request,
        each GPU block named by its position in the request's table."""
        tph = self.hash_block_size
        jobs: list[Job] = []
        for rid, state in self.reqs_to_load.items():
            if state.load_event is not None:
                continue
            state.load_event = self.load_event_counter
            req, job = state.req, self._new_job(rid, False)
            transfer = state.transfer_meta
            for b, c in zip(transfer.gpu_block_ids, transfer.cpu_block_ids):
                g = next(g for g, table in enumerate(req.tables) if b in table)
                i = req.tables[g].index(b)
                hidx = (i + 1) * self.group_block_sizes[g] // tph - 1
                job.add_chunk(g, i, hidx, req.keys(g, self.group_block_sizes[g])[i], [(i, b)])
            job.keys = job.ckeys
            job.cpu_chunks = [self.cpu_contents.get(c, CPUBlockContent(None))
                              for c in transfer.cpu_block_ids]
            jobs.append(job)
        if jobs:
            self.load_event_counter += 1
        return jobs

    def complete_job(self, jid: int) -> Job:
        """``update_connector_output`` for a job the worker finished: a load's request is
        reported (``finished_recving``) and its pins released; a store's CPU blocks hold what
        it read, and its event, once all its jobs and every earlier event are done, is
        reported (``completed_store_events``)."""
        job = self.jobs.pop(jid)
        job.done = True
        if not job.is_store:
            self._cleanup_load_request(job.rid)
            return job
        for c, content in zip(self.job_slots.pop(jid), job.contents):
            self.cpu_contents[c] = CPUBlockContent(content)
        self.event_jobs[self.job_event.pop(jid)].discard(jid)
        while self.store_order and not self.event_jobs[self.store_order[0]]:
            event = self.store_order.pop(0)
            del self.event_jobs[event]
            self._process_store_event(event)
        return job

    def _process_store_event(self, event: int) -> None:
        transfer = self.store_event_to_blocks.pop(event)
        if not self.lazy_mode:
            self.in_flight_store_gpu_blocks.difference_update(transfer.gpu_block_ids)
        self._process_store_completion(transfer)
        for rid in self.store_event_to_reqs.pop(event, []):
            state = self.reqs_to_store.get(rid)
            if state is None:
                continue
            state.store_events.discard(event)
            if state.finished and not state.store_events:
                self._cleanup_store_request(rid)

    def _process_store_completion(self, transfer: TransferMeta) -> None:
        """The CPU blocks take their GPU blocks' hashes (a lookup finds them from now on);
        both pins are released, the CPU blocks to the LRU end of their free queue."""
        for b, c in zip(transfer.gpu_block_ids, transfer.cpu_block_ids):
            key = self.gpu_block_pool.key[b]
            assert key is not None
            self.cpu_block_pool.cache(c, key)
        self.cpu_block_pool.free_blocks(transfer.cpu_block_ids)
        self.gpu_block_pool.free_blocks(transfer.gpu_block_ids)

    def _cleanup_load_request(self, rid: str) -> None:
        state = self.reqs_to_load.pop(rid, None)
        if state is not None:
            self.cpu_block_pool.free_blocks(state.transfer_meta.cpu_block_ids)
            self.gpu_block_pool.free_blocks(state.transfer_meta.gpu_block_ids)

    def _cleanup_store_request(self, rid: str) -> None:
        state = self.reqs_to_store.pop(rid, None)
        if state is None:
            return
        for event in state.store_events:
            reqs = self.store_event_to_reqs.get(event)
            if reqs is not None and rid in reqs:
                reqs.remove(rid)
                if not reqs:
                    del self.store_event_to_reqs[event]

    def partial_tail(self, gid: int, hidx: int) -> bool:
        """A stored block cached under a hash boundary inside it: a prompt's partial tail
        (``FullAttentionManager._cache_partial_tail_block``), which the lazy walk stores as it
        is. The model leaves what it holds to the real run's check (INV-4 by content, the
        harness's ``partial_tails``) and INV-3 to the whole blocks."""
        return (hidx + 1) * self.hash_block_size % self.group_block_sizes[gid] != 0

    def whole_blocks(self, job: Job) -> Job:
        """``job`` without its partial tails (:meth:`partial_tail`), for INV-3."""
        if not any(self.partial_tail(g, h) for g, h in zip(job.gids, job.hidx)):
            return job
        out = Job(job.jid, job.rid, job.is_store, job.keys)
        for gid, c, hidx, key, blocks in job.chunks():
            if not self.partial_tail(gid, hidx):
                out.add_chunk(gid, c, hidx, key, blocks)
        return out

    # --- a finished request ---------------------------------------------------------------
    def request_finished(self, req: Request) -> None:
        """``request_finished_all_groups`` with the blocks of the computed tokens: the blocks
        confirmed since the last store are queued for the next step's event; the CPU hit
        pinned for the request is released; a load or store in flight keeps its state until
        it completes."""
        block_ids = [table[:-(-req.num_computed // bs)]
                     for table, bs in zip(req.tables, self.group_block_sizes)]
        self._queue_finished_eager_store(req, block_ids)
        pending = self.pending_cpu_hits.pop(req.rid, None)
        if pending is not None:
            self._free_pending_cpu_hit(pending)
        load_state = self.reqs_to_load.get(req.rid)
        if load_state is not None:
            if load_state.load_event is not None:
                load_state.finished = True
            else:
                self._cleanup_load_request(req.rid)
        store_state = self.reqs_to_store.get(req.rid)
        if store_state is not None:
            if store_state.store_events:
                store_state.finished = True
            else:
                self._cleanup_store_request(req.rid)

    def _queue_finished_eager_store(self, req: Request, block_ids: list[list[int]]) -> None:
        state = self.reqs_to_store.get(req.rid)
        if state is None:
            return
        gpu_ids, _ = self._select_eager_blocks_to_store(state, block_ids)
        tail = self._find_fa_partial_tail_source(req, block_ids)
        # (decode tokens can fill the tail's block: the scan above picked it then)
        if (tail is not None and tail not in gpu_ids
                and len(gpu_ids) < self.cpu_block_pool.get_num_free_blocks()):
            gpu_ids.append(tail)
        if not gpu_ids:
            return
        cpu_ids = self.cpu_block_pool.get_new_blocks(len(gpu_ids))
        self.pending_finished_stores.append(TransferMeta(gpu_ids, cpu_ids))
        self.in_flight_store_gpu_blocks.update(gpu_ids)
        self.gpu_block_pool.touch(gpu_ids)

    def _find_fa_partial_tail_source(self, req: Request, block_ids: list[list[int]]
                                     ) -> int | None:
        """With fine-grained hits on the CPU coordinator, the full-attention block in which the
        prompt's last hash boundary falls, cached under that boundary's hash
        (``FullAttentionManager._cache_partial_tail_block``), if the CPU pool lacks it
        (mgr 0.30.0:1202-1248): no positional scan reaches a boundary inside a block."""
        if not self.cpu_coordinator.config.partial_hash_hits:
            return None
        tph = self.hash_block_size
        fa = self.fa_gidx
        fa_bs = self.group_block_sizes[fa]
        boundary = req.num_prompt // tph * tph
        if boundary == 0 or boundary > req.num_computed or boundary % fa_bs == 0:
            return None
        i = boundary // fa_bs
        if i >= len(block_ids[fa]):
            return None
        b = block_ids[fa][i]
        if b == NULL or b in self.in_flight_store_gpu_blocks:
            return None
        ident = req.ident_at(boundary)          # (None: the hash is not computed yet)
        key = make_key(fa, ident) if ident is not None else None
        if key is None or self.gpu_block_pool.key[b] != key:
            return None                         # (the block was promoted, or never cached)
        return None if self.cpu_block_pool.holder(key) is not None else b

    # --- the engine's questions -----------------------------------------------------------
    def has_pending_stores(self) -> bool:
        """The connector's keep-alive (``has_pending_push_work``): the engine steps on."""
        return bool(self.pending_finished_stores or self.store_event_to_blocks)

    def quiet(self) -> bool:
        return not self.jobs and not self.has_pending_stores()

    def held_gpu_blocks(self) -> list[int]:
        """The GPU blocks the connector pinned and has not released (INV-1 counts them held):
        the sources of store events in flight or queued, the destinations of loads."""
        metas = list(self.store_event_to_blocks.values()) + self.pending_finished_stores
        metas += [state.transfer_meta for state in self.reqs_to_load.values()]
        return [b for meta in metas for b in meta.gpu_block_ids]
