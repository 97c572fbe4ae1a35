"""The hybrid block allocator: one shared GPU block pool serving every KV cache group.

Mirrors ``vllm/v1/core/block_pool.py`` (free queue, prefix cache, refcounts), the per-kind
managers of ``single_type_kv_cache_manager.py`` and the hybrid coordinator, in simplified form:

* block 0 is the null block, never handed out; the free queue is ordered (allocation takes the
  head, freed blocks go to the tail; a request's blocks are freed tail first, so that its last
  blocks are evicted first). A free block that still carries a hash stays in the GPU prefix cache
  (evictable, LRU) until it is handed out again;
* full / mla / cross_attention (and drafter groups, which sit beside their target) hold a block
  for every token; sliding_window / chunked_local / mamba free blocks out of reach
  (``get_num_skipped_tokens``) and put the null block in their place; a ring
  (``CircularBufferSpec``) claims one block for the request's lifetime and is never cached;
* a mamba group in ``align`` mode (``MambaManager``, ``mamba_cache_mode == "align"``, no
  speculative or prefill-checkpoint blocks) allocates, per allocation that reaches a new block,
  null blocks up to the last block and one new block there for the running state; the state of
  the previous allocation is freed by the next ``remove_skipped_blocks`` (which skips the null
  gaps a chunked prefill leaves); a state block that is full when cached (a chunk ending on a
  block boundary) is prefix-cached and offered to the connector with its boundary; admission
  counts at most one new block plus an evictable hit block, and a hit on a state cached in the
  same step waits for the next one (``cached_blocks_this_step``). A hit is the one state block
  ending at the hit length (nulls before it);
* a GPU prefix hit needs every prefix-cacheable group to hit (hit lengths are aligned to the
  scheduler block size, and a windowed group only needs the blocks still in its reach); with
  several groups only the blocks of the tokens up to the last scheduler block boundary are
  hashed (an EAGLE group's one block past it too), the others are freed unhashed
  (``KVCacheManager.cacheable_tokens``).
* sliding-window and align-mode Mamba groups cache only the blocks their
  ``reachable_block_mask`` keeps (``window_reachable_blocks``, ``mamba_reachable_blocks``):
  every block by default (``prefix_cache_retention_interval`` None) unless a window needs fewer
  blocks than a scheduler block holds; under a retention interval only those a later request can
  reach at the replay boundaries or the shared-prefix junction (0), or also one checkpoint per
  interval. A block left out is never hashed: freed, it goes to the front of the free queue.
"""

from __future__ import annotations

from typing import Any, Final, Iterable, Sequence

# (Final: constants mypyc inlines, no module-dict lookup at each use)
NULL: Final = 0
LAST: Final = -1        # BlockPool.later of the last block of a chain (see there)
# request states
WAITING: Final = 0
RUNNING: Final = 1
WAITING_FOR_LOAD: Final = 2
FINISHED: Final = 3
ABORTED: Final = 4
_KIND_CODE = {"full": 0, "mla": 0, "cross_attention": 0, "sliding_window": 1,
              "sliding_window_mla": 1, "chunked_local": 2, "mamba": 3, "ring": 4}
# rule codes (GroupRule.code)
FULLISH: Final = 0
SLIDING: Final = 1
CHUNKED: Final = 2
MAMBA: Final = 3
RING: Final = 4

# --- keys ------------------------------------------------------------------------------------
# A GPU prefix-cache key and an offload key name a group's KV for a token prefix: the group id
# and the prefix's identity (``Request.ident``, a chained hash: a signed 64-bit int, in
# [-2**63, 2**63)), as vLLM's ``make_offload_key`` appends the group index to a block hash. The
# pair is kept as one int, made by make_key and taken apart by key_group / key_ident only:
#
#     key = ident + group_id * 2**64
#
# Each group's keys fill their own range [group_id * 2**64 - 2**63, group_id * 2**64 + 2**63),
# the ranges in group order: a bijection, and keys order exactly as the ``(group_id, ident)``
# pairs (the eviction heap of cpu_manager.RankedCPUManager breaks ties by key). Group 0's keys are
# its idents themselves. An int hashes and compares faster than a tuple and is not tracked by
# the garbage collector.
KEY_GROUP_SHIFT: Final = 64
_IDENT_BIAS: Final = 1 << 63          # ident + _IDENT_BIAS is in [0, 2**64)
# group_id * 2**64 by group id (layout.py allows at most 16 groups). (list[Any], as _GROUP_END:
# the compiled build uses the int objects as they are, instead of trying at each read to
# convert one to a native int, which they exceed)
_GROUP_BASE: Final[list[Any]] = [g << KEY_GROUP_SHIFT for g in range(16)]
# the first key past group g's range, (2 * g + 1) * 2**63, by group id: a key's group is the
# first g whose bound exceeds it (found by comparisons: no intermediate int is made)
_GROUP_END: Final[list[Any]] = [(2 * g + 1) << (KEY_GROUP_SHIFT - 1) for g in range(16)]
# The type of a key: an int, annotated Any so that the compiled build keeps keys as the int
# objects make_key made (never converted to and from its native ints: most keys exceed them)
Key = Any

# --- sparse prefix-cache retention --------------------------------------------------------
# ``prefix_cache_retention_interval`` (CacheConfig, 0.29.0+; the KV cache manager reads the
# KVCacheConfig's copy): ``None`` caches every block of a sliding-window or Mamba group (dense);
# ``0`` only the blocks a later request can reach at a replay boundary or a shared-prefix
# junction; ``> 0`` also one checkpoint per interval-sized segment. The masks below are the
# managers' ``reachable_block_mask``; the connector calls the same ones for its store mask.

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


def make_key(gid: int, ident: Key) -> Key:
    """The key of group ``gid``'s KV for the prefix of identity ``ident``."""
    return ident + _GROUP_BASE[gid] if gid else ident


def key_group(key: Key) -> int:
    """The group id of ``key``: ``(key + 2**63) >> 64``."""
    if key < _IDENT_BIAS:
        return 0
    g = 1
    while key >= _GROUP_END[g]:
        g += 1
    return g


def key_ident(key: Key) -> Key:
    """The prefix identity of ``key``: ``key - key_group(key) * 2**64``."""
    if key < _IDENT_BIAS:
        return key
    g = 1
    while key >= _GROUP_END[g]:
        g += 1
    return key - _GROUP_BASE[g]


