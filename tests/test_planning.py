"""Layouts of layers, planned by each release's own planner (``simsched.planning``).

The expected groups follow vLLM's grouping rule (``get_kv_cache_groups``: layers of one spec
form a group; with specs of one page size, groups of the smallest kind's layer count) and the
hybrid KV cache manager's default (``VllmConfig.__post_init__``: off for chunked local
attention, whose layers then plan as full attention), read in each release's source."""

from __future__ import annotations

import dataclasses

import pytest

from simsched.case import Case
from simsched.families import FAMILIES, family_case
from simsched.layout import Layout, LayoutError
from simsched.lockstep import lockstep
from simsched.model import run_case
from simsched.planning import plan
from simsched.targets import Releases

VERSIONS = ["0.30.0", "0.33.0"]
GPT_OSS = [{"kind": "full", "count": 2, "head_size": 64},
           {"kind": "sliding_window", "count": 2, "head_size": 64, "sliding_window": 128}]
#: a prefix stored by a, loaded back by b once c has pushed it out of the GPU pool
LOAD = [{"id": "a", "prompt": [[1, 100]], "decode": 2},
        {"id": "c", "prompt": [[9, 500]], "arrival": 8, "decode": 2},
        {"id": "b", "prompt": [[1, 100]], "arrival": 20, "decode": 2}]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(VERSIONS, timeout=120) as p:
        yield p


def layers_case(layers, requests=LOAD, **engine) -> Case:
    """48 blocks: c's prompt (32 blocks of a full-attention group, and a sliding window's 128
    tokens and a 64-token chunk) needs the blocks a's prefix left cached."""
    return Case.from_json({"layout": {"layers": layers, "engine": dict(
        {"num_gpu_blocks": 48}, **engine)}, "requests": requests,
        "timing": {"max_num_batched_tokens": 64}})


# --- the layout language (no release needed) ---------------------------------------------

@pytest.mark.parametrize("layers, field", [
    ([{"kind": "cross_attention"}], "layout.layers[0].kind"),
    ([{"kind": "mamba"}, {"kind": "full"}], "layout.layers[0].shapes"),
    ([{"kind": "mamba", "shapes": [[4, 0]], "mamba_type": "mamba1"}, {"kind": "full"}],
     "layout.layers[0].shapes"),
    ([{"kind": "mamba", "shapes": [[4, 3]]}, {"kind": "full"}], "layout.layers[0].mamba_type"),
    ([{"kind": "mamba", "shapes": [[4, 3]], "mamba_type": "mamba1", "head_size": 64},
      {"kind": "full"}], "layout.layers[0].head_size"),
    ([{"kind": "full", "shapes": [[4, 3]]}], "layout.layers[0].shapes"),
    # under prefix caching vLLM makes the mode align (MambaModelConfig.verify_and_update_config)
    ([{"kind": "mamba", "shapes": [[4, 3]], "mamba_type": "mamba1", "mamba_cache_mode": "none"},
      {"kind": "full"}], "layout.layers[0].mamba_cache_mode"),
    # one state layout a model (get_mamba_state_shape_from_config)
    ([{"kind": "mamba", "shapes": [[4, 3]], "mamba_type": "mamba1"}, {"kind": "full"},
      {"kind": "mamba", "shapes": [[4, 4]], "mamba_type": "mamba1"}], "layout.layers[2].shapes"),
    ([{"kind": "mamba", "shapes": [[4, 3]], "mamba_type": "mamba1"}], "layout.layers"),
    ([{"kind": "sliding_window"}], "layout.layers[0].sliding_window"),
    ([{"kind": "full", "attention_chunk_size": 8}], "layout.layers[0].attention_chunk_size"),
    ([{"kind": "full", "dtype": "int4"}], "layout.layers[0].dtype"),
    ([{"kind": "full", "drafter": True}], "layout.layers"),
    ([], "layout.layers"),
])
def test_a_bad_layer_is_refused_naming_its_field(layers, field):
    with pytest.raises(LayoutError) as e:
        Layout.from_json({"layers": layers})
    assert e.value.field == field


