"""The discrete-event model of vLLM's scheduler with the OffloadingConnector: ``Model``.

One scheduler step (a ``STEP`` event at time t) does what ``Scheduler.schedule()`` plus the
connector's ``build_connector_meta`` plus the model runner do:

1. schedule running requests first (decode: 1 token, plus speculative tokens; prefill: chunked to
   the token budget), preempting the last running request when the pool runs dry; then waiting
   requests (``max_num_seqs``; requests skipped at earlier steps first, ``_requeue_skipped``):
   GPU prefix hit (``get_computed_blocks``), then the connector's ``get_num_new_matched_tokens``;
   admission needs free blocks for the whole sequence (``full_sequence_must_fit``) and, for a load,
   beyond the in-flight prefills' reservations; a CPU hit allocates blocks and issues a load
   (``update_state_after_alloc``) and the request waits for it (``WAITING_FOR_REMOTE_KVS``) until
   the waiting loop reaches it after the load completes (``_promote_loaded``);
2. ``build_connector_meta``: offload keys, block IDs, flushes, store jobs;
3. execute: flushed stores read their blocks, then computed tokens are written (the shadow),
   output tokens appended; finished requests free their blocks (``FINISH`` events);
4. transfer completions arrive as ``STORE_DONE``/``LOAD_DONE`` events ``store_latency`` /
   ``load_latency`` steps later, before that step's scheduling (``update_connector_output``).

Invariants (``simsched.invariants``) are checked where they can be decided; the first finding
(a crash or an invariant violation) stops the run.

Size: ``Model`` mirrors vLLM's ``Scheduler`` (``v1/core/sched/scheduler.py``, 3,783 lines in
0.33.0, of which ``schedule()`` alone is about 1,090) method for method: ``schedule`` with its
running and waiting loops, ``_mamba_block_aligned_split``, ``_preempt_request``,
``finish_requests`` and ``_free_request``, ``_update_waiting_for_remote_kv``,
``_request_remaining_blocks`` and ``update_from_output``, which here sits in ``execute_model``
beside the model runner's writes into the content shadow, both acting on the same scheduled
requests in the same order. These methods share one state (the queues, the in-flight prefills,
the drafts, the step's fences) as vLLM's share the scheduler's ``self``: parting them across
modules would split what vLLM keeps in one class, each part reaching into the other's state.
What vLLM keeps in other modules is in other modules here too: ``AsyncScheduler`` and the engine
core's batch queue in :mod:`simsched.model.async_scheduler`, the KV cache manager, the connector
and the CPU tier in theirs, and running a case (the start-up checks, the run, its result) in
:mod:`simsched.model.run`.
"""

from __future__ import annotations

import math
from typing import Final

from simsched import invariants as inv
from simsched.case import VOCAB, Case, RequestSpec, sampled_token
from simsched.geometry import (SINGLE_TYPE_MANAGER_PY, cache_block_size,
                               check_kv_cache_coordinator, derive, effective_block_size,
                               max_model_len, partial_hash_hits)
from simsched.model import events as ev
from simsched.model.async_scheduler import AsyncRun
from simsched.model.block_pool import NULL
from simsched.model.kv_cache_manager import KVCacheManager
from simsched.model.multi_connector import MultiConnector
from simsched.model.nixl_scheduler import NixlPullConnectorScheduler
from simsched.model.offloading_common import Job
from simsched.model.offloading_scheduler import ModelCrash, OffloadingConnectorScheduler
from simsched.model.simple_cpu_scheduler import SimpleCPUOffloadScheduler, block_geometry
from simsched.model.simple_cpu_scheduler_legacy import LegacySimpleCPUOffloadScheduler
from simsched.model.request import ABORTED, FINISHED, RUNNING, WAITING, WAITING_FOR_LOAD, Request
from simsched.model.single_type_kv_cache_manager import (ChunkedLocalAttentionManager,
                                                         CircularBufferManager)
from simsched.profiles import EAGLE_METHODS, Profile, retention_interval
from simsched.shadow import Prefixes, Shadow
from simsched.trace import fmt_alloc, fmt_hung_end, fmt_hung_flush, fmt_job, fmt_recv, header

MAX_STEPS: Final = 100_000
# a scheduled request: (request, tokens, new block IDs per group), or the request alone for a
# quiet decode step (one token, no new block, see Model._fast_bound): most scheduled requests
# are quiet decodes, and the request alone makes no tuple (nor GC-tracked object) per step
Sched = tuple[Request, int, list[list[int]]]
Scheduled = Request | Sched
STALL_STEPS: Final = 8
#: steps the engine may go on stepping once every request finished and none is to come: the
#: transfers still in flight are reported within the case's latencies (at most 9 steps drawn),
#: so a run still stepping this long after is an engine that never goes idle (INV-8; SimpleCPU's
#: lazy offload, 0.30.0+, met at the step cap of 20,000 before: seconds a case)
MAX_STEPS_AFTER_LAST: Final = 100


class TransferFailed(Exception):
    """A transfer job of the case's ``faults`` failed. The offloading worker collects the copy
    engine's results in ``OffloadingConnectorWorker.get_finished``, which asserts each one
    succeeded ("we currently do not support job failures", 0.25.1-0.33.0): the engine stops,
    and no release reports the failure to the scheduler (the connector implements no
    ``get_block_ids_with_load_errors``, the path ``kv_load_failure_policy`` acts on)."""

    def __init__(self, jid: int, kind: str):
        super().__init__(f"the offloading worker does not support failed transfers: {kind} job "
                         f"{jid} failed (OffloadingConnectorWorker.get_finished asserts "
                         f"transfer_result.success)")
        self.jid, self.kind = jid, kind


class RunEnded(Exception):
    """The run stops cleanly on a transfer job that never completes (``timing.jobs``, latency
    null): its step flushes the job, or nothing but such jobs and the requests they hold back
    is left. The release's engine would step on forever (``has_pending_push_work``) or wait
    forever in the worker's flush; the trace's last line says which."""


