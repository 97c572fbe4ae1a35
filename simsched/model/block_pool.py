"""The GPU block pool: ``vllm/v1/core/block_pool.py`` and the ``FreeKVCacheBlockQueue`` and
``BlockHashToBlockMap`` it holds.

Blocks are named by their IDs (``KVCacheBlock.block_id``); the pool keeps each block's
``ref_cnt`` and ``block_hash`` in lists by ID. Block 0 is the null block: never handed out,
never freed (its ``ref_cnt`` stays 1). A block hash here is a key of
``simsched.model.request.make_key``: the group ID and the chained hash of the tokens the block ends.
"""

from __future__ import annotations

from typing import Final, Iterable

from simsched.model.request import Key

NULL: Final = 0


class FreeKVCacheBlockQueue:
    """``FreeKVCacheBlockQueue``: the free blocks in eviction order, a doubly linked list.

    ``next_free[b]`` / ``prev_free[b]`` are the blocks after and before ``b``; the null block
    closes the ring (``next_free[NULL]`` is the head, ``prev_free[NULL]`` the tail), as vLLM's
    fake head and tail blocks do. A block out of the queue keeps stale links."""

    def __init__(self, num_blocks: int):
        self.next_free: list[int] = list(range(1, num_blocks)) + [NULL]
        self.prev_free: list[int] = [num_blocks - 1] + list(range(num_blocks - 1))
        self.num_free_blocks = num_blocks - 1

    def popleft_n(self, n: int) -> list[int]:
        """The first ``n`` blocks, taken out (allocation takes the head)."""
        out: list[int] = []
        b = self.next_free[NULL]
        for _ in range(n):
            out.append(b)
            b = self.next_free[b]
        self.next_free[NULL] = b
        self.prev_free[b] = NULL
        self.num_free_blocks -= n
        return out

    def remove(self, b: int) -> None:
        """Take ``b`` out from anywhere in the queue (a prefix hit on a free cached block)."""
        before, after = self.prev_free[b], self.next_free[b]
        self.next_free[before] = after
        self.prev_free[after] = before
        self.num_free_blocks -= 1

    def append_n(self, blocks: list[int]) -> None:
        """Put ``blocks`` at the tail, in order: the last to be evicted."""
        tail = self.prev_free[NULL]
        for b in blocks:
            self.next_free[tail] = b
            self.prev_free[b] = tail
            tail = b
        self.next_free[tail] = NULL
        self.prev_free[NULL] = tail
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[int]) -> None:
        """Put ``blocks`` at the head, in order: the first to be reused."""
        head = self.next_free[NULL]
        for b in reversed(blocks):
            self.next_free[b] = head
            self.prev_free[head] = b
            head = b
        self.next_free[NULL] = head
        self.prev_free[head] = NULL
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[int]:
        """The free blocks, head (next allocated) first."""
        out: list[int] = []
        b = self.next_free[NULL]
        while b != NULL:
            out.append(b)
            b = self.next_free[b]
        return out


class BlockHashToBlockMap:
    """``BlockHashToBlockMap``: the GPU prefix cache, every block cached under each hash.

    Two requests admitted before either cached a block compute it twice: both copies carry the
    hash, in the order they were cached; a hit takes the first (``get_one_block``)."""

    def __init__(self) -> None:
        self._cache: dict[Key, list[int]] = {}

    def get_one_block(self, key: Key) -> int | None:
        blocks = self._cache.get(key)
        return blocks[0] if blocks is not None else None

    def insert(self, key: Key, b: int) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = [b]
        else:
            blocks.append(b)

    def pop(self, key: Key, b: int) -> None:
        blocks = self._cache[key]
        if len(blocks) == 1:
            del self._cache[key]
        else:
            blocks.remove(b)

    def blocks(self, key: Key) -> list[int]:
        """Every block cached under ``key``, in caching order (a copy)."""
        return list(self._cache.get(key, ()))


class BlockPool:
    """``BlockPool``: refcounts, the free queue and the GPU prefix cache.

    A block is in the free queue exactly when its ``ref_cnt`` is 0. A free block that still
    carries a hash stays in the prefix cache (evictable, in LRU order) until it is handed out
    again."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_block_queue = FreeKVCacheBlockQueue(num_blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.ref: list[int] = [0] * num_blocks
        self.key: list[Key | None] = [None] * num_blocks      # KVCacheBlock.block_hash
        self.ref[NULL] = 1              # the null block is held by the pool itself

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def free_queue(self) -> list[int]:
        """The free blocks, head (next allocated) first."""
        return self.free_block_queue.get_all_free_blocks()

    @property
    def free(self) -> dict[int, None]:
        """The free queue as an ordered dict of its blocks (a copy, for tests and checks)."""
        return dict.fromkeys(self.free_queue())

    def get_new_blocks(self, n: int) -> list[int]:
        """``get_new_blocks``: the head of the free queue; a block still cached there is
        evicted from the prefix cache first (``_maybe_evict_cached_block``)."""
        if n > self.get_num_free_blocks():
            raise RuntimeError(f"{n} blocks asked of a free queue of {self.get_num_free_blocks()}")
        blocks = self.free_block_queue.popleft_n(n)
        for b in blocks:
            self.uncache(b)
            self.ref[b] = 1
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        """``free_blocks``, the blocks given in eviction order: a block left without users goes
        to the head if it has no hash (LIFO reuse, it can never be hit), to the tail if it has
        one (LRU eviction of the prefix cache)."""
        evict_first: list[int] = []
        evict_last: list[int] = []
        for b in ordered_blocks:
            if b == NULL:
                continue
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (evict_first if self.key[b] is None else evict_last).append(b)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)

    def touch(self, blocks: Iterable[int]) -> None:
        """``touch``: a prefix hit takes the blocks, out of the free queue if they were free."""
        for b in blocks:
            if b == NULL:
                continue
            if self.ref[b] == 0:
                self.free_block_queue.remove(b)
            self.ref[b] += 1

    def reset_prefix_cache(self) -> bool:
        """``reset_prefix_cache``: every hash dropped, only while no block but the null block is
        in use (a running request's blocks could not be told from fresh ones); the free queue
        keeps its order."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.key = [None] * self.num_blocks
        return True

    def holder(self, k: Key) -> int | None:
        """``get_cached_block``: the block a hit on key ``k`` takes, None if none carries it."""
        return self.cached_block_hash_to_block.get_one_block(k)

    def get_cached_block(self, k: Key) -> int:
        """The block a hit on key ``k`` takes, where a lookup found ``k`` cached."""
        b = self.cached_block_hash_to_block.get_one_block(k)
        if b is None:
            raise RuntimeError(f"no block cached under key {k}")
        return b

    def cache(self, b: int, k: Key) -> None:
        """Block ``b`` (no hash yet) gets hash ``k`` (``cache_full_blocks``), after any other
        block carrying it."""
        self.key[b] = k
        self.cached_block_hash_to_block.insert(k, b)

    def uncache(self, b: int) -> None:
        """``_maybe_evict_cached_block``: block ``b`` loses its hash, if it has one."""
        k = self.key[b]
        if k is not None:
            self.cached_block_hash_to_block.pop(k, b)
            self.key[b] = None
