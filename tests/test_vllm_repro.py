"""vLLM-only repros: the plain release environment (`simsched releases env`), the generated
``test_vllm_*.py`` files (fuzz/vllm_repro.py) and their verification on real releases.

The real checks need `simsched releases install` to have run; they FAIL when a release they
name is missing."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from simsched.vllm import releases as rel
from simsched.vllm.releases import InstalledRelease, ReleaseError

ROOT = Path(__file__).resolve().parent.parent


def _installed(version: str) -> InstalledRelease:
    have = {r.version: r for r in rel.installed()}
    assert version in have, (f"vLLM {version} not installed in {rel.simsched_home()}: "
                             f"run `simsched releases install {version}`")
    return have[version]


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "simsched.cli", *args], cwd=cwd, env=env,
                          text=True, capture_output=True, timeout=60)


# --- simsched releases env ---------------------------------------------------------------


def test_env_prefix_has_only_the_release_on_the_path(tmp_path):
    release = InstalledRelease("0.30.0", tmp_path / "releases" / "0.30.0",
                               tmp_path / "base" / "bin" / "python", "")
    parts = rel.env_prefix(release)
    assert parts[0] == "env" and parts[-1] == str(release.python)
    assigned = dict(p.split("=", 1) for p in parts if "=" in p)
    assert assigned["PYTHONPATH"] == str(release.path)     # no simsched root beside it
    assert assigned["PYTHONSAFEPATH"] == "1"               # nor the current directory
    assert assigned["VLLM_NO_USAGE_STATS"] == assigned["HF_HUB_OFFLINE"] == "1"
    assert ["-u", "PYTHONHOME"] == parts[1:3] and "PYTHONOPTIMIZE" in parts


def test_env_prefix_refuses_white_space(tmp_path):
    release = InstalledRelease("0.30.0", tmp_path / "my releases" / "0.30.0",
                               tmp_path / "base" / "bin" / "python", "")
    with pytest.raises(ReleaseError, match="white space"):
        rel.env_prefix(release)


def test_env_of_an_unknown_release_is_a_one_line_error():
    for version in ("0.99.0", "0.30.0,0.33.0"):
        proc = _cli("releases", "env", version)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.startswith("simsched: error: ") and proc.stderr.count("\n") == 1


def test_changed_closure_updates_the_base_in_place(tmp_path, monkeypatch):
    """A base env built from another closure is updated by pip, not removed and rebuilt
    (release workers of other processes may be running on it)."""
    home = tmp_path / "home"
    (home / "base" / "bin").mkdir(parents=True)
    (home / "base" / "bin" / "python").symlink_to(sys.executable)
    (home / "base" / rel.BASE_MARKER).write_text(json.dumps({"closure_sha256": "old"}))
    (home / "base" / "keep").write_text("a file of the installed env")
    closure = tmp_path / "closure.txt"
    closure.write_text("# one more pin\n")
    calls = []
    monkeypatch.setattr(rel, "_run", lambda cmd, what, **kw: calls.append(cmd) or "2.13.0+cpu\n")
    rel._ensure_base(home, closure, lambda msg: None)
    assert (home / "base" / "keep").exists()
    assert not any("venv" in cmd for cmd in calls)
    assert any(cmd[1:4] == ["-m", "pip", "install"] and str(closure) in cmd for cmd in calls)
    assert rel.base_ready(home, closure)


def test_release_env_runs_vllm_and_pytest_but_not_simsched(tmp_path):
    """From the simsched checkout itself (where the cwd would make simsched importable) and
    from an empty folder."""
    proc = _cli("releases", "env", "0.33.0")
    assert proc.returncode == 0, proc.stderr
    prefix = shlex.split(proc.stdout.strip())
    assert prefix[-1] == str(_installed("0.33.0").python)
    test = tmp_path / "test_plain.py"
    test.write_text(
        "import importlib.util\n\n"
        "import pytest\nimport vllm\n\n\n"
        "def test_plain():\n"
        "    assert vllm.__version__ == '0.33.0'\n"
        "    assert importlib.util.find_spec('simsched') is None\n"
        "    with pytest.raises(ModuleNotFoundError):\n"
        "        import simsched  # noqa: F401\n")
    for cwd in (ROOT, tmp_path):
        run = subprocess.run(prefix + ["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                       str(test)], cwd=cwd, text=True, capture_output=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "1 passed" in run.stdout
