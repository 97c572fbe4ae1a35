"""One manager per KV cache spec kind, as ``vllm/v1/core/single_type_kv_cache_manager.py`` has them.

Each manager handles one KV cache group's blocks over the shared :class:`BlockPool`:

* ``FullAttentionManager`` (full, MLA, cross attention, and drafter groups, which sit beside their
  target): a block for every token, none ever out of reach;
* ``SlidingWindowManager`` and ``ChunkedLocalAttentionManager``: blocks out of reach
  (``get_num_skipped_tokens``) are freed and the null block takes their place;
* ``MambaManager``: one running state; in ``align`` mode (``mamba_cache_mode == "align"``, no
  prefill-checkpoint blocks) an allocation that reaches a new block puts null blocks up to the
  last block and one new block there; the previous state is freed by the next
  ``remove_skipped_blocks``; a state block full when cached is prefix-cached and offered to the
  connector with its boundary; a hit on a state cached in the same step waits for the next one
  (``cached_blocks_this_step``). Under speculative decoding the spec's
  ``num_speculative_blocks`` state blocks for the drafts follow the running state in either
  mode;
* ``CircularBufferManager`` (a ring, ``CircularBufferSpec``): one block for the request's
  lifetime, never cached. (vLLM derives it from ``FullAttentionManager``; here it stands apart,
  so that no full-attention rule applies to it by inheritance.)

The block tables live on the request (``Request.tables[gid]``), not in the manager's
``req_to_blocks``. Sliding-window and align-mode Mamba groups cache only the blocks their
``reachable_block_mask`` keeps: every block by default (``prefix_cache_retention_interval``
None) unless a window needs fewer blocks than a scheduler block holds; under a retention interval
only those a later request can reach at the replay boundaries or the shared-prefix junction (0),
or also one checkpoint per interval. A block left out is never hashed: freed, it goes to the
front of the free queue.

Size: mirrors vLLM's ``v1/core/single_type_kv_cache_manager.py`` (2,730 lines in 0.33.0): the
base manager and the kinds the model has, each overriding the hooks vLLM's overrides
(``get_num_skipped_tokens``, ``get_num_blocks_to_allocate``, ``remove_skipped_blocks``,
``reachable_block_mask``, ``new_step_starts``), with ``make_manager`` for vLLM's
``get_manager_for_kv_cache_spec``; and the bodies of the sliding-window and Mamba
``reachable_block_mask`` as functions (``window_reachable_blocks``, ``mamba_reachable_blocks``),
which the connector's store mask calls too. A kind's rules read as overrides of the base class
beside them, as in vLLM's one module: splitting it would part that class hierarchy.
"""

from __future__ import annotations

from typing import Final, Sequence

from simsched.model.block_pool import NULL, BlockPool
from simsched.model.request import Key, Request, make_key

#: quiet_bound's "no bound": past every position
NO_BOUND: Final = 1 << 62


