"""The CPU tier: ``vllm/v1/kv_offload/cpu/manager.py`` (``CPUOffloadingManager``) with the LRU
policy of ``cpu/policies/lru.py``, as each release writes it; capacity in chunks.

The manager owns what every policy shares: a chunk's status (``ChunkStatus``: ``ref_cnt`` -1
while its store is in flight, else the loads reading it), the chunk pool, and the
``prepare_store`` / ``complete_store`` / ``prepare_load`` / ``complete_load`` skeletons. The
policy decides the eviction order:

- :class:`CPUOffloadingManager` itself: 0.25.1-0.30.0's ``LRUCachePolicy``, an evictable list
  (an ``OrderedDict`` of the chunks with ``ref_cnt`` 0: a chunk joins its MRU end when its store
  or its last load completes; ``touch`` moves the evictable ones to the MRU end);
- :class:`RankedCPUManager`: 0.31.0+'s, logical recency ranks in a lazy heap.

A chunk's ``content`` is what its store wrote (the model's shadow of the KV), read back by loads.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any, Final

from simsched.model.request import Key, key_group, make_key
from simsched.profiles import ConfigError

CPU_MANAGER_PY = "v1/kv_offload/cpu/manager.py"

# CPUOffloadingManager.lookup results (vLLM's LookupResult)
MISS: Final = 0
HIT: Final = 1
HIT_PENDING: Final = 2
RETRY: Final = 3            # a secondary tier has not answered yet (tiered offloading)


class ChunkStatus:
    """``ChunkStatus``: ``ref_cnt`` -1 until the chunk's store completes (not readable), then the
    number of loads reading it; ``content``, what the store wrote; ``rank``, its recency
    (:class:`RankedCPUManager`)."""

    __slots__ = ("ref_cnt", "content", "rank")

    def __init__(self, rank: tuple[int, int] = (0, 0)):
        self.ref_cnt = -1
        self.content: Any = None
        self.rank = rank

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


_GROUP0_END: Final = 1 << 63       # group 0's keys are [-2**63, 2**63) (request.make_key)


def tuple_set_order(keys: list) -> list[Key]:
    """The distinct ``keys`` in the order a set of their ``(group_id, ident)`` tuples, filled in
    the order given, iterates them: the model's stand-in for the order vLLM walks a job's key set
    in (:func:`walk_order`)."""
    pairs: set[tuple[int, Key]] = set()
    for k in keys:
        g = 0 if k < _GROUP0_END else key_group(k)
        pairs.add((g, k - make_key(g, 0) if g else k))
    return [make_key(g, h) if g else h for g, h in pairs]


def walk_order(keys: list, observed: list | None = None) -> list[Key]:
    """The order in which a completing job's distinct ``keys`` reach the CPU tier's policy.

    vLLM keeps a job's keys as a set (``TransferJobStatus.keys``) and ``complete_store`` /
    ``complete_load`` walk that set; up to 0.30.0 each chunk joins the evictable list's MRU end as
    it is walked, so the walk decides which of the job's chunks is evicted first. A set of hash
    bytes iterates in an order that depends on the process's hash seed: vLLM leaves it
    unspecified, and so does the model. ``observed`` is the order a release's run took for this
    job (``simsched.lockstep`` passes it, so that a run is compared with the release on what vLLM
    does specify); without it, or where it names other keys (the runs went apart earlier), the
    model walks :func:`tuple_set_order`."""
    if observed is not None and len(observed) == len(set(observed)) and set(observed) == set(keys):
        return list(observed)
    return tuple_set_order(keys)


class CPUOffloadingManager:
    """``CPUOffloadingManager`` with 0.25.1-0.30.0's ``LRUCachePolicy`` (the evictable list)."""

    def __init__(self, capacity: int, asserts: bool = True):
        self.capacity = capacity
        self.asserts = asserts          # the release's asserts run (not under python -O)
        self.chunks: dict[Key, ChunkStatus] = {}
        # the evictable chunks (ref_cnt 0), least recently used first
        self.evictable: OrderedDict[Key, None] = OrderedDict()
        self.touches = True             # the connector touches the keys it looks up
        self.evictions = 0

    def lookup(self, key, st=None) -> int:
        chunk = self.chunks.get(key)
        if chunk is None:
            return MISS
        return HIT if chunk.is_ready else HIT_PENDING

    def is_ready(self, key) -> bool:
        chunk = self.chunks.get(key)
        return chunk is not None and chunk.is_ready

    def chunks_of(self, keys: list) -> list[ChunkStatus | None]:
        """The chunks of ``keys`` (None where a key is not stored): a job's, as it prepares."""
        return [self.chunks.get(k) for k in keys]

    def touch(self, keys) -> None:
        """``LRUCachePolicy.touch``: each evictable key to the MRU end, last key first
        (``for key in reversed(list(keys))``), so the first key ends most recent."""
        self.touch_range(list(keys), 0, len(keys))

    def touch_range(self, keys: list, lo: int, hi: int) -> None:
        """``touch(keys[lo:hi])``."""
        for i in range(min(hi, len(keys)) - 1, lo - 1, -1):
            if keys[i] in self.evictable:
                self.evictable.move_to_end(keys[i])

    def prepare_store(self, keys, st=None) -> list | None:
        """``prepare_store``: the keys not stored yet, each given a chunk (not ready), after
        evicting what they need; None (and no change) if too few chunks can be evicted. The
        chunks of ``keys`` are protected: a chunk already stored stays. ``st``: the request
        storing (its accesses count from 0.31.0 on)."""
        to_store = [k for k in keys if k not in self.chunks]
        self._record_store_access(keys, st)
        if not to_store:
            return []
        n_evict = len(to_store) - (self.capacity - len(self.chunks))
        if n_evict > 0:
            victims = self.evict(n_evict, set(keys))
            if victims is None:
                return None
            for k in victims:
                del self.chunks[k]
            self.evictions += n_evict
        for k in to_store:
            self.chunks[k] = self._new_chunk(k, st)
        return to_store

    def _record_store_access(self, keys, st) -> None:
        """No request accesses before 0.31.0."""

    def _new_chunk(self, key, st) -> ChunkStatus:
        return ChunkStatus()

    def evict(self, n: int, protected: set) -> list | None:
        """``LRUCachePolicy.evict``: the first ``n`` evictable chunks not ``protected``, from the
        LRU end; None (and no change) if there are fewer."""
        victims = []
        for k in self.evictable:
            if k not in protected:
                victims.append(k)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for k in victims:
            del self.evictable[k]
        return victims

    def complete_store(self, keys: list, contents: list, chunks: list | None = None,
                       observed: list | None = None, st=None) -> None:
        """A store job's chunks ``keys`` are ready, holding ``contents[i]`` for ``keys[i]``
        (``chunks``: the job's, else looked up). In the order vLLM walks the job's key set
        (:func:`walk_order`; ``observed``: a release's) each joins the evictable list's MRU
        end."""
        chunks = self.chunks_of(keys) if chunks is None else chunks
        content: dict = {}
        status: dict = {}
        for k, ch, c in zip(keys, chunks, contents):     # (a key's first chunk, as listed)
            content.setdefault(k, c)
            status.setdefault(k, ch)
        for k in walk_order(keys, observed):
            chunk = status[k]
            if chunk is not None and not chunk.is_ready:
                chunk.ref_cnt = 0
                chunk.content = content[k]
                self.evictable[k] = None

    def _pin(self, keys: list) -> list[ChunkStatus]:
        """``prepare_load``'s reference counts: each chunk read by one more load. A chunk whose
        store is in flight fails vLLM's ``assert chunk.is_ready``; without asserts its
        ``ref_cnt`` goes from -1 to 0, and it reads as ready from then on."""
        chunks = [self.chunks[k] for k in keys]
        for k, chunk in zip(keys, chunks):
            if self.asserts and not chunk.is_ready:
                raise ConfigError("AssertionError", "prepare_load", CPU_MANAGER_PY, "load",
                                  f"Chunk {k!r} is not ready for reading")
            chunk.ref_cnt += 1
        return chunks

    def prepare_load(self, keys: list, st=None) -> list[ChunkStatus]:
        """A load pins its chunks: not evictable while they are read. Returns them. A key the
        tier no longer holds fails vLLM's ``assert chunk is not None``; without asserts the
        next line reads ``ref_cnt`` of None."""
        for k in keys:
            if k not in self.chunks:
                exc, msg = (("AssertionError", f"Chunk {k!r} not found in cache") if self.asserts
                            else ("AttributeError", "'NoneType' object has no attribute 'ref_cnt'"))
                raise ConfigError(exc, "prepare_load", CPU_MANAGER_PY, "load", msg)
            if self.chunks[k].ref_cnt == 0:
                del self.evictable[k]
        return self._pin(keys)

    def complete_load(self, keys: list, chunks: list | None = None,
                      observed: list | None = None) -> None:
        """A load job's chunks have been read; those no other load reads join the evictable
        list's MRU end, in the order vLLM walks the job's key set (:func:`walk_order`)."""
        for k in walk_order(keys, observed):
            chunk = self.chunks[k]
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.evictable[k] = None

    def on_request_finished(self, st) -> None:
        """``CPUOffloadingManager.on_request_finished``: no recency change before 0.31.0."""


