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
from simsched.layout import LAYER_KINDS, Engine, Layer, Layout


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


#: how a release's planner stands to a layout of groups written by hand
REACHED, SYNTHETIC, UNCHECKED = "reached", "synthetic", "unchecked"


def layers_for_groups(layout: Layout) -> tuple[Layout | None, str]:
    """The model a deployment would declare to get ``layout``'s groups, if any model does: each
    group becomes its ``layers`` attention layers, in the group's order (a drafter group's after
    the target's, as the drafter registers them), alike in heads, head size and dtype, served
    with ``--block-size`` the groups' block size. (None, why) where the layer language cannot
    say what the groups do: another kind than an attention layer's, a knob of a group that a
    layer does not carry, or groups of several block sizes (a deployment gets those from layers
    whose page sizes the planner unifies, a search this does not make)."""
    groups = layout.groups
    other = sorted({g.kind for g in groups} - set(LAYER_KINDS))
    if other:
        return None, f"no layers of kind {', '.join(other)} in the layer language"
    if any(g.extra_retained_tokens for g in groups):
        return None, "extra_retained_tokens is a group's knob, not a layer's"
    if any(g.kind == "chunked_local" for g in groups) and len({g.kind for g in groups}) > 1:
        # the planner here runs as an engine started without the flag, which plans local
        # layers as full attention
        return None, ("chunked local attention beside other groups: a deployment gets such "
                      "groups with VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 (the "
                      "hybrid KV cache manager is off for it by default), never with EAGLE")
    sizes = sorted({g.block_size for g in groups})
    if len(sizes) > 1:
        return None, f"groups of several block sizes ({', '.join(map(str, sizes))})"
    layers = [Layer(kind=g.kind, count=g.layers, sliding_window=g.sliding_window,
                    attention_chunk_size=g.attention_chunk_size, drafter=g.drafter)
              for g in groups]
    engine = dataclasses.replace(layout.engine, block_size=sizes[0],
                                 # the pool is checked by the case's own run, not here
                                 num_gpu_blocks=1 << 20)
    return Layout(groups=(), engine=engine, layers=tuple(layers)), ""


def group_layout_reach(case: Case, version: str, pool,
                       timeout: float | None = None) -> tuple[str, str]:
    """Whether ``version``'s planner builds ``case``'s hand-written groups for some model:
    ``(REACHED, how)``, ``(SYNTHETIC, what it builds instead)`` or ``(UNCHECKED, why not
    asked)``. The planner is asked for the groups of :func:`layers_for_groups`'s model: with one
    block size and attention layers alike, the groups it builds depend only on the layers' kinds,
    windows, chunks, drafters and order, so what it builds from them is what every such model
    gets. The groups compare in order, by everything but their layer counts (which size a block
    in bytes, not what the scheduler does with it)."""
    layout = case.layout
    if layout.layers:
        return REACHED, "a layout of layers: its groups are the release's planner's"
    model, why = layers_for_groups(layout)
    if model is None:
        return UNCHECKED, why
    probe = dataclasses.replace(case, layout=model)
    planned, out = plan(probe, version, pool, timeout=timeout)
    if planned is None:
        return UNCHECKED, (f"the planner does not start an engine of these layers: "
                           f"{out.get('status')} {out.get('reason') or out.get('message') or ''}"
                           ).strip()

    def shape(groups) -> list[dict]:
        return [{k: v for k, v in g.to_json().items() if k != "layers"} for g in groups]

    layers = " + ".join(f"{x.count}x{x.kind}" + (f"(w={x.sliding_window})" if x.sliding_window
                                                 else "")
                        + (f"(c={x.attention_chunk_size})" if x.attention_chunk_size else "")
                        + ("[drafter]" if x.drafter else "") for x in model.layers)
    flags = f"--block-size {model.engine.block_size}"
    if shape(planned.layout.groups) == shape(layout.groups):
        return REACHED, f"{version}'s planner builds these groups from layers {layers} ({flags})"
    built = Layout(groups=planned.layout.groups, engine=Engine()).describe()
    return SYNTHETIC, (f"{version}'s planner builds {built} from the layers these groups "
                       f"declare ({layers}, {flags}), not these groups")
