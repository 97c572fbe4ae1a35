"""Drive the real vLLM ``Scheduler`` (with the real ``OffloadingConnector``) through a case.

Runs inside a release worker only (op ``run_case``). Nothing under test is mocked: the
``VllmConfig`` holds a real ``ModelConfig`` (tiny local HF config, :mod:`build`), the
``KVCacheConfig`` has one real group per layout group (the hybrid KV cache manager is switched
back on: the scheduler sees every group, checked at boot), the connector builds its real CPU
offloading manager. This module plays the GPU worker only:

* one sampled token per request whose prefill is complete, ``simsched.case.sampled_token`` (the
  model samples the same ids);
* speculative decoding (sync scheduling): ``k`` drafts per request of an executed batch through
  ``Scheduler.update_draft_token_ids`` (as ``EngineCore.post_step``), the tokens that follow the
  request's known ones; a step that scheduled drafts accepts the first ones as the request's
  ``accept`` pattern says (``RequestSpec.accepted``; padding drafts ``-1`` never) and samples one
  token after them, so ``update_from_output`` rolls back over the rejected ones;
* transfer completions through the connector's real output path: a store reports only through
  ``OffloadingWorkerMetadata.completed_jobs``; a load through ``completed_jobs`` and
  ``finished_recving`` (as the real offloading worker does). A job created at time ``t`` is
  reported in the output of the step at ``t + latency - 1`` (so the scheduler sees it before the
  step at ``t + latency``, as the model's ``STORE_DONE``/``LOAD_DONE`` events); jobs named in
  ``jobs_to_flush`` complete in the step that flushes them. A job of latency null
  (``timing.jobs``) is never reported: a step that flushes it never ends, and once nothing but
  such jobs is in flight the run stops (:meth:`_Run._end_hung`).

It emits ``simsched-trace/1`` lines (see :mod:`simsched.trace`) from what the real scheduler did,
and keeps a content shadow of every GPU block and CPU chunk (:class:`simsched.shadow.Shadow`),
checking INV-1/2 (real block pool), INV-3/4 (store jobs: real source blocks against the tokens
their keys name), INV-5 (loads), INV-6 (writes into blocks a store has not read yet), INV-7
(loads of chunks not stored yet) and INV-8 (liveness) on the real run; and at every lookup the
connector answers (``get_num_new_matched_tokens``, observed on the run's own connector) INV-9
against a hit computed from the CPU tier's content alone (``inv.expected_lookup_hit``) and, for
a lookup that defers, INV-8 (a deferral that outlasts every transfer it could wait for).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import math
import os
import time
from collections import Counter, deque
from operator import attrgetter
from types import SimpleNamespace
from typing import Any

from simsched import invariants as inv
from simsched.model.block_pool import NULL
from simsched.model.request import Request as IdentRequest, make_key
from simsched.case import Case, sampled_token
from simsched.geometry import estimate_max_model_len, max_model_len
from simsched.layout import Layout, LayoutError
from simsched.model.scheduler import STALL_STEPS
from simsched.shadow import Shadow
from simsched.trace import fmt_alloc, fmt_hung_end, fmt_hung_flush, fmt_job, header

_block_id = attrgetter("block_id")

DEFAULT_STEP_CAP = 20_000

#: steps beyond the case's longest transfer latency that a lookup may keep deferring, counted
#: from the last completion it could be waiting for (see ``_Run._deferred``): a job created at
#: ``t`` is reported before the step at ``t + latency``, one step later under async scheduling
#: (the batch queue), and a chunk stored in the step of the lookup is pending one step more
DEFER_MARGIN = 2

#: loads a request may complete without a token of it being scheduled in between: a waiting
#: request is loaded once per admission (a preempted one again after it ran); a third load in
#: a row means its loaded tokens are dropped and it is looked up afresh at every step
#: (INV-8, op ``load``: the one-token-prompt livelock of block size 1, found at the step cap
#: before, 20,000 steps)
MAX_LOADS_UNSCHEDULED = 2

#: what a token of each layout kind attends to, for INV-9's oracle (``inv.reach_chunks``);
#: kinds not named are taken as full attention (every chunk: the least the oracle can demand)
_REACH = {"sliding_window": "window", "sliding_window_mla": "window",
          "chunked_local": "local", "mamba": "state"}


class _Crash(Exception):
    def __init__(self, stage: str, exc: BaseException):
        super().__init__(f"{stage}: {exc!r}")
        self.stage = stage
        self.exc = exc


class _TransferFailed(Exception):
    """A faulted job failed and the release's offloading worker raised: the run stops."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Ended(Exception):
    """The run stops cleanly on a job that never completes (``timing.jobs``, latency null):
    ``line``, the trace's last line."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


class _ChunkIndex:
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


class _Job:
    """One real transfer job as the shadow sees it: ``items`` like the model's
    ``(group_id, chunk_idx, hash_idx, key, [(block_index, block_id), ...])``; ``due`` None: the
    worker never reports it (it hangs)."""

    __slots__ = ("jid", "rid", "is_store", "items", "due", "read", "contents", "done")

    def __init__(self, jid, rid, is_store, items, due):
        self.jid, self.rid, self.is_store, self.items, self.due = jid, rid, is_store, items, due
        self.read = False
        self.contents: dict = {}
        self.done = False


class RealEngine:
    """One per worker; :meth:`run_case` builds a fresh Scheduler per case."""

    def __init__(self, probe):
        from vllm.config import SchedulerConfig  # noqa: F401 - import check
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import RequestStatus
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading.common as common

        self.probe = probe
        self.builder = probe.builder
        _cap_memory()
        self.Scheduler = Scheduler
        try:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler
            self.AsyncScheduler = AsyncScheduler
        except ImportError:
            self.AsyncScheduler = None
        self.SamplingParams = SamplingParams
        self.ModelRunnerOutput = ModelRunnerOutput
        self.KVConnectorOutput = KVConnectorOutput
        self.RequestStatus = RequestStatus
        self.WorkerMeta = getattr(common, "OffloadingWorkerMetadata", None)
        try:
            from vllm.v1.outputs import DraftTokenIds
            self.DraftTokenIds = DraftTokenIds
        except ImportError:
            self.DraftTokenIds = None
        self.sched_params = set(inspect.signature(Scheduler.__init__).parameters)
        self.mro_params = set(inspect.signature(ModelRunnerOutput).parameters)
        try:
            from vllm.v1.structured_output import StructuredOutputManager
            self.StructuredOutputManager = StructuredOutputManager
        except ImportError:
            self.StructuredOutputManager = None
        from simsched.vllm.inside import build
        self.Unsupported = build.Unsupported
        self.Refused = build.Refused

    # -- boot ------------------------------------------------------------------------------
    def boot(self, case: Case):
        import copy
        vc, kvc = self.build(case)
        eng, timing = case.layout.engine, case.timing
        if case.requests:   # the engine's max_model_len, as its start-up check counted it
            vc.model_config = copy.copy(vc.model_config)
            vc.model_config.max_model_len = max_model_len(case)
        sc = copy.copy(vc.scheduler_config)
        sc.max_num_batched_tokens = timing.max_num_batched_tokens
        sc.max_num_seqs = timing.max_num_seqs
        for name, value in (("max_num_scheduled_tokens", None), ("enable_chunked_prefill", True),
                            ("long_prefill_token_threshold", 0),
                            ("disable_hybrid_kv_cache_manager", False),
                            ("async_scheduling", bool(eng.async_scheduling))):
            if hasattr(sc, name):
                setattr(sc, name, value)
        if hasattr(sc, "max_num_partial_prefills"):
            sc.max_num_partial_prefills = 1
        vc.scheduler_config = sc
        cc = vc.cache_config
        cc.num_gpu_blocks = eng.num_gpu_blocks
        kcu = self.probe.kcu
        sbs, tph = kcu.resolve_kv_cache_block_sizes(kvc, vc)
        cls = self.Scheduler
        if eng.async_scheduling and self.AsyncScheduler is not None:
            cls = self.AsyncScheduler
        kw: dict[str, Any] = {"vllm_config": vc, "kv_cache_config": kvc,
                              "log_stats": False}
        if "structured_output_manager" in self.sched_params:
            kw["structured_output_manager"] = self.StructuredOutputManager(vc)
        if "block_size" in self.sched_params:
            kw["block_size"] = sbs
        if "hash_block_size" in self.sched_params:
            kw["hash_block_size"] = tph
        sched = cls(**kw)
        n_groups = len(sched.kv_cache_manager.coordinator.single_type_managers)
        if n_groups != len(case.layout.groups):
            raise RuntimeError(f"harness: the scheduler sees {n_groups} KV cache groups, the "
                               f"layout has {len(case.layout.groups)}")
        return vc, kvc, sched, sbs, tph

    def boot_retention(self, case_json: dict) -> dict:
        """The retention interval each side of the booted engine reads (op ``boot_retention``):
        ``cache_config``, the ``KVCacheConfig``, the KV cache manager's coordinator (0.29.0+)
        and the connector's scheduler config (0.30.0+); ``"absent"`` where the release has no
        such field. An unsupported case: ``{"unsupported": reason}``."""
        try:
            vc, kvc, sched, _, _ = self.boot(Case.from_json(case_json))
        except self.Unsupported as e:
            return {"unsupported": str(e)}
        sides = {"cache_config": vc.cache_config, "kv_cache_config": kvc}
        name = "prefix_cache_retention_interval"
        out = {side: getattr(obj, name, "absent") for side, obj in sides.items()}
        out["kv_cache_manager"] = getattr(sched.kv_cache_manager.coordinator,
                                          "retention_interval", "absent")
        out["connector"] = getattr(sched.connector.connector_scheduler.config,
                                   "retention_interval", "absent")
        return out

    # -- the run ---------------------------------------------------------------------------
    def run_case(self, case_json: dict, mutant: str | None = None,
                 step_cap: int = DEFAULT_STEP_CAP, checks: str = "full",
                 bare: bool = False) -> dict:
        """``bare=True``: the bare Scheduler's speed (:class:`_BareRun`), no trace, no shadow,
        no checks; the result has ``loop_wall``/``loop_cpu`` seconds of the scheduler loop."""
        t0 = time.perf_counter()
        try:
            case = Case.from_json(case_json)
        except LayoutError as e:
            return {"status": "invalid", "reason": str(e)}
        if not case.layout.planned:
            planned = self.plan_case(case)
            if planned["status"] != "ok":
                return planned
            case = dataclasses.replace(case, layout=Layout.from_json(
                dict(case.layout.to_json(), groups=planned["groups"])))
        refusal = self.startup_refusal(case)
        if refusal is not None:
            return {"status": "refused", "reason": refusal}
        if bare:
            out = _BareRun(self, case, step_cap).go()
            out["wall"] = time.perf_counter() - t0
            return out
        undo = None
        if mutant:
            from simsched.vllm.inside import mutants
            undo = mutants.apply(mutant)
        try:
            run = _Run(self, case, step_cap, checks)
            try:
                run.go()
            except self.Unsupported as e:
                return {"status": "unsupported", "reason": str(e)}
        finally:
            if undo is not None:
                undo()
        out = run.result()
        out["wall"] = time.perf_counter() - t0
        out["mutant"] = mutant
        return out

    def plan(self, case_json: dict) -> dict:
        """Op ``plan``: the KV cache groups the release's planner builds of a case's layers,
        ``{"status": "ok", "groups": [...]}``, or why the engine does not start (``refused``,
        ``unsupported``, ``invalid``)."""
        try:
            case = Case.from_json(case_json)
        except LayoutError as e:
            return {"status": "invalid", "reason": str(e)}
        return self.plan_case(case)

    def plan_case(self, case: Case) -> dict:
        """The planner's groups alone: the offloading connector's own configuration is built
        when the case runs, where what it checks (or crashes on) is the run's outcome, not a
        reason the planner would not build these groups."""
        layout = case.layout
        try:
            if not layout.layers:
                raise self.Unsupported("a layout of groups has no layers to plan")
            vc = self.builder.vllm_config(layout)
            kvc = self.builder.planner.plan(layout, self.checked_config(case, vc))
            groups = self.builder.planner.groups(kvc)
        except self.Unsupported as e:
            return {"status": "unsupported", "reason": str(e)}
        except self.Refused as e:
            return {"status": "refused", "reason": str(e)}
        try:
            Layout.from_json(dict(case.layout.to_json(), groups=groups))
        except LayoutError as e:
            return {"status": "unsupported", "reason": f"the planner built groups the layout "
                    f"language refuses: {e}"}
        return {"status": "ok", "groups": groups}

    def startup_refusal(self, case: Case) -> str | None:
        """The release's own start-up checks, in ``EngineCore._initialize_kv_caches``' order,
        run before any Scheduler is built: the KV cache pool (:meth:`kv_memory_refusal`), then
        ``VllmConfig.validate_block_size`` (:meth:`block_size_refusal`). The first refusal's
        message, or None."""
        try:
            vc, kvc = self.build(case)
        except self.Unsupported:
            return None             # the run says so
        except self.Refused as e:   # a layout of layers: the release's planner ran the check
            return str(e)
        if case.layout.layers:
            return self.block_size_refusal(case, vc, kvc)
        return self.kv_memory_refusal(case, vc, kvc) or self.block_size_refusal(case, vc, kvc)

    def build(self, case: Case):
        """The case's (VllmConfig, KVCacheConfig); a layout of layers planned by the release
        with the config its start-up checks see (:meth:`checked_config`)."""
        return self.builder.build(case.layout, planning=lambda vc: self.checked_config(case, vc))

    def checked_config(self, case: Case, vc):
        """A copy of ``vc`` as the engine's start-up checks see it: the case's
        ``max_model_len`` (:func:`simsched.geometry.max_model_len`, as :meth:`boot` sets it)
        and scheduler budget."""
        import copy
        vc = copy.copy(vc)
        vc.model_config = copy.copy(vc.model_config)
        if case.requests:
            vc.model_config.max_model_len = max_model_len(case)
        sc = vc.scheduler_config = copy.copy(vc.scheduler_config)
        sc.max_num_batched_tokens = case.timing.max_num_batched_tokens
        # SchedulerConfig.__post_init__ sets the encoder budget (cross attention's blocks) to
        # max_num_batched_tokens: an engine started with this budget has it
        if hasattr(sc, "max_num_encoder_input_tokens"):
            sc.max_num_encoder_input_tokens = sc.max_num_batched_tokens
        if hasattr(sc, "async_scheduling"):
            sc.async_scheduling = bool(case.layout.engine.async_scheduling)
        return vc

    def block_size_refusal(self, case: Case, vc, kvc) -> str | None:
        """``VllmConfig.validate_block_size`` (``config/vllm.py``, called by
        ``EngineCore._initialize_kv_caches`` once ``cache_config.block_size`` is the smallest
        block size of the KV cache groups): up to 0.26.0 it asserts, in Mamba align mode,
        ``block_size <= max_num_batched_tokens`` (a chunk must reach a block boundary; 0.27.0
        dropped the assert, its ``_mamba_block_aligned_split`` advancing sub-block instead).
        Run on copies with the case's budget; its AssertionError's message (stripped under
        ``python -O``, as in a real engine), or None."""
        import copy
        if not hasattr(vc, "validate_block_size"):
            return None
        vc = copy.copy(vc)
        cc = vc.cache_config = copy.copy(vc.cache_config)
        vc.parallel_config = copy.copy(vc.parallel_config)
        sc = vc.scheduler_config = copy.copy(vc.scheduler_config)
        sc.max_num_batched_tokens = case.timing.max_num_batched_tokens
        if hasattr(sc, "long_prefill_token_threshold"):
            sc.long_prefill_token_threshold = 0       # as boot sets it
        cc.block_size = min(g.kv_cache_spec.block_size for g in kvc.kv_cache_groups)
        try:
            vc.validate_block_size()
        except AssertionError as e:
            return str(e)
        return None

    def kv_memory_refusal(self, case: Case, vc, kvc) -> str | None:
        """The release's own start-up check of the KV cache pool, run before any Scheduler is
        built: ``_check_enough_kv_cache_memory`` (``v1/core/kv_cache_utils.py``,
        ``kv_cache_planning.py`` from 0.33.0) with the case's ``max_model_len``
        (:func:`simsched.geometry.max_model_len`, as :meth:`boot` sets it). A group needs its spec's ``max_memory_usage_bytes`` in
        pages; the groups share the pool of ``num_gpu_blocks`` blocks, the null block held
        back from 0.29.0 (``Planner.holds_null_block``; before, the check counted it,
        vllm-project/vllm#47272). Passed in units of 1 GiB, so that the release's message counts blocks where it
        says GiB. Its ValueError's message, or None (it fits, or the release has no check)."""
        import importlib
        check = None
        for name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
            try:
                check = getattr(importlib.import_module(name), "_check_enough_kv_cache_memory",
                                None)
            except ImportError:
                continue
            if check is not None:
                break
        if check is None or not case.requests:
            return None
        vc = self.checked_config(case, vc)
        specs = [g.kv_cache_spec for g in kvc.kv_cache_groups]
        gib = 1 << 30

        def needed(model_len: int) -> int:
            vc.model_config.max_model_len = model_len
            return gib * sum(-(-s.max_memory_usage_bytes(vc) // s.page_size_bytes)
                             for s in specs)

        def estimate(available: int) -> int:
            return estimate_max_model_len(needed, available, model_len)

        model_len = max_model_len(case)
        usable = kvc.num_blocks - (1 if self.builder.planner.holds_null_block else 0)
        try:
            check(gib * usable, lambda: needed(model_len), model_len, estimate)
        except ValueError as e:
            return str(e)
        except AssertionError:      # e.g. "DCP not support sliding window.": the run shows it
            return None
        return None

    def crash_info(self, stage: str, exc: BaseException) -> dict:
        return self.probe.error(stage, exc)


class _Run:
    def __init__(self, eng: RealEngine, case: Case, step_cap: int, checks: str):
        self.eng, self.case, self.step_cap, self.checks = eng, case, step_cap, checks
        self.lines = [header("vllm-" + _vllm_version(), case.asserts)]
        self.findings: list[dict] = []
        self.counters = {"steps": 0, "stores": 0, "loads": 0, "preemptions": 0, "finished": 0,
                         "aborted": 0, "scheduled_tokens": 0}
        self.step_no = 0
        self.loop_t0: float | None = None
        self.loop_c0 = 0.0
        self.lookup_finding: inv.InvariantViolation | None = None
        self.lookup_error: BaseException | None = None
        # lookups the connector answered and checked: how many, how many the tier's ready
        # chunks gave a hit (the oracle's want > 0), how many deferred
        self.lookup_counts = {"checked": 0, "expected_hit": 0, "deferred": 0}
        # the case's faults: job ID -> (store | load, the connector metadata that created it);
        # the failed job and why the run stopped there
        self.faulted: dict[int, tuple[str, Any]] = {}
        self.failed: tuple[_Job, str] | None = None
        self.unsupported: str | None = None
        # job ID -> its keys (as the model's keys) in the order of the job's key set
        # (TransferJobStatus.keys), which complete_store / complete_load walk: an order vLLM
        # leaves to the set (simsched.model.cpu_manager.walk_order); lockstep hands it to the model
        self.walks: dict[int, list] = {}

    # -- helpers ---------------------------------------------------------------------------
    def emit(self, line: str) -> None:
        self.lines.append(line)

    def result(self) -> dict:
        # loop_wall, loop_cpu: the Scheduler loop with the worker side, shadow and checks, boot
        # excluded (as _BareRun's), for bench/bench_real_side.py
        started = self.loop_t0 is not None
        stopped = {} if self.unsupported is None else {"reason": self.unsupported}
        return {"status": "ok" if self.unsupported is None else "unsupported", **stopped,
                "trace": self.lines, "findings": self.findings,
                "counters": self.counters, "lookups": self.lookup_counts,
                "walks": sorted(self.walks.items()),
                "loop_wall": time.perf_counter() - self.loop_t0 if started else None,
                "loop_cpu": time.process_time() - self.loop_c0 if started else None}

    def go(self) -> None:
        try:
            self._go()
        except _Crash as c:
            info = self.eng.crash_info(c.stage, c.exc)
            self.lines.append(f"crash {info['exception']} {info['function'] or '?'} {c.stage}")
            info.update(kind="crash", step=self.step_no, op=c.stage)
            self.findings.append(info)
        except inv.InvariantViolation as v:
            self.lines.append(f"violation {v.inv_id} {v.detail}")
            self.findings.append(dict(v.to_finding(),
                                      group_kinds=self._kinds_named(v.detail)))
        except _TransferFailed as f:
            self.unsupported = f.reason
        except _Ended as e:
            self.lines.append(e.line)
        finally:
            # the observed lookup was this connector's own attribute: drop it
            cs = getattr(self, "cs", None)
            if cs is not None:
                vars(cs).pop("get_num_new_matched_tokens", None)

    def _case_event(self, event) -> None:
        """``Scheduler.reset_prefix_cache()`` between two steps, as the engine core runs an
        operator's ``reset_prefix_cache`` call: its defaults (no running request reset, no
        connector reset)."""
        done = self._call("reset_prefix_cache", self.sched.reset_prefix_cache)
        self.emit(f"reset_prefix_cache {'ok' if done else 'refused'}")

    def _kinds_named(self, detail: str) -> str | None:
        """The kinds of the KV cache groups a violation names (``group 2``, ``g1:3``, or a
        block some request's table of that group holds), for the finding's cluster; None
        where it names none."""
        import re
        groups = {int(a or b) for a, b in re.findall(r"\bgroup (\d+)|\bg(\d+):", detail)}
        blocks = {int(b) for b in re.findall(r"\bblock (\d+)", detail)}
        if blocks and hasattr(self, "sched"):
            for rid in self.reqs:
                for gid, table in enumerate(self._tables(rid)):
                    if blocks & set(table):
                        groups.add(gid)
        layout = self.case.layout.groups
        kinds = sorted({layout[g].kind + ("-drafter" if layout[g].drafter else "")
                        for g in groups if g < len(layout)})
        return "+".join(kinds) or None

    def _call(self, stage: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except self.eng.Unsupported:
            raise
        except Exception as e:   # noqa: BLE001 - vLLM's failure is the observation
            raise _Crash(stage, e) from e

    # -- setup -----------------------------------------------------------------------------
    def _boot(self) -> None:
        eng, case = self.eng, self.case
        vc, kvc, sched, sbs, tph = self._call("boot", eng.boot, case)
        self.sched, self.tph, self.vc, self.kvc = sched, tph, vc, kvc
        self.conn = sched.connector
        cs = getattr(self.conn, "connector_scheduler", None)
        if cs is None:
            raise RuntimeError("harness: no OffloadingConnectorScheduler on the scheduler")
        self.cs = cs
        # every lookup the connector answers is checked (INV-9, deferrals): observed on this
        # scheduler's own connector, an instance attribute that go() drops after the case
        self._lookup_orig = cs.get_num_new_matched_tokens
        cs.get_num_new_matched_tokens = self._observed_lookup
        cfg = cs.config
        self.bpc = int(getattr(cfg, "blocks_per_chunk", None)
                       or getattr(cfg, "block_size_factor", 1))
        gcfgs = []
        for group_cfg in cfg.kv_group_configs:
            gid = int(group_cfg.group_idx)
            tpb = int(getattr(group_cfg, "tokens_per_block", None)
                      or getattr(group_cfg, "gpu_block_size"))
            # cow_source: Mamba "align" (0.33.0+): stores come as one-block boundary jobs whose
            # block_indices name the block's index; the block table is not append-only there
            gcfgs.append(SimpleNamespace(group_id=gid, tokens_per_block=tpb,
                                         tokens_per_chunk=tpb * self.bpc,
                                         cow_source=bool(getattr(group_cfg,
                                                                 "requires_cow_source", False))))
        self.gcfgs = gcfgs
        self.gcfg_by_id = {g.group_id: g for g in gcfgs}
        self.drafters = self._drafter_groups(cfg)
        self.geo = SimpleNamespace(tokens_per_hash=tph, groups=gcfgs)
        layout = case.layout
        mgrs = sched.kv_cache_manager.coordinator.single_type_managers
        self.block_sizes = [int(m.block_size) for m in mgrs]
        self.unit = math.gcd(tph, *self.block_sizes)
        # per group, what the shadow writes by: the block size, and whether it is a ring
        self.shadow_groups = [(bs, g.kind == "ring")
                              for g, bs in zip(layout.groups, self.block_sizes)]
        self.shadow = Shadow(layout.engine.num_gpu_blocks, self.bpc)
        self.tier: dict[Any, tuple] = {}          # offload key -> content (ready chunks)
        self.pending_reads: dict[int, set[int]] = {}
        self.jobs: dict[int, _Job] = {}
        self.reqs: dict[str, Any] = {}            # rid -> vllm Request
        self.ident: dict[str, IdentRequest] = {}  # rid -> token identity tracker
        self.index: dict[str, int] = {}
        self.hash_index: dict[str, dict] = {}
        self.finished: set[str] = set()
        try:
            from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx
            self.key_hash, self.key_group = get_offload_block_hash, get_offload_group_idx
        except ImportError:
            self.key_hash = lambda k: bytes(k)[:-4]
            self.key_group = lambda k: int.from_bytes(bytes(k)[-4:], "big")
        self.hasher = self.eng.probe.hasher(vc, tph)
        # speculative decoding (sync scheduling): the worker proposes drafts after each executed
        # step (EngineCore.post_step -> Scheduler.update_draft_token_ids)
        spec = layout.engine.speculative
        self.num_spec = (spec.num_tokens if spec is not None and not layout.engine.async_scheduling
                         else 0)
        self.verified: dict[str, int] = {}       # rid -> verification steps so far
        # INV-9 / deferrals: what the scheduler has been told of the CPU tier
        self.reported: set = set()       # content keys whose store completion it was told
        self.key_done: dict = {}         # content key -> step of its last reported transfer
        self.req_done: dict[str, int] = {}   # rid -> step of its own last reported transfer
        self.deferred: dict[str, list[int]] = {}     # rid -> steps its lookup deferred
        self.loads_unscheduled: dict[str, int] = {}  # rid -> loads since it last ran
        self.defer_bound = max([case.timing.store_latency, case.timing.load_latency]
                               + [j.latency for j in case.timing.jobs
                                  if j.latency is not None]) + DEFER_MARGIN
        # a layout group the connector does not offload bounds every load (gpu-group-bound)
        self.gpu_only_groups = len(gcfgs) < len(layout.groups)
        try:
            from vllm.v1.kv_offload.base import make_offload_key
            self.offload_key = make_offload_key
        except ImportError:
            self.offload_key = None
        self._boot_caps()
        self._boot_slots()
        self._boot_tails()

    def _drafter_groups(self, cfg) -> set[int]:
        """The groups holding EAGLE/MTP drafter KV, for INV-9's eagle-tail rule: the layout's
        drafter groups; with speculative decoding and none marked, the drafter's layers share
        the target's groups (a shared-group MTP model, or a drafter left unannotated), and
        0.25.1-0.29.0 then take every group for a drafter group
        (``OffloadingConnectorScheduler.__init__``: ``if use_eagle and not eagle_groups:
        eagle_groups = set(range(len(kv_cache_groups)))``, the trailing chunk "excluded from
        offloading due to volatility"); 0.30.0+ take none ("fail toward serving", #52735). Read
        from ``GroupOffloadConfig.is_eagle_group``, and only in these two shapes: any other set
        the connector flags is not excused."""
        layout = self.case.layout.groups
        marked = {g.group_id for g in self.gcfgs if layout[g.group_id].drafter}
        flagged = {int(gc.group_idx) for gc in cfg.kv_group_configs
                   if getattr(gc, "is_eagle_group", False)}
        every = {g.group_id for g in self.gcfgs}
        if not marked and self.case.layout.engine.speculative is not None and flagged == every:
            return every
        return marked

    def _add_request(self, i: int, spec) -> None:
        eng = self.eng
        params: dict[str, Any] = {"max_tokens": spec.decode, "ignore_eos": True}
        ktp = {}
        if spec.max_load_tokens is not None:
            ktp["max_load_tokens"] = spec.max_load_tokens
        if spec.max_offload_tokens is not None:
            ktp["max_offload_tokens"] = spec.max_offload_tokens
        if ktp:
            params["extra_args"] = {"kv_transfer_params": ktp}
        if spec.skip_reading_prefix_cache:
            params["skip_reading_prefix_cache"] = True
        sp = eng.SamplingParams(**params)
        prompt = spec.prompt_tokens()
        req = self._call("add_request", lambda: eng.probe.Request(
            request_id=spec.id, prompt_token_ids=prompt, sampling_params=sp,
            pooling_params=None, arrival_time=float(i), block_hasher=self.hasher))
        self.reqs[spec.id] = req
        self.index[spec.id] = i
        self.ident[spec.id] = IdentRequest(spec.id, i, spec, prompt, spec.prompt_len + spec.decode,
                                           self.unit, len(self.case.layout.groups))
        self._call("add_request", self.sched.add_request, req)

    def _hidx(self, rid: str, block_hash) -> int:
        req = self.reqs[rid]
        hashes = req.block_hashes
        m = self.hash_index.setdefault(rid, {})
        if len(m) < len(hashes):
            for j in range(len(m), len(hashes)):
                m.setdefault(bytes(hashes[j]), j)
        return m.get(bytes(block_hash), -1)

    # -- lookups: INV-9 and deferrals -----------------------------------------------------
    def _observed_lookup(self, request, num_computed_tokens, *args, **kw):
        """The connector's ``get_num_new_matched_tokens``, its answer checked. A finding (or a
        harness error) is kept and raised once ``schedule()`` returns, never inside it."""
        out = self._lookup_orig(request, num_computed_tokens, *args, **kw)
        if self.lookup_finding is None and self.lookup_error is None:
            bound = kw.get("max_num_new_tokens", args[0] if args else None)
            try:
                self._check_lookup(request, int(num_computed_tokens), out, bound)
            except inv.InvariantViolation as v:
                self.lookup_finding = v
            except Exception as e:   # noqa: BLE001 - the harness's own failure, not vLLM's
                self.lookup_error = e
        return out

    def _check_lookup(self, request, num_local: int, out, bound) -> None:
        """INV-9: a lookup finds at least the hit the CPU tier's ready chunks give
        (``inv.expected_lookup_hit``); a deferred one (``None``) goes to :meth:`_deferred`."""
        got = out[0] if isinstance(out, tuple) else out
        rid = request.request_id
        spec = self.case.requests[self.index[rid]]
        groups = self._hit_groups(request)
        state = self.cs._req_status.get(rid)
        # max-load-tokens: only where the release reads it (RequestOffloadState.max_load_tokens)
        max_load = spec.max_load_tokens if hasattr(state, "max_load_tokens") else None
        want = inv.expected_lookup_hit(num_local, int(request.num_tokens), groups, max_load,
                                       bound if self.gpu_only_groups else None)
        if getattr(request, "skip_reading_prefix_cache", False):
            want = 0        # get_num_new_matched_tokens: such a request reads no prefix
        counts = self.lookup_counts
        counts["checked"] += 1
        counts["expected_hit"] += want > 0
        counts["deferred"] += got is None
        if got is None:
            self._deferred(rid, want, num_local)
            return
        self.deferred.pop(rid, None)
        if got < want:
            raise inv.InvariantViolation(
                "INV-9", self.step_no, f"{rid}: ready chunks cover {want} tokens beyond the "
                f"GPU hit of {num_local}, lookup found {got}", "lookup")

    def _hit_groups(self, request) -> list:
        """Per offloaded group, the request's complete chunks as INV-9's oracle sees them: ready
        when the scheduler was told their store completed and the CPU tier still holds them."""
        rid = request.request_id
        ident = self.ident[rid]
        hashes = request.block_hashes
        known = min(len(hashes) * self.tph, len(ident.tokens))
        groups = []
        for g in self.gcfgs:
            lg = self.case.layout.groups[g.group_id]
            tpc = g.tokens_per_chunk
            ready = []
            for c in range(known // tpc):
                key = make_key(g.group_id, ident.ident_at((c + 1) * tpc))
                ready.append(key in self.reported and self._tier_holds(
                    request, hashes[(c + 1) * tpc // self.tph - 1], g.group_id))
            reach = _REACH.get(lg.kind, "full")
            span = lg.sliding_window if reach == "window" else (
                lg.attention_chunk_size if reach == "local" else 0)
            groups.append(inv.HitGroup(tpc, reach, ready, span or 0,
                                        g.group_id in self.drafters))
        return groups

    def _tier_holds(self, request, block_hash, gid: int) -> bool:
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

    def _deferred(self, rid: str, want: int, num_local: int) -> None:
        """INV-8 on a lookup: a deferral ("ask me again later") waits for a transfer in flight
        (the request's own, or a store or load of one of its chunks: HIT_PENDING,
        ``_chunks_being_loaded``), and each such transfer is reported within the case's
        latency. Counted per step since the last completion the request could be waiting
        for, a deferral that outlasts ``defer_bound`` steps while its ready chunks give a hit
        is a finding."""
        ident = self.ident[rid]
        since = self.req_done.get(rid, -1)
        for g in self.gcfgs:
            for c in range(len(ident.tokens) // g.tokens_per_chunk):
                key = make_key(g.group_id, ident.ident_at((c + 1) * g.tokens_per_chunk))
                since = max(since, self.key_done.get(key, -1))
        steps = [s for s in self.deferred.get(rid, ()) if s > since and s != self.step_no]
        steps.append(self.step_no)
        self.deferred[rid] = steps
        if len(steps) > self.defer_bound and want > 0 and not self._defers_on_hung(rid):
            raise inv.InvariantViolation(
                "INV-8", self.step_no, f"{rid}: lookup deferred {len(steps)} steps (bound "
                f"{self.defer_bound}) while ready chunks cover {want} tokens beyond the GPU hit "
                f"of {num_local}", "lookup")

    # -- jobs from the connector metadata --------------------------------------------------
    def _job_items(self, jid: int, tjob, status, is_store: bool) -> list:
        """Per chunk: (group, chunk index, hash index, key, [(block index, block id)])."""
        rid = tjob.req_id
        gpu = tjob.src_spec if is_store else tjob.dst_spec
        bids = [int(b) for b in gpu.block_ids]
        sizes = list(getattr(gpu, "group_sizes", None) or [len(bids)])
        starts = list(getattr(gpu, "block_indices", None) or [0] * len(sizes))
        ident = self.ident[rid]
        req_state = self.cs._req_status.get(rid)
        by_group: dict[int, list] = {}
        walk = []
        for k in status.keys:
            gid = int(self.key_group(k))
            hidx = self._hidx(rid, self.key_hash(k))
            by_group.setdefault(gid, []).append((hidx, k))
            walk.append(make_key(gid, ident.ident_at((hidx + 1) * self.tph)))
        self.walks[jid] = walk
        items = []
        pos = 0
        for gi, gcfg in enumerate(self.gcfgs):
            n = sizes[gi] if gi < len(sizes) else 0
            blocks = bids[pos:pos + n]
            pos += n
            gid = gcfg.group_id
            keys = sorted(by_group.get(gid, []), key=lambda x: x[0])
            if not keys:
                continue        # the job has no chunk of this group
            tpc = gcfg.tokens_per_chunk
            offload_keys = (req_state.group_states[gi].offload_keys
                            if req_state is not None and gi < len(req_state.group_states) else [])
            chunk_of = _ChunkIndex(offload_keys, self.tph, tpc)
            if is_store and self._is_tail_job(keys, tpc):
                items.append(self._tail_item(gid, keys[0], blocks, starts, gi, tpc, ident))
            elif is_store and gcfg.cow_source:
                # an aligned boundary job (_build_aligned_boundary_store_jobs): one key, one block,
                # its index in the request's table given by block_indices (boundary // tpb - 1);
                # the table cannot be read positionally (interior states nulled or relocated)
                start = starts[gi] if gi < len(starts) else 0
                for hidx, k in keys:
                    c = chunk_of.of(k, hidx)
                    take, blocks = blocks[:1], blocks[1:]
                    items.append((gid, c, hidx, make_key(gid, ident.ident_at((hidx + 1) * self.tph)),
                                  [(start, b) for b in take]))
            elif is_store:
                # the source blocks of each chunk: its non-null blocks, in order
                table = (req_state.group_states[gi].block_ids
                         if req_state is not None else [])
                for hidx, k in keys:
                    c = chunk_of.of(k, hidx)
                    idxs = [i for i in range(c * self.bpc, (c + 1) * self.bpc)
                            if i < len(table) and table[i] != 0]
                    take, blocks = blocks[:len(idxs)], blocks[len(idxs):]
                    items.append((gid, c, hidx, make_key(gid, ident.ident_at((hidx + 1) * self.tph)),
                                  list(zip(idxs, take))))
            else:
                start = starts[gi] if gi < len(starts) else 0
                per_chunk: dict[int, list] = {}
                for off, b in enumerate(blocks):
                    i = start + off
                    per_chunk.setdefault(i // self.bpc, []).append((i, b))
                for hidx, k in keys:
                    c = chunk_of.of(k, hidx)
                    items.append((gid, c, hidx, make_key(gid, ident.ident_at((hidx + 1) * self.tph)),
                                  per_chunk.get(c, [])))
        return items

    # -- per-request caps (INV-10) ----------------------------------------------------------
    def _boot_caps(self) -> None:
        """Which per-request caps this release honours, read from what its code has: the
        fields ``RequestOffloadState.__post_init__`` parses out of ``kv_transfer_params``
        (``max_offload_tokens`` in every release, ``max_load_tokens`` from 0.31.0; 0.30.0's
        connector bounds a load only by ``OffloadingConnector._max_loadable_tokens``, the
        groups it does not offload). A cap the release does not parse is not checked."""
        import dataclasses
        import importlib
        mod = importlib.import_module(
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
        cls = getattr(mod, "RequestOffloadState", None)
        names: set[str] = set()
        if cls is not None and dataclasses.is_dataclass(cls):
            names = {f.name for f in dataclasses.fields(cls)}
        self.caps_supported = {n: n in names for n in ("max_offload_tokens", "max_load_tokens")}
        self.tpbs = {g.group_id: g.tokens_per_block for g in self.gcfgs}

    def _cap(self, rid: str, name: str) -> int | None:
        """The request's cap ``name`` as the case gives it (not as the release parsed it), or
        None when it has none or the release does not support it. 0 is a cap: the release's
        ``_calc_num_offloadable_tokens`` takes ``min(n, 0)`` (nothing stored) and
        ``_lookup_complete_chunks`` ``num_computed_tokens + 0`` (nothing loaded)."""
        if not self.caps_supported.get(name):
            return None
        return getattr(self.case.requests[self.index[rid]], name)

    def _check_caps(self, step: int, job: _Job) -> None:
        """INV-10 where the job is built: the token positions its chunks cover against the
        request's cap (a store's against ``max_offload_tokens``, a load's against
        ``max_load_tokens``)."""
        if job.is_store:
            v = inv.check_store_cap(step, job, self._cap(job.rid, "max_offload_tokens"),
                                    self.tph)
        else:
            v = inv.check_load_cap(step, job, self._cap(job.rid, "max_load_tokens"),
                                   self.tph, self.tpbs)
        if v is not None:
            raise v

    # -- the CPU tier's slots (INV-5, INV-7) ------------------------------------------------
    def _boot_slots(self) -> None:
        """The CPU tier as the worker sees it: chunk slots, not keys. A store job's
        ``dst_spec`` and a load job's ``src_spec`` (``CPULoadStoreSpec.block_ids``: chunk
        indices into the CPU cache, one per key, in the order ``prepare_store`` /
        ``prepare_load`` took the keys: group by group, chunk by chunk, as the job's items)
        name the slots the worker writes or reads. A slot holds what the last completed store
        wrote there, whatever key the manager maps to it now."""
        self.slot_content: dict[int, Any] = {}      # CPU slot -> chunk content
        self.job_slots: dict[int, list[int]] = {}   # job id -> the slot of each item
        self.slot_writer: dict[int, int] = {}       # CPU slot -> pending store writing it
        self.slot_readers: dict[int, set[int]] = {}  # CPU slot -> pending loads reading it

    def _bind_slots(self, step: int, job: _Job, tjob) -> None:
        """The slots of a new job; INV-7 when a store is handed a slot a pending load still
        reads (the manager evicted a chunk in use: ``prepare_load`` pins it with ``ref_cnt``),
        or a load reads a slot a pending store is writing."""
        spec = tjob.dst_spec if job.is_store else tjob.src_spec
        ids = getattr(spec, "block_ids", None)
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

    def _write_slots(self, job: _Job) -> None:
        """A store completed: its chunks are in their slots."""
        for item, s in zip(job.items, self.job_slots.pop(job.jid, ())):
            self.slot_content[s] = job.contents.get(item[3])
            if self.slot_writer.get(s) == job.jid:
                del self.slot_writer[s]

    def _read_slot(self, job: _Job, x: int, item) -> Any:
        """What a completing load reads for its item ``x``: its slot's content (the key's, if
        the job's slots are not known)."""
        slots = self.job_slots.get(job.jid)
        if slots is None:
            return self.tier.get(item[3])
        s = slots[x]
        readers = self.slot_readers.get(s)
        if readers is not None:
            readers.discard(job.jid)
        if x == len(slots) - 1:
            del self.job_slots[job.jid]
        return self.slot_content.get(s)

    # -- partial-tail stores (INV-3, INV-4) -------------------------------------------------
    def _boot_tails(self) -> None:
        """``SchedulerOffloadConfig.supports_partial_tail`` (0.28.0+: align-mode Mamba whose
        block is larger than the hash block, one block per chunk, one block size): a boundary
        state handed over inside a block (``MambaManager`` CoW of a producer's partial tail,
        ``take_boundary_state_offloads``) is stored by ``_build_partial_tail_store_jobs`` as one
        job keying every group at the boundary: per group one block, the one at
        ``boundary // block_size`` (the CoW copy for the Mamba group). ``writer``: per block the
        request whose forward last left it partly written (the shadow names no identity for a
        partial block)."""
        self.partial_tails = bool(getattr(self.cs.config, "supports_partial_tail", False))
        # block -> the request appending to it while a partial-tail store of it is pending
        self.appending: dict[int, str] = {}
        self.writer: dict[int, str] = {}

    def _is_tail_job(self, keys: list, tpc: int) -> bool:
        """A group's part of a partial-tail store: one key, ending inside a chunk."""
        return self.partial_tails and len(keys) == 1 and (keys[0][0] + 1) * self.tph % tpc != 0

    def _is_tail(self, item) -> bool:
        return self.partial_tails and (item[2] + 1) * self.tph % \
            self.gcfg_by_id[item[0]].tokens_per_chunk != 0

    def _tail_item(self, gid: int, hk, blocks: list, starts: list, gi: int, tpc: int,
                   ident) -> tuple:
        """The item of a partial-tail store: the chunk the boundary falls in, its one block at
        the index ``block_indices`` gives (``boundary // block_size``)."""
        hidx, _ = hk
        end = (hidx + 1) * self.tph
        start = starts[gi] if gi < len(starts) else end // self.gcfg_by_id[gid].tokens_per_block
        return (gid, end // tpc, hidx, make_key(gid, ident.ident_at(end)),
                [(start, b) for b in blocks[:1]])

    def _chunk_items(self, job: _Job):
        """``job`` as INV-3 judges it: its partial-tail items (checked by content, INV-4, and by
        the one block each group gives) left out."""
        if not self.partial_tails:
            return job
        return SimpleNamespace(jid=job.jid, items=[x for x in job.items if not self._is_tail(x)])

    def _check_tail(self, job: _Job, item, content, req) -> inv.InvariantViolation | None:
        gid = item[0]
        b = item[4][0][1] if item[4] else None
        w = self.writer.get(b) if b is not None else None
        return inv.check_stored_tail(self.step_no, job, item, content, req,
                                     self.ident.get(w) if w is not None else None, self.tph,
                                     self.gcfg_by_id[gid].cow_source)

    def _note_writers(self, rid: str, written: list) -> None:
        """The blocks the forward of ``rid`` left partly written are its (the shadow keeps no
        identity for them)."""
        idents = self.shadow.idents
        for b in written:
            if idents[b] is None:
                self.writer[b] = rid
            else:
                self.writer.pop(b, None)

    def _apply_block_copies(self, out) -> None:
        """``SchedulerOutput.kv_cache_block_copies`` (the Mamba CoW of a partial tail): the
        worker copies each source block into its destination before the forward pass
        overwrites the source."""
        sh = self.shadow
        for cp in getattr(out, "kv_cache_block_copies", None) or ():
            src, dst = int(cp.src_block_id), int(cp.dst_block_id)
            sh.gids[dst], sh.ends[dst], sh.idents[dst] = sh.gids[src], sh.ends[src], \
                sh.idents[src]
            if src in self.writer:
                self.writer[dst] = self.writer[src]
            else:
                self.writer.pop(dst, None)

    # -- the shadow ------------------------------------------------------------------------
    def _tables(self, rid: str) -> list[list[int]]:
        mgrs = self.sched.kv_cache_manager.coordinator.single_type_managers
        out = []
        for m in mgrs:
            blocks = m.req_to_blocks.get(rid) or []
            out.append([b.block_id for b in blocks])
        return out

    def _read_store(self, job: _Job) -> None:
        if job.read:
            return
        job.read = True
        pr = self.pending_reads
        ident = self.ident[job.rid]
        for item in job.items:
            content = self.shadow.read(item[4])
            job.contents[item[3]] = content
            for _, b in item[4]:
                if self.appending.get(b) == job.rid:
                    del self.appending[b]
            for _, b in item[4]:
                s = pr.get(b)
                if s is not None:
                    s.discard(job.jid)
                    if not s:
                        del pr[b]
            if self._is_tail(item):
                v = self._check_tail(job, item, content, ident)
            else:
                v = inv.check_stored_chunk(self.step_no, job, item, content, ident, self.geo)
            if v is not None:
                raise v

    def _complete(self, job: _Job) -> None:
        job.done = True
        if job.is_store:
            self._read_store(job)
            for item in job.items:
                self.tier[item[3]] = job.contents.get(item[3])
            self._write_slots(job)
            return
        written = []
        for x, item in enumerate(job.items):
            content = self._read_slot(job, x, item)
            self.shadow.write(item[4], content or ())
            written.extend(b for _, b in item[4])
        v = inv.check_writes(self.step_no, written, self.pending_reads, f"load {job.jid}")
        if v is not None:
            raise v
        req = self.reqs[job.rid]
        if not req.is_finished():
            # check against where each destination block really sits in the request's table
            tables = self._tables(job.rid)
            pos = [{b: i for i, b in enumerate(t) if b != NULL} for t in tables]
            true = SimpleNamespace(jid=job.jid, items=[
                (gid, c, hidx, key, [(pos[gid].get(b, i), b) for i, b in blocks])
                for gid, c, hidx, key, blocks in job.items])
            ident = self.ident[job.rid]
            v = inv.check_loaded(self.step_no, true, ident, self.shadow, self.geo)
            if v is not None:
                raise v

    def _check_pool(self) -> None:
        """INV-1: every block's ``ref_cnt`` is the number of references its holders keep, and
        the free blocks are the rest of the pool; INV-2: a block two requests hold is a
        prefix-cache block."""
        pool = self.sched.kv_cache_manager.block_pool
        refs = self._references()
        blocks = pool.blocks
        for b, n in refs.items():
            blk = blocks[b]
            if blk.ref_cnt != n:
                raise inv.InvariantViolation("INV-1", self.step_no, f"block {b}: refcount "
                                             f"{blk.ref_cnt} but held {n} times")
            # one request may hold a block twice (an align-mode Mamba table naming its state
            # block at two positions, each a reference): only two requests share a slot
            if n > 1 and blk.block_hash is None:
                held_by = self._holders(b)
                if len(held_by) > 1:
                    raise inv.InvariantViolation("INV-2", self.step_no, f"block {b} held by "
                                                 f"{', '.join(sorted(held_by))} but not a "
                                                 "prefix-cache block")
        n_free = pool.get_num_free_blocks()
        if n_free + len(refs) != pool.num_gpu_blocks - 1:
            raise inv.InvariantViolation("INV-1", self.step_no, f"free {n_free} + held "
                                         f"{len(refs)} != pool {pool.num_gpu_blocks - 1}")

    def _req_to_blocks(self) -> list[dict]:
        return [m.req_to_blocks for m in
                self.sched.kv_cache_manager.coordinator.single_type_managers]

    def _references(self) -> Counter:
        """Per block id, the references kept on it: one per entry of a request's block table
        (a finished request may still hold its blocks: aborted during a load, they are freed
        when the load reports ``finished_recving``; a freed one has no entry), and the ones
        held off the tables. The null block is no one's."""
        refs: Counter = Counter()
        tables = self._req_to_blocks()
        for rid in self.reqs:
            for req_to_blocks in tables:
                refs.update(map(_block_id, req_to_blocks.get(rid, ())))
        # async scheduling: blocks of a freed request that a batch in flight may still write,
        # and the source blocks a Mamba copy-on-write retains until the step that copies them
        # ran, are returned to the pool only once that step's output is processed
        # (Scheduler._free_request_blocks, _free_cow_retained_blocks, deferred_frees)
        for _, held in getattr(self.sched, "deferred_frees", None) or ():
            refs.update(map(_block_id, held))
        for pinned in self._partial_tail_pins().values():
            refs.update(map(_block_id, pinned))
        refs.pop(NULL, None)
        return refs

    def _partial_tail_pins(self) -> dict:
        """0.27.0-0.28.0: the CoW copy of a producer's last-prompt-boundary Mamba state, handed
        to the connector for a partial-tail store, lives off the request's table, pinned for
        the request until its blocks are freed (KVCacheManager.take_partial_tail_offloads:
        "pinned here and unpinned when the request's blocks are freed", _partial_tail_pins):
        a reference the request holds."""
        return getattr(self.sched.kv_cache_manager, "_partial_tail_pins", None) or {}

    def _holders(self, b: int) -> set[str]:
        """The requests holding block ``b`` in their tables or pins (deferred frees are no
        request's)."""
        held = {rid for rid in self.reqs if any(b in ids for ids in self._tables(rid))}
        held.update(rid for rid, pinned in self._partial_tail_pins().items()
                    if any(blk.block_id == b for blk in pinned))
        return held

    # -- the loop --------------------------------------------------------------------------
    def _go(self) -> None:
        self._boot()
        self.loop_t0, self.loop_c0 = time.perf_counter(), time.process_time()
        case, sched = self.case, self.sched
        # a request aborted before it arrives is never sent (RequestSpec.withdrawn); its abort
        # counts it aborted
        arrivals = sorted(((r.arrival, i, r) for i, r in enumerate(case.requests)
                           if not r.withdrawn), key=lambda x: (x[0], x[1]))
        aborts = sorted(((r.abort_at, i, r.id) for i, r in enumerate(case.requests)
                         if r.abort_at is not None))
        events = sorted(case.events, key=lambda e: e.step)
        ai = bi = ei = 0
        unfinished = len(case.requests)
        t = arrivals[0][0] if arrivals else 0
        self.stall = 0
        RS = self.eng.RequestStatus
        # EngineCore's batch queue: depth 2 with async scheduling (step_with_batch_queue,
        # VllmConfig.max_concurrent_batches), else 1 (EngineCore.step)
        depth = 2 if case.layout.engine.async_scheduling else 1
        queue: deque = deque()
        while unfinished > 0 or sched.has_requests() or self._live_jobs() or queue:
            # completions are delivered in update_from_output; arrivals and aborts at t
            while ai < len(arrivals) and arrivals[ai][0] <= t:
                self._add_request(arrivals[ai][1], arrivals[ai][2])
                ai += 1
            while bi < len(aborts) and aborts[bi][0] <= t:
                rid = aborts[bi][2]
                bi += 1
                req = self.reqs.get(rid)
                if req is None:
                    unfinished -= 1
                    self.counters["aborted"] += 1
                    continue
                if rid in self.finished:
                    continue
                self._call("finish_requests", sched.finish_requests, [rid],
                           RS.FINISHED_ABORTED)
                self.finished.add(rid)
                unfinished -= 1
                self.counters["aborted"] += 1
                self.emit(f"finish {rid} aborted")
            while ei < len(events) and events[ei].step <= t:
                if unfinished > 0:      # (as the model: an event while the case is running)
                    self._case_event(events[ei])
                ei += 1
            if (unfinished <= 0 and not sched.has_requests() and not self._live_jobs()
                    and not queue):
                break
            if not sched.has_requests() and not self.cs._jobs and not self._live_jobs():
                if queue:
                    # EngineCore.step_with_batch_queue: nothing to schedule, the batch in
                    # flight is collected
                    progress, done = self._update(queue.pop())
                    unfinished = self._end_call(t, progress, done, unfinished,
                                                ai < len(arrivals) or bi < len(aborts))
                    t += 1
                    continue
                # idle: jump to the next arrival or abort
                nxt = ([x[0] for x in arrivals[ai:ai + 1]] + [x[0] for x in aborts[bi:bi + 1]]
                       + [e.step for e in events[ei:ei + 1]])
                if not nxt:
                    raise inv.InvariantViolation("INV-8", self.step_no,
                                                 f"{unfinished} requests never finished")
                t = max(t + 1, min(nxt))
                continue
            batch = self._schedule_execute(t)
            queue.appendleft(batch)
            if len(queue) < depth and (batch.executed or sched.has_requests()):
                # the batch queue is not full: schedule the next batch before collecting this one
                if self.checks == "full":
                    self._check_pool()
                self.emit("check ok")
                self._stall(batch.executed, ai < len(arrivals) or bi < len(aborts), unfinished)
                t += 1
                continue
            progress, done = self._update(queue.pop())
            unfinished = self._end_call(t, progress or batch.executed, done, unfinished,
                                        ai < len(arrivals) or bi < len(aborts))
            t += 1

    def _end_call(self, t: int, progress: bool, done: list, unfinished: int,
                  future: bool = False) -> int:
        """After ``update_from_output``: finished requests, pool check, trace, liveness."""
        tail = []
        for rid, req in self.reqs.items():
            if rid not in self.finished and req.is_finished():
                self.finished.add(rid)
                unfinished -= 1
                self.counters["finished"] += 1
                tail.append(f"finish {rid} finished")
        if self.checks == "full":
            self._check_pool()
        self.emit("check ok")
        # the model's order: FINISH events of step t, then completions due at t + 1
        self.lines.extend(tail)
        for job in done:
            self.emit(f"done {job.jid} {'store' if job.is_store else 'load'}")
        if self.failed is not None:
            job, reason = self.failed
            self.emit(f"failed {job.jid} {'store' if job.is_store else 'load'}")
            raise _TransferFailed(reason)
        self._stall(progress, future, unfinished)
        return unfinished

    def _stall(self, progress: bool, future: bool, unfinished: int) -> None:
        if progress or self._live_jobs() or future:
            self.stall = 0
        else:
            self.stall += 1
            if self.stall > STALL_STEPS and self._hung():
                self._end_hung()
            if self.stall > STALL_STEPS:
                stuck = [r for r in self.reqs if r not in self.finished][:5]
                raise inv.InvariantViolation("INV-8", self.step_no, f"no progress for "
                                             f"{self.stall} steps with the tier quiet; "
                                             f"stuck: {stuck}")
        if self.counters["steps"] >= self.step_cap:
            raise inv.InvariantViolation("INV-8", self.step_no, f"{unfinished} requests "
                                         f"unfinished after {self.step_cap} steps")

    def _live_jobs(self) -> bool:
        """A transfer is in flight that the worker will report (a job that never completes is
        none: it keeps the release's engine stepping, has_pending_push_work, and nothing
        else)."""
        return any(not j.done and j.due is not None for j in self.jobs.values())

    # -- jobs that never complete (timing.jobs, latency null) -------------------------------
    def _hung(self) -> list[_Job]:
        return [j for j in self.jobs.values() if j.due is None and not j.done]

    def _end_hung(self) -> None:
        """Nothing has moved for ``STALL_STEPS`` steps and only jobs that never complete are in
        flight (the release's engine would step on forever: ``Scheduler.has_requests`` holds
        while the connector has jobs, ``has_pending_push_work``). The run stops with
        ``end waiting on ...`` when every unfinished request is held back by them
        (``inv.held_back``); one that is not is stuck for another reason (INV-8)."""
        hung = [(j.jid, j.is_store, j.rid) for j in self._hung()]
        running = self.eng.RequestStatus.RUNNING
        held = [(rid, inv.held_back(rid, self.reqs[rid].status == running,
                                    rid in self.deferred and self._defers_on_hung(rid), hung))
                for rid in self.reqs if rid not in self.finished]
        v = inv.check_hung_end(self.step_no, self.stall, hung, held)
        if v is not None:
            raise v
        raise _Ended(fmt_hung_end([(jid, is_store) for jid, is_store, _ in hung], held))

    def _defers_on_hung(self, rid: str) -> bool:
        """A deferred lookup of ``rid`` waits on a job that never completes: one of its own
        (``get_num_new_matched_tokens`` defers while the request has transfer jobs), or one
        holding a chunk of its prompt (a store's chunk is HIT_PENDING in the CPU tier until it
        completes, ``_maximal_prefix_lookup`` / ``_sliding_window_lookup`` defer on it; a
        load's is in ``_chunks_being_loaded``)."""
        hung = self._hung()
        if not hung:
            return False
        if any(j.rid == rid for j in hung):
            return True
        keys = {item[3] for j in hung for item in j.items}
        ident = self.ident[rid]
        for g in self.gcfgs:
            tpc = g.tokens_per_chunk
            for c in range(len(ident.tokens) // tpc):
                if make_key(g.group_id, ident.ident_at((c + 1) * tpc)) in keys:
                    return True
        return False

    def _schedule_execute(self, t: int) -> SimpleNamespace:
        """``schedule()`` and the worker's execution of the batch; its output is applied by
        :meth:`_update` (at once, or after the next schedule with async scheduling)."""
        sched, case = self.sched, self.case
        self.step_no = step = self.counters["steps"]
        self.counters["steps"] += 1
        self.emit(f"step {step}")
        # the requests' computed counts before the step, for the shadow
        before = {rid: r.num_computed_tokens for rid, r in self.reqs.items()}
        try:
            out = self._call("schedule", sched.schedule)
        except _Crash as c:
            # a lookup that went wrong earlier in this schedule() is the first bad operation;
            # what vLLM raised after it is its consequence, named in the finding
            v = self.lookup_finding
            if v is None:
                raise
            raise inv.InvariantViolation(v.inv_id, v.step, f"{v.detail} (then "
                                         f"{type(c.exc).__name__} in {c.stage})", v.op) from c
        if self.lookup_error is not None:
            raise self.lookup_error
        if self.lookup_finding is not None:
            raise self.lookup_finding
        # --- what was scheduled
        new_ids = {}
        for nr in out.scheduled_new_reqs:
            new_ids[nr.req_id] = [list(b) for b in nr.block_ids]
            before[nr.req_id] = nr.num_computed_tokens
        cached = out.scheduled_cached_reqs
        c_ids = list(getattr(cached, "req_ids", []) or [])
        for k, rid in enumerate(c_ids):
            nb = cached.new_block_ids[k]
            new_ids[rid] = ([list(b) for b in nb] if nb is not None
                            else [[] for _ in self.shadow_groups])
            before[rid] = cached.num_computed_tokens[k]
        preempted = sorted(getattr(out, "preempted_req_ids", None) or ())
        for rid in preempted:
            self.emit(f"preempt {rid}")
            self.counters["preemptions"] += 1
        meta = getattr(out, "kv_connector_metadata", None)
        load_jobs = dict(getattr(meta, "load_jobs", None) or {}) if meta is not None else {}
        store_jobs = dict(getattr(meta, "store_jobs", None) or {}) if meta is not None else {}
        flush = set(getattr(meta, "jobs_to_flush", None) or ()) if meta is not None else set()
        for n, jid in enumerate(sorted(load_jobs), self.counters["loads"]):
            tj = load_jobs[jid]
            status = self.cs._jobs.get(jid)
            items = self._job_items(jid, tj, status, False) if status is not None else []
            # the worker reports it done its latency after (Timing.jobs: by order of creation)
            job = _Job(jid, tj.req_id, False, items, _due(t, case.timing.latency("load", n)))
            self.jobs[jid] = job
            if case.fault("load", n) is not None:
                self.faulted[jid] = ("load", meta)
            self.emit(fmt_job(job))
            self._check_caps(step, job)
            self._bind_slots(step, job, tj)
            for item in items:
                if item[3] not in self.tier:
                    raise inv.InvariantViolation(
                        "INV-7", step, f"load of chunk g{item[0]}:{item[2]} whose store has "
                        "not completed")
        self.counters["loads"] += len(load_jobs)
        scheduled = dict(out.num_scheduled_tokens)
        for rid, n in scheduled.items():
            self.counters["scheduled_tokens"] += n
            self.emit(f"sched {rid} {n}")
            per_group = new_ids.get(rid) or [[] for _ in self.shadow_groups]
            self.emit(fmt_alloc(rid, per_group))
        new_stores = []
        for n, jid in enumerate(sorted(store_jobs), self.counters["stores"]):
            tj = store_jobs[jid]
            status = self.cs._jobs.get(jid)
            items = self._job_items(jid, tj, status, True) if status is not None else []
            job = _Job(jid, tj.req_id, True, items, _due(t, case.timing.latency("store", n)))
            self.jobs[jid] = job
            if case.fault("store", n) is not None:
                self.faulted[jid] = ("store", meta)
            new_stores.append(job)
            self.emit(fmt_job(job))
            self._check_caps(step, job)
            self._bind_slots(step, job, tj)
            v = inv.check_store_job(step, self._chunk_items(job), self.geo)
            if v is not None:
                raise v
        self.counters["stores"] += len(store_jobs)
        if flush:
            self.emit("flush " + ",".join(map(str, sorted(flush))))
            for jid in sorted(flush):
                job = self.jobs.get(jid)
                if job is not None and not job.done and job.due is None:
                    # the worker waits for a flushed job before the step runs (handle_preemptions:
                    # worker.wait(jobs_to_flush), a CUDA event synchronize): on one that never
                    # completes it waits forever, and the engine never finishes this step
                    raise _Ended(fmt_hung_flush(jid, job.is_store))
            for jid in sorted(flush):
                job = self.jobs.get(jid)
                if job is not None and job.is_store and not job.done:
                    self._read_store(job)
                    job.due = t          # the worker finishes it in this step
        self._apply_block_copies(out)
        # --- execute: write what the forward pass computes; sample
        sampled: dict[str, list[int]] = {}
        seed = case.seed
        pr = self.pending_reads
        spec_sched = dict(getattr(out, "scheduled_spec_decode_tokens", None) or {})
        for rid, n in scheduled.items():
            ident = self.ident[rid]
            start = before.get(rid, 0)
            ident.tables = self._tables(rid)
            drafts = list(spec_sched.get(rid, ()))
            d = len(drafts)
            accepted: list[int] = []
            samples = start + n >= len(ident.tokens) + d
            if samples and d:
                # verification: the first accepted drafts are the request's next tokens (the
                # worker proposed them so); the slots of rejected drafts hold KV of no token;
                # padding drafts (-1, a new decode request padded to 1 + k tokens) never match
                if all(x == -1 for x in drafts):
                    a = 0
                else:
                    spec = case.requests[self.index[rid]]
                    k = self.verified.get(rid, 0)
                    self.verified[rid] = k + 1
                    a = spec.accepted(k, d)
                base = len(ident.tokens)
                accepted = [sampled_token(seed, self.index[rid], base + j) for j in range(a)]
                ident.append_tokens(accepted[:max(0, ident.max_tokens - base)])
            written = self.shadow.write_computed(ident, self.shadow_groups, start, start + n)
            self._note_writers(rid, written)
            if pr:
                own = [b for b in written if self.appending.get(b) != rid]
                v = inv.check_writes(step, own, pr, f"request {rid}")
                if v is not None:
                    raise v
            # the worker samples when the batch reaches the end of the tokens it knows (under
            # async scheduling it knows the tokens the scheduler has not received yet)
            if samples:
                pos = start + n - d + len(accepted)
                tok = sampled_token(seed, self.index[rid], pos)
                sampled[rid] = accepted + [tok]
                if len(ident.tokens) < ident.max_tokens:
                    ident.append_tokens([tok])
            else:
                sampled[rid] = []
        for job in new_stores:
            if not job.read:
                for item in job.items:
                    for _, b in item[4]:
                        pr.setdefault(b, set()).add(job.jid)
                    if self._is_tail(item) and not self.gcfg_by_id[item[0]].cow_source:
                        # an attention block of a partial tail is stored while its request
                        # goes on appending to it past the boundary: the stored tokens stay
                        for _, b in item[4]:
                            self.appending[b] = job.rid
        # --- completions reported by this step's worker output
        done = [j for j in self.jobs.values()
                if not j.done and j.due is not None and j.due <= t + 1]
        done.sort(key=lambda j: j.jid)
        failing = [j for j in done if j.jid in self.faulted]
        if failing:
            self._fail(failing[0])
            done = []           # the worker raised before it reported any job of the step
        for job in done:
            self._complete(job)
        return SimpleNamespace(out=out, order=list(scheduled), sampled=sampled, done=done,
                               executed=bool(scheduled))

    def _fail(self, job: _Job) -> None:
        """A job of the case's faults is due: the release's own offloading worker is handed
        its failure (:mod:`transfer_faults`). Where it raises, the run stops after this step
        (:meth:`_end_call`), as the engine would; a release whose worker takes the failure
        would go on to recover, which the harness does not play yet: unsupported."""
        from simsched.vllm.inside import transfer_faults
        kind, meta = self.faulted[job.jid]
        raised = transfer_faults.worker_refusal(self.sched, self.vc, self.kvc, meta, job.jid)
        if raised is None:
            raise self.eng.Unsupported(
                f"{kind} job {job.jid} failed and this release's offloading worker took the "
                "failure without raising; simsched does not drive the recovery that follows")
        self.failed = (job, f"the offloading worker does not support failed transfers: {kind} "
                            f"job {job.jid} failed ({raised})")

    def _check_reloads(self, order: list[str], done: list) -> None:
        """INV-8 on loads: a request loaded again and again without ever running. A completed
        load counts as progress for the stall check, so without this a request whose loaded
        tokens are dropped (``_update_waiting_for_remote_kv`` sets ``num_computed_tokens`` to
        ``num_tokens - 1``, 0 for a one-token prompt, and the next ``schedule()`` takes it for
        a new request) keeps the run going until the step cap."""
        for rid in order:
            self.loads_unscheduled.pop(rid, None)
        for job in done:
            if job.is_store:
                continue
            n = self.loads_unscheduled[job.rid] = self.loads_unscheduled.get(job.rid, 0) + 1
            if n > MAX_LOADS_UNSCHEDULED:
                raise inv.InvariantViolation(
                    "INV-8", self.step_no, f"{job.rid}: loaded {n} times without being "
                    f"scheduled in between", op="load")

    def _update(self, batch: SimpleNamespace) -> tuple[bool, list]:
        """``update_from_output`` with the worker output of ``batch``: sampled tokens and the
        connector's output (store completions through the worker metadata's completed jobs,
        loads also through ``finished_recving``)."""
        eng, done, order = self.eng, batch.done, batch.order
        completed: dict[int, int] = {}
        recving: set[str] = set()
        for job in done:
            completed[job.jid] = 1
            if not job.is_store:
                recving.add(job.rid)
        kvo = None
        if completed or recving:
            wm = eng.WorkerMeta(completed_jobs=completed) if eng.WorkerMeta else None
            kvo = eng.KVConnectorOutput(finished_recving=recving or None,
                                        kv_connector_worker_meta=wm)
        mro = eng.ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=[batch.sampled[r] for r in order], kv_connector_output=kvo,
            **({"logprobs": None} if "logprobs" in eng.mro_params else {}))
        self._call("update_from_output", self.sched.update_from_output, batch.out, mro)
        self._check_reloads(order, done)
        for job in done:    # now the scheduler knows: what INV-9's oracle may count on
            self.req_done[job.rid] = self.step_no
            for item in job.items:
                self.key_done[item[3]] = self.step_no
                if job.is_store:
                    self.reported.add(item[3])
        if self.num_spec and order and eng.DraftTokenIds is not None:
            self._propose_drafts(batch.out, order)
        return bool(order) or bool(done), done

    def _propose_drafts(self, out, order: list[str]) -> None:
        """The drafter after an executed step (``EngineCore.post_step``): ``k`` drafts for every
        request of the batch, the tokens that follow the request's known ones (whether the
        worker accepts them is the case's ``accept`` pattern); ``k`` is the scheduler's
        ``num_spec_tokens_to_schedule`` where it has one, none when it says ``skip_drafts``. The
        scheduler drops drafts of requests that are finished or in a prefill chunk."""
        k = getattr(out, "num_spec_tokens_to_schedule", None)
        k = self.num_spec if k is None else int(k)
        if getattr(out, "skip_drafts", False):
            k = 0
        seed = self.case.seed
        drafts = []
        for rid in order:
            req = self.reqs[rid]
            base = req.num_tokens
            drafts.append([sampled_token(seed, self.index[rid], base + j) for j in range(k)])
        self._call("update_draft_token_ids", self.sched.update_draft_token_ids,
                   self.eng.DraftTokenIds(list(order), drafts))


class _BareRun:
    """The real Scheduler (+ KVCacheManager + OffloadingConnector) driven through a case by the
    smallest worker side that keeps it going, for speed measurements (``bench/bench_model.py
    --real``): per step ``schedule()``, one sampled token per request whose prefill completes
    (``sampled_token``, as :class:`_Run`), transfer completions reported as :class:`_Run` does (a job
    due ``latency`` steps after its creation, flushed jobs at once), ``update_from_output()``.
    No trace, no content shadow, no invariant check. The real ``Request`` objects (prompt block
    hashes included) are built before the timed loop; ``loop_wall``/``loop_cpu`` time the loop
    only (boot and request construction excluded), run with the start-up heap frozen as
    EngineCore runs the Scheduler."""

    def __init__(self, eng: RealEngine, case: Case, step_cap: int):
        self.eng, self.case, self.step_cap = eng, case, step_cap

    def go(self) -> dict:
        eng, case = self.eng, self.case
        vc, kvc, sched, sbs, tph = eng.boot(case)
        hasher = eng.probe.hasher(vc, tph)
        reqs = {}
        for i, spec in enumerate(case.requests):
            sp = eng.SamplingParams(max_tokens=spec.decode, ignore_eos=True)
            reqs[spec.id] = (i, spec, eng.probe.Request(
                request_id=spec.id, prompt_token_ids=spec.prompt_tokens(), sampling_params=sp,
                pooling_params=None, arrival_time=float(i), block_hasher=hasher))
        arrivals = sorted(((spec.arrival, i, r) for i, spec, r in reqs.values()),
                          key=lambda x: (x[0], x[1]))
        aborts = sorted((spec.abort_at, i, spec.id) for i, spec, _ in reqs.values()
                        if spec.abort_at is not None)
        timing, seed = case.timing, case.seed
        store_lat, load_lat = timing.store_latency, timing.load_latency
        WorkerMeta, KVO, MRO = eng.WorkerMeta, eng.KVConnectorOutput, eng.ModelRunnerOutput
        extra = {"logprobs": None} if "logprobs" in eng.mro_params else {}
        aborted = eng.RequestStatus.FINISHED_ABORTED
        counters = {"steps": 0, "stores": 0, "loads": 0, "preemptions": 0, "finished": 0,
                    "aborted": 0, "scheduled_tokens": 0}
        pending: dict[int, tuple[int, str | None]] = {}   # job id -> (due, rid for a load)
        finished: set[str] = set()
        unfinished = len(reqs)
        ai = bi = 0
        t = arrivals[0][0] if arrivals else 0
        # EngineCore freezes its start-up heap once the engine is built (``freeze_gc_heap``: a
        # full collection, then ``gc.freeze()``), so that the Scheduler serves with the cyclic
        # collector no longer walking torch's and vLLM's objects (unfrozen, a full collection
        # here walks about 615,000 of them): timed likewise, and unfrozen after the loop
        gc.collect()
        gc.freeze()
        try:
            c0, w0 = time.process_time(), time.perf_counter()
            while unfinished > 0 or sched.has_requests() or pending:
                while ai < len(arrivals) and arrivals[ai][0] <= t:
                    if arrivals[ai][2].request_id not in finished:    # not aborted before arrival
                        sched.add_request(arrivals[ai][2])
                    ai += 1
                while bi < len(aborts) and aborts[bi][0] <= t:
                    rid = aborts[bi][2]
                    bi += 1
                    if rid not in finished:
                        if reqs[rid][1].arrival <= t:
                            sched.finish_requests([rid], aborted)
                        finished.add(rid)
                        unfinished -= 1
                        counters["aborted"] += 1
                if not sched.has_requests() and not pending:
                    nxt = [x[0] for x in arrivals[ai:ai + 1]] + [x[0] for x in aborts[bi:bi + 1]]
                    if not nxt:
                        break
                    t = max(t + 1, min(nxt))
                    continue
                out = sched.schedule()
                counters["steps"] += 1
                counters["preemptions"] += len(getattr(out, "preempted_req_ids", None) or ())
                meta = out.kv_connector_metadata
                if meta is not None:
                    for jid, tj in (getattr(meta, "load_jobs", None) or {}).items():
                        pending[jid] = (t + load_lat, tj.req_id)
                        counters["loads"] += 1
                    for jid in getattr(meta, "store_jobs", None) or {}:
                        pending[jid] = (t + store_lat, None)
                        counters["stores"] += 1
                    for jid in getattr(meta, "jobs_to_flush", None) or ():
                        if jid in pending:
                            pending[jid] = (t, pending[jid][1])
                scheduled = out.num_scheduled_tokens
                order = list(scheduled)
                sampled = []
                for rid in order:
                    counters["scheduled_tokens"] += scheduled[rid]
                    req = reqs[rid][2]
                    # schedule() has advanced num_computed_tokens: the prefill is complete
                    sampled.append([sampled_token(seed, reqs[rid][0], req.num_tokens)]
                                   if req.num_computed_tokens >= req.num_tokens else [])
                kvo = None
                done = [jid for jid, (due, _) in pending.items() if due <= t + 1]
                if done:
                    recving = {pending[j][1] for j in done if pending[j][1] is not None}
                    for j in done:
                        del pending[j]
                    wm = WorkerMeta(completed_jobs=dict.fromkeys(done, 1)) if WorkerMeta else None
                    kvo = KVO(finished_recving=recving or None, kv_connector_worker_meta=wm)
                mro = MRO(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                          sampled_token_ids=sampled, kv_connector_output=kvo, **extra)
                sched.update_from_output(out, mro)
                for rid in order:
                    if rid not in finished and reqs[rid][2].is_finished():
                        finished.add(rid)
                        unfinished -= 1
                        counters["finished"] += 1
                if counters["steps"] >= self.step_cap:
                    return {"status": "stuck", "counters": counters}
                t += 1
            return {"status": "ok", "counters": counters, "loop_cpu": time.process_time() - c0,
                    "loop_wall": time.perf_counter() - w0}
        finally:
            gc.unfreeze()


def _due(t: int, latency: int | None) -> int | None:
    """When the worker reports a job created at ``t``: None for one that never completes."""
    return None if latency is None else t + latency


def _cap_memory() -> None:
    """RLIMIT_AS: the worker's address space may grow by SIMSCHED_WORKER_MEM_MB (default
    8192) beyond what it holds once vLLM is imported; past that, allocations fail (MemoryError)
    instead of taking the machine down, and a worker killed for memory is a recorded finding."""
    try:
        import resource
        cap_mb = int(os.environ.get("SIMSCHED_WORKER_MEM_MB", "8192"))
        if cap_mb <= 0:
            return
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = vm + cap_mb * (1 << 20)
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (OSError, ValueError, ImportError):
        pass


def _vllm_version() -> str:
    try:
        import vllm
        return vllm.__version__
    except Exception:  # noqa: BLE001
        return "?"


__all__ = ["RealEngine", "DEFAULT_STEP_CAP"]
