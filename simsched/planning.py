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


def deployment_reach(layout: Layout) -> str:
    """Whether, and how, a real deployment reaches ``layout``, in one line for a finding.

    A layout of layers is what the release's own planner built for that model: a deployment
    of it, with the case's engine flags, has these groups. A layout of groups was written by
    hand; no planner vouches for it, and where a rule of vLLM's start-up is known to keep
    deployments from it, the line says which flag they need."""
    from simsched.families import family_of

    flags = " ".join(f"{k}={v}" for k, v in layout.engine.to_json().items()
                     if k not in ("num_gpu_blocks", "cpu_chunks"))
    if layout.layers:
        family = family_of(layout)
        model = f"the {family} family" if family else "a model of these layers"
        return (f"reached: {model}, its groups built by the release's own planner"
                + (f"; flags {flags}" if flags else ""))
    kinds = {g.kind for g in layout.groups}
    if "chunked_local" in kinds and len(kinds) > 1:
        return ("written as groups: a model with chunked local attention runs with the hybrid "
                "KV cache manager off (VllmConfig.__post_init__), its local layers planned as "
                "full attention, unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 "
                "(and never with EAGLE)")
    return "written as groups: no release's planner was asked whether a deployment builds them"
