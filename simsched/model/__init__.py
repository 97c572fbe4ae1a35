"""The model: a discrete-event model of vLLM's scheduler with the ``OffloadingConnector``, one
module per vLLM module it mirrors.

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
``cpu_manager``                    ``v1/kv_offload/cpu/manager.py`` and its LRU policies
``scheduler``                      ``v1/core/sched/scheduler.py`` (``Scheduler.schedule``,
                                   ``update_from_output``) and the model runner's writes
=================================  =============================================================

The content shadow, the invariants and the trace (``simsched.shadow``, ``simsched.invariants``,
``simsched.trace``) are shared with the real runs and sit beside this package.
"""

__all__ = ["MAX_STEPS", "STALL_STEPS", "Model", "RunResult", "cli_run", "collector_paused",
           "crash_finding", "resolve_profile", "run_case"]


def unmodelled_knobs(layout) -> list[str]:
    """The knobs ``layout`` sets that the model does not mirror: the model runs as if they had
    their default, and a step where a release differs from it on such a case is the model's gap,
    named after the knob. The CPU tier's ARC policy (``policies/arc.py``) is not modelled."""
    out = []
    if layout.engine.eviction_policy != "lru":
        out.append(f"engine.eviction_policy={layout.engine.eviction_policy}")
    return out


def __getattr__(name: str):
    """The scheduler's public names, imported on first use: the modules the oracles share
    (``block_pool``, ``request``) import without the whole model."""
    if name in __all__:
        from simsched.model import scheduler
        return getattr(scheduler, name)
    raise AttributeError(f"module 'simsched.model' has no attribute {name!r}")
