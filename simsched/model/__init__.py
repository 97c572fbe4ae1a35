"""The model: a discrete-event model of vLLM's scheduler with the ``OffloadingConnector`` (alone,
or beside NIXL in a ``MultiConnector``) or the ``SimpleCPUOffloadConnector``, one module per
vLLM module it mirrors.

=================================  =============================================================
module                             mirrors (``vllm/...``)
=================================  =============================================================
``events``                         the engine's step loop, as a ``(time, priority, sequence)``
                                   event queue
``request``                        ``v1/request.py``; the block hashes and offload keys
``block_pool``                     ``v1/core/block_pool.py``, ``FreeKVCacheBlockQueue``
``single_type_kv_cache_manager``   ``v1/core/single_type_kv_cache_manager.py``
``kv_cache_manager``               ``v1/core/kv_cache_manager.py``, ``kv_cache_coordinator.py``
``offloading_scheduler``           ``distributed/kv_transfer/kv_connector/v1/offloading/
                                   scheduler.py`` (``OffloadingConnectorScheduler``)
``offloading_common``              ``.../offloading/common.py`` (``TransferJob``: ``Job``)
``cpu_manager``                    ``v1/kv_offload/cpu/manager.py`` and its LRU policies
``tiering_manager``                ``v1/kv_offload/tiering/manager.py``
                                   (``TieringOffloadingManager``, 0.30.0+: the CPU tier as
                                   primary of secondary tiers, ``engine.secondary_tiers``)
``fs_tier``                        ``.../tiering/fs/manager.py``, ``async_lookup.py``
                                   (``FileSystemTierManager`` and its lookup probes)
``multi_connector``                ``.../kv_connector/v1/multi_connector.py``
                                   (``MultiConnector``: a P/D decode instance's children)
``nixl_scheduler``                 ``.../kv_connector/v1/nixl/pull_scheduler.py``
                                   (``NixlPullConnectorScheduler``: pulls of remote prefills)
``simple_cpu_scheduler``           ``v1/simple_kv_offload/manager.py``
                                   (``SimpleCPUOffloadScheduler``, 0.30.0+: a CPU block pool
                                   looked up by a coordinator of its own)
``simple_cpu_scheduler_legacy``    the same module as 0.25.1-0.29.0 have it (no finish flush,
                                   loads placed by the hashed full-attention blocks)
``scheduler``                      ``v1/core/sched/scheduler.py`` (``Scheduler.schedule``,
                                   ``update_from_output``) and the model runner's writes
``async_scheduler``                ``v1/core/sched/async_scheduler.py`` (``AsyncScheduler``) and
                                   the engine core's batch queue
                                   (``EngineCore.step_with_batch_queue``)
``run``                            no vLLM module: ``run_case`` runs a case (the engine's start-up
                                   checks, then the model) and returns its ``RunResult``
=================================  =============================================================

The content shadow, the invariants and the trace (``simsched.shadow``, ``simsched.invariants``,
``simsched.trace``) are shared with the real runs and sit beside this package.
"""

import importlib

#: the model's public names, by the module that holds them
_MODULE_OF = {"MAX_STEPS": "scheduler", "STALL_STEPS": "scheduler", "Model": "scheduler",
              "RunResult": "run", "cli_run": "run", "collector_paused": "run",
              "crash_finding": "run", "resolve_profile": "run", "run_case": "run"}
__all__ = list(_MODULE_OF)


def unmodelled_path(layout, profile=None) -> str | None:
    """The connector path of ``layout`` the model does not mirror (``simsched.connectors``), or
    None: the model is the ``OffloadingConnector`` with a CPU tier, alone or in a
    ``MultiConnector`` beside NIXL, with file-system tiers behind the CPU tier
    (``TieringOffloadingManager``), and the ``SimpleCPUOffloadConnector`` on the layouts
    :data:`~simsched.model.simple_cpu_scheduler.MODELLED_KINDS` covers (0.30.0+'s manager, and
    0.25.1-0.29.0's in ``simple_cpu_scheduler_legacy``). ``profile``: the release whose code
    counts; every release's model covers the same paths today. A case on another path is
    checked on the real run alone, by the invariants that need no model (the content shadow,
    the fences, liveness, the hit oracle): no model run, no lockstep comparison."""
    engine = layout.engine
    kind = engine.connector.kind
    if kind == "multi":
        # NIXL's pulls of a model with multi-module MTP stop short of its lookahead (0.31.0+)
        if engine.speculative is not None and engine.speculative.method == "mtp":
            return f"engine.connector={engine.connector.describe()} with MTP"
    elif kind == "simple_cpu":
        gap = _simple_cpu_gap(layout, profile)
        if gap is not None:
            return f"engine.connector={engine.connector.describe()} with {gap}"
    elif kind != "offloading":
        return f"engine.connector={engine.connector.describe()}"
    return None