class _RequestCacheAccess:
    """``CPUOffloadingManager``'s ``_RequestCacheAccess`` (0.31.0+) and the LRU policy's
    ``_RequestRank`` (0.33.0) of one request: the keys it accessed, per group in first-access
    order (``key_groups``, by the key's group id, as ``get_offload_group_idx``), and its request
    rank once it has one (0: none yet). ``positions`` is ``ReqContext``'s
    ``_offload_key_positions``: each offload key's end token in the request, from its key lists
    (``counts``: how far each group's list was read; the lists are only appended to)."""

    __slots__ = ("st", "rank", "seen", "key_groups", "positions", "counts")

    def __init__(self, st, n_groups: int):
        self.st = st
        self.rank = 0
        self.seen: set = set()
        self.key_groups: dict[int, list] = {}
        self.positions: dict[Key, int] = {}
        self.counts = [0] * n_groups


class RankedCPUManager(CPUOffloadingManager):
    """``CPUOffloadingManager`` with 0.31.0+'s ``LRUCachePolicy``: logical recency ranks
    independent of transfer pinning.

    Eviction takes the evictable chunks (ready, no load in flight) of lowest rank, ties by key
    (``make_offload_key`` appends the group index to the block hash: the lower group first at
    one position of one request). An inserted chunk takes the next rank ``(n, 0)``, or from
    0.33.0 (``request_ranks``) its request's rank and token position ``(request rank,
    -position)``, so that a request's tails precede its heads; from 0.33.0 a request's first
    access to a resident chunk (``on_request_access``) raises it to that rank. When a request
    finishes, every chunk it accessed takes a fresh rank, tail first, so that its head is the
    most recent (``on_request_finished``). The connector never calls ``touch`` from 0.31.0 on.

    ``heap`` holds ``(rank, key)`` items, pushed when a chunk becomes evictable or is ranked
    again while evictable; an item is current while its chunk is evictable with that rank (the
    others are dropped as they surface), as vLLM's lazy heap."""

    def __init__(self, capacity: int, request_ranks: bool, cfgs, asserts: bool = True):
        super().__init__(capacity, asserts)
        self.touches = False
        self.request_ranks = request_ranks
        self.heap: list[tuple[tuple[int, int], Key]] = []
        self.next_rank = 0
        self.tokens_per_chunk = [cfg.tokens_per_chunk for cfg in cfgs]
        self.req_state: dict[str, _RequestCacheAccess] = {}

    def touch(self, keys) -> None:
        return

    def _push(self, k, chunk: ChunkStatus) -> None:
        """``_push_evictable``; the heap is rebuilt from the evictable chunks when stale items
        outnumber them (``_maybe_compact_heap``)."""
        heapq.heappush(self.heap, (chunk.rank, k))
        if len(self.heap) >= max(64, 2 * len(self.chunks)):
            self.heap = [(c.rank, key) for key, c in self.chunks.items() if c.ref_cnt == 0]
            heapq.heapify(self.heap)

    def _set_rank(self, k, chunk: ChunkStatus, rank: tuple[int, int]) -> None:
        chunk.rank = rank
        if chunk.ref_cnt == 0:
            self._push(k, chunk)

    def _access(self, st) -> _RequestCacheAccess:
        """The request's access record, and its key positions read up to its keys now."""
        a = self.req_state.get(st.req.rid)
        if a is None or a.st is not st:
            a = self.req_state[st.req.rid] = _RequestCacheAccess(st, len(self.tokens_per_chunk))
        for gi, tpc in enumerate(self.tokens_per_chunk):
            keys = st.groups[gi].keys
            for i in range(a.counts[gi], len(keys)):
                a.positions[keys[i]] = (i + 1) * tpc    # a key met twice: its later position
            a.counts[gi] = len(keys)
        return a

    def _request_rank(self, a: _RequestCacheAccess) -> int:
        """``_get_request_rank``: the request's rank, the next one at its first use."""
        if not a.rank:
            self.next_rank += 1
            a.rank = self.next_rank
        return a.rank

    def _record_access(self, a: _RequestCacheAccess, keys) -> None:
        """``_record_request_cache_access``: the keys the request meets for the first time join
        its record; from 0.33.0 they are ``on_request_access``ed."""
        new = []
        for k in keys:
            if k not in a.seen:
                a.seen.add(k)
                a.key_groups.setdefault(key_group(k), []).append(k)
                new.append(k)
        if new and self.request_ranks:
            self._on_request_access(a, new)

    def _on_request_access(self, a: _RequestCacheAccess, keys: list) -> None:
        """``LRUCachePolicy.on_request_access`` (0.33.0): a resident chunk of known position is
        raised to ``(request rank, -position)`` if that is above its rank."""
        request_rank = self._request_rank(a)
        for k in keys:
            position = a.positions.get(k)
            chunk = self.chunks.get(k)
            if position is None or chunk is None:
                continue
            rank = (request_rank, -position)
            if chunk.rank < rank:
                self._set_rank(k, chunk, rank)

    def _record_store_access(self, keys, st) -> None:
        """``prepare_store`` records the request's access to the new and the ready keys before
        any eviction (chunks still being written are not accessed)."""
        if st is not None:
            self._record_access(self._access(st), [k for k in keys if k not in self.chunks
                                                   or self.chunks[k].is_ready])

    def _new_chunk(self, key, st) -> ChunkStatus:
        """``LRUCachePolicy.insert``'s rank of a new chunk."""
        a = self.req_state.get(st.req.rid) if st is not None and self.request_ranks else None
        position = a.positions.get(key) if a is not None else None
        if a is None or position is None:
            self.next_rank += 1
            return ChunkStatus((self.next_rank, 0))
        return ChunkStatus((self._request_rank(a), -position))

    def evict(self, n: int, protected: set) -> list | None:
        """``LRUCachePolicy.evict``: the ``n`` evictable chunks of lowest (rank, key) that are not
        ``protected``, or None (and no change) if there are fewer."""
        selected: list = []
        chosen: set = set()
        deferred: list = []
        while self.heap and len(selected) < n:
            item = heapq.heappop(self.heap)
            rank, k = item
            chunk = self.chunks.get(k)
            if chunk is None or chunk.ref_cnt != 0 or chunk.rank != rank or k in chosen:
                continue            # stale
            if k in protected:
                deferred.append(item)
                continue
            selected.append(item)
            chosen.add(k)
        for item in deferred + (selected if len(selected) < n else []):
            heapq.heappush(self.heap, item)
        return [k for _, k in selected] if len(selected) == n else None

    def prepare_load(self, keys: list, st=None) -> list[ChunkStatus]:
        """A load pins its chunks (not evictable while loaded) and is a request access."""
        chunks = self._pin(keys)
        if st is not None:
            self._record_access(self._access(st), keys)
        return chunks

    def on_request_finished(self, st) -> None:
        """``CPUOffloadingManager.on_request_finished`` and the policy's: the keys the request
        accessed, head to tail (``order_request_keys``: each group's keys by position where all
        are known, the groups by id, then all by position where all are known), take fresh
        ranks from the tail on."""
        a = self.req_state.pop(st.req.rid, None)
        if a is None:
            return
        if a.st is st:
            self._access(st)
        positions = a.positions
        flat: list = []
        for gid in sorted(a.key_groups):
            keys = a.key_groups[gid]
            if all(k in positions for k in keys):
                keys = sorted(keys, key=positions.__getitem__)
            flat += keys
        if all(k in positions for k in flat):
            flat.sort(key=positions.__getitem__)
        for k in flat[::-1]:          # tail first
            chunk = self.chunks.get(k)
            if chunk is not None:
                self.next_rank += 1
                self._set_rank(k, chunk, (self.next_rank, 0))

    def complete_store(self, keys: list, contents: list, chunks: list | None = None,
                       observed: list | None = None, st=None) -> None:
        """Recency is a rank here: the order the job's keys are walked in does not matter."""
        chunks = self.chunks_of(keys) if chunks is None else chunks
        for k, chunk, c in zip(keys, chunks, contents):
            if chunk is not None and not chunk.is_ready:
                chunk.ref_cnt = 0
                chunk.content = c
                self._push(k, chunk)            # evictable now

    def complete_load(self, keys: list, chunks: list | None = None,
                      observed: list | None = None) -> None:
        chunks = self.chunks_of(keys) if chunks is None else chunks
        for k, chunk in zip(keys, chunks):
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._push(k, chunk)            # evictable now
