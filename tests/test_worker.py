"""The release worker protocol, against a REAL vLLM release.

Releases are located by :func:`release_spec` through ``simsched.vllm.releases``; a release that
is not installed makes the tests FAIL: they are never skipped.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from simsched.vllm.worker import (HarnessError, ReleaseWorker, WorkerDied, WorkerSpec,
                                  WorkerTimeout, spec_for)

FULL16_RING4 = {"groups": [{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}]}


def release_spec(version: str, *, asserts: bool = True, extra_env: dict | None = None
                 ) -> WorkerSpec:
    try:
        spec = spec_for(version, asserts=asserts)
    except LookupError:
        pytest.fail(f"vLLM release {version} is not installed: run `simsched releases install`",
                    pytrace=False)
    if extra_env:
        spec = WorkerSpec(spec.version, spec.python, {**spec.env, **extra_env}, spec.optimize)
    return spec


@pytest.fixture(scope="module")
def worker():
    w = ReleaseWorker(release_spec("0.30.0", extra_env={"SIMSCHED_WORKER_TEST_OPS": "1"}),
                      timeout=120)
    yield w
    w.close()


def test_ready_ping_and_batch(worker):
    assert worker.ping()["pong"] is True
    assert worker.ready == {"ready": True, "version": "0.30.0", "optimize": 0}
    assert worker.start_seconds is not None
    out = worker.config_batch([
        {"layout": {"groups": [{"kind": "full", "block_size": 16}]}, "num_tokens": 40},
        {"layout": {"groups": []}, "num_tokens": 4},        # invalid layout: isolated
        {"layout": FULL16_RING4, "num_tokens": 40},
    ])
    assert [o["status"] for o in out] == ["ok", "invalid", "error"]
    assert out[0]["offload_keys"] == [[0, 1]]


def test_harness_error_is_reported_and_worker_survives(worker):
    pid = worker.pid
    with pytest.raises(HarnessError) as e:
        worker.call("no_such_op")
    assert "ValueError: unknown op" in e.value.error
    with pytest.raises(HarnessError):
        worker.call("config_batch")                       # missing "items"
    assert worker.pid == pid and worker.ping()["pong"]


def test_killed_worker_raises_died_then_restarts(worker):
    worker.ping()
    old = worker.pid
    os.kill(old, signal.SIGKILL)
    with pytest.raises(WorkerDied) as e:
        worker.ping()
    assert e.value.version == "0.30.0" and e.value.signal == signal.SIGKILL
    assert worker.ping()["pong"] and worker.pid != old
    assert worker.starts >= 2


def test_timeout_kills_then_restarts(worker):
    worker.ping()
    old = worker.pid
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout) as e:
        worker.call("sleep", seconds=30, timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert e.value.op == "sleep" and e.value.seconds == 0.5
    assert worker.pid is None                              # killed
    assert worker.ping()["pid"] != old


def test_sleep_op_needs_the_test_switch():
    with ReleaseWorker(release_spec("0.30.0"), timeout=60) as w:
        with pytest.raises(HarnessError, match="unknown op 'sleep'"):
            w.call("sleep", seconds=0)


def test_optimized_worker_announces_it():
    with ReleaseWorker(release_spec("0.30.0", asserts=False), timeout=60) as w:
        assert w.start()["optimize"] == 1