class PrefixCacheConfig:
    """What every manager reads of the engine's configuration (vLLM passes these to each manager
    and to the coordinator); the model sets the speculative-decoding fields from its profile."""

    def __init__(self, block_size: int, retention_interval: int | None):
        #: the scheduler block size: hits are multiples of it with several groups
        self.block_size = block_size
        # enable_partial_hash_hits (geometry.partial_hash_hits) and the hash unit: with partial
        # hits the managers' cache_hit_alignment_tokens is the hash unit
        self.partial_hash_hits = False
        self.tokens_per_hash = block_size
        # FullAttentionManager._cache_partial_tail_block (0.26.0+), and its boundary below the
        # whole prompt but under EAGLE (0.32.0+)
        self.partial_tail = False
        self.partial_tail_below_prompt = False
        #: KVCacheConfig.prefix_cache_retention_interval (None dense, 0 reachable boundaries
        #: only, > 0 also one checkpoint per interval)
        self.retention_interval = retention_interval
        # use_eagle_block_drop (EAGLE-style speculative decoding): the last block of a GPU
        # prefix hit is dropped, the drafter needs the tokens before the generation point
        # recomputed (find_longest_cache_hit(drop_eagle_block))
        self.eagle_drop = False
        # 0.32.0+, several groups (HybridKVCacheCoordinator): an EAGLE group matches one block
        # past the candidate hit before dropping one (eagle_proof_margin)
        self.eagle_margin = False
        # the replay boundaries' EAGLE pair (get_replay_boundaries, 0.30.0+) and the block below
        # the junction kept by an EAGLE sliding-window group (cache_blocks, 0.33.0)
        self.eagle_replay_pair = False
        self.eagle_junction_below = False
        # the coordinator's eagle_group_ids: the specs of the drafter groups (is_eagle_group),
        # None when no group is a drafter (then every group is one)
        self.drafter_specs: set[tuple] | None = None

    @property
    def cache_hit_alignment_tokens(self) -> int:
        return self.tokens_per_hash if self.partial_hash_hits else self.block_size

    def without_eagle(self) -> PrefixCacheConfig:
        """This configuration as a coordinator built with ``use_eagle=False`` reads it (the
        SimpleCPUOffloadConnector's CPU coordinator before 0.27.0): no EAGLE rule."""
        out = PrefixCacheConfig(self.block_size, self.retention_interval)
        out.partial_hash_hits, out.tokens_per_hash = self.partial_hash_hits, self.tokens_per_hash
        out.partial_tail = self.partial_tail
        out.partial_tail_below_prompt = self.partial_tail_below_prompt
        out.drafter_specs = self.drafter_specs
        return out

    def without_partial_hash_hits(self) -> PrefixCacheConfig:
        """This configuration as a coordinator built with ``allow_partial_hash_hits=False``
        reads it (the SimpleCPUOffloadConnector's CPU coordinator in lazy mode, 0.30.0+:
        kv_cache_coordinator.py 0.30.0:700-701): hits on scheduler blocks only."""
        out = PrefixCacheConfig(self.block_size, self.retention_interval)
        out.tokens_per_hash = self.tokens_per_hash
        out.partial_tail = self.partial_tail
        out.partial_tail_below_prompt = self.partial_tail_below_prompt
        out.eagle_drop, out.eagle_margin = self.eagle_drop, self.eagle_margin
        out.eagle_replay_pair = self.eagle_replay_pair
        out.eagle_junction_below = self.eagle_junction_below
        out.drafter_specs = self.drafter_specs
        return out

    def use_eagle(self, spec: tuple) -> bool:
        """``manager.use_eagle``: EAGLE-style drafting, and the group a drafter group or of the
        spec of one (verify_and_split_kv_cache_groups marks every group whose spec equals an EAGLE
        group's: ``is_draft`` is no part of the spec's equality)."""
        return self.eagle_drop and (self.drafter_specs is None or spec in self.drafter_specs)


def replay_boundaries(num_prompt: int, scheduler_block_size: int, eagle_pair: bool
                      ) -> tuple[int, ...]:
    """``replay_boundaries`` (0.32.0+; ``get_replay_boundaries`` 0.30.0/0.31.0): where a later
    request replaying this prompt resumes. A resend is capped at ``num_prompt - 1``; with EAGLE
    (``eagle_pair``: an EAGLE group, 0.30.0+) a resend and a longer sibling drop back one
    scheduler block from their aligned hits. 0.29.0 keeps ``num_prompt - 1`` only."""
    if not eagle_pair:
        return (num_prompt - 1,)
    block = scheduler_block_size
    resend = (num_prompt - 1) // block * block
    extension = num_prompt // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


def window_reachable_blocks(start: int, end: int, align: int, bs: int, need: int, shift: int,
                            retention: int | None, boundaries: Sequence[int]
                            ) -> list[bool] | None:
    """``SlidingWindowManager.reachable_block_mask`` for blocks ``start..end-1``; None: every
    block. A hit at an aligned boundary needs the ``need`` blocks before it (``cdiv(window - 1,
    bs)``, one more with EAGLE, whose peek block past the boundary ``shift`` counts); segment
    tails every ``align`` tokens (None, dense) or ``retention`` tokens (> 0), none for 0; under
    any retention the tails ending at ``boundaries`` too. A sub-block alignment is dense
    (0.30.0+; 0.29.0 asserts it never happens)."""
    if align % bs:
        return None
    mask = [False] * (end - start)
    segment = align if retention is None else (retention or 0)
    if segment:
        per = segment // bs
        if need >= per:
            return None             # every block ends some segment's tail
        for i in range(max(start, shift), end):
            if (i - shift) % per >= per - need:
                mask[i - start] = True
    if retention is not None:
        for boundary in boundaries:
            e = boundary // align * align // bs + shift
            for j in range(max(start, e - need), min(end, e)):
                mask[j - start] = True
    return mask


