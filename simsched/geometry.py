"""Derived offload geometry, and the behaviour profiles that say how a vLLM release derives it.

From a :class:`~simsched.layout.Layout` this module computes what vLLM computes at start-up and on
the first scheduled request: the scheduler block size and the hash unit
(``resolve_kv_cache_block_sizes``), which groups are offloaded and their chunk geometry
(``build_offloading_config``, ``SchedulerOffloadConfig.from_spec``) and the offload keys of a
request (``RequestOffloadState.update_offload_keys``). Where vLLM raises, :func:`derive` raises a
:class:`ConfigError` naming the exception type and the raising vLLM function.

vLLM changed these rules between releases, so the rules that differ are a :class:`Profile`: a few
named policy fields, one profile per distinct behaviour. ``asserts=False`` mirrors running vLLM
under ``python -O``: its ``assert`` statements vanish, and the code walks on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from simsched.layout import Group, Layout, RetentionUnset
from simsched.layout import cache_block_size as layout_cache_block_size

CONFIG_PY = "distributed/kv_transfer/kv_connector/v1/offloading/config.py"
SCHEDULER_PY = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
KV_CACHE_UTILS_PY = "v1/core/kv_cache_utils.py"
SINGLE_TYPE_MANAGER_PY = "v1/core/single_type_kv_cache_manager.py"
#: ``SpeculativeConfig.use_eagle()``: methods that draft from the target's hidden states.
EAGLE_METHODS = ("eagle", "eagle3", "mtp")


class ConfigError(Exception):
    """What vLLM raises while configuring offloading, as the model predicts it."""

    def __init__(self, exception: str, function: str, file: str, stage: str, message: str):
        self.exception, self.function, self.file = exception, function, file
        self.stage, self.message = stage, message
        super().__init__(f"{exception} in {function}: {message}")

    def to_json(self) -> dict:
        return {"status": "error", "stage": self.stage, "exception": self.exception,
                "function": self.function, "file": self.file, "message": self.message}


MATH_UTILS_PY = "utils/math_utils.py"


def _cdiv(a: int, b: int) -> int:
    """``vllm.utils.math_utils.cdiv``, including its ZeroDivisionError on a zero divisor."""
    if b == 0:
        raise ConfigError("ZeroDivisionError", "cdiv", MATH_UTILS_PY, "from_spec",
                          "integer division or modulo by zero")
    return -(-a // b)


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


# --- the policies a profile is made of -----------------------------------------------------------

def every_group(layout: Layout) -> tuple[int, ...]:
    """0.29.0/0.30.0: every KV cache group is offloaded."""
    return tuple(range(len(layout.groups)))


def prefix_cacheable_groups(layout: Layout) -> tuple[int, ...]:
    """0.31.0+ and PR #54743: only groups whose spec is prefix-cacheable are offloaded."""
    return tuple(i for i, g in enumerate(layout.groups) if g.prefix_cacheable)


def prefix_cacheable_or_all(layout: Layout) -> tuple[int, ...]:
    """PR #55037: the boot assert checks prefix-cacheable groups, or all when none are."""
    return prefix_cacheable_groups(layout) or every_group(layout)


def window_full_attention_only(group: Group, tokens_per_chunk: int) -> int | None:
    """``get_sliding_window_size_in_chunks`` as released: anything else must be full attention."""
    if group.kind in ("sliding_window", "sliding_window_mla"):
        return _cdiv(group.sliding_window, tokens_per_chunk)  # type: ignore[arg-type]
    if group.kind == "chunked_local":
        return _cdiv(group.attention_chunk_size, tokens_per_chunk)  # type: ignore[arg-type]
    if group.kind == "mamba":
        return 1
    if group.kind in ("full", "mla"):
        return None
    raise _WindowAssert(group.spec_name)


def window_before_chunked_local(group: Group, tokens_per_chunk: int) -> int | None:
    """0.25.1-0.27.1: no chunked-local branch, so chunked local must pass as full attention."""
    if group.kind == "chunked_local":
        raise _WindowAssert(group.spec_name)
    return window_full_attention_only(group, tokens_per_chunk)


