"""Shadow of KV content: what every GPU block slot and every CPU chunk holds.

A slot's content is ``(group_id, end, ident)``: the group's KV for the request prefix
``[0, end)`` whose token identity (``Request.ident_at(end)``, a chained hash of the token ids) is
``ident``; for a block that is written up to ``end`` only (a partial block) or whose tokens are
not all known yet ``ident`` is None. For a Mamba state block, ``end`` is the position the state
summarises; for a ring, the latest position written. A CPU chunk holds the tuple of the contents of
the blocks the store read.
"""

from __future__ import annotations

from typing import Any

from simsched.allocator import FULLISH, NULL, RING, GroupRule, Request


class Shadow:
    def __init__(self, num_blocks: int, blocks_per_chunk: int | None = None):
        self.gpu: list[tuple | None] = [None] * num_blocks
        self.bpc = blocks_per_chunk
        # nums[e] is the int e, one object each (grown on demand by num()): the group ids and
        # ends of slot contents go into the content tuples as these objects. (The compiled build
        # makes a new int object each time it puts a native int above 256 in a tuple or a list;
        # see also allocator.BlockPool.ids.)
        self.nums: list[Any] = list(range(257))

    def num(self, e: int) -> Any:
        """The int ``e`` (0 <= e), as the one object ``nums[e]``."""
        nums = self.nums
        if e >= len(nums):
            nums.extend(range(len(nums), e + 1))
        return nums[e]

    def write_computed(self, req: Request, rules: list[GroupRule], start: int,
                       end: int, collect: bool = True) -> list[int]:
        """The model computed tokens ``[start, end)`` of ``req``: write its blocks; returns the
        block IDs written (``collect`` False: an empty list, nothing collected)."""
        gpu: list[tuple | None] = self.gpu
        written: list[int] = []
        eo = self.num(end)              # (nums grows to end: every end written is in it)
        nums = self.nums
        unit, tables = req.unit, req.tables
        ident: list[Any] = req.ident    # (the hashes stay the int objects hash() made)
        nid = len(ident)
        for r in rules:
            gid = r.gid
            go = nums[gid]
            # (the table's items read as the int objects they are, stored as is into written:
            # see allocator.BlockPool.ids)
            table: list[Any] = tables[gid]
            if not table:
                continue
            if r.code == RING:
                bo = table[0]
                b: int = bo
                gpu[b] = (go, eo, None)
                if collect:
                    written.append(bo)
                continue
            bs = r.bs
            last = (end - 1) // bs + 1
            if last > len(table):
                last = len(table)
            i0 = start // bs
            full = min(end // bs, last)          # blocks [i0, full) are complete at end
            if full > i0:
                # their identities: ident_at((i + 1) * bs) = ident[(i + 1) * per - 1] (None when
                # not known, as ident_at)
                per = bs // unit
                for i in range(i0, full):
                    bo = table[i]
                    b = bo
                    if b != NULL:
                        k = (i + 1) * per - 1
                        gpu[b] = (go, nums[(i + 1) * bs], ident[k] if k < nid else None)
                        if collect:
                            written.append(bo)
            if last > full and last > i0:        # the partial block holding token end - 1
                bo = table[last - 1]
                b = bo
                if b != NULL:
                    gpu[b] = (go, eo, None)
                    if collect:
                        written.append(bo)
        return written

    def read(self, blocks) -> tuple:
        gpu = self.gpu
        return tuple(gpu[b] for _, b in blocks)

    def write(self, blocks: list[tuple[int, int]], content: tuple) -> None:
        """A chunk's ``content`` into its ``(block_index, block_id)`` destination blocks (see
        :meth:`write_chunk`)."""
        self.write_chunk([i for i, _ in blocks], [b for _, b in blocks], 0, len(blocks), content)

    def write_chunk(self, idx: list[int], bids: list[int], lo: int, hi: int,
                    content: tuple) -> None:
        """A chunk's ``content`` into the blocks ``bids[lo:hi]``, at block indices ``idx[lo:hi]`` of
        the request's table (a model ``Job`` keeps its blocks as such parallel lists)."""
        gpu = self.gpu
        n = len(content) if content else 0
        if n and n == self.bpc:
            # a whole chunk: each destination block takes the chunk's block at its own offset
            # (the offloading worker skips block_index % blocks_per_chunk blocks of the chunk)
            for y in range(lo, hi):
                gpu[bids[y]] = content[idx[y] % n]
            return
        if not n:
            return
        # a chunk whose store read only some blocks (windowed groups): its content lines up
        # with the tail of the destination blocks, content[n - (hi - lo):] (a negative start
        # counts from the end, as slices do), paired with the blocks in order
        start = n - (hi - lo)
        if start < 0:
            start = max(0, n + start)
        for y in range(lo, min(hi, lo + n - start)):
            gpu[bids[y]] = content[start + y - lo]

    @staticmethod
    def expected(req, gid: int, tokens_per_block: int, index: int) -> tuple:
        e = (index + 1) * tokens_per_block
        return (gid, e, req.ident_at(e))


__all__ = ["Shadow", "FULLISH"]