def predicts_config(layout) -> bool:
    """The model predicts the case's config chain (``geometry.config_outcome``): the
    OffloadingConnector's, alone or as a MultiConnector's child, on a path it mirrors. The
    SimpleCPUOffloadConnector has no such chain (its manager is built with the scheduler)."""
    return unmodelled_path(layout) is None and layout.engine.connector.kind != "simple_cpu"


def _simple_cpu_gap(layout, profile=None) -> str | None:
    """What of ``layout`` the SimpleCPU model leaves out, if anything (``profile``: the
    release's; None, 0.33.0's rules). Of the Mamba layouts: fine-grained hash hits
    (``geometry.partial_hash_hits``), whose producer partial-tail copy the GPU side hands over
    (``MambaManager._cache_partial_tail_block`` and ``allocate_new_blocks``'
    ``move_block_hashes``, single_type_kv_cache_manager.py 0.30.0:1890-1925, 2039-2127; not
    modelled on any path); and by ``profile.extra["simple_cpu_mamba"]``, on 0.27.0-0.27.1
    ("plain") speculative decoding (the CPU lookup of a Mamba state under ngram drafts) and DCP
    (prefill chunks of a Mamba layout under DCP), gaps of the OffloadingConnector's path too
    but one, and every Mamba layout on 0.25.1-0.26.0 ("none": those, and the GPU prefix hits
    of eager offload after a store that never completes)."""
    from simsched.model.simple_cpu_scheduler import MODELLED_KINDS
    other = sorted({g.kind for g in layout.groups if g.kind not in MODELLED_KINDS})
    if other:
        return "+".join(other) + " groups"
    if not any(g.kind == "mamba" for g in layout.groups):
        return None
    from simsched.profiles import DEFAULT_PROFILE, PROFILES
    profile = profile if profile is not None else PROFILES[DEFAULT_PROFILE]
    rule = profile.extra.get("simple_cpu_mamba", "modelled")
    if rule == "none":
        return "mamba groups (0.25.1-0.26.0)"
    if rule == "plain" and layout.engine.speculative is not None:
        return "mamba groups and speculative decoding (0.27.0-0.27.1)"
    if rule == "plain" and layout.engine.dcp_size > 1:
        return "mamba groups under DCP (0.27.0-0.27.1)"
    if _fine_grained_hash_hits(layout, profile):
        return "mamba groups with fine-grained hash hits"
    return None


def _fine_grained_hash_hits(layout, profile) -> bool:
    """``geometry.partial_hash_hits`` of the case's geometry (False where the release refuses
    the block sizes: no run to model)."""
    from simsched.geometry import partial_hash_hits, resolve_block_sizes
    from simsched.profiles import ConfigError
    try:
        _, tokens_per_hash = resolve_block_sizes(layout, profile)
    except ConfigError:
        return False
    return partial_hash_hits(layout, profile, tokens_per_hash)


def unmodelled_knobs(layout) -> list[str]:
    """The knobs ``layout`` sets that the model does not mirror: the model runs as if they had
    their default, and a step where a release differs from it on such a case is the model's gap,
    named after the knob. The CPU tier's ARC policy (``policies/arc.py``) is not modelled."""
    out = []
    if layout.engine.eviction_policy != "lru":
        out.append(f"engine.eviction_policy={layout.engine.eviction_policy}")
    return out


def __getattr__(name: str):
    """The model's public names, imported on first use: the modules the oracles share
    (``block_pool``, ``request``) import without the whole model."""
    if name in _MODULE_OF:
        module = importlib.import_module(f"simsched.model.{_MODULE_OF[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'simsched.model' has no attribute {name!r}")
