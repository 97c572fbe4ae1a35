"""``simsched replay`` on real releases: the whole case, step by step, on each release's real
Scheduler by default; exit 1 exactly when something shows. Needs the releases installed
(`simsched releases install`): without them these tests fail."""

import json
import subprocess
import sys

import pytest

from simsched.lockstep import HANDMADE

pytestmark = pytest.mark.real

RING_BOOT = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                   {"kind": "ring", "block_size": 4}]},
             "requests": [{"id": "r0", "prompt": [[7, 64]], "decode": 2}]}


def replay(tmp_path, case: dict, *args):
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))
    return subprocess.run([sys.executable, "-m", "simsched.cli", "replay", str(path), *args],
                          capture_output=True, text=True, timeout=600)


def test_boot_assert_fails_on_030_and_runs_clean_on_033(tmp_path):
    r = replay(tmp_path, RING_BOOT, "--release", "0.30.0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "crash:AssertionError:build_offloading_config" in r.stdout
    r = replay(tmp_path, RING_BOOT, "--release", "0.33.0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ran " in r.stdout and "steps: clean" in r.stdout   # every step ran, not the boot only


def test_a_step_level_bug_shows_with_its_first_bad_step(tmp_path):
    """The ring fence (HANDMADE["ring_fence"]): on 0.31.0 and 0.32.0 (the ring is no longer
    offloaded, 0.30.0 asserts at boot) a ring block is not watched, so b's step writes a block
    a's pending store still reads (INV-6, seen on the real run's shadow); 0.33.0 flushes the
    store first. Only running the steps can tell."""
    case = HANDMADE["ring_fence"]
    r = replay(tmp_path, case, "--release", "0.32.0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "invariant:INV-6" in r.stdout
    assert "the first bad step" in r.stdout and "violation INV-6" in r.stdout
    r = replay(tmp_path, case, "--release", "0.33.0")
    assert r.returncode == 0, r.stdout + r.stderr
    # the config chain alone sees nothing wrong on 0.32.0: the bug is in the steps
    r = replay(tmp_path, case, "--release", "0.32.0", "--config-only")
    assert r.returncode == 0, r.stdout + r.stderr


def test_unknown_release_is_one_line(tmp_path):
    r = replay(tmp_path, RING_BOOT, "--release", "9.9.9")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_copy_on_write_retention_is_no_second_owner(tmp_path):
    """Align-mode Mamba with a partial tail under async scheduling: 0.32.0+ retains the copy's
    source block in ``deferred_frees`` (``_free_cow_retained_blocks``) while the request still
    holds it: two references, one owner. The pool check counted it as two requests (INV-2)."""
    case = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                  {"kind": "mamba", "block_size": 16,
                                   "mamba_cache_mode": "align"}],
                       "engine": {"blocks_per_chunk": 2, "prefix_match_unit": 4,
                                  "async_scheduling": True, "retention_interval": 0}},
            "requests": [{"id": "r0", "prompt": [[0, 64]]}]}
    r = replay(tmp_path, case, "--release", "0.33.0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "steps: clean" in r.stdout
