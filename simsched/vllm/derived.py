"""Derived targets: an installed release with a contributor's patch or source tree over it.

``simsched releases add NAME --base X.Y.Z --patch FILE`` applies a unified diff (``git diff``
of a vLLM checkout: paths ``a/vllm/...``) to a copy of the release's tree;
``--tree PATH`` copies the ``.py`` files of the checkout's ``vllm/`` package over it (nothing
is compiled, the CUDA extension modules stay stripped, files the checkout lacks keep the
release's version: a checkout has no generated ``_version.py``). The copy is hard links to the
release's files, so it costs no disk; a changed file is always written as a new file.

The build happens in ``derived/.tmp-NAME-*`` and is renamed into place only after the smoke
import passed and the marker was written: a patch that does not apply or a tree that does not
import leaves nothing behind. A target is then used wherever a release is, by its NAME; its
marker names its base release, which stands for it wherever a behaviour profile is needed.

A ``--tree`` target remembers the tree: :func:`refresh` rebuilds it when the tree's ``.py``
files changed since (a campaign calls it at start), so a live checkout is fuzzed as it is.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from simsched.vllm import installer
from simsched.vllm import releases as rel
from simsched.vllm import unidiff
from simsched.vllm.releases import InstalledRelease, ReleaseError

#: a derived target's name: not a version, not a word the command line reserves
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_+-]{0,63}$")
RESERVED = frozenset({"all", "releases", "model", "config", "lockstep"})


def _check_name(name: str, home: Path) -> None:
    if not NAME_RE.match(name) or name in RESERVED:
        raise ReleaseError(f"target name {name!r}: a letter then letters, digits, '_', '+' or "
                           f"'-' (not a version, not one of {', '.join(sorted(RESERVED))})")
    if rel.find(name, home) is not None or (rel._derived_dir(home) / name).exists():
        raise ReleaseError(f"target {name!r} already exists; remove it first: "
                           f"simsched releases remove {name}")


def _base_release(base: str, home: Path) -> InstalledRelease:
    found = {r.version: r for r in rel.installed(home)}
    if base not in found:
        have = ", ".join(found) or "none"
        raise ReleaseError(f"--base {base}: not an installed release (installed: {have}); "
                           f"run: simsched releases install {base}")
    return found[base]


def _link_copy(src: Path, dst: Path) -> None:
    """A copy of a release's tree made of hard links (a plain copy across file systems)."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)
    shutil.copytree(src, dst, copy_function=link, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(rel.RELEASE_MARKER, "vllm-cache"))


def _drop_bytecode(tree: Path, paths: list[str]) -> None:
    """Remove the base's compiled bytecode of the changed files (links to the base's)."""
    for path in paths:
        source = tree / path
        for pyc in (source.parent / "__pycache__").glob(source.stem + ".*.pyc"):
            pyc.unlink()


def tree_files(tree: Path) -> dict[str, Path]:
    """The ``.py`` files of a checkout's ``vllm/`` package: ``vllm/...`` -> its file."""
    package = tree / "vllm"
    if not (package / "__init__.py").is_file():
        raise ReleaseError(f"--tree {tree}: no vllm/ package there (expected "
                           f"{package}/__init__.py: give the checkout's root)")
    return {str(p.relative_to(tree)): p for p in sorted(package.rglob("*.py"))
            if "__pycache__" not in p.parts}


def tree_digest(tree: Path) -> str:
    """sha256 over the names and contents of the tree's ``.py`` files."""
    digest = hashlib.sha256()
    for name, path in tree_files(tree).items():
        digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _overlay_tree(tree: Path, dst: Path) -> list[str]:
    """Copy the tree's ``.py`` files that differ from the base's over ``dst``."""
    changed = []
    for name, path in tree_files(tree).items():
        target = dst / name
        data = path.read_bytes()
        if target.is_file() and target.read_bytes() == data:
            continue
        if target.exists():
            target.unlink()              # a hard link to the base's file: never write through
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        changed.append(name)
    return changed


