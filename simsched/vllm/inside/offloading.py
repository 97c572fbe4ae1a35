"""The harness's driver of vLLM's ``OffloadingConnector``: everything the run reads of this one
connector, or hands to it, and nothing else (:class:`simsched.vllm.inside.connector.ConnectorDriver`
is the seam a driver of another connector implements beside it).

* At boot, the connector's scheduler side (``Scheduler.connector.connector_scheduler``) and its
  ``SchedulerOffloadConfig`` (``cs.config``): the offloaded groups and their chunking, the
  groups it takes for EAGLE drafter groups, partial-tail stores, the per-request caps its
  ``RequestOffloadState`` parses. (Its ``kv_transfer_config``,
  ``kv_connector="OffloadingConnector"``, is built with the rest of the ``VllmConfig`` in
  :mod:`simsched.vllm.inside.build`.)
* Lookups: ``get_num_new_matched_tokens`` observed on the run's own connector; what its CPU
  tier still holds (``manager.lookup``).
* The transfer jobs of a step: ``OffloadingConnectorMetadata`` (``load_jobs``, ``store_jobs``,
  ``jobs_to_flush``), each job's items (group, chunk, hash index, key and GPU blocks) read from
  its specs and the connector's own key set (``TransferJobStatus.keys``), its CPU slots.
* Their completion, in the model runner's output: a store only through
  ``OffloadingWorkerMetadata.completed_jobs``, a load through ``completed_jobs`` and
  ``finished_recving`` (as the real offloading worker reports them); a faulted job handed to
  the release's own worker-role connector (:mod:`simsched.vllm.inside.transfer_faults`).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import SimpleNamespace

from simsched.model.request import make_key
from simsched.vllm.inside import connector as seam
from simsched.vllm.inside.connector import ScheduledJobs
from simsched.vllm.inside.cpu_tier import CpuTier


class ChunkIndex:
    """The chunk index of a job's key: where it sits in its request's offload keys (the
    connector's ``RequestOffloadState``, per group), else the chunk its hash index ends. A
    request's keys are distinct (block hashes are chained, each over its parent's), so a key
    found at the chunk its hash index ends is there; a group whose keys do not start at chunk 0
    has them searched, once."""

    def __init__(self, offload_keys: list, tph: int, tpc: int):
        self.offload_keys, self.tph, self.tpc = offload_keys, tph, tpc
        self.position: dict[bytes, int] | None = None

    def of(self, key, hidx: int) -> int:
        c = (hidx + 1) * self.tph // self.tpc - 1
        kb = bytes(key)
        if 0 <= c < len(self.offload_keys) and bytes(self.offload_keys[c]) == kb:
            return c
        if self.position is None:
            self.position = {}
            for i, k in enumerate(self.offload_keys):
                self.position.setdefault(bytes(k), i)
        return self.position.get(kb, c)


class OffloadingConnectorDriver:
    """The ``OffloadingConnector`` of one booted ``Scheduler`` (one per run of a case): a
    :class:`~simsched.vllm.inside.connector.ConnectorDriver`.

    ``groups``: per offloaded KV cache group, ``group_id``, ``tokens_per_block``,
    ``tokens_per_chunk`` and ``cow_source``; ``geometry`` them with the tokens per hash block
    (as the invariants' checks take it); ``blocks_per_chunk``; ``partial_tails``;
    ``caps_supported``: per cap name whether the release parses it."""

    def __init__(self, sched, tph: int, connector=None):
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading.common as common
        from vllm.v1.outputs import KVConnectorOutput
        self.KVConnectorOutput = KVConnectorOutput
        self.WorkerMeta = getattr(common, "OffloadingWorkerMetadata", None)
        self.sched, self.tph = sched, tph
        # connector: the OffloadingConnector, the scheduler's own or a MultiConnector's child
        self.connector = sched.connector if connector is None else connector
        cs = getattr(self.connector, "connector_scheduler", None)
        if cs is None:
            raise RuntimeError("harness: no OffloadingConnectorScheduler on the scheduler")
        self.cs = cs
        self._read_config(cs.config)
        self._read_keys()
        self.caps_supported = self._caps_supported()

    # -- the connector's scheduler config ----------------------------------------------------
    def _read_config(self, cfg) -> None:
        self.config = cfg
        self.blocks_per_chunk = int(getattr(cfg, "blocks_per_chunk", None)
                                    or getattr(cfg, "block_size_factor", 1))
        groups = []
        for group_cfg in cfg.kv_group_configs:
            gid = int(group_cfg.group_idx)
            tpb = int(getattr(group_cfg, "tokens_per_block", None)
                      or getattr(group_cfg, "gpu_block_size"))
            # cow_source: Mamba "align" (0.33.0+): stores come as one-block boundary jobs whose
            # block_indices name the block's index; the block table is not append-only there
            groups.append(SimpleNamespace(
                group_id=gid, tokens_per_block=tpb, tokens_per_chunk=tpb * self.blocks_per_chunk,
                cow_source=bool(getattr(group_cfg, "requires_cow_source", False))))
        self.groups = groups
        self.group_by_id = {g.group_id: g for g in groups}
        self.geometry = SimpleNamespace(tokens_per_hash=self.tph, groups=groups)
        # SchedulerOffloadConfig.supports_partial_tail (0.28.0+): see _tail_item
        self.partial_tails = bool(getattr(cfg, "supports_partial_tail", False))

    def _read_keys(self) -> None:
        """The offload key of a (block hash, group) and back, as the release builds them (a
        key before ``make_offload_key``: the hash and the group index in 4 bytes)."""
        try:
            from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx
            self.key_hash, self.key_group = get_offload_block_hash, get_offload_group_idx
        except ImportError:
            self.key_hash = lambda k: bytes(k)[:-4]
            self.key_group = lambda k: int.from_bytes(bytes(k)[-4:], "big")
        try:
            from vllm.v1.kv_offload.base import make_offload_key
            self.offload_key = make_offload_key
        except ImportError:
            self.offload_key = None

    def _caps_supported(self) -> dict[str, bool]:
        """Which per-request caps this release honours, read from what its code has: the
        fields ``RequestOffloadState.__post_init__`` parses out of ``kv_transfer_params``
        (``max_offload_tokens`` in every release, ``max_load_tokens`` from 0.31.0; 0.30.0's
        connector bounds a load only by ``OffloadingConnector._max_loadable_tokens``, the
        groups it does not offload). A cap the release does not parse is not checked."""
        mod = importlib.import_module(
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
        cls = getattr(mod, "RequestOffloadState", None)
        names: set[str] = set()
        if cls is not None and dataclasses.is_dataclass(cls):
            names = {f.name for f in dataclasses.fields(cls)}
        return {n: n in names for n in ("max_offload_tokens", "max_load_tokens")}

    def drafter_groups(self, case) -> set[int]:
        """The groups holding EAGLE/MTP drafter KV, for INV-9's eagle-tail rule: the layout's
        drafter groups; with speculative decoding and none marked, the drafter's layers share
        the target's groups (a shared-group MTP model, or a drafter left unannotated), and
        0.25.1-0.29.0 then take every group for a drafter group
        (``OffloadingConnectorScheduler.__init__``: ``if use_eagle and not eagle_groups:
        eagle_groups = set(range(len(kv_cache_groups)))``, the trailing chunk "excluded from
        offloading due to volatility"); 0.30.0+ take none ("fail toward serving", #52735). Read
        from ``GroupOffloadConfig.is_eagle_group``, and only in these two shapes: any other set
        the connector flags is not excused."""
        layout = case.layout.groups
        marked = {g.group_id for g in self.groups if layout[g.group_id].drafter}
        flagged = {int(gc.group_idx) for gc in self.config.kv_group_configs
                   if getattr(gc, "is_eagle_group", False)}
        every = {g.group_id for g in self.groups}
        if not marked and case.layout.engine.speculative is not None and flagged == every:
            return every
        return marked

    def kv_transfer_params(self, spec) -> dict:
        """Nothing beyond the caps (:mod:`~simsched.vllm.inside.case_requests` adds them)."""
        return {}

    # -- lookups ---------------------------------------------------------------------------
    def observe_lookups(self, observer) -> None:
        """Every lookup the connector's scheduler answers, handed to ``observer``
        (:func:`~simsched.vllm.inside.connector.observe_lookups`)."""
        seam.observe_lookups(self.cs, observer)

    def stop_observing(self) -> None:
        seam.stop_observing(self.cs)

    def reads_load_cap(self, rid: str) -> bool:
        """The release reads the request's ``max_load_tokens``
        (``RequestOffloadState.max_load_tokens``)."""
        return hasattr(self.cs._req_status.get(rid), "max_load_tokens")

    def tier_holds(self, request, block_hash, gid: int) -> bool:
        """The CPU tier still holds the chunk ready: not evicted since its store completed
        (CPUOffloadingManager.prepare_store evicts under the tier's capacity) nor being stored
        again. Read from the manager's own lookup, below the connector's search."""
        if self.offload_key is None:
            return True
        state = self.cs._req_status.get(request.request_id)
        try:
            res = self.cs.manager.lookup(self.offload_key(block_hash, gid), state.req_context)
        except (TypeError, AttributeError):
            return True     # (a manager without per-key lookups: eviction not read)
        return getattr(res, "name", "") == "HIT"

    # -- the jobs of a step ----------------------------------------------------------------
    def has_jobs(self) -> bool:
        """The connector has jobs it has not been told are done."""
        return bool(self.cs._jobs)

    def scheduled_jobs(self, out) -> ScheduledJobs:
        """The jobs ``SchedulerOutput.kv_connector_metadata`` hands the worker."""
        meta = getattr(out, "kv_connector_metadata", None)
        if meta is None:
            return ScheduledJobs(None, {}, {}, set())
        return ScheduledJobs(meta, dict(getattr(meta, "load_jobs", None) or {}),
                             dict(getattr(meta, "store_jobs", None) or {}),
                             set(getattr(meta, "jobs_to_flush", None) or ()))

    def job_slots(self, tjob, is_store: bool):
        """The CPU slots a job writes (a store's ``dst_spec``) or reads (a load's
        ``src_spec``): ``CPULoadStoreSpec.block_ids``, chunk indices into the CPU cache, one
        per key in the order ``prepare_store`` / ``prepare_load`` took the keys; None where the
        spec names none."""
        spec = tjob.dst_spec if is_store else tjob.src_spec
        return getattr(spec, "block_ids", None)

    def job_items(self, jid: int, tjob, is_store: bool, requests) -> tuple[list, list | None]:
        """The job's items, per chunk ``(group, chunk index, hash index, key, [(block index,
        block id)])``, and its keys (as the model's keys) in the order of the job's key set
        (``TransferJobStatus.keys``, which ``complete_store`` / ``complete_load`` walk: an
        order vLLM leaves to the set, :func:`simsched.model.cpu_manager.walk_order`); no items
        and no walk for a job the connector does not track."""
        status = self.cs._jobs.get(jid)
        if status is None:
            return [], None
        rid = tjob.req_id
        ident = requests.ident[rid]
        by_group: dict[int, list] = {}
        walk = []
        for k in status.keys:
            gid = int(self.key_group(k))
            hidx = requests.hidx(rid, self.key_hash(k))
            by_group.setdefault(gid, []).append((hidx, k))
            walk.append(self._key(gid, ident, hidx))
        return self._items(tjob, is_store, by_group, ident), walk

    def _key(self, gid: int, ident, hidx: int):
        return make_key(gid, ident.ident_at((hidx + 1) * self.tph))

    def _items(self, tjob, is_store: bool, by_group: dict, ident) -> list:
        """Per offloaded group, its blocks of the job's GPU spec (``group_sizes`` of them, from
        ``block_indices`` in the request's table) paired with its keys."""
        gpu = tjob.src_spec if is_store else tjob.dst_spec
        bids = [int(b) for b in gpu.block_ids]
        sizes = list(getattr(gpu, "group_sizes", None) or [len(bids)])
        starts = list(getattr(gpu, "block_indices", None) or [0] * len(sizes))
        req_state = self.cs._req_status.get(tjob.req_id)
        items: list = []
        pos = 0
        for gi, gcfg in enumerate(self.groups):
            n = sizes[gi] if gi < len(sizes) else 0
            blocks = bids[pos:pos + n]
            pos += n
            keys = sorted(by_group.get(gcfg.group_id, []), key=lambda x: x[0])
            if not keys:
                continue        # the job has no chunk of this group
            offload_keys = (req_state.group_states[gi].offload_keys
                            if req_state is not None and gi < len(req_state.group_states) else [])
            chunk_of = ChunkIndex(offload_keys, self.tph, gcfg.tokens_per_chunk)
            start = starts[gi] if gi < len(starts) else None
            items.extend(self._group_items(gcfg, gi, keys, blocks, start, chunk_of, req_state,
                                           ident, is_store))
        return items

    def _group_items(self, gcfg, gi: int, keys: list, blocks: list, start: int | None,
                     chunk_of: ChunkIndex, req_state, ident, is_store: bool) -> list:
        gid = gcfg.group_id
        if is_store and self._is_tail_job(keys, gcfg.tokens_per_chunk):
            return [self._tail_item(gcfg, keys[0], blocks, start, ident)]
        if is_store and gcfg.cow_source:
            # an aligned boundary job (_build_aligned_boundary_store_jobs): one key, one block,
            # its index in the request's table given by block_indices (boundary // tpb - 1);
            # the table cannot be read positionally (interior states nulled or relocated)
            items = []
            for hidx, k in keys:
                c = chunk_of.of(k, hidx)
                take, blocks = blocks[:1], blocks[1:]
                items.append((gid, c, hidx, self._key(gid, ident, hidx),
                              [(0 if start is None else start, b) for b in take]))
            return items
        if is_store:
            table = req_state.group_states[gi].block_ids if req_state is not None else []
            return self._store_items(gid, keys, blocks, table, chunk_of, ident)
        return self._load_items(gid, keys, blocks, 0 if start is None else start, chunk_of,
                                ident)

    def _store_items(self, gid: int, keys: list, blocks: list, table, chunk_of: ChunkIndex,
                     ident) -> list:
        """The source blocks of each chunk of a store: its non-null blocks, in order."""
        bpc = self.blocks_per_chunk
        items = []
        for hidx, k in keys:
            c = chunk_of.of(k, hidx)
            idxs = [i for i in range(c * bpc, (c + 1) * bpc) if i < len(table) and table[i] != 0]
            take, blocks = blocks[:len(idxs)], blocks[len(idxs):]
            items.append((gid, c, hidx, self._key(gid, ident, hidx), list(zip(idxs, take))))
        return items

    def _load_items(self, gid: int, keys: list, blocks: list, start: int,
                    chunk_of: ChunkIndex, ident) -> list:
        """The destination blocks of each chunk of a load: the blocks from ``start`` on in
        the request's table, by the chunk they fall in."""
        per_chunk: dict[int, list] = {}
        for off, b in enumerate(blocks):
            i = start + off
            per_chunk.setdefault(i // self.blocks_per_chunk, []).append((i, b))
        items = []
        for hidx, k in keys:
            c = chunk_of.of(k, hidx)
            items.append((gid, c, hidx, self._key(gid, ident, hidx), per_chunk.get(c, [])))
        return items

    # -- partial-tail stores ----------------------------------------------------------------
    def _is_tail_job(self, keys: list, tpc: int) -> bool:
        """A group's part of a partial-tail store: one key, ending inside a chunk."""
        return self.partial_tails and len(keys) == 1 and (keys[0][0] + 1) * self.tph % tpc != 0

    def _tail_item(self, gcfg, hk, blocks: list, start: int | None, ident) -> tuple:
        """The item of a partial-tail store (``supports_partial_tail``, 0.28.0+: align-mode
        Mamba whose block is larger than the hash block): a boundary state handed over inside
        a block (``MambaManager`` CoW of a producer's partial tail,
        ``take_boundary_state_offloads``) is stored by ``_build_partial_tail_store_jobs`` as
        one job keying every group at the boundary: per group one block, at the index
        ``block_indices`` gives (``boundary // block_size``; for the Mamba group the CoW
        copy), in the chunk the boundary falls in."""
        hidx, _ = hk
        end = (hidx + 1) * self.tph
        gid = gcfg.group_id
        if start is None:
            start = end // gcfg.tokens_per_block
        return (gid, end // gcfg.tokens_per_chunk, hidx, make_key(gid, ident.ident_at(end)),
                [(start, b) for b in blocks[:1]])

    def external_writes(self, out, t: int) -> list:
        """None: the OffloadingConnector alone has no other connector writing GPU blocks."""
        return []

    def held_blocks(self) -> dict:
        """None: the OffloadingConnector holds no GPU block itself (a finished request's
        blocks stay the request's until its stores complete: ``request_finished``)."""
        return {}

    # -- their completion ------------------------------------------------------------------
    def connector_output(self, completed_jobs: list[int], finished_recving: set[str]):
        """The ``KVConnectorOutput`` of a model runner output reporting these jobs done (the
        offloading worker's ``OffloadingWorkerMetadata.completed_jobs``) and these requests'
        loads done (``finished_recving``), or None when there is nothing to report."""
        if not completed_jobs and not finished_recving:
            return None
        wm = (self.WorkerMeta(completed_jobs=dict.fromkeys(completed_jobs, 1))
              if self.WorkerMeta else None)
        return self.KVConnectorOutput(finished_recving=finished_recving or None,
                                      kv_connector_worker_meta=wm)

    def worker_refusal(self, vc, kvc, meta, jid: int) -> str | None:
        """Job ``jid`` of ``meta`` fails on the release's own worker-role connector: the
        AssertionError it raised, or None where it took the failure
        (:func:`simsched.vllm.inside.transfer_faults.worker_refusal`)."""
        from simsched.vllm.inside import transfer_faults
        return transfer_faults.worker_refusal(self.sched, vc, kvc, meta, jid)

    # -- the CPU tier's content, clock and lifetime ----------------------------------------
    #: the CPU tier's lookups defer only on the worker's jobs (the case's latencies)
    lookup_defer_steps = 0
    hit_alignment = 1       # the hit ends on chunks: INV-9's own rules
    strands_at_idle = False  # the run steps on until its jobs are reported

    def cpu_tier(self) -> CpuTier:
        """The CPU tier as the content shadow keeps it."""
        return CpuTier()

    def tier_io_live(self) -> bool:
        """No tier behind the CPU tier: its transfers are the worker's."""
        return False

    def before_schedule(self, step: int) -> list[str]:
        """Nothing: the CPU tier moves only through the worker's jobs."""
        return []

    def close(self) -> None:
        """Nothing outside the process."""
