"""Campaigns on the model: findings are found, shrunk, written out, and survive a resume."""

import json
import re

import pytest

from fuzz.campaign import Campaign, parse_target
from fuzz.evaluate import CampaignError
from fuzz.shrink import Hunt
from simsched.case import load_case
from simsched.targets import Releases


def model_campaign(out, budget=6.0, seed=1):
    with Releases(()) as pool:
        return Campaign(out, pool, model=True, run_releases=[], budget=budget, seed_=seed,
                        asserts=True, progress=lambda s: None).run()


def test_model_campaign_finds_and_shrinks_the_boot_assert(tmp_path):
    data = model_campaign(tmp_path, budget=30.0)
    boot = next(f for f in data["findings"]
                if f["signature"] == "crash:AssertionError:build_offloading_config"
                and "model:every-group" in f["present_on"]
                and "model:prefix-cacheable" not in f["present_on"])
    assert boot["groups"] <= 2 and boot["requests"] == 1
    assert "every-group" in boot["profiles_affected"]
    assert "prefix-cacheable" not in boot["profiles_affected"]
    case = load_case(tmp_path / boot["case"])
    assert len(case.layout.groups) <= 2
    for f in data["findings"]:
        folder = tmp_path / "repros" / f["id"]
        assert {p.name for p in folder.iterdir()} >= {"case.json", "test_repro.py", "README.md"}
    assert (tmp_path / "report.md").read_text().startswith("# simsched campaign report")


def test_findings_are_deduplicated_by_signature_and_where(tmp_path):
    data = model_campaign(tmp_path, budget=4.0)
    keys = [(f["signature"], tuple(f["present_on"])) for f in data["findings"]]
    assert len(keys) == len(set(keys)) and keys
    assert len({f["id"] for f in data["findings"]}) == len(keys)


def test_same_seed_same_findings(tmp_path):
    a = model_campaign(tmp_path / "a", budget=3.0, seed=7)
    b = model_campaign(tmp_path / "b", budget=3.0, seed=7)
    # the first finding of a round is a fixed function of the seed
    assert a["findings"][0]["signature"] == b["findings"][0]["signature"]
    assert (tmp_path / "a" / a["findings"][0]["case"]).read_text() == \
        (tmp_path / "b" / b["findings"][0]["case"]).read_text()


def test_resume_keeps_every_finding(tmp_path):
    first = model_campaign(tmp_path, budget=3.0)
    ids = {f["id"] for f in first["findings"]}
    second = model_campaign(tmp_path, budget=2.0, seed=2)
    assert ids <= {f["id"] for f in second["findings"]}


def test_damaged_finding_is_named_and_kept(tmp_path):
    bad = tmp_path / "repros" / "x" / "finding.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    (tmp_path / "report.json").write_text("{also not json")   # derived: simply rewritten
    said = []
    with Releases(()) as pool:
        data = Campaign(tmp_path, pool, model=True, run_releases=[], budget=1.0, seed_=1,
                        progress=said.append).run()
    assert any(str(bad) in line and "not a readable finding" in line for line in said)
    assert bad.read_text() == "{not json"
    assert json.loads((tmp_path / "report.json").read_text())["findings"] == data["findings"]


@pytest.mark.parametrize("target, installed, expect", [
    ("all", ["0.30.0"], (True, ["0.30.0"], "screen")),
    ("all", [], (True, [], "none")),
    ("config", ["0.30.0"], (True, ["0.30.0"], "none")),
    ("model", ["0.30.0"], (True, [], "none")),
    ("lockstep", ["0.30.0"], (True, ["0.30.0"], "every")),
    ("releases", ["0.30.0", "0.33.0"], (False, ["0.30.0", "0.33.0"], "every")),
    ("0.33.0", ["0.30.0", "0.33.0"], (False, ["0.33.0"], "every")),
])
def test_parse_target(target, installed, expect):
    assert parse_target(target, installed) == expect


@pytest.mark.parametrize("target, msg", [("0.99.0", "not installed"), ("bogus", "expected"),
                                         ("releases", "no vLLM release")])
def test_parse_target_errors(target, msg):
    with pytest.raises(CampaignError, match=msg):
        parse_target(target, [])


def test_report_json_contract(tmp_path):
    data = model_campaign(tmp_path, budget=2.0)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["format"] == "simsched-report/1"
    keys = {"id", "signature", "kind", "exception", "function", "file", "releases_affected",
            "releases_clean", "profiles_affected", "case", "groups", "requests", "steps"}
    for f in on_disk["findings"]:
        assert keys <= set(f)
        assert f["kind"] in ("crash", "invariant", "divergence")
    assert on_disk["findings"] == data["findings"]


def linked_pngs(out) -> list[str]:
    """The images report.md links, each checked to be a PNG file beside it."""
    names = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (out / "report.md").read_text())
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    return names


