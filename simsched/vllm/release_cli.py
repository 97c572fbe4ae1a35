"""``simsched releases install | list | env | add | remove``: the command's subcommands, over the
installer (:mod:`simsched.vllm.installer`), the installed releases
(:mod:`simsched.vllm.releases`) and derived targets (:mod:`simsched.vllm.derived`). Each returns
the exit status; an error is one line on stderr.
"""

from __future__ import annotations

import sys
import time

from simsched.vllm.installer import base_ready, install
from simsched.vllm.releases import (BASE_MARKER, DEFAULT_RELEASES, KNOWN_RELEASES, ReleaseError,
                                    _base_dir, _read_json, env_prefix, installed,
                                    installed_derived, resolve, simsched_home, version_key)


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
