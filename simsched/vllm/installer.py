"""Installing real vLLM releases on a CPU-only machine, without the CUDA stack.

The base environment first (``base/``: a venv with CPU torch 2.13.0 and the import closure,
``closure.txt``, every wheel pinned by hash), then each release's wheel: downloaded with pip,
its sha256 checked against :data:`~simsched.vllm.releases.KNOWN_RELEASES`, installed with
``pip --no-deps --target``, its CUDA extension modules removed, and smoke-imported (the
scheduler-side modules simsched drives). A release directory only ever appears complete: it is
built under ``releases/.tmp-*`` and renamed into place after its smoke import passed and its
marker was written. Installs hold the home's install lock (:func:`_install_lock`, also taken by
:mod:`simsched.vllm.derived`). Where the home's folders are and what is installed there is
:mod:`simsched.vllm.releases`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Mapping

from simsched.vllm.releases import (BASE_MARKER, BASE_PYTHON_VERSION, CLOSURE_FILE,
                                    KNOWN_RELEASES, RELEASE_MARKER, InstalledRelease, Release,
                                    ReleaseError, _base_dir, _base_python, _env_for, _home,
                                    _read_json, _releases_dir, _unknown, _write_json, installed)

# What the smoke import checks: the scheduler-side modules simsched drives.
SMOKE_MODULES = (
    "vllm.config",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.sched.scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.v1.kv_offload.cpu",
    "vllm.v1.request",
    "vllm.v1.kv_cache_interface",
)
_SMOKE_SCRIPT = (
    "import sys, importlib\n"
    "out, sys.stdout = sys.stdout, sys.stderr\n"
    f"for m in {SMOKE_MODULES!r}:\n"
    "    importlib.import_module(m)\n"
    "import vllm\n"
    "print(vllm.__version__, file=out)\n"
)
_BASE_SMOKE_SCRIPT = (
    "import importlib.util, torch, transformers, pydantic, msgspec, zmq, pytest\n"
    "assert importlib.util.find_spec('triton') is None, 'triton must not be installed'\n"
    "print(torch.__version__)\n"
)
# Compiled extension modules of a release: CUDA kernels that scheduler-side code never loads
# (they cannot even be loaded here: no libcuda). About 600 MB of a release's 800 MB.
_STRIP_GLOBS = ("vllm/**/*.so",)

SMOKE_TIMEOUT_S = 600
PIP_TIMEOUT_S = 3600

Progress = Callable[[str], None]
Downloader = Callable[[Release, Path, Path], Path]  # (release, base python, dest dir) -> wheel


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _clean_env(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """os.environ without what would redirect a child python, plus `extra`.

    PYTHONDONTWRITEBYTECODE goes too: the smoke import is what compiles a release's bytecode
    (12-15 s once), so that later imports take about 5 s."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(extra)
    return env