def test_report_md_links_its_plots(tmp_path):
    model_campaign(tmp_path, budget=2.0)
    names = linked_pngs(tmp_path)
    assert {"plot-findings.png", "plot-examples-per-s.png", "plot-coverage.png"} <= set(names)
    assert "plot-vllm-arcs.png" not in names     # no release ran: no vLLM coverage to plot


def test_steer_choices(tmp_path):
    with Releases(()) as pool:
        with pytest.raises(CampaignError, match="expected one of"):
            Campaign(tmp_path, pool, steer="bogus")
        with pytest.raises(CampaignError, match="runs no release"):
            Campaign(tmp_path, pool, model=True, run_releases=[], steer="coverage")
        assert Campaign(tmp_path, pool, steer=False).steer == "none"


def test_shrinking_keeps_the_bug_not_just_the_signature(tmp_path):
    """On one release, the ring group of upstream PR #55037 and a lone Mamba group under DCP raise
    the same assert of ``build_offloading_config`` (one cluster), but they are different variants:
    the ring one needs a ring spec and the every-group assert (0.29.0-0.30.0 in vLLM), the Mamba one
    the DCP-scaled hash unit of a single group, from 0.27.0 (``replay --all-releases`` on real
    vLLM shows exactly these release sets). A shrink step from one to the other is refused."""
    from simsched.case import Case, RequestSpec
    from simsched.layout import Engine, Group, Layout
    from simsched.outcome import Signature

    def case(groups, **engine):
        return Case(layout=Layout(groups=groups, engine=Engine(**engine)),
                    requests=(RequestSpec("r0", prompt=((101, 64),), decode=1),))

    ring = case((Group("mla", 64), Group("ring", 4)))
    ring_smaller = case((Group("full", 16), Group("ring", 4)))
    mamba_dcp = case((Group("mamba", 16, mamba_cache_mode="align"),), dcp_size=2)
    sig = Signature.parse("crash:AssertionError:build_offloading_config")
    with Releases(()) as pool:
        c = Campaign(tmp_path, pool, model=True, run_releases=[], budget=1.0, seed_=1,
                     asserts=True, progress=lambda s: None)
        fp_ring, fp_mamba = c.fingerprint(ring, sig), c.fingerprint(mamba_dcp, sig)
        hunt = Hunt(("crash",), "bug", sig, fp_ring, [], [], [], frozenset({"0.30.0"}))
        assert c.same_bug(ring_smaller, hunt)
        assert not c.same_bug(mamba_dcp, hunt)
    # both fail under 0.30.0's profile and neither under 0.31.0's; the upstream fix of the assert
    # alone (ring groups exempt) ends the ring one and leaves the single-group DCP scaling
    assert "every-group" in fp_ring and "every-group" in fp_mamba
    assert "prefix-cacheable" not in fp_ring and "prefix-cacheable" not in fp_mamba
    assert "fix-assert-only" in fp_mamba and "fix-assert-only" not in fp_ring
    assert c.fingerprint(ring, Signature.parse("invariant:INV-4")) == ()


def test_simsched_own_crash_is_a_tool_error_not_a_finding(tmp_path, monkeypatch):
    """An exception inside the model is simsched's, not vLLM's: it never becomes a finding;
    its case is saved under tool-errors/ and ``simsched fuzz`` exits 1."""
    import simsched.model
    from simsched.cli import main

    real = simsched.model.run_case

    def broken(case, profile, **kw):
        if len(case.layout.groups) == 1 and case.layout.groups[0].kind == "full":
            raise KeyError("the model's own bug")
        return real(case, profile, **kw)

    monkeypatch.setattr(simsched.model, "run_case", broken)
    rc = main(["fuzz", "--target", "model", "--budget", "4", "--seed", "1",
               "--out", str(tmp_path)])
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["tool_errors"], data["summary"]
    e = data["tool_errors"][0]
    assert e["exception"] == "KeyError" and e["function"].startswith("simsched.")
    assert (tmp_path / e["case"]).is_file()
    assert all(f["class"] != "tool-error" and not (f["function"] or "").startswith("simsched")
               for f in data["findings"])
    assert rc == 1
    assert "Tool errors" in (tmp_path / "report.md").read_text()


