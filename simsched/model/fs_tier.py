"""A file-system secondary tier: ``FileSystemTierManager`` (``vllm/v1/kv_offload/tiering/fs/
manager.py``) with its lookup probes (``AsyncLookupManager``, ``tiering/async_lookup.py``), as
0.25.1-0.33.0 write them, on the I/O clock the harness gives it
(:mod:`simsched.vllm.inside.tiering`): the manager of the tiers is
:mod:`simsched.model.tiering_manager`.

A key has a file once a cascade of it was written (the first one: the tier skips a key whose
file exists), and keeps it. A lookup of a key answers from the probe of the key: RETRY until the
tier's lookup thread answered it, then whether the file was there when the probe was posted
(``flush``, at ``on_schedule_end``). 0.25.1-0.29.0's probes have no generation (``LookupPhase``,
0.30.0): an answer goes to whatever probe of its key is there, and a probe goes with its last
request even in flight. On this clock that changes nothing: the answers are drained before
every ``schedule()``, before any lookup could make a probe anew. Reads (promotions) and writes
(cascades) are queued and run
before a ``schedule()``: a job first seen before step ``s`` runs before step ``s + io_latency -
1``, reads first, FIFO (``DualQueueThreadPool._worker``).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Final

from simsched.model.cpu_manager import HIT, MISS, RETRY
from simsched.model.request import Key

# AsyncLookupManager's LookupPhase
PENDING: Final = 0
IN_FLIGHT: Final = 1
RESOLVED: Final = 2


class LookupState:
    """``LookupState``: one key's probe, its phase, its answer (None until resolved) and the
    requests asking for it."""

    __slots__ = ("generation", "phase", "result", "request_ids")

    def __init__(self, generation: int):
        self.generation = generation
        self.phase = PENDING
        self.result: bool | None = None
        self.request_ids: set[str] = set()


class AsyncLookupManager:
    """``AsyncLookupManager`` of an fs tier: probes accumulated per step, posted at ``flush``
    (``on_schedule_end``), answered by the lookup thread before the next ``schedule()``."""

    def __init__(self, files: dict):
        self.files = files
        self.states: dict[Key, LookupState] = {}
        self.req_keys: dict[str, set[Key]] = {}
        self.next_generation = 0
        self.batch: list[tuple[Key, int]] = []
        self.posted: list[tuple[Key, int, bool]] = []    # probes the thread answered

    def lookup(self, key: Key, rid: str) -> bool | None:
        """True or False once probed, None (RETRY) until then; the first lookup of a key
        queues its probe."""
        state = self.states.get(key)
        if state is None:
            state = LookupState(self.next_generation)
            self.next_generation += 1
            self.states[key] = state
            self.batch.append((key, state.generation))
        state.request_ids.add(rid)
        self.req_keys.setdefault(rid, set()).add(key)
        return state.result

    def flush(self) -> None:
        """Post the step's probes; the lookup thread answers each from the files now there."""
        batch, self.batch = self.batch, []
        for key, generation in batch:
            state = self.states.get(key)
            if state is None or state.generation != generation:
                continue
            state.phase = IN_FLIGHT
            self.posted.append((key, generation, key in self.files))

    def drain_results(self) -> None:
        """Apply the thread's answers (a probe no request asks for any more is dropped)."""
        posted, self.posted = self.posted, []
        for key, generation, found in posted:
            state = self.states.get(key)
            if state is None or state.generation != generation:
                continue
            if not state.request_ids:
                del self.states[key]
                continue
            state.result, state.phase = found, RESOLVED

    def cleanup(self, rid: str) -> None:
        """Release the request's probes, keeping those in flight."""
        for key in self.req_keys.pop(rid, ()):
            state = self.states[key]
            state.request_ids.discard(rid)
            if not state.request_ids and state.phase != IN_FLIGHT:
                del self.states[key]


class TransferJob:
    """``TransferJob`` (``tiering/base.py``): a cascade (CPU -> file) or a promotion (file ->
    CPU) of ``keys``, the CPU chunks it reads or fills, and the content a promotion read."""

    __slots__ = ("job_id", "keys", "chunks", "is_promotion", "rid", "contents")

    def __init__(self, job_id: int, keys: list, chunks: list, is_promotion: bool, rid: str):
        self.job_id, self.keys, self.chunks = job_id, keys, chunks
        self.is_promotion, self.rid = is_promotion, rid
        self.contents: list = []


class FileSystemTierManager:
    """``FileSystemTierManager``: a file per key (what its chunk held when the first cascade
    of the key wrote it; files are never removed), the I/O queues the harness runs
    (``DualQueueThreadPool``) and the lookup probes."""

    def __init__(self, io_latency: int):
        self.io_latency = io_latency
        self.files: dict[Key, Any] = {}
        self.lookups = AsyncLookupManager(self.files)
        self.load_q: deque[TransferJob] = deque()
        self.store_q: deque[TransferJob] = deque()
        self.first_seen: dict[int, int] = {}
        self.finished: list[TransferJob] = []

    def lookup(self, key: Key, rid: str) -> int:
        found = self.lookups.lookup(key, rid)
        if found is None:
            return RETRY
        return HIT if found else MISS

    def submit_store(self, job: TransferJob) -> None:
        self.store_q.append(job)

    def submit_load(self, job: TransferJob) -> None:
        self.load_q.append(job)

    def run_io(self, step: int) -> list[TransferJob]:
        """The harness's I/O clock before ``schedule()`` of ``step``: the jobs due, reads
        first, FIFO; a write stores its chunks' content where a key has no file yet, a read
        takes its files'."""
        for q in (self.load_q, self.store_q):
            for job in q:
                self.first_seen.setdefault(job.job_id, step)
        ran: list[TransferJob] = []
        while True:
            for q in (self.load_q, self.store_q):
                if q and self.first_seen[q[0].job_id] + self.io_latency - 1 <= step:
                    break
            else:
                return ran
            job = q.popleft()
            del self.first_seen[job.job_id]
            if job.is_promotion:
                job.contents = [self.files[k] for k in job.keys]
            else:
                for k, chunk in zip(job.keys, job.chunks):
                    # a key's file is written once ("Check if block already exists to avoid
                    # redundant writes", 0.30.0 fs/io.py:100-102)
                    self.files.setdefault(k, chunk.content)
            self.finished.append(job)
            ran.append(job)

    def get_finished_jobs(self) -> list[TransferJob]:
        done, self.finished = self.finished, []
        return done