def window_ring_is_one_block(group: Group, tokens_per_chunk: int) -> int | None:
    """PR #55038's first change: a ring reaches back one chunk, like a Mamba state."""
    if group.kind == "ring":
        return 1
    return window_full_attention_only(group, tokens_per_chunk)


class _WindowAssert(Exception):
    pass


# --- prefix_cache_retention_interval without --prefix-cache-retention-interval ----------------
# What an engine started without the flag has in cache_config, and so in the KVCacheConfig the
# KV cache manager reads: the planner copies it there (get_kv_cache_config_from_groups,
# v1/core/kv_cache_utils.py; kv_cache_planning.py in 0.33.0). None is dense (every block cached).

def retention_absent(layout: Layout) -> int | None:
    """Before 0.29.0 no config field: the KV cache coordinator reads the environment's
    ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` (``envs.py``), None when unset: every block cached."""
    return None


def retention_sparse(layout: Layout) -> int | None:
    """0.30.0+: ``CacheConfig.prefix_cache_retention_interval`` is ``Field(default=0)``."""
    return 0


def retention_dense_for_hybrid_eagle(layout: Layout) -> int | None:
    """0.29.0: 0 (``_get_prefix_cache_retention_interval``), but
    ``EngineArgs.create_engine_config`` sets None for a hybrid model with EAGLE-style drafting:
    sparse retention would leave the Mamba states at the replay boundary unreachable behind
    EAGLE's dropped tail block."""
    spec = layout.engine.speculative
    eagle = spec is not None and spec.method in EAGLE_METHODS
    return None if layout.hybrid and eagle else 0


@dataclass(frozen=True)
class Profile:
    """One distinct behaviour of the offloading scheduler's configuration and keying."""

    name: str
    summary: str
    releases: tuple[str, ...] = ()
    offloaded_groups: Callable[[Layout], tuple[int, ...]] = every_group
    asserted_groups: Callable[[Layout], tuple[int, ...]] = every_group
    window_in_chunks: Callable[[Group, int], int | None] = window_full_attention_only
    window_file: str = SCHEDULER_PY
    # ``storable_chunks`` clamps to the number of keyed chunks (0.30.0+).
    keyed_chunk_clamp: bool = True
    # ``update_offload_keys`` skips groups with zero hashes per chunk (PR #55038).
    skip_zero_hash_groups: bool = False
    # One group: DCP scales the block only for attention (0.31.0+).
    single_group_dcp_by_spec: bool = False
    # One group: a prefix_match_unit other than the block size is refused (0.32.0+).
    single_group_unit_check: bool = False
    # A chunk 'block_size' that is no multiple of the block size: ValueError (0.30.0+).
    chunk_size_error: str = "ValueError"
    # ``alignment_tokens``: the one full-attention chunk size, else the largest chunk size when
    # no group is full attention (0.30.0+); "absent": not a field of the config (0.29.0).
    alignment: str = "single-or-max"
    # Speculative decoding with an EAGLE-style method and no annotated drafter group makes every
    # group a drafter group (0.29.0); later releases treat every group as a target group.
    eagle_marks_all_groups: bool = False
    # ``from_spec`` checks prefix_cache_retention_interval against windowed chunk sizes (0.30.0+).
    retention_check: bool = True
    # The retention interval of an engine started without the flag (see retention_sparse).
    retention_default: Callable[[Layout], int | None] = retention_sparse
    # Mamba groups send the hash unit back to the scheduler block size when their cache mode is
    # not "align" (0.28.0+), or when their block size differs from the cache block size (before).
    mamba_backoff: str = "mode"
    # Offload block sizes: DCP scales every group (0.25.1, 0.26.0), or attention groups only.
    offload_dcp_all_groups: bool = False
    # 0.25.1: hybrid layouts refuse DCP, every group counts for the hash unit, and the boot checks
    # live in OffloadingSpec.__init__; the window helper is get_sliding_window_size_in_blocks.
    hybrid_dcp_error: bool = False
    hash_unit_all_groups: bool = False
    config_function: str = "build_offloading_config"
    window_function: str = "get_sliding_window_size_in_chunks"
    extra: dict = field(default_factory=dict)


