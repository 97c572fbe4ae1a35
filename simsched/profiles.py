"""The behaviour profiles: how each vLLM release (and each upstream fix proposal) configures
offloading, as a few named policy fields, one :class:`Profile` per distinct behaviour.

The model and the config derivation (:mod:`simsched.geometry`) read a release's differences only
from its profile: the policies below (which groups are offloaded, asserted, how a sliding window
is counted in chunks, the retention interval an engine starts with), flags, and ``extra`` (the
model's step-level differences, named after the vLLM change they stand for). Also here: what vLLM
raises while configuring offloading (:class:`ConfigError`), which the policies raise as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from simsched.layout import Group, Layout, RetentionUnset

CONFIG_PY = "distributed/kv_transfer/kv_connector/v1/offloading/config.py"
SCHEDULER_PY = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
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


def cdiv(a: int, b: int) -> int:
    """``vllm.utils.math_utils.cdiv``, including its ZeroDivisionError on a zero divisor."""
    if b == 0:
        raise ConfigError("ZeroDivisionError", "cdiv", MATH_UTILS_PY, "from_spec",
                          "integer division or modulo by zero")
    return -(-a // b)


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
        return cdiv(group.sliding_window, tokens_per_chunk)  # type: ignore[arg-type]
    if group.kind == "chunked_local":
        return cdiv(group.attention_chunk_size, tokens_per_chunk)  # type: ignore[arg-type]
    if group.kind == "mamba":
        return 1
    if group.kind in ("full", "mla"):
        return None
    raise WindowAssert(group.spec_name)


def window_before_chunked_local(group: Group, tokens_per_chunk: int) -> int | None:
    """0.25.1-0.27.1: no chunked-local branch, so chunked local must pass as full attention."""
    if group.kind == "chunked_local":
        raise WindowAssert(group.spec_name)
    return window_full_attention_only(group, tokens_per_chunk)


def window_ring_is_one_block(group: Group, tokens_per_chunk: int) -> int | None:
    """PR #55038's first change: a ring reaches back one chunk, like a Mamba state."""
    if group.kind == "ring":
        return 1
    return window_full_attention_only(group, tokens_per_chunk)


class WindowAssert(Exception):
    """``get_sliding_window_size_in_chunks``' assert that a group it has no branch for is full
    attention; :func:`simsched.geometry.derive` turns it into the ConfigError vLLM raises."""


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
    # the model's step-level differences, each named after the vLLM change it stands for; read
    # with get(key, default) only (a Mapping: the compiled model calls get, as it must for
    # RecordingProfile to see the lookup)
    extra: Mapping[str, Any] = field(default_factory=dict)


#: Before 0.30.0 NIXL's scheduler does not tell its worker that a request is parked for a pull
#: (``awaiting_kvs``, 0.30.0 ``pull_scheduler.py``): a pull left with no blocks is never reported;
#: the SimpleCPUOffloadConnector's manager is the one 0.30.0 rewrote (no finish flush, loads
#: placed by the hashed full-attention blocks, no keep-alive the engine hears:
#: ``simsched.model.simple_cpu_scheduler_legacy``); and the connector's
#: lookup queries the chunk an EAGLE group pops past the hit for a sliding-window group only
#: (``_lookup_complete_chunks``: ``if is_eagle_unverified and sliding_window_size_in_chunks is
#: not None``; 0.30.0: every EAGLE group), so a second full-attention EAGLE group pops a chunk
#: of the hit the first one left
_BEFORE_0_30 = {"nixl_awaiting_kvs": False, "simple_cpu_legacy_manager": True,
                "eagle_extra_chunk_windows_only": True}

#: Before 0.28.0 a lookup that starts a promotion answers RETRY (0.27.1
#: ``tiering/manager.py`` ``lookup``: ``MISS if not promoted else RETRY``; 0.28.0: HIT_PENDING):
#: the connector counts no hit for it
_BEFORE_0_28 = {"tier_promotion_retry": True}

