"""Installing real vLLM releases on a CPU-only machine, without the CUDA stack.

Layout under the simsched home (``$SIMSCHED_HOME`` or ``~/.cache/simsched``)::

    base/                      a venv: CPU torch 2.13.0 + the import closure (closure.txt)
    base/simsched-base.json    completion marker, holds the closure file's sha256
    releases/X.Y.Z/            one release, installed with ``pip --no-deps --target``
    releases/X.Y.Z/simsched-release.json   completion marker
    derived/NAME/              a derived target: a release's tree with a patch or a source
    derived/NAME/simsched-derived.json     tree's files over it (:mod:`simsched.vllm.derived`)
    downloads/                 wheels between download and install (removed once installed)

A release directory only ever appears complete: it is built under ``releases/.tmp-*`` and
renamed into place after its smoke import passed and its marker was written. A release is used
by running the base venv's python with ``PYTHONPATH`` pointing at the release directory
(`worker_command` / `worker_env`). This module never imports vLLM itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import simsched

_HERE = Path(__file__).resolve().parent
CLOSURE_FILE = _HERE / "closure.txt"
RELEASES_FILE = _HERE / "releases.json"

BASE_MARKER = "simsched-base.json"
RELEASE_MARKER = "simsched-release.json"
DERIVED_MARKER = "simsched-derived.json"
BASE_PYTHON_VERSION = (3, 11)  # the closure pins cp311 wheels

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


class ReleaseError(Exception):
    """A release cannot be installed, found or used; the message says why and what to do."""


@dataclass(frozen=True)
class Release:
    """A known vLLM release: the wheel simsched installs for it, pinned by sha256."""

    version: str
    wheel: str
    sha256: str


@dataclass(frozen=True)
class InstalledRelease:
    """A target a worker can run: a pinned release, or a derived target built on one.

    ``version`` is the name the target goes by everywhere (``--releases``, reports, repro
    files): ``X.Y.Z`` for a release, NAME for a derived target, whose ``base`` is the release it
    is built on and ``origin`` says from what (the patch's sha256, or the source tree)."""

    version: str
    path: Path  # releases/X.Y.Z or derived/NAME: goes first on the worker's PYTHONPATH
    python: Path  # the base venv's interpreter
    wheel_sha256: str
    base: str | None = None
    origin: str = ""

    @property
    def release(self) -> str:
        """The pinned release whose behaviour profile stands for this target."""
        return self.base or self.version


Progress = Callable[[str], None]
Downloader = Callable[[Release, Path, Path], Path]  # (release, base python, dest dir) -> wheel


def version_key(version: str) -> tuple[int, ...]:
    """'0.10.0' -> (0, 10, 0): releases compare as integer tuples, not strings."""
    try:
        return tuple(int(part) for part in version.split("."))
    except ValueError:
        raise ReleaseError(f"not a release version: {version!r}") from None


def _load_known_releases(path: Path = RELEASES_FILE) -> Mapping[str, Release]:
    rows = json.loads(path.read_text())["releases"]
    table = {row["version"]: Release(row["version"], row["wheel"], row["sha256"]) for row in rows}
    ordered = {v: table[v] for v in sorted(table, key=version_key)}
    return types.MappingProxyType(ordered)


KNOWN_RELEASES: Mapping[str, Release] = _load_known_releases()
DEFAULT_RELEASES: tuple[str, ...] = tuple(KNOWN_RELEASES)


def simsched_home() -> Path:
    env = os.environ.get("SIMSCHED_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "simsched"


def _home(home: Path | str | None) -> Path:
    return Path(home).expanduser() if home is not None else simsched_home()


def _base_dir(home: Path) -> Path:
    return home / "base"


def _base_python(home: Path) -> Path:
    return _base_dir(home) / "bin" / "python"


def _releases_dir(home: Path) -> Path:
    return home / "releases"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _unknown(version: str, releases: Mapping[str, Release]) -> ReleaseError:
    return ReleaseError(f"unknown vLLM release '{version}'; known: {', '.join(releases)}")


# --- the worker's environment -------------------------------------------------------------


def _simsched_root() -> Path:
    """The directory that makes ``import simsched`` work: the project root.

    If simsched is installed into a site-packages directory, putting that directory on the
    worker's path would shadow the base venv's packages (numpy...). A shim directory holding
    only a ``simsched`` symlink is used instead."""
    package = Path(simsched.__file__).resolve().parent
    root = package.parent
    if root.name not in ("site-packages", "dist-packages"):
        return root
    key = hashlib.sha256(str(package).encode()).hexdigest()[:12]
    shim = Path(tempfile.gettempdir()) / f"simsched-path-{key}"
    link = shim / "simsched"
    if not link.exists():
        shim.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            link.symlink_to(package, target_is_directory=True)
    return shim


def _env_for(release_dir: Path) -> dict[str, str]:
    return {
        "PYTHONPATH": os.pathsep.join([str(release_dir), str(_simsched_root())]),
        "PYTHONHASHSEED": "0",
        "PYTHONNOUSERSITE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(release_dir / "vllm-cache"),
    }


def worker_env(release: InstalledRelease) -> dict[str, str]:
    """Environment variables a worker process for `release` needs.

    Only the variables simsched sets; merge them over ``os.environ``:
    ``subprocess.run(worker_command(r) + [...], env={**os.environ, **worker_env(r)})``."""
    return _env_for(release.path)


def plain_env(release: InstalledRelease) -> dict[str, str]:
    """The environment of plain vLLM code of `release` (a vLLM-only repro test): the worker's,
    with only the release on the path and the current directory kept off it
    (``PYTHONSAFEPATH``), so that ``import simsched`` fails from any folder, a checkout of
    simsched included, and pytest comes from the base env."""
    env = _env_for(release.path)
    env["PYTHONPATH"] = str(release.path)
    env["PYTHONSAFEPATH"] = "1"
    return env


# Variables of the caller's environment that would redirect or change the interpreter.
_UNSET_FOR_PLAIN = ("PYTHONHOME", "PYTHONSTARTUP", "PYTHONOPTIMIZE", "PYTHONINSPECT")


def env_prefix(release: InstalledRelease) -> list[str]:
    """``env -u ... NAME=value ... PYTHON``: a command prefix that runs plain vLLM code of
    `release`, as ``$(simsched releases env X.Y.Z) -m pytest FILE`` (the shell splits it on
    white space, so no part may hold any)."""
    parts = ["env"] + [part for name in _UNSET_FOR_PLAIN for part in ("-u", name)]
    parts += [f"{k}={v}" for k, v in sorted(plain_env(release).items())]
    parts.append(str(release.python))
    bad = [p for p in parts if not p or any(c.isspace() for c in p)]
    if bad:
        raise ReleaseError(f"vLLM {release.version}: a path holds white space, the printed "
                           f"command would split it: {bad[0]!r}")
    return parts


def worker_command(release: InstalledRelease) -> list[str]:
    """The interpreter to run a worker for `release` with (append ``-m module`` and args)."""
    return [str(release.python)]


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


def installed(home: Path | str | None = None) -> list[InstalledRelease]:
    """Releases whose install completed, sorted by version. Empty without a base env."""
    home = _home(home)
    python = _base_python(home)
    if not python.exists() or not _releases_dir(home).exists():
        return []
    found = []
    for path in _releases_dir(home).iterdir():
        marker = _read_json(path / RELEASE_MARKER)
        if path.name.startswith(".") or not marker or marker.get("version") != path.name:
            continue
        with contextlib.suppress(ReleaseError):
            version_key(path.name)
            found.append(InstalledRelease(path.name, path, python, marker.get("wheel_sha256", "")))
    return sorted(found, key=lambda r: version_key(r.version))


def _derived_dir(home: Path) -> Path:
    return home / "derived"


def installed_derived(home: Path | str | None = None) -> list[InstalledRelease]:
    """Derived targets whose build completed (:mod:`simsched.vllm.derived`), sorted by name;
    one whose base release is no longer installed is left out."""
    home = _home(home)
    python = _base_python(home)
    have = {r.version for r in installed(home)}
    found = []
    if not python.exists() or not _derived_dir(home).exists():
        return []
    for path in sorted(_derived_dir(home).iterdir()):
        marker = _read_json(path / DERIVED_MARKER)
        if path.name.startswith(".") or not marker or marker.get("name") != path.name \
                or marker.get("base") not in have:
            continue
        found.append(InstalledRelease(path.name, path, python, marker.get("base_sha256", ""),
                                      base=marker["base"], origin=marker.get("origin", "")))
    return found


def is_release(name: str) -> bool:
    """A release's name (X.Y.Z), not a derived target's (which starts with a letter)."""
    return all(part.isdigit() for part in name.split("."))


def find(name: str, home: Path | str | None = None) -> InstalledRelease | None:
    """The installed release or derived target called ``name``, if any."""
    for r in installed(home) if is_release(name) else installed_derived(home):
        if r.version == name:
            return r
    return None


def release_of(name: str, home: Path | str | None = None) -> str:
    """The pinned release a target name stands on: a release itself, a derived target's base
    (a name not installed is returned as it is)."""
    if is_release(name):
        return name
    found = find(name, home)
    return found.release if found is not None else name


def resolve(spec: str, home: Path | str | None = None,
            releases: Mapping[str, Release] = KNOWN_RELEASES) -> list[InstalledRelease]:
    """'0.30.0', '0.30.0,0.33.0', 'releases' or 'all' -> installed releases (never empty)."""
    home = _home(home)
    have = {r.version: r for r in installed(home)}
    if spec.strip() in ("all", "releases"):   # the pinned releases; derived ones by name
        if not have:
            raise ReleaseError(f"no vLLM releases installed in {home}; install them with: "
                               f"simsched releases install")
        return list(have.values())
    wanted = [v.strip() for v in spec.split(",") if v.strip()]
    if not wanted:
        raise ReleaseError("no vLLM release given; say e.g. 0.30.0 or all")
    have.update({r.version: r for r in installed_derived(home)})
    for version in wanted:
        if version not in releases and version not in have:
            raise _unknown(version, releases)
    missing = [v for v in wanted if v not in have]
    if missing:
        raise ReleaseError(f"vLLM {', '.join(missing)} not installed in {home}; install with: "
                           f"simsched releases install {' '.join(missing)}")
    return [have[v] for v in wanted]


# --- CLI ---------------------------------------------------------------------------------


def _error(err: ReleaseError) -> int:
    print(f"simsched: error: {err}", file=sys.stderr)
    return 2


def cli_install(versions: list[str] | None = None) -> int:
    """`simsched releases install [X.Y.Z ...]` (no versions: all defaults)."""
    started = time.monotonic()
    try:
        done = install(versions or DEFAULT_RELEASES)
    except ReleaseError as err:
        return _error(err)
    print(f"{len(done)} release(s) ready in {simsched_home()} ({time.monotonic() - started:.1f} s)")
    return 0


def cli_env(version: str) -> int:
    """`simsched releases env X.Y.Z`: print the command prefix of `env_prefix`."""
    try:
        if "," in version or version.strip() in ("all", "releases"):
            raise ReleaseError(f"one release is needed, got {version!r}")
        release, = resolve(version)
        print(" ".join(env_prefix(release)))
    except ReleaseError as err:
        return _error(err)
    return 0


def cli_list(args: object = None) -> int:
    """`simsched releases list`: the known releases and which are installed."""
    home = simsched_home()
    base = _base_dir(home)
    marker = _read_json(base / BASE_MARKER)
    if marker is None:
        state = "not built"
    elif base_ready(home):
        state = f"ready, torch {marker.get('torch', '?')}"
    else:
        state = "stale (closure changed): run simsched releases install"
    print(f"simsched home: {home}")
    print(f"base env:      {base} ({state})")
    have = {r.version: r for r in installed(home)}
    for version in sorted(set(KNOWN_RELEASES) | set(have), key=version_key):
        where = str(have[version].path) if version in have else "not installed"
        print(f"  vllm {version:<8} {where}")
    if len(have) < len(KNOWN_RELEASES):
        print("install with: simsched releases install [X.Y.Z ...]")
    derived = installed_derived(home)
    if derived:
        print("derived targets (simsched releases add / remove):")
    for target in derived:
        print(f"  {target.version:<13} {target.path}\n{'':16}derived: {target.origin}")
    return 0


def cli_add(name: str, base: str, patch: str | None, tree: str | None) -> int:
    """`simsched releases add NAME --base X.Y.Z (--patch FILE | --tree PATH)`."""
    from simsched.vllm import derived
    try:
        target = derived.add(name, base, patch=patch, tree=tree,
                             progress=lambda s: print(s, file=sys.stderr, flush=True))
    except ReleaseError as err:
        return _error(err)
    print(f"{target.version}: {derived.describe(target)}")
    return 0


def cli_remove(name: str) -> int:
    from simsched.vllm import derived
    try:
        derived.remove(name)
    except ReleaseError as err:
        return _error(err)
    print(f"removed {name}")
    return 0