_EVERY_GROUP_NO_CLAMP = Profile(
    "every-group-no-clamp",
    "every group offloaded and asserted divisible by the hash unit; storable chunks not "
    "clamped to keyed chunks",
    releases=("0.29.0",), keyed_chunk_clamp=False, chunk_size_error="AssertionError",
    alignment="absent", eagle_marks_all_groups=True, retention_check=False,
    retention_default=retention_dense_for_hybrid_eagle,
    extra={"spec_pad_after_hit": False, "eagle_replay_pair": False,
           "preempt_in_flight": True, "partial_hash_hits": "no-dcp",
           "mamba_tail_eagle_shift": False})

PROFILES: dict[str, Profile] = {p.name: p for p in (
    _EVERY_GROUP_NO_CLAMP,
    # 0.28.0 has no KVCacheManager.take_boundary_state_offloads and no
    # _build_aligned_boundary_store_jobs (both 0.29.0+): its _build_store_jobs stores an
    # align-mode Mamba group's state block in the chunk job, beside the other groups' blocks
    replace(_EVERY_GROUP_NO_CLAMP, name="every-group-no-clamp-chunked-mamba",
            summary="as every-group-no-clamp; an align-mode Mamba state is stored in the chunk "
            "store job, not as a boundary job of its own", releases=("0.28.0",),
            retention_default=retention_absent,
            extra={**_EVERY_GROUP_NO_CLAMP.extra, "mamba_boundary_stores": False}),
    Profile("legacy-spec-init",
            "0.29.0's rules as 0.25.1 has them: boot checks in OffloadingSpec.__init__, no DCP "
            "for hybrid layouts, Mamba back-off by block size, no chunked-local window",
            releases=("0.25.1",), keyed_chunk_clamp=False, chunk_size_error="AssertionError",
            alignment="absent", eagle_marks_all_groups=True, retention_check=False,
            window_in_chunks=window_before_chunked_local, mamba_backoff="block_size",
            offload_dcp_all_groups=True, hybrid_dcp_error=True, hash_unit_all_groups=True,
            config_function="__init__", window_function="get_sliding_window_size_in_blocks",
            retention_default=retention_absent,
            extra={"mamba_boundary_stores": False, "eagle_tail_hole": True,
                   "spec_pad_after_hit": False, "preempt_in_flight": True,
                   "align_budget_assert": True, "window_frees_on_processed": False,
                   "partial_hash_hits": "none"}),
    Profile("legacy-dcp-all",
            "0.29.0's rules, with DCP scaling every group's offload block, Mamba back-off by "
            "block size and no chunked-local window",
            releases=("0.26.0",), keyed_chunk_clamp=False, chunk_size_error="AssertionError",
            alignment="absent", eagle_marks_all_groups=True, retention_check=False,
            window_in_chunks=window_before_chunked_local, mamba_backoff="block_size",
            offload_dcp_all_groups=True, retention_default=retention_absent,
            extra={"mamba_boundary_stores": False, "spec_pad_after_hit": False,
                   "preempt_in_flight": True, "align_budget_assert": True,
                   "partial_hash_hits": "no-dcp-any-group", "mamba_tail_eagle_shift": False}),
    Profile("legacy-mamba-block-size",
            "0.29.0's rules, with Mamba back-off by block size and no chunked-local window",
            releases=("0.27.0", "0.27.1"), keyed_chunk_clamp=False,
            chunk_size_error="AssertionError", alignment="absent", eagle_marks_all_groups=True,
            retention_check=False, window_in_chunks=window_before_chunked_local,
            mamba_backoff="block_size", retention_default=retention_absent,
            extra={"mamba_boundary_stores": False, "spec_pad_after_hit": False,
                   "preempt_in_flight": True, "partial_hash_hits": "no-dcp-any-group",
                   "mamba_tail_eagle_shift": False}),
    Profile("every-group",
            "every group offloaded and asserted divisible by the hash unit",
            releases=("0.30.0",)),
    Profile("prefix-cacheable",
            "only prefix-cacheable groups offloaded (a ring is left out); also upstream PR #54743",
            releases=("0.31.0",), offloaded_groups=prefix_cacheable_groups,
            asserted_groups=prefix_cacheable_groups, single_group_dcp_by_spec=True),
    Profile("prefix-cacheable-strict-unit",
            "as prefix-cacheable; with one group, a prefix_match_unit other than its block size "
            "is refused",
            releases=("0.32.0",), offloaded_groups=prefix_cacheable_groups,
            asserted_groups=prefix_cacheable_groups, single_group_dcp_by_spec=True,
            single_group_unit_check=True,
            extra={"mamba_checkpoint_below": True, "mamba_tail_recache": True,
                   "eagle_hit_margin": True}),
    Profile("prefix-cacheable-windows-in-config",
            "as prefix-cacheable-strict-unit; sliding windows in chunks derived in "
            "offloading/config.py",
            releases=("0.33.0",), offloaded_groups=prefix_cacheable_groups,
            asserted_groups=prefix_cacheable_groups, window_file=CONFIG_PY,
            single_group_dcp_by_spec=True, single_group_unit_check=True,
            extra={"cpu_lru": "request-ranks", "restart_store_idx": True,
                   "store_skip_null_chunks": True,
                   "mamba_checkpoint_below": True,
                   "alloc_all_groups": True, "spec_cache_on_output": True,
                   "eagle_hit_margin": True, "eagle_junction_below": True}),
    Profile("fix-assert-only",
            "upstream PR #55037 on 0.30.0: the boot assert skips non-prefix-cacheable groups, "
            "which are still offloaded",
            asserted_groups=prefix_cacheable_or_all),
    Profile("fix-assert-and-window",
            "PR #55037 plus the first change of #55038: a ring's reach is one chunk",
            asserted_groups=prefix_cacheable_or_all, window_in_chunks=window_ring_is_one_block),
    Profile("fix-skip-zero-hash",
            "PR #55037 plus all of #55038: groups with zero hashes per chunk are never keyed",
            asserted_groups=prefix_cacheable_or_all, window_in_chunks=window_ring_is_one_block,
            skip_zero_hash_groups=True),
)}