def test_block_size_belongs_to_a_layout_of_layers():
    assert Layout.from_json({"layers": [{"kind": "full"}],
                             "engine": {"block_size": 32}}).engine.block_size == 32
    with pytest.raises(LayoutError, match="engine.block_size: only with layout.layers"):
        Layout.from_json({"groups": [{"kind": "full", "block_size": 16}],
                          "engine": {"block_size": 16}})


def test_the_model_runs_a_layout_of_layers_only_once_planned():
    case = layers_case(GPT_OSS)
    assert not case.layout.planned
    assert Case.from_json(case.to_json()) == case
    with pytest.raises(LayoutError, match="planner"):
        run_case(case)


def test_family_cases_are_deterministic():
    for family in FAMILIES:
        assert family_case(3, family).to_json() == family_case(3, family).to_json()
        assert family_case(3, family).to_json() != family_case(4, family).to_json()


# --- the release's planner --------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("layers, groups, blocks", [
    (GPT_OSS, [{"kind": "full", "block_size": 16, "layers": 2},
               {"kind": "sliding_window", "block_size": 16, "layers": 2,
                "sliding_window": 128}], 48),
    # Llama 4: the hybrid KV cache manager is off by default, local layers become full ones
    ([{"kind": "chunked_local", "count": 3, "attention_chunk_size": 64},
      {"kind": "full", "count": 1}], [{"kind": "full", "block_size": 16, "layers": 4}], 36),
    # one spec, one group, whatever the layer count
    ([{"kind": "mla", "count": 3, "head_size": 576}],
     [{"kind": "mla", "block_size": 16, "layers": 3}], 36),
])
def test_the_planner_groups_layers_as_the_release_does(pool, version, layers, groups, blocks):
    """Planned, then run in lockstep: b loads a's prefix back (one group: 36 blocks, so that
    c's 32 evict a's)."""
    case = layers_case(layers, num_gpu_blocks=blocks)
    planned, out = plan(case, version, pool)
    assert out["status"] == "ok", out
    assert [g.to_json() for g in planned.layout.groups] == groups
    res = lockstep(case, version, pool)
    assert res.agree, res.summary()
    assert res.real["counters"]["loads"] >= 1, res.summary()


@pytest.mark.parametrize("version, marked", [("0.30.0", False), ("0.33.0", True)])
def test_an_eagle_drafter_layer_joins_the_target_group(pool, version, marked):
    """0.33.0 marks the group that holds a draft layer ``is_eagle_group`` (spec.is_draft);
    0.30.0 marks none for plain attention (its rule is for non-causal multi-token decode
    specs), and its coordinator then treats every group as an EAGLE group."""
    case = layers_case([{"kind": "full", "count": 4}, {"kind": "full", "drafter": True}],
                       speculative={"method": "eagle", "num_tokens": 2})
    planned, out = plan(case, version, pool)
    assert out["status"] == "ok", out
    [group] = planned.layout.groups
    assert (group.layers, group.drafter) == (5, marked)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_pool_the_release_refuses_is_refused_not_run(pool, version):
    """48 blocks less the null block hold 47 * 16 = 752 tokens of one full-attention group,
    not a request of 800."""
    case = layers_case([{"kind": "full", "count": 2}],
                       requests=[{"id": "a", "prompt": [[1, 790]], "decode": 10}])
    planned, out = plan(case, version, pool)
    assert planned is None and out["status"] == "refused", out
    assert "max seq len (800)" in out["reason"]
    res = lockstep(case, version, pool)
    assert res.real["status"] == "refused" and res.observations == []


@pytest.mark.parametrize("version", VERSIONS)
def test_groups_the_planner_does_not_build_are_unsupported(pool, version):
    """A case that says its layers planned into other groups (another release's plan, or one
    written by hand) is no layout of this release: unsupported, and no finding is made of it."""
    case = layers_case(GPT_OSS)
    wrong = dataclasses.replace(case, layout=Layout.from_json(dict(
        case.layout.to_json(), groups=[{"kind": "full", "block_size": 16, "layers": 4}])))
    res = lockstep(wrong, version, pool)
    assert res.real["status"] == "unsupported", res.summary()
    assert "planner builds the groups" in res.real["reason"] and res.observations == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("seed", [20, 36])
