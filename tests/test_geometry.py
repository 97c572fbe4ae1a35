"""The geometry model and its behaviour profiles, against expectations worked out by hand from
the vLLM source (not from the model's own output)."""

import pytest

from simsched.geometry import config_outcome, derive, offload_key_indices
from simsched.layout import RETENTION_UNSET, Layout, LayoutError
from simsched.profiles import PROFILES, ConfigError, profile_for_release, retention_interval

FULL16_RING4 = Layout.from_json({"groups": [{"kind": "full", "block_size": 16},
                                            {"kind": "ring", "block_size": 4}]})


def L(*groups, **engine):
    return Layout.from_json({"groups": list(groups), "engine": engine})


def test_single_group_hash_unit_is_its_block_size():
    g = derive(L({"kind": "full", "block_size": 16}))
    assert (g.scheduler_block_size, g.tokens_per_hash, g.blocks_per_chunk) == (16, 16, 1)
    assert g.groups[0].hashes_per_chunk == 1


def test_hybrid_hash_unit_is_gcd_of_prefix_cacheable_groups_and_scheduler_block_is_lcm():
    g = derive(L({"kind": "full", "block_size": 16},
                 {"kind": "sliding_window", "block_size": 48, "sliding_window": 128}))
    assert (g.scheduler_block_size, g.tokens_per_hash) == (48, 16)
    assert [x.hashes_per_chunk for x in g.groups] == [1, 3]
    assert g.groups[1].sliding_window_in_chunks == 3     # cdiv(128, 48)
    assert g.alignment_tokens == 16                      # the one full-attention chunk size


def test_blocks_per_chunk_scales_chunks_and_keys():
    g = derive(L({"kind": "full", "block_size": 16}, blocks_per_chunk=4))
    assert g.groups[0].tokens_per_chunk == 64 and g.groups[0].hashes_per_chunk == 4
    # keys come from every 4th hash, the last of each chunk: indices 3, 7
    assert offload_key_indices(g.groups[0], 9, 0, PROFILES["every-group"]) == [3, 7]
    assert offload_key_indices(g.groups[0], 9, 1, PROFILES["every-group"]) == [7]


def test_mamba_outside_align_mode_backs_off_to_scheduler_block():
    layout = L({"kind": "full", "block_size": 16},
               {"kind": "mamba", "block_size": 64, "mamba_cache_mode": "none"})
    with pytest.raises(ConfigError) as e:
        derive(layout)
    # hash unit 64 (the lcm): the 16-token attention group is not divisible by it
    assert (e.value.exception, e.value.function) == ("AssertionError", "build_offloading_config")


def test_dcp_scales_attention_groups_not_mamba():
    g = derive(L({"kind": "full", "block_size": 16},
                 {"kind": "mamba", "block_size": 32, "mamba_cache_mode": "align"}, dcp_size=2))
    assert [x.tokens_per_block for x in g.groups] == [32, 32]


@pytest.mark.parametrize("profile, asserts, expect", [
    # 0.29.0/0.30.0: the boot assert over every group
    ("every-group", True, ("AssertionError", "build_offloading_config")),
    # asserts stripped: the window assert goes too, and hashes_per_chunk == 0 reaches islice
    ("every-group", False, ("ValueError", "update_offload_keys")),
    # PR #55037 alone: the next assert, in get_sliding_window_size_in_chunks
    ("fix-assert-only", True, ("AssertionError", "get_sliding_window_size_in_chunks")),
    ("fix-assert-only", False, ("ValueError", "update_offload_keys")),
    # with the ring's reach handled (#55038's first change): the islice failure
    ("fix-assert-and-window", True, ("ValueError", "update_offload_keys")),
    # zero-hash groups skipped, or the ring left out (0.31.0+, #54743): clean
    ("fix-skip-zero-hash", True, None),
    ("prefix-cacheable", True, None),
    ("prefix-cacheable-windows-in-config", False, None),
])
def test_reference_chain(profile, asserts, expect):
    out = config_outcome(FULL16_RING4, 64, profile, asserts)
    if expect is None:
        assert out["status"] == "ok"
    else:
        assert (out["exception"], out["function"]) == expect


def test_scoped_profile_leaves_the_ring_out():
    g = derive(FULL16_RING4, "prefix-cacheable")
    assert [x.group_id for x in g.groups] == [0]
    assert derive(FULL16_RING4, "fix-skip-zero-hash").groups[1].hashes_per_chunk == 0


def test_every_release_maps_to_a_profile():
    assert profile_for_release("0.30.0").name == "every-group"
    assert profile_for_release("0.29.0").name == "every-group-no-clamp"
    assert profile_for_release("0.33.0").name == "prefix-cacheable-windows-in-config"
    assert profile_for_release("0.31.0").name == "prefix-cacheable"


def test_both_chunk_knobs_is_vllms_value_error():
    out = config_outcome(L({"kind": "full", "block_size": 16}, blocks_per_chunk=2,
                           offload_block_size=32), 16)
    assert (out["exception"], out["function"]) == ("ValueError", "build_offloading_config")