#: No release and no upstream proposal, but a path worth running: 0.29.0 with #55037 and all of
#: #55038 backported, without 0.30.0's keyed-chunk clamp. It is the path on which 0.29.0's
#: ``assert len(offload_keys) == len(offload_block_ids)`` in ``_build_store_jobs`` fires.
PROFILES["every-group-no-clamp+skip-zero-hash"] = replace(
    PROFILES["every-group-no-clamp"], name="every-group-no-clamp+skip-zero-hash",
    summary="0.29.0 with PR #55037 and #55038's window and zero-hash-skip fixes, no clamp",
    releases=(), asserted_groups=prefix_cacheable_or_all,
    window_in_chunks=window_ring_is_one_block, skip_zero_hash_groups=True)

DEFAULT_PROFILE = "prefix-cacheable-windows-in-config"


def profile_for_release(version: str) -> Profile:
    """The profile that stands for a release; releases before 0.29.0 map to the nearest one."""
    for p in PROFILES.values():
        if version in p.releases:
            return p
    key = tuple(int(x) for x in version.split("."))
    if key < (0, 29, 0):
        return PROFILES["every-group-no-clamp"]
    return PROFILES[DEFAULT_PROFILE]


def retention_interval(layout: Layout, profile: Profile) -> int | None:
    """``prefix_cache_retention_interval`` of the case's engine, in its CacheConfig and its
    KVCacheConfig alike: the case's value (null: dense), else the release's default."""
    value = layout.engine.retention_interval
    if isinstance(value, RetentionUnset):
        return profile.retention_default(layout)
    return value


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]