def test_report_leads_with_the_bugs_of_the_newest_release():
    from fuzz.report import markdown, summary

    def finding(fid, klass, affected, clean):
        return {"id": fid, "class": klass, "cluster": fid, "kind": "crash",
                "signature": "crash:AssertionError:f", "exception": "AssertionError",
                "function": "f", "source": "assert x", "layout": "full/16 + ring/4",
                "case": f"repros/{fid}/case.json", "groups": 2, "requests": 1,
                "releases_affected": affected, "releases_clean": clean, "range": "r",
                "first_bad_step": None}
    data = {"seed": 1, "budget_s": 1, "elapsed_s": 1.0, "examples": 1, "examples_per_s": 1.0,
            "targets": [], "releases_installed": ["0.30.0", "0.33.0"], "families": {},
            "knobs": {}, "findings": [finding("old-bug", "bug", ["0.30.0"], ["0.33.0"]),
                                      finding("refusal", "validation", ["0.33.0"], []),
                                      finding("new-bug", "bug", ["0.33.0"], ["0.30.0"])]}
    data["summary"] = summary(data)
    assert data["summary"]["clusters"] == {"bug": 2, "validation": 1}
    assert data["summary"]["bugs_in_newest"] == 1
    md = markdown(data)
    present, fixed = md.index("## Bugs present in 0.33.0 (1)"), md.index("## Bugs fixed since (1)")
    assert present < md.index("new-bug") < fixed < md.index("old-bug")
    assert md.index("<details><summary>Validation") > md.index("old-bug")
    assert md.index("refusal") > md.index("<details><summary>Validation")

    # a start-up assert whose fix is a clean refusal, found after the refusal: it joins the
    # refusal's cluster, and the cluster is a bug (its gravest member's class)
    data["findings"].append(dict(finding("assert", "bug", ["0.30.0"], []), cluster="refusal"))
    data["summary"] = summary(data)
    assert data["summary"]["clusters"] == {"bug": 3}
    md = markdown(data)
    # the refusal on 0.33.0 is the fix, not the assert's presence there
    assert data["summary"]["bugs_in_newest"] == 1
    assert md.index("## Bugs fixed since (2)") < md.index("[assert]")


def test_a_cause_that_does_not_show_again_is_set_aside(tmp_path, monkeypatch):
    """A run that is not deterministic (here: the model shows an invariant on the first call
    only) makes hypothesis raise Flaky while shrinking: the campaign goes on, keeps the case as
    a tool error, and reports no finding for it."""
    from simsched.targets import SharedModelRuns

    real, calls = SharedModelRuns.outcome, []

    def once(self, target):
        config, findings, steps = real(self, target)
        if target.profile.name == "fix-assert-only" and not calls:
            calls.append(self.case)
            return config, findings + [{"kind": "invariant", "inv_id": "INV-5", "step": 0,
                                        "detail": "once", "what": "x"}], steps
        return config, findings, steps

    monkeypatch.setattr(SharedModelRuns, "outcome", once)
    with Releases(()) as pool:
        data = Campaign(tmp_path, pool, model=True, run_releases=[], budget=3.0, seed_=1,
                        progress=lambda s: None).run()
    assert calls
    assert any(e["exception"] == "Nondeterministic" for e in data["tool_errors"])
    assert not any(f["signature"] == "invariant:INV-5" for f in data["findings"])


def test_nothing_is_reported_on_a_layout_no_engine_builds(tmp_path):
    """An align-mode Mamba block other than the engine's block size is a layout no release
    builds (vLLM sets mamba_block_size = block_size): the model's crash on it, under a
    release's profile or a fix proposal's, is no finding; the same crash on a layout engines
    do build is one."""
    from simsched.case import Case
    from simsched.layout import deployment_refusal
    from simsched.replay import observe

    def case(mamba_block):
        return Case.from_json({"layout": {
            "groups": [{"kind": "full", "block_size": 16},
                       {"kind": "mamba", "block_size": mamba_block, "mamba_cache_mode": "align"}],
            "engine": {"prefix_match_unit": 32}},
            "requests": [{"id": "r0", "prompt": [[0, 64]]}]})
    with Releases(()) as pool:
        c = Campaign(tmp_path, pool, model=True, run_releases=[], budget=1.0, seed_=1,
                     progress=lambda s: None)
        for mamba_block, reported in ((16, True), (4, False)):
            one = case(mamba_block)
            assert (deployment_refusal(one.layout) is None) == reported
            outcomes: dict = {}
            obs = observe(one, c.model_targets, [], outcomes, steps=[])
            assert any(o.signature.function == "resolve_kv_cache_block_sizes" for o in obs)
            assert bool(c.triage(one, obs, outcomes)) == reported


