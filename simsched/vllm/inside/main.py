"""The release worker loop: ``python [-O] -m simsched.vllm.inside.main``.

Protocol (one JSON object per line): the worker first announces
``{"ready": true, "version": ..., "optimize": sys.flags.optimize}``; then every request
``{"id": n, "op": "...", ...}`` gets exactly one reply ``{"id": n, "ok": true, "result": ...}`` or
``{"id": n, "ok": false, "error": "<type>: <msg>", "traceback": "..."}`` (an error of the harness,
not an observation of vLLM: vLLM's own failures are outcomes inside ``result``).

Ops: ``ping``, ``config_batch`` (``items``: list of ``{"layout", "num_tokens"}``),
``scheduler_construct`` (``layout``), ``plan`` (``case``: the KV cache groups the release's
planner builds of a layout of layers), ``run_case`` (``case``, ``mutant``, ``step_cap``: see
:mod:`simsched.vllm.inside.engine` and :mod:`simsched.vllm.inside.run`), ``features``,
``coverage`` (``action``: ``take``, ``reset`` or ``summary``; arc coverage of the offloading
code, collected when the worker starts with ``SIMSCHED_COVERAGE=1``, see
:mod:`simsched.vllm.inside.coverage`), ``exit``; and ``sleep`` (``seconds``), a test-only op
that exists only when the worker runs with ``SIMSCHED_WORKER_TEST_OPS=1``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback


def _setup_io():
    """Keep the real stdout for replies; everything else printed goes to stderr."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)                       # C-level writes to fd 1 land on stderr too
    out = os.fdopen(reply_fd, "w", buffering=1, encoding="utf-8")
    sys.stdout = sys.stderr
    return out


def main() -> int:
    out = _setup_io()
    inp = sys.stdin
    for name in ("vllm", "torch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import vllm  # noqa: F401 - imported once, announced below
    for name in ("vllm", "torch"):
        logging.getLogger(name).setLevel(logging.WARNING)

    test_ops = os.environ.get("SIMSCHED_WORKER_TEST_OPS") == "1"
    state: dict = {}

    def probe():
        if "probe" not in state:
            from simsched.vllm.inside.config_probe import ConfigProbe
            state["probe"] = ConfigProbe()
        return state["probe"]

    def send(obj) -> None:
        out.write(json.dumps(obj, separators=(",", ":")) + "\n")
        out.flush()

    # the whole worker runs the mutated release (bench/bench_mutants.py): patched in around
    # every op that runs the release, afresh for each (a mutant may count what it saw)
    mutant = os.environ.get("SIMSCHED_MUTANT") or None

    def mutated(fn, *args, **kw):
        if not mutant:
            return fn(*args, **kw)
        from simsched.vllm.inside import mutants
        undo = mutants.apply(mutant)
        try:
            return fn(*args, **kw)
        finally:
            undo()

    tracer = None
    if os.environ.get("SIMSCHED_COVERAGE") == "1":
        from simsched.vllm.inside.coverage import ArcTracer
        tracer = ArcTracer(os.path.dirname(os.path.abspath(vllm.__file__)))
        tracer.start()

    send({"ready": True, "version": vllm.__version__, "optimize": sys.flags.optimize,
          **({"coverage": True} if tracer is not None else {}),
          **({"mutant": mutant} if mutant else {})})
    for line in inp:
        line = line.strip()
        if not line:
            continue
        rid = None
        try:
            req = json.loads(line)
            rid = req.get("id")
            op = req.get("op")
            if op == "ping":
                result = {"pong": True, "pid": os.getpid()}
            elif op == "config_batch":
                result = mutated(probe().run_batch, req["items"])
            elif op == "scheduler_construct":
                result = probe().scheduler_construct(req["layout"])
            elif op == "run_case":
                if "engine" not in state:
                    from simsched.vllm.inside.engine import RealEngine
                    state["engine"] = RealEngine(probe())
                kw = {"step_cap": int(req["step_cap"])} if req.get("step_cap") else {}
                result = state["engine"].run_case(req["case"], req.get("mutant") or mutant,
                                                     bare=bool(req.get("bare", False)), **kw)
            elif op == "plan":
                if "engine" not in state:
                    from simsched.vllm.inside.engine import RealEngine
                    state["engine"] = RealEngine(probe())
                result = state["engine"].plan(req["case"])
            elif op == "boot_retention":
                if "engine" not in state:
                    from simsched.vllm.inside.engine import RealEngine
                    state["engine"] = RealEngine(probe())
                result = state["engine"].boot_retention(req["case"])
            elif op == "features":
                result = probe().builder.features
            elif op == "coverage":
                action = req.get("action", "take")
                if tracer is None:
                    result = {"active": False}
                elif action == "take":
                    result = tracer.take()
                elif action == "reset":
                    tracer.take()
                    tracer.reset()
                    result = {"active": True}
                elif action == "summary":
                    result = tracer.summary()
                else:
                    raise ValueError(f"coverage: unknown action {action!r}")
            elif op == "sleep" and test_ops:
                time.sleep(float(req.get("seconds", 0)))
                result = None
            elif op == "exit":
                send({"id": rid, "ok": True, "result": None})
                return 0
            else:
                raise ValueError(f"unknown op {op!r}")
            send({"id": rid, "ok": True, "result": result})
        except Exception as e:  # noqa: BLE001 - a harness error, reported, never fatal
            send({"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