def test_the_cpu_tier_of_a_planned_pool_holds_cpu_chunks_chunks(pool, version, seed):
    """The planner's pool has one KV cache tensor per layer slot, each shared by a layer of
    every group, and from 0.29.0 each tensor's size is the whole allocation
    (``build_offloading_config`` divides the first one's by the blocks). A harness that added
    the sizes up gave the real CPU tier twice the chunks of ``cpu_chunks`` on gpt-oss: these
    cases, whose 16-chunk tier fills, diverged on the first store the model's full tier
    refused."""
    case = family_case(seed, "gpt-oss")
    assert case.layout.engine.cpu_chunks == 16
    res = lockstep(case, version, pool)
    assert res.agree, res.summary()
    assert res.real["counters"]["stores"] >= 2


def test_the_model_alone_says_a_layout_of_layers_is_not_its_to_plan():
    """Replayed on the model only, a layout of layers is ``unsupported`` with the reason, never
    a crash finding of the model nor a predicted vLLM error (its empty group list would predict
    'KV offloading found no eligible cache groups')."""
    from simsched.replay import observe
    from simsched.targets import UNPLANNED, ModelTarget
    from simsched.profiles import PROFILES

    outcomes: dict = {}
    obs = observe(layers_case(GPT_OSS), [ModelTarget(p) for p in PROFILES.values()], [],
                  outcomes)
    assert obs == []
    assert {o["status"] for o in outcomes.values()} == {"unsupported"}
    assert all(o["reason"] == UNPLANNED for o in outcomes.values())


@pytest.mark.parametrize("version", VERSIONS)
def test_replay_plans_a_layout_of_layers_on_each_release(pool, version):
    from simsched.replay import observe
    from simsched.targets import ReleaseTarget

    outcomes: dict = {}
    obs = observe(layers_case(GPT_OSS), [], [ReleaseTarget(version, pool)], outcomes,
                  config=False)
    assert obs == [] and outcomes[version]["status"] == "ran", outcomes
    assert outcomes[version]["counters"]["loads"] >= 1


def test_the_campaign_plans_a_layout_of_layers_on_its_newest_release(pool, tmp_path):
    """A drawn layout of layers is planned by the campaign's newest release and evaluated as
    any case (no tool error: every other release plans it again); one whose engine that
    release refuses is counted, not run."""
    from fuzz import triage as tri
    from fuzz.campaign import LAYERS_EVERY, Campaign

    camp = Campaign(tmp_path, pool, model=True, run_releases=VERSIONS, budget=1.0, seed_=0)
    assert camp.newest.version == "0.33.0"
    assert "planned_cases" in repr(camp._strategy(LAYERS_EVERY - 1))
    assert "planned_cases" not in repr(camp._strategy(0))
    planned = camp._planned(layers_case(GPT_OSS))
    assert [g.kind for g in planned.layout.groups] == ["full", "sliding_window"]
    seen = camp.evaluate(planned, sampled=True)
    assert not [s for s in seen if s.klass == tri.TOOL_ERROR], seen
    too_long = layers_case([{"kind": "full"}], requests=[{"id": "a", "prompt": [[1, 900]]}])
    assert camp._planned(too_long) is None
    assert camp.layers == {"planned": 1, "refused": 1}


def test_a_finding_says_how_a_deployment_reaches_its_layout():
    from simsched.planning import deployment_reach

    planned = Layout.from_json({"layers": FAMILIES["gpt-oss"][0], "groups": [
        {"kind": "full", "block_size": 16, "layers": 2},
        {"kind": "sliding_window", "block_size": 16, "layers": 2, "sliding_window": 128}],
        "engine": {"num_gpu_blocks": 64}})
    assert deployment_reach(planned) == ("reached: the gpt-oss family, its groups built by the "
                                         "release's own planner")
    eagle = Layout.from_json({"layers": FAMILIES["dense+eagle"][0],
                              "engine": FAMILIES["dense+eagle"][1]})
    assert deployment_reach(eagle).endswith(
        "flags speculative={'method': 'eagle', 'num_tokens': 2}")
    local = Layout.from_json({"groups": [{"kind": "full", "block_size": 16},
                                         {"kind": "chunked_local", "block_size": 16,
                                          "attention_chunk_size": 64}]})
    assert "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1" in deployment_reach(local)
    alone = Layout.from_json({"groups": [{"kind": "full", "block_size": 16}]})
    assert deployment_reach(alone).startswith("written as groups: no release's planner")


