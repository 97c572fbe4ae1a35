"""Arc coverage of vLLM's offloading-relevant code inside a release worker (``sys.settrace``).

Release workers run Python 3.11 (no ``sys.monitoring``) and the pinned closure has no
``coverage`` package, so this is a small stdlib tracer limited to the files where the offloading
scheduler's decisions live (:data:`PREFIXES`, relative to the ``vllm`` package): the offloading
connector, ``v1/kv_offload/``, and the KV cache manager files of ``v1/core/``. Every other frame
returns ``None`` from the global trace function, so its lines cost nothing beyond the call event;
the decision is cached per code object. A function without a branch (no jump, no exception
handler: the many small key helpers) always takes the same arcs, so only its first call is traced.

An arc is ``(file, from_line, to_line)``; a function's entry and exit are arcs from and to
``-first_line`` (the convention of coverage.py). The worker enables the tracer at start-up when
``SIMSCHED_COVERAGE=1`` and answers the op ``coverage`` with :meth:`ArcTracer.take`: what the
cases since the last ``take`` covered, how much of it is new to this worker, and a rarity score.
"""

from __future__ import annotations

import dis
import os
import sys

PREFIXES = (
    "distributed/kv_transfer/kv_connector/v1/offloading",   # offloading_connector.py, offloading/
    "v1/kv_offload/",
    "v1/core/kv_cache_",                                    # utils, manager, coordinator, metrics
    "v1/core/single_type_kv_cache_manager.py",
    "v1/core/block_pool.py",
)


def _branch_free(code) -> bool:
    """No conditional or unconditional jump and no exception handler: one path through it."""
    if code.co_exceptiontable:
        return False
    return not any("JUMP" in ins.opname or ins.opname in ("FOR_ITER", "SEND")
                   for ins in dis.get_instructions(code))


class ArcTracer:
    """Collects arcs in the traced files; ``take`` reports and clears the current window."""

    def __init__(self, vllm_dir: str, prefixes: tuple[str, ...] = PREFIXES):
        self.vllm_dir = os.path.abspath(vllm_dir) + os.sep
        self.prefixes = prefixes
        self._codes: dict = {}        # id(code) -> (file index or -1: not traced, code)
        self._straight_done: set = set()   # ids of branch-free code traced once already
        self.files: list[str] = []    # file index -> path relative to the vllm package
        self._file_index: dict[str, int] = {}
        self.current: set = set()     # arcs hit since the last take
        self.hits: dict = {}          # arc -> number of takes that hit it
        self.takes = 0
        self.active = False

    def _file_of(self, code) -> int:
        path = os.path.abspath(code.co_filename)
        if not path.startswith(self.vllm_dir):
            return -1
        rel = path[len(self.vllm_dir):].replace(os.sep, "/")
        if not rel.startswith(self.prefixes):
            return -1
        if rel not in self._file_index:
            self._file_index[rel] = len(self.files)
            self.files.append(rel)
        return self._file_index[rel]

    def _global(self, frame, event, arg):
        code = frame.f_code
        # keyed by id: code objects compare equal across files when their bodies are equal
        got = self._codes.get(id(code))
        if got is None:
            fid = self._file_of(code)
            if fid >= 0 and _branch_free(code):
                fid = -2 - fid          # branch-free: trace its first call only
            self._codes[id(code)] = got = (fid, code)   # holding it keeps its id unique
        fid = got[0]
        if fid < 0:
            if fid == -1 or id(code) in self._straight_done:
                return None
            self._straight_done.add(id(code))
            fid = -2 - fid
        add = self.current.add
        entry = -code.co_firstlineno
        prev = entry

        def local(frame, event, arg):
            nonlocal prev
            if event == "line":
                line = frame.f_lineno
                add((fid, prev, line))
                prev = line
            elif event == "return":
                add((fid, prev, entry))
            return local

        return local

    def start(self) -> None:
        sys.settrace(self._global)
        self.active = True

    def stop(self) -> None:
        sys.settrace(None)
        self.active = False

    def take(self) -> dict:
        """What was covered since the last take: ``hit`` arcs, ``new`` of them never hit before
        in this worker (a branch-free function's arcs count in the first window that calls it
        only), ``rare`` = sum over the hit arcs of 1 / (takes that hit the arc, this one
        included): high for a case that reaches code few cases reach. ``total``: arcs so far."""
        arcs, self.current = self.current, set()
        self.takes += 1
        new = rare = 0
        hits = self.hits
        for a in arcs:
            n = hits.get(a, 0) + 1
            hits[a] = n
            if n == 1:
                new += 1
            rare += 1.0 / n
        return {"active": self.active, "hit": len(arcs), "new": new, "rare": round(rare, 3),
                "total": len(hits), "files": len(self.files)}

    def reset(self) -> None:
        """Forget everything covered so far (a new measurement in the same worker)."""
        self.current = set()
        self.hits = {}
        self.takes = 0
        self._straight_done = set()

    def summary(self) -> dict:
        """Arcs covered so far per file (for reports)."""
        per: dict[str, int] = {}
        for fid, _a, _b in self.hits:
            per[self.files[fid]] = per.get(self.files[fid], 0) + 1
        return dict(sorted(per.items()))
