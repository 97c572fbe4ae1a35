"""The CPU tier as the worker sees it (INV-5, INV-7): the content of the ready chunks, and the
chunk slots the jobs write and read.

A store job's ``dst_spec`` and a load job's ``src_spec`` (``CPULoadStoreSpec.block_ids``: chunk
indices into the CPU cache, one per key, in the order ``prepare_store`` / ``prepare_load`` took
the keys: group by group, chunk by chunk, as the job's items) name the slots the worker writes
or reads. A slot holds what the last completed store wrote there, whatever key the manager maps
to it now: a load reads its slot (INV-5 then judges what it wrote)."""

from __future__ import annotations

from typing import Any

from simsched import invariants as inv


class CpuTier:
    def __init__(self):
        self.ready: dict[Any, tuple] = {}           # offload key -> content (ready chunks)
        self.slot_content: dict[int, Any] = {}      # CPU slot -> chunk content
        self.job_slots: dict[int, list[int]] = {}   # job id -> the slot of each item
        self.slot_writer: dict[int, int] = {}       # CPU slot -> pending store writing it
        self.slot_readers: dict[int, set[int]] = {}  # CPU slot -> pending loads reading it

    def bind(self, step: int, job, ids) -> None:
        """The slots ``ids`` of a new job; INV-7 when a store is handed a slot a pending load
        still reads (the manager evicted a chunk in use: ``prepare_load`` pins it with
        ``ref_cnt``), or a load reads a slot a pending store is writing."""
        if ids is None or len(ids) != len(job.items):
            return              # not one slot per chunk: nothing to pair
        slots = [int(s) for s in ids]
        self.job_slots[job.jid] = slots
        for item, s in zip(job.items, slots):
            if job.is_store and self.slot_readers.get(s):
                raise inv.InvariantViolation(
                    "INV-7", step, f"store {job.jid} writes CPU slot {s} (g{item[0]}:{item[2]}) "
                    f"while load {min(self.slot_readers[s])} still reads it")
            if not job.is_store and s in self.slot_writer:
                raise inv.InvariantViolation(
                    "INV-7", step, f"load {job.jid} reads CPU slot {s} (g{item[0]}:{item[2]}) "
                    f"while store {self.slot_writer[s]} still writes it")
            if job.is_store:
                self.slot_writer[s] = job.jid
            else:
                self.slot_readers.setdefault(s, set()).add(job.jid)

    def check_load(self, step: int, job) -> None:
        """INV-7: a load of a chunk whose store has not completed."""
        for item in job.items:
            if item[3] not in self.ready:
                raise inv.InvariantViolation(
                    "INV-7", step, f"load of chunk g{item[0]}:{item[2]} whose store has "
                    "not completed")

    def stored(self, job) -> None:
        """A store completed: its chunks are ready, and in their slots."""
        for item in job.items:
            self.ready[item[3]] = job.contents.get(item[3])
        for item, s in zip(job.items, self.job_slots.pop(job.jid, ())):
            self.slot_content[s] = job.contents.get(item[3])
            if self.slot_writer.get(s) == job.jid:
                del self.slot_writer[s]

    def read(self, job, x: int, item) -> Any:
        """What a completing load reads for its item ``x``: its slot's content (the key's, if
        the job's slots are not known)."""
        slots = self.job_slots.get(job.jid)
        if slots is None:
            return self.ready.get(item[3])
        s = slots[x]
        readers = self.slot_readers.get(s)
        if readers is not None:
            readers.discard(job.jid)
        if x == len(slots) - 1:
            del self.job_slots[job.jid]
        return self.slot_content.get(s)