def _run(cmd: list[str], what: str, *, env: Mapping[str, str] | None = None,
         timeout: float = PIP_TIMEOUT_S) -> str:
    """Run `cmd`; on failure raise ReleaseError with `what` and the last line of its output."""
    try:
        proc = subprocess.run(cmd, env=env if env is not None else _clean_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ReleaseError(f"{what}: timed out after {timeout:.0f} s") from None
    if proc.returncode != 0:
        lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
        last = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        raise ReleaseError(f"{what}: {last}")
    return proc.stdout



# --- the base environment ----------------------------------------------------------------


def _host_python() -> str:
    if sys.version_info[:2] == BASE_PYTHON_VERSION:
        return sys.executable
    name = "python%d.%d" % BASE_PYTHON_VERSION
    found = shutil.which(name)
    if not found:
        raise ReleaseError(f"the base environment needs {name} (the closure pins cp311 wheels); "
                           f"none found on PATH")
    return found


def base_ready(home: Path | str | None = None, closure: Path = CLOSURE_FILE) -> bool:
    home = _home(home)
    marker = _read_json(_base_dir(home) / BASE_MARKER)
    return (marker is not None and marker.get("closure_sha256") == sha256_of(closure)
            and _base_python(home).exists())


def _ensure_base(home: Path, closure: Path, progress: Progress) -> str:
    """Build HOME/base unless its marker says it matches `closure`. Returns the closure sha."""
    closure_sha = sha256_of(closure)
    base = _base_dir(home)
    if base_ready(home, closure):
        return closure_sha
    started = time.monotonic()
    if _read_json(base / BASE_MARKER) is not None and _base_python(home).exists():
        # a complete base env built from another closure: pip installs what the closure adds
        # or re-pins and leaves what is already satisfied (release workers may be using it)
        progress(f"base env {base}: closure changed, updating it in place...")
    else:
        if base.exists():
            progress(f"base env {base}: incomplete, rebuilding")
            shutil.rmtree(base)
        progress(f"base env {base}: creating venv...")
        _run([_host_python(), "-m", "venv", str(base)], "creating the base venv")
        progress(f"base env: installing torch 2.13.0 (CPU) and the closure ({closure.name})...")
    _run([str(_base_python(home)), "-m", "pip", "install", "--quiet", "--no-deps",
          "--require-hashes", "--only-binary=:all:", "--no-cache-dir", "-r", str(closure)],
         "installing the base closure")
    torch_version = _run([str(_base_python(home)), "-c", _BASE_SMOKE_SCRIPT],
                         "base env smoke import", timeout=SMOKE_TIMEOUT_S).strip()
    seconds = time.monotonic() - started
    _write_json(base / BASE_MARKER, {
        "closure_sha256": closure_sha,
        "python": str(_base_python(home)),
        "torch": torch_version,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build_seconds": round(seconds, 1),
    })
    progress(f"base env: ready, torch {torch_version} ({seconds:.1f} s)")
    return closure_sha



# --- releases ----------------------------------------------------------------------------


def pip_download(release: Release, python: Path, dest: Path) -> Path:
    """Download `release`'s wheel into `dest` with pip; return the file."""
    _run([str(python), "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
          "--no-cache-dir", "--dest", str(dest), f"vllm=={release.version}"],
         f"vLLM {release.version}: downloading")
    wheel = dest / release.wheel
    if not wheel.exists():
        got = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise ReleaseError(f"vLLM {release.version}: pip downloaded {got}, expected {release.wheel}")
    return wheel


def _fetch_verified(release: Release, home: Path, download: Downloader,
                    progress: Callable[[str], None]) -> Path:
    """The release's wheel in HOME/downloads, its sha256 checked. Reuses a verified download."""
    downloads = home / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / release.wheel
    if wheel.exists() and sha256_of(wheel) == release.sha256:
        progress(f"reusing downloaded {release.wheel}")
        return wheel
    progress("downloading...")
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".tmp-") as tmp:
        got = Path(download(release, _base_python(home), Path(tmp)))
        if got.name != release.wheel:
            raise ReleaseError(f"vLLM {release.version}: got wheel {got.name}, "
                               f"pinned {release.wheel}")
        digest = sha256_of(got)
        if digest != release.sha256:
            got.unlink()
            raise ReleaseError(f"vLLM {release.version}: sha256 mismatch for {release.wheel}: "
                               f"expected {release.sha256}, got {digest}; file removed")
        os.replace(got, wheel)
    progress(f"verified sha256 {release.sha256[:16]}...")
    return wheel


def _smoke_import(release_dir: Path, python: Path, version: str,
                  expect: bool = True) -> str:
    """Import the scheduler-side modules from ``release_dir``; the vllm version it reports
    (which must be ``version`` when ``expect``)."""
    out = _run([str(python), "-c", _SMOKE_SCRIPT], f"vLLM {version}: smoke import failed",
               env=_clean_env(_env_for(release_dir)), timeout=SMOKE_TIMEOUT_S)
    got = out.strip().splitlines()[-1] if out.strip() else "?"
    if expect and got != version:
        raise ReleaseError(f"vLLM {version}: smoke import found vllm {got}")
    return got


def _strip_extensions(release_dir: Path) -> int:
    freed = 0
    for pattern in _STRIP_GLOBS:
        for path in release_dir.glob(pattern):
            freed += path.stat().st_size
            path.unlink()
    return freed