def mamba_reachable_blocks(start: int, end: int, align: int, bs: int, retention: int | None,
                           boundaries: Sequence[int]) -> list[bool] | None:
    """``MambaManager.reachable_block_mask`` for blocks ``start..end-1``; None: every block. A
    Mamba hit needs the one state block ending on the boundary (block ``i`` ends at ``(i + 1) *
    bs``): one per ``retention`` tokens (> 0) and the one at each aligned boundary; None (or an
    interval of at most one block) caches every state."""
    if retention is None:
        return None
    mask = [False] * (end - start)
    if retention:
        per = retention // bs
        if per <= 1:
            return None
        for i in range((start + per) // per * per - 1, end, per):
            mask[i - start] = True
    for boundary in boundaries:
        b = boundary // align * align // bs - 1
        if start <= b < end:
            mask[b - start] = True
    return mask


class SingleTypeKVCacheManager:
    """``SingleTypeKVCacheManager``: the rules every kind shares."""

    def __init__(self, gid: int, group, block_size: int, enable_prefix_caching: bool,
                 pool: BlockPool, config: PrefixCacheConfig,
                 max_in_flight_tokens: int | None = None):
        self.gid = gid
        self.block_size = block_size
        self.pool = pool
        self.config = config
        self.kind: str = group.kind
        self.window: int = group.sliding_window or 0
        self.chunk: int = group.attention_chunk_size or 0
        self.drafter: bool = bool(group.drafter)
        self.cacheable: bool = bool(enable_prefix_caching and group.prefix_cacheable and not (
            group.kind == "mamba" and group.mamba_cache_mode != "align"))
        # what the group's KVCacheSpec compares equal by (the harness gives every attention
        # spec the same heads and dtype): groups of one spec share a SpecGroup
        self.spec: tuple = (self.kind, block_size, self.window, self.chunk,
                            group.mamba_cache_mode if group.kind == "mamba" else None,
                            group.extra_retained_tokens)
        #: ``max_admission_blocks_per_request`` of the recycling specs; None: no cap
        self.admission_cap: int | None = None
        #: blocks a request holds past its tokens' slots: ``MambaSpec.num_speculative_blocks``
        #: (0 for every other spec)
        self.num_speculative_blocks: int = 0

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens out of this group's reach: none by default."""
        return 0

    def num_tokens_out_of_window(self, num_tokens: int) -> int:
        """Tokens a prefix hit of ``num_tokens`` need not find (``find_longest_cache_hit``):
        the skipped ones, but for a sliding window that retains extra tokens."""
        return self.get_num_skipped_tokens(num_tokens)

    def use_eagle(self) -> bool:
        return self.config.use_eagle(self.spec)

    def get_num_blocks_to_allocate(self, req: Request, hit: int, total: int, num_tokens: int,
                                   capped: bool, lookahead: int) -> int:
        """Blocks this group needs for a request about to take a GPU prefix hit of ``hit``
        tokens with ``total`` tokens computed (hit plus connector tokens), slots for
        ``num_tokens`` tokens; ``capped``: ``apply_admission_cap``. A request that already holds
        blocks (after a load) needs ``required - held``; a fresh one ``required - max(skipped
        blocks, hit blocks)`` plus its evictable hit blocks (ref 0, taken out of the free queue
        when touched)."""
        bs = self.block_size
        required = -(-num_tokens // bs)
        if capped and self.admission_cap is not None and self.admission_cap < required:
            required = self.admission_cap
        table = req.tables[self.gid]
        if table:
            return max(required - len(table), 0)
        n_hit = hit // bs if (self.cacheable and hit) else 0
        skipped = self.get_num_skipped_tokens(total) // bs
        need = max(required - max(n_hit, skipped), 0)
        keys = req.keys(self.gid, bs)
        # the hit's blocks past those it did not look up (nulls, never evictable)
        looked_up = max(skipped, self.num_tokens_out_of_window(hit) // bs)
        for j in range(looked_up, n_hit):
            if self.pool.ref[self.pool.get_cached_block(keys[j])] == 0:
                need += 1           # an evictable hit block
        return need

    def new_block_counts(self, req: Request, num_computed: int, num_tokens_main: int,
                         num_tokens: int) -> tuple[int, int]:
        """``allocate_new_blocks``'s plan for slots up to ``num_tokens``: the null placeholders
        for blocks already out of reach at ``num_computed`` and the new blocks."""
        have = len(req.tables[self.gid])
        target = -(-num_tokens // self.block_size)
        if target <= have:
            return 0, 0
        nulls = max(min(self.get_num_skipped_tokens(num_computed) // self.block_size,
                        target) - have, 0)
        return nulls, target - have - nulls

    def allocate_external_computed_blocks(self, req: Request, nulls: int,
                                          blocks: list[int]) -> list[int]:
        """``add_local_computed_blocks``' null padding for the blocks out of reach at the
        computed tokens and ``allocate_external_computed_blocks``' blocks for the connector's
        tokens: appended to the table, and returned."""
        new = [NULL] * nulls + blocks if nulls else blocks
        req.tables[self.gid].extend(new)
        return new

    def allocate_new_blocks(self, req: Request, num_tokens_main: int, nulls: int,
                            blocks: list[int]) -> list[int]:
        """``allocate_new_blocks``: the plan of :meth:`new_block_counts` (its null placeholders
        and the new ``blocks``) appended to the table; returns what vLLM reports as the
        request's new block IDs."""
        return self.allocate_external_computed_blocks(req, nulls, blocks)

    def remove_skipped_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """``remove_skipped_blocks``: the blocks out of reach are freed, tail first, and the null
        block takes their place. Blocks before the last null were freed earlier: only the run of
        real blocks ending at the last skipped block is left to free."""
        table = req.tables[self.gid]
        n = min(self.get_num_skipped_tokens(num_computed_tokens) // self.block_size, len(table))
        lo = n
        while lo > 0 and table[lo - 1] != NULL:
            lo -= 1
        if lo == n:
            return
        freed = table[lo:n]
        freed.reverse()
        table[lo:n] = [NULL] * (n - lo)
        # one free_blocks call per group (_remove_blocks_in_range): unhashed blocks of a later
        # group go in front of an earlier group's
        self.pool.free_blocks(freed)

    def reachable_block_mask(self, req: Request, start: int, end: int) -> list[bool] | None:
        """Which of blocks ``start..end-1`` ``cache_blocks`` may cache; None: every block."""
        return None

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """``cache_blocks``: put this group's full blocks of ``[0, num_tokens)`` (tokens already
        cut to what the coordinator caches) in the GPU prefix cache, past those it cached before
        (``num_cached_block``). A block the mask leaves out stays uncached for good."""
        gid, bs = self.gid, self.block_size
        table = req.tables[gid]
        start = req.num_cached_blocks[gid]
        n = min(num_tokens // bs, len(table))
        if start >= n:
            return
        keys = req.keys(gid, bs)
        m = min(n, len(keys))
        mask = self.reachable_block_mask(req, start, n)
        for j in range(start, m):
            b = table[j]
            if (mask is None or mask[j - start]) and b != NULL and self.pool.key[b] is None:
                self.pool.cache(b, keys[j])
        self.cached_new_blocks(req, start, m)
        # past the known tokens a block has no key yet: counted cached only once it has one
        i = max(start, m)
        while i < n and (table[i] == NULL or self.pool.key[table[i]] is not None):
            i += 1
        req.num_cached_blocks[gid] = i

    def cached_new_blocks(self, req: Request, start: int, end: int) -> None:
        """A hook: blocks ``start..end-1`` of the table were just cached."""

    def quiet_bound(self, req: Request, first_real_block: int) -> int:
        """The largest ``num_computed`` at which block ``first_real_block`` is still in reach
        (``get_num_skipped_tokens(c) < (first_real_block + 1) * block_size``); none skips
        by default."""
        return NO_BOUND

    def forget(self, req: Request) -> None:
        """``pop_blocks_for_free``: the request's per-manager state is dropped."""

    def new_step_starts(self) -> None:
        """``new_step_starts``: nothing by default."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """``FullAttentionManager``: every token's block stays (also MLA, cross attention and the
    drafter groups of EAGLE/MTP, whose layout is a full-attention group's)."""

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """``cache_blocks``, and (0.26.0+, a block wider than the hash unit)
        ``_cache_partial_tail_block``: the block in which the prompt's last hash boundary falls
        is cached under that boundary's hash (``cache_partial_block``) once the tokens up to it
        are; a later request can resume from the boundary, and the block, hashed, is freed to
        the LRU end of the free queue. Once full it takes its own hash instead
        (``cache_full_blocks``: the partial->full promotion)."""
        config = self.config
        tail = -1
        if (config.partial_tail and self.block_size != config.tokens_per_hash
                and self.kind in ("full", "mla")):
            tail = self._partial_tail_index(req)
        table = req.tables[self.gid]
        if 0 <= tail < len(table) and (tail + 1) * self.block_size <= num_tokens:
            b = table[tail]
            if b != NULL and self.pool.key[b] is not None \
                    and self.pool.key[b] != req.keys(self.gid, self.block_size)[tail]:
                self.pool.uncache(b)            # full now: cached below under its own hash
        super().cache_blocks(req, num_tokens)
        if 0 <= tail < len(table) and tail * self.block_size < self._boundary(req) <= num_tokens:
            b = table[tail]
            if b != NULL and self.pool.key[b] is None:
                ident = req.ident_at(self._boundary(req))
                assert ident is not None
                self.pool.cache(b, make_key(self.gid, ident))

    def _boundary(self, req: Request) -> int:
        """The prompt's last hash boundary (0.32.0+: a resend matches at most prompt_len - 1
        tokens, but EAGLE lookups read the whole prompt before dropping a hash unit)."""
        tph = self.config.tokens_per_hash
        limit = req.num_prompt
        if self.config.partial_tail_below_prompt and not self.use_eagle():
            limit -= 1
        return limit // tph * tph

    def _partial_tail_index(self, req: Request) -> int:
        """The block the prompt's last hash boundary falls inside, -1 if it ends a block."""
        boundary = self._boundary(req)
        if boundary == 0 or boundary % self.block_size == 0:
            return -1
        return boundary // self.block_size


class SlidingWindowManager(SingleTypeKVCacheManager):
    """``SlidingWindowManager``: a token is out of reach once ``sliding_window`` newer ones are
    computed; its block is freed ``extra_retained_tokens`` later (0.28.0+: multi-module MTP
    re-prefills that many trailing tokens)."""

    def __init__(self, gid: int, group, block_size: int, enable_prefix_caching: bool,
                 pool: BlockPool, config: PrefixCacheConfig,
                 max_in_flight_tokens: int | None = None):
        super().__init__(gid, group, block_size, enable_prefix_caching, pool, config)
        self.extra_retained_tokens: int = group.extra_retained_tokens
        if max_in_flight_tokens is not None:
            # SlidingWindowSpec.max_admission_blocks_per_request: cdiv(window - 1 + extra
            # retained + in_flight, bs) + 1, in_flight = VllmConfig.max_in_flight_tokens
            self.admission_cap = -(-(self.window - 1 + self.extra_retained_tokens
                                     + max_in_flight_tokens) // block_size) + 1

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1 - self.extra_retained_tokens)

    def num_tokens_out_of_window(self, num_tokens: int) -> int:
        """``find_longest_cache_hit`` looks for the ``cdiv(sliding_window - 1, block_size)``
        blocks before the hit: the retained tokens are not looked up."""
        return max(0, num_tokens - self.window + 1)

    def quiet_bound(self, req: Request, first_real_block: int) -> int:
        return ((first_real_block + 1) * self.block_size + self.window - 2
                + self.extra_retained_tokens)

    def reachable_block_mask(self, req: Request, start: int, end: int) -> list[bool] | None:
        """The coordinator's retention interval and alignment, the request's replay boundaries
        and its shared-prefix junction (with EAGLE, 0.33.0, the junction one block lower too)."""
        config, bs = self.config, self.block_size
        eagle = self.use_eagle()
        need = -(-(self.window - 1) // bs) + (1 if eagle else 0)
        if config.retention_interval is None and need >= config.block_size // bs:
            return None                 # dense: every block ends some segment's tail
        boundaries = list(replay_boundaries(req.num_prompt, config.block_size,
                                            config.eagle_replay_pair and config.eagle_drop))
        junction = req.shared_prefix_boundary
        if junction:
            boundaries.append(junction)
            if eagle and config.eagle_junction_below:
                boundaries.append(junction - bs)
        return window_reachable_blocks(start, end, config.cache_hit_alignment_tokens, bs, need,
                                       1 if eagle else 0, config.retention_interval, boundaries)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """``ChunkedLocalAttentionManager``: attention within chunks of ``attention_chunk_size``; the
    chunks before the current one are out of reach."""

    def __init__(self, gid: int, group, block_size: int, enable_prefix_caching: bool,
                 pool: BlockPool, config: PrefixCacheConfig,
                 max_in_flight_tokens: int | None = None):
        super().__init__(gid, group, block_size, enable_prefix_caching, pool, config)
        if max_in_flight_tokens is not None:
            # ChunkedLocalAttentionSpec.max_admission_blocks_per_request: cdiv(chunk +
            # in_flight, bs)
            self.admission_cap = -(-(self.chunk + max_in_flight_tokens) // block_size)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.chunk * self.chunk

    def quiet_bound(self, req: Request, first_real_block: int) -> int:
        m = (first_real_block + 1) * self.block_size
        return (m - 1) // self.chunk * self.chunk + self.chunk - 1


class MambaManager(SingleTypeKVCacheManager):
    """``MambaManager``: one state per request; every earlier token is out of reach.

    Under speculative decoding the spec's ``num_speculative_blocks`` (``num_speculative_tokens``,
    ``Layout.num_speculative_blocks``) state blocks for the drafts' states follow the request's
    running state in either mode: "none" allocates that many blocks' worth of tokens more
    (``num_tokens += block_size * num_speculative_blocks``), "align" keeps them as the table's
    last blocks and moves them to its end when the running state moves past them
    (``allocate_new_blocks``; vllm/v1/core/single_type_kv_cache_manager.py, 0.30.0:1809-1933,
    alike in 0.25.1:1253-1327 and 0.33.0:1797-1923 for what the model plays)."""

    def __init__(self, gid: int, group, block_size: int, enable_prefix_caching: bool,
                 pool: BlockPool, config: PrefixCacheConfig,
                 offers: list[tuple[str, int, int, int]], tail_recache: int = 0,
                 num_speculative_blocks: int = 0, skip_lags_speculative_blocks: bool = False):
        super().__init__(gid, group, block_size, enable_prefix_caching, pool, config)
        self.align: bool = group.mamba_cache_mode == "align"
        self.num_speculative_blocks = num_speculative_blocks
        # 0.25.1 (remove_skipped_blocks, 0.25.1:1156): "with async scheduling, the
        # num_computed_tokens can contain draft tokens from the previous step that may or may
        # not be rejected later [...] let's assume that all tokens are rejected": it frees on
        # num_computed_tokens - num_speculative_blocks (blocks taken for tokens), in either
        # mode; 0.26.0 frees on the processed tokens instead, with no such subtraction
        self.skip_lags_speculative_blocks = skip_lags_speculative_blocks
        # _num_retired_blocks: per request, the blocks below it already nulled (align mode)
        self.num_retired_blocks: dict[str, int] = {}
        # _allocated_block_reqs (align mode): the requests allocate_new_blocks has seen since
        # they last got blocks; the others still need their speculative blocks
        self.allocated: set[str] = set()
        # cached_blocks_this_step: keys of the state blocks cached in this step
        self.cached_blocks_this_step: set[Key] = set()
        # _pending_boundary_state_offloads: (rid, gid, block, boundary tokens) of every state
        # block cached in this step, one list the coordinator shares between its Mamba managers
        # (so that the connector reads them in the order they were cached)
        self.offers = offers
        # 0.32.0's _cache_partial_tail_block re-registers the state block at the prompt's last
        # hash boundary, (num_prompt - 1) // tph * tph, whenever cache_blocks is called there,
        # although the block is already keyed at that boundary (0.33.0 returns early:
        # "re-caching would mark it cached this step and defer every sibling that hits it";
        # 0.30.0/0.31.0 skip a Mamba block equal to the hash block): the block counts as cached
        # this step again. The hash unit tph when the rule applies, else 0.
        self.tail_recache = tail_recache

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

    def quiet_bound(self, req: Request, first_real_block: int) -> int:
        return (first_real_block + 1) * self.block_size

    def get_num_blocks_to_allocate(self, req: Request, hit: int, total: int, num_tokens: int,
                                   capped: bool, lookahead: int) -> int:
        """``MambaManager.get_num_blocks_to_allocate`` (0.30.0:1713-1807). "none" mode: the
        tokens' blocks and ``num_speculative_blocks`` more. Align mode: a hit whose state block
        another request cached in this step cannot be used yet (``num_gpu_blocks + 1``: never
        fits); else ``num_required_blocks = cdiv(num_tokens_main_model, block_size) +
        num_speculative_blocks`` less the hit's and the request's blocks, and when positive one
        block (the new running state), plus the speculative blocks for a request
        ``allocate_new_blocks`` has not seen (0.30.0:1797-1802; 0.25.1:1238-1246, 0.28.0:1529-
        1540; 0.31.0+ caps the count there instead, min(count, cap), 0.31.0:1807-1811, which
        comes to the same without partial hits and prefill checkpoints); plus the evictable
        hit block. The EAGLE lookahead slots do not count (``num_tokens_main_model``)."""
        if not self.align:
            return super().get_num_blocks_to_allocate(
                req, hit, total, num_tokens + self.block_size * self.num_speculative_blocks,
                capped, lookahead)
        bs = self.block_size
        table = req.tables[self.gid]
        n = -(-(num_tokens - lookahead) // bs) + self.num_speculative_blocks - len(table)
        need = 0
        if not table and self.cacheable and hit:
            n -= hit // bs
            k = req.keys(self.gid, bs)[hit // bs - 1]
            if k in self.cached_blocks_this_step:
                return self.pool.num_blocks + 1
            if self.pool.ref[self.pool.get_cached_block(k)] == 0:
                need += 1
        if n > 0:
            n = 1 if req.rid in self.allocated else 1 + self.num_speculative_blocks
        return need + n

    def new_block_counts(self, req: Request, num_computed: int, num_tokens_main: int,
                         num_tokens: int) -> tuple[int, int]:
        """``allocate_new_blocks``' plan. "none" mode: slots for ``num_speculative_blocks``
        blocks' worth of tokens more. Align mode: no slots for lookahead tokens (they would break
        the block alignment, and draft models have no Mamba layers); ``num_required_blocks =
        cdiv(num_tokens_main_model, block_size) + num_speculative_blocks``; when the table is
        shorter, nulls up to ``num_required_blocks - num_speculative_blocks - 1`` (the running
        state's block) and new blocks up to ``num_required_blocks``: one for a request already
        allocated (its speculative blocks move up, :meth:`allocate_new_blocks`), one and the
        speculative blocks for a new one."""
        if not self.align:
            return super().new_block_counts(
                req, num_computed, num_tokens_main,
                num_tokens + self.block_size * self.num_speculative_blocks)
        have = len(req.tables[self.gid])
        required = -(-num_tokens_main // self.block_size) + self.num_speculative_blocks
        if required <= have:
            return 0, 0
        running = required - self.num_speculative_blocks - 1
        if req.rid in self.allocated:
            return max(running - have, 0), 1
        return max(running - have, 0), required - max(have, running)

    def allocate_new_blocks(self, req: Request, num_tokens_main: int, nulls: int,
                            blocks: list[int]) -> list[int]:
        """Align mode (0.30.0:1821-1933): the nulls up to the running state's block; for a
        request already allocated, each of its speculative blocks (its last
        ``num_speculative_blocks``) below that block is moved to the table's end, a null in its
        place (``_relocate_speculative_block``, 0.30.0:1935-1944; 0.25.1:1309-1318 "reuse
        previous speculative blocks in this step"), then the new blocks. Returns the table past
        its former end (nulls and moved blocks included), as vLLM reports the request's new
        block IDs. The request counts as allocated from then on (0.28.0+ also when nothing was
        added; before, only a request that needs its speculative blocks is ever added later, so
        the two agree)."""
        if not self.align:
            return super().allocate_new_blocks(req, num_tokens_main, nulls, blocks)
        table = req.tables[self.gid]
        prev = len(table)
        allocated = req.rid in self.allocated
        self.allocated.add(req.rid)
        if not nulls and not blocks:
            return []
        table.extend([NULL] * nulls)
        if allocated:
            running = -(-num_tokens_main // self.block_size) - 1
            for i in range(prev - self.num_speculative_blocks, prev):
                if i >= running:
                    break
                table.append(table[i])
                table[i] = NULL
        new = table[prev:] + blocks
        table.extend(blocks)
        return new

    def remove_skipped_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Align mode (``_remove_blocks_in_range``, 0.30.0:1625-1644): prefill leaves null gaps
        between states; every state block in ``[retired, n)`` is freed, tail first. (The running
        block of two steps ago, ``last_state_block_idx``, lies in that range whenever its own
        rule would free it, 0.30.0:1655-1674; before 0.30.0 the base rule stops at the first
        null going down and that rule alone frees a state below a gap, which comes to the same:
        every earlier state was freed by then.) The speculative blocks are always past ``n``:
        the table holds ``cdiv(num_tokens_main_model, block_size)`` blocks before them. 0.25.1
        frees on ``num_speculative_blocks`` fewer tokens (``skip_lags_speculative_blocks``)."""
        if self.skip_lags_speculative_blocks:
            num_computed_tokens = max(0, num_computed_tokens - self.num_speculative_blocks)
        if not self.align:
            super().remove_skipped_blocks(req, num_computed_tokens)
            return
        table = req.tables[self.gid]
        n = min(self.get_num_skipped_tokens(num_computed_tokens) // self.block_size, len(table))
        first = self.num_retired_blocks.get(req.rid, 0)
        if first >= n:
            return
        freed = [table[i] for i in range(n - 1, first - 1, -1) if table[i] != NULL]
        table[first:n] = [NULL] * (n - first)
        if freed:
            self.pool.free_blocks(freed)
        self.num_retired_blocks[req.rid] = n

    def reachable_block_mask(self, req: Request, start: int, end: int) -> list[bool] | None:
        """The state blocks ending at the coordinator's retention checkpoints, the request's
        replay boundaries and its shared-prefix junction."""
        config = self.config
        if not self.align or config.retention_interval is None:
            return None
        boundaries = list(replay_boundaries(req.num_prompt, config.block_size,
                                            config.eagle_replay_pair and config.eagle_drop))
        if req.shared_prefix_boundary:
            boundaries.append(req.shared_prefix_boundary)
        return mamba_reachable_blocks(start, end, config.cache_hit_alignment_tokens,
                                      self.block_size, config.retention_interval, boundaries)

    def cache_partial_tail_block(self, req: Request, num_cacheable_tokens: int) -> None:
        """0.32.0 (``tail_recache``): called by the coordinator before a ``cache_blocks`` of
        ``num_cacheable_tokens`` (what it caches of the request's known tokens): the state block
        at the prompt's last hash boundary counts as cached in this step again."""
        tph, bs, t = self.tail_recache, self.block_size, num_cacheable_tokens
        if not (tph and t and t % tph == 0 and t == (req.num_prompt - 1) // tph * tph
                and t % bs == 0):
            return
        table = req.tables[self.gid]
        i = t // bs - 1
        if i < len(table) and table[i] != NULL:
            k = self.pool.key[table[i]]
            if k is not None:
                self.cached_blocks_this_step.add(k)

    def cached_new_blocks(self, req: Request, start: int, end: int) -> None:
        """Align mode: every state block cached now is offered to the connector with the
        boundary it summarises, and marked cached this step."""
        if not self.align:
            return
        table = req.tables[self.gid]
        for j in range(start, end):
            b = table[j]
            k = self.pool.key[b] if b != NULL else None
            if k is not None:
                self.offers.append((req.rid, self.gid, b, (j + 1) * self.block_size))
                self.cached_blocks_this_step.add(k)

    def forget(self, req: Request) -> None:
        """``pop_blocks_for_free`` (align mode): the request's retired blocks and its allocated
        mark are dropped."""
        self.num_retired_blocks.pop(req.rid, None)
        self.allocated.discard(req.rid)

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()


class CircularBufferManager(SingleTypeKVCacheManager):
    """``CircularBufferManager`` (``CircularBufferSpec``): a ring of one block that the request
    claims at its first allocation and holds until it finishes; never cached."""

    def get_num_blocks_to_allocate(self, req: Request, hit: int, total: int, num_tokens: int,
                                   capped: bool, lookahead: int) -> int:
        return 0 if req.tables[self.gid] else 1

    def new_block_counts(self, req: Request, num_computed: int, num_tokens_main: int,
                         num_tokens: int) -> tuple[int, int]:
        return 0, 0 if req.tables[self.gid] else 1

    def remove_skipped_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """The ring block stays for the request's lifetime."""


def make_manager(gid: int, group, block_size: int, enable_prefix_caching: bool,
                 pool: BlockPool, config: PrefixCacheConfig,
                 max_in_flight_tokens: int | None = None,
                 offers: list[tuple[str, int, int, int]] | None = None,
                 mamba_tail_recache: int = 0, num_speculative_blocks: int = 0,
                 mamba_skip_lags: bool = False) -> SingleTypeKVCacheManager:
    """``get_manager_for_kv_cache_spec``: the manager of a group's spec kind."""
    kind = group.kind
    if kind in ("sliding_window", "sliding_window_mla"):
        return SlidingWindowManager(gid, group, block_size, enable_prefix_caching, pool, config,
                                    max_in_flight_tokens)
    if kind == "chunked_local":
        return ChunkedLocalAttentionManager(gid, group, block_size, enable_prefix_caching, pool,
                                            config, max_in_flight_tokens)
    if kind == "mamba":
        return MambaManager(gid, group, block_size, enable_prefix_caching, pool, config,
                            offers if offers is not None else [], mamba_tail_recache,
                            num_speculative_blocks, mamba_skip_lags)
    if kind == "ring":
        return CircularBufferManager(gid, group, block_size, enable_prefix_caching, pool, config)
    return FullAttentionManager(gid, group, block_size, enable_prefix_caching, pool, config)
