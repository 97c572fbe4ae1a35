"""The model's modules compiled at install (mypyc, ``setup.py``) and their Python sources.

``simsched.COMPILED`` lists the modules ``setup.py`` compiles. ``SIMSCHED_PURE=1`` imports their
sources instead, and so does a build older than a source. Where this process runs the compiled
modules (the CI's ``pip install -e .``), the golden corpus (``test_model_equivalence.py``) pins
them, and runs once more here on the sources, so that both stay the same model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import simsched

ROOT = Path(__file__).resolve().parent.parent
SHOW = ("import simsched, simsched.model.scheduler as m, "
        "simsched.model.offloading_scheduler as o; "
        "print(simsched.compiled(), m.__file__, o.__file__)")


def python(code: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(cwd), **(env or {})}, timeout=120)


def test_pure_imports_the_sources():
    r = python(SHOW, {"SIMSCHED_PURE": "1"})
    assert r.returncode == 0, r.stderr
    is_compiled, *files = r.stdout.split()
    assert is_compiled == "False" and all(f.endswith(".py") for f in files), r.stdout


def test_stale_build_runs_the_sources(tmp_path):
    """A source edited after the build: its sources run (all of them), with a warning."""
    if not simsched.compiled():
        pytest.skip("nothing compiled here (no pip install -e .): the sources run anyway")
    pkg = Path(simsched.__file__).parent
    shutil.copytree(pkg, tmp_path / "simsched", ignore=shutil.ignore_patterns("__pycache__"))
    for lib in pkg.parent.glob("*__mypyc*"):
        shutil.copy2(lib, tmp_path)
    r = python(SHOW, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("True "), (r.stdout, r.stderr)
    # a source edited after the build
    os.utime(tmp_path / "simsched" / "model" / "offloading_scheduler.py")
    r = python(SHOW, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    is_compiled, *files = r.stdout.split()
    assert is_compiled == "False" and all(f.endswith(".py") for f in files), r.stdout
    assert "older than their sources" in r.stderr


def test_in_place_rebuild_is_not_stale(tmp_path):
    """``setup.py build_ext --inplace`` rewrites mypyc's shared library but can leave a module's
    unchanged shim with its old time: the build counts as fresh when the library is newer than
    the sources."""
    if not simsched.compiled():
        pytest.skip("nothing compiled here (no pip install -e .): the sources run anyway")
    pkg = Path(simsched.__file__).parent
    shutil.copytree(pkg, tmp_path / "simsched", ignore=shutil.ignore_patterns("__pycache__"))
    libs = [shutil.copy2(lib, tmp_path) for lib in pkg.parent.glob("*__mypyc*")]
    sources = tmp_path / "simsched"
    t = max(p.stat().st_mtime for p in sources.rglob("*.py"))
    for src in sources.rglob("*.py"):
        os.utime(src, (t, t))                               # every source edited at t
    for shim in sources.rglob("*.so"):
        os.utime(shim, (t - 100, t - 100))                  # shims older than the sources
    for lib in libs:
        os.utime(lib, (t + 100, t + 100))                   # the library rebuilt after them
    r = python(SHOW, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("True "), (r.stdout, r.stderr)
    assert "older than their sources" not in r.stderr
    for lib in libs:
        os.utime(lib, (t - 100, t - 100))                   # nothing rebuilt: stale
    r = python(SHOW, cwd=tmp_path)
    assert r.stdout.startswith("False ") and "older than their sources" in r.stderr, r


def test_golden_corpus_on_the_sources_too():
    if not simsched.compiled():
        pytest.skip("nothing compiled here: test_model_equivalence.py ran on the sources")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "test_model_equivalence.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "SIMSCHED_PURE": "1"})
    assert r.returncode == 0, r.stdout[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
