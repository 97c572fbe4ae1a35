"""The real KV cache manager's blocks (INV-1, INV-2): the block tables the requests hold, and
every block's ``ref_cnt`` against the references its holders keep."""

from __future__ import annotations

from collections import Counter
from operator import attrgetter

from simsched import invariants as inv
from simsched.model.block_pool import NULL

_block_id = attrgetter("block_id")


def _managers(sched) -> list:
    return sched.kv_cache_manager.coordinator.single_type_managers


def block_tables(sched, rid: str) -> list[list[int]]:
    """Per KV cache group, the block IDs of ``rid``'s block table."""
    out = []
    for m in _managers(sched):
        blocks = m.req_to_blocks.get(rid) or []
        out.append([b.block_id for b in blocks])
    return out


def check_pool(sched, rids, step: int, held: Counter | None = None) -> None:
    """INV-1: every block's ``ref_cnt`` is the number of references its holders keep, and
    the free blocks are the rest of the pool; INV-2: a block two requests hold is a
    prefix-cache block. ``rids``: every request sent to the scheduler; ``held``: the
    references the connector keeps itself (its driver's ``held_blocks``)."""
    pool = sched.kv_cache_manager.block_pool
    refs = _references(sched, rids)
    refs.update(held or Counter())
    blocks = pool.blocks
    for b, n in refs.items():
        blk = blocks[b]
        if blk.ref_cnt != n:
            raise inv.InvariantViolation("INV-1", step, f"block {b}: refcount "
                                         f"{blk.ref_cnt} but held {n} times")
        # one request may hold a block twice (an align-mode Mamba table naming its state
        # block at two positions, each a reference): only two requests share a slot
        if n > 1 and blk.block_hash is None:
            held_by = _holders(sched, rids, b)
            if len(held_by) > 1:
                raise inv.InvariantViolation("INV-2", step, f"block {b} held by "
                                             f"{', '.join(sorted(held_by))} but not a "
                                             "prefix-cache block")
    n_free = pool.get_num_free_blocks()
    if n_free + len(refs) != pool.num_gpu_blocks - 1:
        raise inv.InvariantViolation("INV-1", step, f"free {n_free} + held "
                                     f"{len(refs)} != pool {pool.num_gpu_blocks - 1}")


def _references(sched, rids) -> Counter:
    """Per block id, the references kept on it: one per entry of a request's block table
    (a finished request may still hold its blocks: aborted during a load, they are freed
    when the load reports ``finished_recving``; a freed one has no entry), and the ones
    held off the tables. The null block is no one's."""
    refs: Counter = Counter()
    tables = [m.req_to_blocks for m in _managers(sched)]
    for rid in rids:
        for req_to_blocks in tables:
            refs.update(map(_block_id, req_to_blocks.get(rid, ())))
    # async scheduling: blocks of a freed request that a batch in flight may still write,
    # and the source blocks a Mamba copy-on-write retains until the step that copies them
    # ran, are returned to the pool only once that step's output is processed
    # (Scheduler._free_request_blocks, _free_cow_retained_blocks, deferred_frees)
    for _, held in getattr(sched, "deferred_frees", None) or ():
        refs.update(map(_block_id, held))
    for pinned in _partial_tail_pins(sched).values():
        refs.update(map(_block_id, pinned))
    refs.pop(NULL, None)
    return refs


def _partial_tail_pins(sched) -> dict:
    """0.27.0-0.28.0: the CoW copy of a producer's last-prompt-boundary Mamba state, handed
    to the connector for a partial-tail store, lives off the request's table, pinned for
    the request until its blocks are freed (KVCacheManager.take_partial_tail_offloads:
    "pinned here and unpinned when the request's blocks are freed", _partial_tail_pins):
    a reference the request holds."""
    return getattr(sched.kv_cache_manager, "_partial_tail_pins", None) or {}


def _holders(sched, rids, b: int) -> set[str]:
    """The requests holding block ``b`` in their tables or pins (deferred frees are no
    request's)."""
    held = {rid for rid in rids if any(b in ids for ids in block_tables(sched, rid))}
    held.update(rid for rid, pinned in _partial_tail_pins(sched).items()
                if any(blk.block_id == b for blk in pinned))
    return held
