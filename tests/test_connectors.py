"""The case format's connector paths (``engine.connector``, ``engine.secondary_tiers``,
``requests[].remote_prefill``: :mod:`simsched.connectors`): parsed, validated with an error
that names the field, written back unchanged; and what the model does not mirror is named."""

import pytest

from simsched.case import Case
from simsched.layout import Layout, LayoutError, Speculative
from simsched.model import unmodelled_path
from simsched.profiles import profile_for_release

FULL = [{"kind": "full", "block_size": 16}]


def _layout(**engine) -> Layout:
    return Layout.from_json({"groups": FULL, "engine": engine})


@pytest.mark.parametrize("engine", [
    {"connector": {"kind": "simple_cpu", "lazy_offload": True}},
    {"connector": {"kind": "simple_cpu", "lazy_offload": False}},
    {"connector": {"kind": "multi", "order": ["nixl", "offloading"]}},
    {"secondary_tiers": [{"kind": "fs", "io_latency": 2}]},
])
def test_a_connector_path_is_written_back_as_given(engine):
    layout = _layout(**engine)
    assert layout.to_json()["engine"] == {k: v for k, v in engine.items()}
    assert Layout.from_json(layout.to_json()) == layout


def test_the_default_path_is_not_written():
    """A case of the OffloadingConnector alone reads and writes as before the connector knob
    existed: the same JSON, so the same case IDs and corpus entries."""
    layout = Layout.from_json({"groups": FULL})
    assert "engine" not in layout.to_json()
    assert _layout(connector={"kind": "offloading"}) == layout


@pytest.mark.parametrize("engine, field", [
    ({"connector": {"kind": "lmcache"}}, "layout.engine.connector.kind"),
    ({"connector": {"kind": "offloading", "lazy_offload": True}},
     "layout.engine.connector.lazy_offload"),
    ({"connector": {"kind": "simple_cpu", "order": ["offloading", "nixl"]}},
     "layout.engine.connector.order"),
    ({"connector": {"kind": "multi", "order": ["offloading", "offloading"]}},
     "layout.engine.connector.order"),
    ({"connector": {"kind": "multi"}, "secondary_tiers": [{"kind": "fs"}]},
     "layout.engine.secondary_tiers"),
    ({"secondary_tiers": [{"kind": "s3"}]}, "layout.engine.secondary_tiers[0].kind"),
    ({"secondary_tiers": [{"kind": "fs", "io_latency": 0}]},
     "layout.engine.secondary_tiers[0].io_latency"),
])
def test_a_bad_connector_field_is_named(engine, field):
    with pytest.raises(LayoutError) as e:
        _layout(**engine)
    assert e.value.field == field


def test_a_remote_prefill_needs_the_multi_connector():
    requests = [{"id": "p", "prompt": [[0, 64]], "remote_prefill": 2}]
    case = Case.from_json({"layout": {"groups": FULL,
                                      "engine": {"connector": {"kind": "multi"}}},
                           "requests": requests})
    assert case.requests[0].remote_prefill == 2
    assert Case.from_json(case.to_json()) == case
    with pytest.raises(LayoutError) as e:
        Case.from_json({"layout": {"groups": FULL}, "requests": requests})
    assert e.value.field == "requests[0].remote_prefill"


