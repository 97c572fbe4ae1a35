"""Parent side of a release worker: one persistent process per vLLM release, over a pipe.

The parent never imports vllm. A :class:`ReleaseWorker` starts
``python [-O] -m simsched.vllm.inside.main`` lazily, waits for its ready line and then speaks the
line-JSON protocol documented in :mod:`simsched.vllm.inside.main`::

    spec = spec_for("0.30.0")                  # or WorkerSpec(version, python, env)
    with ReleaseWorker(spec) as w:
        outcomes = w.call("config_batch", items=[{"layout": {...}, "num_tokens": 100}])

A worker that dies raises :class:`WorkerDied`, one that does not answer in time is killed and
raises :class:`WorkerTimeout`; the next ``call`` restarts it transparently. The worker's stderr is
kept in a bounded ring buffer (and optionally appended to a log file), never the terminal.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
DEFAULT_START_TIMEOUT = 120.0
DEFAULT_CALL_TIMEOUT = 600.0
STDERR_LINES = 200


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one release's worker: its version, the base python, the environment."""

    version: str
    python: str
    env: dict[str, str] = field(default_factory=dict)
    optimize: bool = False          # run with ``python -O`` (asserts stripped)

    def command(self) -> list[str]:
        return [self.python] + (["-O"] if self.optimize else []) + \
            ["-m", "simsched.vllm.inside.main"]

    def with_optimize(self, optimize: bool) -> "WorkerSpec":
        return WorkerSpec(self.version, self.python, dict(self.env), optimize)


def spec_for(version: str, *, asserts: bool = True, coverage: bool = False,
             mutant: str | None = None) -> WorkerSpec:
    """The :class:`WorkerSpec` of an installed release, via :mod:`simsched.vllm.releases`;
    ``coverage``: the worker collects arc coverage of the offloading code (op ``coverage``);
    ``mutant``: the worker runs the release with that mutant of
    :mod:`simsched.vllm.inside.mutants` patched in for its whole life (the mutation benchmark:
    a campaign against a mutated release that gives it no hint)."""
    from simsched.vllm import releases  # lazy: written and owned elsewhere

    rel = releases.find(version)      # a release, or a derived target by its name
    if rel is None:
        raise LookupError(f"vLLM release {version} is not installed")
    cmd = list(releases.worker_command(rel))
    env = dict(releases.worker_env(rel))
    if coverage:
        env["SIMSCHED_COVERAGE"] = "1"
    if mutant:
        env["SIMSCHED_MUTANT"] = mutant
    return WorkerSpec(version=version, python=cmd[0], env=env, optimize=not asserts)


