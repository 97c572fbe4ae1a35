"""The layout language and case files: round trips and one-line errors that name the field."""

import json

import pytest
from hypothesis import given, settings

from fuzz.strategies import config_cases, layouts
from simsched.case import Case, load_case
from simsched.layout import Layout, LayoutError

REF = {"groups": [{"kind": "mla", "block_size": 64}, {"kind": "ring", "block_size": 4}]}


def test_round_trip_of_a_layout():
    layout = Layout.from_json(REF)
    assert layout.to_json() == REF
    assert layout.describe() == "mla/64 + ring/4"
    assert [g.prefix_cacheable for g in layout.groups] == [True, False]


@settings(max_examples=200, deadline=None)
@given(config_cases(asserts=None))
def test_generated_cases_round_trip(case):
    again = Case.from_json(json.loads(case.dumps()))
    assert again == case
    assert again.dumps() == case.dumps()


@settings(max_examples=300, deadline=None)
@given(layouts(families=("mamba_hybrid",)))
def test_mamba_hybrid_align_mode_uses_the_attention_block_size(layout):
    """vLLM sets mamba_block_size = cache_config.block_size in align mode: the family draws no
    align-mode layout a real engine would not build (the harness refuses those)."""
    attn, mamba = layout.groups
    assert mamba.kind == "mamba"
    if mamba.mamba_cache_mode == "align":
        assert mamba.block_size == attn.block_size


@settings(max_examples=400, deadline=None)
@given(layouts(families=("gpt_oss", "deepseek_v4", "free")))
def test_no_windowed_or_chunked_local_group_is_drawn_under_dcp(layout):
    """vLLM asserts sliding-window and chunked-local groups unsupported under DCP (the harness
    refuses them), and a Mamba model's one group too: the families with such groups draw them at
    dcp_size 1 only."""
    kinds = {g.kind for g in layout.groups}
    if kinds & {"sliding_window", "sliding_window_mla", "chunked_local"} or kinds == {"mamba"} \
            and len(layout.groups) == 1:
        assert layout.engine.dcp_size == 1, layout.describe()


@pytest.mark.parametrize("bad, field, reason", [
    ({"groups": []}, "layout.groups", "non-empty"),
    ({"groups": [{"kind": "sliding_window", "block_size": 16}]},
     "layout.groups[0].sliding_window", "required"),
    ({"groups": [{"kind": "full", "block_size": 16, "sliding_window": 8}]},
     "layout.groups[0].sliding_window", "not used"),
    ({"groups": [{"kind": "nope", "block_size": 16}]}, "layout.groups[0].kind", "one of"),
    ({"groups": [{"kind": "full", "block_size": 0}]}, "layout.groups[0].block_size", "between"),
    ({"groups": [{"kind": "full", "block_size": "16"}]}, "layout.groups[0].block_size", "integer"),
    ({"groups": [{"kind": "full", "block_size": True}]}, "layout.groups[0].block_size", "integer"),
    ({"groups": [{"kind": "mamba", "block_size": 16, "mamba_cache_mode": "all"}]},
     "layout.groups[0].mamba_cache_mode", "one of"),
    ({"groups": [{"kind": "full", "block_size": 16, "drafter": True}]},
     "layout.groups[0].drafter", "speculative"),
    ({"groups": [{"kind": "full", "block_size": 16}], "engine": {"dcp_size": 0}},
     "layout.engine.dcp_size", "between"),
    ({"groups": [{"kind": "full", "block_size": 16}], "engine": {"speculative": {"method": "x",
      "num_tokens": 1}}}, "layout.engine.speculative.method", "one of"),
    ({"groups": [{"kind": "full", "block_size": 16}], "engine": {"bogus": 1}},
     "layout.engine.bogus", "unknown field"),
    ([1, 2], "layout", "JSON object"),
])
def test_impossible_layout_names_field(bad, field, reason):
    with pytest.raises(LayoutError) as e:
        Layout.from_json(bad)
    assert e.value.field == field
    assert reason in e.value.reason
    assert "\n" not in str(e.value)


def test_vllm_level_conflicts_are_not_refused_by_the_layout():
    # vLLM itself rejects both knobs at once; predicting that error is the model's job.
    Layout.from_json({"groups": [{"kind": "full", "block_size": 16}],
                      "engine": {"blocks_per_chunk": 2, "offload_block_size": 32}})


@pytest.mark.parametrize("text, field", [
    ("{", "not valid JSON"),
    ('{"layout": {"groups": [{"kind": "full", "block_size": 16}]}, "requests": [{"id": "a"}]}',
     "requests[0].prompt"),
    ('{"layout": {"groups": [{"kind": "full", "block_size": 16}]}, "format": "other/9"}',
     "format"),
    ('{"layout": {"groups": [{"kind": "full", "block_size": 16}]}, '
     '"requests": [{"id": "a", "prompt": [[0, 4]]}, {"id": "a", "prompt": [[0, 4]]}]}',
     "duplicate request id"),
    ('{"layout": {"groups": [{"kind": "full", "block_size": 16}]}, '
     '"requests": [{"id": "a", "prompt": [[0, -4]]}]}', "requests[0].prompt[0]"),
])
def test_malformed_case_file(tmp_path, text, field):
    path = tmp_path / "case.json"
    path.write_text(text)
    with pytest.raises(LayoutError) as e:
        load_case(path)
    assert field in str(e.value)
    assert str(path) in str(e.value)


def test_missing_case_file(tmp_path):
    with pytest.raises(LayoutError, match="cannot read"):
        load_case(tmp_path / "absent.json")


def test_bare_layout_file_is_a_case(tmp_path):
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(REF))
    assert load_case(path).layout == Layout.from_json(REF)


@pytest.mark.parametrize("groups, engine, why", [
    ([{"kind": "full", "block_size": 16},
      {"kind": "mamba", "block_size": 4, "mamba_cache_mode": "align"}], {}, "Mamba block size 4"),
    ([{"kind": "full", "block_size": 16},
      {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "none"}], {}, "sets it to align"),
    ([{"kind": "sliding_window", "block_size": 16, "sliding_window": 32}], {"dcp_size": 2},
     "dcp_size 2"),
    # engines do build these: same Mamba block as the attention block; "none" without prefix
    # caching; Mamba beside full attention under DCP
    ([{"kind": "full", "block_size": 16},
      {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}], {"dcp_size": 2}, None),
    ([{"kind": "full", "block_size": 16},
      {"kind": "mamba", "block_size": 4, "mamba_cache_mode": "none"}],
     {"enable_prefix_caching": False}, None),
])
def test_deployment_refusal_names_the_layouts_no_engine_builds(groups, engine, why):
    from simsched.layout import deployment_refusal
    got = deployment_refusal(Layout.from_json({"groups": groups, "engine": engine}))
    assert (got is None) if why is None else (why in got), got