# --- the derivation ------------------------------------------------------------------------------

def effective_block_size(group: Group, dcp: int) -> int:
    """``resolve_dcp_kv_block_size``: attention groups span ``dcp`` times their block size."""
    return group.block_size * dcp if group.dcp_sharded else group.block_size


def partial_hash_hits(layout: Layout, profile: Profile, tokens_per_hash: int) -> bool:
    """The hybrid coordinator's ``enable_partial_hash_hits``: an align-mode Mamba group whose
    block is wider than the hash unit (at least as wide under DCP, 0.30.0+:
    ``partial_hash_hits_enabled``) gives hits on hash-block boundaries, and the coordinator then
    caches every computed token, not rounded to the scheduler block (``_align_cacheable``). From
    0.28.0 every other prefix-cacheable group must take fine-grained lookups (full attention and
    Mamba managers) or have blocks of the hash unit; before 0.28.0 any group will do, and DCP
    turns it off. 0.25.1 has none. ``profile.extra["partial_hash_hits"]``: "none",
    "no-dcp-any-group" (0.26.0-0.27.1), "no-dcp" (0.28.0-0.29.0), absent: 0.30.0's rule."""
    rule = profile.extra.get("partial_hash_hits", "dcp")
    dcp = layout.engine.dcp_size
    if rule == "none" or (dcp > 1 and rule != "dcp"):
        return False
    if not any(g.kind == "mamba" and g.mamba_cache_mode == "align"
               and (g.block_size > tokens_per_hash or (dcp > 1 and g.block_size == tokens_per_hash))
               for g in layout.groups):
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
        by_spec = profile.single_group_dcp_by_spec
        bs = effective_block_size(groups[0], dcp) if by_spec else groups[0].block_size * dcp
        if profile.single_group_unit_check and engine.prefix_match_unit not in (None, bs):
            raise ConfigError("ValueError", "resolve_kv_cache_block_sizes", KV_CACHE_UTILS_PY,
                              "resolve", f"Invalid prefix_match_unit={engine.prefix_match_unit}; "
                              "with a single KV cache group, prefix-cache hits land on the block "
                              f"size ({bs}).")
        return bs, bs
    if profile.hybrid_dcp_error and dcp != 1:
        raise ConfigError("ValueError", "resolve_kv_cache_block_sizes", KV_CACHE_UTILS_PY,
                          "resolve", "Hybrid KV cache groups with multiple block sizes do not "
                          "support context parallelism (dcp_world_size/pcp_world_size > 1).")
    sizes = [effective_block_size(g, dcp) for g in groups]
    scheduler = math.lcm(*sizes)
    # The offloading connector is always configured here, so block hashing is active.
    if profile.mamba_backoff == "mode":
        backoff = any(g.kind == "mamba" and g.mamba_cache_mode != "align" for g in groups)
    else:
        cache_block = cache_block_size(layout)
        backoff = any(g.kind == "mamba" and g.block_size != cache_block for g in groups)
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
        if profile.offload_dcp_all_groups:
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
    all_drafters = (profile.eagle_marks_all_groups and spec is not None
                    and spec.method in EAGLE_METHODS and not any(g.drafter for g in layout.groups))

    groups = []
    for i in selected:
        group = layout.groups[i]
        tokens_per_chunk = tpb[i] * blocks_per_chunk
        try:
            window = profile.window_in_chunks(group, tokens_per_chunk)
        except _WindowAssert as e:
            if asserts:
                raise ConfigError("AssertionError", profile.window_function,
                                  profile.window_file, "from_spec",
                                  f"{e.args[0]} is not a FullAttentionSpec") from None
            window = None
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

    retention = retention_interval(layout, profile)
    if retention is not None and profile.retention_check:
        for g in groups:
            if g.sliding_window_in_chunks is not None and g.tokens_per_chunk == 0:
                raise ConfigError("ZeroDivisionError", "from_spec", SCHEDULER_PY, "from_spec",
                                  "integer division or modulo by zero")
            if g.sliding_window_in_chunks is not None and retention % g.tokens_per_chunk:
                raise ConfigError("ValueError", "from_spec", SCHEDULER_PY, "from_spec",
                                  f"prefix_cache_retention_interval ({retention}) must be a "
                                  f"multiple of tokens_per_chunk ({g.tokens_per_chunk}).")

    return Geometry(scheduler_block_size=scheduler_block_size, tokens_per_hash=tokens_per_hash,
                    blocks_per_chunk=blocks_per_chunk, alignment_tokens=alignment,
                    groups=tuple(groups))


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


