"""The vLLM releases simsched knows and the ones installed on this machine, and how a worker runs
one.

Layout under the simsched home (``$SIMSCHED_HOME`` or ``~/.cache/simsched``)::

    base/                      a venv: CPU torch 2.13.0 + the import closure (closure.txt)
    base/simsched-base.json    completion marker, holds the closure file's sha256
    releases/X.Y.Z/            one release, installed with ``pip --no-deps --target``
    releases/X.Y.Z/simsched-release.json   completion marker
    derived/NAME/              a derived target: a release's tree with a patch or a source
    derived/NAME/simsched-derived.json     tree's files over it (:mod:`simsched.vllm.derived`)
    downloads/                 wheels between download and install (removed once installed)

The known releases are ``releases.json`` beside this module (:data:`KNOWN_RELEASES`, each wheel
pinned by sha256); :func:`installed`, :func:`installed_derived`, :func:`find` and
:func:`resolve` read what the home holds (a release counts only once its marker is written:
:mod:`simsched.vllm.installer` builds it). A release is used by running the base venv's python
with ``PYTHONPATH`` pointing at the release directory (:func:`worker_command` /
:func:`worker_env`; :func:`env_prefix` for plain vLLM code). This module never imports vLLM itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import simsched

_HERE = Path(__file__).resolve().parent
CLOSURE_FILE = _HERE / "closure.txt"
RELEASES_FILE = _HERE / "releases.json"

BASE_MARKER = "simsched-base.json"
RELEASE_MARKER = "simsched-release.json"
DERIVED_MARKER = "simsched-derived.json"
BASE_PYTHON_VERSION = (3, 11)  # the closure pins cp311 wheels


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