def groups_case(groups, **engine) -> Case:
    return Case.from_json({"layout": {"groups": groups, "engine": dict(num_gpu_blocks=64,
                                                                        **engine)},
                           "requests": [{"id": "a", "prompt": [[1, 40]], "decode": 2}]})


FULL, SW = {"kind": "full", "block_size": 16}, {"kind": "sliding_window", "block_size": 16,
                                                "sliding_window": 128}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_release_s_planner_judges_a_layout_of_groups(pool, version):
    """A layout of groups written by hand, asked of the release's planner with the layers it
    declares (``planning.layers_for_groups``). vLLM groups layers by spec in the order each spec
    first appears and cuts each spec's layers into groups (``_get_kv_cache_groups_uniform_page_
    size``, 0.30.0 ``v1/core/kv_cache_utils.py:1435``): the groups of one spec are next to each
    other, and one spec alone is one group. So ``full + full + sliding_window`` is what a model
    of two full layers and a sliding-window layer gets; ``full + sliding_window + full`` no model
    gets (its layers plan as the former), nor two full groups alone (one group)."""
    from simsched.planning import REACHED, SYNTHETIC, UNCHECKED, group_layout_reach

    how, why = group_layout_reach(groups_case([FULL, FULL, SW]), version, pool)
    assert how == REACHED and "1xfull + 1xfull + 1xsliding_window(w=128)" in why, why
    how, why = group_layout_reach(groups_case([FULL, SW, FULL]), version, pool)
    assert how == SYNTHETIC, why
    assert "builds full/16 + full/16 + sliding_window/16(w=128) from layers 1xfull + " \
           "1xsliding_window(w=128) + 1xfull, --block-size 16, not these groups" in why
    how, why = group_layout_reach(groups_case([FULL, FULL]), version, pool)
    assert (how, why.split(" from ")[0]) == (SYNTHETIC, f"{version}'s planner builds full/16")
    # a ring of 4 beside full attention of 16 (upstream PR #55037's layout): a ring whose
    # state page does not divide the attention page is padded and keeps its capacity
    ring = groups_case([FULL, {"kind": "ring", "block_size": 4}])
    how, why = group_layout_reach(ring, version, pool)
    assert how == REACHED and "1xfull + 1xring/4, --block-size 16" in why, why
    # a ring no witness builds is not judged: other widths than the ones tried might
    odd = groups_case([{"kind": "mla", "block_size": 64}, {"kind": "ring", "block_size": 132}])
    assert group_layout_reach(odd, version, pool)[0] == UNCHECKED
    # a ring serves attention layers beside it: rings alone are no model's
    lone = groups_case([{"kind": "ring", "block_size": 4}])
    assert group_layout_reach(lone, version, pool)[0] == SYNTHETIC
    # what the layer language cannot say is not judged
    mixed = groups_case([FULL, dict(FULL, block_size=64)])
    assert group_layout_reach(mixed, version, pool) == (
        UNCHECKED, "groups of several block sizes (16, 64)")
    mamba = groups_case([FULL, {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}])
    assert group_layout_reach(mamba, version, pool)[0] == UNCHECKED


def test_a_cross_attention_group_beside_a_connector_is_no_deployments():
    """Only encoder-decoder models have a cross-attention group, and every release's Scheduler
    refuses a KV connector beside one (``assert not self.is_encoder_decoder``, 0.33.0
    ``v1/core/sched/scheduler.py:176``): a finding on such groups is synthetic, unless the
    case strips asserts (``python -O``), where no release was asked."""
    from simsched.planning import SYNTHETIC, UNCHECKED, group_layout_reach

    case = groups_case([FULL, {"kind": "cross_attention", "block_size": 16}])
    how, why = group_layout_reach(case, "0.33.0", None)
    assert how == SYNTHETIC and "not currently supported with KV connectors" in why
    stripped = dataclasses.replace(case, asserts=False)
    how, why = group_layout_reach(stripped, "0.33.0", None)
    assert how == UNCHECKED and "only under python -O" in why