def max_blocks_per_request(group: Group, model_len: int, in_flight: int, dcp: int,
                           encoder_tokens: int) -> int:
    """``KVCacheSpec.max_memory_usage_bytes`` in blocks: what one request of ``model_len`` tokens
    can hold of the group at once. Full attention (MLA, drafters): a block per ``block_size``
    tokens; sliding window: the window and the in-flight tokens, plus one block for a window not
    starting on a block boundary; chunked local: a chunk and the in-flight tokens (both never
    more than ``model_len``, ``max_admission_blocks_per_request``); Mamba: one state block, two
    in align mode (the running state and the previous one); a ring: its one block; cross
    attention: the encoder input (``max_num_encoder_input_tokens``: ``max_num_batched_tokens``,
    as ``SchedulerConfig`` sets it). Only full attention counts a request's tokens per DCP rank
    (``FullAttentionSpec.max_memory_usage_bytes``: ``cdiv(max_model_len, dcp_world_size)``);
    the other specs count blocks of their own ``block_size`` whatever DCP (cross attention,
    sliding window, chunked local: ``v1/kv_cache_interface.py``, every release)."""
    bs = group.block_size * dcp if group.kind in ("full", "mla") else group.block_size
    if group.kind == "ring":
        return 1
    if group.kind == "mamba":
        return 2 if group.mamba_cache_mode == "align" else 1
    if group.kind in ("sliding_window", "sliding_window_mla"):
        return -(-min((group.sliding_window or 1) - 1 + in_flight, model_len) // bs) + 1
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
                                      case.timing.max_num_batched_tokens)
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
    if not (case.asserts and profile.extra.get("align_budget_assert", False)
            and any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in groups)):
        return None
    block_size = min(g.block_size for g in groups)
    budget = case.timing.max_num_batched_tokens
    if block_size <= budget:
        return None
    return (f"In Mamba cache align mode, block_size ({block_size}) must be <= "
            f"max_num_batched_tokens ({budget}).")


def check_enough_kv_cache_memory(case) -> str | None:
    """vLLM's start-up check that the KV cache pool holds one request of ``max_model_len``
    tokens (``check_enough_kv_cache_memory`` / ``_check_enough_kv_cache_memory``,
    ``v1/core/kv_cache_utils.py``, ``kv_cache_planning.py`` from 0.33.0; every release): the
    groups share one pool, so their ``max_memory_usage_bytes`` add up, counted here in blocks
    against the pool less the null block the ``BlockPool`` holds back. The engine refuses to
    start otherwise: returns the refusal as vLLM words it (blocks where it says GiB), None
    when the pool is large enough."""
    if not case.requests:
        return None                 # no request, no max_model_len to serve
    available = case.layout.engine.num_gpu_blocks - 1

    def needed(model_len: int) -> int:
        return kv_cache_blocks_needed(case, model_len)

    model_len = max_model_len(case)
    need = needed(model_len)
    if need <= available:
        return None
    estimate = estimate_max_model_len(needed, available, model_len)
    hint = (f" Based on the available memory, the estimated maximum model length is {estimate}."
            if estimate > 0 else "")
    return (f"To serve at least one request with the model's max seq len ({model_len}), "
            f"({need} blocks) KV cache is needed, which is larger than the available KV cache "
            f"memory ({available} blocks).{hint} Try increasing `gpu_memory_utilization` or "
            f"decreasing `max_model_len` when initializing the engine.")