def _release_complete(path: Path, release: Release) -> dict | None:
    marker = _read_json(path / RELEASE_MARKER)
    if marker and marker.get("version") == release.version \
            and marker.get("wheel_sha256") == release.sha256:
        return marker
    return None


def _install_release(release: Release, home: Path, closure_sha: str, download: Downloader,
                     say: Callable[[str], None]) -> None:
    started = time.monotonic()
    python = _base_python(home)
    final = _releases_dir(home) / release.version
    marker = _release_complete(final, release)
    if marker and marker.get("closure_sha256") == closure_sha:
        say("already installed")
        return
    if marker:  # installed against another base closure: check it still imports
        say("base env changed since install, re-checking import...")
        _smoke_import(final, python, release.version)
        _write_json(final / RELEASE_MARKER, {**marker, "closure_sha256": closure_sha})
        say(f"ok ({time.monotonic() - started:.1f} s)")
        return

    wheel = _fetch_verified(release, home, download, say)
    tmp = Path(tempfile.mkdtemp(dir=_releases_dir(home), prefix=f".tmp-{release.version}-"))
    try:
        say("installing...")
        _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
              "--no-cache-dir", "--target", str(tmp), str(wheel)],
             f"vLLM {release.version}: pip install")
        freed = _strip_extensions(tmp)
        say(f"removed {freed / 2**20:.0f} MB of CUDA extension modules; smoke import...")
        _smoke_import(tmp, python, release.version)
        seconds = time.monotonic() - started
        _write_json(tmp / RELEASE_MARKER, {
            "version": release.version,
            "wheel": release.wheel,
            "wheel_sha256": release.sha256,
            "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": str(python),
            "closure_sha256": closure_sha,
            "install_seconds": round(seconds, 1),
        })
        if final.exists():  # left over without a valid marker
            shutil.rmtree(final)
        tmp.chmod(0o755)  # mkdtemp made it private
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    wheel.unlink(missing_ok=True)
    say(f"installed ({seconds:.1f} s)")


@contextlib.contextmanager
def _install_lock(home: Path):
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "install.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ReleaseError(f"another simsched install is running in {home}") from None
        yield


def _remove_leftovers(home: Path) -> None:
    """Temp dirs of installs that were killed; safe under the install lock."""
    for parent in (_releases_dir(home), home / "downloads"):
        for path in parent.glob(".tmp-*") if parent.exists() else ():
            shutil.rmtree(path, ignore_errors=True)


#: releases installed at once (``install``)
INSTALL_WORKERS = 2


def install(versions: Iterable[str] | None = None, home: Path | str | None = None,
            progress: Progress = print, *,
            releases: Mapping[str, Release] = KNOWN_RELEASES,
            download: Downloader = pip_download,
            closure: Path = CLOSURE_FILE) -> list[InstalledRelease]:
    """Install `versions` (default: all of `releases`) into `home`; return them installed.

    Builds or repairs the base env first. Idempotent and resumable: complete releases are
    skipped, a killed install leaves only temp dirs, removed on the next run."""
    home = _home(home)
    wanted = list(dict.fromkeys(versions or releases))
    for version in wanted:
        if version not in releases:
            raise _unknown(version, releases)
    with _install_lock(home):
        _releases_dir(home).mkdir(parents=True, exist_ok=True)
        _remove_leftovers(home)
        closure_sha = _ensure_base(home, closure, progress)

        def one(i: int, version: str) -> None:
            prefix = f"[{i}/{len(wanted)}] vllm {version}: "
            _install_release(releases[version], home, closure_sha, download,
                             lambda msg: progress(prefix + msg))
        # two at a time: one wheel downloads (the network) while the other unpacks and
        # smoke-imports (the disk and a core); each release has its own temp dir and marker.
        # A release that fails does not stop the others: its error is raised once they ran.
        with ThreadPoolExecutor(max_workers=INSTALL_WORKERS) as pool:
            for done in [pool.submit(one, i, v) for i, v in enumerate(wanted, 1)]:
                done.result()
    by_version = {r.version: r for r in installed(home)}
    return [by_version[v] for v in wanted]
