"""The release's own start-up checks, run on the case's configuration before any ``Scheduler``
is built (:meth:`simsched.vllm.inside.engine.RealEngine.startup_refusal` runs them in
``EngineCore._initialize_kv_caches``' order): the KV cache pool for the case's
``max_model_len`` (:func:`kv_memory_refusal`), then ``VllmConfig.validate_block_size``
(:func:`block_size_refusal`). Each returns the release's refusal message, or None."""

from __future__ import annotations

import copy
import importlib

from simsched.case import Case
from simsched.geometry import estimate_max_model_len, max_model_len


def checked_config(case: Case, vc):
    """A copy of ``vc`` as the engine's start-up checks see it: the case's
    ``max_model_len`` (:func:`simsched.geometry.max_model_len`, as ``RealEngine.boot`` sets it)
    and scheduler budget."""
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


def block_size_refusal(case: Case, vc, kvc) -> str | None:
    """``VllmConfig.validate_block_size`` (``config/vllm.py``, called by
    ``EngineCore._initialize_kv_caches`` once ``cache_config.block_size`` is the smallest
    block size of the KV cache groups): up to 0.26.0 it asserts, in Mamba align mode,
    ``block_size <= max_num_batched_tokens`` (a chunk must reach a block boundary; 0.27.0
    dropped the assert, its ``_mamba_block_aligned_split`` advancing sub-block instead).
    Run on copies with the case's budget; its AssertionError's message (stripped under
    ``python -O``, as in a real engine), or None."""
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


def _memory_check():
    """The release's ``_check_enough_kv_cache_memory`` (``v1/core/kv_cache_utils.py``,
    ``kv_cache_planning.py`` from 0.33.0), or None where it has none."""
    for name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            check = getattr(importlib.import_module(name), "_check_enough_kv_cache_memory", None)
        except ImportError:
            continue
        if check is not None:
            return check
    return None


def kv_memory_refusal(case: Case, vc, kvc, holds_null_block: bool) -> str | None:
    """The release's own start-up check of the KV cache pool, run before any Scheduler is
    built: ``_check_enough_kv_cache_memory`` with the case's ``max_model_len``
    (:func:`simsched.geometry.max_model_len`, as ``RealEngine.boot`` sets it). A group needs
    its spec's ``max_memory_usage_bytes`` in pages; the groups share the pool of
    ``num_gpu_blocks`` blocks, the null block held back from 0.29.0 (``holds_null_block``:
    ``Planner.holds_null_block``; before, the check counted it, vllm-project/vllm#47272).
    Passed in units of 1 GiB, so that the release's message counts blocks where it says GiB.
    Its ValueError's message, or None (it fits, or the release has no check)."""
    check = _memory_check()
    if check is None or not case.requests:
        return None
    vc = checked_config(case, vc)
    specs = [g.kv_cache_spec for g in kvc.kv_cache_groups]
    gib = 1 << 30

    def needed(model_len: int) -> int:
        vc.model_config.max_model_len = model_len
        return gib * sum(-(-s.max_memory_usage_bytes(vc) // s.page_size_bytes)
                         for s in specs)

    def estimate(available: int) -> int:
        return estimate_max_model_len(needed, available, model_len)

    model_len = max_model_len(case)
    usable = kvc.num_blocks - (1 if holds_null_block else 0)
    try:
        check(gib * usable, lambda: needed(model_len), model_len, estimate)
    except ValueError as e:
        return str(e)
    except AssertionError:      # e.g. "DCP not support sliding window.": the run shows it
        return None
    return None
