"""Partial-tail stores as the content shadow follows them (INV-3, INV-4).

``SchedulerOffloadConfig.supports_partial_tail`` (0.28.0+: align-mode Mamba whose block is
larger than the hash block, one block per chunk, one block size): a boundary state handed over
inside a block (``MambaManager`` CoW of a producer's partial tail,
``take_boundary_state_offloads``) is stored by ``_build_partial_tail_store_jobs`` as one job
keying every group at the boundary, per group one block (the connector driver builds such an
item, :meth:`simsched.vllm.inside.offloading.OffloadingConnectorDriver.job_items`). Such an item
is left out of INV-3 and checked by content (``inv.check_stored_tail``, INV-4). The shadow
names no identity for a partly written block, so this keeps, per block, the request whose
forward last left it partly written (``writer``), and the request still appending to a block a
pending partial-tail store of it will read (``appending``: its writes past the boundary are no
INV-6)."""

from __future__ import annotations

from types import SimpleNamespace

from simsched import invariants as inv


class PartialTails:
    def __init__(self, enabled: bool, tph: int, group_by_id: dict):
        self.enabled, self.tph, self.group_by_id = enabled, tph, group_by_id
        # block -> the request appending to it while a partial-tail store of it is pending
        self.appending: dict[int, str] = {}
        self.writer: dict[int, str] = {}

    def is_tail(self, item) -> bool:
        return self.enabled and (item[2] + 1) * self.tph % \
            self.group_by_id[item[0]].tokens_per_chunk != 0

    def chunk_items(self, job):
        """``job`` as INV-3 judges it: its partial-tail items (checked by content, INV-4, and by
        the one block each group gives) left out."""
        if not self.enabled:
            return job
        return SimpleNamespace(jid=job.jid, items=[x for x in job.items if not self.is_tail(x)])

    def check(self, step: int, job, item, content, req,
              idents: dict) -> inv.InvariantViolation | None:
        """INV-4 on a partial-tail item: the content its one block holds against the boundary
        state, an attention block's against the request that wrote it."""
        gid = item[0]
        b = item[4][0][1] if item[4] else None
        w = self.writer.get(b) if b is not None else None
        return inv.check_stored_tail(step, job, item, content, req,
                                     idents.get(w) if w is not None else None, self.tph,
                                     self.group_by_id[gid].cow_source)

    def pending(self, rid: str, item) -> None:
        """A new store of ``item`` not read yet: an attention block of a partial tail is stored
        while its request goes on appending to it past the boundary (the stored tokens stay)."""
        if self.is_tail(item) and not self.group_by_id[item[0]].cow_source:
            for _, b in item[4]:
                self.appending[b] = rid

    def read(self, rid: str, item) -> None:
        """The store of ``item`` read its blocks: no longer appended to under it."""
        for _, b in item[4]:
            if self.appending.get(b) == rid:
                del self.appending[b]

    def note_writers(self, rid: str, written: list, idents: list) -> None:
        """The blocks the forward of ``rid`` left partly written (``idents``: the shadow's
        identity per block, None for such a block) are its."""
        for b in written:
            if idents[b] is None:
                self.writer[b] = rid
            else:
                self.writer.pop(b, None)

    def apply_block_copies(self, out, sh) -> None:
        """``SchedulerOutput.kv_cache_block_copies`` (the Mamba CoW of a partial tail): the
        worker copies each source block into its destination (in the shadow ``sh``) before the
        forward pass overwrites the source."""
        for cp in getattr(out, "kv_cache_block_copies", None) or ():
            src, dst = int(cp.src_block_id), int(cp.dst_block_id)
            sh.gids[dst], sh.ends[dst], sh.idents[dst] = sh.gids[src], sh.ends[src], \
                sh.idents[src]
            if src in self.writer:
                self.writer[dst] = self.writer[src]
            else:
                self.writer.pop(dst, None)
