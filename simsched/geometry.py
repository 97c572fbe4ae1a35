"""Derived offload geometry: what a vLLM release computes for a layout at start-up.

From a :class:`~simsched.layout.Layout` this module computes what vLLM computes at start-up and on
the first scheduled request: the scheduler block size and the hash unit
(``resolve_kv_cache_block_sizes``), which groups are offloaded and their chunk geometry
(``build_offloading_config``, ``SchedulerOffloadConfig.from_spec``) and the offload keys of a
request (``RequestOffloadState.update_offload_keys``). Where vLLM raises, :func:`derive` raises a
:class:`ConfigError` naming the exception type and the raising vLLM function.

vLLM changed these rules between releases; the rules that differ are read from a
:class:`~simsched.profiles.Profile`. ``asserts=False`` mirrors running vLLM
under ``python -O``: its ``assert`` statements vanish, and the code walks on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from simsched.layout import Group, Layout
from simsched.layout import cache_block_size as layout_cache_block_size
from simsched.profiles import (CONFIG_PY, DEFAULT_PROFILE, EAGLE_METHODS, SCHEDULER_PY,
                               ConfigError, Profile, WindowAssert, get_profile,
                               retention_interval)

KV_CACHE_UTILS_PY = "v1/core/kv_cache_utils.py"
KV_CACHE_COORDINATOR_PY = "v1/core/kv_cache_coordinator.py"
SINGLE_TYPE_MANAGER_PY = "v1/core/single_type_kv_cache_manager.py"


@dataclass(frozen=True)
class GroupGeometry:
    group_id: int              # index in the layout (vLLM's group_idx)
    kind: str
    tokens_per_block: int      # block size, scaled by DCP for attention kinds
    tokens_per_chunk: int
    hashes_per_chunk: int
    sliding_window_in_chunks: int | None
    drafter: bool

    def to_json(self) -> dict:
        return {"group_id": self.group_id, "tokens_per_block": self.tokens_per_block,
                "tokens_per_chunk": self.tokens_per_chunk,
                "hashes_per_chunk": self.hashes_per_chunk,
                "sliding_window_in_chunks": self.sliding_window_in_chunks,
                "drafter": self.drafter}


@dataclass(frozen=True)
class Geometry:
    scheduler_block_size: int
    tokens_per_hash: int
    blocks_per_chunk: int
    alignment_tokens: int | None
    groups: tuple[GroupGeometry, ...]   # the offloaded groups, in layout order

    def to_json(self) -> dict:
        return {"scheduler_block_size": self.scheduler_block_size,
                "tokens_per_hash": self.tokens_per_hash,
                "blocks_per_chunk": self.blocks_per_chunk,
                "alignment_tokens": self.alignment_tokens,
                "groups": [g.to_json() for g in self.groups]}


# --- the derivation ------------------------------------------------------------------------------

def effective_block_size(group: Group, dcp: int) -> int:
    """``resolve_dcp_kv_block_size``: attention groups span ``dcp`` times their block size."""
    return group.block_size * dcp if group.dcp_sharded else group.block_size


def partial_hash_hits(layout: Layout, profile: Profile, tokens_per_hash: int) -> bool:
    """The hybrid coordinator's ``enable_partial_hash_hits``: an align-mode Mamba group whose
    block is wider than the hash unit (at least as wide under DCP, 0.29.0+:
    ``partial_hash_hits_enabled``) gives hits on hash-block boundaries, and the coordinator then
    caches every computed token, not rounded to the scheduler block (``_align_cacheable``). From
    0.28.0 every other prefix-cacheable group must take fine-grained lookups (full attention and
    Mamba managers) or have blocks of the hash unit; before 0.28.0 any group will do, and DCP
    turns it off. 0.25.1 has none. ``profile.extra["partial_hash_hits"]``: "none",
    "no-dcp-any-group" (0.26.0-0.27.1), "no-dcp" (0.28.0), absent: 0.29.0's rule, which 0.30.0
    keeps (kv_cache_coordinator.py 0.29.0:627-641: "DCP accepts equality")."""
    dcp = layout.engine.dcp_size
    if not any(g.kind == "mamba" and g.mamba_cache_mode == "align"
               and (g.block_size > tokens_per_hash or (dcp > 1 and g.block_size == tokens_per_hash))
               for g in layout.groups):
        return False
    rule = profile.extra.get("partial_hash_hits", "dcp")
    if rule == "none" or (dcp > 1 and rule != "dcp"):
        return False
    return rule == "no-dcp-any-group" or all(
        g.kind in ("full", "mla", "mamba") or effective_block_size(g, dcp) == tokens_per_hash
        for g in layout.groups if g.prefix_cacheable)


def cache_block_size(layout: Layout) -> int:
    """``cache_config.block_size`` as the engine sets it (:func:`simsched.layout.cache_block_size`)."""
    return layout_cache_block_size(layout.groups)


def resolve_block_sizes(layout: Layout, profile: Profile) -> tuple[int, int]:
    """``resolve_kv_cache_block_sizes``: (scheduler block size, tokens per hash)."""
    engine, groups = layout.engine, layout.groups
    dcp = engine.dcp_size
    if len(groups) == 1:
        bs = groups[0].block_size
        if dcp > 1:   # DCP scales the block: of every spec (up to 0.30.0), of attention (0.31.0+)
            bs = effective_block_size(groups[0], dcp) if profile.single_group_dcp_by_spec \
                else bs * dcp
        if profile.single_group_unit_check and engine.prefix_match_unit not in (None, bs):
            raise ConfigError("ValueError", "resolve_kv_cache_block_sizes", KV_CACHE_UTILS_PY,
                              "resolve", f"Invalid prefix_match_unit={engine.prefix_match_unit}; "
                              "with a single KV cache group, prefix-cache hits land on the block "
                              f"size ({bs}).")
        return bs, bs
    if dcp != 1 and profile.hybrid_dcp_error:
        raise ConfigError("ValueError", "resolve_kv_cache_block_sizes", KV_CACHE_UTILS_PY,
                          "resolve", "Hybrid KV cache groups with multiple block sizes do not "
                          "support context parallelism (dcp_world_size/pcp_world_size > 1).")
    sizes = [effective_block_size(g, dcp) for g in groups]
    scheduler = math.lcm(*sizes)
    # The offloading connector is always configured here, so block hashing is active.
    mamba = [g for g in groups if g.kind == "mamba"]
    if mamba and profile.mamba_backoff == "mode":
        backoff = any(g.mamba_cache_mode != "align" for g in mamba)
    elif mamba:
        backoff = any(g.block_size != cache_block_size(layout) for g in mamba)
    else:
        backoff = False
    if backoff:
        return scheduler, scheduler
    hashing = [s for g, s in zip(groups, sizes)
               if g.prefix_cacheable or profile.hash_unit_all_groups] or sizes
    unit = engine.prefix_match_unit if engine.prefix_match_unit is not None else math.gcd(*hashing)
    if any(s % unit for s in hashing):
        raise ConfigError("ValueError", "resolve_kv_cache_block_sizes", KV_CACHE_UTILS_PY,
                          "resolve", f"Invalid prefix_match_unit={unit}; prefix-cacheable KV "
                          f"cache group block sizes must be divisible by prefix_match_unit")
    return scheduler, unit


def _blocks_per_chunk(layout: Layout, tokens_per_block: list[int], profile: Profile,
                      asserts: bool) -> int:
    engine = layout.engine
    if engine.blocks_per_chunk is not None and engine.offload_block_size is not None:
        raise ConfigError("ValueError", "build_offloading_config", CONFIG_PY,
                          "build_offloading_config",
                          "Specify only one of 'block_size' or 'blocks_per_chunk' in "
                          "kv_connector_extra_config.")
    if engine.blocks_per_chunk is not None:
        return engine.blocks_per_chunk
    if engine.offload_block_size is None:
        return 1
    unique = set(tokens_per_block)
    if len(unique) != 1:
        if asserts:
            raise ConfigError("AssertionError", profile.config_function, CONFIG_PY,
                              "build_offloading_config",
                              "If 'block_size' is specified in kv_connector_extra_config, "
                              "all groups must have the same block size.")
    tpb = unique.pop()   # with asserts stripped, vLLM takes whatever set.pop() gives: so do we
    if engine.offload_block_size % tpb:
        if profile.chunk_size_error == "ValueError" or asserts:
            raise ConfigError(profile.chunk_size_error, profile.config_function, CONFIG_PY,
                              "build_offloading_config",
                              f"'block_size'={engine.offload_block_size} in "
                              "kv_connector_extra_config must be a multiple of the GPU KV cache "
                              f"block size ({tpb} tokens).")
    return engine.offload_block_size // tpb


def derive(layout: Layout, profile: Profile | str = DEFAULT_PROFILE,
           asserts: bool = True) -> Geometry:
    """The geometry a release with ``profile`` derives for ``layout``, or its ConfigError."""
    if isinstance(profile, str):
        profile = get_profile(profile)
    scheduler_block_size, tokens_per_hash = resolve_block_sizes(layout, profile)
    dcp = layout.engine.dcp_size

    selected = profile.offloaded_groups(layout)
    if not selected:
        raise ConfigError("ValueError", "build_offloading_config", CONFIG_PY,
                          "build_offloading_config",
                          "KV offloading found no eligible cache groups.")
    def offload_block(group: Group) -> int:
        if dcp > 1 and profile.offload_dcp_all_groups:
            return group.block_size * dcp
        return effective_block_size(group, dcp)

    tpb = {i: offload_block(layout.groups[i]) for i in selected}
    if asserts:
        for i in profile.asserted_groups(layout):
            size = offload_block(layout.groups[i])
            if size % tokens_per_hash:
                raise ConfigError("AssertionError", profile.config_function, CONFIG_PY,
                                  "build_offloading_config",
                                  f"tokens_per_block={size} not divisible by "
                                  f"tokens_per_hash={tokens_per_hash}.")
    blocks_per_chunk = _blocks_per_chunk(layout, list(tpb.values()), profile, asserts)
    if blocks_per_chunk == 0:   # only reachable with asserts stripped: the CPU tier's sizing
        raise ConfigError("ZeroDivisionError", "__init__", "v1/kv_offload/cpu/spec.py", "spec",
                          "integer division or modulo by zero")
    spec = layout.engine.speculative
    all_drafters = (spec is not None and spec.method in EAGLE_METHODS
                    and not any(g.drafter for g in layout.groups)
                    and profile.eagle_marks_all_groups)

    groups = []
    for i in selected:
        group = layout.groups[i]
        tokens_per_chunk = tpb[i] * blocks_per_chunk
        try:
            window = profile.window_in_chunks(group, tokens_per_chunk)
        except WindowAssert as e:
            if asserts:
                raise ConfigError("AssertionError", profile.window_function,
                                  profile.window_file, "from_spec",
                                  f"{e.args[0]} is not a FullAttentionSpec") from None
            window = None
        if window is not None and group.extra_retained_tokens:
            # max of cdiv(window, tpc) and cdiv(window - 1 + extra_retained_tokens, tpc)
            reach = connector_window_tokens(group, profile)
            window = max(window, -(-(reach - 1) // tokens_per_chunk))
        groups.append(GroupGeometry(
            group_id=i, kind=group.kind, tokens_per_block=tpb[i],
            tokens_per_chunk=tokens_per_chunk,
            hashes_per_chunk=tokens_per_chunk // tokens_per_hash,
            sliding_window_in_chunks=window, drafter=group.drafter or all_drafters))

    full = {g.tokens_per_chunk for g in groups if g.sliding_window_in_chunks is None}
    alignment = full.pop() if len(full) == 1 else (
        None if full else max(g.tokens_per_chunk for g in groups))
    if profile.alignment == "absent":
        alignment = None

    # from_spec checks the retention interval against each windowed group's chunk size
    windowed = [g for g in groups if g.sliding_window_in_chunks is not None]
    retention = retention_interval(layout, profile) if windowed else None
    if retention is not None and profile.retention_check:
        for g in windowed:
            if g.tokens_per_chunk == 0:
                raise ConfigError("ZeroDivisionError", "from_spec", SCHEDULER_PY, "from_spec",
                                  "integer division or modulo by zero")
            if retention % g.tokens_per_chunk:
                raise ConfigError("ValueError", "from_spec", SCHEDULER_PY, "from_spec",
                                  f"prefix_cache_retention_interval ({retention}) must be a "
                                  f"multiple of tokens_per_chunk ({g.tokens_per_chunk}).")

    return Geometry(scheduler_block_size=scheduler_block_size, tokens_per_hash=tokens_per_hash,
                    blocks_per_chunk=blocks_per_chunk, alignment_tokens=alignment,
                    groups=tuple(groups))


def check_kv_cache_coordinator(layout: Layout, profile: Profile, scheduler_block_size: int,
                               asserts: bool) -> None:
    """The start-up checks of the KV cache manager's coordinator, which ``Scheduler.__init__``
    builds after the connector (so after every check of :func:`derive`, and outside the
    connector's config chain): ``KVCacheCoordinator.__init__``, then the hybrid coordinator's."""
    check_retention_interval(layout, profile, scheduler_block_size)
    check_attention_groups(layout, profile, asserts)


def check_attention_groups(layout: Layout, profile: Profile, asserts: bool) -> None:
    """``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups`` (0.25.1-0.28.0) asserts
    that its groups have two specs at least: groups of one spec (kind and sizes; a drafter's
    spec is its target's, no ``is_draft`` field yet) make one attention group."""
    groups = layout.groups
    if (not asserts or len(groups) < 2 or not layout.engine.enable_prefix_caching
            or not profile.extra.get("hybrid_needs_two_specs", False)):
        return
    if len({replace(g, layers=1, drafter=False) for g in groups}) == 1:
        raise ConfigError("AssertionError", "verify_and_split_kv_cache_groups",
                          KV_CACHE_COORDINATOR_PY, "boot",
                          "HybridKVCacheCoordinator requires at least two attention groups.")


def check_retention_interval(layout: Layout, profile: Profile, scheduler_block_size: int
                             ) -> None:
    """``KVCacheCoordinator.__init__``'s ``_validate_prefix_cache_retention_interval``: an
    interval is refused on a model with no sliding-window or Mamba group, where it would have no
    effect (0 is let through from 0.29.0), and must be a non-negative multiple of the scheduler
    block size."""
    retention = retention_interval(layout, profile)
    if retention is None:
        return
    if not any(g.kind in ("sliding_window", "sliding_window_mla", "mamba")
               for g in layout.groups):
        if retention == 0 and profile.extra.get("retention_zero_allowed", True):
            return
        raise ConfigError("ValueError", "_validate_prefix_cache_retention_interval",
                          KV_CACHE_COORDINATOR_PY, "boot",
                          "prefix_cache_retention_interval is set but this model has no "
                          "sliding-window or Mamba KV cache group")
    if retention < 0 or retention % scheduler_block_size:
        raise ConfigError("ValueError", "_validate_prefix_cache_retention_interval",
                          KV_CACHE_COORDINATOR_PY, "boot",
                          f"prefix_cache_retention_interval ({retention}) must be "
                          "non-negative and a multiple of scheduler_block_size "
                          f"({scheduler_block_size}).")


def num_block_hashes(geometry: Geometry, num_tokens: int) -> int:
    """How many block hashes a request of ``num_tokens`` tokens carries (full hash units only)."""
    return num_tokens // geometry.tokens_per_hash


def offload_key_indices(group: GroupGeometry, num_hashes: int, num_keys: int,
                        profile: Profile) -> list[int]:
    """``update_offload_keys`` for one group: indices of the block hashes that become new keys.

    ``num_keys`` keys exist already. The real code calls
    ``islice(block_hashes, hpc * num_keys + hpc - 1, None, hpc)``; CPython rejects a negative
    start (``hpc == 0`` gives -1) and a zero step with a ValueError, raised in
    ``update_offload_keys``.
    """
    hpc = group.hashes_per_chunk
    if hpc == 0 and profile.skip_zero_hash_groups:
        return []
    start = hpc * num_keys + hpc - 1
    if start < 0 or hpc <= 0:
        raise ConfigError("ValueError", "update_offload_keys", SCHEDULER_PY, "update_offload_keys",
                          "Indices for islice() must be None or an integer: "
                          "0 <= x <= sys.maxsize.")
    return list(range(start, num_hashes, hpc))


def config_outcome(layout: Layout, num_tokens: int, profile: Profile | str = DEFAULT_PROFILE,
                   asserts: bool = True) -> dict:
    """The model's prediction of the config-level chain, in the worker's outcome format."""
    if isinstance(profile, str):
        profile = get_profile(profile)
    try:
        geometry = derive(layout, profile, asserts)
        num_hashes = num_block_hashes(geometry, num_tokens)
        keys = [offload_key_indices(g, num_hashes, 0, profile) for g in geometry.groups]
    except ConfigError as e:
        return e.to_json()
    return {"status": "ok", "geometry": geometry.to_json(), "num_hashes": num_hashes,
            "offload_keys": keys}


# --- the start-up check of the KV cache pool ----------------------------------------------------

def max_model_len(case) -> int:
    """The engine's ``max_model_len`` for a case: its longest request, prompt plus decode, and
    room for the speculative tokens scheduled past it (the drafts, and the slots an
    EAGLE-style drafter writes ahead: ``num_lookahead_tokens``). The release harness boots the
    Scheduler with it: the scheduler caps drafts and ``allocate_slots`` caps lookahead slots at
    ``max_model_len``, so a smaller one would change what is scheduled and allocated, and a
    larger one would let the start-up check pass a pool that the longest request and its
    lookahead never fit in (it would wait forever: no deployment's state)."""
    spec = case.layout.engine.speculative
    lookahead = spec.num_tokens if spec is not None else 0
    longest = max((r.prompt_len + r.decode for r in case.requests), default=0)
    return longest + lookahead if longest else 0


def connector_window_tokens(group: Group, profile: Profile) -> int:
    """A sliding-window group's window in tokens as the offloading connector reads it: from
    0.31.0 (``retained_widens_windows``) widened by the group's ``extra_retained_tokens``
    (``get_sliding_window_size_in_chunks``, ``load_window_size_in_chunks``, and the spec of
    ``_reachable_store_block_mask``: "Widen only the store mask, not the model's attention
    window")."""
    window = group.sliding_window or 1
    if group.extra_retained_tokens and profile.extra.get("retained_widens_windows", False):
        return window + group.extra_retained_tokens
    return window


def max_blocks_per_request(group: Group, model_len: int, in_flight: int, dcp: int,
                           encoder_tokens: int, num_speculative_blocks: int = 0) -> int:
    """``KVCacheSpec.max_memory_usage_bytes`` in blocks: what one request of ``model_len`` tokens
    can hold of the group at once. Full attention (MLA, drafters): a block per ``block_size``
    tokens; sliding window: the window and the in-flight tokens, plus one block for a window not
    starting on a block boundary; chunked local: a chunk and the in-flight tokens (both never
    more than ``model_len``, ``max_admission_blocks_per_request``); Mamba: one state block, two
    in align mode (the running state and the previous one), and the spec's
    ``num_speculative_blocks`` (``MambaSpec.max_memory_usage_bytes``: ``1 +`` or ``2 +
    num_speculative_blocks`` pages, kv_cache_interface.py 0.25.1:688-697, 0.30.0:1034-1045,
    0.33.0:1135-1141; 0.29.0+ adds ``num_prefill_checkpoint_blocks``, 0 here); a ring: its one
    block; cross attention: the encoder input (``max_num_encoder_input_tokens``:
    ``max_num_batched_tokens``, as ``SchedulerConfig`` sets it). Only full attention counts a
    request's tokens per DCP rank (``FullAttentionSpec.max_memory_usage_bytes``:
    ``cdiv(max_model_len, dcp_world_size)``); the other specs count blocks of their own
    ``block_size`` whatever DCP (cross attention, sliding window, chunked local:
    ``v1/kv_cache_interface.py``, every release)."""
    bs = group.block_size * dcp if group.kind in ("full", "mla") else group.block_size
    if group.kind == "ring":
        return 1
    if group.kind == "mamba":
        return (2 if group.mamba_cache_mode == "align" else 1) + num_speculative_blocks
    if group.kind in ("sliding_window", "sliding_window_mla"):
        retained = (group.sliding_window or 1) - 1 + group.extra_retained_tokens
        return -(-min(retained + in_flight, model_len) // bs) + 1
    if group.kind == "chunked_local":
        return -(-min((group.attention_chunk_size or 1) + in_flight, model_len) // bs)
    if group.kind == "cross_attention":
        return -(-encoder_tokens // bs)
    return -(-model_len // bs)


def kv_cache_blocks_needed(case, model_len: int) -> int:
    """``max_memory_usage_bytes`` summed over the groups, in blocks of the shared pool."""
    eng = case.layout.engine
    in_flight = case.timing.max_num_batched_tokens * (2 if eng.async_scheduling else 1)
    return sum(max_blocks_per_request(g, model_len, in_flight, eng.dcp_size,
                                      case.timing.max_num_batched_tokens,
                                      case.layout.num_speculative_blocks)
               for g in case.layout.groups)


def estimate_max_model_len(needed: Callable[[int], int], available: int,
                           model_len: int) -> int:
    """``estimate_max_model_len``: the longest ``max_model_len`` up to ``model_len`` whose
    ``needed`` memory fits in ``available`` (vLLM's binary search), 0 if none."""
    lo, hi, best = 1, model_len, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if needed(mid) <= available:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def validate_block_size(case, profile: "Profile") -> str | None:
    """``VllmConfig.validate_block_size`` (``config/vllm.py``), which
    ``EngineCore._initialize_kv_caches`` calls once ``cache_config.block_size`` is the smallest
    block size of the KV cache groups: up to 0.26.0 (``profile.extra["align_budget_assert"]``)
    it asserts, in Mamba align mode, ``block_size <= max_num_batched_tokens``, as a prefill
    chunk must reach a block boundary there. An assert: ``python -O`` strips it. Returns the
    refusal as vLLM words it, None when the engine starts."""
    groups = case.layout.groups
    if not (case.asserts
            and any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in groups)
            and profile.extra.get("align_budget_assert", False)):
        return None
    block_size = min(g.block_size for g in groups)
    budget = case.timing.max_num_batched_tokens
    if block_size <= budget:
        return None
    return (f"In Mamba cache align mode, block_size ({block_size}) must be <= "
            f"max_num_batched_tokens ({budget}).")


def check_enough_kv_cache_memory(case, profile) -> str | None:
    """vLLM's start-up check that the KV cache pool holds one request of ``max_model_len``
    tokens (``check_enough_kv_cache_memory`` / ``_check_enough_kv_cache_memory``,
    ``v1/core/kv_cache_utils.py``, ``kv_cache_planning.py`` from 0.33.0; every release): the
    groups share one pool, so their ``max_memory_usage_bytes`` add up, counted here in blocks.
    From 0.29.0 ``get_kv_cache_configs`` checks against the pool less the null block the
    ``BlockPool`` holds back; before, against the whole pool (``startup_null_block`` False),
    so that an engine whose pool holds the longest request only with the null block starts,
    and that request never gets its blocks. The engine refuses to start otherwise: returns the
    refusal as vLLM words it (blocks where it says GiB), None when the pool is large enough."""
    if not case.requests:
        return None                 # no request, no max_model_len to serve
    blocks = case.layout.engine.num_gpu_blocks

    def needed(model_len: int) -> int:
        return kv_cache_blocks_needed(case, model_len)

    model_len = max_model_len(case)
    need = needed(model_len)
    if need < blocks:
        return None
    # (asked only where the answer matters: a pool short of the request by the null block)
    available = blocks - 1 if profile.extra.get("startup_null_block", True) else blocks
    if need <= available:
        return None
    estimate = estimate_max_model_len(needed, available, model_len)
    hint = (f" Based on the available memory, the estimated maximum model length is {estimate}."
            if estimate > 0 else "")
    return (f"To serve at least one request with the model's max seq len ({model_len}), "
            f"({need} blocks) KV cache is needed, which is larger than the available KV cache "
            f"memory ({available} blocks).{hint} Try increasing `gpu_memory_utilization` or "
            f"decreasing `max_model_len` when initializing the engine.")