def test_a_clusters_range_spans_its_members():
    """Two bug findings of one cause, one on 0.29.0 (0.30.0 refuses its case), one on
    0.31.0-0.33.0: the cluster's row spans both, its own range each finding keeps."""
    from fuzz.report import cluster_range

    def member(fid, affected, clean, refused):
        return {"id": fid, "class": "bug", "cluster": "c", "releases_affected": affected,
                "releases_clean": clean, "releases_refused": dict.fromkeys(refused, "r"),
                "range": "own"}
    one = member("a", ["0.29.0"], [], ["0.30.0"])
    assert cluster_range([one]) == "own"
    two = member("b", ["0.31.0", "0.33.0"], ["0.28.0"], [])
    assert cluster_range([one, two]) == ("0.29.0: regressed in 0.29.0, fixed in 0.30.0 (refused "
                                         "at start-up); 0.31.0 to 0.33.0: regressed in 0.31.0, "
                                         "not fixed in the newest")


def test_an_interrupt_while_a_finding_is_written_leaves_its_folder_whole(tmp_path, monkeypatch):
    """Ctrl-C between a finding's test_repro.py and its README.md: the campaign's last report
    finishes that folder before it writes finding.json (which load_findings trusts)."""
    from fuzz import repro
    real, calls = repro.vllm_test, []

    def interrupted_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(repro, "vllm_test", interrupted_once)
    data = model_campaign(tmp_path, budget=30.0)
    assert data["interrupted"] and len(calls) >= 2 and data["findings"]
    for f in data["findings"]:
        folder = tmp_path / "repros" / f["id"]
        assert {p.name for p in folder.iterdir()} >= {"case.json", "test_repro.py", "README.md",
                                                      "finding.json"}


def test_the_shrinker_keeps_a_model_s_layers_whole():
    """A planned layout of layers pairs the model's layers with the groups a release's planner
    built from them: the shrinker drops requests but neither a planned group nor an engine flag
    (the DeepSeek V4 family at --block-size 16 is a model whose pages the planner cannot unify,
    and its groups without the ring are no planner's), whatever the finding's check says."""
    from dataclasses import replace

    from fuzz.shrink import simplify
    from simsched.families import family_case
    from simsched.layout import Group, Layout

    case = family_case(5, "deepseek-v4")
    planned = [Group(kind="mla", block_size=64, layers=4),
               Group(kind="sliding_window_mla", block_size=64, layers=4, sliding_window=64),
               Group(kind="ring", block_size=8, layers=4)]
    case = replace(case, layout=replace(case.layout, groups=tuple(planned)))
    tried = []

    def still_shows(cand):
        tried.append(cand)
        return "shown"
    shrunk, _ = simplify(case, still_shows, "shown", seconds=5)
    assert tried and all(c.layout == case.layout for c in tried)
    assert shrunk.layout == case.layout and len(shrunk.requests) == 1
    # a layout of groups written by hand still loses groups and flags
    hand = replace(case, layout=Layout(groups=tuple(planned), engine=case.layout.engine))
    shrunk, _ = simplify(hand, still_shows, "shown", seconds=5)
    assert len(shrunk.layout.groups) == 1 and shrunk.layout.engine.block_size is None


def test_the_knobs_coverage_counts_a_mamba_group_s_speculative_blocks():
    """A Mamba group under speculative decoding has its speculative state blocks (the knob
    issue 20 names ``groups[i].num_speculative_blocks``, set as every deployment sets it): the
    coverage counts it there, and not without drafts or without a Mamba group."""
    from simsched.case import Case
    from fuzz.campaign import knobs_of

    def case(groups, speculative=None):
        engine = {"speculative": speculative} if speculative else {}
        return Case.from_json({"layout": {"groups": groups, "engine": engine},
                               "requests": [{"id": "a", "prompt": [[1, 32]]}]})
    mamba = [{"kind": "full", "block_size": 16},
             {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}]
    mtp = {"method": "mtp", "num_tokens": 2}
    assert "groups.num_speculative_blocks" in knobs_of(case(mamba, mtp))
    assert "groups.num_speculative_blocks" not in knobs_of(case(mamba))
    assert "groups.num_speculative_blocks" not in knobs_of(case(mamba[:1], mtp))