@pytest.mark.parametrize("version", ["0.33.0"])
def test_a_bug_on_a_layout_no_planner_builds_is_synthetic(pool, version, tmp_path):
    """The campaign asks each affected release's planner about a bug's hand-written layout:
    where none builds it, the finding is ``synthetic`` with the planner's answer, and the report
    lists it apart from the bugs; where one does, it stays a bug that says how it is reached."""
    from types import SimpleNamespace

    from fuzz import clustering
    from fuzz import triage as tri
    from fuzz.evaluate import Evaluator
    from fuzz.report import markdown, summary

    ev = Evaluator(pool, model=False, run_releases=[version])
    synthetic = SimpleNamespace(case=groups_case([FULL, SW, FULL]), klass=tri.BUG,
                                releases_affected=[version], deployment="")
    clustering.judge_reach(synthetic, ev.all_release_targets)
    assert synthetic.klass == tri.SYNTHETIC
    assert synthetic.deployment.startswith(f"synthetic: {version}'s planner builds full/16 + "
                                           "full/16 + sliding_window/16(w=128)")
    reached = SimpleNamespace(case=groups_case([FULL, FULL, SW]), klass=tri.BUG,
                              releases_affected=[version], deployment="")
    clustering.judge_reach(reached, ev.all_release_targets)
    assert reached.klass == tri.BUG and reached.deployment.startswith("reached: ")

    def finding(fid, klass):
        return {"id": fid, "class": klass, "cluster": fid, "kind": "invariant",
                "signature": "invariant:INV-4", "invariant": "INV-4", "op": "store",
                "message": "m", "layout": "l", "case": f"repros/{fid}/case.json", "groups": 3,
                "requests": 1, "releases_affected": [version], "releases_clean": [],
                "range": "r", "first_bad_step": 1}
    data = {"seed": 1, "budget_s": 1, "elapsed_s": 1.0, "examples": 1, "examples_per_s": 1.0,
            "targets": [], "releases_installed": [version], "families": {}, "knobs": {},
            "findings": [finding("made-up", "synthetic"), finding("real", "bug")]}
    data["summary"] = summary(data)
    assert data["summary"]["clusters"] == {"bug": 1, "synthetic": 1}
    assert data["summary"]["bugs_in_newest"] == 1
    md = markdown(data)
    assert md.index("[real]") < md.index("<details><summary>Synthetic") < md.index("[made-up]")


@pytest.mark.parametrize("version", VERSIONS)
def test_a_compressor_ring_family_reaches_the_ring_boot_assert_of_0_30_0(pool, version):
    """DeepSeek V4.1 style layers (MLA at 64-token blocks, a compressor's ring of 8 float32 state
    rows: ``CompressorStateCache.get_kv_cache_spec``) planned by the release: the ring keeps its
    capacity (its page is padded to the MLA page). 0.30.0's ``build_offloading_config`` then
    asserts every group's block size divisible by the hash unit (64): the engine does not boot,
    upstream PR #55037's bug, reached by a model's own layers; 0.31.0 keys only the
    prefix-cacheable groups, and 0.33.0 runs the case. Both sides agree."""
    case = family_case(3, "mla+ring")
    planned, out = plan(case, version, pool)
    assert out["status"] == "ok", out
    assert [(g.kind, g.block_size) for g in planned.layout.groups] == [("mla", 64), ("ring", 8)]
    res = lockstep(case, version, pool)
    assert res.agree, res.summary()
    crashes = [f for f in res.real["findings"] if f.get("kind") == "crash"]
    if version == "0.30.0":
        assert [(f["exception"], f["function"]) for f in crashes] == [
            ("AssertionError", "build_offloading_config")]
    else:
        assert res.real["findings"] == [] and res.real["counters"]["steps"] > 0


