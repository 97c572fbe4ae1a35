"""The KV cache manager and its coordinator: ``vllm/v1/core/kv_cache_manager.py`` and
``kv_cache_coordinator.py``, over one :class:`BlockPool` shared by every KV cache group.

* a GPU prefix hit needs every prefix-cacheable group to hit: hit lengths are aligned to the
  scheduler block size, and a windowed group only needs the blocks still in its reach
  (``get_computed_blocks``);
* with several groups only the blocks of the tokens up to the last scheduler block boundary are
  hashed (an EAGLE group's one block past it too), the others are freed unhashed
  (``cacheable_tokens``);
* a request's blocks are freed tail first, so that its last blocks are evicted first.
"""

from __future__ import annotations

from typing import Callable

from simsched.model.block_pool import NULL, BlockPool
from simsched.model.request import Key, Request
from simsched.model.single_type_kv_cache_manager import (
    NO_BOUND, ChunkedLocalAttentionManager, CircularBufferManager, FullAttentionManager,
    MambaManager, PrefixCacheConfig, SingleTypeKVCacheManager, SlidingWindowManager, make_manager)


class KVCacheManager:
    """``KVCacheManager`` with its coordinator (``UnitaryKVCacheCoordinator`` for one group,
    ``HybridKVCacheCoordinator`` for several)."""

    def __init__(self, groups, block_sizes: list[int], num_blocks: int, align: int,
                 enable_prefix_caching: bool = True, max_in_flight_tokens: int | None = None,
                 mamba_tail_recache: int = 0, retention_interval: int | None = None,
                 num_speculative_blocks: int = 0, mamba_skip_lags: bool = False,
                 config: PrefixCacheConfig | None = None):
        """``max_in_flight_tokens``: ``VllmConfig.max_in_flight_tokens`` (max_num_batched_tokens
        times the concurrent batches), the admission cap of the recycling specs; None: no cap.
        ``mamba_tail_recache``: see ``MambaManager.tail_recache``. ``num_speculative_blocks``:
        the Mamba specs' (``Layout.num_speculative_blocks``); ``mamba_skip_lags``: see
        ``MambaManager.skip_lags_speculative_blocks``. ``config``: another coordinator's, to
        share (a connector's coordinator of the same groups), else one of its own."""
        self.pool = BlockPool(num_blocks)
        self.config = config if config is not None else PrefixCacheConfig(align,
                                                                          retention_interval)
        # _pending_boundary_state_offloads of every Mamba manager, in the order they were cached
        self.offers: list[tuple[str, int, int, int]] = []
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(i, g, bs, enable_prefix_caching, self.pool, self.config,
                         max_in_flight_tokens, self.offers, mamba_tail_recache,
                         num_speculative_blocks, mamba_skip_lags)
            for i, (g, bs) in enumerate(zip(groups, block_sizes))]
        self.max_model_len: int = 0         # set by the model (0: no cap)
        # a Mamba group without align mode disables GPU prefix hits altogether
        self.hits_possible = enable_prefix_caching and not any(
            isinstance(m, MambaManager) and not m.cacheable for m in self.managers)
        self.cacheable = [m for m in self.managers if m.cacheable]
        if any(m.drafter for m in self.managers):
            self.config.drafter_specs = {m.spec for m in self.cacheable if m.drafter}
        # get_computed_blocks bounds the hit with the full-attention groups first, then checks
        # the reach of the others
        self.full = [m for m in self.cacheable if isinstance(m, FullAttentionManager)]
        self.rest = [m for m in self.cacheable if not isinstance(m, FullAttentionManager)]
        # a cacheable group whose find_longest_cache_hit never drops EAGLE's block: Mamba (draft
        # models have no Mamba layers) and chunked local attention (it asserts drop_eagle_block
        # is False; with the assert stripped it ignores it). Then the hit must end where such a
        # group holds a block: see get_computed_blocks
        self.eagle_keepers = any(isinstance(m, (MambaManager, ChunkedLocalAttentionManager))
                                 for m in self.cacheable)
        self.tail_recachers = [m for m in self.cacheable
                               if isinstance(m, MambaManager) and m.align and m.tail_recache]
        self.junction = 0          # the last get_computed_blocks's shared_prefix_boundary

    def use_config(self, config: PrefixCacheConfig) -> None:
        """The coordinator and its managers read ``config`` from now on."""
        self.config = config
        for m in self.managers:
            m.config = config

    def new_step(self) -> None:
        """``KVCacheManager.new_step_starts``."""
        for m in self.managers:
            m.new_step_starts()

    def take_offers(self) -> list[tuple[str, int, int, int]]:
        """``take_boundary_state_offloads``: this step's Mamba boundary states, in offer order."""
        out = list(self.offers)
        self.offers.clear()
        return out

    # --- GPU prefix cache ------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> int:
        """``get_computed_blocks``: tokens served by the GPU prefix cache (every group hits).

        Also sets ``self.junction``, the ``shared_prefix_boundary`` it returns: the full-attention
        groups' longer hit when another group cut the hit short (``find_longest_cache_hit``'s
        ``num_uncached_common_prefix_tokens``), else 0."""
        self.junction = 0
        # prefix_cache_lookup_enabled: caching on and the request reads the prefix cache
        if not self.hits_possible or not self.cacheable or req.skip_reading_prefix_cache:
            return 0
        # max_cache_hit_length: the last token is recomputed for its logits
        return self.find_longest_cache_hit(req.keys, req.num_tokens - 1)

    def find_longest_cache_hit(self, keys_of: Callable[[int, int], list[Key]],
                               max_cache_hit_length: int) -> int:
        """The coordinator's ``find_longest_cache_hit``: the longest hit of at most
        ``max_cache_hit_length`` tokens over the block hashes ``keys_of(group_id,
        block_size)`` gives (a request's, or the suffix a connector looks up past its local
        hit); sets ``self.junction``."""
        self.junction = 0
        config = self.config
        align = config.block_size
        L = max_cache_hit_length
        # an EAGLE sliding-window group (no Mamba or chunked local group beside it) drops the
        # block for the whole hit after its reach search (the peek, below); else every EAGLE
        # full-attention group matches past the candidate and drops its own block (_eagle_reach)
        drop_last = config.eagle_drop and not self.eagle_keepers and any(
            isinstance(m, SlidingWindowManager) and m.use_eagle() for m in self.rest)
        if drop_last or not self.full:
            L = L // align * align
            if drop_last and config.eagle_margin and L >= 0:
                # the keys of known tokens bound it (len(block_hashes) * hash_block_size)
                L += min(m.block_size for m in self.cacheable)
        for m in self.full:
            # FullAttentionManager.find_longest_cache_hit: the longest run of cached blocks from
            # the start (a block whose tokens are not all known has no key: the run stops there)
            bs = m.block_size
            eagle = not drop_last and m.use_eagle()
            reach = self._eagle_reach(max_cache_hit_length, L, bs) if eagle else L
            hit = self._cached_run(keys_of(m.gid, bs), reach // bs) * bs
            if eagle and hit > 0:
                # drop_eagle_block: the drafter needs the tokens before the generation point
                hit -= min(align, bs)
            L = min(L, hit) // align * align
        if config.eagle_drop and self.eagle_keepers and not self.full:
            # one Mamba or chunked local group (UnitaryKVCacheCoordinator): nothing drops, and
            # no group matches past the candidate hit (no eagle_proof_margin)
            L = max_cache_hit_length // align * align
        full_hit = L
        if self.rest:
            L = self._hit_in_reach(keys_of, L, drop_last)
            if full_hit > L and self.full:
                self.junction = full_hit
        if drop_last and L > 0:
            L = (L - min(align, min(m.block_size for m in self.cacheable))) // align * align
        return L

    def _cached_run(self, keys: list[Key], limit: int) -> int:
        """How many of a group's first ``limit`` blocks (of keys ``keys``) are cached, from
        the start."""
        n = 0
        while n < min(limit, len(keys)) and self.pool.holder(keys[n]) is not None:
            n += 1
        return n

    def _hit_in_reach(self, keys_of: Callable[[int, int], list[Key]], L: int,
                      drop_last: bool) -> int:
        """The longest hit of at most ``L`` tokens at which every group other than full attention
        finds the blocks in its reach cached (``HybridKVCacheCoordinator``'s fixed point).

        Where a group misses block ``j`` of its reach at ``L``, it misses it at every smaller
        ``L`` whose reach still covers ``j`` (the reach's start only grows with ``L``): the
        search resumes at the largest ``L`` that ends at or before block ``j``. The run of
        blocks found cached before the miss is not looked up again at a smaller ``L``."""
        align = self.config.block_size
        keys = [keys_of(m.gid, m.block_size) for m in self.rest]
        found = [(0, 0)] * len(self.rest)
        while L > 0:
            for x, m in enumerate(self.rest):
                bs = m.block_size
                hi = L // bs
                lo = m.num_tokens_out_of_window(L) // bs
                if isinstance(m, SlidingWindowManager):
                    if drop_last and lo > 0:
                        # find_longest_cache_hit(drop_eagle_block): the run it needs counts
                        # EAGLE's peek block (_contiguous_blocks_for_hit: one more), popped
                        # after the match
                        lo -= 1
                    if lo >= hi > 0:
                        # a match needs a cached block: a one-token window still needs the
                        # hit's last one
                        lo = hi - 1
                a, z = found[x]
                j = lo
                while j < hi:
                    if a <= j < z:
                        j = z
                    elif j < len(keys[x]) and self.pool.holder(keys[x][j]) is not None:
                        j += 1
                    else:
                        break
                if j < hi:                        # block j is missing
                    if j > lo:
                        found[x] = (lo, j)
                    L = ((j + 1) * bs - 1) // align * align
                    break
            else:
                return L                          # every group hits at L
        return L

    def _eagle_reach(self, max_cache_hit_length: int, L: int, bs: int) -> int:
        """How far an EAGLE full-attention group of block size ``bs`` matches at the candidate
        hit ``L``: one block past it, which it drops after the match (the coordinator's
        ``_max_length``, ``HybridKVCacheCoordinator.find_longest_cache_hit``), capped by
        ``max_cache_hit_length`` (up to 0.31.0: no margin at the first candidate, the request's
        tokens but one) or by the keys of known tokens (0.32.0+,
        ``len(block_hashes) * hash_block_size``: the group's keys bound the run). One group
        (``UnitaryKVCacheCoordinator``): no margin, ``L`` itself."""
        if not self.config.eagle_margin:
            return min(L + bs, max_cache_hit_length) if len(self.managers) > 1 else L
        return L + bs

    def apply_hit(self, req: Request, L: int, total: int | None = None) -> None:
        """Take the hit blocks (``save_new_computed_blocks``): the null block for the blocks out
        of reach at ``total`` computed tokens (the hit plus the connector's tokens; default
        ``L``), the hit blocks in reach touched. The hit blocks count as cached
        (``num_cached_block``): ``cache_blocks`` starts after them."""
        req.quiet_until = -1
        if total is None:
            total = L
        if L == 0:
            return
        for m in self.cacheable:
            table = req.tables[m.gid]
            n = L // m.block_size
            # the blocks the hit did not look up (nulls), and those out of reach at ``total``
            first = min(max(m.num_tokens_out_of_window(L), m.get_num_skipped_tokens(total))
                        // m.block_size, n)
            table.extend([NULL] * first)
            keys = req.keys(m.gid, m.block_size)
            blocks = [self.pool.get_cached_block(keys[j]) for j in range(first, n)]
            self.pool.touch(blocks)
            table.extend(blocks)
            req.num_cached_blocks[m.gid] = len(table)

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Put the full blocks of ``[0, num_tokens)`` in the GPU prefix cache."""
        aligned = self.cacheable_tokens(num_tokens)
        if self.tail_recachers:
            known = self.cacheable_tokens(min(num_tokens, req.num_tokens))
            for mamba in self.tail_recachers:
                mamba.cache_partial_tail_block(req, known)
        for m in self.cacheable:
            n = aligned
            if 0 < aligned < num_tokens and m.use_eagle():
                # get_num_cacheable_tokens: an EAGLE group's lookup matches one block past the
                # aligned boundary before it drops it, so that block is cached too
                n = min(num_tokens, aligned + m.block_size)
            m.cache_blocks(req, n)

    def cacheable_tokens(self, num_tokens: int) -> int:
        """``HybridKVCacheCoordinator.cache_blocks``: of several groups, a GPU prefix hit is a
        multiple of the scheduler block size (``find_longest_cache_hit``), so only the tokens up
        to the last such boundary are cached (``_align_cacheable``, 0.28.0+; the rounding in
        ``cache_blocks`` before): a block past it is freed unhashed, to the front of the free
        queue. The unitary coordinator of one group caches every full block, and so does the
        hybrid one with fine-grained hash hits (``geometry.partial_hash_hits``; the hits
        themselves are not modelled at hash-block granularity)."""
        if len(self.managers) > 1 and not self.config.partial_hash_hits:
            return num_tokens // self.config.block_size * self.config.block_size
        return num_tokens

    # --- admission gates (Scheduler.schedule, waiting loop) ---------------------------------
    def admission_blocks(self, req: Request, hit: int, total: int, num_tokens: int,
                         capped: bool, lookahead: int = 0) -> int:
        """``coordinator.get_num_blocks_to_allocate`` for a request about to take a GPU prefix hit
        of ``hit`` tokens (blocks not touched yet) with ``total`` tokens computed (hit plus
        connector tokens), slots for ``num_tokens`` tokens, ``lookahead`` of them the EAGLE
        lookahead slots; ``capped``: ``apply_admission_cap`` (the full-sequence gate)."""
        need = 0
        for m in self.managers:
            n = m.get_num_blocks_to_allocate(req, hit, total, num_tokens, capped, lookahead)
            if n > self.pool.num_blocks:
                return n                # a Mamba hit cached in this step: never fits
            need += n
        return need

    def remaining_blocks(self, req: Request) -> int:
        """``Scheduler._request_remaining_blocks``: blocks an in-flight prefill (or load) still
        needs to hold its full sequence (admission cap applied)."""
        return self.admission_blocks(req, 0, req.num_computed, req.num_tokens, True)

    # --- allocation ------------------------------------------------------------------------
    def remove_skipped_blocks(self, req: Request, computed: int) -> None:
        """``remove_skipped_blocks``: every group frees its blocks out of reach at ``computed``
        tokens (the null block takes their place)."""
        for m in self.managers:
            m.remove_skipped_blocks(req, computed)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: int | None = None,
                       cache_upto: int | None = None, reserved: int = 0,
                       processed: int | None = None, lookahead: int = 0
                       ) -> list[list[int]] | None:
        """``allocate_slots``: blocks for ``[0, computed + num_new_tokens + lookahead)``
        (``num_lookahead_tokens``: the slots an EAGLE-style drafter writes past the scheduled
        tokens); None if the pool is dry, ``reserved`` blocks kept free for the in-flight
        prefills. ``processed``: the tokens whose output is processed (``num_computed_tokens -
        num_in_flight_tokens`` under async scheduling): blocks out of a window are freed on that
        basis (``remove_skipped_blocks``), while the blocks to add count ``computed``.

        Returns the new block IDs per group (null placeholders included, as vLLM reports them).
        """
        if computed is None:
            c = req.num_computed
            if (num_new_tokens == 1 and c <= req.quiet_until
                    and cache_upto == c + 1 and not lookahead):
                return [[] for _ in self.managers]     # a decode step that changes nothing
        else:
            c = computed
        self.remove_skipped_blocks(req, c if processed is None else processed)
        # num_tokens_need_slot: the lookahead slots never past max_model_len
        main = c + num_new_tokens
        total = main + lookahead
        if self.max_model_len > 0:
            total = min(total, self.max_model_len)
        plan = [m.new_block_counts(req, c, main, total) for m in self.managers]
        if sum(n for _, n in plan) > self.pool.get_num_free_blocks() - reserved:
            return None
        pool = self.pool
        out: list[list[int]]
        if num_new_tokens == 0:
            # a load (the connector's tokens only): allocate_new_computed_blocks gives every
            # group the blocks of the loaded tokens (allocate_external_computed_blocks) before
            # allocate_new_blocks, which finds their slots there, but for a Mamba group's
            # speculative blocks: those come after every group's loaded blocks
            out = [m.allocate_external_computed_blocks(
                       req, nulls, pool.get_new_blocks(n - m.num_speculative_blocks))
                   for m, (nulls, n) in zip(self.managers, plan)]
            for m, new in zip(self.managers, out):
                new.extend(m.allocate_new_blocks(req, main, 0,
                                                 pool.get_new_blocks(m.num_speculative_blocks)))
        else:
            out = [m.allocate_new_blocks(req, main, nulls, pool.get_new_blocks(n) if n else [])
                   for m, (nulls, n) in zip(self.managers, plan)]
        if cache_upto is not None and self.cacheable:
            self.cache_blocks(req, cache_upto)
        req.quiet_until = self.quiet_bound(req)
        return out

    def quiet_bound(self, req: Request) -> int:
        """The largest ``num_computed`` up to which ``allocate_slots(req, 1, cache_upto=
        num_computed + 1)`` is a no-op given the current tables (no skipped block to free, no
        block to add, no block to offer to the prefix cache); -1 if none. Freeing blocks, a hit
        or caching only make the real bound larger, so a stale bound is safe; ``free`` and
        ``apply_hit`` reset it.

        This is the model's one performance shortcut of the allocator: a decode step, the most
        common step, skips ``allocate_slots`` (measured in BENCHMARKS.md, "Model speed")."""
        bound = NO_BOUND
        align = self.config.block_size
        for m in self.managers:
            table = req.tables[m.gid]
            have, bs = len(table), m.block_size
            if isinstance(m, CircularBufferManager):
                if not have:
                    return -1
                continue
            # ceil((c + 1) / bs) <= have, the speculative blocks past the slots
            bound = min(bound, (have - m.num_speculative_blocks) * bs - 1)
            lead = 0                                       # the first real block
            while lead < have and table[lead] == NULL:
                lead += 1
            if lead < have:                                # remove_skipped_blocks stays a no-op
                bound = min(bound, m.quiet_bound(req, lead))
            done = req.num_cached_blocks[m.gid]
            if m.cacheable and done < have:                # cache_blocks stays a no-op
                # block done is cached once cacheable_tokens reaches its end: with several
                # groups at the first scheduler block boundary past it (an EAGLE group may
                # cache it sooner: its end bounds it then)
                end = (done + 1) * bs
                if len(self.managers) > 1 and not m.use_eagle():
                    end = -(-end // align) * align
                bound = min(bound, end - 2)
        return bound

    def free(self, req: Request) -> None:
        """Free every block of ``req``, tail first."""
        req.quiet_until = -1
        req.num_cached_blocks = [0] * len(req.tables)
        self.forget(req)
        for table in req.tables:
            table.reverse()                     # tail first (the table is emptied below)
            self.pool.free_blocks(table)
            table.clear()

    def forget(self, req: Request) -> None:
        """``pop_blocks_for_free``: the request's align-mode Mamba state (retired blocks) and its
        pending offers are dropped (also when its blocks are freed later)."""
        for m in self.managers:
            m.forget(req)
        if self.offers:
            self.offers[:] = [o for o in self.offers if o[0] != req.rid]
