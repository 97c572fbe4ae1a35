"""Arc coverage inside release workers (simsched.vllm.inside.coverage), and the campaign's
``--steer coverage`` on a real release. The worker tests need vLLM 0.30.0 installed: without it
they fail, never skip."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from simsched.targets import Releases
from simsched.vllm.inside.coverage import ArcTracer

BRANCHY = '''\
def pick(x):
    if x > 0:
        return "pos"
    return "neg"


def plain(x):
    return x + 1
'''


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tracer_records_arcs_of_the_chosen_files_only(tmp_path):
    pkg = tmp_path / "vllm"
    (pkg / "v1" / "kv_offload").mkdir(parents=True)
    (pkg / "v1" / "kv_offload" / "m.py").write_text(BRANCHY)
    (pkg / "other.py").write_text(BRANCHY)
    traced = load(pkg / "v1" / "kv_offload" / "m.py", "cov_traced")
    untraced = load(pkg / "other.py", "cov_untraced")
    tracer = ArcTracer(str(pkg))
    tracer.start()
    try:
        traced.pick(1)
        untraced.pick(-1)
        first = tracer.take()
        traced.pick(1)
        again = tracer.take()
        traced.pick(-1)
        other_branch = tracer.take()
        traced.plain(1)
        traced.plain(2)
        plain = tracer.take()
    finally:
        tracer.stop()
    # pick(1): entry -> line 2 -> line 3 -> exit; other.py is not traced
    assert first["hit"] == first["new"] == 3 and tracer.files == ["v1/kv_offload/m.py"]
    assert again["hit"] == 3 and again["new"] == 0 and again["rare"] == pytest.approx(1.5)
    # pick(-1) shares the entry arc only: 2 -> 4 and 4 -> exit are new
    assert other_branch["new"] == 2
    assert plain["new"] == 2          # branch-free: entry -> line 8 -> exit, traced once
    assert tracer.summary() == {"v1/kv_offload/m.py": 7}



@pytest.mark.real
def test_worker_reports_coverage_of_the_offloading_code():
    layout_full = {"groups": [{"kind": "full", "block_size": 16}]}
    layout_ring = {"groups": [{"kind": "mla", "block_size": 64}, {"kind": "ring", "block_size": 4}]}
    item = lambda layout: {"layout": layout, "num_tokens": 256}   # noqa: E731
    with Releases.installed(["0.30.0"], coverage=True) as pool:
        w = pool.worker("0.30.0")
        w.call("config_batch", items=[item(layout_full)])
        pool.reset_coverage()
        w.call("config_batch", items=[item(layout_full)])
        full = pool.take_coverage()
        w.call("config_batch", items=[item(layout_full)])
        full_again = pool.take_coverage()
        crash = w.call("config_batch", items=[item(layout_ring)])[0]
        ring = pool.take_coverage()
        per_file = w.call("coverage", action="summary")
    assert full["new"] > 50 and full["total"] == full["new"]
    assert full_again["new"] == 0 and full_again["hit"] > 0
    # the boot assert of upstream PR #55037: the ring's path through build_offloading_config
    assert crash["exception"] == "AssertionError"
    assert ring["new"] > 0 and ring["total"] == full["total"] + ring["new"]
    assert "distributed/kv_transfer/kv_connector/v1/offloading/config.py" in per_file
    assert not any(f.startswith("config/") for f in per_file)   # only the offloading code
    with Releases.installed(["0.30.0"]) as plain:
        plain.worker("0.30.0").call("config_batch", items=[item(layout_full)])
        assert plain.worker("0.30.0").call("coverage", action="take") == {"active": False}
        assert plain.take_coverage()["total"] == 0


@pytest.mark.real
def test_coverage_steered_campaign_reports_arcs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "simsched.cli", "fuzz", "--target", "0.30.0",
                        "--releases", "0.30.0", "--asserts", "on", "--steer", "coverage",
                        "--budget", "6", "--seed", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["steer"] == "coverage" and data["vllm_arcs"] > 100
    assert data["arcs_timeline"][-1]["arcs"] <= data["vllm_arcs"]
    assert "![vLLM offloading code covered](plot-vllm-arcs.png)" in \
        (tmp_path / "report.md").read_text()
    assert (tmp_path / "plot-vllm-arcs.png").stat().st_size > 0
