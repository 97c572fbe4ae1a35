"""The ``SimpleCPUOffloadConnector``'s scheduler side as 0.25.1-0.29.0 have it.

Mirrors ``vllm/v1/simple_kv_offload/manager.py`` of 0.25.1-0.29.0 (**mgr**, 905-921 lines; the
five versions differ in the connector's plumbing, not in what the manager decides: see the
notes below), beside the model of 0.30.0+ it inherits from
(:mod:`simsched.model.simple_cpu_scheduler`). The CPU tier is the same: a second block pool of
the GPU pool's groups, looked up by a CPU ``KVCacheCoordinator`` of its own for the suffix past
the GPU hit; stores pin their GPU blocks until their event completes; one store event and one
load event a step, cut into jobs by the worker the harness plays. What 0.30.0 rewrote:

* the lookup asks nothing of the request or the local prefix: no ``skip_reading_prefix_cache``
  answer, no refusal of a local prefix off the scheduler block (mgr 0.29.0:245-281);
* a load finds where its blocks go by counting the hashed blocks of the full-attention group's
  table (the local prefix) and back-tracing the hit from the end of the computed range
  (mgr 0.29.0:332-391; 0.30.0 keeps the local prefix the lookup saw);
* eager stores reach the confirmed tokens rounded down to the scheduler block, per group to
  its block; a block the sliding window nulled, one not hashed, in flight or already in the
  CPU pool is passed over (no look into the GPU prefix cache for a nulled block); once the CPU
  pool is full no group stores more this step (mgr 0.29.0:577-634);
* a finished request's last blocks are not flushed (mgr 0.29.0:531-535 "If a request finishes
  in the same step as its last full block, that block may be missed. (TODO: flush on
  finish.)"; ``request_finished`` 766-798 releases pins only);
* the connector's keep-alive hook is named ``has_pending_transfers`` (connector 0.29.0:295),
  which the scheduler never calls: ``Scheduler.has_requests`` asks ``has_pending_push_work``,
  the base's False (scheduler 0.29.0:2597). After its last request the engine idles with its
  last stores in flight (``strands_at_idle``, which the model's run reads).

Release differences inside 0.25.1-0.29.0, as profile extras: the CPU coordinator is built with
``use_eagle=False`` before 0.27.0 (mgr 0.26.0:125; 0.27.0:120-126 ``spec_config.use_eagle()``),
``simple_cpu_cpu_eagle``. The others change nothing the model sees: 0.25.1 scales blocks by
``dcp * pcp`` (pcp is 1 here), 0.28.0 adds the disk backend (``kv_offload_backend``, not in the
case format), 0.25.1-0.28.0 size the CPU tier from the sum of separate ``KVCacheTensor`` sizes
(``_derive_cpu_config``), which the harness's ``kv_bytes_per_block`` follows, and the lazy
walk's cursor loop became ``iter_blocks_after`` in 0.26.0 (mgr 0.25.1:492-522, same walk).
Every block is scaled by the DCP size (``spec.block_size * cp_world_size``), not only full
attention's (0.30.0): a Mamba group's too, whose blocks neither pool scales
(``spec_block_sizes``; DCP serves full-attention and Mamba groups only,
``layout.DCP_UNSUPPORTED_KINDS``). No boundary hand-offs: an align-mode Mamba group's states
are stored by the positional scan, the step after they were computed.
"""

from __future__ import annotations

from simsched.model.block_pool import NULL
from simsched.model.offloading_common import Job
from simsched.model.request import Request
from simsched.model.offloading_scheduler import ModelCrash
from simsched.model.single_type_kv_cache_manager import MambaManager
from simsched.model.simple_cpu_scheduler import (MANAGER_PY, SimpleCPUOffloadScheduler,
                                                 StoreRequestState)