_EVERY_GROUP_NO_CLAMP = Profile(
    "every-group-no-clamp",
    "every group offloaded and asserted divisible by the hash unit; storable chunks not "
    "clamped to keyed chunks",
    releases=("0.29.0",), keyed_chunk_clamp=False, chunk_size_error="AssertionError",
    alignment="absent", eagle_marks_all_groups=True, retention_check=False,
    retention_default=retention_dense_for_hybrid_eagle,
    extra={"spec_pad_after_hit": False, "eagle_replay_pair": False,
           "preempt_in_flight": True,
           "mamba_tail_eagle_shift": False, **_BEFORE_0_30})

#: What 0.31.0 changed beyond the groups it offloads, and later releases keep: the scheduler's
#: ``kv_holding_waiting`` queue, drained before ``waiting``, with the blocks of one spec decode
#: step kept free for an async load (``Scheduler._spec_decode_step_blocks``); the connector's
#: ``max_load_tokens``; the CPU tier's LRU policy by recency ranks, not an evictable list; and
#: the scheduler's own answer for a request that skips reading the prefix cache: whatever the
#: connector said, nothing to load (skip_reading_zeroes_hit, a deferred lookup included); and
#: the SimpleCPUOffloadConnector stores the prefix-cacheable groups only (no ring).
#: (retained_widens_windows: get_sliding_window_size_in_chunks, load_window_size_in_chunks and
#: the store mask count a sliding-window group's extra_retained_tokens)
_SINCE_0_31 = {"kv_holding_waiting": True, "max_load_tokens": True, "cpu_lru": "ranks",
               "retained_widens_windows": True, "skip_reading_zeroes_hit": True,
               "simple_cpu_prefix_cacheable_only": True}

#: From 0.32.0 the SimpleCPUOffloadConnector's eager store state of a preempted request starts
#: over when it is preempted (``_prepare_eager_store_specs``: ``preempted_req_ids``), not when it
#: resumes, and its eager stores reach the coordinator's cacheable tokens
#: (``get_num_cacheable_tokens``: an EAGLE group's block past the boundary too); a prompt's
#: partial tail block is cached at its last hash boundary below the whole prompt
#: (``_cache_partial_tail_block``: a resend matches prompt_len - 1 tokens at most); 0.33.0 also looks nothing up past a local prefix that is not a whole number of
#: attention chunks (simple_cpu_chunked_local_guard)
_SINCE_0_32 = {"simple_cpu_reset_at_preemption": True,
               "simple_cpu_eagle_cacheable_block": True, "fa_partial_tail_below_prompt": True}

#: Before 0.27.0 NIXL pulls every unhashed block of a Mamba group (0.27.0 ``nixl/
#: base_scheduler.py`` get_exchange_clipped_blocks keeps its running-state block alone), and the
#: SimpleCPUOffloadConnector's CPU coordinator is built with ``use_eagle=False`` (0.26.0
#: ``simple_kv_offload/manager.py:125``; 0.27.0: ``spec_config.use_eagle()``); the SimpleCPU
#: model leaves their Mamba layouts out (simple_cpu_mamba, ``model._simple_cpu_gap``)
_BEFORE_0_27 = {"nixl_clips_ssm": False, "simple_cpu_cpu_eagle": False,
                "simple_cpu_mamba": "none"}

#: Before 0.29.0 the start-up check of the KV cache pool counts the null block as usable
#: (``get_kv_cache_configs`` checks the whole pool; 0.29.0 reserves the block the
#: ``BlockPool`` holds back: geometry.check_enough_kv_cache_memory), and a retention interval
#: of 0 on a model with no sliding-window or Mamba group is refused like any other
#: (geometry.check_retention_interval), and the hybrid KV cache coordinator asserts that its
#: groups have two specs at least (geometry.check_attention_groups)
_BEFORE_0_29 = {"startup_null_block": False, "retention_zero_allowed": False,
                "hybrid_needs_two_specs": True, **_BEFORE_0_30}