def test_offload_block_size_not_multiple_of_block():
    layout = L({"kind": "full", "block_size": 128}, offload_block_size=64)
    assert config_outcome(layout, 16, "every-group")["exception"] == "ValueError"
    assert config_outcome(layout, 16, "every-group-no-clamp")["exception"] == "AssertionError"
    # 0.29.0 under python -O: blocks_per_chunk = 64 // 128 = 0, and the CPU tier's sizing
    # (CPUOffloadingSpec.__init__: cpu bytes // bytes per chunk) divides by zero
    out = config_outcome(layout, 16, "every-group-no-clamp", asserts=False)
    assert (out["exception"], out["function"], out["stage"]) == ("ZeroDivisionError", "__init__",
                                                                 "spec")


def test_zero_chunk_window_divides_by_zero_like_cdiv():
    # a fix proposal that keeps every group but lets a ring pass: window of a 0-token chunk
    from simsched.layout import Group
    from simsched.profiles import window_full_attention_only
    with pytest.raises(ConfigError) as e:
        window_full_attention_only(Group("sliding_window", 16, sliding_window=128), 0)
    assert (e.value.exception, e.value.function) == ("ZeroDivisionError", "cdiv")


def test_eagle_without_drafter_group_marks_every_group_on_0_29():
    layout = L({"kind": "full", "block_size": 16}, {"kind": "full", "block_size": 32},
               speculative={"method": "eagle", "num_tokens": 2})
    assert [g.drafter for g in derive(layout, "every-group-no-clamp").groups] == [True, True]
    assert [g.drafter for g in derive(layout, "every-group").groups] == [False, False]


def test_retention_interval_must_be_a_multiple_of_windowed_chunks():
    layout = L({"kind": "sliding_window", "block_size": 16, "sliding_window": 128},
               retention_interval=100)
    out = config_outcome(layout, 16)
    assert (out["exception"], out["function"]) == ("ValueError", "from_spec")


SW_FULL = ({"kind": "full", "block_size": 16},
           {"kind": "sliding_window", "block_size": 16, "sliding_window": 128})
HYBRID = ({"kind": "full", "block_size": 16},
          {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"})
EAGLE = {"method": "eagle", "num_tokens": 1}


@pytest.mark.parametrize("version, default, hybrid_eagle", [
    # before 0.29.0 only VLLM_PREFIX_CACHE_RETENTION_INTERVAL (envs.py), unset: None, dense
    ("0.25.1", None, None), ("0.27.1", None, None), ("0.28.0", None, None),
    # 0.29.0: _get_prefix_cache_retention_interval's 0; EngineArgs.create_engine_config sets
    # None for a hybrid model with EAGLE when the flag is left out
    ("0.29.0", 0, None),
    # 0.30.0+: Field(default=0), whatever the model (config/cache.py)
    ("0.30.0", 0, 0), ("0.31.0", 0, 0), ("0.32.0", 0, 0), ("0.33.0", 0, 0)])
def test_retention_left_out_is_the_release_default(version, default, hybrid_eagle):
    profile = profile_for_release(version)
    assert L(*SW_FULL).engine.retention_interval is RETENTION_UNSET
    assert retention_interval(L(*SW_FULL), profile) == default
    assert retention_interval(L(*SW_FULL, speculative=EAGLE), profile) == default
    assert retention_interval(L(*HYBRID), profile) == default
    assert retention_interval(L(*HYBRID, speculative=EAGLE), profile) == hybrid_eagle
    # ngram drafts without the target's hidden states: no use_eagle(), no dense default
    ngram = {"method": "ngram", "num_tokens": 2}
    assert retention_interval(L(*HYBRID, speculative=ngram), profile) == default
    # the flag given: its value, None (--prefix-cache-retention-interval None) included
    for value, want in (("dense", None), (0, 0), (64, 64)):
        assert retention_interval(L(*HYBRID, speculative=EAGLE, retention_interval=value),
                                  profile) == want


def test_retention_dense_null_and_absent_round_trip():
    """Absent and null are the release's default; "dense" is the flag's None."""
    absent, null = L(*SW_FULL), L(*SW_FULL, retention_interval=None)
    dense = L(*SW_FULL, retention_interval="dense")
    assert absent.to_json() == null.to_json() == {"groups": list(SW_FULL)}
    assert null == absent and null.engine.retention_interval is RETENTION_UNSET
    assert dense.engine.retention_interval is None
    assert dense.to_json()["engine"] == {"retention_interval": "dense"}
    assert Layout.from_json(dense.to_json()) == dense != absent
    assert "retention_interval=dense" in dense.describe()
    with pytest.raises(LayoutError, match=r"engine\.retention_interval: expected an integer"):
        L(*SW_FULL, retention_interval="sparse")


def test_single_group_prefix_match_unit_is_refused_from_0_32():
    layout = L({"kind": "full", "block_size": 64}, prefix_match_unit=16)
    assert config_outcome(layout, 64, "prefix-cacheable")["status"] == "ok"
    out = config_outcome(layout, 64, "prefix-cacheable-strict-unit")
    assert (out["exception"], out["function"]) == ("ValueError", "resolve_kv_cache_block_sizes")
