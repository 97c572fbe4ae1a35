"""The offloading connector's transfer job: ``Job``.

Mirrors ``TransferJob`` of ``distributed/kv_transfer/kv_connector/v1/offloading/common.py``
(there in every release from 0.25.1 to 0.33.0), the job that the connector's scheduler side
(:mod:`simsched.model.offloading_scheduler`) builds, the worker runs, and the worker's output
reports done by its ID. vLLM's job carries the request and the source and destination specs;
the model's also keeps its chunks with their offload keys and GPU blocks, its fences, and what
a store read from its blocks, which the invariants check.
"""

from __future__ import annotations

from simsched.model.request import Key


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
    (OffloadingConnectorScheduler._deferred lists them). ``cpu_chunks``: the CPU tier's chunks of
    ``ckeys`` (``ChunkStatus``), in order, as the job was prepared (vLLM's store or load spec:
    a chunk being written or read is not evicted), None if not known (looked up then)."""

    __slots__ = ("jid", "rid", "is_store", "keys", "gids", "cidx", "hidx", "ckeys", "bpos",
                 "bidx", "bids", "fenced", "deferred", "read", "contents", "done",
                 "cpu_chunks", "unready")

    def __init__(self, jid, rid, is_store, keys, fenced=None, deferred: bool = False):
        self.jid, self.rid, self.is_store = jid, rid, is_store
        self.keys = keys
        self.gids: list[int] = []
        self.cidx: list[int] = []
        self.hidx: list[int] = []
        self.ckeys: list = []           # the chunks' offload keys
        self.bpos: list[int] = [0]
        self.bidx: list[int] = []
        self.bids: list = []            # the GPU block IDs, as the block tables hold them
        self.fenced = fenced
        self.deferred = deferred
        self.read = False            # a store has read its source blocks
        self.contents: list = []       # a store's chunk contents, in chunk order, once read
        self.done = False
        self.cpu_chunks: list | None = None
        self.unready: list[int] = []    # a load's chunks not ready when it was prepared

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
        CPU chunks are not known then."""
        self.cpu_chunks = None
        self.gids, self.cidx, self.hidx, self.ckeys = [], [], [], []
        self.bpos, self.bidx, self.bids = [0], [], []
        for gid, c, hidx, key, blocks in items:
            self.add_chunk(gid, c, hidx, key, blocks)
