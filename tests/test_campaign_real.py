"""A real campaign, end to end: the model and real vLLM 0.30.0 and 0.33.0 find upstream PR
#55037's boot assert, shrink it, and write a repro that fails on 0.30.0 and passes on 0.33.0.
Needs the releases installed (`simsched releases install`): without them these tests fail."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real

BOOT = "crash:AssertionError:build_offloading_config"


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    out = tmp_path_factory.mktemp("campaign")
    r = subprocess.run([sys.executable, "-m", "simsched.cli", "fuzz", "--budget", "60",
                        "--seed", "1", "--releases", "0.30.0,0.33.0", "--asserts", "on",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads((out / "report.json").read_text())


def boot_finding(data):
    """The boot assert as found on real releases: one cluster, the assert's line (other
    layouts that fail the same line, a lone Mamba group under DCP among them, are its
    variants, not findings of their own)."""
    found = [f for f in data["findings"] if f["signature"] == BOOT
             and "tokens_per_block % tokens_per_hash" in (f.get("source") or "")]
    assert found, [(f["signature"], f.get("source")) for f in data["findings"]]
    # the divisibility assert is one cluster whatever layout shows it (a ring group, a Mamba
    # block smaller than the hash unit...): its variants may be findings of their own
    assert len({f["cluster"] for f in found}) == 1, [(f["id"], f["cluster"]) for f in found]
    rings = [f for f in found if "ring" in f["layout"]]
    assert rings, [f["layout"] for f in found]
    return rings[0]


def test_boot_assert_found_on_030_not_033(campaign):
    out, data = campaign
    boot = boot_finding(data)
    assert boot["class"] == "bug"
    assert boot["releases_affected"] == ["0.30.0"]
    assert boot["releases_clean"] == ["0.33.0"]
    assert boot["range"] == "0.30.0: present since 0.30.0 (oldest run), fixed in 0.33.0"
    assert boot["kind"] == "crash" and boot["function"] == "build_offloading_config"
    assert boot["file"] == "distributed/kv_transfer/kv_connector/v1/offloading/config.py"
    # shrunk to at most two groups, or found on a model family (DeepSeek V4 style: its three
    # planned groups stay whole), which a deployment of that model reaches
    assert boot["groups"] <= 2 or boot["deployment"].startswith("reached: the "), boot
    assert "every-group" in boot["profiles_affected"]
    assert "prefix-cacheable" not in boot["profiles_affected"]


def test_the_main_campaign_runs_real_steps(campaign):
    """Real Scheduler steps on both releases; every bug's releases ran the case step by step
    (a crash at start-up stops the run at boot: its outcome is that crash); no tool error."""
    out, data = campaign
    summ = data["summary"]
    assert all(summ["real_steps_per_release"][v] > 0 for v in ("0.30.0", "0.33.0")), summ
    assert data["tool_errors"] == []
    bugs = [f for f in data["findings"] if f["class"] == "bug"]
    assert bugs
    for f in bugs:
        finding = json.loads((out / "repros" / f["id"] / "finding.json").read_text())
        assert finding["releases_affected"], f["id"]
        for v in finding["releases_clean"]:
            assert v not in finding["releases_not_run"]
    keys = [tuple(map(str, f["cluster_key"])) for f in data["findings"]]
    assert len(keys) == len(set(keys))               # one finding per cause
    for f in data["findings"]:                       # a cause found twice is one cluster
        for g in data["findings"]:
            if f["cluster_key"] in g["aliases"]:
                assert f["cluster"] == g["cluster"], (f["id"], g["id"])


def test_repro_fails_on_030_and_passes_on_033(campaign):
    out, data = campaign
    boot = boot_finding(data)
    test_file = out / "repros" / boot["id"] / "test_repro.py"
    # the two releases the campaign ran (the file parametrizes over every installed one)
    r = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                        "-k", "0.30.0 or 0.33.0", str(test_file)], capture_output=True,
                       text=True, timeout=900, cwd=test_file.parent)
    lines = r.stdout.splitlines()
    assert any(l.startswith("FAILED") and "[0.30.0]" in l for l in lines), r.stdout[-3000:]
    assert any(l.startswith("PASSED") and "[0.33.0]" in l for l in lines), r.stdout[-3000:]
    assert r.returncode == 1


def test_vllm_only_repro_of_the_campaign_fails_on_030_and_passes_on_033(campaign):
    """The campaign writes the bug's vLLM-only test unverified (no --verify-repros); run
    through each release's plain environment from an empty folder it fails on 0.30.0 and
    passes on 0.33.0."""
    from fuzz import vllm_repro_verify
    from simsched.vllm.releases import installed
    out, data = campaign
    boot = boot_finding(data)
    folder = out / "repros" / boot["id"]
    tests = sorted(folder.glob("test_vllm_*.py"))
    assert [t.name for t in tests] == ["test_vllm_boot_assert_build_offloading_config.py"]
    assert "; not verified (" in (folder / "README.md").read_text()
    releases = [r for r in installed() if r.version in ("0.30.0", "0.33.0")]
    verdict = vllm_repro_verify.verify(tests[0], boot, releases)
    assert verdict.results == {"0.30.0": "failed", "0.33.0": "passed"}, verdict.reason
    assert verdict.verified


def test_every_bug_cluster_gets_an_issue_text(campaign):
    """ISSUE.md beside each bug's repro; the boot assert's cites the raising line as 0.30.0's
    own config.py has it, and gives the releases as ranges."""
    out, data = campaign
    bugs = [f for f in data["findings"] if f["class"] == "bug"]
    for f in bugs:
        text = (out / "repros" / f["id"] / "ISSUE.md").read_text()
        assert text.startswith("# [Bug][KV offloading]: "), f["id"]
    others = [f for f in data["findings"] if f["class"] != "bug"]
    assert not any((out / "repros" / f["id"] / "ISSUE.md").exists() for f in others)
    text = (out / "repros" / boot_finding(data)["id"] / "ISSUE.md").read_text()
    assert text.startswith("# [Bug][KV offloading]: AssertionError in build_offloading_config")
    assert "Present in 0.30.0; absent from 0.33.0" in text
    assert "offloading/config.py` line " in text and "(vLLM 0.30.0)" in text
    assert "tokens_per_block % tokens_per_hash" in text.split("### Where\n")[1].split("###")[0]
    assert "--kv-transfer-config '{\"kv_connector\": \"OffloadingConnector\"" in text


def test_no_config_divergence_between_model_and_releases(campaign):
    """The model's config chain agrees with both releases' (trace-level gaps are listed as
    model-gap clusters; the config level is the part the model must get exactly)."""
    _, data = campaign
    assert [f["signature"] for f in data["findings"] if f["kind"] == "divergence"
            and (f.get("field") or "").startswith("config.")] == []