class LegacySimpleCPUOffloadScheduler(SimpleCPUOffloadScheduler):
    """``SimpleCPUOffloadScheduler`` of 0.25.1-0.29.0: the hooks that differ from 0.30.0's,
    each beside the method it mirrors; the rest (the CPU coordinator's lookup, the lazy walk,
    the events, their jobs and completions) is 0.30.0's, unchanged in these lines."""

    #: after the last request the engine idles with stores in flight (module docstring)
    strands_at_idle = True
    #: the CPU coordinator takes the GPU's fine-grained hits in either mode (no
    #: allow_partial_hash_hits before 0.30.0: mgr 0.29.0:129-140)
    lazy_without_partial_hash_hits = False

    @property
    def spec_block_sizes(self) -> list[int]:
        """Per group ``kv_cache_spec.block_size * cp_world_size`` (mgr 0.29.0:354-357,
        375-376, 594-595): under DCP a Mamba group's block too is scaled, which neither the
        GPU pool nor the CPU coordinator scales (``group_block_sizes``: the blocks the pools
        hold); the selection and the load's placement count in these."""
        # (DCP serves full-attention and Mamba groups only: layout.DCP_UNSUPPORTED_KINDS)
        return [bs * self.cp_world_size if isinstance(m, MambaManager) else bs
                for m, bs in zip(self.gpu.managers, self.group_block_sizes)]

    # --- requests -------------------------------------------------------------------------
    def _declines_lookup(self, req: Request, num_computed: int) -> bool:
        """``get_num_new_matched_tokens`` (mgr 0.29.0:245-281) asks nothing of the request or
        the local prefix: a request that skips reading the prefix cache is looked up too (the
        scheduler takes the answer: a load), and the local prefix is the block-aligned one the
        scheduler hands it."""
        return False

    def update_state_after_alloc(self, req: Request, tables: list[list[int]],
                                 num_external: int, block_keys=None,
                                 scheduled: bool = True) -> Job | None:
        """Registers the request for eager stores; pairs the CPU hit's first ``num_external``
        tokens with GPU blocks (mgr 0.29.0:285-406). The local prefix is read off the table
        the scheduler passes (``get_blocks``: every block of the request): the full-attention
        group's hashed blocks, the new ones not hashed yet (their caching waits for the load);
        per group the hit's blocks end where the computed range does (``cdiv(total, block) -
        n_ext``)."""
        pending = self._take_cpu_hit(req, tables, num_external)
        if pending is None:
            return None
        fa = self.fa_gidx
        keys = self.gpu_block_pool.key
        num_computed = sum(keys[b] is not None for b in tables[fa]) * self.group_block_sizes[fa]
        total = num_computed + num_external
        gpu_block_ids: list[int] = []
        cpu_block_ids: list[int] = []
        for g, (cpu_blocks, bs) in enumerate(zip(pending[0], self.spec_block_sizes)):
            if self.asserts and num_external % bs:
                # (a Mamba block scaled past the scheduler block under DCP)
                raise ModelCrash("AssertionError", "update_state_after_alloc", "schedule",
                                 f"num_external_tokens={num_external} not aligned to group "
                                 f"{g} block_size={bs}", MANAGER_PY)
            taken = cpu_blocks[:num_external // bs]
            start = -(-total // bs) - len(taken)
            for i, c in enumerate(taken):
                if c != NULL:           # a window's or chunk's padding: nothing to load
                    gpu_block_ids.append(tables[g][start + i])
                    cpu_block_ids.append(c)
        self._record_load(req, pending, gpu_block_ids, cpu_block_ids)
        return None

    # --- the step's events ----------------------------------------------------------------
    def _prepare_boundary_store_specs(self, offers, preempted: list[str], finished: list[str]
                                      ) -> tuple[list[int], list[int], list[str]]:
        """No boundary hand-offs (0.30.0 added them): an align-mode Mamba group's state blocks
        are stored positionally like every group's (mgr 0.29.0:576-634)."""
        return [], [], []

    def _select_eager_blocks_to_store(self, state: StoreRequestState,
                                      block_ids_by_group: list[list[int]]
                                      ) -> tuple[list[int], list[int]]:
        """Phase 1 of ``_prepare_eager_store_specs`` (mgr 0.29.0:576-634): per group, from its
        cursor to the last block of the confirmed tokens rounded down to the scheduler block,
        the blocks to store. A null block (out of the window), one not hashed, in flight or
        already in the CPU pool is passed over; once the CPU pool has no free block left, no
        group stores more (``out_of_space``)."""
        req = state.req
        confirmed_tokens = req.num_computed - self.num_output_placeholders.get(req.rid, 0)
        aligned_tokens = confirmed_tokens // self.block_size * self.block_size
        num_free = self.cpu_block_pool.get_num_free_blocks()
        gpu_ids: list[int] = []
        advanced = [0] * len(block_ids_by_group)
        for g, (group_ids, bs) in enumerate(zip(block_ids_by_group, self.spec_block_sizes)):
            ready = min(len(group_ids), aligned_tokens // bs)
            for i in range(state.num_stored_blocks[g], ready):
                b = group_ids[i]
                if b == NULL or not self._ready_to_store(b):
                    advanced[g] += 1
                    continue
                if len(gpu_ids) >= num_free:
                    return gpu_ids, advanced
                gpu_ids.append(b)
                advanced[g] += 1
        return gpu_ids, advanced

    # --- a finished request ---------------------------------------------------------------
    def _queue_finished_eager_store(self, req: Request, block_ids: list[list[int]]) -> None:
        """No finish flush (mgr 0.29.0:531-535, 766-798): the blocks a request confirmed in
        its last steps are not stored once it finished."""