def test_the_model_names_the_paths_it_does_not_mirror():
    assert unmodelled_path(Layout.from_json({"groups": FULL})) is None
    assert unmodelled_path(_layout(eviction_policy="arc")) is None     # a knob, not a path
    lazy = _layout(connector={"kind": "simple_cpu", "lazy_offload": True})
    assert unmodelled_path(lazy) is None
    assert unmodelled_path(lazy, profile_for_release("0.30.0")) is None
    assert unmodelled_path(lazy, profile_for_release("0.29.0")) is None     # (the legacy manager)
    # Mamba (model._simple_cpu_gap): modelled from 0.27.0, with speculative decoding or DCP from
    # 0.28.0 (profile extra simple_cpu_mamba)
    mamba = Layout.from_json({"groups": FULL + [{"kind": "mamba", "block_size": 16,
                                                 "mamba_cache_mode": "align"}],
                              "engine": {"connector": {"kind": "simple_cpu"}}})
    assert unmodelled_path(mamba) is None
    assert unmodelled_path(mamba, profile_for_release("0.28.0")) is None
    assert unmodelled_path(mamba, profile_for_release("0.27.0")) is None
    assert unmodelled_path(mamba, profile_for_release("0.26.0")) == \
        "engine.connector=simple_cpu(eager) with mamba groups (0.25.1-0.26.0)"
    spec = mamba.with_engine(speculative=Speculative("ngram", 2))
    assert unmodelled_path(spec, profile_for_release("0.28.0")) is None
    assert unmodelled_path(spec, profile_for_release("0.27.1")) == \
        "engine.connector=simple_cpu(eager) with mamba groups and speculative decoding " \
        "(0.27.0-0.27.1)"
    # fine-grained hash hits (a Mamba block wider than the hash unit; as wide under DCP from
    # 0.29.0): the producer partial-tail copy is not modelled
    fine = "engine.connector=simple_cpu(eager) with mamba groups with fine-grained hash hits"
    wide = mamba.with_engine(prefix_match_unit=8)
    assert unmodelled_path(wide) == fine
    assert unmodelled_path(wide, profile_for_release("0.28.0")) == fine
    dcp = mamba.with_engine(dcp_size=2)
    assert unmodelled_path(dcp) == unmodelled_path(dcp, profile_for_release("0.29.0")) == fine
    assert unmodelled_path(dcp, profile_for_release("0.28.0")) is None
    assert unmodelled_path(dcp, profile_for_release("0.27.0")) == \
        "engine.connector=simple_cpu(eager) with mamba groups under DCP (0.27.0-0.27.1)"
    ring = Layout.from_json({"groups": FULL + [{"kind": "ring", "block_size": 16}],
                             "engine": {"connector": {"kind": "simple_cpu"}}})
    assert unmodelled_path(ring) is None
    assert unmodelled_path(_layout(connector={"kind": "multi"})) is None
    mtp = _layout(connector={"kind": "multi"}, speculative={"method": "mtp", "num_tokens": 2})
    assert unmodelled_path(mtp) == "engine.connector=multi(offloading+nixl) with MTP"
    fs = _layout(secondary_tiers=[{"kind": "fs"}])
    assert unmodelled_path(fs) is None
    assert unmodelled_path(fs, profile_for_release("0.25.1")) is None


def test_a_case_on_an_unmodelled_path_runs_no_model():
    """On a path the model does not mirror it runs nothing (no model finding, no config chain
    of the wrong connector), and the release's step run is the whole check (here: no release
    given, so nothing at all): a SimpleCPU case with fine-grained hash hits (a Mamba block of
    two hash units). The fs tiers and the
    SimpleCPU path are modelled on every release; the SimpleCPU path's config chain is not the
    OffloadingConnector's: no config is compared."""
    from simsched.profiles import PROFILES
    from simsched.replay import observe
    from simsched.targets import ModelTarget
    requests = [{"id": "a", "prompt": [[0, 64]]}]
    mamba = Case.from_json({"layout": {"groups": [
        {"kind": "full", "block_size": 32},
        {"kind": "mamba", "block_size": 32, "mamba_cache_mode": "align"}],
        "engine": {"prefix_match_unit": 16, "connector": {"kind": "simple_cpu"}}},
        "requests": requests})
    outcomes: dict = {}
    obs = observe(mamba, [ModelTarget(p) for p in PROFILES.values()], [], outcomes)
    assert obs == [] and outcomes == {}
    simple = Case.from_json({"layout": {"groups": FULL,
                                        "engine": {"connector": {"kind": "simple_cpu"}}},
                             "requests": requests})
    outcomes = {}
    obs = observe(simple, [ModelTarget(PROFILES[p]) for p in ("legacy-spec-init", "every-group",
                                                             "prefix-cacheable")], [], outcomes)
    assert obs == [] and sorted(outcomes) == ["model:every-group", "model:legacy-spec-init",
                                              "model:prefix-cacheable"]


def test_a_simple_cpu_case_is_not_judged_by_the_offloading_config_chain():
    """The OffloadingConnector's config chain (``build_offloading_config``, the offload keys'
    checks) is no part of a SimpleCPUOffloadConnector engine: an ``offload_block_size`` the
    OffloadingConnector refuses is no finding of the model on the SimpleCPU path, which runs
    the case (a campaign showed such model-only clusters)."""
    from simsched.targets import ModelTarget
    from simsched.profiles import PROFILES
    layout = {"groups": [{"kind": "full", "block_size": 12}],
              "engine": {"offload_block_size": 256}}
    requests = [{"id": "a", "prompt": [[0, 64]], "decode": 2}]
    offloading = Case.from_json({"layout": layout, "requests": requests})
    config, findings, _ = ModelTarget(PROFILES["every-group"]).outcome(offloading)
    assert config["status"] == "error" and findings[0]["function"] == "build_offloading_config"
    simple = dict(layout, engine=dict(layout["engine"], connector={"kind": "simple_cpu"}))
    case = Case.from_json({"layout": simple, "requests": requests})
    config, findings, steps = ModelTarget(PROFILES["every-group"]).outcome(case)
    assert config["status"] == "ok" and findings == [] and steps > 0
