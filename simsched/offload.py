"""The offloading scheduler (``OffloadingConnectorScheduler``) and the CPU tier, simplified.

Mirrors ``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`` (0.29.0-0.33.0):
``RequestOffloadState`` (offload keys grown from block hashes, block IDs, next chunk to store),
``storable_chunks``, ``_build_store_jobs`` with its ``assert len(offload_keys) ==
len(offload_block_ids)``, ``get_num_new_matched_tokens`` / ``_lookup_complete_chunks``,
``update_state_after_alloc`` (load jobs), ``_update_req_states``, ``build_connector_meta`` (flush
of fenced blocks that get re-allocated), ``update_connector_output`` and ``request_finished``;
and ``vllm/v1/kv_offload/cpu/manager.py`` with the LRU policy (chunks being written are not
readable and not evictable; chunks being loaded are not evictable).

An offload key is ``(group_id, block_hash)`` as in ``make_offload_key``, kept as one int
(``allocator.make_key``, taken apart by ``key_group`` / ``key_ident``); every key also has a
request-relative hash index (kept beside it) for traces. Where vLLM raises, the model raises
:class:`ModelCrash` (a :class:`~simsched.geometry.ConfigError`) naming the vLLM function.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    # i64: mypyc's native 64-bit int, an annotation only (never evaluated: from __future__
    # import annotations), so that nothing at run time needs mypy_extensions: the release
    # workers import these modules in vLLM's environments
    from mypy_extensions import i64

from simsched.allocator import (ABORTED, INTS, NULL, Key, Request, ints_to, key_group,
                                make_key, window_reachable_blocks)
from simsched.geometry import (SCHEDULER_PY, ConfigError, Geometry, GroupGeometry, Profile,
                               offload_key_indices, prefix_cacheable_groups,
                               retention_interval)

# CPUTier.lookup results (Final: constants mypyc inlines, no module-dict lookup at each use)
MISS: Final = 0
HIT: Final = 1
HIT_PENDING: Final = 2


class ModelCrash(ConfigError):
    """An exception the real scheduler raises at run time (stage = the vLLM function's role)."""

    def __init__(self, exception: str, function: str, stage: str, message: str,
                 file: str = SCHEDULER_PY):
        super().__init__(exception, function, file, stage, message)




class CPUTier:
    """``CPUOffloadingManager`` with the LRU policy; capacity in chunks.

    A chunk's state is kept by slot, with no object per chunk: ``entries`` maps its key to its
    slot, an index into the parallel lists ``ready`` (its store completed), ``refs`` (loads in
    flight: vLLM's ``ref_cnt``), ``content`` (what it holds, once ready) and ``rank`` (its
    recency rank, :class:`RankedCPUTier`, or stamp, :class:`ListCPUTier`). The slots of evicted
    chunks are reused (``free``); a slot not in use is not ready and holds no load or content.

    Only eviction frees a slot, and it takes ready chunks with no load in flight: the chunks of a
    store job (not ready until it completes; no other job stores them) and of a load job (its
    load counted) keep their slots while the job is in flight. So a job keeps its chunks' slots
    (Job.slots, from :meth:`prepare_store_slots` and :meth:`prepare_load`) and its completion
    and the model's reads of it use them, with no lookup of the keys again."""

    def __init__(self, capacity: int, evictable_list: bool = False):
        self.capacity = capacity
        # 0.25.1-0.30.0's LRUCachePolicy keeps an evictable list: a chunk joins its MRU end when
        # it becomes evictable (store or last load completes) and touches move only evictable
        # chunks; 0.31.0+ rank chunks instead (RankedCPUTier)
        self.evictable_list = evictable_list
        # key -> slot. ``lru``: the LRU order (first = least recently used): with the evictable
        # list, the evictable chunks only (ready, ref_cnt 0; the positions of the others never
        # matter: they join the MRU end when they become evictable), else the same mapping as
        # ``entries``, ordered (RankedCPUTier keeps a plain dict and no LRU order)
        self.lru: OrderedDict[Key, int] = OrderedDict()
        self.entries: dict[Key, int] = {} if evictable_list else self.lru
        # (made for the capacity's slots at once, up to 4,096; grown by blocks beyond: _grow)
        m = min(capacity, 4096)
        self.ready: list[bool] = [False] * m
        self.refs: list[int] = [0] * m
        self.content: list = [None] * m
        self.rank: list = [0] * m           # (rank objects: compared and queued as they are)
        ints_to(m)
        self.free: list[int] = []
        self.n_slots = 0                    # slots ever used (the lists may be longer)
        # where the slots taken by new chunks are recorded, in order, while not None
        # (prepare_store_slots)
        self.added: list | None = None
        # whether touch() does anything (OffloadScheduler._touch skips the calls if not)
        self.touches = True
        self.evictions = 0
        # change counters, for memos of callers: ``version`` moves on every change (order
        # included), ``content_version`` on every change but a touch (what lookups can see:
        # which chunks exist, ready or not, and their load refcounts)
        self.version = 0
        self.content_version = 0

    def _add(self, key, rank: object) -> int:
        """A new chunk (not ready, no load in flight) under ``key``, at a free slot (``rank``:
        an int object, stored as it is); the slot."""
        free = self.free
        if free:
            s = free.pop()
        else:
            s = self.n_slots
            self.n_slots = s + 1
            if s == len(self.ready):
                self._grow()
        self.rank[s] = rank
        entries: dict = self.entries        # (the slot as its shared int object: INTS)
        so = INTS[s]
        entries[key] = so
        if self.added is not None:
            self.added.append(so)
        return s

    def _grow(self) -> None:
        """More fresh slots (not ready, no load, no content): the lists grow by blocks (and
        ``INTS`` has an object for each slot)."""
        have = len(self.ready)
        n = max(64, have)
        self.ready.extend([False] * n)
        self.refs.extend([0] * n)
        self.content.extend([None] * n)
        self.rank.extend([0] * n)
        ints_to(have + n)

    def _store_new(self, keys: list) -> list:
        """``prepare_store(keys)`` when the tier has room for all of ``keys`` (no eviction): the
        keys not in it, in order, each added as :meth:`_add` adds it with rank 0. One dict
        operation per key (``setdefault`` with the next slot: a key is hashed once, not looked
        up and then inserted); ``keys`` are distinct (a request's keys, or one key). With room
        there is no free slot: chunks leave only by eviction, which fills the tier."""
        assert not self.free
        entries: dict = self.entries    # (untyped: the slot object compared by identity)
        to_store: list | None = None    # (None while every key so far is new: keys[:i] then)
        # (i64: slots and indices as plain 64-bit ints, no tagged-int checks; INTS read by
        # the 64-bit item read, cheaper than the tagged-int one)
        s0: i64 = self.n_slots
        s: i64 = s0                     # the next slot, taken by the next new key
        ints = ints_to(s + len(keys) + 1)
        so = ints[s]
        have: i64 = len(self.ready)     # slots the lists have room for
        i: i64 = 0                      # (the index of k: the keys read inline, not by index)
        for k in keys:
            if entries.setdefault(k, so) is not so:
                # there already (its slot is in use: never the next slot s)
                if to_store is None:
                    to_store = keys[:i]
            else:
                if to_store is not None:
                    to_store.append(k)
                if s == have:
                    self._grow()
                    have = len(self.ready)
                s += 1                  # (fresh slots: rank 0 already, not ready, no load)
                so = ints[s]
            i += 1
        self.n_slots = s
        if self.added is not None:
            # the new keys took the slots s0.. in order (the record is empty: a prepare_store
            # that calls this adds nothing else)
            self.added = ints[s0:s]
        if to_store is None:
            to_store = keys[:]
        if to_store:
            self.version += 1
            self.content_version += 1
        return to_store

    def _drop(self, key) -> int:
        """Evict the chunk of ``key`` (ready, no load in flight): its slot is free; the slot."""
        s = self.entries.pop(key)
        self.ready[s] = False
        self.content[s] = None
        self.free.append(s)
        return s

    def lookup(self, key) -> int:
        s = self.entries.get(key)
        if s is None:
            return MISS
        return HIT if self.ready[s] else HIT_PENDING

    def is_ready(self, key) -> bool:
        """The chunk of ``key`` is there and its store completed."""
        s = self.entries.get(key)
        return s is not None and self.ready[s]

    def touch(self, keys) -> None:
        """``LRUCachePolicy.touch``: each present key to the MRU end, last key first (``for key in
        reversed(list(keys))``), so the first key ends most recent."""
        self.touch_range(list(keys), 0, len(keys))

    def touch_range(self, keys: list, lo: int, hi: int) -> None:
        """``touch(keys[lo:hi])``."""
        lru = self.lru
        self.version += 1
        move = lru.move_to_end
        for i in range(min(hi, len(keys)) - 1, lo - 1, -1):
            k = keys[i]
            if k in lru:
                move(k)

    def prepare_store(self, keys, st=None, spans: list[int] | None = None) -> list | None:
        """``st``, ``spans``: the request and the positions of its keys, for RankedCPUTier."""
        entries, lru = self.entries, self.lru
        if len(keys) <= self.capacity - len(entries):
            return self._store_new(keys)
        to_store = [k for k in keys if k not in entries]
        if not to_store:
            return []
        self.version += 1
        self.content_version += 1
        n_evict = len(to_store) - (self.capacity - len(entries))
        if n_evict > 0:
            protected = set(keys)
            victims = []
            if self.evictable_list:
                for k in lru:                   # (evictable chunks only)
                    if k not in protected:
                        victims.append(k)
                        if len(victims) == n_evict:
                            break
            else:
                ready, refs = self.ready, self.refs
                for k, s in lru.items():
                    if ready[s] and refs[s] == 0 and k not in protected:
                        victims.append(k)
                        if len(victims) == n_evict:
                            break
            if len(victims) < n_evict:
                return None
            for k in victims:
                self._drop(k)
                if self.evictable_list:
                    del lru[k]
            self.evictions += len(victims)
        for k in to_store:
            self._add(k, 0)
        return to_store

    def prepare_store_slots(self, keys, st=None, spans: list[int] | None = None
                            ) -> tuple[list | None, list]:
        """:meth:`prepare_store`, and the slots its new chunks took, in the order of the keys it
        returns (a store job's chunks, Job.slots)."""
        self.added = []
        to_store = self.prepare_store(keys, st, spans)
        slots = self.added
        self.added = None
        assert slots is not None
        return to_store, slots

    def slots_of(self, keys: list, slots: list | None) -> list:
        """``slots`` (a job's, Job.slots), or if None the slots of ``keys``, None where a key is
        not there (callers that give keys alone, tests; jobs whose chunks were replaced)."""
        if slots is not None:
            return slots
        entries: dict = self.entries
        return [entries.get(k) for k in keys]

    def complete_store(self, keys: list, contents: list, slots: list | None = None) -> None:
        """A store job's chunks ``keys`` are ready, holding ``contents[i]`` for ``keys[i]``
        (lists in the job's chunk order, Job.ckeys and Job.contents: a list, not a dict, as the
        worker reads them in that order; ``slots``: theirs, Job.slots, else looked up). With the
        evictable list, those evictable now join its MRU end in the order of vLLM's set of the
        job's keys (tuple_set_order)."""
        self.version += 1
        self.content_version += 1
        entries, ready, content = self.entries, self.ready, self.content
        ss = self.slots_of(keys, slots)
        for x in range(len(keys)):
            so = ss[x]
            if so is None:
                continue
            sx: int = so
            if not ready[sx]:
                ready[sx] = True
                content[sx] = contents[x]
        if self.evictable_list:
            # the ready, unreferenced ones: those that just became so and those already in the
            # list (assigned again: an OrderedDict keeps their place)
            refs, lru = self.refs, self.lru
            for k in tuple_set_order(keys):
                s = entries.get(k)
                if s is not None and ready[s] and not refs[s]:
                    lru[k] = s

    def prepare_load(self, keys, st=None, spans: list[int] | None = None) -> list:
        """A load job of the chunks ``keys`` (a list) starts; returns their slots, in order
        (Job.slots). (Here and in the loads' other updates the load counts are read, then
        stored: ``refs[s] += 1`` compiles to a generic in-place add.)"""
        self.version += 1
        self.content_version += 1
        entries: dict = self.entries    # (untyped: the slot objects go into the list)
        refs = self.refs
        ks: list = keys
        slots = [entries[k] for k in ks]
        for x in range(len(ks)):
            k = ks[x]
            s: int = slots[x]
            n = refs[s] + 1
            refs[s] = n
            if self.evictable_list and n == 1 and self.ready[s]:
                del self.lru[k]                 # not evictable while loaded
        return slots

    def on_request_finished(self, st) -> None:
        """``CPUOffloadingManager.on_request_finished``: no recency change before 0.31.0."""

    def complete_load(self, keys: list, slots: list | None = None) -> None:
        """A load job's chunks ``keys`` (its keys as listed, Job.keys; ``slots``: theirs,
        Job.slots, else looked up) have been read. With the evictable list, those evictable now
        join its MRU end in the order of vLLM's set of the job's keys (tuple_set_order: the
        keys looked up again in that order)."""
        self.version += 1
        self.content_version += 1
        entries, refs = self.entries, self.refs
        if self.evictable_list:
            for k in tuple_set_order(keys):
                s = entries[k]
                n = refs[s] - 1
                refs[s] = n
                if not n and self.ready[s]:
                    self.lru[k] = s             # evictable now: the MRU end
            return
        ss = self.slots_of(keys, slots)
        for x in range(len(ss)):
            sx: int = ss[x]
            refs[sx] = refs[sx] - 1


# a rank ``(rank, -position)`` is kept as one int, ``(rank << RANK_SHIFT) - position`` (a token
# position stays far below 2**RANK_SHIFT, so the order is the tuples' order): comparisons and the
# eviction queue need no tuples. (A shift, not a product: mypyc multiplies ints inline only when
# both are below 2**30, and shifts them inline while the result stays below 2**62.)
RANK_SHIFT: Final = 40


class _ReqAccess:
    """A request's state in :class:`RankedCPUTier`: its request rank (0: none given yet); the
    keys it accessed, in first-access order (``order``); and what it knows of their positions
    (``ReqContext.get_offload_key_position``), in one of two modes.

    By index (``seen`` not None; 0.33.0 while the callers give each key's chunk index, see
    RankedCPUTier.prepare_store): a key's position follows from its group and chunk index, and
    ``marks[group index][chunk index]`` is not None once the request accessed that chunk: the
    chunk's slot then (its int object; -1 if it had none yet), a guess the walk at finish checks
    against ``RankedCPUTier.key_at`` (the key is the chunk's in the request's key list, looked
    up if the slot does not hold that very object: evicted since, say);
    ``seen`` holds the request's offload keys entered so far (``counts`` per group, ``slots`` in
    all), only to tell that they are distinct (then a key and its chunk index name each other).

    By dict (``seen`` None): ``codes`` maps each key of the request to ``2 * position code +
    accessed`` (see :meth:`RankedCPUTier._codes`), ``extra`` holds the keys accessed while their
    position was not known (counted in ``unknown``, as is a change of the request state or a key
    met twice: then on_request_finished takes the general path). ``slots``: the keys entered in
    ``codes`` (more than its size if a key came twice). A request leaves the first mode for this
    one, for good, when a key comes twice, a key comes without its chunk index, or the request
    state changes (RankedCPUTier._by_index): all rare; the dict costs a code per key of the
    request, the marks only the keys accessed."""

    __slots__ = ("st", "rank", "order", "codes", "extra", "unknown", "counts", "slots", "seen",
                 "marks")

    def __init__(self, st, n_groups: int, by_index: bool):
        self.st = st
        self.rank = 0
        self.order: list = []
        self.codes: dict[Key, int] = {}
        self.extra: dict = {}
        self.unknown = 0
        self.counts: list[int] = [0] * n_groups
        self.slots = 0
        self.seen: set | None = set() if by_index else None
        self.marks: list[list] = [[] for _ in range(n_groups)] if by_index else []


def _sorted_items(rs: list, ks: list) -> tuple[list, list]:
    """The items ``(rs[i], ks[i])`` (ranks, see RANK_SHIFT, and keys) in (rank, key) order, as
    two lists: sorted by rank alone (ints compare faster than tuples), then each run of equal
    ranks (rare: one position of one request, across groups) put in key order."""
    out_r: list = []
    out_k: list = []
    start, prev = 0, -1                 # (ranks are positive)
    for i in sorted(range(len(rs)), key=rs.__getitem__):
        ro, k = rs[i], ks[i]
        r: int = ro
        if r == prev:
            x = len(out_k)
            while x > start and k < out_k[x - 1]:
                x -= 1
            out_r.insert(x, ro)
            out_k.insert(x, k)
        else:
            start, prev = len(out_k), r
            out_r.append(ro)
            out_k.append(k)
    return out_r, out_k


class RankedCPUTier(CPUTier):
    """0.31.0+ ``LRUCachePolicy``: logical recency ranks independent of transfer pinning.

    Eviction takes the evictable chunks (ready, no load in flight) of lowest rank; ties (same
    request, same token position) go to the lower group index (``make_offload_key`` appends the
    group index, big-endian, to the block hash). Ranks come from one counter: an inserted chunk
    takes the next rank (0.31.0, 0.32.0) or, with ``request_ranks`` (0.33.0), its request's rank
    and token position, ``(request rank, -position)``, so that a request's tails precede its
    heads; a request's first access to a resident chunk (``prepare_load``, ``prepare_store`` of a
    ready or new chunk: ``_record_request_cache_access``) raises it to that rank (0.33.0,
    ``on_request_access``); when the request finishes (``on_request_finished``, after its last
    store jobs) every chunk it accessed takes a fresh rank, tail first, so that its head is the
    most recent. The connector never calls ``touch`` from 0.31.0 on.

    A chunk's rank is ``rank[slot]``, an int (see ``RANK_SHIFT``); ``entries`` is a plain dict
    (eviction follows the ranks, not its order). ``key_at[slot]`` is the key object of a slot in
    use (None: free), so that the marks of a request (see _ReqAccess) hold the slots of its
    chunks: a slot that holds the very key object saves the finish walk a dict lookup.
    """

    def __init__(self, capacity: int, request_ranks: bool, cfgs):
        super().__init__(capacity, False)
        self.entries = {}
        self.touches = False
        self.request_ranks = request_ranks
        # eviction candidates, items (rank, key), from the first eviction on (``queued``; see
        # _lowest_evictable), in three parts (no heap: a heap's pops compare items by the dozen):
        # - ``fresh``, a queue sorted by (rank, key) as the parallel lists ``fresh_rank`` and
        #   ``fresh_key`` from ``head`` on (before it: taken). An item joins it when it is not
        #   below its last item, as the new ranks of on_request_finished, above all, do;
        # - ``pile``, the other items as they come (and the chunks an eviction passed over,
        #   protected, or gave back, too few), as the parallel lists ``pile_rank`` and
        #   ``pile_key``, none ranked below ``pile_low``: most of them are stale before an
        #   eviction gets that low (a running request's chunks, ranked again when it finishes),
        #   so they are only sorted once one does, into
        # - ``run``, a second sorted queue, ``run_rank`` and ``run_key`` from ``run_head`` on.
        # The ranks are the rank objects of ``rank`` (no int boxed again), compared as ints: most
        # comparisons need no key (ranks of distinct chunks tie only at one position of one
        # request, across groups).
        # Every evictable chunk (ready, ref_cnt 0) has its current item in one of the parts: a
        # chunk is pushed when it becomes evictable (complete_store, complete_load) and when it
        # takes a new rank while evictable; they may also hold items of chunks gone, ranked
        # again or no longer evictable (dropped as they surface). Keys order as their
        # (group id, ident) pairs (see make_key): the order is (rank, group id, ident).
        # An item is current when it holds the very rank object of its chunk's slot (``is``: no
        # unboxing): every rank given is a new object (prepare_store gives one to the new
        # chunks of the groups that end at the same token), and an item keeps its object alive,
        # so no later rank of any chunk is that object
        self.queued = False
        self.fresh_rank: list = []
        self.fresh_key: list = []
        self.head = 0
        self.pile_rank: list = []
        self.pile_key: list = []
        self.pile_low = 0
        self.run_rank: list = []
        self.run_key: list = []
        self.run_head = 0
        self.next_rank = 0
        # per group: (index in the request's groups, tokens per chunk, index in group id order)
        by_id = sorted(cfg.group_id for cfg in cfgs)
        self.group: list[tuple[int, int, int]] = [
            (i, cfg.tokens_per_chunk, by_id.index(cfg.group_id)) for i, cfg in enumerate(cfgs)]
        self.n_groups = max(len(cfgs), 1)
        # the walk of a request's chunks by their marks (_rerank_accessed): on a grid of
        # step the gcd of the groups' tokens per chunk, a group's chunk c at grid point
        # (c + 1) * steps[w]; at each point the groups in group id order (walk[w])
        unit = math.gcd(*[tpc for _, tpc, _ in self.group]) if self.group else 1
        by_order = sorted(self.group, key=lambda g: g[2])
        self.walk: list[int] = [gi for gi, _, _ in by_order]
        self.steps: list[int] = [tpc // unit for _, tpc, _ in by_order]
        # (the same steps by group index: prepare_store's new ranks by grid point)
        self.grid: list[int] = [tpc // unit for _, tpc, _ in self.group]
        self.req_state: dict[str, _ReqAccess] = {}
        self.key_at: list = [None] * len(self.ready)     # (see above)

    def _grow(self) -> None:
        super()._grow()
        self.key_at.extend([None] * (len(self.ready) - len(self.key_at)))

    def touch(self, keys) -> None:
        return

    def _state(self, st) -> _ReqAccess:
        rid = st.req.rid
        a = self.req_state.get(rid)
        if a is None:
            a = self.req_state[rid] = _ReqAccess(st, len(self.group), self.request_ranks)
        return a

    def _request_rank(self, a: _ReqAccess) -> int:
        if not a.rank:
            self.next_rank += 1
            a.rank = self.next_rank
        return a.rank

    def _codes(self, a: _ReqAccess, st, ends: list[int] | None = None) -> dict[Key, int]:
        """``ReqContext.get_offload_key_position``: a key's chunk end token in the request, kept
        as the code ``position * n_groups + the group's index in group id order`` (the order in
        which on_request_finished walks a request's chunks, head to tail, ties by group id),
        doubled, plus 1 once the request accessed the key. Extended as the request's offload
        keys grow (they are only ever appended; ``ends``: up to these counts per group, not all).
        The dict mode of _ReqAccess."""
        if a.st is not st:
            # another request state (the model keeps one per request): positions anew; every
            # key accessed so far is accessed without a known position until found again
            a.st, a.codes, a.counts, a.slots = st, {}, [0] * len(self.group), 0
            a.extra = dict.fromkeys(a.order)
            a.unknown += 1
        counts, out, extra, ng = a.counts, a.codes, a.extra, self.n_groups
        for gi, tpc, order in self.group:
            keys: list = st.groups[gi].keys
            n, e = counts[gi], len(keys) if ends is None else ends[gi]
            if n < e:
                step = 2 * tpc * ng
                c = (n + 1) * step + 2 * order
                for i in range(n, e):
                    out[keys[i]] = c
                    c += step
                if extra:
                    for i in range(n, e):
                        if keys[i] in extra:
                            out[keys[i]] |= 1
                counts[gi] = e
                a.slots += e - n
                if a.slots != len(out):
                    # a key met twice (its later position holds, as in a position map; its
                    # access mark is restored)
                    a.unknown += 1
                    for k in a.order:
                        if k in out:
                            out[k] |= 1
        return out

    def _by_index(self, a: _ReqAccess, st, spans: list[int] | None) -> bool:
        """Whether a call (``spans``: its keys' chunk indices, see prepare_store) goes by index:
        the request is in that mode (see _ReqAccess), the call gives the chunk indices, the
        request state is the same and the request's keys, entered as far as they go now, are
        still distinct. Else the request goes by dict from now on, its dict as it would be had
        it gone by dict from the start (the call then extends it, as _codes does)."""
        seen = a.seen
        if seen is None:
            return False
        if spans is not None and a.st is st:
            groups, counts = st.groups, a.counts
            total = a.slots
            for gi in range(len(counts)):
                keys: list = groups[gi].keys
                n = counts[gi]
                if n < len(keys):
                    for i in range(n, len(keys)):
                        seen.add(keys[i])       # (no slice: cheaper than update())
                    total += len(keys) - n
            if len(seen) == total:
                marks = a.marks
                for gi in range(len(counts)):
                    e = len(groups[gi].keys)
                    if counts[gi] < e:
                        marks[gi].extend([None] * (e - counts[gi]))
                        counts[gi] = e
                a.slots = total
                return True
        # the dict of the keys entered so far (distinct), those accessed marked (the marks
        # restored through ``extra``, empty again after)
        ends, a.counts, a.slots = a.counts, [0] * len(self.group), 0
        a.seen, a.marks, a.extra = None, [], dict.fromkeys(a.order)
        self._codes(a, a.st, ends)
        a.extra = {}
        return False

    def _first_unknown(self, a: _ReqAccess, k) -> None:
        """A key without a known position: its first access is recorded in ``extra``."""
        if k not in a.extra:
            a.extra[k] = None
            a.order.append(k)
            a.unknown += 1
            if self.request_ranks:
                self._request_rank(a)

    def prepare_store(self, keys, st=None, spans: list[int] | None = None) -> list | None:
        """``spans`` (0.33.0 callers; None: not given, positions looked up): for each group of
        the request in order, ``spans[2 * gi]`` and ``spans[2 * gi + 1]``, the chunk index its
        keys in ``keys`` start from and how many there are: ``keys`` lists the groups' keys in
        group order, each group's a subsequence of its key list from that chunk index on, the
        very key objects of the list."""
        entries = self.entries
        if st is None:
            return self._insert([k for k in keys if k not in entries], keys, None)
        # the first accesses to the new and the ready keys (as in prepare_load), in one pass
        # with the keys to store
        a = self._state(st)
        to_store: list = []
        ready = self.ready
        if not self.request_ranks:
            for k in keys:
                s = entries.get(k)
                if s is None:
                    to_store.append(k)
                elif not ready[s]:
                    continue
                self._first_unknown(a, k)       # positions only matter at finish
            return self._insert(to_store, keys, None)
        # (the new keys' ranks, None if their position is unknown: an int boxed once)
        to_rank: list = []
        order, ng = a.order, self.n_groups
        if self._by_index(a, st, spans):
            assert spans is not None
            groups, marks, group = st.groups, a.marks, self.group
            klist: list = keys          # (a list here: read without generic lookups)
            base = 0                    # (the request rank << RANK_SHIFT, from the first access)
            # the new chunks are inserted at once while there is room (the keys are distinct
            # here, and chunks not ready are no eviction candidates), as _store_new does: each
            # key offered the next fresh slot (``setdefault``: hashed once); none while a slot
            # is free (only after an eviction that failed). The rest are inserted by _insert.
            ents: dict = entries        # (untyped: the slot object compared by identity)
            rank, key_at = self.rank, self.key_at
            room = 0 if self.free else self.capacity - len(entries)
            s0 = sn = self.n_slots      # the slot offered next
            ints = ints_to(sn + min(room, len(klist)) + 1)
            so: Any = ints[sn] if room > 0 else None     # (None: no room, looked up)
            # the new chunks' rank objects by grid point (see __init__), made once for the
            # chunks of the groups that end there (the same rank: one int boxed, not one per
            # group; an object shared by chunks of distinct keys still tells a queue item
            # current by identity, see __init__: it is new, and no chunk takes it twice)
            grid = self.grid
            n_grid = 0
            for gi in range(len(group)):
                n_grid = max(n_grid, len(groups[gi].keys) * grid[gi] + 1)
            made: list = [None] * n_grid
            p = 0
            for gi in range(len(group)):
                c, cnt = spans[2 * gi], spans[2 * gi + 1]
                if not cnt:
                    continue
                gkeys: list = groups[gi].keys
                m, tpc, gs = marks[gi], group[gi][1], grid[gi]
                for x in range(p, p + cnt):
                    k = klist[x]
                    while gkeys[c] is not k:
                        c += 1                  # (a chunk of the span left out)
                    sk: Any = ents.get(k) if so is None else ents.setdefault(k, so)
                    if sk is so:                 # new: at slot ``so``, or to _insert (None)
                        to_store.append(k)
                        if m[c] is None:
                            m[c] = so if so is not None else -1     # (-1: no slot yet)
                            order.append(k)
                        if not base:
                            base = self._request_rank(a) << RANK_SHIFT
                        t = (c + 1) * gs
                        ro: Any = made[t]
                        if ro is None:
                            ro = base - (c + 1) * tpc
                            made[t] = ro
                        if so is not None:
                            if sn == len(self.ready):
                                self._grow()
                            rank[sn] = ro
                            key_at[sn] = k
                            sn += 1
                            room -= 1
                            so = ints[sn] if room > 0 else None
                        else:
                            to_rank.append(ro)
                    else:
                        si: int = sk
                        if ready[si] and m[c] is None:
                            m[c] = sk
                            order.append(k)
                            if not base:
                                base = self._request_rank(a) << RANK_SHIFT
                            r = base - (c + 1) * tpc
                            rs: int = rank[si]     # (unboxed: r is not boxed to compare)
                            if rs < r:
                                self._set_rank(k, si, r)
                    c += 1
                p += cnt
            self.n_slots = sn
            if self.added is not None:
                # the slots taken, in order, if recorded (Job.slots): s0.. here (one slice, no
                # append per chunk), then those _insert takes
                self.added.extend(ints[s0:sn])
            return self._insert(to_store, keys, to_rank, len(to_store) - len(to_rank))
        codes = self._codes(a, st)
        for k in keys:
            s = entries.get(k)
            if s is None:
                to_store.append(k)
                vo = codes.get(k)
                if vo is None:
                    to_rank.append(None)
                    self._first_unknown(a, k)
                    continue
                v = vo
                if not v & 1:
                    codes[k] = v | 1
                    order.append(k)
                to_rank.append((self._request_rank(a) << RANK_SHIFT) - (v >> 1) // ng)
            elif ready[s]:
                v = codes.get(k, -1)
                if v < 0:
                    self._first_unknown(a, k)
                elif not v & 1:
                    codes[k] = v | 1
                    order.append(k)
                    r = (self._request_rank(a) << RANK_SHIFT) - (v >> 1) // ng
                    if self.rank[s] < r:
                        self._set_rank(k, s, r)
        return self._insert(to_store, keys, to_rank)

    def _insert(self, to_store: list, keys, to_rank: list | None, done: int = 0) -> list | None:
        """The rest of prepare_store: evict for the new chunks ``to_store``, insert them
        (``to_rank``: their ranks, 0.33.0 ``(request rank, -position)``, None where the position
        is unknown or the request does not rank them: the next rank then). The first ``done``
        are inserted already (filling the room there was; ``to_rank`` lists the others'): taken
        out again if the eviction fails."""
        if not to_store:
            return []
        entries = self.entries
        self.version += 1
        self.content_version += 1
        n_evict = len(to_store) - (self.capacity - len(entries)) - done
        if n_evict > 0:
            victims = self._lowest_evictable(n_evict, set(keys))
            if victims is None:
                key_at = self.key_at
                for i in range(done):
                    key_at[self._drop(to_store[i])] = None
                return None
            # (their slots are all taken again below, ``key_at`` with them: there is no free
            # slot left after an insertion)
            for k in victims:
                self._drop(k)
            self.evictions += n_evict
        key_at = self.key_at
        for i, k in enumerate(to_store[done:] if done else to_store):
            r = to_rank[i] if to_rank is not None else None
            if r is None:
                self.next_rank += 1
                r = self.next_rank << RANK_SHIFT
            key_at[self._add(k, r)] = k         # not evictable (not ready): not queued
        return to_store

    def _set_rank(self, k, s: int, r: int) -> None:
        ro: object = r                          # (boxed once: list and queue share it)
        self.rank[s] = ro
        if self.queued and self.ready[s] and not self.refs[s]:
            self._push(ro, k)

    def _push(self, ro: Any, k) -> None:
        """An eviction candidate, of rank ``ro`` (the rank object of ``rank``) and key ``k``: to
        the end of ``fresh`` if not below its last item, else to the pile."""
        fk = self.fresh_key
        if len(fk) > self.head:
            r: int = ro
            last: int = self.fresh_rank[-1]
            if r < last or (r == last and k < fk[-1]):
                self._pile(ro, k, r)
                return
        fk.append(k)
        self.fresh_rank.append(ro)

    def _pile(self, ro: Any, k, r: int) -> None:
        """An eviction candidate (as in _push) to the pile (``r``: ``ro`` as an int, which
        _push, most of the calls, has unboxed already)."""
        pk = self.pile_key
        if not pk or r < self.pile_low:
            self.pile_low = r
        pk.append(k)
        self.pile_rank.append(ro)

    def _current(self, ro: Any, k) -> bool:
        """The item (``ro``, ``k``) is its chunk's current one, and the chunk is evictable."""
        s = self.entries.get(k)
        return s is not None and self.rank[s] is ro and self.ready[s] and not self.refs[s]

    def _compact(self) -> None:
        """Drop the items of chunks gone, ranked again or not evictable, at once (cheaper than
        one by one once they are most); the queues stay sorted."""
        fr, fk, pr, pk = self.fresh_rank, self.fresh_key, self.pile_rank, self.pile_key
        rr, rk = self.run_rank, self.run_key
        fr2: list = []
        fk2: list = []
        for i in range(self.head, len(fk)):
            if self._current(fr[i], fk[i]):
                fr2.append(fr[i])
                fk2.append(fk[i])
        self.fresh_rank, self.fresh_key, self.head = fr2, fk2, 0
        rr2: list = []
        rk2: list = []
        for i in range(self.run_head, len(rk)):
            if self._current(rr[i], rk[i]):
                rr2.append(rr[i])
                rk2.append(rk[i])
        self.run_rank, self.run_key, self.run_head = rr2, rk2, 0
        self.pile_rank, self.pile_key = [], []
        for i in range(len(pk)):
            if self._current(pr[i], pk[i]):
                self._pile(pr[i], pk[i], pr[i])

    def _sort_pile(self) -> None:
        """The pile's items of evictable chunks sorted into the run; the pile is left empty."""
        rr, rk, pr, pk = self.run_rank, self.run_key, self.pile_rank, self.pile_key
        rs, ks = rr[self.run_head:], rk[self.run_head:]
        for i in range(len(pk)):
            if self._current(pr[i], pk[i]):
                rs.append(pr[i])
                ks.append(pk[i])
        self.run_rank, self.run_key = _sorted_items(rs, ks)
        self.run_head = 0
        pr.clear()
        pk.clear()

    def _lowest_evictable(self, n: int, protected: set) -> list | None:
        """The ``n`` evictable chunks (ready, no load in flight, not ``protected``) of lowest
        ``(rank, group)``, lowest first, or None if there are fewer (nothing changes then).
        The queue holds the current item of every evictable chunk (see __init__): items
        surface in (rank, key) order, the pile sorted into the run before an item of its lowest
        rank or more surfaces; one whose chunk is gone, has another rank since or is not
        evictable (a store or a load in flight: pushed again when that completes) is dropped,
        as is a copy of the item just seen (equal items surface one after the other);
        protected chunks go back (to the pile)."""
        entries, ready, refs, rank = self.entries, self.ready, self.refs, self.rank
        if not self.queued:                    # built at the first eviction, kept up after
            self.queued = True
            rs: list = []
            ks: list = []
            for k, slot in entries.items():
                if ready[slot] and not refs[slot]:
                    rs.append(rank[slot])
                    ks.append(k)
            self.fresh_rank, self.fresh_key = _sorted_items(rs, ks)
        elif len(self.fresh_key) - self.head + len(self.run_key) - self.run_head \
                + len(self.pile_key) > 4 * len(entries):
            self._compact()                     # mostly items to drop
        fr, fk, head, pk = self.fresh_rank, self.fresh_key, self.head, self.pile_key
        rr, rk, rhead = self.run_rank, self.run_key, self.run_head
        victims: list = []
        passed: list = []
        last_r = -1                             # (ranks are positive)
        last_k: Any = None
        while len(victims) < n:
            # the lowest item of the queues (equal items surface one after the other)
            if head < len(fk):
                r: int = fr[head]
                k = fk[head]
                from_fresh = True
                if rhead < len(rk):
                    r2: int = rr[rhead]
                    if r2 < r or (r2 == r and rk[rhead] < k):
                        r, k, from_fresh = r2, rk[rhead], False
            elif rhead < len(rk):
                r, k, from_fresh = rr[rhead], rk[rhead], False
            elif pk:
                r, k, from_fresh = self.pile_low, None, False    # (only the pile: sorted below)
            else:
                break
            if pk and self.pile_low <= r:
                # the pile may hold lower items: sorted into the run first
                self.run_head = rhead
                self._sort_pile()
                rr, rk, rhead = self.run_rank, self.run_key, 0
                continue
            if from_fresh:
                ro = fr[head]
                head += 1
            else:
                ro = rr[rhead]
                rhead += 1
            s = entries.get(k)
            if s is None or not ready[s] or refs[s] or (r == last_r and k == last_k):
                continue                       # stale, not evictable, or a copy
            if rank[s] is not ro:
                continue                       # stale
            last_r, last_k = r, k
            (passed if k in protected else victims).append(k)
        # (the taken items dropped: amortized O(1) each)
        if 2 * head > len(fk):
            del fr[:head]
            del fk[:head]
            head = 0
        if 2 * rhead > len(rk):
            del rr[:rhead]
            del rk[:rhead]
            rhead = 0
        self.head, self.run_head = head, rhead
        for k in passed if len(victims) == n else passed + victims:
            ro = rank[entries[k]]
            self._pile(ro, k, ro)
        if len(victims) < n:
            return None
        return victims

    def prepare_load(self, keys, st=None, spans: list[int] | None = None) -> list:
        """A load in flight on each chunk of ``keys`` and, given the request, its first access to
        each (0.33.0: raises the chunk to the request's rank, ``(request rank, -position)``, if
        that is higher), in one pass; returns the chunks' slots (as CPUTier.prepare_load).
        ``spans``: as for prepare_store."""
        self.version += 1
        self.content_version += 1
        entries: dict = self.entries    # (untyped: the slot objects go into the list)
        refs = self.refs
        klist: list = keys          # (a list here: read without generic lookups)
        slots = [entries[k] for k in klist]
        s: int
        # (``refs[s] = refs[s] + 1``, not ``+=``: mypyc compiles an item's ``+=`` as a generic
        # number operation)
        if st is None:
            for x in range(len(slots)):
                s = slots[x]
                refs[s] = refs[s] + 1
            return slots
        a = self._state(st)
        if not self.request_ranks:
            for x in range(len(slots)):
                s = slots[x]
                refs[s] = refs[s] + 1
                self._first_unknown(a, klist[x])    # positions only matter at finish
            return slots
        order, ng, rank = a.order, self.n_groups, self.rank
        if self._by_index(a, st, spans):
            assert spans is not None
            groups, marks, group = st.groups, a.marks, self.group
            # (prepare_store's walk of the spans, kept inline in both: as one method giving
            # each key's chunk index it cost 2.3 M more instructions per 64-request run)
            base = 0                    # (the request rank << RANK_SHIFT, from the first access)
            p = 0
            for gi in range(len(group)):
                c, cnt = spans[2 * gi], spans[2 * gi + 1]
                if not cnt:
                    continue
                gkeys: list = groups[gi].keys
                m, tpc = marks[gi], group[gi][1]
                for x in range(p, p + cnt):
                    k = klist[x]
                    while gkeys[c] is not k:
                        c += 1                  # (a chunk of the span left out)
                    s = slots[x]
                    refs[s] = refs[s] + 1
                    if m[c] is None:
                        m[c] = INTS[s]         # (its slot: see __init__)
                        order.append(k)
                        if not base:
                            base = self._request_rank(a) << RANK_SHIFT
                        r = base - (c + 1) * tpc
                        rs: int = rank[s]          # (unboxed: r is not boxed to compare)
                        if rs < r:
                            self._set_rank(k, s, r)     # (not evictable now: not pushed)
                    c += 1
                p += cnt
            return slots
        codes = self._codes(a, st)
        for x in range(len(slots)):
            k = klist[x]
            s = slots[x]
            refs[s] = refs[s] + 1
            v = codes.get(k, -1)
            if v < 0:
                self._first_unknown(a, k)
            elif not v & 1:
                codes[k] = v | 1
                order.append(k)
                r = (self._request_rank(a) << RANK_SHIFT) - (v >> 1) // ng
                if rank[s] < r:
                    self._set_rank(k, s, r)     # (not evictable now: not pushed)
        return slots

    def on_request_finished(self, st) -> None:
        a = self.req_state.pop(st.req.rid, None)
        if a is None:
            return
        if a.seen is not None:
            self._rerank_accessed(a)
            return
        # order_request_keys, head to tail: by position, ties by group id (each group's keys
        # sorted by position, the groups in id order, then a stable sort by position)
        if not a.unknown:
            # every key accessed has its code (doubled, plus 1: the same order)
            flat = list(a.order)
            flat.sort(key=a.codes.__getitem__)
        else:
            flat = list(a.order)
            codes = self._codes(a, st)
            if all(map(codes.__contains__, flat)):
                flat.sort(key=codes.__getitem__)
            else:
                groups: dict = {}
                for k in flat:
                    groups.setdefault(key_group(k), []).append(k)
                flat = []
                for gid in sorted(groups):
                    keys = groups[gid]
                    if all(k in codes for k in keys):
                        keys = sorted(keys, key=codes.__getitem__)
                    flat += keys
        entries, rank, queued = self.entries, self.rank, self.queued
        fr, fk = self.fresh_rank, self.fresh_key
        nr = self.next_rank
        for i in range(len(flat) - 1, -1, -1):     # tail first (mypyc 2.4 cannot compile
            k = flat[i]                                # a loop over reversed() of this list)
            s = entries.get(k)
            if s is not None:
                nr += 1
                r: object = nr << RANK_SHIFT       # (boxed once: list and queue share it)
                rank[s] = r
                if queued and self.ready[s] and not self.refs[s]:
                    # (above every rank given before: the end of ``fresh``)
                    fr.append(r)
                    fk.append(k)
        self.next_rank = nr

    def _rerank_accessed(self, a: _ReqAccess) -> None:
        """on_request_finished for a request going by index: the keys it accessed, tail to head,
        found by walking its marks by position (grid point) down, ties in reverse group id
        order (see __init__), each take the next fresh rank; the keys are those of the request
        state of its last access (as the dict mode's codes are: its key lists, only appended). (The
        re-ranking of on_request_finished's loop, fused with the walk: no list of the keys.)"""
        steps = self.steps
        # (the marks in walk order, typed: no generic lookups in the walk)
        marks: list[list] = [a.marks[gi] for gi in self.walk]
        gkeys: list[list] = [a.st.groups[gi].keys for gi in self.walk]
        key_at = self.key_at
        end = 0
        for w in range(len(marks)):
            end = max(end, len(marks[w]) * steps[w])
        entries, rank, queued = self.entries, self.rank, self.queued
        fr, fk = self.fresh_rank, self.fresh_key
        nr = self.next_rank
        nw = len(marks)
        ones = max(steps) == 1 if steps else True     # (every group's chunk at every point)
        for t in range(end, 0, -1):
            w = nw
            while w:
                w -= 1
                if ones:
                    c = t - 1
                else:
                    r = steps[w]
                    if t % r:
                        continue
                    c = t // r - 1
                m = marks[w]
                if c >= len(m):
                    continue
                so = m[c]
                if so is not None:
                    k = gkeys[w][c]
                    s: int = so
                    if s < 0 or key_at[s] is not k:
                        # (no slot at the mark, see prepare_store, or not the key's any more:
                        # evicted, maybe stored again since; or the key object another one)
                        sk = entries.get(k)
                        if sk is None:
                            continue
                        s = sk
                    nr += 1
                    ro: object = nr << RANK_SHIFT      # (boxed once: as above)
                    rank[s] = ro
                    if queued and self.ready[s] and not self.refs[s]:
                        fr.append(ro)
                        fk.append(k)
        self.next_rank = nr

    def complete_store(self, keys: list, contents: list, slots: list | None = None) -> None:
        self.version += 1
        self.content_version += 1
        queued, ready, content = self.queued, self.ready, self.content
        ss: list = self.slots_of(keys, slots)
        # (zip: the keys, slots and contents read inline, not by bounds-checked calls; the
        # lists have one item per key)
        for k, so, cx in zip(keys, ss, contents):
            if so is None:
                continue
            s: int = so
            if not ready[s]:
                ready[s] = True
                content[s] = cx
                if queued and not self.refs[s]:
                    self._push(self.rank[s], k)       # evictable now

    def complete_load(self, keys, slots: list | None = None) -> None:
        self.version += 1
        self.content_version += 1
        queued, refs = self.queued, self.refs
        ss = self.slots_of(keys, slots)
        for x in range(len(ss)):
            s: int = ss[x]
            n = refs[s] - 1                     # (not -=: see prepare_load)
            refs[s] = n
            if queued and not n and self.ready[s]:
                self._push(self.rank[s], keys[x])     # evictable now


class ListCPUTier(CPUTier):
    """0.25.1-0.30.0 ``LRUCachePolicy`` with its evictable list (:class:`CPUTier` with
    ``evictable_list``: a chunk joins the MRU end when it becomes evictable, its store or its last
    load completing; ``touch`` moves the evictable ones of the keys given to the MRU end, last key
    first; eviction takes the evictable chunks from the LRU end), built lazily: the order only
    matters once a store must evict, and until then most of the work on it would be touches (of
    keys mostly not there) and store and load completions (in the order of vLLM's key set,
    :func:`tuple_set_order`).

    Until the first eviction (``lazy``) the order is kept as stamps: ``clock`` counts the moves
    (joins, touched keys), and a chunk's place in the list is the stamp of its last move, kept
    in ``rank[slot]``. Touches and store and load completions are logged (``log``, with the
    stamps they take) and applied, in order, at the first eviction (or when the log grows long):
    a touch ``(keys, lo, hi, t)`` gives ``keys[i]`` (lo <= i < hi) the stamp ``t + hi - 1 - i``
    if the chunk is evictable then and its stamp is lower (a chunk evictable then has been so
    since it last joined: it was there at the touch if it joined before, which its lower stamp
    says); a completion ``(keys, -1, n, t)`` joined the keys it made evictable at the placeholder
    stamp ``t`` and gives each one still there ``t`` + its index in set order. A touch whose keys
    a later touch of the same list covers is skipped (the later stamps are higher). At the first
    eviction the evictable chunks go into the ``lru`` in stamp order, and the tier works as the
    evictable list from then on."""

    def __init__(self, capacity: int):
        super().__init__(capacity, True)
        self.lazy = True
        self.clock = 0
        self.log: list[tuple] = []

    def touch(self, keys) -> None:
        self.touch_range(keys, 0, len(keys))

    def touch_range(self, keys: list, lo: int, hi: int) -> None:
        """``touch(keys[lo:hi])``; logged while lazy (``keys`` may grow after: ``[lo, hi)``
        counts)."""
        if not self.lazy:
            super().touch_range(keys, lo, hi)
            return
        self.version += 1
        if hi > lo:
            self.log.append((keys, lo, hi, self.clock))
            self.clock += hi - lo
            if len(self.log) > 256 + len(self.entries):
                self._apply_log()

    def _apply_log(self) -> None:
        """Apply the logged moves, in order (see the class docstring)."""
        log = self.log
        if not log:
            return
        self.log = []
        # the touches that a later touch of the same key list covers: skipped
        skip: list[bool] = [False] * len(log)
        last: dict[int, tuple[int, int]] = {}
        for x in range(len(log) - 1, -1, -1):
            keys, lo, hi, t = log[x]
            if lo < 0:
                continue
            cover = last.get(id(keys))
            if cover is not None and cover[0] <= lo and hi <= cover[1]:
                skip[x] = True
            else:
                last[id(keys)] = (lo, hi)
        entries, ready, refs, rank = self.entries, self.ready, self.refs, self.rank
        for x in range(len(log)):
            if skip[x]:
                continue
            keys, lo, hi, t = log[x]
            if lo < 0:
                # a store or load completion: its keys joined at the stamp t, in set order
                stamp = t
                for k in tuple_set_order(keys):
                    s = entries.get(k)
                    if s is not None and rank[s] == t and ready[s] and not refs[s]:
                        rank[s] = stamp
                    stamp += 1
                continue
            stamp = t
            for i in range(hi - 1, lo - 1, -1):
                s = entries.get(keys[i])
                if s is not None and ready[s] and not refs[s] and rank[s] < stamp:
                    rank[s] = stamp
                stamp += 1

    def prepare_store(self, keys, st=None, spans: list[int] | None = None) -> list | None:
        if self.lazy:
            # the new chunks are not evictable (not ready): no stamp yet
            entries = self.entries
            room = self.capacity - len(entries)
            if len(keys) <= room:
                return self._store_new(keys)
            n_new = 0
            for k in keys:
                if k not in entries:
                    n_new += 1
            if n_new <= room:
                return self._store_new(keys)
            # the first eviction: the evictable list, in stamp order, from now on
            self._apply_log()
            lru, ready, refs, rank = self.lru, self.ready, self.refs, self.rank
            for _, k in sorted([(rank[s], k) for k, s in entries.items()
                                if ready[s] and not refs[s]]):
                lru[k] = entries[k]
            self.lazy = False
        return super().prepare_store(keys, st)

    def complete_store(self, keys: list, contents: list, slots: list | None = None) -> None:
        """``keys``: the job's keys as listed; they join in the order of their set."""
        if not self.lazy:
            super().complete_store(keys, contents, slots)
            return
        self.version += 1
        self.content_version += 1
        ready, content, rank = self.ready, self.content, self.rank
        refs: list[i64] = self.refs             # (i64: the counts unboxed directly)
        t: object = self.clock                  # (boxed once for all the keys)
        ss: list = self.slots_of(keys, slots)
        # (zip: the slots and contents read inline, not by bounds-checked calls; both lists
        # have one item per key)
        for so, cx in zip(ss, contents):
            if so is None:
                continue
            s: i64 = so                         # (i64: the lists indexed with no tagged checks)
            if not ready[s]:
                ready[s] = True
                content[s] = cx
                if not refs[s]:
                    rank[s] = t                 # evictable now: placed when the log is applied
        self.log.append((keys, -1, len(keys), t))
        self.clock += len(keys)

    def prepare_load(self, keys, st=None, spans: list[int] | None = None) -> list:
        if not self.lazy:
            return super().prepare_load(keys, st)
        self.version += 1
        self.content_version += 1
        entries: dict = self.entries    # (untyped: the slot objects go into the list)
        refs: list[i64] = self.refs     # (i64: the counts and slots as plain 64-bit ints)
        ks: list = keys
        slots = [entries[k] for k in ks]
        for so in slots:
            s: i64 = so
            refs[s] = refs[s] + 1               # not evictable while loaded
        return slots

    def complete_load(self, keys: list, slots: list | None = None) -> None:
        """``keys``: the job's keys as listed; those evictable now join in the order of their set
        (logged as a store completion is: the set order is only worked out if the log is
        applied)."""
        if not self.lazy:
            super().complete_load(keys, slots)
            return
        self.version += 1
        self.content_version += 1
        ready, rank = self.ready, self.rank
        refs: list[i64] = self.refs     # (i64: the counts and slots as plain 64-bit ints)
        t: object = self.clock                  # (boxed once for all the keys)
        ss: list = self.slots_of(keys, slots)
        for so in ss:                           # (one slot per key)
            s: i64 = so
            r: i64 = refs[s] - 1                # (not -=: a generic in-place subtraction when
            if r:                               # compiled)
                refs[s] = r
                continue
            refs[s] = 0                         # (a literal: the int object made once)
            if ready[s]:
                rank[s] = t                     # evictable now: placed when the log is applied
        self.log.append((keys, -1, len(keys), t))
        self.clock += len(keys)


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


class GroupState:
    __slots__ = ("keys", "block_ids", "next_stored", "num_hit_chunks")

    def __init__(self) -> None:
        # offload keys (group_id, block hash): see make_key. Key m is made from the block hash
        # of index hpc * m + hpc - 1 (hpc: the group's hashes_per_chunk), shown in traces
        # (OffloadScheduler._hash_indices)
        self.keys: list[Key] = []
        self.block_ids: list[int] = []
        self.next_stored = 0
        self.num_hit_chunks = 0


class ReqOffload:
    __slots__ = ("req", "groups", "jobs", "max_offload_tokens", "max_load_tokens", "num_local",
                 "finished_signaled", "next_key_at", "memo_version", "memo_local", "memo_tokens",
                 "memo_hit", "memo_evictions", "memo_missed", "memo_pending", "memo_loading")

    def __init__(self, req: Request, n: int):
        self.req = req
        self.groups = [GroupState() for _ in range(n)]
        self.jobs: set[int] = set()
        spec = req.spec
        self.max_offload_tokens = spec.max_offload_tokens if spec is not None else None
        self.max_load_tokens = spec.max_load_tokens if spec is not None else None
        self.num_local = 0
        self.finished_signaled = False
        self.next_key_at = 0       # num_tokens below which update_offload_keys adds no key
        # the last _lookup (see OffloadScheduler._lookup_memo): its hit (before the being_loaded
        # check) and the keys it read as missing and as pending (filled by _lookup); num_local
        # and num_tokens then; the tier's content_version and evictions at the last call, when
        # the hit was still that (version -1: none), and whether being_loaded deferred it then
        self.memo_version = -1
        self.memo_evictions = 0
        self.memo_local = 0
        self.memo_tokens = 0
        self.memo_hit: int | None = None
        self.memo_missed: list = []
        self.memo_pending: list = []
        self.memo_loading = False


_GROUP0_END: Final = 1 << 63       # group 0's keys are [-2**63, 2**63) (allocator.make_key)


def tuple_set_order(keys: list) -> list[Key]:
    """The distinct ``keys`` in the order a set of their ``(group_id, ident)`` tuples, filled in
    the order given, iterates them. A job's keys as vLLM holds them (a set) are walked in set
    order when the job completes, which matters to the evictable list of the pre-0.31.0 CPU tier
    (each completed chunk joins its MRU end). vLLM's set holds bytes keys, whose hashes vary per
    process; the model fixed that order as the one of the pair tuples (the representation of keys
    before they became ints), and keeps it. (Group 0's keys are its idents, the keys below
    2**63: see allocator.make_key; they are not taken apart.)"""
    pairs: set[tuple[int, Key]] = set()     # (typed: taken apart with no iterator each)
    last, base = 0, make_key(0, 0)      # the last group met and its base (groups come in runs)
    for x in range(len(keys)):
        k = keys[x]
        if k < _GROUP0_END:
            g = 0
        else:
            g = key_group(k)
        if not g:
            pairs.add((0, k))
        else:
            if g != last:
                last, base = g, make_key(g, 0)
            pairs.add((g, k - base))            # (key_ident(k), without a second walk)
    return [make_key(g, h) if g else h for g, h in pairs]


class Job:
    """A transfer job. Its chunks, in order, are kept as parallel lists (no object per chunk):
    chunk ``x`` is group ``gids[x]``'s chunk ``cidx[x]``, named by the key ``ckeys[x]`` made from
    the request's block hash ``hidx[x]``; its blocks (a store's sources, a load's destinations)
    are ``bids[bpos[x]:bpos[x + 1]]``, at the block indices ``bidx[bpos[x]:bpos[x + 1]]`` of the
    request's table. :meth:`chunks` gives them as ``(group_id, chunk_idx, hash_idx, key,
    [(block_index, block_id)])`` tuples. ``keys``: a load's, the list ``ckeys`` (which the tier
    walks in the order it needs when the load completes); a store's, its chunks'
    keys (``ckeys`` lists them, in chunk order, with ``contents``: the tier completes those). A
    store's fences (``_block_id_to_pending_jobs``): ``fenced``, the blocks fenced at once (None
    if none); ``deferred``, whether its other source blocks are fenced once its request finishes
    (OffloadScheduler._deferred lists them). ``slots``: the CPU tier's slots of ``ckeys``, in
    order, kept from when the job was prepared (stable while it is in flight: see CPUTier), None
    if not known (the tier looks the keys up)."""

    __slots__ = ("jid", "rid", "is_store", "keys", "gids", "cidx", "hidx", "ckeys", "bpos",
                 "bidx", "bids", "fenced", "deferred", "read", "contents", "done", "slots")

    def __init__(self, jid, rid, is_store, keys, fenced=None, deferred: bool = False):
        self.jid, self.rid, self.is_store = jid, rid, is_store
        self.keys = keys
        self.gids: list[int] = []
        self.cidx: list[int] = []
        self.hidx: list[int] = []
        self.ckeys: list = []           # (Key = Any: the key objects as made)
        self.bpos: list[int] = [0]
        self.bidx: list[int] = []
        self.bids: list = []            # (the block ID objects of the tables: no re-boxing)
        self.fenced = fenced
        self.deferred = deferred
        self.read = False            # a store has read its source blocks
        self.contents: list = []       # a store's chunk contents, in chunk order, once read
        self.done = False
        self.slots: list | None = None

    def add_chunk(self, gid: int, c: int, hidx: int, key: Key, blocks) -> None:
        """Append a chunk; ``blocks``: its ``(block_index, block_id)`` pairs."""
        self.gids.append(gid)
        self.cidx.append(c)
        self.hidx.append(hidx)
        self.ckeys.append(key)
        for i, b in blocks:
            self.bidx.append(i)
            self.bids.append(b)
        self.bpos.append(len(self.bids))

    def chunk(self, x: int) -> tuple:
        """Chunk ``x`` as ``(group_id, chunk_idx, hash_idx, key, [(block_index, block_id)])``."""
        lo, hi = self.bpos[x], self.bpos[x + 1]
        return (self.gids[x], self.cidx[x], self.hidx[x], self.ckeys[x],
                list(zip(self.bidx[lo:hi], self.bids[lo:hi])))

    def chunks(self) -> list[tuple]:
        """Every chunk, as :meth:`chunk` gives it."""
        return [self.chunk(x) for x in range(len(self.gids))]

    @property
    def items(self) -> list[tuple]:
        """:meth:`chunks`: the shape of the real-vLLM harness's jobs, which the trace and the
        named invariant checks read (built on demand)."""
        return self.chunks()

    def set_chunks(self, items) -> None:
        """Replace the chunks by ``items``, tuples as :meth:`chunk` gives them (tests); their
        slots are not known then."""
        self.slots = None
        self.gids, self.cidx, self.hidx, self.ckeys = [], [], [], []
        self.bpos, self.bidx, self.bids = [0], [], []
        for gid, c, hidx, key, blocks in items:
            self.add_chunk(gid, c, hidx, key, blocks)


class OffloadScheduler:
    def __init__(self, geometry: Geometry, profile: Profile, asserts: bool, cpu_chunks: int,
                 enable_prefix_caching: bool = True, layout=None):
        self.geo, self.profile, self.asserts = geometry, profile, asserts
        self.cfgs = geometry.groups
        self.n = len(self.cfgs)
        self.bpc = geometry.blocks_per_chunk
        self.tph = geometry.tokens_per_hash
        # one block and one hash per chunk in every group: a store job's chunk, hash and block
        # indices are the same numbers (_store_job makes them one list)
        self.one_index = self.bpc == 1 and all(g.hashes_per_chunk == 1 for g in self.cfgs)
        # the CPU tier's LRUCachePolicy: up to 0.30.0 an evictable list; from 0.31.0 recency ranks,
        # by request and token position from 0.33.0 (profile.extra["cpu_lru"])
        lru = profile.extra.get("cpu_lru", "ranks" if profile.offloaded_groups is
                                prefix_cacheable_groups else "list")
        self.tier: CPUTier
        if lru == "list":
            self.tier = ListCPUTier(cpu_chunks)
        elif lru == "plain":                # "plain": insertion and touch order only
            self.tier = CPUTier(cpu_chunks)
        else:
            self.tier = RankedCPUTier(cpu_chunks, lru == "request-ranks", self.cfgs)
        self.req_status: dict[str, ReqOffload] = {}
        self.jobs: dict[int, Job] = {}
        # the last touch (see _touch): the tier's version after it (-1: none), the request state
        # it touched, its length and its groups' num_hit_chunks then
        self._touched_version = -1
        self._touched_st: ReqOffload | None = None
        self._touched_len = 0
        self._touched_hits: list[int] = []
        self.job_counter = 0
        # _block_id_to_pending_jobs: block ID -> the ID of the one pending job that reads it,
        # or a set of their IDs where several do (mostly one: no set per block)
        self.block_to_jobs: dict[int, int | set[int]] = {}
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
        self.sw_held: dict[str, ReqOffload] = {}
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
        # chunk by chunk like the other groups and the boundary states are not handed over)
        boundary_stores = profile.extra.get("mamba_boundary_stores", True)
        self.boundary_stores: bool = boundary_stores
        if layout is not None:
            for g in self.cfgs:
                grp = layout.groups[g.group_id]
                if grp.kind == "mamba" and grp.mamba_cache_mode == "align":
                    self.mamba_align = g.tokens_per_chunk
                    if boundary_stores:
                        self.cow_groups |= {g.group_id}
        self.supports_max_load = profile.extra.get(
            "max_load_tokens", profile.offloaded_groups is prefix_cacheable_groups)
        self.finish_clamp = profile.extra.get("finish_store_clamp", profile.keyed_chunk_clamp)
        # 0.25.1: an EAGLE group's trailing chunk of each store is skipped for good
        self.eagle_tail_hole: bool = profile.extra.get("eagle_tail_hole", False)
        self.observer = None     # set by the model: gets (event, payload) callbacks
        self.prompt_only = layout.engine.offload_prompt_only if layout is not None else True
        # 0.30.0+ (the releases with retention plumbing, ``profile.retention_check``): a sliding
        # window group stores only the chunks that SlidingWindowManager.reachable_block_mask
        # says a later lookup can reach
        self.sw_store_mask: dict = {}
        # 0.30.0+ (same marker): sliding-window lookups use load_window_size_in_chunks and a miss
        # clears a pending chunk (_sliding_window_lookup); window sizes of SlidingWindowSpec groups
        self.window_v2 = profile.retention_check
        # 0.33.0's get_num_new_matched_tokens sets every group's next_stored_chunk_idx back to 0
        self.restart_store_idx = profile.extra.get("restart_store_idx", False)
        # 0.33.0's _build_store_jobs skips a chunk with a reachable null block, not only one
        # whose last block is null ("A reachable null block would leave part of the chunk
        # unwritten")
        self.skip_null_chunks: bool = profile.extra.get("store_skip_null_chunks", False)
        # 0.33.0's update_state_after_alloc records every block of an admitted request, in every
        # group (also groups not offloaded, GPU hits included) as allocated in this batch, with or
        # without a load: a pending store fencing one of them is flushed
        self.alloc_all_groups = profile.extra.get("alloc_all_groups", False)
        # the KV cache groups not offloaded (None: the layout is not known), see
        # update_state_after_alloc
        self.other_gids: tuple | None = None if layout is None else tuple(
            sorted(set(range(len(layout.groups))) - {g.group_id for g in self.cfgs}))
        self.sw_tokens = {g.group_id: layout.groups[g.group_id].sliding_window for g in self.cfgs
                          if layout is not None and layout.groups[g.group_id].kind in
                          ("sliding_window", "sliding_window_mla")}
        if layout is not None and profile.retention_check:
            retention = retention_interval(layout, profile)
            for g in self.cfgs:
                grp = layout.groups[g.group_id]
                if grp.kind in ("sliding_window", "sliding_window_mla"):
                    self.sw_store_mask[g.group_id] = _SlidingWindowStoreMask(
                        g, grp.sliding_window, geometry, retention)

    # --- RequestOffloadState ----------------------------------------------------------------
    def update_offload_keys(self, st: ReqOffload, caller: str = "") -> None:
        if len(st.req.tokens) < st.next_key_at:
            return                             # fast path: no group gets a new key
        try:
            self._update_offload_keys(st)
        except ConfigError as e:
            e.caller = caller  # type: ignore[attr-defined]
            raise

    def _update_offload_keys(self, st: ReqOffload) -> None:
        req, profile = st.req, self.profile
        # (i64: the hash and key counts as plain 64-bit ints, no tagged-int checks)
        tph: i64 = self.tph
        num_hashes: i64 = req.num_tokens // tph
        hpc: i64
        for cfg, gs in zip(self.cfgs, st.groups):
            hpc = cfg.hashes_per_chunk
            if hpc > 0 and (len(gs.keys) + 1) * hpc > num_hashes:
                continue                       # fast path: no new key
            m: i64 = len(gs.keys)
            if hpc <= 0:
                # offload_key_indices raises islice's ValueError or, for a group of no hashes
                # skipped, gives no index: no key
                offload_key_indices(cfg, num_hashes, m, profile)
                continue
            # offload_key_indices(cfg, num_hashes, m, profile), inlined (hpc > 0: no error): the
            # hash indices range(first, num_hashes, hpc), of which there are n_new; key m (hash
            # index j = hpc * m + hpc - 1) names the tokens [0, (j + 1) * tph):
            # make_key(gid, ident_at((m + 1) * hpc * tph)), from the request's shared key list
            first: i64 = hpc * m + hpc - 1
            n_new: i64 = (num_hashes - first + hpc - 1) // hpc if num_hashes > first else 0
            if n_new:
                ks = req.keys(cfg.group_id, hpc * tph)
                if n_new == 1 and m < len(ks):
                    gs.keys.append(ks[m])       # (mostly one, as decoding completes a chunk)
                elif m:
                    gs.keys.extend(ks[m:m + n_new])
                else:
                    # the group's first keys: the slice is its list (nothing else holds the
                    # empty one), not copied into it (a list.extend is a slice assignment)
                    gs.keys = ks[:n_new]
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

    def storable_chunks(self, st: ReqOffload, cfg: GroupGeometry, gs: GroupState,
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
                self.profile.keyed_chunk_clamp and st.req.finished):
            n = max(0, n - 1)
        n = min(n, len(gs.block_ids) // self.bpc)
        if self.profile.keyed_chunk_clamp:
            n = min(n, len(gs.keys))
        return n

    def advance_stored_idx(self, st: ReqOffload, num_tokens: int, ns=None) -> None:
        """``ns``: ``storable_chunks(..., num_tokens)`` per group when the caller has them."""
        if ns is None:
            ns = [self.storable_chunks(st, cfg, gs, num_tokens, False)
                  for cfg, gs in zip(self.cfgs, st.groups)]
        for gs, n in zip(st.groups, ns):
            if n > gs.next_stored:
                gs.next_stored = n

    # --- scheduler-facing API ---------------------------------------------------------------
    def on_new_request(self, req: Request) -> None:
        st = ReqOffload(req, self.n)
        req.off = st
        self.req_status[req.rid] = st

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
        hit = self._lookup_memo(st)
        for cfg, gs in zip(self.cfgs, st.groups):
            gs.num_hit_chunks = (num_computed + (hit or 0)) // cfg.tokens_per_chunk
        self._touch(st)
        return hit

    def _lookup_memo(self, st: ReqOffload) -> int | None:
        """``_lookup(st)``, or its last result when it would read the same again. A waiting
        request that cannot be admitted repeats the same lookup step after step, while other
        requests' stores complete (each moves the tier's ``content_version``).

        Exact: with the same ``num_local`` and request length (which fix the request's offload
        keys and every bound of the search), ``_lookup``'s search reads nothing of the tier but
        whether each key it visits is there and if so ready, and its result follows from those
        reads. A chunk leaves the tier (or stops being ready: a slot is freed and reused) only
        by eviction, which moves ``evictions`` (a failed insertion takes out only the chunks it
        added in the same call, never seen by a lookup); otherwise a chunk only comes in (not
        ready) or becomes ready. So with no eviction since, every key read as ready still is;
        the keys read as missing (``memo_missed``) and as pending (``memo_pending``, whether
        in the first-miss walk of a full-attention group or in the sliding-window walk from the
        end, where a pending chunk defers the lookup) are read again: if each still is, every
        read repeats. ``being_loaded`` is not part of the search: its check of the hit's keys
        runs again whenever the content changed (a hit of 0 has none to check: every group's
        range is empty or the lookup returned early)."""
        tier = self.tier
        version, num_local, num_tokens = tier.content_version, st.num_local, len(st.req.tokens)
        hit: int | None
        if st.memo_local == num_local and st.memo_tokens == num_tokens:
            if st.memo_version == version:
                # (``being_loaded`` changes only with the content: the same check's result)
                return None if st.memo_loading else st.memo_hit
            if st.memo_version >= 0 and st.memo_evictions == tier.evictions \
                    and self._reads_unchanged(st):
                hit = st.memo_hit
            else:
                hit = self._fresh_lookup(st)
        else:
            hit = self._fresh_lookup(st)
        st.memo_version, st.memo_evictions, st.memo_local, st.memo_tokens = \
            version, tier.evictions, num_local, num_tokens
        loading = False
        if hit and self.being_loaded:
            loading = self._hits_being_loaded(st, hit)
        st.memo_loading = loading
        return None if loading else hit

    def _fresh_lookup(self, st: ReqOffload) -> int | None:
        """``_lookup(st)``, its result and what it read kept in ``st``'s memo."""
        st.memo_missed.clear()
        st.memo_pending.clear()
        hit = st.memo_hit = self._lookup(st)
        return hit

    def _reads_unchanged(self, st: ReqOffload) -> bool:
        """Every key the last ``_lookup`` read as missing is still missing, every key it read as
        pending is still pending."""
        entries, ready = self.tier.entries, self.tier.ready
        for k in st.memo_missed:
            if k in entries:
                return False
        for k in st.memo_pending:
            so = entries.get(k)
            if so is None:
                return False
            s: i64 = so                 # (i64: ``ready`` indexed with no tagged-int checks)
            if ready[s]:
                return False
        return True

    def _touch(self, st: ReqOffload) -> None:
        """Touch the request's keys in the CPU tier's LRU. Repeating a touch changes nothing when
        the tier did not change since (the touched keys already sit at the MRU end in the order
        the touch leaves them): then it is skipped (``_touched_*``: the tier's version after the
        last touch, and what that touch covered). A tier that ignores touches (0.31.0+) is not
        called."""
        tier = self.tier
        if not tier.touches:
            return
        n = len(st.req.tokens)
        if self._touched_version == tier.version and self._touched_st is st \
                and self._touched_len == n:
            hits = self._touched_hits
            for x, gs in enumerate(st.groups):
                if hits[x] != gs.num_hit_chunks:
                    break
            else:
                return
        for cfg, gs in zip(self.cfgs, st.groups):
            w = cfg.sliding_window_in_chunks
            keys = gs.keys
            tier.touch_range(keys, 0 if w is None else max(0, gs.num_hit_chunks - w), len(keys))
        self._touched_version, self._touched_st, self._touched_len = tier.version, st, n
        self._touched_hits = [gs.num_hit_chunks for gs in st.groups]

    def _load_window(self, cfg: GroupGeometry, num_tokens: int) -> int:
        """``GroupOffloadConfig.load_window_size_in_chunks``: a SlidingWindowSpec group's window in
        chunks grows to cover a partial rightmost chunk (``-num_tokens % tokens_per_chunk``)."""
        w: Any = cfg.sliding_window_in_chunks
        wt: int | None = self.sw_tokens.get(cfg.group_id)
        if wt is None:
            return w
        win: int = wt                   # (native ints from here)
        tpc = cfg.tokens_per_chunk
        n = -(-(win - 1 + (-num_tokens % tpc)) // tpc)
        wi: int = w
        return wi if wi >= n else n

    def _lookup(self, st: ReqOffload) -> int | None:
        """``_lookup_complete_chunks`` without deferred backends and EAGLE pops, but for its
        ``being_loaded`` check (``_hits_being_loaded``). Appends the keys it reads as missing to
        ``st.memo_missed``, those it reads as pending to ``st.memo_pending`` (_lookup_memo)."""
        req, tier = st.req, self.tier
        # (tier.lookup of a key, inlined below: MISS when not in ``entries``, HIT_PENDING when
        # its chunk is not ready; i64: the slot found unboxed directly, ``ready`` indexed with
        # no tagged-int checks)
        entries: dict[Key, i64] = tier.entries
        ready = tier.ready
        missed, pending_keys = st.memo_missed, st.memo_pending
        # (i64: the token counts, chunk indices and hits as plain 64-bit ints, no tagged-int
        # checks in the arithmetic and comparisons)
        num_computed: i64 = st.num_local
        max_hit: i64 = req.num_tokens
        if self.supports_max_load and st.max_load_tokens is not None:
            max_hit = min(max_hit, num_computed + st.max_load_tokens)
        if self.sw_groups:
            max_hit -= 1
            if self.mamba_align is not None:
                max_hit = max_hit // self.mamba_align * self.mamba_align
        num_hit: i64 = 0
        n_hit: i64
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
                tpc: i64 = cfg.tokens_per_chunk
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
                query_max: i64 = min(max_hit + tpc, len(keys) * tpc) if eagle else max_hit
                num_chunks: i64 = min(-(-query_max // tpc), len(keys))
                start: i64 = num_computed // tpc
                # n_hit: the group's hit in chunks from ``start``; -1: deferred (not None: a native
                # int)
                if w is None:
                    hits: i64 = 0
                    j: i64                  # (i64: keys indexed with no tagged-int checks)
                    for j in range(start, num_chunks):         # (keys[start:num_chunks])
                        k = keys[j]
                        s = entries.get(k)
                        if s is None:
                            missed.append(k)
                            break
                        if not ready[s]:
                            defer = True
                            pending_keys.append(k)
                        hits += 1
                    n_hit = -1 if defer else hits
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
                    idx: i64
                    for idx in range(len(sub) - 1, -1, -1):
                        k = sub[idx]
                        s = entries.get(k)
                        if s is None:
                            missed.append(k)
                            consecutive = 0
                            if v2:
                                pending, need = False, w_req
                        else:
                            if not ready[s]:
                                pending = True
                                pending_keys.append(k)
                            consecutive += 1
                        if consecutive == need:
                            n_hit, found = idx + need, True
                            break
                    if not found:
                        n_hit = consecutive
                    if pending:
                        n_hit = -1
                        defer = True
                if n_hit == 0:
                    return 0
                if n_hit >= 0:
                    if eagle:
                        n_hit -= 1
                        eagle_verified |= 1 << gi
                    max_hit = min(max_hit, tpc * (start + n_hit))
                new_hit: i64 = max_hit - num_computed
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

    def _hits_being_loaded(self, st: ReqOffload, num_hit: int) -> bool:
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
            # (gkeys[lo:hi] and bl disjoint, without the slice; i64: gkeys indexed with no
            # tagged-int checks)
            x: i64 = lo
            end: i64 = len(gkeys) if hi > len(gkeys) else hi
            while x < end:
                if gkeys[x] in bl:
                    return True
                x += 1
        return False

    def update_state_after_alloc(self, req: Request, tables: list[list[int]], num_external: int,
                                 block_keys: list | None) -> Job | None:
        """A load job for ``num_external`` tokens beyond the GPU hit; ``tables`` are the request's
        block tables (every KV cache group), ``block_keys[block]`` is the block hash a block
        carries (its GPU prefix-cache key, ``BlockPool.key``: a GPU prefix hit), None if none
        (``is_cached``). Without a load the request is scheduled in this step."""
        bpc: i64 = self.bpc         # (i64: positions and counts with no tagged-int checks)
        marked: list[list[int]]         # the tables whose blocks this batch allocated
        if self.alloc_all_groups:
            # a request scheduled in this step: its new blocks are its whole tables, which
            # build_connector_meta (_update_req_states) marks for the offloaded groups before any
            # use of them; the other groups' blocks are marked here
            marked = ([tables[gid] for gid in self.other_gids]
                      if num_external == 0 and self.other_gids is not None else tables)
        elif num_external:
            # up to 0.32.0 a load's offloaded groups, every block of their tables
            marked = [tables[cfg.group_id] for cfg in self.cfgs]
        else:
            return None
        if self.alloc_mark is not None:
            mark: list = self.alloc_mark        # (typed list, not Optional: native item stores)
            batch: object = self.alloc_batch    # (one int object, stored in every mark)
            blk: i64                # (i64: the marks indexed with no tagged-int checks)
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
        num_cached: i64 = st.num_local + num_external
        keys: list[Key] = []
        spans: list[int] = []       # per group: its keys' first chunk index and count (the tier)
        job = Job(-1, req.rid, False, None)     # (its ID is given by _new_job, at the end)
        bpos = job.bpos
        for cfg, gs in zip(self.cfgs, st.groups):
            gid = cfg.group_id
            spans.append(0)
            spans.append(0)
            blocks: list = tables[gid]     # (untyped: the block ID objects go into the job)
            tpb: i64 = cfg.tokens_per_block
            tpc: i64 = cfg.tokens_per_chunk
            n_gpu: i64 = -(-num_cached // tpb)
            n_local: i64 = n_gpu
            assert block_keys is not None         # (num_external > 0: given)
            i: i64                  # (i64: the lists indexed with no tagged-int checks)
            for i in range(n_gpu):
                bi: i64 = blocks[i]
                if bi != NULL and block_keys[bi] is None:
                    n_local = i
                    break
            if n_gpu - n_local:
                start: i64 = n_local // bpc
                end: i64 = -(-num_cached // tpc)
                gkeys = gs.keys
                if self.asserts and len(gkeys) < end:
                    raise ModelCrash("AssertionError", "update_state_after_alloc", "load",
                                     "assert len(offload_keys) >= end_chunk_idx")
                # chunks [start, cend), chunk c loading the blocks [max(c * bpc, n_local),
                # min((c + 1) * bpc, n_gpu)) (tokens_per_chunk = bpc * tokens_per_block): together
                # the blocks [n_local, min(cend * bpc, n_gpu)); the lists of the chunks' keys,
                # hash indices and blocks are slices, added at once (the first group's are the
                # job's lists, not copied into its empty ones: a list.extend is a slice assignment)
                cend: i64 = min(end, len(gkeys))
                if start < cend:
                    m: i64 = cend - start
                    spans[-2], spans[-1] = start, m
                    top: i64 = min(cend * bpc, n_gpu)
                    shift: i64 = len(job.bids) - n_local    # block i goes to position shift + i
                    if not keys:
                        job.gids = [gid] * m
                        job.cidx = self._ints(start, cend)
                        job.hidx = self._hash_indices(cfg.hashes_per_chunk, start, cend)
                        keys = gkeys[start:cend]        # (the job's ckeys: the same list)
                        job.bids = blocks[n_local:top]
                        job.bidx = self._ints(n_local, top)
                    else:
                        job.gids.extend([gid] * m)
                        job.cidx.extend(self._ints(start, cend))
                        job.hidx.extend(self._hash_indices(cfg.hashes_per_chunk, start, cend))
                        keys.extend(gkeys[start:cend])
                        job.bids.extend(blocks[n_local:top])
                        job.bidx.extend(self._ints(n_local, top))
                    # chunk c's blocks end at (c + 1) * bpc for c < n_gpu // bpc, else at n_gpu
                    # (mostly the last chunk alone: appended, no list made)
                    k: i64 = max(start, min(cend, n_gpu // bpc))
                    if k > start:
                        bpos.extend(self._ints(shift + (start + 1) * bpc, shift + k * bpc + 1, bpc))
                    if cend - k == 1:
                        bpos.append(shift + n_gpu)
                    elif cend > k:
                        bpos.extend([shift + n_gpu] * (cend - k))
            gs.next_stored = -(-num_cached // tpc)      # BLOCK_LEVEL policy
        job.slots = self.tier.prepare_load(keys, st, spans)
        job.ckeys = keys
        # (the evictable list's complete_load puts the keys in the order of their set,
        # tuple_set_order, itself: when that order is needed)
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
        sts: list[ReqOffload] = []      # the scheduled requests' states, in order (store jobs)
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
                new: list[i64] = nb[cfg.group_id]   # (i64: the IDs unboxed directly)
                if cfg.sliding_window_in_chunks is None:
                    bl: list = gs.block_ids     # (the block ID objects appended as they are)
                    if len(new) == 1:
                        # one block (a decode step reaching a new block): appended (list.extend
                        # is a slice assignment with a realloc, about 300 instructions more)
                        one: list = new
                        bl.append(one[0])
                    else:
                        bl.extend(new)
                if mark is None:
                    alloc.update(new)
                    continue
                blk: i64
                for blk in new:
                    if blk != NULL:    # null placeholders are not allocations
                        mark[blk] = batch
                        marked = True
        alloc.discard(NULL)      # null placeholders are not allocations
        if sw_groups and (alloc or marked):
            # (i64: the positions, block IDs and batch numbers as plain 64-bit ints)
            bpc: i64 = self.bpc
            prompt_only = self.prompt_only
            now: i64 = self.alloc_batch
            in_set = bool(alloc)
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
                    bids: list = gs.block_ids   # (IDs looked up as the int objects it holds)
                    stop: i64 = len(bids)
                    if prompt_only:
                        top: i64 = num_prompt // cfgs[gi].tokens_per_chunk * bpc
                        if top < stop:
                            stop = top
                    start: i64 = gs.next_stored * bpc
                    if start < stop:
                        visit = True
                    j: i64
                    for j in range(start, stop):
                        # _allocated_now(bids[j]), inlined (a NULL block is never marked)
                        bo = bids[j]
                        b: i64 = bo
                        if mark is not None:
                            m: i64 = mark[b]
                            if m == now:
                                bids[j] = NULL
                                continue
                        if in_set and bo in alloc:
                            bids[j] = NULL
                if not visit and rid not in new_blocks:     # (new ones: appended below)
                    idle.append(rid)
            for rid in idle:
                del held[rid]
        for x in range(0, len(grown), 2):
            gst: ReqOffload = grown[x]
            gnb: list = grown[x + 1]
            for gi in sw_groups:
                gnew: list = gnb[cfgs[gi].group_id]
                gbl: list = gst.groups[gi].block_ids
                if len(gnew) == 1:
                    gbl.append(gnew[0])         # (one block: appended, as above)
                else:
                    gbl.extend(gnew)
        for rid in preempted:
            pst = rs.get(rid)
            if pst is not None and pst.jobs:
                self.batch_flush.update(pst.jobs)
        if self.block_to_jobs and (alloc or marked):
            for b, pending in self.block_to_jobs.items():
                if not self._allocated_now(b):
                    continue
                if isinstance(pending, int):
                    self.batch_flush.add(pending)
                else:
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

    def _offloadable(self, st: ReqOffload, n: int) -> int:
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
                to_store, slots = self.tier.prepare_store_slots([key], st)
                if not to_store:
                    continue
                c = boundary // cfg.tokens_per_chunk - 1
                job = Job(-1, rid, True, {key}, [b])
                job.slots = slots
                job.add_chunk(gid, c, boundary // tph - 1, key,
                              [(boundary // cfg.tokens_per_block - 1, b)])
                self._new_job(job)
                st.jobs.add(job.jid)
                self._fence(b, job.jid)
                out.append(job)
        return out

    def _build_store_jobs(self, scheduled: dict[str, int], finished: list[str],
                          states: list[ReqOffload]) -> list[Job]:
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

    def _null_chunk_keys(self, st: ReqOffload, gs: GroupState, start: int, cnt: int,
                         mask: _SlidingWindowStoreMask | None, new_keys: list) -> int:
        """0.33.0's ``_build_store_jobs`` key walk over chunks ``start..start+cnt-1``: a chunk
        is kept when its last block is not null, one of its blocks is reachable
        (``_reachable_store_block_mask``; no mask: all of them) and none of its reachable blocks
        is null; the keys kept are appended to ``new_keys``. Returns the index (from
        ``start``) of the first chunk kept, -1 if none."""
        bpc = self.bpc
        bl = gs.block_ids
        blocks = None
        if mask is not None:
            blocks = mask.blocks(start, start + cnt, st.req.num_prompt,
                                 st.req.shared_prefix_boundary)
        first = -1
        for i in range(cnt):
            lo = (start + i) * bpc
            reach = [True] * bpc if blocks is None else blocks[i * bpc:(i + 1) * bpc]
            if bl[lo + bpc - 1] == NULL or not any(reach):
                continue
            if any(r and bl[lo + b] == NULL for b, r in enumerate(reach)):
                continue
            if first < 0:
                first = i
            new_keys.append(gs.keys[start + i])
        return first

    def _store_job(self, st: ReqOffload, n_sched: int, out: list[Job]) -> None:
        """The store job of the request of ``st``, if it has chunks to store, appended to ``out``
        (``n_sched``: the tokens scheduled for it, read if it has not finished)."""
        # (i64: the positions, indices and counts as plain 64-bit ints, no tagged-int checks
        # in the arithmetic, comparisons and list indexing)
        bpc: i64 = self.bpc
        asserts, tier = self.asserts, self.tier
        cfgs = self.cfgs
        masks: dict[int, _SlidingWindowStoreMask] = self.sw_store_mask
        req = st.req
        rid = req.rid
        if req.status == ABORTED:
            n_after = req.num_computed
        elif req.finished:
            # 0.30.0+ clamp to the commit point: the final sampled token's slot is never
            # written; 0.29.0 stores up to num_tokens (the block ending there is stale)
            n_after = (max(req.num_prompt, req.num_tokens - 1) if self.finish_clamp
                       else req.num_tokens)
        else:
            n_after = req.num_computed + n_sched
        n_off: i64 = self._offloadable(st, n_after)
        groups = st.groups
        for cfg, gs in zip(cfgs, groups):
            if n_off // cfg.tokens_per_chunk > gs.next_stored:
                break
        else:
            return        # no group can store a chunk: advance_stored_idx is a no-op too
        new_keys: list = []
        ns = [self.storable_chunks(st, cfg, gs, n_off) for cfg, gs in zip(cfgs, groups)]
        # where next_stored goes after this store (the chunks collected but under 0.25.1's hole)
        adv = [self.storable_chunks(st, cfg, gs, n_off, False) for cfg, gs in zip(cfgs, groups)
               ] if self.eagle_tail_hole else ns
        # per group: where its keys start in new_keys when they are all of its chunks
        # start..min(n, len(keys)) - 1 (each chunk's last block not NULL, reachable), else -1;
        # the chunk of its first key in new_keys (n if none: the walk below starts there); and
        # (spans, for the tier) the chunk index they start from and how many there are
        whole: list[int] = []
        firsts: list[int] = []
        spans: list[int] = []
        cow = self.cow_groups
        start: i64
        i: i64
        for cfg, gs, n in zip(cfgs, groups, ns):
            start = gs.next_stored
            whole.append(-1)
            firsts.append(n)
            spans.append(start)
            spans.append(0)
            if n <= start or cfg.group_id in cow:
                continue
            # the chunks' keys gs.keys[start:n] and their last blocks
            # gs.block_ids[start * bpc + bpc - 1:n * bpc:bpc]
            gkeys = gs.keys
            bl: list = gs.block_ids     # (block IDs read as the int objects the list holds)
            nk: i64 = max(0, min(n, len(gkeys)) - start)
            b_lo: i64 = start * bpc + bpc - 1
            b_hi: i64 = min(n * bpc, len(bl))
            nb: i64 = (b_hi - b_lo + bpc - 1) // bpc if b_hi > b_lo else 0
            if asserts and nk != nb:
                raise ModelCrash(
                    "AssertionError", "_build_store_jobs", "build_store_jobs",
                    f"assert len(offload_keys) == len(offload_block_ids) "
                    f"({nk} != {nb}, group {cfg.group_id})")
            k0: i64 = len(new_keys)
            cnt: i64 = min(nk, nb)
            mask = masks.get(cfg.group_id) if masks else None
            if self.skip_null_chunks and cnt:
                i = self._null_chunk_keys(st, gs, start, cnt, mask, new_keys)
                if i >= 0:
                    firsts[-1] = start + i
                if len(new_keys) - k0 == cnt and start + cnt == min(n, len(gkeys)):
                    whole[-1] = k0
                spans[-1] = len(new_keys) - k0
                continue
            if mask is not None:
                reach = mask.reachable(start, n, req.num_prompt, req.shared_prefix_boundary)
                cnt = min(cnt, len(reach))
                i = 0                   # (the mask read inline: mostly not reachable)
                for r in reach:
                    if i == cnt:
                        break
                    if r and bl[b_lo + i * bpc]:        # reachable, block not NULL (0)
                        if len(new_keys) == k0:
                            firsts[-1] = start + i
                        new_keys.append(gkeys[start + i])
                    i += 1
            elif cnt:
                # the keys whose block is not NULL (0): all cnt of them when no block is
                # (one slice of keys)
                lasts: list[i64] = bl[b_lo:b_lo + (cnt - 1) * bpc + 1:bpc] if bpc > 1 else \
                    bl[b_lo:b_lo + cnt]
                null = False            # (a native loop: no call of all() nor compared objects)
                for last in lasts:
                    if last == NULL:
                        null = True
                        break
                if not null:
                    firsts[-1] = start
                    if new_keys:
                        new_keys.extend(gkeys[start:start + cnt])
                    else:
                        new_keys = gkeys[start:start + cnt]     # (not copied into the empty one)
                else:
                    for i in range(cnt):
                        if lasts[i]:
                            if len(new_keys) == k0:
                                firsts[-1] = start + i
                            new_keys.append(gkeys[start + i])
            if cnt and len(new_keys) - k0 == cnt and start + cnt == min(n, len(gkeys)):
                whole[-1] = k0
            spans[-1] = len(new_keys) - k0
        if not new_keys:
            self.advance_stored_idx(st, n_off, adv)
            return
        to_store, slots = tier.prepare_store_slots(new_keys, st, spans)
        if to_store is None:
            return
        if not to_store:
            self.advance_stored_idx(st, n_off, adv)
            return
        self._touch(st)
        # (the evictable list's complete_store puts the keys in the order of their set,
        # tuple_set_order, itself: when that order is needed)
        job = Job(-1, rid, True, to_store, None, True)
        job.slots = slots           # (those of to_store: the walk below lists the same keys)
        fenced: list = []
        one = self.one_index        # (hidx, bidx and bpos made at the end)
        # the keys to store are a subsequence of new_keys, in the order of the walk below
        # (the same groups and chunks): each chunk's key is the next one to store or not one
        # (a request's keys are distinct; the tier returns the key objects it was given, those
        # of the groups' key lists: compared by identity). When they are all of new_keys
        # (the same length: the same list), a group whose chunks all went into new_keys
        # (whole) is stored whole when the walk reaches it at its first key
        all_new = len(to_store) == len(new_keys)
        j: i64 = 0
        n_store: i64 = len(to_store)
        gi: i64 = 0
        c: i64
        for cfg, gs, n in zip(cfgs, groups, ns):   # state unchanged: same storable chunks
            # (the blocks of the other groups are the job's deferred fences: _deferred)
            sink = fenced if cfg.sliding_window_in_chunks is not None else None
            start = gs.next_stored
            bl = gs.block_ids
            hpc, gid = cfg.hashes_per_chunk, cfg.group_id
            keys = gs.keys
            end: i64 = min(n, len(keys))
            w: i64 = whole[gi]
            first: i64 = firsts[gi]
            gi += 1
            if all_new and w == j:
                # chunks start..end-1 are the next keys to store (the same objects), each
                # with all its blocks (none NULL: checked above when a chunk is one block);
                # appended by slices, as the loop below would append them
                m: i64 = end - start
                lo: i64 = start * bpc
                hi: i64 = end * bpc
                sources = bl[lo:hi]
                if bpc == 1 or NULL not in sources:
                    j += m
                    self._add_run(job, sink, gid, hpc, keys, sources, start, end, bpc)
                    gs.next_stored = max(gs.next_stored, adv[gi - 1])
                    continue
            bulk = True             # the run test below is tried once per group
            for c in range(first, end):     # (the chunks before first are not in new_keys)
                k = keys[c]
                if j == n_store or k is not to_store[j]:
                    continue
                if bulk:
                    bulk = False
                    # the common case: chunks c..end-1 are all stored, each with all its
                    # blocks (none NULL); appended by slices, as the loop would append them
                    m = end - c
                    lo = c * bpc
                    hi = end * bpc
                    run = bl[lo:hi] if m > 1 and to_store[j:j + m] == keys[c:end] else None
                    # (a chunk of one block is in new_keys only with that block)
                    if run is not None and (bpc == 1 or NULL not in run):
                        j += m
                        self._add_run(job, sink, gid, hpc, keys, run, c, end, bpc)
                        break
                j += 1
                # (the job's lists read from it: _add_run may have replaced them)
                job.gids.append(gid)
                job.cidx.append(c)
                job.ckeys.append(k)
                jbids = job.bids
                if one:
                    # its one block (not NULL: the chunk is in new_keys)
                    b = bl[c]
                    jbids.append(b)
                    if sink is not None:
                        sink.append(b)
                    continue
                job.hidx.append(hpc * c + hpc - 1)
                for i in range(c * bpc, c * bpc + bpc):
                    b = bl[i]
                    if not b:                       # NULL (0): no source block
                        continue
                    job.bidx.append(i)
                    jbids.append(b)
                    if sink is not None:
                        sink.append(b)
                job.bpos.append(len(jbids))
            gs.next_stored = max(gs.next_stored, adv[gi - 1])
        if one:
            # every chunk's hash and block index is its chunk index and it has one block: the
            # three index lists are one list (nothing changes a job's lists), bpos is 0..n
            cidx = job.cidx
            job.hidx = job.bidx = cidx
            job.bpos = self._ints(0, len(cidx) + 1)
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

    def _add_run(self, job: Job, sink: list | None, gid: int, hpc: i64, keys: list,
                 sources: list, c: i64, end: i64, bpc: i64) -> None:
        """Append a group's chunks ``c..end-1`` to a store job by slices, as one chunk at a time
        would: each chunk's key from ``keys``, its hash index (``hpc``: the group's
        hashes_per_chunk) and its ``bpc`` source blocks, none NULL, from ``sources`` (the blocks
        of the run, in order, a list the job may keep), which also go to the fence list ``sink``
        (if any). (With ``one_index``, the hash and block indices and bpos are left to
        _store_job.) (i64: the positions and counts with no tagged-int checks.)"""
        m: i64 = end - c
        b0: i64 = len(job.bids)
        cs = self._ints(c, end)         # (also the hash and block indices of a chunk of one)
        if sink is not None:
            sink.extend(sources)
        if not job.ckeys:
            # the job's first chunks: the lists made here are its lists (``sources``: the
            # caller's own slice), not copied into its empty ones
            job.gids = [gid] * m
            job.cidx = cs
            job.ckeys = keys[c:end]
            job.bids = sources
        else:
            job.gids.extend([gid] * m)
            job.cidx.extend(cs)
            job.ckeys.extend(keys[c:end])
            job.bids.extend(sources)
        if self.one_index:
            return
        job.hidx.extend(cs if hpc == 1 else self._hash_indices(hpc, c, end))
        job.bidx.extend(cs if bpc == 1 else self._ints(c * bpc, end * bpc))
        job.bpos.extend(self._ints(b0 + bpc, b0 + m * bpc + 1, bpc))

    def _hash_indices(self, hpc: int, c: int, end: int) -> list[int]:
        """The hash indices of a group's keys ``c..end-1`` (``hpc`` > 0: its hashes_per_chunk;
        see GroupState.keys)."""
        return self._ints(hpc * c + hpc - 1, hpc * end, hpc)

    def _ints(self, lo: int, hi: int, step: int = 1) -> list[int]:
        """``list(range(lo, hi, step))`` (0 <= lo, 0 < step), sliced from ``INTS``: a job's chunk
        and block indices are appended as slices of it (cheaper than iterating a range)."""
        ints = ints_to(hi)
        return ints[lo:hi] if step == 1 else ints[lo:hi:step]

    def _fence(self, b: Any, jid: Any) -> None:
        """Record that job ``jid`` reads block ``b`` (``_block_id_to_pending_jobs``, see
        ``block_to_jobs``). (Untyped: the int objects as given go into the dict, not re-boxed.)"""
        btj: dict = self.block_to_jobs
        cur = btj.setdefault(b, jid)    # (one dict operation when the block is not fenced yet)
        if cur is jid:
            return                      # (new, or this job's already)
        if isinstance(cur, int):
            if cur != jid:
                btj[b] = {cur, jid}
        else:
            cur.add(jid)

    def _remove_pending(self, jid: int, blocks) -> None:
        btj = self.block_to_jobs
        for b in blocks or ():
            s = btj.get(b)
            if s is None:
                continue
            if isinstance(s, int):
                if s == jid:
                    del btj[b]
            else:
                s.discard(jid)
                if not s:
                    del btj[b]

    def complete_job(self, jid: int) -> Job:
        """``update_connector_output`` for one completed job."""
        job = self.jobs.pop(jid)
        st = self.req_status[job.rid]
        if job.is_store:
            self.tier.complete_store(job.ckeys, job.contents, job.slots)
        else:
            self.tier.complete_load(job.keys, job.slots)
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
        return not self.jobs