def default_env(pythonpath: str, cache_root: str) -> dict[str, str]:
    """The environment a worker needs besides PATH etc. (offline, fixed hash seed)."""
    return {"PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "VLLM_CACHE_ROOT": cache_root, "PYTHONHASHSEED": "0"}


class WorkerError(RuntimeError):
    """Base class of worker failures."""


class WorkerDied(WorkerError):
    def __init__(self, version: str, returncode: int | None, stderr_tail: list[str],
                 during: str = ""):
        self.version = version
        self.returncode = returncode
        self.signal = -returncode if returncode is not None and returncode < 0 else None
        self.stderr_tail = stderr_tail
        how = (f"signal {signal.Signals(self.signal).name}" if self.signal
               else f"exit code {returncode}")
        tail = "\n".join(stderr_tail[-15:])
        super().__init__(f"vLLM {version} worker died ({how}){during}; last stderr:\n{tail}")


class WorkerTimeout(WorkerError):
    def __init__(self, version: str, op: str, seconds: float):
        self.version = version
        self.op = op
        self.seconds = seconds
        super().__init__(f"vLLM {version} worker did not answer {op!r} within {seconds:g} s "
                         "(killed)")


class HarnessError(WorkerError):
    """The worker reported an error in the harness itself (``ok: false``)."""

    def __init__(self, version: str, op: str, error: str, tb: str):
        self.version = version
        self.op = op
        self.error = error
        self.traceback = tb
        super().__init__(f"vLLM {version} worker failed {op!r}: {error}\n{tb}")


class ReleaseWorker:
    def __init__(self, spec: WorkerSpec, timeout: float = DEFAULT_CALL_TIMEOUT,
                 start_timeout: float = DEFAULT_START_TIMEOUT, log_path: str | None = None):
        self.spec = spec
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.log_path = log_path
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self.proc: subprocess.Popen | None = None
        self.ready: dict | None = None
        self.start_seconds: float | None = None
        self.starts = 0
        self._buf = b""
        self._next_id = 0
        self._drain: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def version(self) -> str:
        return self.spec.version

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self) -> dict:
        if self.proc is not None and self.proc.poll() is None:
            return self.ready or {}
        self._reap()
        env = dict(os.environ)
        env.update(self.spec.env)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.spec.command(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     cwd=PROJECT_ROOT, start_new_session=True)
        self.starts += 1
        self._buf = b""
        self._drain = threading.Thread(target=self._drain_stderr, args=(self.proc,),
                                       name=f"simsched-worker-{self.version}-stderr",
                                       daemon=True)
        self._drain.start()
        ready = self._read_obj(self.start_timeout, "<start>")
        if not ready.get("ready"):
            self._kill()
            raise WorkerError(f"vLLM {self.version} worker sent {ready!r} instead of ready")
        self.ready = ready
        self.start_seconds = time.monotonic() - t0
        return ready

    def _drain_stderr(self, proc: subprocess.Popen) -> None:
        log = open(self.log_path, "a", encoding="utf-8", errors="replace") \
            if self.log_path else None
        try:
            for raw in proc.stderr:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self.stderr_tail.append(line)
                if log:
                    log.write(line + "\n")
        except (OSError, ValueError):
            pass
        finally:
            if log:
                log.close()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        self._reap()

    def _reap(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        if self._drain is not None:
            self._drain.join(timeout=2)
            self._drain = None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self._send({"id": -1, "op": "exit"})
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self._kill()

    def __enter__(self) -> "ReleaseWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- protocol ----------------------------------------------------------------------------
    def _send(self, obj: dict) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj, separators=(",", ":")) + "\n").encode())
        self.proc.stdin.flush()

    def _died(self, during: str) -> WorkerDied:
        proc = self.proc
        rc = None
        if proc is not None:
            try:
                rc = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        if self._drain is not None:
            self._drain.join(timeout=2)
        err = WorkerDied(self.version, rc, list(self.stderr_tail), during)
        self._reap()
        return err

    def _read_obj(self, timeout: float, op: str) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise WorkerTimeout(self.version, op, timeout)
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise self._died(f" during {op!r}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self._kill()
            raise WorkerError(f"vLLM {self.version} worker sent a non-JSON line: "
                              f"{line[:200]!r}") from None

    def call(self, op: str, timeout: float | None = None, **payload: Any) -> Any:
        """Send one request and return its ``result``; restarts a dead worker first."""
        self.start()
        self._next_id += 1
        rid = self._next_id
        try:
            self._send({"id": rid, "op": op, **payload})
        except (BrokenPipeError, OSError):
            raise self._died(f" while sending {op!r}") from None
        reply = self._read_obj(self.timeout if timeout is None else timeout, op)
        if reply.get("id") != rid:
            self._kill()
            raise WorkerError(f"vLLM {self.version} worker answered id {reply.get('id')} "
                              f"to request {rid}")
        if not reply.get("ok"):
            raise HarnessError(self.version, op, reply.get("error", "?"),
                               reply.get("traceback", ""))
        return reply.get("result")

    # -- conveniences ------------------------------------------------------------------------
    def ping(self) -> dict:
        return self.call("ping")

    def config_batch(self, items: list[dict], timeout: float | None = None) -> list[dict]:
        return self.call("config_batch", timeout=timeout, items=items)
