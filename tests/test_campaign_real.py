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
    r = subprocess.run([sys.executable, "-m", "simsched.cli", "fuzz", "--budget", "45",
                        "--seed", "1", "--releases", "0.30.0,0.33.0", "--asserts", "on",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads((out / "report.json").read_text())


def boot_finding(data):
    """The boot assert as found on real releases (the model alone finds it on more layouts).

    Other bugs raise from the same function on 0.30.0 (a lone Mamba group under DCP, an
    offload block size with mixed group block sizes); each is its own finding, told apart by its
    fingerprint, so the one of PR #55037 is the one whose message names the divisibility."""
    on_030 = [f for f in data["findings"]
              if f["signature"] == BOOT and f["present_on"] == ["0.30.0"]]
    keys = [tuple(f["fingerprint"]) for f in on_030]
    assert len(keys) == len(set(keys)), keys     # one finding per fingerprint
    found = [f for f in on_030 if "not divisible by tokens_per_hash" in f["message"]]
    assert found, [(f["signature"], f["present_on"], f["message"]) for f in data["findings"]]
    return min(found, key=lambda f: (f["groups"], f["id"]))


def test_boot_assert_found_on_030_not_033(campaign):
    out, data = campaign
    boot = boot_finding(data)
    assert boot["releases_affected"] == ["0.30.0"]
    assert boot["releases_clean"] == ["0.33.0"]
    assert boot["kind"] == "crash" and boot["function"] == "build_offloading_config"
    assert boot["file"] == "distributed/kv_transfer/kv_connector/v1/offloading/config.py"
    assert boot["groups"] <= 2
    assert {"every-group", "every-group-no-clamp"} <= set(boot["profiles_affected"])
    assert "prefix-cacheable" not in boot["profiles_affected"]


def test_repro_fails_on_030_and_passes_on_033(campaign):
    out, data = campaign
    boot = boot_finding(data)
    test_file = out / "repros" / boot["id"] / "test_repro.py"
    r = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                        str(test_file)], capture_output=True, text=True, timeout=900,
                       cwd=test_file.parent)
    lines = r.stdout.splitlines()
    assert any(l.startswith("FAILED") and "[0.30.0]" in l for l in lines), r.stdout[-3000:]
    assert any(l.startswith("PASSED") and "[0.33.0]" in l for l in lines), r.stdout[-3000:]
    assert r.returncode == 1


def test_no_divergence_between_model_and_releases(campaign):
    _, data = campaign
    assert [f["signature"] for f in data["findings"] if f["kind"] == "divergence"] == []