@pytest.mark.parametrize("version", VERSIONS)
def test_layers_the_planner_cannot_lay_out_are_refused_naming_the_check(pool, version):
    """MLA layers of two page sizes beside sliding-window MLA: vLLM's planner cannot unify the
    pages (``unify_kv_cache_spec_page_size`` pads only non-MLA layers) and raises
    NotImplementedError: the engine does not start, ``refused`` naming the check and no
    finding, never a worker error."""
    case = layers_case([dict(kind="mla", count=2, head_size=576),
                        dict(kind="sliding_window_mla", count=2, head_size=576,
                             sliding_window=64),
                        dict(kind="mla", count=2, head_size=132)], block_size=64)
    planned, out = plan(case, version, pool)
    assert planned is None and out["status"] == "refused", out
    assert out["reason"].startswith("NotImplementedError in unify_kv_cache_spec_page_size: ")
    res = lockstep(case, version, pool)
    assert res.real["status"] == "refused" and res.observations == [], res.summary()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_deepseek_v4_family_plans_three_groups(pool, version):
    """MLA, sliding-window MLA and compressor-ring layers, four of each, plan as three groups;
    0.30.0 stops at boot on the ring's block size (the hash unit is 64), 0.33.0 runs the case
    step by step, agreeing with the model."""
    case = family_case(5, "deepseek-v4")
    planned, out = plan(case, version, pool)
    assert out["status"] == "ok", out
    assert [(g.kind, g.block_size, g.layers) for g in planned.layout.groups] == [
        ("mla", 64, 4), ("sliding_window_mla", 64, 4), ("ring", 8, 4)]
    res = lockstep(case, version, pool)
    assert res.agree, res.summary()
    crashed = [f["function"] for f in res.real["findings"] if f.get("kind") == "crash"]
    assert crashed == (["build_offloading_config"] if version == "0.30.0" else [])


# --- hybrid Mamba models: the platform's block-size alignment ---------------------------------

#: Qwen3-Next style layers in another proportion: a temporal state of (4, 32, 64) (conv state
#: 256 x 3): 1,536 + 16,384 = 17,920 bytes beside attention of 512 bytes a token
_WIDE_GDN = [{"kind": "mamba", "count": 3, "mamba_type": "gdn_attn",
              "shapes": [[256, 3], [4, 32, 64]]},
             {"kind": "full", "num_kv_heads": 2, "head_size": 64}]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("layers, groups", [
    (FAMILIES["qwen3-next"][0], [("mamba", 32, 1)] * 3 + [("full", 32, 1)]),
    (FAMILIES["jamba"][0], [("mamba", 16, 1)] * 7 + [("full", 16, 1)]),
    (_WIDE_GDN, [("mamba", 48, 1)] * 3 + [("full", 48, 1)]),
])
def test_a_hybrid_mamba_model_gets_the_block_size_the_platform_aligns(pool, version, layers,
                                                                        groups):
    """``Platform._align_hybrid_block_size`` (``platforms/interface.py``, 0.30.0:778-960,
    0.33.0:940-1135), align mode, FlashAttention (``get_supported_kernel_block_sizes``:
    ``[MultipleOf(16)]``, so the kernel alignment is ``max(16, --block-size 16) = 16``; 0.33.0
    also takes the lcm with the Mamba layers' prefill checkpoint alignment, none here, and with
    every backend's smallest kernel block, 16 again):

    - attention page a token: ``FullAttentionSpec(block_size=1, ...)``: K and V, ``2 * heads *
      head_size * dtype bytes``: Qwen3-Next style 2 * 2 * 64 * 2 = 512; Jamba style (8 heads of
      128) 2 * 8 * 128 * 2 = 4,096.
    - Mamba page: the states' bytes: (256*3 + 4*32*32) * 2 = 9,728; Jamba (512*3 + 512*16) * 2
      = 19,456; the wide GDN state (256*3 + 4*32*64) * 2 = 17,920.
    - ``attn_block_size = 16 * cdiv(mamba_page, 16 * attn_page_1)``: 16 * cdiv(9728, 8192) = 32;
      16 * cdiv(19456, 65536) = 16; 16 * cdiv(17920, 8192) = 48; ``block_size`` is raised to it
      and ``mamba_block_size = block_size`` (align); the Mamba page is padded to the attention
      page (16 KiB, 64 KiB, 24 KiB), so every layer's page is one size and the planner makes a
      group of each layer (``_get_kv_cache_groups_uniform_page_size``: groups of the smallest
      kind's layer count, 1), Mamba layers first as the model declares them.

    The family's ``groups`` (which sizes its GPU pool) is that count."""
    case = layers_case(layers, requests=LOAD[:1], num_gpu_blocks=8 * len(groups) + 8)
    planned, out = plan(case, version, pool)
    assert out["status"] == "ok", out
    assert [(g.kind, g.block_size, g.layers) for g in planned.layout.groups] == groups
    assert all(g.mamba_cache_mode == "align" for g in planned.layout.groups if g.kind == "mamba")
    for family, (fam_layers, _, n) in FAMILIES.items():
        if fam_layers == layers:
            assert n == len(groups), family


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("family, seeds", [("qwen3-next", (0, 1, 7, 11)),
                                           ("jamba", (2, 3, 5))])