def _build(name: str, base: InstalledRelease, home: Path, source: dict,
           progress: Callable[[str], None]) -> InstalledRelease:
    """Build the target in a temp dir, smoke-import it, write its marker, move it in place."""
    parent = rel._derived_dir(home)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".tmp-{name}-"))
    try:
        _link_copy(base.path, tmp)
        if source["kind"] == "patch":
            patch = Path(source["patch"])
            files = unidiff.parse(patch.read_text(), patch.name)
            changed = unidiff.apply(files, tmp, patch.name)
            origin = f"{base.version} + patch {patch.name} (sha256 {source['patch_sha256']})"
        else:
            changed = _overlay_tree(Path(source["tree"]), tmp)
            origin = f"{base.version} + tree {source['tree']}"
        _drop_bytecode(tmp, changed)
        progress(f"{name}: {len(changed)} file(s) over vllm {base.version}; smoke import...")
        try:
            got = installer._smoke_import(tmp, base.python, base.version, expect=False)
        except ReleaseError as e:
            raise ReleaseError(f"{name}: {str(e).replace(f'vLLM {base.version}: ', '')}") \
                from None
        marker = {"name": name, "base": base.version, "base_sha256": base.wheel_sha256,
                  "origin": origin, "vllm_version": got, "files": changed,
                  "added_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **source}
        rel._write_json(tmp / rel.DERIVED_MARKER, marker)
        tmp.chmod(0o755)
        final = parent / name
        if final.exists():               # a rebuild of a tree target (refresh)
            shutil.rmtree(final)
        os.rename(tmp, final)
    except unidiff.PatchError as e:
        raise ReleaseError(str(e)) from None
    except OSError as e:
        raise ReleaseError(f"{name}: {e.strerror or e}: {e.filename}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    progress(f"{name}: ready ({origin})")
    return rel.find(name, home)          # type: ignore[return-value]


def add(name: str, base: str, *, patch: str | Path | None = None,
        tree: str | Path | None = None, home: Path | str | None = None,
        progress: Callable[[str], None] = print) -> InstalledRelease:
    """Add the derived target ``name``: ``base`` with ``patch`` applied, or ``tree`` over it."""
    home = rel._home(home)
    if (patch is None) == (tree is None):
        raise ReleaseError("give exactly one of --patch FILE and --tree PATH")
    with installer._install_lock(home):
        _check_name(name, home)
        release = _base_release(base, home)
        if patch is not None:
            path = Path(patch).expanduser().resolve()
            if not path.is_file():
                raise ReleaseError(f"--patch {patch}: no such file")
            source = {"kind": "patch", "patch": str(path),
                      "patch_sha256": installer.sha256_of(path)}
        else:
            root = Path(tree).expanduser().resolve()   # type: ignore[arg-type]
            source = {"kind": "tree", "tree": str(root), "tree_sha256": tree_digest(root)}
        return _build(name, release, home, source, progress)


def refresh(target: InstalledRelease, home: Path | str | None = None,
            progress: Callable[[str], None] = print) -> bool:
    """Rebuild a ``--tree`` target whose tree changed since it was built; True if it did."""
    home = rel._home(home)
    marker = rel._read_json(target.path / rel.DERIVED_MARKER) or {}
    if marker.get("kind") != "tree":
        return False
    root = Path(marker["tree"])
    digest = tree_digest(root)
    if digest == marker.get("tree_sha256"):
        return False
    with installer._install_lock(home):
        progress(f"{target.version}: {root} changed since it was added; re-reading it")
        _build(target.version, _base_release(marker["base"], home), home,
               {"kind": "tree", "tree": str(root), "tree_sha256": digest}, progress)
    return True


def remove(name: str, home: Path | str | None = None) -> None:
    home = rel._home(home)
    with installer._install_lock(home):
        path = rel._derived_dir(home) / name
        if not NAME_RE.match(name) or not path.is_dir():
            pinned = " (a pinned release: its files are " \
                     f"{rel._releases_dir(home) / name})" if name in rel.KNOWN_RELEASES else ""
            raise ReleaseError(f"no derived target {name!r}{pinned}; see simsched releases list")
        shutil.rmtree(path)


def describe(target: InstalledRelease) -> str:
    marker = rel._read_json(target.path / rel.DERIVED_MARKER) or {}
    files = marker.get("files") or []
    return f"{target.origin}; {len(files)} file(s): {', '.join(files[:4])}" + \
        (" ..." if len(files) > 4 else "")
