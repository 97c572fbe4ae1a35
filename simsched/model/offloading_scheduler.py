"""The offloading scheduler (``OffloadingConnectorScheduler``), simplified.

Mirrors ``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`` (0.29.0-0.33.0):
``RequestOffloadState`` (offload keys grown from block hashes, block IDs, next chunk to store),
``storable_chunks``, ``_build_store_jobs`` with its ``assert len(offload_keys) ==
len(offload_block_ids)``, ``get_num_new_matched_tokens`` / ``_lookup_complete_chunks``,
``update_state_after_alloc`` (load jobs), ``_update_req_states``, ``build_connector_meta`` (flush
of fenced blocks that get re-allocated), ``update_connector_output`` and ``request_finished``.
The CPU tier it stores to and loads from is :mod:`simsched.model.cpu_manager`.

An offload key is ``(group_id, block_hash)`` as in ``make_offload_key``, kept as one int
(``request.make_key``, taken apart by ``key_group`` / ``key_ident``); every key also has a
request-relative hash index (kept beside it) for traces. Where vLLM raises, the model raises
:class:`ModelCrash` (a :class:`~simsched.geometry.ConfigError`) naming the vLLM function.

Size: mirrors vLLM's ``offloading/scheduler.py`` (2,462 lines in 0.33.0) hook for hook: the
lookup (``get_num_new_matched_tokens``, ``_lookup_complete_chunks``), the loads
(``update_state_after_alloc``), the stores and their fences (``build_connector_meta``,
``_build_store_jobs``, ``_reachable_store_block_mask``), the completions and
``request_finished``. vLLM keeps the request state (``RequestOffloadState``,
``RequestGroupState``) and ``OffloadingConnectorScheduler`` in that one module in every release
from 0.25.1 to 0.33.0, and the hooks share the connector's tables of jobs, fences and request
states; the one piece vLLM keeps apart, the transfer job (``TransferJob``,
``offloading/common.py``), is apart here too: :mod:`simsched.model.offloading_common`.
"""

from __future__ import annotations

from typing import Any

from simsched.geometry import (Geometry, GroupGeometry, connector_window_tokens,
                               offload_key_indices)
from simsched.layout import SKIPPING_KINDS
from simsched.model.block_pool import NULL
from simsched.model.cpu_manager import (HIT_PENDING, MISS, RETRY, CPUOffloadingManager,
                                        RankedCPUManager)
from simsched.model.offloading_common import Job
from simsched.model.request import ABORTED, Key, Request, make_key
from simsched.model.single_type_kv_cache_manager import window_reachable_blocks
from simsched.model.tiering_manager import TieringOffloadingManager
from simsched.profiles import SCHEDULER_PY, ConfigError, Profile, retention_interval


class ModelCrash(ConfigError):
    """An exception the real scheduler raises at run time (stage = the vLLM function's role)."""

    def __init__(self, exception: str, function: str, stage: str, message: str,
                 file: str = SCHEDULER_PY):
        super().__init__(exception, function, file, stage, message)




