"""A layout of layers planned by a release: the KV cache groups its own planner builds.

A case may describe the model as its attention layers (``layout.layers``) instead of its KV
cache groups. Which groups a deployment gets, and whether its engine starts at all, is the
release's planner's answer (``get_kv_cache_configs``, run inside the release worker by
``simsched.vllm.inside.planner.Planner``), and it differs between releases. :func:`plan` asks
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

#: why no deployment runs a cross-attention group beside a KV connector (python -O strips it)
ENCODER_DECODER_WITH_CONNECTOR = (
    "cross attention: only encoder-decoder models (Whisper and the like) have such a group, and "
    "the Scheduler refuses a KV connector beside them (v1/core/sched/scheduler.py: "
    "`assert not self.is_encoder_decoder, \"Encoder-decoder models are not currently supported "
    "with KV connectors\"`, every release 0.25.1-0.33.0)")
#: ... and what it takes under python -O, which strips that assert
ENCODER_DECODER_STRIPPED = (
    "cross attention beside a KV connector: only under python -O (the Scheduler's refusal of an "
    "encoder-decoder model with a KV connector is an assert), with prefix caching forced on "
    "(off by default for encoder-decoder models, and the connectors need it); no release's "
    "planner was asked")

#: the layer each group kind becomes in a witness: attention with the layer language's default
#: heads; MLA with DeepSeek's latent (kv_lora_rank 512 + rope 64); a ring as DeepSeek V4.1's
#: compressor declares it (``CompressorStateCache``: one head of float32 state rows)
_ATTENTION = Layer(kind="full")
_MLA = Layer(kind="mla", head_size=576)
_RING = Layer(kind="ring", num_kv_heads=1, head_size=1024, dtype="float32", block_size=8)
#: ring state widths tried: the planner scales a page that divides the largest page and pads one
#: that does not, so which block size a ring keeps depends on its width (1000: a width whose
#: page divides no power of two)
_RING_WIDTHS = (1024, 1000)
_MLA_KINDS = ("mla", "sliding_window_mla")
#: kinds a witness declares layers of: not Mamba, whose group's block size is what the platform's
#: hybrid alignment makes of the model's state and attention pages (``Platform.
#: _align_hybrid_block_size``), not a flag a witness can set
_WITNESS_KINDS = tuple(k for k in LAYER_KINDS if k != "mamba")


def witness_models(layout: Layout) -> tuple[list[Layout], bool, str]:
    """Models a deployment could declare to get ``layout``'s groups: each group becomes its
    ``layers`` layers, in the group's order (a drafter group's after the target's, as the
    drafter registers them), served with ``--block-size`` the groups' block size (a ring layer
    declares its own). ``complete``: the groups a planner builds from these models are what
    every model of these layer kinds gets (one block size, no ring, no MLA beside other
    attention: page sizes then play no part, and the planner groups layers by spec in the order
    the specs first appear, ``_get_kv_cache_groups_uniform_page_size``). ``([], False, why)``
    where the layer language cannot say what the groups do; ``([], True, why)`` where no model
    has such layers at all."""
    groups = layout.groups
    other = sorted({g.kind for g in groups} - set(_WITNESS_KINDS))
    if other:
        return [], False, (f"no witness layers of kind {', '.join(other)} (a Mamba group's "
                           "block size is the platform's alignment of the model's pages)"
                           if other == ["mamba"] else
                           f"no layers of kind {', '.join(other)} in the layer language")
    if any(g.extra_retained_tokens for g in groups):
        return [], False, "extra_retained_tokens is a group's knob, not a layer's"
    if any(g.kind == "chunked_local" for g in groups) and len({g.kind for g in groups}) > 1:
        # the planner here runs as an engine started without the flag, which plans local
        # layers as full attention
        return [], False, ("chunked local attention beside other groups: a deployment gets such "
                           "groups with VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 (the "
                           "hybrid KV cache manager is off for it by default), never with EAGLE")
    sizes = sorted({g.block_size for g in groups if g.kind != "ring"})
    if len(sizes) > 1:
        return [], False, f"groups of several block sizes ({', '.join(map(str, sizes))})"
    if not sizes:
        # every ring in vLLM's models holds the open token group of attention layers beside it
        # (DeepSeek V4.1's compressor, Qwen4-exp's QSA cache, GLM-5 Next, Step 5's CSA tail)
        return [], True, "rings alone: no model has a ring without the attention layers it serves"
    engine = dataclasses.replace(layout.engine, block_size=sizes[0],
                                 # the pool is checked by the case's own run, not here
                                 num_gpu_blocks=1 << 20)
    rings = any(g.kind == "ring" for g in groups)
    models = []
    for width in _RING_WIDTHS if rings else _RING_WIDTHS[:1]:
        layers = tuple(dataclasses.replace(
            _RING if g.kind == "ring" else _MLA if g.kind in _MLA_KINDS else _ATTENTION,
            kind=g.kind, count=g.layers, sliding_window=g.sliding_window,
            attention_chunk_size=g.attention_chunk_size, drafter=g.drafter,
            **({"block_size": g.block_size, "head_size": width} if g.kind == "ring" else {}))
            for g in groups)
        models.append(Layout(groups=(), engine=engine, layers=layers))
    mla = {g.kind in _MLA_KINDS for g in groups}
    return models, not rings and len(mla) == 1, ""


def _describe_layers(model: Layout) -> str:
    return " + ".join(f"{x.count}x{x.kind}" + (f"/{x.block_size}" if x.block_size else "")
                      + (f"(w={x.sliding_window})" if x.sliding_window else "")
                      + (f"(c={x.attention_chunk_size})" if x.attention_chunk_size else "")
                      + ("[drafter]" if x.drafter else "") for x in model.layers)


def group_layout_reach(case: Case, version: str, pool,
                       timeout: float | None = None) -> tuple[str, str]:
    """Whether ``version``'s planner builds ``case``'s hand-written groups for some model:
    ``(REACHED, from which layers)``, ``(SYNTHETIC, what it builds instead)`` where the witness
    is complete (:func:`witness_models`), or ``(UNCHECKED, why it cannot tell)``. Groups compare
    in order, by everything but their layer counts (which size a block in bytes, not what the
    scheduler does with it)."""
    layout = case.layout
    if layout.layers:
        return REACHED, "a layout of layers: its groups are the release's planner's"
    if any(g.kind == "cross_attention" for g in layout.groups):
        if case.asserts:
            return SYNTHETIC, ENCODER_DECODER_WITH_CONNECTOR
        return UNCHECKED, ENCODER_DECODER_STRIPPED
    models, complete, why = witness_models(layout)
    if not models:
        return (SYNTHETIC if complete else UNCHECKED), why

    def shape(groups) -> list[dict]:
        return [{k: v for k, v in g.to_json().items() if k != "layers"} for g in groups]

    answers = []
    for model in models:
        planned, out = plan(dataclasses.replace(case, layout=model), version, pool,
                            timeout=timeout)
        layers = f"{_describe_layers(model)}, --block-size {model.engine.block_size}"
        if planned is None:
            answers.append(f"refuses layers {layers}: {out.get('status')} "
                           f"{out.get('reason') or out.get('message') or ''}".strip())
        elif shape(planned.layout.groups) == shape(layout.groups):
            return REACHED, f"{version}'s planner builds these groups from layers {layers}"
        else:
            built = Layout(groups=planned.layout.groups, engine=Engine()).describe()
            answers.append(f"builds {built} from layers {layers}")
    if complete and not answers[0].startswith("refuses"):
        return SYNTHETIC, f"{version}'s planner {answers[0]}, not these groups"
    return UNCHECKED, f"{version}'s planner " + "; ".join(dict.fromkeys(answers))
