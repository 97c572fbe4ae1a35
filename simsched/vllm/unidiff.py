"""Applying a unified diff, as ``git diff`` of a vLLM checkout writes it, to a release's tree.

Strict like ``git apply``: every hunk's context and removed lines must be found as they are,
at the line the hunk names or at an offset from it (the nearest first); there is no fuzz, and a
hunk that does not match stops the whole patch with a one-line error naming the patch file, the
path and the hunk. Files are created (``--- /dev/null``), deleted (``+++ /dev/null``) or
changed; renames, mode-only changes and binary patches are refused, and so is a path outside
``vllm/``. :func:`parse` reads the patch, :func:`apply` writes the result; nothing is written
until every hunk of every file matched. :func:`diff` writes one file's patch as git does.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(Exception):
    """The patch cannot be read or does not apply; the message names where."""


@dataclass
class Hunk:
    header: str                 # the ``@@ -a,b +c,d @@`` line, for messages
    old_start: int              # 1-based; 0 for a file the hunk creates
    old: list[str] = field(default_factory=list)    # context and removed lines, newlines kept
    new: list[str] = field(default_factory=list)    # context and added lines


@dataclass
class FilePatch:
    old_path: str | None        # None: the patch creates the file
    new_path: str | None        # None: the patch deletes the file
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or "?"


def _strip_prefix(raw: str, source: str, n: int) -> str | None:
    """``a/vllm/x.py`` -> ``vllm/x.py``; ``/dev/null`` -> None. Refuses paths leaving vllm/."""
    name = raw.split("\t")[0].strip()
    if name == "/dev/null":
        return None
    if name.startswith(('"',)):
        raise PatchError(f"{source}: line {n}: quoted path {name}: not supported")
    parts = PurePosixPath(name).parts
    path = PurePosixPath(*parts[1:]) if parts and parts[0] in ("a", "b") else PurePosixPath(name)
    if not path.parts or path.parts[0] != "vllm" or ".." in path.parts:
        raise PatchError(f"{source}: line {n}: {name} is outside the vllm/ package "
                         f"(paths are a/vllm/..., as git diff of a vLLM checkout writes them)")
    return str(path)


def parse(text: str, source: str) -> list[FilePatch]:
    """The file patches of a unified diff; ``source`` names the patch in error messages."""
    lines = text.splitlines(keepends=True)
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("GIT binary patch", "Binary files ")):
            raise PatchError(f"{source}: line {i + 1}: a binary patch: not supported")
        if line.startswith(("rename from ", "copy from ")):
            raise PatchError(f"{source}: line {i + 1}: a rename or copy: not supported "
                             f"(write it as a deletion and a new file)")
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            fp = FilePatch(_strip_prefix(line[4:], source, i + 1),
                           _strip_prefix(lines[i + 1][4:], source, i + 2))
            if fp.old_path and fp.new_path and fp.old_path != fp.new_path:
                raise PatchError(f"{source}: line {i + 1}: {fp.old_path} becomes {fp.new_path}: "
                                 f"a rename is not supported")
            i = _read_hunks(lines, i + 2, fp, source)
            if not fp.hunks:
                raise PatchError(f"{source}: {fp.path}: no hunk")
            files.append(fp)
            continue
        i += 1
    if not files:
        raise PatchError(f"{source}: not a unified diff (no '--- a/...' and '+++ b/...' lines)")
    return files


def _read_hunks(lines: list[str], i: int, fp: FilePatch, source: str) -> int:
    """Read the hunks of one file from line ``i``; the index of the first line after them."""
    while i < len(lines) and (m := _HUNK.match(lines[i])):
        old_len = int(m.group(2)) if m.group(2) is not None else 1
        new_len = int(m.group(4)) if m.group(4) is not None else 1
        hunk = Hunk(lines[i].split("@@")[1].strip(), int(m.group(1)))
        i += 1
        while (len(hunk.old) < old_len or len(hunk.new) < new_len) and i < len(lines):
            tag, body = lines[i][:1], lines[i][1:]
            if lines[i] in ("\n",):          # an empty context line whose space was stripped
                tag, body = " ", "\n"
            if tag not in (" ", "-", "+"):
                raise PatchError(f"{source}: line {i + 1}: hunk {hunk.header} of {fp.path} "
                                 f"ends early (expected -{old_len} +{new_len} lines)")
            if i + 1 < len(lines) and lines[i + 1].startswith("\\"):
                body = body.rstrip("\n")     # "\ No newline at end of file"
            if tag in (" ", "-"):
                hunk.old.append(body)
            if tag in (" ", "+"):
                hunk.new.append(body)
            i += 1 + (i + 1 < len(lines) and lines[i + 1].startswith("\\"))
        if len(hunk.old) != old_len or len(hunk.new) != new_len:
            raise PatchError(f"{source}: hunk {hunk.header} of {fp.path}: truncated")
        fp.hunks.append(hunk)
    return i


def _find(lines: list[str], want: list[str], at: int, start: int) -> int | None:
    """Where ``want`` occurs in ``lines`` at or after ``start``, nearest to ``at`` first."""
    last = len(lines) - len(want)
    for offset in range(0, max(last, at) + 1):
        for pos in ((at + offset, at - offset) if offset else (at,)):
            if start <= pos <= last and lines[pos:pos + len(want)] == want:
                return pos
    return None


def patched_text(fp: FilePatch, old: str | None, source: str) -> str:
    """The new content of one file (``old``: its content in the base tree, None if absent)."""
    if fp.old_path is None:
        if old is not None:
            raise PatchError(f"{source}: {fp.path}: creates a file the base already has")
        return "".join(line for h in fp.hunks for line in h.new)
    if old is None:
        raise PatchError(f"{source}: {fp.path}: no such file in the base release")
    lines = old.splitlines(keepends=True)
    out: list[str] = []
    done = 0
    for n, hunk in enumerate(fp.hunks, 1):
        pos = _find(lines, hunk.old, max(hunk.old_start - 1, 0), done)
        if pos is None:
            raise PatchError(f"{source}: hunk {n} of {fp.path} (@@ {hunk.header} @@) does not "
                             f"apply: its context and removed lines are not in the base file")
        out += lines[done:pos] + hunk.new
        done = pos + len(hunk.old)
    return "".join(out + lines[done:])


def apply(files: list[FilePatch], tree: Path, source: str) -> list[str]:
    """Apply parsed patches to ``tree`` (a release directory holding ``vllm/``): every result
    is computed first, then written as new files (never in place: the tree's files may be hard
    links to the base release's). Returns the paths changed."""
    results: dict[str, str | None] = {}
    for fp in files:
        old_file = tree / fp.old_path if fp.old_path else None
        old = old_file.read_text() if old_file is not None and old_file.is_file() else None
        if fp.new_path is None:
            if old is None:
                raise PatchError(f"{source}: {fp.path}: deletes a file the base does not have")
            results[fp.old_path] = None      # type: ignore[index]
            continue
        results[fp.new_path] = patched_text(fp, old, source)
    for path, text in results.items():
        target = tree / path
        if target.exists():
            target.unlink()
        if text is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    return sorted(results)


def diff(path: str, old: str, new: str) -> str:
    """The patch of one file from ``old`` to ``new``, as ``git diff`` writes it (paths
    ``a/PATH`` and ``b/PATH``, a last line without newline marked)."""
    out = []
    for line in difflib.unified_diff(old.splitlines(keepends=True),
                                     new.splitlines(keepends=True), f"a/{path}", f"b/{path}"):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)