class Model:
    def __init__(self, case: Case, profile: Profile, checks: str = "full", trace: bool = True,
                 observed_walks: dict[int, list] | None = None):
        self.case, self.profile, self.checks = case, profile, checks
        layout, timing = case.layout, case.timing
        # A healthy run schedules at least one token a step once requests have arrived, so a
        # run four times longer than every token plus the last arrival is stuck (INV-8).
        work = sum(r.prompt_len + r.decode for r in case.requests)
        last = max((r.arrival for r in case.requests), default=0)
        self.max_steps = min(MAX_STEPS, 4 * (work + last) + 64)
        simple_cpu = layout.engine.connector.kind == "simple_cpu"
        # the connector's geometry: the SimpleCPUOffloadConnector moves one GPU block a transfer
        self.geo = geo = (block_geometry(layout, profile, case.asserts) if simple_cpu
                          else derive(layout, profile, asserts=case.asserts))
        check_kv_cache_coordinator(layout, profile, geo.scheduler_block_size, case.asserts)
        self.tpbs = {g.group_id: g.tokens_per_block for g in geo.groups}
        self.no_blocks_text = fmt_alloc("", [[] for _ in layout.groups])[len("alloc  "):]
        dcp = layout.engine.dcp_size
        sizes = [effective_block_size(g, dcp) for g in layout.groups]
        self.unit = math.gcd(geo.tokens_per_hash, *sizes)
        # VllmConfig.max_in_flight_tokens: max_num_batched_tokens per concurrent batch (two with
        # async scheduling)
        in_flight = timing.max_num_batched_tokens * (2 if layout.engine.async_scheduling else 1)
        # MambaManager.tail_recache (0.32.0+), asked of the profile only for a Mamba group
        tail_recache = any(g.kind == "mamba" for g in layout.groups) and bool(
            profile.extra.get("mamba_tail_recache"))
        # the retention interval: read by the sliding-window and Mamba managers' reachable-block
        # masks only (reachable_block_mask), so asked of the profile only for such a group
        retention = retention_interval(layout, profile) if any(
            g.kind in ("sliding_window", "sliding_window_mla", "mamba")
            for g in layout.groups) else None
        # MambaSpec.num_speculative_blocks; 0.25.1's remove_skipped_blocks lags by them, asked
        # of the profile only when there are such blocks
        spec_blocks = layout.num_speculative_blocks if any(
            g.kind == "mamba" for g in layout.groups) else 0
        skip_lags = spec_blocks > 0 and bool(profile.extra.get("mamba_skip_lags_spec_blocks"))
        self.kv = KVCacheManager(layout.groups, sizes, layout.engine.num_gpu_blocks,
                                 geo.scheduler_block_size, layout.engine.enable_prefix_caching,
                                 max_in_flight_tokens=in_flight,
                                 mamba_tail_recache=geo.tokens_per_hash if tail_recache else 0,
                                 retention_interval=retention,
                                 num_speculative_blocks=spec_blocks, mamba_skip_lags=skip_lags)
        # KVCacheManager.max_model_len: allocate_slots caps the slots it allocates there
        self.kv.max_model_len = max_model_len(case)
        self.kv.config.partial_hash_hits = partial_hash_hits(layout, profile, geo.tokens_per_hash)
        self.kv.config.tokens_per_hash = geo.tokens_per_hash
        # FullAttentionManager._cache_partial_tail_block (0.26.0+; its boundary below the whole
        # prompt from 0.32.0)
        self.kv.config.partial_tail = bool(profile.extra.get("fa_partial_tail", True))
        self.kv.config.partial_tail_below_prompt = bool(
            profile.extra.get("fa_partial_tail_below_prompt", False))
        self.off = OffloadingConnectorScheduler(geo, profile, case.asserts,
                                                layout.engine.cpu_chunks,
                                                layout.engine.enable_prefix_caching, layout,
                                                observed_walks)
        # the SimpleCPUOffloadConnector (engine.connector "simple_cpu"): its CPU tier is a
        # coordinator of the GPU pool's groups over cpu_chunks blocks (_derive_cpu_config),
        # built as the scheduler's (get_kv_cache_coordinator, use_eagle_block_drop): it reads
        # the GPU coordinator's configuration, but in lazy mode from 0.30.0 fine-grained hits
        # (allow_partial_hash_hits=not lazy_offload: lazy_without_partial_hash_hits, below)
        self.simple: SimpleCPUOffloadScheduler | None = None
        if simple_cpu:
            cpu_coordinator = KVCacheManager(layout.groups, sizes, layout.engine.cpu_chunks,
                                             geo.scheduler_block_size, True,
                                             retention_interval=retention, config=self.kv.config)
            # 0.25.1-0.29.0's manager (simple_cpu_scheduler_legacy), or 0.30.0's rewrite
            manager = (LegacySimpleCPUOffloadScheduler
                       if profile.extra.get("simple_cpu_legacy_manager", False)
                       else SimpleCPUOffloadScheduler)
            self.simple = manager(
                geo, self.kv, cpu_coordinator, [g.prefix_cacheable for g in layout.groups],
                bool(profile.extra.get("simple_cpu_prefix_cacheable_only", False)),
                layout.engine.connector.lazy_offload,
                timing.max_num_batched_tokens,
                bool(profile.extra.get("simple_cpu_reset_at_preemption", False)),
                bool(profile.extra.get("simple_cpu_chunked_local_guard", False)),
                bool(profile.extra.get("simple_cpu_eagle_cacheable_block", False)),
                case.asserts, layout.engine.dcp_size)
        # the connector the scheduler's hooks call, and its jobs
        self.conn: OffloadingConnectorScheduler | SimpleCPUOffloadScheduler = \
            self.simple or self.off
        self.jobs: dict[int, Job] = self.conn.jobs
        # a P/D decode instance (engine.connector "multi"): a MultiConnector of the offloading
        # connector above and NIXL, whose pulls land as the harness plays NIXL's worker
        self.nixl: NixlPullConnectorScheduler | None = None
        self.multi: MultiConnector | None = None
        if layout.engine.connector.kind == "multi":
            self.nixl = NixlPullConnectorScheduler.for_layout(
                layout, bool(profile.extra.get("nixl_awaiting_kvs", True)),
                bool(profile.extra.get("nixl_clips_ssm", True)))
            self.multi = MultiConnector(layout.engine.connector.order, self.off, self.nixl)
        # NIXL pulls in flight: request ID -> the blocks it writes (per group); block -> the
        # pull that has not landed in it (INV-6b)
        self.pulls: dict[str, list[list[int]]] = {}
        self.unlanded: dict[int, str] = {}
        self.shadow = Shadow(layout.engine.num_gpu_blocks, geo.blocks_per_chunk)
        # per group, what the shadow writes by: the block size, and whether it is a ring
        self.shadow_groups = [(m.block_size, isinstance(m, CircularBufferManager))
                              for m in self.kv.managers]
        # Scheduler.need_mamba_block_aligned_split (an align-mode Mamba group, so the engine's
        # cache_config.mamba_cache_mode is "align"): prefill chunks are cut at block boundaries
        # of cache_config.block_size, the first attention group's block size (_mamba_split)
        self.mamba_split_bs = 0
        if any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in layout.groups):
            self.mamba_split_bs = cache_block_size(layout)
        # the last block-aligned position whose state can be cached: floor(num_tokens) up to
        # 0.31.0, get_mamba_prefill_checkpoint_position (floor(num_tokens - 1)) from 0.32.0;
        # and up to 0.26.0 no sub-block prefill chunk for a block wider than the budget. The
        # profile is asked only where prefill chunks are cut so (an align-mode Mamba group)
        self.mamba_split_below = bool(self.mamba_split_bs) and bool(
            profile.extra.get("mamba_checkpoint_below", False))
        self.mamba_wide_block_skip = bool(self.mamba_split_bs) and bool(
            profile.extra.get("align_budget_assert", False))
        # Scheduler.mamba_partial_cache_hit (0.26.0+): a hash unit below the scheduler block and
        # fine-grained hash hits on: a prefill chunk also stops at the prompt's last hash
        # boundary, the only step end that registers its partial-tail Mamba state (_mamba_tail)
        self.mamba_tail_unit = geo.tokens_per_hash if (
            self.mamba_split_bs and self.kv.config.partial_hash_hits
            and geo.tokens_per_hash < geo.scheduler_block_size) else 0
        spec = layout.engine.speculative
        self.num_spec = spec.num_tokens if spec is not None else 0
        # VllmConfig.num_lookahead_tokens: EAGLE-style drafters write KV past the scheduled
        # tokens, allocate_slots reserves them
        self.lookahead = self.num_spec if spec is not None and spec.method in EAGLE_METHODS \
            else 0
        # Request.spec_token_ids: rid -> drafts proposed after the request's last step, verified
        # when it is scheduled next (Scheduler.update_draft_token_ids); per request the number of
        # verification steps so far (the index into its ``accept`` pattern)
        self.drafts: dict[str, int] = {}
        self.verified: dict[str, int] = {}
        # per step (schedule): scheduled_spec_decode_tokens (counts), and the requests whose
        # drafts are padding (-1) only
        self.sched_drafts: dict[str, int] = {}
        # Scheduler.schedule pads a new one-token decode from the waiting queue also when it
        # resumes after a prefix hit (num_computed_tokens > 0), not only beside running
        # requests (0.30.0+; 0.25.1-0.29.0: scheduled_running_reqs and not prefill_scheduled)
        # (asked of the profile only when the engine drafts)
        self.spec_pad_after_hit: bool = spec is not None and bool(
            profile.extra.get("spec_pad_after_hit", True))
        self.padded: set[str] = set()
        self.kv.config.eagle_drop = eagle = bool(self.lookahead)
        # what EAGLE's block drop changes, asked of the profile only under EAGLE-style drafting:
        # the sparse-retention masks' EAGLE boundaries (KVCacheManager._reachable_mask), the
        # coordinator's hit margin, and (0.30.0+) the Mamba tail boundary one hash unit lower
        self.kv.config.eagle_replay_pair = eagle and bool(
            profile.extra.get("eagle_replay_pair", True))
        self.kv.config.eagle_junction_below = eagle and bool(
            profile.extra.get("eagle_junction_below", False))
        self.kv.config.eagle_margin = (eagle and len(layout.groups) > 1
                                       and bool(profile.extra.get("eagle_hit_margin", False)))
        if (eagle and self.simple is not None and self.kv.config.drafter_specs is None
                and not profile.extra.get("simple_cpu_cpu_eagle", True)):
            # SimpleCPU's CPU coordinator is built with use_eagle=False before 0.27.0
            # (simple_kv_offload/manager.py 0.26.0:125): its EAGLE groups are the drafter groups
            # the KV cache config marks (is_eagle_group), and with none, no group rather than
            # every group (kv_cache_coordinator.py 0.26.0:98-104): its lookups drop no block
            self.simple.cpu_coordinator.use_config(self.kv.config.without_eagle())
        if (self.simple is not None and self.simple.lazy_mode and self.kv.config.partial_hash_hits
                and self.simple.lazy_without_partial_hash_hits):
            # 0.30.0+'s lazy CPU coordinator takes no fine-grained hits (mgr 0.30.0:200)
            cpu = self.simple.cpu_coordinator
            cpu.use_config(cpu.config.without_partial_hash_hits())
        self.mamba_tail_eagle_shift = eagle and bool(self.mamba_tail_unit) and bool(
            profile.extra.get("mamba_tail_eagle_shift", True))
        # ChunkedLocalAttentionManager.find_longest_cache_hit asserts drop_eagle_block is False
        # ("Hybrid KV cache is not supported for eagle + chunked local attention.", every
        # release): with EAGLE and no drafter group every group is an EAGLE group
        # (KVCacheCoordinator: eagle_group_ids), so a chunked local group fails the first lookup
        self.eagle_chunked_assert = bool(
            self.lookahead and case.asserts and self.kv.hits_possible
            and not any(g.drafter for g in layout.groups)
            and any(isinstance(m, ChunkedLocalAttentionManager) for m in self.kv.cacheable))
        # ... and that its block is the hit alignment (the scheduler block, or the hash unit with
        # partial hash hits: every release): a chunked local group of another block size beside
        # other groups fails the first lookup too
        align = self.kv.config.cache_hit_alignment_tokens
        self.chunked_size_assert = bool(
            case.asserts and self.kv.hits_possible
            and any(isinstance(m, ChunkedLocalAttentionManager) and m.block_size != align
                    for m in self.kv.cacheable))
        # 0.33.0: with speculative decoding, update_from_output caches the blocks of a running
        # request's computed tokens once its new tokens are appended (rejections rolled back)
        self.cache_on_output = bool(spec is not None
                                    and profile.extra.get("spec_cache_on_output", False))
        # (under async scheduling the drafts the scheduler sees are placeholders, set after each
        # step: AsyncRun.after_schedule; the worker verifies its own: _verify_in_flight)
        # Scheduler._spec_decode_step_blocks (0.31.0+): an async load is admitted only with the
        # blocks of one spec decode step free beyond the in-flight reservations, and each
        # in-flight reservation holds that step too (_request_remaining_blocks)
        self.spec_step_blocks = 0
        self.spec_step_slots = 0
        self.spec_step_by_block = False
        if spec is not None and profile.extra.get("kv_holding_waiting", False):
            self.spec_step_by_block = bool(
                profile.extra.get("spec_step_blocks_by_scheduler_block", False))
            self.spec_step_slots = slots = 1 + spec.num_tokens + self.lookahead
            if self.spec_step_by_block:                 # 0.31.0
                self.spec_step_blocks = -(-slots // geo.scheduler_block_size)
            else:                                       # per non-Mamba group
                self.spec_step_blocks = sum(-(-slots // bs) for g, bs in
                                            zip(layout.groups, sizes) if g.kind != "mamba")
        # Scheduler.schedule (0.31.0+): a request that skips reading the prefix cache loads
        # nothing, whatever the connector answered (up to 0.30.0 the OffloadingConnector itself
        # looks nothing up for it, and NIXL still pulls)
        self.skip_zeroes_hit = bool(profile.extra.get("skip_reading_zeroes_hit", False))
        self.timing = timing
        # async scheduling: the engine's batch queue of depth 2 (AsyncRun)
        self.async_ = AsyncRun(self) if layout.engine.async_scheduling else None
        if self.simple is not None and self.async_ is not None:
            self.simple.num_output_placeholders = self.async_.ph
        self.q = ev.EventQueue()
        self.q.handlers = {ev.STEP: self._step, ev.ARRIVAL: self._arrival,
                           ev.STORE_DONE: self.store_done, ev.LOAD_DONE: self.load_done,
                           ev.ABORT: self._abort, ev.FINISH: self.finish_request,
                           ev.PREEMPT: lambda data: None, ev.CASE_EVENT: self._case_event,
                           ev.TRANSFER_FAILED: self.transfer_failed, ev.RECV_DONE: self.recv_done}
        self.tracing = trace
        self.lines: list[str] = [header(profile.name, case.asserts)]
        self.reqs: dict[str, Request] = {}
        # the prompt-only requests of the case's prompts (see _prompt): a prompt -> its request;
        # a prompt's first segment (seed, length) -> the first prompt-only request made with it
        self.prompts: dict[tuple, Request] = {}
        self.segment_first: dict[tuple, Request] = {}
        # Scheduler.schedule drains a first waiting queue before ``waiting``: up to 0.30.0
        # ``skipped_waiting`` (every request skipped at an earlier step: a load in flight, no
        # lookup result), from 0.31.0 ``kv_holding_waiting`` (requests holding blocks: loading or
        # loaded; other skipped requests go back to the front of ``waiting``). ``self.waiting``
        # is the two queues in the order they are drained: the first ``n_held`` are the first.
        self.waiting: list[Request] = []
        self.n_held = 0
        self.kv_holding_first = profile.extra.get("kv_holding_waiting", False)
        self.running: list[Request] = []
        self.finished_ids: list[str] = []
        self.delayed_free: dict[str, Request] = {}   # finished, blocks held until a load ends
        self.loaded: set[str] = set()                # load done, not promoted yet
        # Scheduler._inflight_prefills: requests admitted with prefill left after their chunk, or
        # with an async load; their remaining blocks are reserved when a load is admitted
        self.inflight: dict[str, Request] = {}
        # INV-6 fences: store job ID -> the GPU blocks it has yet to read (jobs with blocks only)
        self.pending_reads = inv.ReadFences(layout.engine.num_gpu_blocks)
        self.counters = {"steps": 0, "stores": 0, "loads": 0, "preemptions": 0, "finished": 0,
                         "aborted": 0, "scheduled_tokens": 0, "cpu_evictions": 0}
        # the counters every step adds to; into ``counters`` when the run stops (run)
        self.steps = 0
        self.scheduled_tokens = 0
        self.n_stores = 0
        self.n_loads = 0
        self.loads_created = 0
        # job ID -> "store" or "load": the jobs the case's faults make fail; under async
        # scheduling, the one whose batch output reported it, until the step's check
        self.failing: dict[int, str] = {}
        self.failed_job: int | None = None
        # jobs that never complete (Timing.jobs, latency None): job ID -> is a store; the
        # requests whose last lookup deferred (kept only when the case has such jobs)
        self.hung: dict[int, bool] = {}
        self.hangs = timing.hangs
        self.deferred_lookups: set[str] = set()
        self.step_no = 0
        self.unfinished = len(case.requests)
        self.future_events = 0      # arrivals and aborts not yet processed
        self.stall = 0
        self.after_last = 0         # steps since every request finished
        self.progress = False
        self.step_scheduled = False
        for i, spec_ in enumerate(case.requests):
            if not spec_.withdrawn:     # aborted before it arrives: never sent (_abort counts it)
                self.q.schedule(spec_.arrival, ev.ARRIVAL, i)     # (the request's index)
                self.future_events += 1
            if spec_.abort_at is not None:
                self.q.schedule(spec_.abort_at, ev.ABORT, spec_.id)
                self.future_events += 1
        for event in case.events:     # after the arrivals and aborts of its time
            self.q.schedule(event.step, ev.CASE_EVENT, event, priority=ev.ABORT)
        sent = [r.arrival for r in case.requests if not r.withdrawn]
        if sent:
            self._schedule_step(min(sent))

    # --- helpers ------------------------------------------------------------------------------
    def _emit(self, line: str) -> None:
        if self.tracing:
            self.lines.append(line)

    def _violation(self, v: inv.InvariantViolation | None) -> None:
        if v is not None:
            raise v

    def _schedule_step(self, t: int) -> None:
        if not self.step_scheduled:
            self.step_scheduled = True
            self.q.schedule(t, ev.STEP)

    def release(self) -> None:
        """Break the model's reference cycles once its run is over (the event handlers are bound
        methods of the model; a request and its connector state point at each other), so that
        reference counting frees it at once: else all of it lives on until a full (oldest
        generation) cyclic collection, which then walks every object of it."""
        self.q.handlers = {}
        for req in self.reqs.values():
            req.off = None

    # --- event handlers -----------------------------------------------------------------------
    def _prompt(self, spec: RequestSpec) -> Request:
        """The prompt-only request of ``spec``'s prompt: its tokens and the identities (and,
        once asked, keys) of its whole units, which every request with that prompt takes as its
        own (``prefix_of``) instead of hashing them again. They are pure functions of the prompt
        and the hash unit, so it is made once per run, is never scheduled and never gets a
        token. Prompts that start with the same segment share its tokens (case.py):
        the identities and keys of its whole units are made once, by the first such prompt."""
        proto = self.prompts.get(spec.prompt)
        if proto is None:
            first = spec.prompt[0]
            prefix_of = self.segment_first.get(first)
            tokens = spec.prompt_tokens()
            proto = Request(spec.id, -1, None, tokens, len(tokens), self.unit,
                            len(self.case.layout.groups), prefix_of, first[1] // self.unit)
            if prefix_of is None:
                self.segment_first[first] = proto
            self.prompts[spec.prompt] = proto
        return proto

    def _arrival(self, i: int) -> None:
        spec = self.case.requests[i]
        self.future_events -= 1
        proto = self._prompt(spec)
        req = Request(spec.id, i, spec, proto.tokens, spec.prompt_len + spec.decode, self.unit,
                      len(self.case.layout.groups), proto, len(proto.ident))
        self.reqs[spec.id] = req
        (self.multi or self.conn).on_new_request(req)
        self.waiting.append(req)
        self._schedule_step(self.q.now)

    def _case_event(self, event) -> None:
        """A case event, while some request of the case is unfinished: the engine core's
        ``reset_prefix_cache`` call, ``Scheduler.reset_prefix_cache()`` with its defaults (the
        GPU prefix cache only; refused while a block is in use)."""
        if self.unfinished <= 0:
            return
        done = self.kv.pool.reset_prefix_cache()
        self._emit(f"reset_prefix_cache {'ok' if done else 'refused'}")

    def _abort(self, rid: str) -> None:
        self.future_events -= 1
        req = self.reqs.get(rid)
        if req is None or req.finished:
            if req is None:        # aborted before arrival: it never runs
                self.unfinished -= 1
                self.counters["aborted"] += 1
            return
        if self.async_ is not None:
            self._schedule_step(self.q.now)     # the engine steps: a finished request to report
        loading = req.status == WAITING_FOR_LOAD and req.rid not in self.loaded
        # num_computed_tokens of a request admitted for a load is its hit length
        computed = req.load_target if req.status == WAITING_FOR_LOAD else None
        self.loaded.discard(rid)
        req.status = ABORTED
        self._free_request(req, "aborted", delay_free=loading, computed=computed)

    def finish_request(self, req: Request) -> None:
        req.status = FINISHED
        self._free_request(req, "finished")
        if self.unfinished == 0:
            # the step whose output finished the last request counts as the first after it
            # (the release checks after update_from_output; the model's check came before)
            self.after_last = 1

    def _free_request(self, req: Request, how: str, delay_free: bool = False,
                      computed: int | None = None) -> None:
        if req in self.running:             # (in one of the two queues at most)
            self.running.remove(req)
        elif req in self.waiting:
            if self.waiting.index(req) < self.n_held:
                self.n_held -= 1
            self.waiting.remove(req)
        self.inflight.pop(req.rid, None)
        # Scheduler._connector_finished: blocks out of a window are freed
        # (remove_skipped_blocks on the processed tokens) before the connector sees the table
        if computed is None:
            computed = req.num_computed
            if self.async_ is not None:
                computed = self.async_.processed(req)
        self.kv.remove_skipped_blocks(req, computed)
        (self.multi or self.conn).request_finished(req)
        if delay_free:
            # Scheduler.finish_requests: a request aborted in WAITING_FOR_REMOTE_KVS keeps its
            # blocks (delay_free_blocks) until its load reports finished_recving;
            # _update_from_kv_xfer_finished frees them then (load_done)
            self.delayed_free[req.rid] = req
        else:
            self._free_request_blocks(req)
        self.finished_ids.append(req.rid)
        self.unfinished -= 1
        self.counters["finished" if how == "finished" else "aborted"] += 1
        self.progress = True
        self._emit(f"finish {req.rid} {how}")

    def _free_request_blocks(self, req: Request) -> None:
        """``Scheduler._free_request_blocks``: a request scheduled in a batch still in flight
        (async scheduling) has its blocks returned to the pool once that batch's output is
        processed (``deferred_frees``), else at once."""
        if self.async_ is not None and not self.async_.can_free(req):
            self.async_.defer_free(req)
        else:
            self.kv.free(req)

    def _read_store(self, job: Job) -> None:
        """The worker reads a store's source blocks (at flush or completion): each chunk's
        content, which must hold the tokens its key names (INV-4)."""
        if job.read:
            return
        job.read = True
        req = self.reqs[job.rid]
        self.pending_reads.pop(job.jid, None)
        job.contents = []
        for x in range(len(job.ckeys)):
            content = self.shadow.read_chunk(job.bids, job.bpos[x], job.bpos[x + 1])
            job.contents.append(content)
            if self.simple is not None and self.simple.partial_tail(job.gids[x], job.hidx[x]):
                continue        # (see SimpleCPUOffloadScheduler.partial_tail)
            v = inv.check_stored_chunk(self.step_no, job, job.chunk(x), content, req, self.geo,
                                       self.tpbs)
            if v is not None:
                raise v

    def store_done(self, jid: int) -> None:
        job = self.jobs.get(jid)
        if job is None:
            return              # flushed and completed earlier
        self._read_store(job)
        self.conn.complete_job(jid)
        if self.tracing:
            self.lines.append(f"done {jid} store")
        self.progress = True

    def completion(self, t: int, jid: int, event: int) -> None:
        """The worker reports job ``jid``, due at ``t``, with the output of the step before ``t``
        (of this step, for a job due now): ``event`` (``STORE_DONE``, ``LOAD_DONE``) in job
        order among the report's (``events.REPORTED``), or, for a job the case's faults name,
        its failure, before them."""
        report = max(t - 1, self.q.now)
        if jid in self.failing:
            self.q.schedule(report, ev.TRANSFER_FAILED, jid, priority=ev.REPORTED - 1)
        else:
            self.q.schedule(report, event, jid, priority=ev.REPORTED + jid)

    def transfer_failed(self, jid: int) -> None:
        """The worker learns of a failed job when it would have completed, and raises in
        ``get_finished`` before it reports any other job of the step: the run stops."""
        kind = self.failing[jid]
        self._emit(f"failed {jid} {kind}")
        raise TransferFailed(jid, kind)

    def transfers_done(self, jids: list[int]) -> bool:
        """The jobs a batch's output reports done, in order (async scheduling: ``AsyncRun``).
        If one of them is a failing job of the case's faults, the worker raised before it
        reported any: none completes, the step ends with its check and then the run stops
        (``after_step``), and the answer is False."""
        failing = [jid for jid in jids if jid in self.failing]
        if failing:
            self.failed_job = failing[0]
            return False
        jobs = self.jobs
        for jid in jids:
            job = jobs.get(jid)
            if job is None:
                continue
            if job.is_store:
                self.store_done(jid)
            else:
                self.load_done(jid)
        return True

    def load_done(self, jid: int) -> None:
        job = self.jobs[jid]
        req = self.reqs[job.rid]
        chunks = job.cpu_chunks if job.cpu_chunks is not None else \
            self.off.tier.chunks_of(job.ckeys)
        shadow = self.shadow
        sgids, sends, sidents = shadow.gids, shadow.ends, shadow.idents
        bidx, bids = job.bidx, job.bids
        bpos: list[int] = job.bpos
        hi = bpos[0]               # (chunk x's blocks start where chunk x - 1's end)
        for chunk, nxt in zip(chunks, bpos[1:]):
            lo, hi = hi, nxt
            c: tuple | None = chunk.content
            if hi - lo == 1 and c is not None and len(c) == 3:
                # a one-block chunk into one block: the block takes the chunk's only block,
                # whole chunk or not
                b = bids[lo]
                sgids[b] = c[0]
                sends[b] = c[1]
                sidents[b] = c[2]
            else:
                shadow.write_chunk(bidx, bids, lo, hi, c)
        written = job.bids          # every destination block, in order
        self._violation(self.pending_reads.check(self.step_no, written, "load", str(jid)))
        self.conn.complete_job(jid)
        self._emit(f"done {jid} load")
        self.progress = True
        if req.finished:
            # aborted while loading: the blocks were held until now (_free_request)
            self.kv.free(self.delayed_free.pop(req.rid))
            return
        self._violation(inv.check_loaded(self.step_no, job, req, self.shadow, self.geo,
                                         self.tpbs))
        # finished_recving_kv_req_ids: the request stays WAITING_FOR_REMOTE_KVS until the waiting
        # loop reaches it (_promote_loaded)
        self.loaded.add(req.rid)
        self._schedule_step(self.q.now)

    def _start_load(self, t: int, job: Job) -> None:
        """The worker starts load job ``job`` at ``t``; it completes ``load_latency`` later (the
        case's timing and faults count loads in the order they start)."""
        self._emit(fmt_job(job))
        load_lat = self.timing.latency("load", self.loads_created)
        if self.case.fault("load", self.loads_created) is not None:
            self.failing[job.jid] = "load"
        self.loads_created += 1
        if load_lat is None:
            self.hung[job.jid] = False      # the worker never reports it
        elif self.async_ is None:
            self.completion(t + load_lat, job.jid, ev.LOAD_DONE)
        else:
            self.async_.due[job.jid] = t + load_lat

    def _start_pulls(self, t: int) -> None:
        """NIXL's ``reqs_to_recv`` of the step: the worker starts each pull it reports (blocks
        to write, or a request parked for it), which lands ``remote_prefill`` steps later
        (``recv_done``); a pull of neither only notifies the prefill instance."""
        assert self.nixl is not None
        for recv in self.nixl.build_connector_meta():
            if not recv.reported:
                continue
            who = f"NIXL recv of {recv.rid}"
            self.pulls[recv.rid] = recv.blocks
            for group in recv.blocks:
                for b in group:
                    self.unlanded[b] = who
            self._emit(fmt_recv(recv.rid, recv.blocks))
            due = t + (self.reqs[recv.rid].spec.remote_prefill or 1)
            if self.async_ is None:
                self.q.schedule(due, ev.RECV_DONE, recv.rid, priority=ev.LOAD_DONE)
            else:
                self.async_.pulls_due[recv.rid] = due

    def recv_done(self, rid: str) -> None:
        """NIXL's worker reports the pull of ``rid`` landed (``finished_recving``)."""
        self._emit(f"landed {rid}")
        self.land(rid)
        self.pull_reported(rid)

    def land(self, rid: str) -> None:
        """The pull of ``rid`` landed: the KV the prefill instance computed for the prompt is
        in the pulled blocks, which no pending store may still have to read (INV-6)."""
        blocks = self.pulls.pop(rid)
        req = self.reqs[rid]
        written = self.shadow.write_landed(req, req.num_prompt, req.tables, self.shadow_groups,
                                           blocks)
        for b in written:
            self.unlanded.pop(b, None)
        self._violation(self.pending_reads.check(self.step_no, written, "NIXL recv of", rid))

    def pull_reported(self, rid: str) -> None:
        """``finished_recving`` names ``rid``: like a load's completion, the request stays
        WAITING_FOR_REMOTE_KVS until the waiting loop reaches it (``_promote_loaded``)."""
        req = self.reqs[rid]
        self.progress = True
        if req.finished:
            # aborted while parked: the blocks were held until now (_free_request)
            self.kv.free(self.delayed_free.pop(rid))
            return
        self.loaded.add(rid)
        self._schedule_step(self.q.now)

    def _check_forward_landed(self, step: int, sched_reqs: list[Scheduled]) -> None:
        """INV-6b: no scheduled request attends to a block a NIXL pull has not landed in."""
        for item in sched_reqs:
            req = item if isinstance(item, Request) else item[0]
            blocks = [b for table in req.tables for b in table]
            self._violation(inv.check_unlanded(step, blocks, self.unlanded,
                                               f"the forward of {req.rid}"))

    def _promote_loaded(self, req: Request) -> None:
        """``_update_waiting_for_remote_kv`` (from _try_promote_blocked_waiting_request /
        _handle_blocked_waiting_request, when the waiting loop reaches the request): only now are
        the loaded blocks cached; on a full prompt hit the last token is recomputed (to sample
        the next one)."""
        self.loaded.discard(req.rid)
        req.num_computed = req.load_target
        self.kv.cache_blocks(req, req.num_computed)
        if req.num_computed == req.num_tokens:
            req.num_computed -= 1
        req.status = WAITING

    # --- the scheduler step -------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.drafts.pop(req.rid, None)         # _preempt_request: spec_token_ids cleared
        self._free_request_blocks(req)
        req.num_computed = 0
        req.status = WAITING
        self.waiting.insert(self.n_held, req)     # prepend_request: the front of ``waiting``
        self.inflight.pop(req.rid, None)
        self.counters["preemptions"] += 1
        self._emit(f"preempt {req.rid}")

    def connector_quiet(self) -> bool:
        """No transfer in flight: no offloading job, no NIXL pull."""
        return self.conn.quiet() and not self.pulls

    def has_requests(self) -> bool:
        """``Scheduler.has_requests``: requests to schedule, or finished ones not yet reported to
        the workers."""
        return bool(self.running or self.waiting or self.finished_ids)

    def _step(self, _data) -> None:
        self.step_scheduled = False
        self._end_idle()
        if self.async_ is not None:
            # EngineCore.step_with_batch_queue; a load completing in it asks for no step at t
            self.step_scheduled = True
            self.async_.call(self.q.now)
            self.step_scheduled = False
            self.after_step(self.step_no)
            return
        if not self.has_requests() and self.connector_quiet():
            # EngineCore idles (has_work): no request, and the transfers that completed before
            # this step released the last finished one; the next arrival wakes it
            return
        t = self.q.now
        sched_reqs, stores = self.schedule(t)
        self.execute_model(t, self.step_no, sched_reqs, stores)
        self.after_step(self.step_no)

    def schedule(self, t: int) -> tuple[list[Scheduled], list[Job]]:
        """``Scheduler.schedule()`` with ``build_connector_meta``: the scheduled requests as
        ``(request, tokens, new blocks)`` (a quiet decode: the request alone) and the store jobs
        created."""
        self.step_no = step = self.steps
        self.steps = step + 1
        if step >= self.max_steps:
            raise inv.InvariantViolation("INV-8", step, f"{self.unfinished} requests unfinished "
                                         f"after {self.max_steps} steps")
        tracing = self.tracing
        lines = self.lines
        if tracing:
            lines.append(f"step {step}")
        tiering = self.off.tiering
        if tiering is not None:
            # the harness runs the fs tiers' probes and I/O before schedule()
            tier_lines = tiering.before_schedule(step)
            if tracing:
                lines += tier_lines
        step_start = len(lines)
        kv, conn = self.kv, self.conn
        kv.new_step()
        budget = self.timing.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list] = {}
        # (request, tokens, new blocks) in scheduling order; a quiet decode as the request alone
        sched_reqs: list[Scheduled] = []
        if self.num_spec:       # (without drafts they stay empty: not made anew)
            self.sched_drafts = {}
            self.padded = set()
        self.prefill_scheduled = False
        preempted: list[str] = []
        running = self.running
        k = self.num_spec
        asy = self.async_
        # (the SimpleCPUOffloadConnector reads every scheduled request's blocks: no quiet step)
        fast = not k and asy is None and self.simple is None
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed
            if (fast and c <= req.fast_until and c <= req.quiet_until
                    and len(req.tokens) == c + 1):
                # a quiet decode step (see _fast_bound): allocate, build_connector_meta and the
                # store jobs would all be no-ops for it
                sched_reqs.append(req)
                budget -= 1
                i += 1
                continue
            c = req.num_computed
            n = len(req.tokens) - c
            if k:
                n += self.drafts.get(req.rid, 0)      # num_tokens_with_spec
            ph = 0
            if asy is not None:
                ph = asy.ph.get(req.rid, 0)
                if ph and c + 2 - ph >= req.max_tokens:
                    # its last token is in flight: no step beyond max_tokens
                    i += 1
                    continue
                n += ph
            if n > budget:
                n = budget
            if asy is not None and k:
                # the input position stays below max_model_len (every release; binds only where
                # num_computed_tokens counts drafts in flight)
                n = min(n, kv.max_model_len - c - 1)
            if self.mamba_split_bs and n > 0:
                n = self._mamba_split(req, n, c)
            if n <= 0:
                i += 1
                continue
            upto = c + n
            processed = None
            if asy is not None or k:
                # allocate_slots caches finalized tokens only (not drafts, nor tokens in flight)
                upto = min(upto, len(req.tokens))
            if asy is not None:
                processed = asy.processed(req)
            while True:
                nb = kv.allocate_slots(req, n, cache_upto=upto, processed=processed,
                                 lookahead=self.lookahead)
                if nb is not None:
                    break
                if (asy is not None and not asy.preempt_in_flight
                        and not asy.can_free(running[-1])):
                    break       # _request_blocks_can_be_freed: its batch is still in flight
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.rid)
                if victim is req:
                    break
            if nb is None:
                break
            scheduled[req.rid] = n
            new_blocks[req.rid] = nb
            sched_reqs.append((req, n, nb))
            budget -= n
            i += 1
            if k:
                # prefill_scheduled: a running request in a prefill chunk (is_prefill_chunk)
                self.prefill_scheduled = self.prefill_scheduled or req.rid in self.inflight
                # scheduled_spec_decode_tokens (cut to the tokens scheduled); the request's
                # spec_token_ids are cleared until the worker proposes new ones
                d = self.drafts.pop(req.rid, 0)
                if d and c + n > len(req.tokens) + ph:
                    self.sched_drafts[req.rid] = min(d, c + n - len(req.tokens) - ph)
        if not preempted:
            budget = self._schedule_waiting(scheduled, new_blocks, budget, sched_reqs)
        # (every token of sched_reqs came out of the budget)
        self.scheduled_tokens += self.timing.max_num_batched_tokens - budget
        if tracing:
            empty = self.no_blocks_text       # fmt_alloc of no new block in any group
            for item in sched_reqs:
                if isinstance(item, Request):       # a quiet decode
                    rid = item.rid
                    lines.append(f"sched {rid} 1")
                    lines.append(f"alloc {rid} {empty}")
                else:
                    req, n, nb = item
                    lines.append(f"sched {req.rid} {n}")
                    lines.append(fmt_alloc(req.rid, nb))
        # build_connector_meta
        finished, self.finished_ids = self.finished_ids, []
        # (typed: unpacked and walked as native lists, not through iterators)
        try:
            meta: tuple[list[Job], list[Job], set[int]] = conn.build_connector_meta(
                scheduled, new_blocks, preempted, finished, kv.take_offers())
        except ModelCrash:
            if self.simple is not None:
                # raised inside Scheduler.schedule(): no scheduler output left it, and the
                # release's trace shows none of the step (the OffloadingConnector's store-job
                # crash follows the step's scheduling there, golden corpus gen149)
                del lines[step_start:]
            raise
        stores, loads, flush = meta
        if self.simple is not None:
            # the SimpleCPUOffloadConnector issues its recorded loads with the step's event
            for job in loads:
                self._start_load(t, job)
        if self.nixl is not None:
            self._start_pulls(t)
        if stores:
            geo = self.geo
            for n, job in enumerate(stores, self.n_stores):
                if tracing:
                    lines.append(fmt_job(job))
                self._violation(inv.check_store_job(
                    step, job if self.simple is None else self.simple.whole_blocks(job), geo))
                if self.unlanded:
                    self._violation(inv.check_unlanded(step, job.bids, self.unlanded,
                                                       f"store {job.jid} of {job.rid}"))
                if self.case.fault("store", n) is not None:
                    self.failing[job.jid] = "store"
                store_lat = self.timing.latency("store", n)
                if store_lat is None:
                    self.hung[job.jid] = True       # the worker never reports it
                elif asy is None:
                    self.completion(t + store_lat, job.jid, ev.STORE_DONE)
                else:
                    asy.due[job.jid] = t + store_lat
            self.n_stores += len(stores)
        self.n_loads += len(loads)
        if flush:
            self._emit("flush " + ",".join(map(str, sorted(flush))))
            if self.hung:
                for jid in sorted(flush):
                    if jid in self.hung and jid in conn.jobs:
                        # the worker waits for the flushed jobs before the step runs
                        # (handle_preemptions: worker.wait(jobs_to_flush)): forever on this one
                        self._emit(fmt_hung_flush(jid, self.hung[jid]))
                        raise RunEnded()
            for jid in sorted(flush):
                fj = conn.jobs.get(jid)
                if fj is not None and fj.is_store:
                    self._read_store(fj)
                    if asy is None:
                        self.completion(t, jid, ev.STORE_DONE)
                    else:
                        asy.due[jid] = t
        if asy is not None:
            asy.after_schedule(sched_reqs)
        return sched_reqs, stores

    def _write_computed(self, step: int, req: Request, start: int, end: int,
                        seen: Prefixes | None = None) -> None:
        """The forward pass wrote tokens ``[start, end)`` of ``req`` into its blocks: the shadow
        records them, and INV-6 checks that no pending store job still reads one of them.
        ``seen``: the request as the worker sees it, if it knows more tokens than ``req``."""
        fences = self.pending_reads
        prefixes = req if seen is None else seen
        if fences.jobs:
            # (the first written block a pending store reads, if any)
            written = self.shadow.write_computed(prefixes, self.shadow_groups, start, end, True,
                                                 fences.count)
            if written:
                self._violation(fences.check(step, written, "request", req.rid))
        else:
            self.shadow.write_computed(prefixes, self.shadow_groups, start, end, False)

    def execute_model(self, t: int, step: int, sched_reqs: list[Scheduled],
                      stores: list[Job]) -> None:
        """The model runner: computed tokens written (the shadow), one token sampled per
        request whose prefill is complete; finished requests leave (``FINISH``)."""
        kv, shadow, fences = self.kv, self.shadow, self.pending_reads
        if self.unlanded:
            self._check_forward_landed(step, sched_reqs)
        gids, ends, idents = shadow.gids, shadow.ends, shadow.idents
        unit = self.unit
        seed = self.case.seed % VOCAB      # (see sampled_token)
        inflight = self.inflight
        asy = self.async_
        fast = not self.num_spec and asy is None and self.simple is None
        for item in sched_reqs:
            if isinstance(item, Request):
                # a quiet decode (see _fast_bound): one token that completes no block, written
                # into the blocks _fast_bound found
                req = item
                end = req.num_computed + 1
                for gid, b in req.fast_blocks:
                    gids[b], ends[b], idents[b] = gid, end, None
                if fences.jobs:
                    written = [b for _, b in req.fast_blocks]
                    self._violation(fences.check(step, written, "request", req.rid))
                req.num_computed = end
                if inflight and req.rid in inflight:
                    del inflight[req.rid]   # _update_after_schedule: no longer a prefill chunk
                tokens = req.tokens
                tokens.append(sampled_token(seed, req.index, end))     # never the last one
                if len(tokens) % unit == 0:
                    req._extend_ident()
                continue
            req, n, _ = item
            start = req.num_computed
            end = start + n
            d = self.sched_drafts.get(req.rid, 0) if self.num_spec else 0
            if d:
                # verification (update_from_output): the accepted drafts are the request's next
                # tokens; a rejected draft's slot holds KV of no token and num_computed_tokens
                # rolls back over it; the worker samples one token after the accepted drafts
                if req.rid in self.padded or (asy is not None and req.rid not in asy.proposed):
                    a = 0
                else:
                    k = self.verified.get(req.rid, 0)
                    self.verified[req.rid] = k + 1
                    a = req.spec.accepted(k, d)
                if asy is not None:
                    self._verify_in_flight(step, req, start, end, d, a)
                    continue
                base = len(req.tokens)
                acc = [sampled_token(seed, req.index, p) for p in range(base, base + a)]
                req.append_tokens(acc[:max(0, req.max_tokens - base)])
                self._write_computed(step, req, start, end)
                req.num_computed = end - (d - a)
                if inflight:
                    inflight.pop(req.rid, None)
                if len(req.tokens) < req.max_tokens:
                    req.append_tokens([sampled_token(seed, req.index, base + a)])
                elif self.cache_on_output:
                    # 0.33.0 _update_request_with_output: the tokens trimmed at a stop leave
                    # num_computed_tokens too
                    req.num_computed -= base + a + 1 - req.max_tokens
                if self.cache_on_output:
                    kv.cache_blocks(req, req.num_computed)
                if len(req.tokens) >= req.max_tokens:
                    req.finish_step = step
                    self.q.schedule(t, ev.FINISH, req)
                else:
                    self.drafts[req.rid] = self.num_spec
                continue
            self._write_computed(step, req, start, end)
            req.num_computed = end
            if end >= len(req.tokens):
                if inflight and req.rid in inflight:
                    del inflight[req.rid]   # _update_after_schedule: no longer a prefill chunk
                tok = sampled_token(seed, req.index, len(req.tokens))
                if asy is not None:
                    assert asy.batch is not None            # (after_schedule made it)
                    asy.batch.tokens.append((req, [tok]))   # delivered with the batch's output
                    continue
                req.append_tokens([tok])
                if self.cache_on_output:
                    kv.cache_blocks(req, req.num_computed)
                if len(req.tokens) >= req.max_tokens:
                    req.finish_step = step
                    self.q.schedule(t, ev.FINISH, req)
                elif self.num_spec:
                    # the drafter proposes after a step that sampled (not a prefill chunk)
                    self.drafts[req.rid] = self.num_spec
            if fast:
                self._fast_bound(req)
        # stores of this step read what the forward pass wrote: fence them from now on
        for job in stores:
            if not job.read and job.bids:
                # the job's source blocks (each also a connector fence: job.fenced, or deferred)
                fences.add(job.jid, job.bids)
        self.progress = self.progress or bool(sched_reqs)

    def _verify_in_flight(self, step: int, req: Request, start: int, end: int, d: int,
                          a: int) -> None:
        """A step with drafts under async scheduling: the worker verifies its own drafts (the
        scheduler sent placeholders) and writes the KV of the accepted ones; the scheduler
        learns the accepted tokens and rolls back over the rejected ones with the step's output
        (``AsyncRun._apply``). ``start`` is already the worker's count: the rejections of the
        previous step were applied before this step executes, as the worker corrects its own
        count by them (``gpu_model_runner``: ``prev_num_draft_len``)."""
        assert self.async_ is not None and self.async_.batch is not None
        seed = self.case.seed % VOCAB
        base = len(req.tokens)
        tokens = [sampled_token(seed, req.index, p) for p in range(base, base + a + 1)]
        accepted = tokens[:min(a, max(0, req.max_tokens - base))]
        self._write_computed(step, req, start, end,
                             req.worker_view(accepted) if accepted else None)
        req.num_computed = end
        self.inflight.pop(req.rid, None)
        self.async_.batch.tokens.append((req, tokens))
        self.async_.batch.rejected[req.rid] = d - a

    def _mamba_split(self, req: Request, n: int, start: int) -> int:
        """``Scheduler._mamba_block_aligned_split`` (no prefill checkpoint blocks,
        long_prefill_token_threshold 0): a prefill chunk of ``n`` tokens from ``start`` ends on
        a block boundary unless it ends the prefill, stops at the next boundary when it starts
        inside a block, at the last cacheable boundary, at the prompt's last hash boundary
        under fine-grained hits (:meth:`_mamba_tail`) and at the block-floored shared-prefix
        junction."""
        prefill_end = max(req.num_prompt, req.num_tokens - 1)
        if start >= prefill_end:
            return n
        bs = self.mamba_split_bs
        nt = req.num_tokens
        if self.kv.config.eagle_drop:
            # "With Eagle, FullAttn prunes the last matching block, so back off one block to
            # avoid a Mamba cache miss" (get_mamba_prefill_checkpoint_position, 0.32.0+; inline
            # before): the block before the last whole one
            last = max(nt // bs * bs - bs, 0)
        else:
            last = ((nt - 1) if self.mamba_split_below else nt) // bs * bs
        end = start + n
        # chunk ends are block-aligned until the prefill's end (0.27.0+), up to 0.26.0 until the
        # last cacheable position only ("if end < last_cache_position")
        if end < (last if self.mamba_wide_block_skip else prefill_end):
            aligned = end // bs * bs
            # 0.27.0+: a block wider than the budget is advanced sub-block; up to 0.26.0 (where
            # only python -O lets such an engine start, see validate_block_size) the chunk is
            # empty and the request is skipped
            if (aligned > start or bs <= self.timing.max_num_batched_tokens
                    or self.mamba_wide_block_skip):
                end = aligned
        stops = [last]
        if start % bs:
            stops.append((start // bs + 1) * bs)
        if self.mamba_tail_unit:
            tail = self._mamba_tail(req.num_prompt)
            if last < tail < req.num_prompt:
                stops.append(tail)
        junction = req.shared_prefix_boundary
        if start < junction < end:
            stops.append(start + (junction - start) // bs * bs)
        inside = [x for x in stops if start < x < end]
        if inside:
            end = min(inside)
        return max(end - start, 0)

    def _mamba_tail(self, num_prompt: int) -> int:
        """``tail_boundary`` of ``_mamba_block_aligned_split``: the prompt's last hash boundary,
        floored to the hash unit up to 0.31.0 (one unit lower under EAGLE's block drop from
        0.30.0), ``get_mamba_prefill_checkpoint_position`` from 0.32.0 (which leaves the last
        prompt token to recompute: a prompt of whole hash units stops one unit short)."""
        h = self.mamba_tail_unit
        eagle = self.kv.config.eagle_drop
        if self.mamba_split_below:
            tail = (num_prompt if eagle else num_prompt - 1) // h * h - (h if eagle else 0)
        else:
            tail = num_prompt // h * h - (h if eagle and self.mamba_tail_eagle_shift else 0)
        return max(tail, 0)

    def _fast_bound(self, req: Request) -> None:
        """After a full step of a running request: up to which ``num_computed`` its next decode
        steps are quiet, and the (group, block) pairs such a step writes.

        A decode step (one token, ``num_tokens == num_computed + 1``) with ``num_computed = c`` is
        quiet when ``allocate_slots`` is a no-op (``c <= req.quiet_until``, checked at the step)
        and:
        ``build_connector_meta`` adds no offload key (``c + 1 < next_key_at``); no group can store
        a chunk (``_store_job``'s quick exit: the offloadable tokens ``min(c + 1, cap)``,
        ``cap`` from ``max_offload_tokens`` and ``offload_prompt_only``, stay below ``store_at``,
        the first chunk end past what some group stored); the request does not finish
        (``c + 2 < max_tokens``); and the token completes no block (so each group's write is
        ``(gid, c + 1, None)`` into the same block). Those quantities only grow outside a full
        step (``next_stored`` too), so the bound stays safe until the next full step recomputes
        it; a preemption resets ``quiet_until``."""
        c = req.num_computed
        st = self.off.req_status.get(req.rid)
        bound = -1
        if len(req.tokens) == c + 1 and st is not None and req.off is st:
            bound = min(req.max_tokens - 3, st.next_key_at - 2)
            cfgs = self.off.cfgs
            # the first chunk end past what some group stored; -1: no store to bound it (no
            # group offloaded), or a group whose tokens_per_chunk <= 0 (then bound -1)
            store_at = -1
            gstates = st.groups                         # (a state per group of cfgs)
            for x in range(min(len(cfgs), len(gstates))):
                cfg, gs = cfgs[x], gstates[x]
                tpc = cfg.tokens_per_chunk
                if tpc <= 0:
                    bound = store_at = -1
                    break
                ns = gs.next_stored
                e = (ns + 1) * tpc
                if store_at < 0 or e < store_at:
                    store_at = e
            if store_at >= 0:
                # the cap of OffloadingConnectorScheduler._offloadable, if any (``capped``)
                mo: int | None = st.max_offload_tokens
                capped = mo is not None
                cap = mo if mo is not None else 0
                if self.off.prompt_only and (not capped or req.num_prompt < cap):
                    capped, cap = True, req.num_prompt
                if not capped or cap >= store_at:
                    bound = min(bound, store_at - 2)        # c + 1 < store_at
            # (group id, block) of the blocks such a step writes
            blocks: list[tuple[int, int]] = []
            for m in self.kv.managers:
                gid = m.gid
                table = req.tables[gid]
                if not table:
                    continue
                if isinstance(m, CircularBufferManager):
                    blocks.append((gid, table[0]))
                    continue
                bs = m.block_size
                i = c // bs
                b = (i + 1) * bs - 2
                if b < bound:
                    bound = b
                if i < len(table) and table[i] != NULL:
                    blocks.append((gid, table[i]))
            req.fast_blocks = blocks
        req.fast_until = bound

    def _schedule_waiting(self, scheduled: dict[str, int], new_blocks: dict[str, list],
                          budget: int, sched_reqs: list[Scheduled]) -> int:
        """The waiting loop of ``Scheduler.schedule()``: returns the budget left."""
        kv, off, multi, t = self.kv, self.off, self.multi, self.q.now
        conn = self.conn
        max_seqs = self.timing.max_num_seqs
        waiting, running = self.waiting, self.running
        pool, inflight = kv.pool, self.inflight
        # scheduled_running_reqs: the running loop's requests only (those of this loop, prefills
        # from the waiting queue, do not make a later one a padded spec decode)
        running_scheduled = len(sched_reqs) > 0
        i = 0
        while i < len(waiting) and budget > 0 and len(running) < max_seqs:
            req = waiting[i]
            if req.status == WAITING_FOR_LOAD:
                if req.rid not in self.loaded:
                    i += 1
                    continue
                self._promote_loaded(req)
            ext = 0             # the tokens to load: the connector's hit, once known
            fresh = req.num_computed == 0
            if fresh:
                if self.eagle_chunked_assert:
                    raise ModelCrash("AssertionError", "find_longest_cache_hit", "lookup",
                                     "Hybrid KV cache is not supported for eagle + chunked "
                                     "local attention.", SINGLE_TYPE_MANAGER_PY)
                if self.chunked_size_assert and not req.skip_reading_prefix_cache:
                    raise ModelCrash("AssertionError", "find_longest_cache_hit", "lookup",
                                     "KV cache groups with different block sizes are not "
                                     "compatible with chunked local attention now",
                                     SINGLE_TYPE_MANAGER_PY)
                L = kv.get_computed_blocks(req)
                # Request.shared_prefix_boundary (_get_local_prefix_cache_hit), a reachable
                # boundary of the sparse-retention masks (GPU caching, sliding-window stores)
                req.shared_prefix_boundary = kv.junction
                hit = (multi or conn).get_num_new_matched_tokens(req, L)
                if self.skip_zeroes_hit and req.skip_reading_prefix_cache:
                    hit = 0     # 0.31.0+: every connector's answer is set aside
                if self.checks == "full" and self.simple is None:
                    # (the hit oracle judges the offloading connector's own lookup)
                    self._violation(inv.check_hit(self.step_no, off, off.req_status[req.rid],
                                                  hit if multi is None else multi.offloading_hit))
                if self.hangs:
                    if hit is None:
                        self.deferred_lookups.add(req.rid)
                    else:
                        self.deferred_lookups.discard(req.rid)
                if hit is None:
                    i += 1
                    continue
                ext = hit
                # allocate_slots(full_sequence_must_fit=scheduler_reserve_full_isl, True in every
                # release): blocks for the whole sequence must be free before the hit is taken;
                # then the chunk's blocks, for a load beyond the blocks reserved for the in-flight
                # prefills (Scheduler._inflight_prefill_reserved_blocks)
                total, n = L + ext, (0 if ext else min(req.num_tokens - L, budget))
                if n and self.mamba_split_bs:
                    n = self._mamba_split(req, n, L)
                    if n == 0:
                        break
                reserved = 0
                if ext:
                    for r in inflight.values():
                        reserved += self.remaining_blocks(r)
                    reserved += self.spec_step_blocks
                la = 0 if ext else self.lookahead     # no lookahead slots for an async load
                free = pool.get_num_free_blocks()
                if (kv.admission_blocks(req, L, total, req.num_tokens, True) > free
                        or kv.admission_blocks(req, L, total, total + n + la, False, la)
                        > free - reserved):
                    break
                kv.apply_hit(req, L, total)
                req.num_cached = L
            else:
                L = req.num_computed
                if (kv.admission_blocks(req, 0, L, req.num_tokens, True)
                        > pool.get_num_free_blocks()):
                    break
            if ext:
                nb = kv.allocate_slots(req, 0, computed=L + ext)
                if nb is None:
                    kv.free(req)
                    break
                # is_cached(block): the block's hash (BlockPool.key) or None
                if multi is None:
                    job = conn.update_state_after_alloc(req, req.tables, ext, pool.key)
                else:   # (parked, not scheduled in this step, whichever child loads it)
                    job = multi.update_state_after_alloc(req, req.tables, ext, pool.key,
                                                         scheduled=False)
                req.status = WAITING_FOR_LOAD
                req.load_target = L + ext
                inflight[req.rid] = req
                if job is not None:
                    self._violation(inv.check_load_ready(self.step_no, off.tier, job))
                    self._start_load(t, job)
                # (no job: NIXL pulls the tokens, multi, _start_pulls; or SimpleCPU issues the
                # load with the step's event)
                i += 1
                continue
            n = min(req.num_tokens - L, budget)
            pad = 0
            if (self.num_spec and n == 1 and req.num_tokens - L == 1
                    and not self.prefill_scheduled
                    and (running_scheduled or (L > 0 and self.spec_pad_after_hit))):
                # Pad new decode requests to uniform spec decoding size: 1 + k tokens, k
                # padding drafts (-1) the worker rejects; not scheduled at all without the budget
                if 1 + self.num_spec > budget:
                    if fresh:
                        kv.free(req)
                        req.num_computed = 0
                    break
                pad = self.num_spec
                n += pad
            if self.mamba_split_bs:
                n = self._mamba_split(req, n, L)
                if n == 0:
                    break
            req.num_computed = L
            nb = kv.allocate_slots(req, n, cache_upto=min(L + n, req.num_tokens),
                             lookahead=self.lookahead)
            if nb is None:
                if fresh:
                    kv.free(req)
                    req.num_computed = 0
                break
            if multi is not None:
                multi.update_state_after_alloc(req, req.tables, 0, pool.key)
            elif conn.alloc_all_groups:
                conn.update_state_after_alloc(req, req.tables, 0, None)
            del waiting[i]
            if i < self.n_held:
                self.n_held -= 1
            running.append(req)
            req.status = RUNNING
            if L + n < req.num_tokens:
                inflight[req.rid] = req
            scheduled[req.rid] = n
            new_blocks[req.rid] = nb = [list(tb) for tb in req.tables]
            sched_reqs.append((req, n, nb))
            budget -= n
            if pad:
                self.sched_drafts[req.rid] = pad
                self.padded.add(req.rid)
        if i:
            self._requeue_skipped(i)
        return budget

    def _requeue_skipped(self, i: int) -> None:
        """The requests skipped by this step's pass (``waiting[:i]``) go back to the front of
        their queue in the order they were skipped (``step_skipped_*``, ``prepend_requests``):
        up to 0.30.0 all of them to ``skipped_waiting``, from 0.31.0 those holding blocks to
        ``kv_holding_waiting`` and the others to ``waiting``."""
        waiting = self.waiting
        held_rest = max(0, self.n_held - i)      # unreached requests of the first queue
        if not self.kv_holding_first:
            self.n_held = i + held_rest
            return
        # the common case: the skipped requests holding blocks already come first, and either
        # all of them hold blocks or no unreached request of the first queue has to pass
        # between them and the others: the queue stays as it is
        nk, ordered = 0, True
        for j in range(i):
            r = waiting[j]
            if r.status == WAITING_FOR_LOAD or r.num_computed:
                if nk != j:
                    ordered = False
                    break
                nk += 1
        if ordered and (held_rest == 0 or nk == i):
            self.n_held = nk + held_rest
            return
        skipped, rest = waiting[:i], waiting[i:]
        kvh = [r for r in skipped if r.status == WAITING_FOR_LOAD or r.num_computed]
        other = [r for r in skipped if not (r.status == WAITING_FOR_LOAD or r.num_computed)]
        self.waiting = kvh + rest[:held_rest] + other + rest[held_rest:]
        self.n_held = len(kvh) + held_rest

    def remaining_blocks(self, req: Request) -> int:
        """``Scheduler._request_remaining_blocks``: the blocks an in-flight prefill (or load)
        still needs for its full sequence and, under speculative decoding, one spec decode
        step: 0.31.0 adds that step's blocks (``_spec_decode_step_blocks``), 0.32.0 on counts
        its ``1 + num_spec_tokens + num_lookahead_tokens`` slots past the sequence."""
        if not self.spec_step_slots:
            return self.kv.remaining_blocks(req)
        if self.spec_step_by_block:
            return self.kv.remaining_blocks(req) + self.spec_step_blocks
        slots = self.spec_step_slots
        return self.kv.admission_blocks(req, 0, req.num_computed, req.num_tokens + slots, True,
                                        slots)

    def after_step(self, step: int) -> None:
        if self.checks == "full":
            self._violation(inv.check_pool(step, self.kv.pool,
                                           [r for r in self.reqs.values() if not r.finished]
                                           + list(self.delayed_free.values())
                                           + (self.async_.held() if self.async_ else []),
                                           self.simple.held_gpu_blocks()
                                           if self.simple is not None else None))
        self._emit("check ok")
        if self.failed_job is not None:
            self.transfer_failed(self.failed_job)
        quiet = self.connector_quiet()
        # a job that never completes is no transfer to wait for (it only keeps the engine
        # stepping: the scheduler's has_requests holds while the connector has jobs)
        live = not quiet and (not self.hung
                              or any(jid not in self.hung for jid in self.jobs))
        if self.progress or live or self.future_events:
            self.stall = 0
        else:
            self.stall += 1
        self.progress = False
        if self.stall > STALL_STEPS and self.hung and self._hung_jobs():
            self._end_hung(step)
        # the engine steps while Scheduler.has_requests(), which counts the connector's pending
        # work (has_pending_push_work): a step that makes more of it every time never idles
        self.after_last = self.after_last + 1 if self.unfinished <= 0 and not \
            self.future_events else 0
        self._violation(inv.check_goes_idle(step, self.after_last, MAX_STEPS_AFTER_LAST))
        if (self.async_.busy() if self.async_ is not None else
                self.running or not quiet or any(r.status != WAITING_FOR_LOAD
                                                 or r.rid in self.loaded for r in self.waiting)):
            if self.stall > STALL_STEPS and self.unfinished > 0:
                stuck = [r.rid for r in self.reqs.values() if not r.finished][:5]
                raise inv.InvariantViolation("INV-8", step, f"no progress for {self.stall} "
                                             f"steps with the tier quiet; stuck: {stuck}")
            self._schedule_step(self.q.now + 1)

    def _end_idle(self) -> None:
        """At a step after the last request left (``has_requests`` false, nothing to arrive)
        with the connector's keep-alive unheard (0.25.1-0.29.0's SimpleCPU:
        ``has_pending_transfers``, see ``simple_cpu_scheduler_legacy``): the engine idles and
        the jobs still in flight are never reported. The run ends (``RunEnded``), naming them
        if any of them would complete. Not under async scheduling: the harness's batch queue
        holds a batch at every such step, and it steps on until the jobs are reported."""
        if (self.simple is None or not self.simple.strands_at_idle or self.async_ is not None
                or self.unfinished > 0 or self.future_events or self.has_requests()):
            return
        jobs = self.jobs
        if any(jid not in self.hung for jid in jobs):
            self._emit("end idle with jobs in flight: " + ", ".join(
                f"{'store' if jobs[jid].is_store else 'load'} {jid}" for jid in sorted(jobs)))
        if jobs:
            raise RunEnded()

    def _hung_jobs(self) -> list[Job]:
        """The jobs that never complete, in flight (all of them: nothing completes them)."""
        jobs = self.jobs
        return [jobs[jid] for jid in sorted(self.hung) if jid in jobs]

    def _end_hung(self, step: int) -> None:
        """Nothing has moved for ``STALL_STEPS`` steps and only jobs that never complete are in
        flight: the run stops (``RunEnded``) when every unfinished request is held back by
        them (``inv.held_back``), else one is stuck for another reason (INV-8)."""
        jobs = self._hung_jobs()
        hung = [(j.jid, j.is_store, j.rid) for j in jobs]
        held = [(r.rid, inv.held_back(r.rid, r.status == RUNNING,
                                      r.rid in self.deferred_lookups and self.defers_on(r, jobs),
                                      hung))
                for r in self.reqs.values() if not r.finished]
        self._violation(inv.check_hung_end(step, self.stall, hung, held))
        self._emit(fmt_hung_end([(jid, is_store) for jid, is_store, _ in hung], held))
        raise RunEnded()

    def defers_on(self, req: Request, hung: list[Job]) -> bool:
        """A deferred lookup of ``req`` waits on one of ``hung``: its own (the connector defers
        while the request has transfer jobs), or one holding a chunk of its prompt (a store's
        chunk is HIT_PENDING until it completes, a load's is being loaded)."""
        if any(j.rid == req.rid for j in hung):
            return True
        keys = {k for j in hung for k in j.ckeys}
        st = self.off.req_status.get(req.rid)
        return st is not None and any(k in keys for gs in st.groups for k in gs.keys)

    # --- running ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.q.run()
        finally:        # (a finding or a crash stops the run: its counters are reported too)
            counters = self.counters
            counters["steps"] = self.steps
            counters["scheduled_tokens"] = self.scheduled_tokens
            counters["stores"] = self.n_stores
            counters["loads"] = self.n_loads
        if self.unfinished > 0:
            raise inv.InvariantViolation("INV-8", self.step_no, f"{self.unfinished} requests "
                                         "never finished")

