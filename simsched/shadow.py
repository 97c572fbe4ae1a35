"""Shadow of KV content: what every GPU block slot and every CPU chunk holds.

A slot's content is ``(group_id, end, ident)``: the group's KV for the request prefix
``[0, end)`` whose token identity (``Request.ident_at(end)``, a chained hash of the token ids) is
``ident``; for a block that is written up to ``end`` only (a partial block) or whose tokens are
not all known yet ``ident`` is None. For a Mamba state block, ``end`` is the position the state
summarises; for a ring, the latest position written. A slot never written holds None.

The slots are kept field by field, in three lists indexed by block ID (``gids``, ``ends``,
``idents``; ``gids[b]`` None: never written): a write stores three references and makes no
object, where a tuple per slot made one per block written (and freed the one it replaced);
only a store's read makes one, its chunk's. :meth:`Shadow.content` gives a slot as the tuple
above.

A CPU chunk holds the contents of the blocks its store read, flat: ``(gid, end, ident)`` of each
block in order, one tuple per chunk (``(None, None, None)`` for a block never written; a
one-block chunk's content is thus its slot's content).
"""

from __future__ import annotations

from typing import Any, Protocol

from simsched.model.block_pool import NULL


class Prefixes(Protocol):
    """What a forward pass's writer reads of a request: its block tables and the identities of
    its prefixes (a ``Request``, or the worker's view of one, ``request.WorkerView``)."""

    tables: list[list[int]]

    def ident_at(self, end: int) -> int | None: ...



class Shadow:
    def __init__(self, num_blocks: int, blocks_per_chunk: int | None = None):
        # (untyped lists: the fields are stored and compared as the objects they are)
        self.gids: list[Any] = [None] * num_blocks
        self.ends: list[Any] = [None] * num_blocks
        self.idents: list[Any] = [None] * num_blocks
        self.bpc: int = blocks_per_chunk or 0     # (0: none; native, as write_chunk compares it)

    def content(self, b: int) -> tuple | None:
        """Block ``b``'s content, ``(group_id, end, ident)`` (None: never written)."""
        g = self.gids[b]
        return None if g is None else (g, self.ends[b], self.idents[b])

    def write_computed(self, req: Prefixes, groups: list[tuple[int, bool]], start: int,
                       end: int, collect: bool = True,
                       fenced: list[int] | None = None) -> list[int]:
        """The model computed tokens ``[start, end)`` of ``req``: write its blocks in every
        group (``groups[gid]``: the group's block size and whether it is a ring, whose one block
        holds the latest position); returns the block IDs written (``collect`` False: an empty
        list). ``fenced``: a count per block ID (``ReadFences.count``); given, only the first
        block written whose count is not 0 is collected (INV-6 names that one)."""
        written: list[int] = []

        def write(b: int, gid: int, upto: int, ident: int | None) -> None:
            self.gids[b], self.ends[b], self.idents[b] = gid, upto, ident
            if collect and (fenced is None or (fenced[b] and not written)):
                written.append(b)

        for gid, (bs, ring) in enumerate(groups):
            table = req.tables[gid]
            if not table:
                continue
            if ring:                   # (the ring's one block is never the null block)
                write(table[0], gid, end, None)
                continue
            # the blocks complete at end, then the partial block holding token end - 1
            full = min(end // bs, len(table))
            last = min(-(-end // bs), len(table))
            for i in range(start // bs, full):
                if table[i] != NULL:
                    write(table[i], gid, (i + 1) * bs, req.ident_at((i + 1) * bs))
            if last > full and last > start // bs and table[last - 1] != NULL:
                write(table[last - 1], gid, end, None)
        return written

    def write_landed(self, ident, num_prompt: int, tables: list[list[int]],
                     groups: list[tuple[int, bool]], blocks: list[list[int]]) -> list[int]:
        """Another connector's pull landed: the KV a prefill instance computed for the request's
        prompt (``num_prompt`` tokens, prefix identities ``ident.ident_at``) into ``blocks`` (per
        group), each at its place in the request's table (``tables``): a complete block holds its
        tokens' identity, the prompt's partial last block the prompt up to its end, a ring's
        block (or a block not in the table) the whole prompt. Returns the blocks written."""
        written: list[int] = []
        for gid, group_blocks in enumerate(blocks):
            bs, ring = groups[gid]
            table = tables[gid] if gid < len(tables) else []
            for b in group_blocks:
                i = table.index(b) if b in table else None
                if ring or i is None:
                    end, who = num_prompt, None
                else:
                    end = min((i + 1) * bs, num_prompt)
                    who = ident.ident_at(end) if end == (i + 1) * bs else None
                self.gids[b], self.ends[b], self.idents[b] = gid, end, who
                written.append(b)
        return written

    def read_chunk(self, bids: list, lo: int, hi: int) -> tuple:
        """The content of a chunk read from the blocks ``bids[lo:hi]`` (flat, see the module)."""
        gids, ends, idents = self.gids, self.ends, self.idents
        if hi - lo == 1:
            b = bids[lo]
            return (gids[b], ends[b], idents[b])
        fields: list[Any] = []
        for y in range(lo, hi):
            b = bids[y]
            fields.append(gids[b])
            fields.append(ends[b])
            fields.append(idents[b])
        return tuple(fields)

    def read(self, blocks) -> tuple:
        """The content of a chunk read from its ``(block_index, block_id)`` source blocks."""
        return self.read_chunk([b for _, b in blocks], 0, len(blocks))

    def write(self, blocks: list[tuple[int, int]], content: tuple) -> None:
        """A chunk's ``content`` into its ``(block_index, block_id)`` destination blocks (see
        :meth:`write_chunk`)."""
        self.write_chunk([i for i, _ in blocks], [b for _, b in blocks], 0, len(blocks), content)

    def write_chunk(self, idx: list[int], bids: list[int], lo: int, hi: int,
                    content: tuple | None) -> None:
        """A chunk's ``content`` into the blocks ``bids[lo:hi]``, at block indices ``idx[lo:hi]`` of
        the request's table (a model ``Job`` keeps its blocks as such parallel lists)."""
        if not content:
            return
        gids, ends, idents = self.gids, self.ends, self.idents
        n = len(content) // 3                     # the blocks the store read
        if n == self.bpc:
            # a whole chunk: each destination block takes the chunk's block at its own offset
            # (the offloading worker skips block_index % blocks_per_chunk blocks of the chunk)
            for y in range(lo, hi):
                j = idx[y] % n * 3
                b = bids[y]
                gids[b] = content[j]
                ends[b] = content[j + 1]
                idents[b] = content[j + 2]
            return
        # a chunk whose store read only some blocks (windowed groups): its content lines up
        # with the tail of the destination blocks, blocks [n - (hi - lo), n) of it (a negative
        # start counts from the end, as slices do), paired with the blocks in order
        start = n - (hi - lo)
        if start < 0:
            start = max(0, n + start)
        for y in range(lo, min(hi, lo + n - start)):
            j = (start + y - lo) * 3
            b = bids[y]
            gids[b] = content[j]
            ends[b] = content[j + 1]
            idents[b] = content[j + 2]


def chunk_block(content: tuple, j: int) -> tuple | None:
    """Block ``j`` of a chunk's flat ``content`` as a slot's content (None: never written)."""
    g = content[3 * j]
    return None if g is None else (g, content[3 * j + 1], content[3 * j + 2])


__all__ = ["Shadow", "chunk_block"]