PROFILES: dict[str, Profile] = {p.name: p for p in (
    _EVERY_GROUP_NO_CLAMP,
    # 0.28.0 has no KVCacheManager.take_boundary_state_offloads and no
    # _build_aligned_boundary_store_jobs (both 0.29.0+): its _build_store_jobs stores an
    # align-mode Mamba group's state block in the chunk job, beside the other groups' blocks
    replace(_EVERY_GROUP_NO_CLAMP, name="every-group-no-clamp-chunked-mamba",
            summary="as every-group-no-clamp; an align-mode Mamba state is stored in the chunk "
            "store job, not as a boundary job of its own", releases=("0.28.0",),
            retention_default=retention_absent,
            extra={**_EVERY_GROUP_NO_CLAMP.extra, **_BEFORE_0_29,
                   "mamba_boundary_stores": False, "partial_hash_hits": "no-dcp"}),
    Profile("legacy-spec-init",
            "0.29.0's rules as 0.25.1 has them: boot checks in OffloadingSpec.__init__, no DCP "
            "for hybrid layouts, Mamba back-off by block size, no chunked-local window",
            releases=("0.25.1",), keyed_chunk_clamp=False, chunk_size_error="AssertionError",
            alignment="absent", eagle_marks_all_groups=True, retention_check=False,
            window_in_chunks=window_before_chunked_local, mamba_backoff="block_size",
            offload_dcp_all_groups=True, hybrid_dcp_error=True, hash_unit_all_groups=True,
            config_function="__init__", window_function="get_sliding_window_size_in_blocks",
            retention_default=retention_absent,
            # mamba_skip_lags_spec_blocks: MambaManager.remove_skipped_blocks frees on
            # num_speculative_blocks fewer computed tokens (0.25.1 only)
            extra={**_BEFORE_0_29, **_BEFORE_0_28, **_BEFORE_0_27, "mamba_boundary_stores": False,
                   "eagle_tail_hole": True,
                   "spec_pad_after_hit": False, "preempt_in_flight": True,
                   "align_budget_assert": True, "window_frees_on_processed": False,
                   "partial_hash_hits": "none", "mamba_skip_lags_spec_blocks": True,
                   "fa_partial_tail": False}),
    Profile("legacy-dcp-all",
            "0.29.0's rules, with DCP scaling every group's offload block, Mamba back-off by "
            "block size and no chunked-local window",
            releases=("0.26.0",), keyed_chunk_clamp=False, chunk_size_error="AssertionError",
            alignment="absent", eagle_marks_all_groups=True, retention_check=False,
            window_in_chunks=window_before_chunked_local, mamba_backoff="block_size",
            offload_dcp_all_groups=True, retention_default=retention_absent,
            extra={**_BEFORE_0_29, **_BEFORE_0_28, **_BEFORE_0_27, "mamba_boundary_stores": False,
                   "spec_pad_after_hit": False, "preempt_in_flight": True,
                   "align_budget_assert": True, "partial_hash_hits": "no-dcp-any-group",
                   "mamba_tail_eagle_shift": False}),
    Profile("legacy-mamba-block-size",
            "0.29.0's rules, with Mamba back-off by block size and no chunked-local window",
            releases=("0.27.0", "0.27.1"), keyed_chunk_clamp=False,
            chunk_size_error="AssertionError", alignment="absent", eagle_marks_all_groups=True,
            retention_check=False, window_in_chunks=window_before_chunked_local,
            mamba_backoff="block_size", retention_default=retention_absent,
            extra={**_BEFORE_0_29, **_BEFORE_0_28, "mamba_boundary_stores": False,
                   "spec_pad_after_hit": False,
                   "preempt_in_flight": True, "partial_hash_hits": "no-dcp-any-group",
                   # (the SimpleCPU model: Mamba without drafts or DCP, model._simple_cpu_gap)
                   "mamba_tail_eagle_shift": False, "simple_cpu_mamba": "plain"}),
    Profile("every-group",
            "every group offloaded and asserted divisible by the hash unit",
            releases=("0.30.0",)),
    Profile("prefix-cacheable",
            "only prefix-cacheable groups offloaded (a ring is left out); also upstream PR #54743",
            releases=("0.31.0",), offloaded_groups=prefix_cacheable_groups,
            asserted_groups=prefix_cacheable_groups, single_group_dcp_by_spec=True,
            extra={**_SINCE_0_31, "spec_step_blocks_by_scheduler_block": True}),
    Profile("prefix-cacheable-strict-unit",
            "as prefix-cacheable; with one group, a prefix_match_unit other than its block size "
            "is refused",
            releases=("0.32.0",), offloaded_groups=prefix_cacheable_groups,
            asserted_groups=prefix_cacheable_groups, single_group_dcp_by_spec=True,
            single_group_unit_check=True,
            extra={**_SINCE_0_31, "mamba_checkpoint_below": True, "mamba_tail_recache": True,
                   "eagle_hit_margin": True, **_SINCE_0_32}),
    Profile("prefix-cacheable-windows-in-config",
            "as prefix-cacheable-strict-unit; sliding windows in chunks derived in "
            "offloading/config.py",
            releases=("0.33.0",), offloaded_groups=prefix_cacheable_groups,
            asserted_groups=prefix_cacheable_groups, window_file=CONFIG_PY,
            single_group_dcp_by_spec=True, single_group_unit_check=True,
            extra={**_SINCE_0_31, "cpu_lru": "request-ranks", "restart_store_idx": True,
                   "tier_schedule_end_last": True,
                   "store_skip_null_chunks": True,
                   "mamba_checkpoint_below": True,
                   "alloc_all_groups": True, "spec_cache_on_output": True,
                   "eagle_hit_margin": True, "eagle_junction_below": True, **_SINCE_0_32,
                   "simple_cpu_chunked_local_guard": True}),
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


# --- profiles that behave alike on a case ------------------------------------------------------
# Most cases touch few of the rules that differ between releases: of the 13 profiles, a generated
# case behaves in two to seven distinct ways, and the campaign spent about three quarters of its
# model time on runs that repeated another profile's (BENCHMARKS.md, "Model speed"). The model is
# a deterministic function of the case and of its profile's answers, so a run is shared by every
# profile that answers each question the run asked as the run's profile did.

#: What a profile is called and stands for, never what the model does with it: not questions.
LABELS = frozenset({"name", "summary", "releases"})


class RecordingProfile(Profile):
    """A profile that writes down each question asked of it, and its answer, in ``answers``: an
    attribute read, a policy called with its arguments (the value it returned or what it raised),
    an ``extra`` lookup. Labels (:data:`LABELS`) are read through unrecorded."""

    def __init__(self, profile: Profile):
        object.__setattr__(self, "_profile", profile)
        object.__setattr__(self, "answers", [])

    def __getattribute__(self, name: str):
        if name == "answers":
            return object.__getattribute__(self, "answers")
        value = getattr(object.__getattribute__(self, "_profile"), name)
        if name.startswith("__") or name in LABELS:
            return value
        answers = object.__getattribute__(self, "answers")
        if name == "extra":
            return _RecordedExtra(value, answers)
        if callable(value):
            return _RecordedPolicy(name, value, answers)
        answers.append((name, None, value))
        return value


class _RecordedPolicy:
    def __init__(self, name: str, policy: Callable, answers: list):
        self.name, self.policy, self.answers = name, policy, answers

    def __call__(self, *args):
        try:
            value = self.policy(*args)
        except Exception as e:
            self.answers.append((self.name, args, _raised(e)))
            raise
        self.answers.append((self.name, args, ("returned", value)))
        return value


class _RecordedExtra:
    """``Profile.extra`` whose lookups are recorded; ``get`` is the one question the model asks
    of it."""

    def __init__(self, extra: Mapping[str, Any], answers: list):
        self.extra, self.answers = extra, answers

    def get(self, key: str, default=None):
        value = self.extra.get(key, default)
        self.answers.append(("extra", (key, default), value))
        return value


def _raised(e: Exception) -> tuple:
    """An exception as an answer: its type and fields, as they were when it was raised."""
    return ("raised", type(e), e.args, sorted(vars(e).items()))


def _answer(policy: Callable, args: tuple) -> tuple:
    try:
        return ("returned", policy(*args))
    except Exception as e:
        return _raised(e)


def answers_alike(answers: list, profile: Profile) -> bool:
    """Does ``profile`` give every answer of ``answers`` (a :class:`RecordingProfile`'s)?"""
    for name, args, value in answers:
        if name == "extra":
            if profile.extra.get(*args) != value:
                return False
        elif args is None:
            if getattr(profile, name) != value:
                return False
        elif _answer(getattr(profile, name), args) != value:
            return False
    return True