class _SlidingWindowStoreMask:
    """``_reachable_store_block_mask`` for a sliding-window group (0.30.0-0.33.0), per chunk.

    The scheduler config's retention interval is ``CacheConfig.prefix_cache_retention_interval``
    (0 by default in these releases). Under an interval the reachable boundaries are
    ``(num_prompt - 1,)`` and the request's shared-prefix junction, and
    ``SlidingWindowManager.reachable_block_mask`` (``window_reachable_blocks``) keeps the
    ``need`` blocks ending at each aligned boundary (0) or also a tail once per interval-sized
    segment. A chunk is reachable when any of its blocks is. Under None (dense, the flag's
    ``None``) the tails are per alignment segment; the store horizon that then also keeps the
    tail of a request's final partial segment (``final_segment_end_block``,
    ``reconsider_final_swa_tail`` in ``_build_store_jobs``) is not modelled.
    """

    def __init__(self, cfg: GroupGeometry, window: int, geometry: Geometry,
                 retention: int | None):
        self.bpc: int = geometry.blocks_per_chunk
        self.align: int = geometry.alignment_tokens or 0      # (0: None, then dense)
        self.bs: int = cfg.tokens_per_block
        bs = self.bs
        eagle = cfg.drafter
        self.need: int = -(-(window - 1) // bs) + (1 if eagle else 0)
        self.shift: int = 1 if eagle else 0
        self.retention: int | None = retention
        # every block reachable (no alignment, a sub-block alignment, or a segment whose tail
        # is all of it)
        segment = self.align if retention is None else retention
        self.dense: bool = geometry.alignment_tokens is None or self.align % bs != 0 or (
            segment > 0 and self.need >= segment // bs)

    def reachable(self, start_chunk: int, end_chunk: int, num_prompt: int,
                  junction: int = 0) -> list[bool]:
        """Whether each chunk ``start_chunk..end_chunk-1`` is reachable."""
        bpc = self.bpc
        n = end_chunk - start_chunk
        mask = self.blocks(start_chunk, end_chunk, num_prompt, junction)
        if mask is None:
            return [True] * n
        if bpc == 1:
            return mask                 # a chunk is one block
        return [any(mask[c * bpc:(c + 1) * bpc]) for c in range(n)]

    def blocks(self, start_chunk: int, end_chunk: int, num_prompt: int,
               junction: int = 0) -> list[bool] | None:
        """The block mask of chunks ``start_chunk..end_chunk-1`` (None: every block
        reachable)."""
        if self.dense:
            return None
        # reachable boundaries: num_prompt - 1 and the request's shared_prefix_boundary
        bpc = self.bpc
        return window_reachable_blocks(
            start_chunk * bpc, end_chunk * bpc, self.align, self.bs, self.need, self.shift,
            self.retention, (num_prompt - 1, junction) if junction else (num_prompt - 1,))


class RequestGroupState:
    __slots__ = ("keys", "block_ids", "next_stored", "num_hit_chunks")

    def __init__(self) -> None:
        # offload keys (group_id, block hash): see make_key. Key m is made from the block hash
        # of index hpc * m + hpc - 1 (hpc: the group's hashes_per_chunk), shown in traces
        self.keys: list[Key] = []
        self.block_ids: list[int] = []
        self.next_stored = 0
        self.num_hit_chunks = 0


class RequestOffloadState:
    __slots__ = ("req", "groups", "jobs", "max_offload_tokens", "max_load_tokens", "num_local",
                 "finished_signaled", "next_key_at")

    def __init__(self, req: Request, n: int):
        self.req = req
        self.groups = [RequestGroupState() for _ in range(n)]
        self.jobs: set[int] = set()
        spec = req.spec
        self.max_offload_tokens = spec.max_offload_tokens if spec is not None else None
        self.max_load_tokens = spec.max_load_tokens if spec is not None else None
        self.num_local = 0
        self.finished_signaled = False
        self.next_key_at = 0       # num_tokens below which update_offload_keys adds no key


class OffloadingConnectorScheduler:
    def __init__(self, geometry: Geometry, profile: Profile, asserts: bool, cpu_chunks: int,
                 enable_prefix_caching: bool = True, layout=None,
                 observed_walks: dict[int, list] | None = None):
        self.geo, self.profile, self.asserts = geometry, profile, asserts
        # job ID -> the order a release's run walked the job's key set in, where the run is
        # compared with one (cpu_manager.walk_order: vLLM leaves that order unspecified)
        self.observed_walks: dict[int, list] = observed_walks or {}
        self.cfgs = geometry.groups
        self.n = len(self.cfgs)
        self.bpc = geometry.blocks_per_chunk
        self.tph = geometry.tokens_per_hash
        # the CPU tier's LRUCachePolicy: up to 0.30.0 an evictable list; from 0.31.0 recency ranks,
        # by request and token position from 0.33.0 (profile.extra["cpu_lru"]). A case's
        # engine.eviction_policy "arc" is not modelled (simsched.model.unmodelled_knobs)
        lru = profile.extra.get("cpu_lru", "list")
        self.tier: CPUOffloadingManager | TieringOffloadingManager
        if lru == "list":
            self.tier = CPUOffloadingManager(cpu_chunks, asserts)
        else:
            self.tier = RankedCPUManager(cpu_chunks, lru == "request-ranks", self.cfgs, asserts)
        # engine.secondary_tiers: the CPU tier as the primary of a TieringOffloadingManager
        self.tiering: TieringOffloadingManager | None = None
        if layout is not None and layout.engine.secondary_tiers:
            self.tiering = TieringOffloadingManager(
                self.tier, [t.io_latency for t in layout.engine.secondary_tiers],
                bool(profile.extra.get("tier_schedule_end_last", False)),
                bool(profile.extra.get("tier_promotion_retry", False)))
            self.tier = self.tiering
        self.req_status: dict[str, RequestOffloadState] = {}
        self.jobs: dict[int, Job] = {}
        self.job_counter = 0
        # _block_id_to_pending_jobs: block ID -> the IDs of the pending jobs that read it
        self.block_to_jobs: dict[int, set[int]] = {}
        self.batch_loads: list[Job] = []
        self.batch_flush: set[int] = set()
        # _current_batch_allocated_block_ids: the blocks update_state_after_alloc and
        # build_connector_meta mark in ``alloc_mark`` (block ID -> the number of the batch that
        # last allocated it; no set of every new block, rebuilt each step; ``alloc_marked``: any
        # block marked in this batch), or, without a layout to size it, a set: see _allocated_now
        self.batch_allocated: set[int] = set()
        self.alloc_mark: list | None = (
            [0] * layout.engine.num_gpu_blocks if layout is not None else None)
        self.alloc_batch = 1
        self.alloc_marked = False
        # the request states (by request ID) whose sliding-window groups hold blocks that
        # build_connector_meta's nulling of re-allocated blocks may still change (the others'
        # are empty, or all stored or never read): a state joins when given new blocks, while in
        # req_status, and leaves when the nulling finds none of its blocks to visit (it joins
        # again with its next new blocks; next_stored goes back only at an admission, which
        # clears the blocks: get_num_new_matched_tokens)
        self.sw_held: dict[str, RequestOffloadState] = {}
        self.being_loaded: set | None = set() if enable_prefix_caching else None
        full = [i for i, g in enumerate(self.cfgs) if g.sliding_window_in_chunks is None]
        sw = sorted((i for i, g in enumerate(self.cfgs) if g.sliding_window_in_chunks is not None),
                    key=lambda i: self.cfgs[i].sliding_window_in_chunks,  # type: ignore
                    reverse=True)
        self.sw_groups = tuple(sw)
        # their group ids: a store job fences their blocks at once, the others' deferred
        self.sw_gids: frozenset = frozenset(self.cfgs[i].group_id for i in sw)
        self.lookup_groups = tuple(full) + self.sw_groups
        self.mamba_align = None
        # GroupOffloadConfig.requires_cow_source: align-mode Mamba groups, stored only through
        # the boundary states the KV cache manager hands over (_build_boundary_store_jobs)
        self.cow_groups: frozenset = frozenset()
        # (0.29.0+; before, profile.extra["mamba_boundary_stores"] False, a Mamba group is stored
        # chunk by chunk like the other groups and the boundary states are not handed over).
        # Only align-mode Mamba groups hand states over: the profile is asked only then.
        self.boundary_stores: bool = (layout is None or any(
            g.kind == "mamba" and g.mamba_cache_mode == "align" for g in layout.groups)) \
            and profile.extra.get("mamba_boundary_stores", True)
        if layout is not None:
            for g in self.cfgs:
                grp = layout.groups[g.group_id]
                if grp.kind == "mamba" and grp.mamba_cache_mode == "align":
                    self.mamba_align = g.tokens_per_chunk
                    if self.boundary_stores:
                        self.cow_groups |= {g.group_id}
        self.supports_max_load = profile.extra.get("max_load_tokens", False)
        # RequestOffloadState.storable_chunks clamps to the keyed chunks (0.30.0+)
        self.keyed_chunk_clamp = profile.keyed_chunk_clamp
        self.finish_clamp = profile.extra.get("finish_store_clamp", profile.keyed_chunk_clamp)
        # 0.25.1: an EAGLE group's trailing chunk of each store is skipped for good (asked of
        # the profile only for a layout with a drafter group)
        self.eagle_tail_hole: bool = any(cfg.drafter for cfg in self.cfgs) and bool(
            profile.extra.get("eagle_tail_hole", False))
        self.observer = None     # set by the model: gets (event, payload) callbacks
        self.prompt_only = layout.engine.offload_prompt_only if layout is not None else True
        # 0.30.0+ (the releases with retention plumbing, ``profile.retention_check``): a sliding
        # window group stores only the chunks that SlidingWindowManager.reachable_block_mask
        # says a later lookup can reach
        self.sw_store_mask: dict = {}
        # 0.30.0+ (same marker): sliding-window lookups use load_window_size_in_chunks and a miss
        # clears a pending chunk (_sliding_window_lookup); window sizes of SlidingWindowSpec groups
        self.window_v2 = profile.retention_check
        # 0.25.1-0.29.0: only a sliding-window EAGLE group looks up the chunk it pops
        self.eagle_extra_windows_only: bool = bool(
            profile.extra.get("eagle_extra_chunk_windows_only", False))
        # 0.33.0's get_num_new_matched_tokens sets every group's next_stored_chunk_idx back to 0
        self.restart_store_idx = profile.extra.get("restart_store_idx", False)
        # 0.33.0's _build_store_jobs skips a chunk with a reachable null block, not only one
        # whose last block is null ("A reachable null block would leave part of the chunk
        # unwritten"). Only the managers that skip blocks (sliding window, chunked local, Mamba)
        # put null blocks in a table: the profile is asked only for a layout with one
        self.skip_null_chunks: bool = layout is not None and any(
            g.kind in SKIPPING_KINDS for g in layout.groups) and bool(
            profile.extra.get("store_skip_null_chunks", False))
        # 0.33.0's update_state_after_alloc records every block of an admitted request, in every
        # group (also groups not offloaded, GPU hits included) as allocated in this batch, with or
        # without a load: a pending store fencing one of them is flushed
        self.alloc_all_groups = profile.extra.get("alloc_all_groups", False)
        # the KV cache groups not offloaded (None: the layout is not known), see
        # update_state_after_alloc
        self.other_gids: tuple | None = None if layout is None else tuple(
            sorted(set(range(len(layout.groups))) - {g.group_id for g in self.cfgs}))
        # 0.31.0+: the windows of lookups and store masks reach the retained tokens too
        # (a spec of sliding_window + extra_retained_tokens in _reachable_store_block_mask)
        self.sw_tokens = {g.group_id: connector_window_tokens(layout.groups[g.group_id],
                                                              profile)
                          for g in self.cfgs if layout is not None and
                          layout.groups[g.group_id].kind in ("sliding_window",
                                                              "sliding_window_mla")}
        if layout is not None and self.sw_tokens and profile.retention_check:
            retention = retention_interval(layout, profile)
            for g in self.cfgs:
                grp = layout.groups[g.group_id]
                if grp.kind in ("sliding_window", "sliding_window_mla"):
                    self.sw_store_mask[g.group_id] = _SlidingWindowStoreMask(
                        g, self.sw_tokens[g.group_id], geometry, retention)

    # --- RequestOffloadState ----------------------------------------------------------------
    def update_offload_keys(self, st: RequestOffloadState, caller: str = "") -> None:
        if len(st.req.tokens) < st.next_key_at:
            return                             # fast path: no group gets a new key
        try:
            self._update_offload_keys(st)
        except ConfigError as e:
            e.caller = caller  # type: ignore[attr-defined]
            raise

    def _update_offload_keys(self, st: RequestOffloadState) -> None:
        req, profile = st.req, self.profile
        tph = self.tph
        num_hashes = req.num_tokens // tph
        for cfg, gs in zip(self.cfgs, st.groups):
            hpc = cfg.hashes_per_chunk
            if hpc > 0 and (len(gs.keys) + 1) * hpc > num_hashes:
                continue                       # no hash completes a new chunk yet
            m = len(gs.keys)
            # the hash indices of the new keys (islice's ValueError where hpc is 0, unless the
            # group of no hashes is skipped: no key); key m (hash index hpc * m + hpc - 1)
            # names the tokens [0, (m + 1) * hpc * tph), from the request's shared key list
            n_new = len(offload_key_indices(cfg, num_hashes, m, profile))
            if n_new:
                gs.keys.extend(req.keys(cfg.group_id, hpc * tph)[m:m + n_new])
        # every group keyed so far: the next key comes at (len(keys) + 1) * hpc hashes
        nxt = None
        for cfg, gs in zip(self.cfgs, st.groups):
            hpc = cfg.hashes_per_chunk
            if hpc <= 0:
                nxt = 0
                break
            at = (len(gs.keys) + 1) * hpc * tph
            if nxt is None or at < nxt:
                nxt = at
        st.next_key_at = nxt or 0

    def storable_chunks(self, st: RequestOffloadState, cfg: GroupGeometry, gs: RequestGroupState,
                        num_tokens: int, collect: bool = True) -> int:
        """Never more than ``num_tokens // tokens_per_chunk`` (``_store_job``'s quick exit relies
        on it). ``collect``: the chunks whose keys a store job collects, else the chunk
        ``next_stored`` advances to (the same but under ``eagle_tail_hole``)."""
        n = num_tokens // cfg.tokens_per_chunk
        if self.eagle_tail_hole:
            # 0.25.1's _build_store_jobs: an EAGLE group's keys stop one chunk short, prefill
            # or decode, but advance_stored_idx and the store walk set next_stored_block_idx to
            # num_offloadable_tokens // offloaded_block_size: that chunk is never stored (the
            # "permanent hole" 0.26.0's RequestOffloadState.storable_chunks fixes)
            if cfg.drafter and collect:
                n = max(0, n - 1)
        elif cfg.drafter and num_tokens > st.req.num_prompt and not (
                self.keyed_chunk_clamp and st.req.finished):
            n = max(0, n - 1)
        n = min(n, len(gs.block_ids) // self.bpc)
        if self.keyed_chunk_clamp:
            n = min(n, len(gs.keys))
        return n

    def advance_stored_idx(self, st: RequestOffloadState, num_tokens: int, ns=None) -> None:
        """``ns``: ``storable_chunks(..., num_tokens)`` per group when the caller has them."""
        if ns is None:
            ns = [self.storable_chunks(st, cfg, gs, num_tokens, False)
                  for cfg, gs in zip(self.cfgs, st.groups)]
        for gs, n in zip(st.groups, ns):
            if n > gs.next_stored:
                gs.next_stored = n

    # --- scheduler-facing API ---------------------------------------------------------------
    def on_new_request(self, req: Request) -> None:
        st = RequestOffloadState(req, self.n)
        req.off = st
        self.req_status[req.rid] = st
        if self.tiering is not None:
            self.tiering.on_new_request(st)

    def get_num_new_matched_tokens(self, req: Request, num_computed: int) -> int | None:
        st = self.req_status[req.rid]
        restart = self.restart_store_idx
        for gs in st.groups:
            if gs.block_ids:
                gs.block_ids.clear()
            if restart:     # 0.33.0: "Restarting at token 0: offer every chunk again."
                gs.next_stored = 0
        if st.jobs:
            return None
        self.update_offload_keys(st, "get_num_new_matched_tokens")
        st.num_local = num_computed
        # a request that skips reading the prefix cache looks nothing up, and is still touched
        hit = 0 if req.skip_reading_prefix_cache else self._lookup_complete_chunks(st)
        if hit and self.being_loaded and self._hits_being_loaded(st, hit):
            hit = None
        for cfg, gs in zip(self.cfgs, st.groups):
            gs.num_hit_chunks = (num_computed + (hit or 0)) // cfg.tokens_per_chunk
        self._touch(st)
        if self.tiering is not None and hit is not None:
            self.tiering.lookup_answered(req.rid)
        return hit

    def _touch(self, st: RequestOffloadState) -> None:
        """``manager.touch`` of the request's keys after a lookup (0.25.1-0.30.0: the evictable
        list moves the touched chunks to its MRU end; a sliding-window group touches only the
        chunks from its window on). The tiers that rank chunks (0.31.0+) ignore touches."""
        tier = self.tier
        if not tier.touches:
            return
        for cfg, gs in zip(self.cfgs, st.groups):
            w = cfg.sliding_window_in_chunks
            keys = gs.keys
            tier.touch_range(keys, 0 if w is None else max(0, gs.num_hit_chunks - w), len(keys))

    def _load_window(self, cfg: GroupGeometry, num_tokens: int) -> int:
        """``GroupOffloadConfig.load_window_size_in_chunks``: a SlidingWindowSpec group's window in
        chunks grows to cover a partial rightmost chunk (``-num_tokens % tokens_per_chunk``)."""
        w: Any = cfg.sliding_window_in_chunks
        wt: int | None = self.sw_tokens.get(cfg.group_id)
        if wt is None:
            return w
        win: int = wt
        tpc = cfg.tokens_per_chunk
        n = -(-(win - 1 + (-num_tokens % tpc)) // tpc)
        wi: int = w
        return wi if wi >= n else n

    def _lookup_complete_chunks(self, st: RequestOffloadState) -> int | None:
        """``_lookup_complete_chunks`` without deferred backends and EAGLE pops, but for its
        ``being_loaded`` check (``_hits_being_loaded``)."""
        req, tier = st.req, self.tier
        num_computed = st.num_local
        max_hit = req.num_tokens
        if self.supports_max_load and st.max_load_tokens is not None:
            max_hit = min(max_hit, num_computed + st.max_load_tokens)
        if self.sw_groups:
            max_hit -= 1
            if self.mamba_align is not None:
                max_hit = max_hit // self.mamba_align * self.mamba_align
        num_hit = 0
        defer = False
        lookup_groups = self.lookup_groups
        # EAGLE drafter groups (is_eagle_group): each looks up one chunk more and pops it (its
        # trailing chunk is volatile), once per convergence pass; the pass restarts the pops when
        # a target group tightens the hit. ``eagle_verified``: the set of the groups popped in
        # this pass, as a bit mask (bit gi; no set made per lookup)
        eagle_verified = 0
        while lookup_groups:
            looked_up_sw = False
            groups, lookup_groups = lookup_groups, ()
            for gi in groups:
                cfg, gs = self.cfgs[gi], st.groups[gi]
                tpc = cfg.tokens_per_chunk
                keys = gs.keys
                eagle = cfg.drafter and not (eagle_verified >> gi) & 1
                if self.asserts and len(keys) < req.num_tokens // tpc:
                    raise ModelCrash("AssertionError", "_lookup_complete_chunks", "lookup",
                                     "assert len(offload_keys) >= "
                                     "req_status.req.num_tokens // tokens_per_chunk")
                max_hit = min(max_hit, len(keys) * tpc)
                if self.supports_max_load and st.max_load_tokens is not None:
                    max_hit = max_hit // tpc * tpc
                if max_hit - num_computed < tpc:
                    return 0
                w = cfg.sliding_window_in_chunks
                # the chunk an EAGLE group will pop is looked up past the hit
                extra = eagle and (w is not None or not self.eagle_extra_windows_only)
                query_max = min(max_hit + tpc, len(keys) * tpc) if extra else max_hit
                num_chunks = min(-(-query_max // tpc), len(keys))
                start = num_computed // tpc
                # n_hit: the group's hit in chunks from ``start``; -1: deferred (not None: a native
                # int). ``retry``: a secondary tier has not answered for a key of the group: no
                # hit, and the scan goes on so that the tiers probe every key up to a miss
                retry = False
                if w is None:
                    hits, pending = 0, False
                    for j in range(start, num_chunks):         # (keys[start:num_chunks])
                        result = tier.lookup(keys[j], st)
                        if result == MISS:
                            break
                        if result == RETRY:
                            retry = True
                            continue
                        if result == HIT_PENDING:
                            pending = True
                        hits += 1
                    n_hit = -1 if pending or retry else hits
                else:
                    sub = keys[start:num_chunks]
                    # _sliding_window_lookup: from the end, the first run of ``need`` consecutive
                    # hits (a pending chunk counts, but defers the lookup); 0.30.0+: a miss clears
                    # a pending chunk to its right, and the first run needs the load window
                    # (GroupOffloadConfig.load_window_size_in_chunks of the candidate end)
                    v2 = self.window_v2
                    need = (self._load_window(cfg, min(max_hit, (num_chunks - eagle) * tpc))
                            if v2 else w) + eagle
                    w_req = w + eagle
                    consecutive, found, pending = 0, False, False
                    for idx in range(len(sub) - 1, -1, -1):
                        result = tier.lookup(sub[idx], st)
                        if result == MISS or result == RETRY:
                            consecutive = 0
                            if v2:
                                pending, need = False, w_req
                            if result == RETRY:
                                retry = True
                        else:
                            if result == HIT_PENDING:
                                pending = True
                            consecutive += 1
                        if consecutive == need:
                            n_hit, found = idx + need, True
                            break
                    if not found:
                        n_hit = consecutive
                    if pending or retry:
                        n_hit = -1
                if n_hit == 0:
                    return 0
                if n_hit < 0:
                    defer = True
                else:
                    if eagle:
                        n_hit -= 1
                        eagle_verified |= 1 << gi
                    max_hit = min(max_hit, tpc * (start + n_hit))
                new_hit = max_hit - num_computed
                if new_hit < tpc:
                    return 0
                if new_hit < num_hit:
                    if not cfg.drafter:
                        eagle_verified = 0
                    if defer:
                        defer = False
                        lookup_groups = self.lookup_groups
                    elif looked_up_sw and not lookup_groups:
                        lookup_groups = self.sw_groups
                if w is not None:
                    looked_up_sw = True
                num_hit = new_hit
        if defer:
            return None
        return num_hit

    def _hits_being_loaded(self, st: RequestOffloadState, num_hit: int) -> bool:
        """The end of ``_lookup_complete_chunks``: a hit of ``num_hit`` tokens some of whose
        chunks (in a sliding-window group, of its load window) are being loaded is deferred."""
        bl = self.being_loaded
        assert bl is not None
        num_computed = st.num_local
        for cfg, gs in zip(self.cfgs, st.groups):
            tpc = cfg.tokens_per_chunk
            gkeys = gs.keys
            lo, hi = num_computed // tpc, -(-(num_computed + num_hit) // tpc)
            if cfg.sliding_window_in_chunks is not None:
                sub = gkeys[lo:hi]
                sub = sub[-(self._load_window(cfg, num_computed + num_hit)
                            if self.window_v2 else cfg.sliding_window_in_chunks):]
                if not bl.isdisjoint(sub):
                    return True
                continue
            # (gkeys[lo:hi] and bl disjoint, without the slice)
            x = lo
            end = len(gkeys) if hi > len(gkeys) else hi
            while x < end:
                if gkeys[x] in bl:
                    return True
                x += 1
        return False

    def update_state_after_alloc(self, req: Request, tables: list[list[int]], num_external: int,
                                 block_keys: list | None, scheduled: bool = True) -> Job | None:
        """A load job for ``num_external`` tokens beyond the GPU hit; ``tables`` are the request's
        block tables (every KV cache group), ``block_keys[block]`` is the block hash a block
        carries (its GPU prefix-cache key, ``BlockPool.key``: a GPU prefix hit), None if none
        (``is_cached``). Without a load the request is scheduled in this step, unless another
        connector loads it (``scheduled`` False: a ``MultiConnector``'s NIXL pull)."""
        marked: list[list[int]]         # the tables whose blocks this batch allocated
        if self.alloc_all_groups:
            # a request scheduled in this step: its new blocks are its whole tables, which
            # build_connector_meta (_update_req_states) marks for the offloaded groups before any
            # use of them; the other groups' blocks are marked here
            marked = ([tables[gid] for gid in self.other_gids]
                      if num_external == 0 and scheduled and self.other_gids is not None
                      else tables)
        elif num_external:
            # up to 0.32.0 a load's offloaded groups, every block of their tables
            marked = [tables[cfg.group_id] for cfg in self.cfgs]
        else:
            return None
        if self.alloc_mark is not None:
            mark: list = self.alloc_mark        # (typed list, not Optional: native item stores)
            batch: object = self.alloc_batch    # (one int object, stored in every mark)
            for table in marked:
                for blk in table:
                    if blk != NULL:             # null placeholders are not allocations
                        mark[blk] = batch
                        self.alloc_marked = True
        else:
            # (NULL is never in batch_allocated outside these updates: adding the tables whole
            # and dropping NULL after is the same set)
            alloc = self.batch_allocated
            for table in marked:
                alloc.update(table)
            alloc.discard(NULL)
        if num_external == 0:
            return None
        st = self.req_status[req.rid]
        num_cached = st.num_local + num_external
        job = Job(-1, req.rid, False, None)     # (its ID is given by _new_job, at the end)
        assert block_keys is not None           # (num_external > 0: given)
        for cfg, gs in zip(self.cfgs, st.groups):
            blocks = tables[cfg.group_id]
            n_gpu = -(-num_cached // cfg.tokens_per_block)
            # the group's blocks from its first one that holds no GPU prefix hit
            n_local = next((i for i in range(n_gpu)
                            if blocks[i] != NULL and block_keys[blocks[i]] is None), n_gpu)
            if n_local < n_gpu:
                start, end = n_local // self.bpc, -(-num_cached // cfg.tokens_per_chunk)
                if self.asserts and len(gs.keys) < end:
                    raise ModelCrash("AssertionError", "update_state_after_alloc", "load",
                                     "assert len(offload_keys) >= end_chunk_idx")
                hpc = cfg.hashes_per_chunk
                for c in range(start, min(end, len(gs.keys))):
                    # chunk c loads its blocks from the first not hit to the hit's end
                    lo, hi = max(c * self.bpc, n_local), min((c + 1) * self.bpc, n_gpu)
                    job.add_chunk(cfg.group_id, c, hpc * c + hpc - 1, gs.keys[c],
                                  [(i, blocks[i]) for i in range(lo, hi)])
            gs.next_stored = -(-num_cached // cfg.tokens_per_chunk)      # BLOCK_LEVEL policy
        keys = job.ckeys
        # the chunks not ready to read (their stores in flight): INV-7 names them
        job.unready = [x for x, k in enumerate(keys) if not self.tier.is_ready(k)]
        job.cpu_chunks = self.tier.prepare_load(keys, st)
        # (the evictable list's complete_load walks the keys as their set, walk_order, itself:
        # when that order is needed)
        job.keys = keys
        self._new_job(job)
        if self.asserts and st.jobs:
            raise ModelCrash("AssertionError", "update_state_after_alloc", "load",
                             "assert not req_status.transfer_jobs")
        st.jobs.add(job.jid)
        self.batch_loads.append(job)
        if self.being_loaded is not None:
            self.being_loaded.update(keys)
        return job

    def _new_job(self, job: Job) -> Job:
        """Give ``job`` the next job ID and register it."""
        job.jid = self.job_counter
        self.job_counter += 1
        self.jobs[job.jid] = job
        return job

    def build_connector_meta(self, scheduled: dict[str, int], new_blocks: dict[str, list],
                             preempted: list[str], finished: list[str], offers=()):
        """``build_connector_meta``: returns (store jobs, load jobs, job IDs to flush).
        ``offers``: the step's Mamba boundary states (``KVCacheManager.take_offers``)."""
        # _update_req_states: the new blocks are marked allocated first, the blocks held before
        # them nulled where re-allocated, then the new ones appended (which are not nulled; only
        # the sliding-window groups' blocks are nulled: the other groups' are appended at once)
        sw_groups, cfgs = self.sw_groups, self.cfgs
        rs, held = self.req_status, self.sw_held
        alloc = self.batch_allocated
        mark = self.alloc_mark
        batch: object = self.alloc_batch       # (one int object, stored in every mark)
        marked = self.alloc_marked              # any block marked allocated in this batch
        grown: list = []        # the states given new blocks and their blocks, in pairs (sw)
        sts: list[RequestOffloadState] = []   # the scheduled requests' states, in order (stores)
        for rid in scheduled:
            st = rs[rid]
            sts.append(st)
            self.update_offload_keys(st, "build_connector_meta")
            nb = new_blocks.get(rid)
            if not nb:
                continue
            for blocks in nb:
                if blocks:
                    break
            else:
                continue        # all groups empty: nothing to mark or extend
            if sw_groups:
                held[rid] = st
                grown.append(st)
                grown.append(nb)
            for cfg, gs in zip(cfgs, st.groups):
                new: list[int] = nb[cfg.group_id]
                if cfg.sliding_window_in_chunks is None:
                    gs.block_ids.extend(new)    # the request's new blocks, in table order
                if mark is None:
                    alloc.update(new)
                    continue
                for blk in new:
                    if blk != NULL:    # null placeholders are not allocations
                        mark[blk] = batch
                        marked = True
        alloc.discard(NULL)      # null placeholders are not allocations
        if sw_groups and (alloc or marked):
            bpc = self.bpc
            prompt_only = self.prompt_only
            # every state in req_status, but those whose windows hold no block to visit (not in
            # held; a state with none left leaves it here); only the blocks from next_stored on
            # that a store can still read: with offload_prompt_only, those of the prompt's whole
            # chunks (_build_store_jobs reads no block of a chunk beyond _offloadable's
            # num_prompt tokens; the later ones, a decode's, are never read)
            idle: list[str] = []
            for rid, st in held.items():
                num_prompt = st.req.num_prompt
                visit = False
                for gi in sw_groups:
                    gs = st.groups[gi]
                    bids = gs.block_ids
                    stop = len(bids)
                    if prompt_only:
                        top = num_prompt // cfgs[gi].tokens_per_chunk * bpc
                        if top < stop:
                            stop = top
                    start = gs.next_stored * bpc
                    if start < stop:
                        visit = True
                    for j in range(start, stop):
                        if self._allocated_now(bids[j]):
                            bids[j] = NULL
                if not visit and rid not in new_blocks:     # (new ones: appended below)
                    idle.append(rid)
            for rid in idle:
                del held[rid]
        for x in range(0, len(grown), 2):
            gst: RequestOffloadState = grown[x]
            gnb: list = grown[x + 1]
            for gi in sw_groups:
                gnew: list = gnb[cfgs[gi].group_id]
                gbl: list = gst.groups[gi].block_ids
                if len(gnew) == 1:
                    gbl.append(gnew[0])         # (one block: appended, as above)
                else:
                    gbl.extend(gnew)
        tiering = self.tiering
        if tiering is not None and not tiering.schedule_end_last:
            tiering.on_schedule_end()       # (0.30.0-0.32.0: before the flushes and stores)
        for rid in preempted:
            pst = rs.get(rid)
            if pst is not None and pst.jobs:
                self.batch_flush.update(pst.jobs)
        if self.block_to_jobs and (alloc or marked):
            for b, pending in self.block_to_jobs.items():
                if self._allocated_now(b):
                    self.batch_flush.update(pending)
        if offers and self.boundary_stores:  # (the boundary jobs first: lower job IDs)
            stores = self._build_boundary_store_jobs(offers)
            stores += self._build_store_jobs(scheduled, finished, sts)
        else:
            stores = self._build_store_jobs(scheduled, finished, sts)
        loads, flush = self.batch_loads, self.batch_flush
        for rid in finished:
            fst = rs.get(rid)
            if fst is None:
                continue
            fst.finished_signaled = True
            self.tier.on_request_finished(fst)
            if not fst.jobs:
                del rs[rid]
                held.pop(rid, None)
        # (the next batch's: new ones where these are not empty, handed out or to clear)
        if loads:
            self.batch_loads = []
        if flush:
            self.batch_flush = set()
        if alloc:
            self.batch_allocated = set()
        self.alloc_batch += 1
        self.alloc_marked = False
        if tiering is not None and tiering.schedule_end_last:
            tiering.on_schedule_end()       # (0.33.0: the manager's last call of the step)
        return stores, loads, flush

    def _allocated_now(self, b: int) -> bool:
        """Whether block ``b`` is in this batch's allocated block IDs (see ``alloc_mark``)."""
        if b == NULL:
            return False
        mark = self.alloc_mark
        if mark is not None:
            m: int = mark[b]
            if m == self.alloc_batch:
                return True
        return bool(self.batch_allocated) and b in self.batch_allocated

    def _offloadable(self, st: RequestOffloadState, n: int) -> int:
        """``_calc_num_offloadable_tokens``; ``offload_prompt_only`` defaults to True in every
        release (``OffloadingSpec``'s ``extra_config.get("offload_prompt_only", True)``): then
        only prompt tokens are stored."""
        req = st.req
        n = min(n, req.num_tokens)
        if st.max_offload_tokens is not None:
            n = min(n, st.max_offload_tokens)
        if self.prompt_only:
            n = min(n, req.num_prompt)
        return n

    def _build_boundary_store_jobs(self, offers) -> list[Job]:
        """``_build_aligned_boundary_store_jobs`` (from ``_build_partial_tail_store_jobs``, before
        the chunk store jobs): an align-mode Mamba group is stored only from the boundary states
        the KV cache manager hands over (``boundary_state_offloads``), one job per boundary: the
        state block, fenced, under the key of the boundary's last block hash, when the boundary
        ends a chunk and lies within the offloadable tokens. (Partial tails, a Mamba block larger
        than the hash block, are not modelled.)"""
        by_req: dict[str, list] = {}
        for rid, gid, b, boundary in offers:
            by_req.setdefault(rid, []).append((gid, b, boundary))
        cfg_of = {cfg.group_id: cfg for cfg in self.cfgs}
        tph, out = self.tph, []
        for rid, entries in by_req.items():
            st = self.req_status.get(rid)
            if st is None:
                continue
            req = st.req
            max_boundary = self._offloadable(st, req.num_tokens)
            for gid, b, boundary in entries:
                cfg = cfg_of.get(gid)
                if cfg is None or b == NULL or boundary > max_boundary \
                        or boundary % cfg.tokens_per_chunk:
                    continue
                ident = req.ident_at(boundary)
                assert ident is not None        # boundary <= num_tokens: a known identity
                key = make_key(gid, ident)
                to_store = self.tier.prepare_store([key], st)
                if not to_store:
                    continue
                c = boundary // cfg.tokens_per_chunk - 1
                job = Job(-1, rid, True, {key}, [b])
                job.cpu_chunks = self.tier.chunks_of(to_store)
                job.add_chunk(gid, c, boundary // tph - 1, key,
                              [(boundary // cfg.tokens_per_block - 1, b)])
                self._new_job(job)
                st.jobs.add(job.jid)
                self._fence(b, job.jid)
                out.append(job)
        return out

    def _build_store_jobs(self, scheduled: dict[str, int], finished: list[str],
                          states: list[RequestOffloadState]) -> list[Job]:
        """The step's store jobs: the scheduled requests' (``states``: theirs, in order, as
        build_connector_meta looked them up: no list of the IDs made, no second lookup), then
        those of the finished requests not scheduled."""
        out: list[Job] = []
        x = 0
        for n in scheduled.values():
            self._store_job(states[x], n, out)
            x += 1
        rs = self.req_status
        for rid in finished:
            if rid not in scheduled:
                fst = rs.get(rid)
                if fst is not None:
                    self._store_job(fst, 0, out)    # (finished: its scheduled tokens not read)
        return out

    def _store_job(self, st: RequestOffloadState, n_sched: int, out: list[Job]) -> None:
        """``_build_store_jobs`` for one request: the chunks each group can store now are
        offered to the CPU tier (``prepare_store``), and those it takes form one store job,
        appended to ``out`` (``n_sched``: the tokens scheduled for the request, read if it has
        not finished). A sliding-window group's source blocks are fenced at once; the others'
        once the request finishes (``_deferred``)."""
        req = st.req
        if req.status == ABORTED:
            n_after = req.num_computed
        elif req.finished:
            # 0.30.0+ clamp to the commit point: the final sampled token's slot is never
            # written; 0.29.0 stores up to num_tokens (the block ending there is stale)
            n_after = (max(req.num_prompt, req.num_tokens - 1) if self.finish_clamp
                       else req.num_tokens)
        else:
            n_after = req.num_computed + n_sched
        n_off = self._offloadable(st, n_after)
        cfgs, groups = self.cfgs, st.groups
        if all(n_off // cfg.tokens_per_chunk <= gs.next_stored for cfg, gs in zip(cfgs, groups)):
            return        # no group can store a chunk: advance_stored_idx is a no-op too
        ns = [self.storable_chunks(st, cfg, gs, n_off) for cfg, gs in zip(cfgs, groups)]
        # where next_stored goes after this store (the chunks collected but under 0.25.1's hole)
        adv = [self.storable_chunks(st, cfg, gs, n_off, False) for cfg, gs in zip(cfgs, groups)
               ] if self.eagle_tail_hole else ns
        offered = [(gi, c) for gi, n in enumerate(ns)
                   for c in self._chunks_to_offer(st, cfgs[gi], groups[gi], n)]
        new_keys = [groups[gi].keys[c] for gi, c in offered]
        if not new_keys:
            self.advance_stored_idx(st, n_off, adv)
            return
        to_store = self.tier.prepare_store(new_keys, st)
        if to_store is None:
            return
        if not to_store:
            self.advance_stored_idx(st, n_off, adv)
            return
        self._touch(st)
        job = Job(-1, req.rid, True, to_store, None, True)
        job.cpu_chunks = self.tier.chunks_of(to_store)     # (in order: the chunks below)
        fenced: list = []
        j = 0                       # to_store is the part of new_keys the tier took, in order
        for gi, c in offered:
            key = groups[gi].keys[c]
            if j == len(to_store) or key != to_store[j]:
                continue
            j += 1
            cfg, blocks = cfgs[gi], groups[gi].block_ids
            hpc = cfg.hashes_per_chunk
            sources = [(i, blocks[i]) for i in range(c * self.bpc, (c + 1) * self.bpc)
                       if blocks[i] != NULL]
            job.add_chunk(cfg.group_id, c, hpc * c + hpc - 1, key, sources)
            if cfg.sliding_window_in_chunks is not None:
                fenced += [b for _, b in sources]
        for gs, n in zip(groups, adv):
            gs.next_stored = max(gs.next_stored, n)
        job.fenced = fenced or None
        self._new_job(job)
        jid = job.jid
        st.jobs.add(jid)
        for b in fenced:
            self._fence(b, jid)
        if req.finished:
            # register the deferred fences; a block re-allocated in this very batch flushes
            # the new job at once (as _build_store_jobs does for finished requests)
            for b in self._deferred(job):
                self._fence(b, jid)
                if self._allocated_now(b):
                    self.batch_flush.add(jid)
        out.append(job)

    def _chunks_to_offer(self, st: RequestOffloadState, cfg: GroupGeometry, gs: RequestGroupState,
                         n: int) -> list[int]:
        """The chunks ``next_stored..n-1`` of a group that ``_build_store_jobs`` offers: with
        their keys and last blocks (``assert len(offload_keys) == len(offload_block_ids)``),
        not a copy-on-write group's, and then as the release walks them: 0.33.0 keeps a chunk
        whose last block is not null, one of whose blocks is reachable
        (``_reachable_store_block_mask``) and none of whose reachable blocks is null; earlier
        releases keep the reachable chunks (sliding window) whose last block is not null."""
        start, bpc = gs.next_stored, self.bpc
        if n <= start or cfg.group_id in self.cow_groups:
            return []
        blocks = gs.block_ids
        num_keys = max(0, min(n, len(gs.keys)) - start)
        last_lo, last_hi = start * bpc + bpc - 1, min(n * bpc, len(blocks))
        num_blocks = (last_hi - last_lo + bpc - 1) // bpc if last_hi > last_lo else 0
        if self.asserts and num_keys != num_blocks:
            raise ModelCrash(
                "AssertionError", "_build_store_jobs", "build_store_jobs",
                f"assert len(offload_keys) == len(offload_block_ids) "
                f"({num_keys} != {num_blocks}, group {cfg.group_id})")
        cnt = min(num_keys, num_blocks)
        mask = self.sw_store_mask.get(cfg.group_id) if self.sw_store_mask else None
        req = st.req
        if self.skip_null_chunks:
            reach = (mask.blocks(start, start + cnt, req.num_prompt, req.shared_prefix_boundary)
                     if mask is not None and cnt else None)
            kept = []
            for i in range(cnt):
                lo = (start + i) * bpc
                r = [True] * bpc if reach is None else reach[i * bpc:(i + 1) * bpc]
                if blocks[lo + bpc - 1] != NULL and any(r) and \
                        not any(r[b] and blocks[lo + b] == NULL for b in range(bpc)):
                    kept.append(start + i)
            return kept
        if mask is not None:
            reach = mask.reachable(start, n, req.num_prompt, req.shared_prefix_boundary)
            cnt = min(cnt, len(reach))
        else:
            reach = [True] * cnt
        return [start + i for i in range(cnt)
                if reach[i] and blocks[last_lo + i * bpc] != NULL]

    def _fence(self, b: int, jid: int) -> None:
        """Record that job ``jid`` reads block ``b`` (``_block_id_to_pending_jobs``)."""
        self.block_to_jobs.setdefault(b, set()).add(jid)

    def _remove_pending(self, jid: int, blocks) -> None:
        for b in blocks or ():
            pending = self.block_to_jobs.get(b)
            if pending is not None:
                pending.discard(jid)
                if not pending:
                    del self.block_to_jobs[b]

    def complete_job(self, jid: int) -> Job:
        """``update_connector_output`` for one completed job."""
        job = self.jobs.pop(jid)
        st = self.req_status[job.rid]
        walked = self.observed_walks.get(jid)
        if job.is_store:
            self.tier.complete_store(job.ckeys, job.contents, job.cpu_chunks, walked, st)
        else:
            self.tier.complete_load(job.keys, job.cpu_chunks, walked)
            if self.being_loaded:
                self.being_loaded.difference_update(job.keys)
        if self.block_to_jobs:
            self._remove_pending(jid, job.fenced)
            if st.req.finished:
                self._remove_pending(jid, self._deferred(job))
        st.jobs.discard(jid)
        if st.finished_signaled and not st.jobs:
            del self.req_status[job.rid]
            self.sw_held.pop(job.rid, None)
        job.done = True
        return job

    def request_finished(self, req: Request) -> None:
        st = self.req_status.get(req.rid)
        if st is None:
            return
        self.update_offload_keys(st, "request_finished")
        for jid in st.jobs:
            for b in self._deferred(self.jobs[jid]):
                self._fence(b, jid)

    def _deferred(self, job: Job) -> list:
        """A store job's deferred fences (``job.deferred``): its source blocks of the groups not
        fenced at once (not sliding-window), in job order; none for other jobs. Listed when
        needed (its request finishing: rarely) rather than kept with every job."""
        if not job.deferred:
            return []
        sw, gids, bpos, bids = self.sw_gids, job.gids, job.bpos, job.bids
        out: list = []
        for x in range(len(gids)):
            if gids[x] not in sw:
                out.extend(bids[bpos[x]:bpos[x + 1]])
        return out

    def quiet(self) -> bool:
        """No job in flight (``has_pending_push_work``), a tier's included."""
        return not self.jobs and (self.tiering is None or not self.tiering.has_pending_work())
