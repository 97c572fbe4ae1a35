"""A layout of layers planned by a release: the KV cache groups its own planner builds.

A case may describe the model as its attention layers (``layout.layers``) instead of its KV
cache groups. Which groups a deployment gets, and whether its engine starts at all, is the
release's planner's answer (``get_kv_cache_configs``, run inside the release worker by
``simsched.vllm.inside.build.Planner``), and it differs between releases. :func:`plan` asks
the release and gives the case back with those groups, which the model and the release then
both run; the release harness plans again and checks that it builds the same groups.
"""

from __future__ import annotations

import dataclasses

from simsched.case import Case
from simsched.layout import Layout


def plan(case: Case, version: str, pool, timeout: float | None = None) -> tuple[Case | None, dict]:
    """(the case with the groups ``version`` plans, ``{"status": "ok", ...}``), or (None, why the
    engine does not start there: ``refused`` naming the check, ``unsupported``, ``invalid``, or
    ``worker`` where the worker died). A case that has its groups is returned as it is."""
    from simsched.vllm.worker import HarnessError, WorkerDied, WorkerError, WorkerTimeout

    if case.layout.planned:
        return case, {"status": "ok"}
    worker = pool.worker(version, case.asserts)
    try:
        out = worker.call("plan", timeout=timeout, case=case.to_json())
    except (WorkerDied, WorkerTimeout, HarnessError, WorkerError) as e:
        first = str(e).splitlines()[0][:300] if str(e) else ""
        return None, {"status": "worker", "exception": type(e).__name__,
                      "function": "release_worker", "message": first, "trace": [],
                      "findings": [], "counters": {}}
    if out.get("status") != "ok":
        return None, out
    layout = Layout.from_json(dict(case.layout.to_json(), groups=out["groups"]))
    return dataclasses.replace(case, layout=layout), out