class Request:
    """A request as the scheduler, the KV cache manager and the connector see it.

    ``ident[k]`` is a chained hash of the tokens ``[0, (k + 1) * unit)``: the token identity of a
    prefix. vLLM's block hashes (one per ``tokens_per_hash`` tokens) are a subsequence of it.
    """

    __slots__ = ("rid", "index", "spec", "tokens", "num_prompt", "max_tokens", "num_computed",
                 "ident", "unit", "status", "tables", "arrival", "off", "num_cached",
                 "load_target", "finish_step", "num_cached_blocks", "quiet_until", "fast_until",
                 "fast_blocks", "key_lists", "prefix_of", "prefix_units",
                 "key_tags",
                 "hit_blocks", "leads", "shared_prefix_boundary")

    def __init__(self, rid: str, index: int, spec, prompt: Sequence[int], max_tokens: int,
                 unit: int, num_groups: int, prefix_of: Request | None = None,
                 prefix_units: int = 0):
        """``prefix_of``: an earlier request whose prompt starts with the same tokens as this one
        for ``prefix_units`` whole units: their identities (and keys) are its own, not hashed
        again."""
        self.rid, self.index, self.spec = rid, index, spec
        # the token ids (>= 0), a list of its own (a copy: prompt may be another request's)
        self.tokens: list[int] = list(prompt)
        self.num_prompt = len(prompt)
        self.max_tokens = max_tokens
        self.num_computed = 0
        self.unit = unit
        self.ident: list[int] = prefix_of.ident[:prefix_units] if prefix_of is not None else []
        self.prefix_of = prefix_of
        self.prefix_units = len(self.ident)
        self.status = WAITING
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.arrival = spec.arrival if spec is not None else 0
        self.off: Any = None    # the connector's RequestOffloadState (offload.RequestOffloadState)
        self.num_cached = 0        # GPU prefix hit tokens at admission
        self.load_target = 0       # tokens computed once the in-flight load completes
        self.finish_step: int | None = None
        self.num_cached_blocks = [0] * num_groups   # blocks already offered to the prefix cache
        self.quiet_until = -1      # see KVCacheManager.quiet_bound
        # per group, a count of leading null blocks of its table found by quiet_bound: a table
        # only grows at its end and only turns blocks null, so its leading nulls stay until it
        # is cleared (KVCacheManager.free, Model.defer_free reset the counts)
        self.leads = [0] * num_groups
        self.fast_until = -1       # the model's quiet-decode bound (Model._fast_bound)
        self.fast_blocks: list[tuple[int, int]] = []   # see Model._fast_bound
        # see keys(): the key lists made so far, one per (group, stride), that of key_tags[i]
        # in key_lists[i] (a tag is stride * 16 + group id, layout.py allowing 16 groups: a
        # request asks for a few, found by a scan of native ints, no dict lookup)
        self.key_lists: list[list[Key]] = []
        self._extend_ident()
        self.key_tags: list[int] = []
        # per group, blocks KVCacheManager.get_computed_blocks found cached at its last search
        self.hit_blocks: list[list[Any]] = []
        # set at each GPU lookup (KVCacheManager.get_computed_blocks): the full-attention groups'
        # longer hit when a sparse-retention group cut it short, else 0; a reachable boundary of the
        # sliding-window and Mamba masks (cache_blocks, the connector's store mask)
        self.shared_prefix_boundary = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def _extend_ident(self) -> None:
        """``ident[k] = hash((ident[k - 1], tuple(tokens[k * unit:(k + 1) * unit])))``
        (``ident[-1]`` read as ``0x5EED``) for every whole unit of known tokens. The units' token
        tuples are slices of one tuple of the new tokens: equal tuples, so the same hashes."""
        tokens = self.tokens
        ident: list = self.ident      # (untyped: the hashes stay the int objects hash() made)
        unit = self.unit
        k = len(ident)
        n = len(tokens) // unit
        if k >= n:
            return
        # (Any, not object: mypy does not narrow an Any variable to int on assignment, so the
        # compiled build appends the int object hash() made instead of unboxing and re-boxing it)
        prev: Any = ident[-1] if ident else 0x5EED
        new = tuple(tokens[k * unit:n * unit])
        j = 0
        end = (n - k) * unit
        while j < end:
            prev = hash((prev, new[j:j + unit]))
            ident.append(prev)
            j += unit

    def keys(self, gid: int, stride: int) -> list[Key]:
        """``[make_key(gid, ident_at(k * stride)) for k = 1, 2, ...]`` as far as the tokens are known: the
        GPU prefix-cache keys of a group's blocks (``stride`` = its block size) and the offload
        keys of its chunks (``stride`` = tokens per chunk). Built once per (group, stride) and
        extended as tokens arrive; the lists are shared, callers copy the slices they keep."""
        if not gid and stride == self.unit:
            return self.ident       # group 0's keys a unit apart: the identities themselves
        tag = stride * 16 + gid
        tags = self.key_tags
        s = 0
        ns = len(tags)
        while s < ns and tags[s] != tag:
            s += 1
        per = stride // self.unit
        if s < ns:
            keys = self.key_lists[s]
        else:
            # a new list, starting with the keys of the shared prefix (all known from the start):
            # the same ints as prefix_of's (equal values)
            p = self.prefix_of
            keys = p.keys(gid, stride)[:self.prefix_units // per] if p is not None else []
            tags.append(tag)
            self.key_lists.append(keys)
        ident: list = self.ident      # (untyped: the hashes stay the int objects hash() made)
        have = len(keys)
        n = len(ident) // per
        # the keys past the shared prefix, appended one by one (mostly one key at a time, as
        # decoded tokens complete a stride: no slice or list made for it)
        j = (have + 1) * per - 1
        end = n * per
        if gid:                 # make_key(gid, h), inlined
            base = _GROUP_BASE[gid]
            while j < end:
                keys.append(ident[j] + base)
                j += per
        else:                   # group 0's keys are its identities
            while j < end:
                keys.append(ident[j])
                j += per
        return keys

    def append_tokens(self, new: list[int]) -> None:
        if len(new) == 1:
            row: list[Any] = new            # (the int object as it is: no unboxing, re-boxing)
            self.tokens.append(row[0])      # (one token: no iterator)
        else:
            self.tokens.extend(new)
        self._extend_ident()

    def ident_at(self, end: int) -> int | None:
        """Identity of the prefix ``[0, end)`` (``end`` a multiple of the unit), None if unknown."""
        k = end // self.unit - 1
        if k < 0:
            return 0x5EED
        return self.ident[k] if k < len(self.ident) else None

    @property
    def finished(self) -> bool:
        return self.status >= FINISHED


class BlockPool:
    """``BlockPool``: refcounts, ordered free queue and the GPU prefix cache.

    The free queue (``FreeKVCacheBlockQueue``) is, as in vLLM, a doubly linked list over the
    blocks, kept in two int lists: ``nxt[b]`` / ``prv[b]`` are the blocks after / before ``b``,
    with the null block 0 (never free) as the sentinel closing the ring (``nxt[0]`` is the head,
    ``prv[0]`` the tail). A block is in the queue exactly when its refcount is 0 (``ref[b] == 0``,
    the null block's is 1): the links of a block out of the queue are left as they were (stale),
    so that handing a block out writes its refcount only. ``free_queue()`` lists it head first."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # ids[b] is the int b, one object per block made here. The compiled build keeps an
        # ``int`` variable as a native int and makes a new int object each time it puts one
        # above 256 in a list (block IDs reach the pool size): where a block ID goes into a list
        # (nxt, prv, the blocks handed out, the prefix cache) the pool stores ids[b] instead, an
        # object read back as is (typed Any). Equal values: only the int objects differ.
        ids: list[Any] = list(range(num_blocks))
        self.ids = ids
        self.nxt: list[Any] = ids[1:] + [0]
        self.prv: list[Any] = [num_blocks - 1] + ids[:-1]
        self.n_free = num_blocks - 1
        self.ref = [0] * num_blocks
        self.key: list[Key | None] = [None] * num_blocks     # see make_key
        # The GPU prefix cache (BlockHashToBlockMap): ``cached[k]`` is the block a hit on key
        # ``k`` takes (get_one_block: the oldest block cached under ``k``). An entry is valid
        # only while that block still carries the key (``key[cached[k]] == k``): evicting a
        # block (clearing its key) leaves the entry behind, stale, so that the many evictions
        # of blocks alone under their key cost no dict operation (a dict operation hashes the
        # key, an int of up to 68 bits, afresh each time); a stale entry is overwritten when a
        # block is next cached under its key, and lookups check the block (``holder``). While
        # any block carries ``k``, ``cached[k]`` is valid.
        self.cached: dict[Key, Any] = {}
        # BlockHashToBlockMap keeps every block cached under a key (a block computed twice,
        # e.g. by two requests admitted before either cached it), in insertion order: the
        # blocks carrying one key form a chain from cached[k], ``later[b]`` / ``earlier[b]``
        # the block cached after / before ``b`` under its key (NULL: none), except that the
        # last block of a chain has ``later`` LAST: ``later[b] == NULL`` for a block alone
        # under its key (or carrying none), so that evicting it decides on one list read
        self.later: list[Any] = [NULL] * num_blocks
        self.earlier: list[Any] = [NULL] * num_blocks
        self.ref[NULL] = 1   # the null block is held by the pool itself

    def num_free(self) -> int:
        return self.n_free

    def is_free(self, b: int) -> bool:
        r: int = self.ref[b]
        return r == 0

    def free_queue(self) -> list[int]:
        """The free blocks, head (next allocated) first."""
        nxt, out = self.nxt, []
        b: int = nxt[NULL]
        while b != NULL:
            out.append(b)
            b = nxt[b]
        return out

    @property
    def free(self) -> dict[int, None]:
        """The free queue as an ordered dict of its blocks (a copy, for tests and checks)."""
        return dict.fromkeys(self.free_queue())

    def get_new_blocks(self, n: int) -> list[int]:
        key, ref, later = self.key, self.ref, self.later
        nxt, prv = self.nxt, self.prv
        if n > self.n_free:
            raise RuntimeError(f"{n} blocks asked of a free queue of {self.n_free}")
        out: list[int] = []
        bo: Any = nxt[NULL]             # (the queue holds the ids objects: appended as they are)
        b = bo
        j = 0
        while j < n:                            # the head of the free queue, in order
            out.append(bo)
            if key[b] is not None:      # evict from the GPU prefix cache (uncache, inlined
                # for a block alone under its key: its entry in ``cached`` goes stale)
                lb = later[b]
                if lb != NULL:
                    self._unchain(b)
                key[b] = None
            ref[b] = 1                  # (out of the queue: its links are left stale)
            bo = nxt[b]
            b = bo
            j += 1
        nxt[NULL] = bo
        prv[b] = NULL
        self.n_free -= n
        return out

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """``BlockPool.free_blocks``: blocks without a hash are prepended to the free queue in
        the order given (LIFO reuse), blocks carrying a hash are appended (LRU eviction)."""
        key, nxt, prv = self.key, self.nxt, self.prv
        ref: list[Any] = self.ref
        first: list[Any] = []
        n = 0
        # (items read as the int objects they are, see ids; a list walked by index)
        given: list[Any] = blocks if isinstance(blocks, list) else list(blocks)
        # the blocks going to the tail are chained after the tail as they come; the chain is
        # closed (nxt[last] = NULL, prv[NULL] = last) once, after the loop
        to: Any = prv[NULL]             # the tail (the null block: an empty queue)
        t = to
        tail = t
        for bo in given:
            b = bo
            if b == NULL:
                continue
            r = ref[b]
            r -= 1
            if r == 0:
                ref[b] = 0              # (a constant: no int object made from r)
                n += 1
                if key[b] is None:
                    first.append(bo)
                else:                   # to the tail
                    nxt[t] = bo
                    prv[b] = to
                    to, t = bo, b
                continue
            ref[b] = r
            if r < 0:
                if t != tail:
                    nxt[t] = NULL
                    prv[NULL] = to
                raise RuntimeError(f"block {b} freed twice")
        if t != tail:
            nxt[t] = NULL
            prv[NULL] = to
        if first:                       # to the head, in the order given
            ho: Any = nxt[NULL]
            h = ho
            i = len(first) - 1
            while i >= 0:
                bo = first[i]
                b = bo
                nxt[b] = ho
                prv[h] = bo
                ho, h = bo, b
                i -= 1
            nxt[NULL] = ho
            prv[h] = NULL
        self.n_free += n

    def touch(self, blocks: Iterable[int]) -> None:
        nxt, prv = self.nxt, self.prv
        ref: list[Any] = self.ref       # (see free_blocks)
        for b in blocks:
            if b == NULL:
                continue
            r = ref[b]
            if r == 0:                  # out of the free queue (its links left stale)
                po: Any = prv[b]
                qo: Any = nxt[b]
                p = po
                q = qo
                nxt[p] = qo
                prv[q] = po
                self.n_free -= 1
                ref[b] = 1              # (a constant: no int object made)
            else:
                ref[b] = r + 1

    def holder(self, k: Key) -> Any:
        """The block a hit on key ``k`` takes, None if no block carries ``k``."""
        bo = self.cached.get(k)
        if bo is None:
            return None
        b: int = bo
        kb = self.key[b]
        return bo if kb is not None and (kb is k or kb == k) else None   # (else stale)

    def cache(self, b: int, k: Key) -> None:
        """``_insert_block_hash``: block ``b`` (no key yet) gets key ``k``, even when another
        block carries it (then b comes last among its blocks)."""
        self.key[b] = k
        bo: Any = self.ids[b]
        held: int = self.cached.setdefault(k, bo)
        if held != b:
            self._join(b, k, held)

    def _join(self, b: int, k: Key, held: int) -> None:
        """``cache``'s rest, where ``cached[k]`` was ``held``, not b: b joins the blocks
        carrying ``k``, or holds ``k`` if the entry was stale."""
        kh = self.key[held]
        if kh is not None and (kh is k or kh == k):     # b comes last in held's chain
            later = self.later
            t = held
            lt = later[t]
            while lt > NULL:            # (NULL: held alone, LAST: the last of its chain)
                t = lt
                lt = later[t]
            later[t] = self.ids[b]
            self.earlier[b] = self.ids[t]
            later[b] = LAST
        else:
            self.cached[k] = self.ids[b]

    def uncache(self, b: int) -> None:
        """``_maybe_evict_cached_block``: block ``b`` loses its key (``BlockHashToBlockMap.pop``);
        the next block cached under it, if any, holds it."""
        if self.key[b] is None:
            return
        lb: int = self.later[b]
        if lb != NULL:
            self._unchain(b)
        self.key[b] = None          # (alone under its key: the entry goes stale)

    def _unchain(self, b: int) -> None:
        """Take ``b`` out of the chain of blocks carrying its key (two or more blocks)."""
        later, earlier = self.later, self.earlier
        lo: Any = later[b]
        eo: Any = earlier[b]
        lb = lo
        eb = eo
        if eb == NULL:                  # b held the key: the next block (lb > 0) holds it
            self.cached[self.key[b]] = lo
            earlier[lb] = NULL
            nb = later[lb]
            if nb == LAST:              # ... alone now
                later[lb] = NULL
        elif lb == LAST:                # b came last: eb does now, or is alone if it holds it
            pb = earlier[eb]
            later[eb] = LAST if pb != NULL else NULL
        else:
            later[eb] = lo
            earlier[lb] = eo
        later[b] = earlier[b] = NULL


class GroupRule:
    __slots__ = ("gid", "kind", "code", "bs", "window", "chunk", "cacheable", "drafter", "align",
                 "spec")

    def __init__(self, gid: int, group, block_size: int, enable_prefix_caching: bool):
        # (typed attributes: native arithmetic and tests in the compiled build)
        self.gid, self.bs = gid, block_size
        self.kind: str = group.kind
        self.code: int = _KIND_CODE[group.kind]
        self.window: int = group.sliding_window or 0
        self.chunk: int = group.attention_chunk_size or 0
        self.drafter: bool = bool(group.drafter)
        self.cacheable: bool = bool(enable_prefix_caching and group.prefix_cacheable and not (
            group.kind == "mamba" and group.mamba_cache_mode != "align"))
        # MambaManager in ``mamba_cache_mode == "align"``: one running state block per request
        # (see KVCacheManager.allocate, remove_skipped_blocks, admission_blocks, cache_blocks)
        self.align: bool = group.kind == "mamba" and group.mamba_cache_mode == "align"
        # what the group's KVCacheSpec compares equal by (the harness gives every attention
        # spec the same heads and dtype): groups of one spec share a SpecGroup
        self.spec: tuple = (self.kind, block_size, self.window, self.chunk,
                            group.mamba_cache_mode if group.kind == "mamba" else None)

    def skipped_tokens(self, computed: int) -> int:
        """``get_num_skipped_tokens``: tokens out of this group's reach."""
        code = self.code
        if code == SLIDING:
            return max(0, computed - self.window + 1)
        if code == CHUNKED:
            return computed // self.chunk * self.chunk
        if code == MAMBA:
            return max(0, computed - 1)
        return 0


class KVCacheManager:
    """``KVCacheManager`` + coordinator over one :class:`BlockPool`."""

    def __init__(self, groups, block_sizes: list[int], num_blocks: int, align: int,
                 enable_prefix_caching: bool = True, max_in_flight_tokens: int | None = None,
                 mamba_tail_recache: int = 0, retention_interval: int | None = None):
        self.pool = BlockPool(num_blocks)
        self.rules = [GroupRule(i, g, bs, enable_prefix_caching)
                      for i, (g, bs) in enumerate(zip(groups, block_sizes))]
        # ``max_admission_blocks_per_request`` of the recycling specs (SlidingWindowSpec:
        # cdiv(window - 1 + in_flight, bs) + 1; ChunkedLocalAttentionSpec: cdiv(chunk +
        # in_flight, bs)), in_flight = VllmConfig.max_in_flight_tokens (max_num_batched_tokens
        # times the concurrent batches); None: no cap
        self.admission_cap: list[int | None] = []
        for r in self.rules:
            cap = None
            if max_in_flight_tokens is not None and r.code == SLIDING:
                cap = -(-(r.window - 1 + max_in_flight_tokens) // r.bs) + 1
            elif max_in_flight_tokens is not None and r.code == CHUNKED:
                cap = -(-(r.chunk + max_in_flight_tokens) // r.bs)
            self.admission_cap.append(cap)
        self.align = align
        # enable_partial_hash_hits (geometry.partial_hash_hits) and the hash unit; set by the
        # model. With partial hits the managers' cache_hit_alignment_tokens is the hash unit
        self.partial_hash_hits = False
        self.tokens_per_hash = align
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len: int = 0         # set by the model (0: no cap)
        # a mamba group without align mode disables GPU prefix hits altogether
        self.hits_possible = enable_prefix_caching and not any(
            r.code == MAMBA and not r.cacheable for r in self.rules)
        self.cacheable_rules = [r for r in self.rules if r.cacheable]
        # the coordinator's eagle_group_ids: the drafter groups (is_eagle_group), else every
        # group; verify_and_split_kv_cache_groups then marks every group whose spec equals an
        # EAGLE group's (one SpecGroup; is_draft is no part of the spec's equality) use_eagle
        self.has_drafter = any(r.drafter for r in self.rules)
        self.drafter_specs = {r.spec for r in self.cacheable_rules if r.drafter}
        # the cacheable groups other than full attention (get_computed_blocks checks their reach
        # at a hit)
        self.rest_rules = [r for r in self.cacheable_rules if r.code != FULLISH]
        # get_computed_blocks's per rest group state during a search: the run of blocks found cached
        # [reach_lo[x], reach_hi[x]) and the group's key list
        self.reach_lo = [0] * len(self.rest_rules)
        self.reach_hi = [0] * len(self.rest_rules)
        self.reach_keys: list[list[Key]] = [[] for _ in self.rest_rules]
        self.junction = 0          # the last get_computed_blocks's shared_prefix_boundary
        # allocate's plan, per rule: null placeholders, new blocks (a scratch list of this
        # manager, overwritten at each call: no list made per allocation)
        self.plan = [0] * (2 * len(self.rules))
        # use_eagle_block_drop (EAGLE-style speculative decoding): the last block of a GPU
        # prefix hit is dropped, the drafter needs the tokens before the generation point
        # recomputed (find_longest_cache_hit(drop_eagle_block)); set by the model
        self.eagle_drop = False
        # 0.32.0+, several groups (HybridKVCacheCoordinator): an EAGLE group matches one block
        # past the candidate hit before dropping one (eagle_proof_margin); set by the model
        self.eagle_margin = False
        # a cacheable group whose find_longest_cache_hit never drops EAGLE's block: Mamba (draft
        # models have no Mamba layers) and chunked local attention (it asserts drop_eagle_block
        # is False; with the assert stripped it ignores it). Then the hit must end where such a
        # group holds a block: see get_computed_blocks
        self.eagle_keepers = any(r.align or r.code == CHUNKED for r in self.cacheable_rules)
        # the full-attention groups get_computed_blocks bounds the hit with first
        self.full_rules = [r for r in self.cacheable_rules if r.code == FULLISH]
        # align-mode Mamba groups (MambaManager, mamba_cache_mode == "align")
        self.align_rules = [r for r in self.rules if r.align]
        # MambaManager._num_retired_blocks: (gid, rid) -> blocks below it already nulled
        self.retired: dict[tuple[int, str], int] = {}
        # MambaManager.cached_blocks_this_step: keys of the Mamba blocks cached in this step
        # (cleared by new_step, KVCacheManager.new_step_starts at the start of schedule())
        self.cached_this_step: set = set()
        # MambaManager._pending_boundary_state_offloads: (rid, gid, block, boundary tokens) of
        # every align-mode Mamba block cached in this step, drained by take_offers
        # (KVCacheManager.take_boundary_state_offloads, once per step for the connector)
        self.offers: list[tuple[str, int, int, int]] = []
        # 0.32.0's MambaManager._cache_partial_tail_block re-registers the state block at the
        # prompt's last hash boundary, (num_prompt - 1) // tph * tph, whenever cache_blocks is
        # called there, although the block is already keyed at that boundary (0.33.0 returns
        # early: "re-caching would mark it cached this step and defer every sibling that hits
        # it"; 0.30.0/0.31.0 skip a Mamba block equal to the hash block): the block counts as
        # cached this step again. The hash unit tph when the rule applies, else 0.
        self.mamba_tail_recache = mamba_tail_recache
        # KVCacheConfig.prefix_cache_retention_interval (the coordinator's retention_interval:
        # None dense, 0 reachable boundaries only, > 0 also one checkpoint per interval), read by
        # the sliding-window and Mamba masks of cache_blocks (_reachable_mask)
        self.retention: int | None = retention_interval
        # the replay boundaries' EAGLE pair (get_replay_boundaries, 0.30.0+) and the block below
        # the junction kept by an EAGLE sliding-window group (cache_blocks, 0.33.0); set by the
        # model from its profile
        self.eagle_replay_pair = False
        self.eagle_junction_below = False

    def new_step(self) -> None:
        """``KVCacheManager.new_step_starts``."""
        if self.cached_this_step:
            self.cached_this_step.clear()

    def take_offers(self) -> list[tuple[str, int, int, int]]:
        """``take_boundary_state_offloads``: this step's Mamba boundary states, in offer order."""
        out, self.offers = self.offers, []
        return out

    # --- GPU prefix cache ------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> int:
        """``get_computed_blocks``: tokens served by the GPU prefix cache (every group hits).

        Also sets ``self.junction``, the ``shared_prefix_boundary`` it returns: the full-attention
        groups' longer hit when another group cut the hit short (``find_longest_cache_hit``'s
        ``num_uncached_common_prefix_tokens``), else 0."""
        self.junction = 0
        if not self.hits_possible or not self.cacheable_rules:
            return 0
        pool = self.pool
        cached, pkey = pool.cached, pool.key
        align = self.align
        # max_cache_hit_length: the last token is recomputed for its logits
        L = req.num_tokens - 1
        # an EAGLE sliding-window group (no Mamba or chunked local group beside it) drops the
        # block for the whole hit after its reach search (the peek, below); else every EAGLE
        # full-attention group matches past the candidate and drops its own block (_eagle_reach)
        drop_last = self.eagle_drop and not self.eagle_keepers and any(
            r.code == SLIDING and self.use_eagle(r) for r in self.rest_rules)
        if drop_last or not self.full_rules:
            L = L // align * align
            if drop_last and self.eagle_margin and L >= 0:
                # the keys of known tokens bound it (len(block_hashes) * hash_block_size)
                L += min(r.bs for r in self.cacheable_rules)
        # req.hit_blocks[gid]: the blocks this search found cached under the group's keys, by
        # key index (a waiting request that cannot be admitted searches again at every step):
        # a full-attention group's run from its first key, another group's blocks found in its
        # reach (NULL where none was). A block still carrying its key proves the key still
        # cached (BlockPool: a key stays in ``cached`` while a block carries it), for a list
        # read instead of a dict lookup; a block that lost its key is looked up again (and ends
        # a full-attention group's run)
        memo = req.hit_blocks
        if not memo:
            memo = req.hit_blocks = [[] for _ in self.rules]
        for r in self.cacheable_rules:        # full-attention prefix bound first
            if r.code != FULLISH:
                continue
            # the longest run of cached blocks from the start (a block whose tokens are not all
            # known has no key: the run stops there)
            keys = req.keys(r.gid, r.bs)
            bs = r.bs
            eagle = not drop_last and self.use_eagle(r)
            m = self._eagle_reach(req, L, bs) // bs if eagle else L // bs
            nkeys = len(keys)
            if nkeys < m:
                m = nkeys
            known = memo[r.gid]
            n = 0
            for bk, k in zip(known, keys):      # (items read inline, no bounds-checked calls)
                if n == m:
                    break
                bi = bk
                kb = pkey[bi]
                if kb is None or (kb is not k and kb != k):
                    del known[n:]
                    break
                n += 1
            while n < m:
                k = keys[n]
                bo: Any = cached.get(k)
                if bo is None:
                    break
                bi = bo
                kb = pkey[bi]
                if kb is None or (kb is not k and kb != k):   # stale (BlockPool.holder)
                    break
                if n == len(known):
                    known.append(bo)
                n += 1
            hit = n * bs
            if eagle and hit > 0:
                # FullAttentionManager.find_longest_cache_hit(drop_eagle_block): the drafter
                # needs the tokens before the generation point recomputed
                hit -= min(align, bs)
            if hit < L:
                L = hit
            L = L // align * align
        if self.eagle_drop and self.eagle_keepers and not self.full_rules:
            # one Mamba or chunked local group (UnitaryKVCacheCoordinator): nothing drops, and
            # no group matches past the candidate hit (no eagle_proof_margin)
            L = (req.num_tokens - 1) // align * align
        # the full-attention blocks of [0, L) were all found above (L only shrinks): the
        # check below only needs the other groups. Where a group misses block j of its reach
        # at L, it misses it at every smaller L whose reach still covers j (the reach's start,
        # skipped_tokens, only grows with L): the search resumes at the largest L that ends at
        # or before block j (the same first L that succeeds as trying every multiple of align).
        # Any missing block of the reach will do: the lowest one skips the most candidates, so
        # the reach is searched from its start; the run of blocks found cached ([ok_lo[x],
        # ok_hi[x]) for the x-th rest group) is not looked up again at a smaller L
        rest = self.rest_rules
        full_hit = L
        if rest:
            # (scratch lists of this manager, reset here: no lists made per search)
            ok_lo: list[Any] = self.reach_lo
            ok_hi: list[Any] = self.reach_hi
            rest_keys = self.reach_keys
            # SlidingWindowManager.find_longest_cache_hit(drop_eagle_block): the run of cached
            # blocks it needs counts EAGLE's peek block (_contiguous_blocks_for_hit: one more),
            # popped after the match, so the window of the hit L minus that block reaches one
            # block below L's window
            peek = 1 if drop_last else 0
            x = 0
            for r in rest:
                ok_lo[x] = ok_hi[x] = 0
                rest_keys[x] = req.keys(r.gid, r.bs)
                x += 1
            while L > 0:
                x = 0
                for r in rest:
                    bs = r.bs
                    hi = L // bs
                    lo = r.skipped_tokens(L) // bs
                    if peek and r.code == SLIDING and lo > 0:
                        lo -= 1
                    if r.code == SLIDING and lo >= hi > 0:
                        # find_longest_cache_hit matches only where it finds a cached block: a
                        # one-token window, which needs none, still needs the hit's last one
                        lo = hi - 1
                    keys = rest_keys[x]
                    known = memo[r.gid]
                    n = len(keys)
                    a = ok_lo[x]
                    z = ok_hi[x]
                    j = lo
                    while j < hi:
                        if a <= j < z:
                            j = z
                            continue
                        if j >= n:
                            break
                        k = keys[j]
                        nk = len(known)
                        if j < nk:
                            bi = known[j]
                            kb = pkey[bi]
                            if kb is not None and (kb is k or kb == k):
                                j += 1
                                continue
                        bo = cached.get(k)
                        if bo is None:
                            break
                        bi = bo
                        kb = pkey[bi]
                        if kb is None or (kb is not k and kb != k):     # stale (holder)
                            break
                        if j < nk:
                            known[j] = bo
                        else:
                            if j > nk:
                                known.extend([NULL] * (j - nk))
                            known.append(bo)
                        j += 1
                    if j < hi:                    # block j is missing
                        if j > lo:
                            ok_lo[x], ok_hi[x] = lo, j
                        L = ((j + 1) * bs - 1) // align * align
                        break
                    x += 1
                else:
                    break                         # every group hits at L
        if rest and full_hit > L and len(rest) < len(self.cacheable_rules):
            self.junction = full_hit
        if drop_last and L > 0:
            L = (L - min(align, min(r.bs for r in self.cacheable_rules))) // align * align
        return L

    def _eagle_reach(self, req: Request, L: int, bs: int) -> int:
        """How far an EAGLE full-attention group of block size ``bs`` matches at the candidate
        hit ``L``: one block past it, which it drops after the match (the coordinator's
        ``_max_length``, ``HybridKVCacheCoordinator.find_longest_cache_hit``), capped by
        ``max_cache_hit_length`` (up to 0.31.0: no margin at the first candidate, the request's
        tokens but one) or by the keys of known tokens (0.32.0+,
        ``len(block_hashes) * hash_block_size``: the group's keys bound the run). One group
        (``UnitaryKVCacheCoordinator``): no margin, ``L`` itself."""
        if not self.eagle_margin:
            return min(L + bs, req.num_tokens - 1) if len(self.rules) > 1 else L
        return L + bs

    def _hit_block(self, known: list[Any], j: int, k: Key) -> Any:
        """The block a hit on ``k``, a group's ``j``-th key, takes (``cached[k]``, valid: a hit's
        blocks carry their keys): ``known[j]``, get_computed_blocks's block
        (``Request.hit_blocks``), if it still carries ``k`` first of its chain (``earlier`` NULL:
        then it is ``cached[k]``), for
        list reads instead of a dict lookup; else ``cached[k]``."""
        pool = self.pool
        if j < len(known):
            bo = known[j]
            b = bo
            e = pool.earlier[b]
            kb = pool.key[b]
            if e == NULL and kb is not None and (kb is k or kb == k):
                return bo
        return pool.cached[k]

    def apply_hit(self, req: Request, L: int, total: int | None = None) -> None:
        """Take the hit blocks (``save_new_computed_blocks``): the null block for the blocks out
        of reach at ``total`` computed tokens (the hit plus the connector's tokens; default
        ``L``), the hit blocks in reach touched. The hit blocks count as cached
        (``num_cached_block``): ``cache_blocks`` starts after them."""
        pool = self.pool
        req.quiet_until = -1
        if total is None:
            total = L
        done = req.num_cached_blocks
        memo = req.hit_blocks
        for r in self.rules:
            table = req.tables[r.gid]
            if not r.cacheable or L == 0:
                continue
            n = L // r.bs
            first = r.skipped_tokens(total) // r.bs
            if n < first:
                first = n
            table.extend([NULL] * first)
            keys = req.keys(r.gid, r.bs)
            known = memo[r.gid] if memo else []
            blocks = [self._hit_block(known, j, keys[j]) for j in range(first, n)]
            pool.touch(blocks)
            table.extend(blocks)
            done[r.gid] = len(table)

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Put the full blocks of ``[0, num_tokens)`` in the GPU prefix cache."""
        pool = self.pool
        key, cached = pool.key, pool.cached
        done: list[Any] = req.num_cached_blocks
        aligned = self.cacheable_tokens(num_tokens)
        tph = self.mamba_tail_recache
        if tph and self.align_rules:
            # the tokens the coordinator caches, of the known tokens (allocate_slots' cap)
            t = self.cacheable_tokens(min(num_tokens, req.num_tokens))
            if t and t % tph == 0 and t == (req.num_prompt - 1) // tph * tph:
                for r in self.align_rules:
                    table = req.tables[r.gid]
                    i = -(-t // r.bs) - 1
                    if r.cacheable and i < len(table) and table[i] != NULL \
                            and key[table[i]] is not None and t % r.bs == 0:
                        self.cached_this_step.add(key[table[i]])
        for r in self.cacheable_rules:
            gid, table = r.gid, req.tables[r.gid]
            i = done[gid]
            nt = aligned
            if aligned > 0 and aligned < num_tokens and self.use_eagle(r):
                # get_num_cacheable_tokens: an EAGLE group's lookup matches one block past the
                # aligned boundary before it drops it, so that block is cached too
                nt = min(num_tokens, aligned + r.bs)
            bs = r.bs
            n = nt // bs
            nb = len(table)
            if n > nb:
                n = nb
            if i >= n:
                continue
            keys = req.keys(r.gid, r.bs)
            m = len(keys)
            if n < m:
                m = n
            row: list[Any] = table      # (items read as the int objects they are: BlockPool.ids)
            # cache_full_blocks(block_mask): a sparse group skips the blocks no later request
            # can reach; they stay uncached for good (num_cached_block moves past them)
            mask = self._reachable_mask(req, r, i, n) if r.code == SLIDING or r.align else None
            for j in range(i, m):
                if mask is not None and not mask[j - i]:
                    continue
                bo = row[j]
                b = bo
                if b != NULL and key[b] is None:      # BlockPool.cache, inlined
                    k = keys[j]
                    key[b] = k
                    held = cached.setdefault(k, bo)
                    if held != b:
                        pool._join(b, k, held)
            if r.align:
                # MambaManager.cache_blocks: every state block cached now is offered to the
                # connector with the boundary it summarises, and marked cached this step
                for j in range(i, m):
                    b = table[j]
                    if b != NULL and key[b] is not None:
                        self.offers.append((req.rid, gid, b, (j + 1) * bs))
                        self.cached_this_step.add(key[b])
            if i < m:
                i = m
            while i < n:                              # past the known tokens: no key
                b = table[i]
                if b != NULL and key[b] is None:
                    break
                i += 1
            done[gid] = i

    def cacheable_tokens(self, num_tokens: int) -> int:
        """``HybridKVCacheCoordinator.cache_blocks``: of several groups, a GPU prefix hit is a
        multiple of the scheduler block size (``find_longest_cache_hit``), so only the tokens up
        to the last such boundary are cached (``_align_cacheable``, 0.28.0+; the rounding in
        ``cache_blocks`` before): a block past it is freed unhashed, to the front of the free
        queue. The unitary coordinator of one group caches every full block, and so does the
        hybrid one with fine-grained hash hits (``geometry.partial_hash_hits``; the hits
        themselves are not modelled at hash-block granularity)."""
        if len(self.rules) > 1 and not self.partial_hash_hits:
            return num_tokens // self.align * self.align
        return num_tokens

    def use_eagle(self, r: GroupRule) -> bool:
        """``manager.use_eagle``: EAGLE-style drafting, and the group a drafter group or of the
        spec of one (every group when no group is a drafter)."""
        return self.eagle_drop and (not self.has_drafter or r.spec in self.drafter_specs)

    def _reachable_mask(self, req: Request, r: GroupRule, start: int, end: int
                        ) -> list[bool] | None:
        """``reachable_block_mask`` of the sliding-window or align-mode Mamba group ``r`` for
        blocks ``start..end-1``, as ``SingleTypeKVCacheManager.cache_blocks`` asks for it: the
        coordinator's retention interval, alignment ``cache_hit_alignment_tokens`` (the
        scheduler block size; the hash unit with fine-grained hash hits), the request's replay
        boundaries and its shared-prefix junction
        (with EAGLE, 0.33.0, a sliding-window group also keeps the junction one block lower).
        None: every block (dense)."""
        retention, align, bs = self.retention, self.align, r.bs
        # the masks align boundaries to cache_hit_alignment_tokens (replay_boundaries to the
        # scheduler block)
        hit_align = self.tokens_per_hash if self.partial_hash_hits else align
        eagle, group_eagle = self.eagle_drop, self.use_eagle(r)
        need = -(-(r.window - 1) // bs) + (1 if group_eagle else 0)
        if retention is None and (r.align or need >= align // bs):
            return None                 # dense (the common case: no boundaries to work out)
        boundaries = list(replay_boundaries(req.num_prompt, align,
                                            self.eagle_replay_pair and eagle))
        junction = req.shared_prefix_boundary
        if junction:
            boundaries.append(junction)
            if group_eagle and self.eagle_junction_below and not r.align:
                boundaries.append(junction - bs)
        if r.align:
            return mamba_reachable_blocks(start, end, hit_align, bs, retention, boundaries)
        return window_reachable_blocks(start, end, hit_align, bs, need, 1 if group_eagle else 0,
                                       retention, boundaries)

    # --- admission gates (Scheduler.schedule, waiting loop) ---------------------------------
    def admission_blocks(self, req: Request, hit: int, total: int, num_tokens: int,
                         capped: bool, lookahead: int = 0) -> int:
        """``coordinator.get_num_blocks_to_allocate`` for a request about to take a GPU prefix hit
        of ``hit`` tokens (blocks not touched yet) with ``total`` tokens computed (hit plus
        connector tokens), slots for ``num_tokens`` tokens; ``capped``: ``apply_admission_cap``
        (the full-sequence gate). Per group (``SingleTypeKVCacheManager.get_num_blocks_to_allocate``):
        a request that already holds blocks (after a load) needs ``required - held``; a fresh one
        needs ``required - max(skipped blocks, hit blocks)`` plus its evictable hit blocks (ref 0,
        taken out of the free queue when touched); a ring needs its one block. ``lookahead``:
        the EAGLE lookahead slots among ``num_tokens``, which align-mode Mamba does not count
        (``num_tokens_main_model``)."""
        need = 0
        nt = num_tokens
        pool = self.pool
        for r, cap in zip(self.rules, self.admission_cap):
            table = req.tables[r.gid]
            if r.code == RING:
                need += 0 if table else 1
                continue
            if r.align:
                # MambaManager.get_num_blocks_to_allocate, align mode: a hit whose state block
                # another request cached in this step cannot be used yet (num_gpu_blocks + 1:
                # never fits); the blocks still missing, at most one (the new running state;
                # num_speculative_blocks is 0), plus the evictable hit block
                n = -(-(nt - lookahead) // r.bs) - len(table)
                if not table and r.cacheable and hit:
                    n_hit = hit // r.bs
                    n -= n_hit
                    k = req.keys(r.gid, r.bs)[n_hit - 1]
                    if k in self.cached_this_step:
                        return pool.num_blocks + 1
                    hb = pool.cached[k]
                    if pool.ref[hb] == 0:
                        need += 1
                need += 1 if n > 0 else n
                continue
            required = -(-nt // r.bs)
            if capped and cap is not None and cap < required:
                required = cap
            if table:
                have = len(table)
                if required > have:
                    need += required - have
                continue
            n_hit = hit // r.bs if (r.cacheable and hit) else 0
            skipped = r.skipped_tokens(total) // r.bs
            hi = n_hit if n_hit > skipped else skipped
            if required > hi:
                need += required - hi
            if skipped < n_hit:
                # the evictable hit blocks (refcount 0)
                ref, keys = pool.ref, req.keys(r.gid, r.bs)
                memo = req.hit_blocks
                known = memo[r.gid] if memo else []
                for j in range(skipped, n_hit):
                    hb = self._hit_block(known, j, keys[j])
                    if ref[hb] == 0:
                        need += 1
        return need

    def remaining_blocks(self, req: Request) -> int:
        """``Scheduler._request_remaining_blocks``: blocks an in-flight prefill (or load) still
        needs to hold its full sequence (admission cap applied)."""
        return self.admission_blocks(req, 0, req.num_computed, req.num_tokens, True)

    # --- allocation ------------------------------------------------------------------------
    def remove_skipped_blocks(self, req: Request, computed: int) -> None:
        """``remove_skipped_blocks``: every group frees its blocks out of reach at ``computed``
        tokens (the null block takes their place)."""
        for r in self.rules:
            if r.code in (FULLISH, RING):
                continue
            table = req.tables[r.gid]
            n = r.skipped_tokens(computed) // r.bs
            nb = len(table)
            if nb < n:
                n = nb
            if r.align:
                # MambaManager._remove_blocks_in_range, align mode: prefill leaves null gaps
                # between states; every state block in [retired, n) is freed, tail first.
                # (The running block of two steps ago, last_state_block_idx, lies in that
                # range whenever its own rule would free it.)
                rk = (r.gid, req.rid)
                first = self.retired.get(rk, 0)
                if first >= n:
                    continue
                group = [table[i] for i in range(n - 1, first - 1, -1) if table[i] != NULL]
                for i in range(first, n):
                    table[i] = NULL
                if group:
                    self.pool.free_blocks(group)
                self.retired[rk] = n
                continue
            row: list[Any] = table      # (items read as the int objects they are: BlockPool.ids)
            i = n - 1
            if i < 0:
                continue
            bo = row[i]
            b = bo
            if b == NULL:
                continue                # nothing (more) out of reach: no list made
            lo = i                 # the run of real blocks ending at n - 1: [lo, n)
            while lo > 0:
                bo = row[lo - 1]
                b = bo
                if b == NULL:
                    break
                lo -= 1
            group = row[lo:n]           # (a slice and a reversal in C: no append per block)
            group.reverse()             # tail first
            while i >= lo:
                table[i] = NULL
                i -= 1
            # one BlockPool.free_blocks call per group (_remove_blocks_in_range): unhashed
            # blocks of a later group go in front of an earlier group's
            self.pool.free_blocks(group)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: int | None = None,
                 cache_upto: int | None = None, reserved: int = 0,
                 processed: int | None = None, lookahead: int = 0) -> list[list[int]] | None:
        """``allocate_slots``: blocks for ``[0, computed + num_new_tokens + lookahead)``
        (``num_lookahead_tokens``: the slots an EAGLE-style drafter writes past the scheduled
        tokens); None if the pool is dry.
        ``processed``: the tokens whose output is processed (``num_computed_tokens -
        num_in_flight_tokens`` under async scheduling): blocks out of a window are freed on that
        basis (``remove_skipped_blocks``), while the blocks to add count ``computed``.

        Returns the new block IDs per group (null placeholders included, as vLLM reports them).
        """
        if computed is None:
            c = req.num_computed
            if (num_new_tokens == 1 and c <= req.quiet_until
                    and cache_upto == c + 1 and not lookahead):
                return [[] for _ in self.rules]     # a decode step that changes nothing
        else:
            c = computed
        self.remove_skipped_blocks(req, c if processed is None else processed)
        # num_tokens_need_slot: the lookahead slots never past max_model_len (allocate_slots:
        # min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len))
        main = c + num_new_tokens
        total = main + lookahead
        cap = self.max_model_len
        if cap > 0 and total > cap:
            total = cap
        tables = req.tables
        # per rule: null placeholders, new blocks
        plan: list[Any] = self.plan
        need = 0
        x = 0
        for r in self.rules:
            have = len(tables[r.gid])
            if r.code == RING:
                n = 0 if have else 1
                plan[x] = 0
                plan[x + 1] = n
                need += n
                x += 2
                continue
            bs = r.bs
            # align-mode Mamba allocates no slots for lookahead tokens (MambaManager: they would
            # break the block alignment, and draft models have no Mamba layers)
            target = -(-(main if r.align else total) // bs)
            if target <= have:
                plan[x] = 0
                plan[x + 1] = 0
                x += 2
                continue
            if r.align:
                # MambaManager.allocate_new_blocks, align mode: nulls up to the last block, one
                # new block there for the running state
                plan[x] = target - 1 - have
                plan[x + 1] = 1
                need += 1
                x += 2
                continue
            nulls = r.skipped_tokens(c) // bs
            if target < nulls:
                nulls = target
            nulls -= have
            if nulls < 0:
                nulls = 0
            n = target - have - nulls
            plan[x] = nulls
            plan[x + 1] = n
            need += n
            x += 2
        # allocate_slots: ``reserved_blocks`` stay free for the in-flight prefills
        pool = self.pool
        if need > pool.n_free - reserved:
            return None
        out: list[list[int]] = []
        x = 0
        for r in self.rules:
            nulls = plan[x]
            n = plan[x + 1]
            x += 2
            if nulls:
                new = [NULL] * nulls
                if n:
                    new += pool.get_new_blocks(n)
            elif n:
                new = pool.get_new_blocks(n)
                if n == 1:
                    # one block (a decode step reaching a new block): appended (list.extend is
                    # a slice assignment, about 300 instructions more, most of them a realloc)
                    one: list[Any] = new        # (the block's int object as it is)
                    tables[r.gid].append(one[0])
                    out.append(new)
                    continue
            else:
                out.append([])
                continue
            tables[r.gid].extend(new)
            out.append(new)
        if cache_upto is not None and self.cacheable_rules:
            self.cache_blocks(req, cache_upto)
        req.quiet_until = self.quiet_bound(req)
        return out

    def quiet_bound(self, req: Request) -> int:
        """The largest ``num_computed`` up to which ``allocate(req, 1, cache_upto=num_computed +
        1)`` is a no-op given the current tables (no skipped block to free, no block to add, no
        block to offer to the prefix cache); -1 if none. Freeing blocks, a hit or caching only
        make the real bound larger, so a stale bound is safe; ``free``/``apply_hit`` reset it."""
        # no bound yet: past every position (and below 2**62, the compiled build's tagged ints,
        # so a constant, not an int object converted at each call)
        bound = (1 << 62) - 1
        tables = req.tables
        done: list[Any] = req.num_cached_blocks
        leads: list[Any] = req.leads
        hybrid = len(self.rules) > 1
        align = self.align
        for r in self.rules:
            table = tables[r.gid]
            have = len(table)
            bs = r.bs
            code = r.code
            if code == RING:
                if not have:
                    return -1
                continue
            b = have * bs - 1                     # ceil((c + 1) / bs) <= have
            if b < bound:
                bound = b
            if code != FULLISH:                        # remove_skipped_blocks stays a no-op
                lead = leads[r.gid]               # the index of the first real block
                first = lead
                while lead < have and table[lead] == NULL:
                    lead += 1
                if lead != first:
                    leads[r.gid] = lead
                if lead < have:
                    m = (lead + 1) * bs           # skipped_tokens(c) < m
                    if code == SLIDING:
                        b = m + r.window - 2
                    elif code == CHUNKED:
                        b = (m - 1) // r.chunk * r.chunk + r.chunk - 1
                    else:                              # MAMBA
                        b = m
                    if b < bound:
                        bound = b
            if r.cacheable:                            # cache_blocks stays a no-op
                d = done[r.gid]
                if d < have:
                    # block d is cached once cacheable_tokens reaches its end: with several
                    # groups at the first scheduler block boundary past it (an EAGLE group may
                    # cache it sooner: its end bounds it then)
                    e = (d + 1) * bs
                    if hybrid and not self.use_eagle(r):
                        e = -(-e // align) * align
                    b = e - 2
                    if b < bound:
                        bound = b
        return bound

    def free(self, req: Request) -> None:
        """Free every block of ``req``, tail first."""
        req.quiet_until = -1
        req.num_cached_blocks = [0] * len(req.tables)
        req.leads = [0] * len(req.tables)
        if self.align_rules:
            self.forget(req)
        for table in req.tables:
            table.reverse()                     # tail first (the table is emptied below)
            self.pool.free_blocks(table)
            table.clear()

    def forget(self, req: Request) -> None:
        """``MambaManager.pop_blocks_for_free``: the request's align-mode Mamba state (retired
        blocks) and its pending offers are dropped (also when its blocks are freed later)."""
        for r in self.align_rules:
            self.retired.pop((r.gid, req.rid), None)
        if self.offers:
            self.offers = [o for o in self.offers if o[0] != req.rid]

    def num_held(self) -> int:
        return self.pool.num_blocks - 1 - self.pool.num_free()