def test_hybrid_mamba_families_agree_with_the_model(pool, version, family, seeds):
    """The families' cases run step by step on the release, Mamba align groups at the aligned
    block size, and agree with the model."""
    for seed in seeds:
        res = lockstep(family_case(seed, family), version, pool)
        assert res.agree, (seed, res.summary())
        assert res.real["counters"]["steps"] > 0 and res.real["findings"] == []


def test_a_witness_leaves_mamba_groups_unchecked():
    """A Mamba group's block size is the platform's alignment of the model's pages, which no
    witness model sets: a layout of groups with one stays unchecked."""
    from simsched.planning import witness_models
    layout = Layout.from_json({"groups": [
        {"kind": "full", "block_size": 16},
        {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}]})
    models, complete, why = witness_models(layout)
    assert models == [] and not complete and "mamba" in why


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("family, blocks", [("qwen3-next", 28), ("jamba", 50)])
def test_a_hybrid_mamba_family_loads_a_prefix_back_from_the_cpu_tier(pool, version, family,
                                                                      blocks):
    """a's 100-token prompt is stored (its full blocks, and each Mamba group's state at the last
    full block), c's 500 tokens push it out of a pool of ``blocks`` blocks (the attention
    group's 16 blocks of 32 tokens or 32 of 16, and the Mamba groups' state blocks), and b, a's
    prompt again, loads it back: one load, and the model agrees step by step."""
    case = Case.from_json({"layout": {"layers": FAMILIES[family][0],
                                      "engine": {"num_gpu_blocks": blocks}},
                           "requests": LOAD, "timing": {"max_num_batched_tokens": 64}})
    res = lockstep(case, version, pool)
    assert res.agree, res.summary()
    assert res.real["counters"]["loads"] == 1, res.summary()


@pytest.mark.parametrize("family", ["qwen3-next", "jamba"])
def test_the_campaign_draws_the_hybrid_mamba_families(family):
    """``fuzz.strategies.planned_cases`` draws every family by name: a search over its draws
    finds a case of each hybrid Mamba family, with its layers and a pool of at least 24 blocks
    a group it plans."""
    from hypothesis import HealthCheck, find, settings

    from fuzz.strategies import planned_cases
    from simsched.families import family_of

    case = find(planned_cases(), lambda c: family_of(c.layout) == family,
                settings=settings(max_examples=2000, database=None,
                                  suppress_health_check=list(HealthCheck)))
    assert case.layout.engine.num_gpu_blocks >= 24 * FAMILIES[family][2]


def test_an_issue_text_names_the_model_of_a_layout_of_layers():
    """ISSUE.md's "A deployment of ...": a layout of layers is a model of those layers (and its
    family's name), never "no common model family"."""
    from fuzz.issue import family

    assert family(family_case(1, "mla+ring").layout) == (
        "a model of 4 mla + 4 ring layers (the mla+ring family of simsched.families)")
    other = Layout.from_json({"layers": [{"kind": "full", "count": 3}]})
    assert family(other) == "a model of 3 full layers"


def test_the_planner_is_asked_for_groups_alone():
    """Planning asks for the groups only: a crash of the offloading connector's own set-up
    (0.29.0 on an MLA group of 128-token blocks with a 64-token offload block: an assert, and
    with asserts stripped a ZeroDivisionError; what the case's run reports) is not a reason
    the planner would not build them."""
    from simsched.planning import REACHED, group_layout_reach

    case = groups_case([{"kind": "mla", "block_size": 128}], offload_block_size=64)
    with Releases.installed(["0.29.0"], timeout=120) as one:
        assert group_layout_reach(case, "0.29.0", one) == (
            REACHED, "0.29.0's planner builds these groups from layers 1xmla, --block-size 128")
        res = lockstep(case, "0.29.0", one)
    assert [(f["kind"], f["stage"]) for f in res.real["findings"]] == [("crash", "boot")], \
        res.summary()
