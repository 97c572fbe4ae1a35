"""The command line: errors are one line naming the problem, never a traceback."""

import json
import subprocess
import sys

import pytest


def simsched(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "simsched.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("content, needle", [
    ("{", "not valid JSON"),
    ('{"layout": {"groups": [{"kind": "full"}]}}', "layout.groups[0].block_size: required"),
    ('{"layout": {"groups": [{"kind": "full", "block_size": 16}]}, "requests": 3}', "requests"),
])
@pytest.mark.parametrize("command", ["geometry", "replay"])
def test_malformed_case_is_one_line(tmp_path, content, needle, command):
    path = tmp_path / "case.json"
    path.write_text(content)
    r = simsched(command, str(path), *(["--model"] if command == "replay" else []))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("simsched: error:"), r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("content, needle", [
    (b'{"layout": "\xff\xfe"}', "not UTF-8 text (byte 0xff at offset 12)"),
    (b"[1, 2]", "expected a JSON object (a case or a bare layout), got an array"),
    (b'"case"', "expected a JSON object (a case or a bare layout), got a string"),
    (b"[" * 100000, "not valid JSON (nested too deeply)"),
    (None, "is a directory, not a case file"),
    ("missing", "cannot read: No such file or directory"),
], ids=["not-utf8", "array", "string", "deep", "directory", "missing"])
@pytest.mark.parametrize("command", ["geometry", "replay", "run"])
def test_unreadable_case_file_is_one_line(tmp_path, content, needle, command):
    path = tmp_path / "case.json"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    r = simsched(command, str(path), *(["--model"] if command == "replay" else []))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"simsched: error: {path}: {needle}", r.stderr


def test_unknown_profile(tmp_path):
    path = tmp_path / "case.json"
    path.write_text(json.dumps({"groups": [{"kind": "full", "block_size": 16}]}))
    r = simsched("geometry", str(path), "--profile", "nope")
    assert r.returncode == 2 and "unknown profile 'nope'" in r.stderr


def test_profiles_lists_releases():
    r = simsched("profiles")
    assert r.returncode == 0
    assert "every-group" in r.stdout and "0.30.0" in r.stdout and "upstream proposal" in r.stdout


def test_replay_model_exit_codes(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"groups": [{"kind": "full", "block_size": 16},
                                          {"kind": "ring", "block_size": 4}]}))
    r = simsched("replay", str(bad), "--model", "--profile", "every-group")
    assert r.returncode == 1 and "crash:AssertionError:build_offloading_config" in r.stdout
    r = simsched("replay", str(bad), "--model", "--profile", "prefix-cacheable")
    assert r.returncode == 0, r.stdout + r.stderr


def test_fuzz_unknown_target(tmp_path):
    r = simsched("fuzz", "--target", "0.99.0", "--budget", "1", "--out", str(tmp_path))
    assert r.returncode == 2 and "0.99.0" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("release, needle", [
    ("9.9.9", "9.9.9: not a known vLLM release (known: 0.25.1, "),
    ("0.30.0", "not installed (installed: none); run: simsched releases install 0.30.0"),
])
def test_replay_a_release_not_installed(tmp_path, monkeypatch, release, needle):
    # install is suggested only for a release simsched can install (releases.json)
    monkeypatch.setenv("SIMSCHED_HOME", str(tmp_path / "home"))
    path = tmp_path / "case.json"
    path.write_text(json.dumps({"groups": [{"kind": "full", "block_size": 16}]}))
    r = simsched("replay", str(path), "--release", release)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("simsched: error: "), r.stderr
    assert needle in lines[0]
    if release == "9.9.9":
        assert "releases install" not in lines[0] and "0.33.0" in lines[0]


def test_replay_a_dead_worker_is_a_tool_error_not_a_finding(tmp_path, monkeypatch, capsys):
    """A release worker that died (``crash:*:release_worker``) is simsched's failure: the release
    says tool error, not FAIL, and replay exits 2, not 1 (the exit of a finding)."""
    import contextlib
    import simsched.replay
    import simsched.targets
    from simsched.cli import main
    from simsched.outcome import Observation, Signature

    class Pool:
        versions = ["0.33.0"]

        def targets(self):
            return []

    def observe(case, models, releases, outcomes, **kw):
        outcomes["0.33.0"] = {"status": "worker", "exception": "WorkerDied",
                              "function": "release_worker", "message": "killed"}
        return [Observation(Signature("crash", "WorkerDied", "release_worker"), "0.33.0",
                            outcomes["0.33.0"])]

    monkeypatch.setattr(simsched.targets.Releases, "installed",
                        classmethod(lambda cls, only=None: contextlib.nullcontext(Pool())))
    monkeypatch.setattr(simsched.replay, "observe", observe)
    case = tmp_path / "case.json"
    case.write_text(json.dumps({"layout": {"groups": [{"kind": "full", "block_size": 16}]},
                                "requests": [{"id": "r0", "prompt": [[0, 64]]}]}))
    assert main(["replay", str(case), "--release", "0.33.0"]) == 2
    out = capsys.readouterr().out
    assert "tool error (simsched's worker, not vLLM): WorkerDied" in out and "FAIL" not in out
