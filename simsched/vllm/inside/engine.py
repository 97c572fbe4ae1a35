"""The release worker's engine (ops ``run_case``, ``plan``, ``boot_retention``): the vLLM
classes a run needs, the boot of a real ``Scheduler`` for a case, and the checks the engine
core makes before it builds one.

Runs inside a release worker only (:mod:`simsched.vllm.inside.main`). A case's layout of layers
is planned into KV cache groups by the release's own planner (:meth:`RealEngine.plan_case`);
the release's start-up checks may refuse it (:mod:`~simsched.vllm.inside.startup`); then
:class:`~simsched.vllm.inside.run.Run` drives the booted ``Scheduler`` through the case and
checks the invariants on the real run, or :class:`~simsched.vllm.inside.bare_run.BareRun` times
it bare.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from typing import Any

from simsched.case import Case
from simsched.geometry import max_model_len
from simsched.layout import Layout, LayoutError
from simsched.vllm.inside import startup
from simsched.vllm.inside.bare_run import BareRun
from simsched.vllm.inside.build import path_module
from simsched.vllm.inside.offloading import OffloadingConnectorDriver
from simsched.vllm.inside.run import Run

DEFAULT_STEP_CAP = 20_000


class RealEngine:
    """One per worker; :meth:`run_case` builds a fresh Scheduler per case."""

    def __init__(self, probe):
        from vllm.config import SchedulerConfig  # noqa: F401 - import check
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import RequestStatus

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
        self.RequestStatus = RequestStatus
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

    def connector_driver(self, sched, tph: int, case: Case):
        """The driver of the booted scheduler's KV connector
        (:mod:`~simsched.vllm.inside.connector`), the one the case's ``kv_transfer_config``
        names (:meth:`~simsched.vllm.inside.build.ConfigBuilder.kv_transfer`): the
        ``OffloadingConnector``'s, or that of the case's connector path, each in the module of
        its name (:func:`~simsched.vllm.inside.build.path_module`)."""
        module = path_module(case.layout)
        if module is None:
            return OffloadingConnectorDriver(sched, tph)
        return module.driver(sched, tph, case)

    def boot_retention(self, case_json: dict) -> dict:
        """The retention interval each side of the booted engine reads (op ``boot_retention``):
        ``cache_config``, the ``KVCacheConfig``, the KV cache manager's coordinator (0.29.0+)
        and the connector's scheduler config (0.30.0+); ``"absent"`` where the release has no
        such field. An unsupported case: ``{"unsupported": reason}``."""
        try:
            case = Case.from_json(case_json)
            vc, kvc, sched, _, tph = self.boot(case)
        except self.Unsupported as e:
            return {"unsupported": str(e)}
        sides = {"cache_config": vc.cache_config, "kv_cache_config": kvc}
        name = "prefix_cache_retention_interval"
        out = {side: getattr(obj, name, "absent") for side, obj in sides.items()}
        out["kv_cache_manager"] = getattr(sched.kv_cache_manager.coordinator,
                                          "retention_interval", "absent")
        out["connector"] = getattr(self.connector_driver(sched, tph, case).config,
                                   "retention_interval", "absent")
        return out

    # -- the run ---------------------------------------------------------------------------
    def run_case(self, case_json: dict, mutant: str | None = None,
                 step_cap: int = DEFAULT_STEP_CAP, checks: str = "full",
                 bare: bool = False) -> dict:
        """The checked run of a case (:class:`~simsched.vllm.inside.run.Run`), ``mutant``
        patched into the release around it. ``bare=True``: the bare Scheduler's speed
        (:class:`~simsched.vllm.inside.bare_run.BareRun`), no trace, no shadow, no checks; the
        result has ``loop_wall``/``loop_cpu`` seconds of the scheduler loop."""
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
            out = BareRun(self, case, step_cap).go()
            out["wall"] = time.perf_counter() - t0
            return out
        undo = None
        if mutant:
            from simsched.vllm.inside import mutants
            undo = mutants.apply(mutant)
        try:
            run = Run(self, case, step_cap, checks)
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
            kvc = self.builder.planner.plan(layout, startup.checked_config(case, vc))
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
        run before any Scheduler is built: the KV cache pool
        (:func:`~simsched.vllm.inside.startup.kv_memory_refusal`), then
        ``VllmConfig.validate_block_size``
        (:func:`~simsched.vllm.inside.startup.block_size_refusal`). The first refusal's message,
        or None."""
        try:
            vc, kvc = self.build(case)
        except self.Unsupported:
            return None             # the run says so
        except self.Refused as e:   # a layout of layers: the release's planner ran the check
            return str(e)
        if case.layout.layers:
            return startup.block_size_refusal(case, vc, kvc)
        holds_null = self.builder.planner.holds_null_block
        return (startup.kv_memory_refusal(case, vc, kvc, holds_null)
                or startup.block_size_refusal(case, vc, kvc))

    def build(self, case: Case):
        """The case's (VllmConfig, KVCacheConfig); a layout of layers planned by the release
        with the config its start-up checks see
        (:func:`~simsched.vllm.inside.startup.checked_config`)."""
        return self.builder.build(case.layout,
                                  planning=lambda vc: startup.checked_config(case, vc))

    def crash_info(self, stage: str, exc: BaseException) -> dict:
        return self.probe.error(stage, exc)


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


__all__ = ["RealEngine", "DEFAULT_STEP_CAP"]
