"""Hypothesis strategies for layouts and cases.

Layouts come in realistic families (a dense model, gpt-oss style full + sliding window, Mamba
hybrids, the DeepSeek V4 family, MLA + ring as in upstream PR #55037, drafter groups beside a target)
and free-form. Sizes are drawn from ``sampled_from`` lists that start with the roundest values, and
group lists shrink toward fewer groups, so hypothesis's shrinker moves toward small, round layouts.
The free-form family comes first: shrinking any failure tends toward it.
"""

from __future__ import annotations

import dataclasses

from functools import lru_cache

from hypothesis import strategies as st

from simsched.case import (FAULT_KINDS, Case, CaseEvent, JobTiming, RequestSpec, Timing,
                           TransferFault, sampled_segment)
from simsched.connectors import MULTI_CHILDREN, Connector, SecondaryTier
from simsched.families import FAMILIES as FAMILY_LAYERS
from simsched.families import family_of as layers_family_of
from simsched.geometry import derive, kv_cache_blocks_needed, max_model_len
from simsched.layout import (KINDS, RETENTION_UNSET, Engine, Group, Layout, RetentionUnset,
                             Speculative, cache_block_size, dcp_refusal)
from simsched.profiles import ConfigError

# Roundest first: hypothesis shrinks a sampled_from toward its first element.
BLOCK_SIZES = (16, 4, 32, 64, 8, 1, 2, 128, 256, 12, 48, 96, 1152, 3, 5)
WINDOWS = (128, 64, 16, 256, 1024, 4096, 100, 1)
CHUNK_SIZES = (64, 16, 128, 256, 8192, 100)
BLOCKS_PER_CHUNK = (1, 2, 4, 8, 3, 16)
PROMPT_LENGTHS = (64, 16, 1, 128, 256, 1000, 1152, 2304, 4096)

FAMILIES = ("free", "dense", "gpt_oss", "mamba_hybrid", "deepseek_v4", "mla_ring", "drafter")


def _pick(values: tuple):
    """``sampled_from`` built once per value list: building strategies is the slow part. Keyed by
    the values' types too: ``(0, 1) == (False, True)``, and a draw of ``_pick((0, 1))`` (prompt
    segment seeds) must never return a bool."""
    return _sampled(values, tuple(type(v) for v in values))


@lru_cache(maxsize=None)
def _sampled(values: tuple, _types: tuple):
    return st.sampled_from(values)


@lru_cache(maxsize=None)
def _ints(lo: int, hi: int):
    return st.integers(lo, hi)


def _group(kind: str, block_size: int, draw) -> Group:
    extra: dict = {}
    if kind in ("sliding_window", "sliding_window_mla"):
        extra["sliding_window"] = draw(_pick(WINDOWS))
    elif kind == "chunked_local":
        extra["attention_chunk_size"] = draw(_pick(CHUNK_SIZES))
    elif kind == "mamba":
        extra["mamba_cache_mode"] = _mamba_cache_mode(draw)
    return Group(kind=kind, block_size=block_size, **extra)


def _mamba_cache_mode(draw) -> str:
    """The campaign's engines cache prefixes, and with prefix caching on vLLM turns a Mamba
    group's mode "none" into "align" (MambaModelConfig.verify_and_update_config; the harness
    answers unsupported): "none" belongs to engines with prefix caching off, where vLLM also
    gives the Mamba group one block of max_model_len tokens, a layout the cases do not build yet.
    The draw stays, so the stream of the other knobs is unchanged."""
    draw(_pick(("align", "none")))
    return "align"


def _groups_free(draw) -> tuple[Group, ...]:
    n = draw(_ints(1, 4))
    return tuple(_group(draw(_pick(tuple(KINDS))), draw(_pick(BLOCK_SIZES)),
                        draw) for _ in range(n))


def _groups_family(draw, family: str) -> tuple[Group, ...]:
    bs = _pick(BLOCK_SIZES)
    if family == "free":
        return _groups_free(draw)
    if family == "dense":
        return (Group(draw(_pick(("full", "mla"))), draw(bs)),)
    if family == "gpt_oss":
        b = draw(bs)
        window = draw(_pick(WINDOWS))
        n_full = draw(_ints(1, 2))
        return tuple([Group("full", b)] * n_full + [Group("sliding_window", b, sliding_window=window)])
    if family == "mamba_hybrid":
        attn = draw(bs)
        draw(_pick((attn, attn * 2, attn * 4, 528, 1056)))
        # in align mode vLLM sets mamba_block_size = cache_config.block_size (the attention
        # block size): a Mamba block of another size is a layout no engine builds (the harness
        # refuses it as unsupported). The draw of the other size stays: the stream of the other
        # knobs is unchanged.
        mode = _mamba_cache_mode(draw)
        return (Group("full", attn), Group("mamba", attn, mamba_cache_mode=mode))
    if family == "deepseek_v4":
        mla = draw(_pick((64, 128, 256)))
        groups = [Group("mla", mla), Group("mla", draw(_pick((64, 128, 256))))]
        groups.append(Group("sliding_window_mla", draw(_pick((64, 128))),
                            sliding_window=128))
        if draw(_pick((False, True))):
            groups.append(Group("ring", draw(_pick((4, 8, 16, 132)))))
        return tuple(groups)
    if family == "mla_ring":
        return (Group(draw(_pick(("mla", "full"))), draw(_pick((64, 16, 1152)))),
                Group("ring", draw(_pick((4, 8, 132)))))
    if family == "drafter":
        b = draw(bs)
        target = draw(_pick(("full", "mla")))
        return (Group(target, b), Group("full", draw(_pick((b, 16))), drafter=True))
    raise ValueError(f"unknown layout family {family!r}")


def _maybe(draw, values, p_none: float = 0.75):
    return None if draw(_ints(0, 99)) < p_none * 100 else draw(_pick(values))


def _retention(draw) -> int | RetentionUnset:
    """Mostly the release's default (the flag left out, as most deployments do)."""
    value = _maybe(draw, (0, 256, 1024, 100), 0.85)
    return RETENTION_UNSET if value is None else value


def _dcp_size(draw, groups: tuple[Group, ...]) -> int:
    dcp = 1 if draw(_ints(0, 9)) < 8 else draw(_pick((2, 4)))
    if dcp_refusal(groups):
        # a layout vLLM refuses under DCP by asserts (layout.dcp_refusal: windowed, chunked-local
        # and ring groups; a Mamba model's one group): no deployment has it, the harness says
        # unsupported. Same draws either way: the stream of the other knobs is unchanged.
        return 1
    return dcp


def _engine(draw, groups: tuple[Group, ...]) -> Engine:
    spec = None
    if any(g.drafter for g in groups) or draw(_ints(0, 9)) == 9:
        spec = Speculative(method=draw(_pick(("eagle", "mtp", "ngram"))),
                           num_tokens=draw(_pick((1, 2, 3, 4))))
        if any(g.drafter for g in groups) and spec.method == "ngram":
            spec = Speculative("eagle", spec.num_tokens)
    chunking = draw(_ints(0, 9))
    return Engine(
        blocks_per_chunk=draw(_pick(BLOCKS_PER_CHUNK)) if 5 <= chunking < 8 else None,
        offload_block_size=(draw(_pick((256, 64, 128, 100, 1152)))
                            if chunking in (8, 9) else None),
        prefix_match_unit=_maybe(draw, (16, 4, 8, 32, 64), 0.85),
        dcp_size=_dcp_size(draw, groups),
        speculative=spec,
        async_scheduling=draw(_ints(0, 9)) == 9,
        retention_interval=_retention(draw),
        num_gpu_blocks=draw(_pick((1024, 64, 256))),
        cpu_chunks=draw(_pick((256, 16, 1024, 4))),   # 4: evictions under loads
    )


@st.composite
def layouts(draw, families: tuple[str, ...] = FAMILIES) -> Layout:
    return _layout(draw, families)


def _layout(draw, families: tuple[str, ...]) -> Layout:
    family = draw(_pick(families))
    groups = _groups_family(draw, family)
    return Layout(groups=groups, engine=_engine(draw, groups))


@st.composite
def config_cases(draw, families: tuple[str, ...] = FAMILIES, asserts: bool | None = True) -> Case:
    """A case for the config-level chain: a layout and one request to key."""
    layout = _layout(draw, families)
    length = draw(_pick(PROMPT_LENGTHS))
    flag = draw(_pick((True, False))) if asserts is None else asserts
    return Case(layout=layout, requests=(RequestSpec(id="r0", prompt=((0, length),)),),
                asserts=flag)


DECODES = (1, 4, 16, 2, 64)
LATENCIES = (1, 0, 2, 5)


def _workload(draw, max_requests: int = 4) -> tuple[RequestSpec, ...]:
    """Requests that share prefixes (segment seed 0 or 1), arrive over a few steps, decode a
    little, and now and then get aborted (also while still waiting) or carry transfer caps."""
    n = draw(_ints(1, max_requests))
    out = []
    for i in range(n):
        # the first request may be long (hash units up to 1152 tokens need it); the rest stay
        # short, so that one case runs in milliseconds under every profile
        lengths = PROMPT_LENGTHS if i == 0 else PROMPT_LENGTHS[:4]
        prompt = [(draw(_pick((0, 1))), draw(_pick(lengths)))]
        if draw(_ints(0, 3)) == 3:
            prompt.append((100 + i, draw(_pick((16, 1, 100)))))
        out.append(RequestSpec(
            id=f"r{i}", prompt=tuple(prompt),
            arrival=draw(_pick((0, 1, 3, 8))) if i else 0,
            decode=draw(_pick(DECODES)),
            abort_at=draw(_pick((2, 0, 5))) if draw(_ints(0, 9)) == 9 else None,
            max_load_tokens=(draw(_pick((0, 16, 64)))
                             if draw(_ints(0, 9)) == 9 else None),
            max_offload_tokens=(draw(_pick((0, 16, 64)))
                                if draw(_ints(0, 9)) == 9 else None)))
    if n > 1 and draw(_ints(0, 7)) == 7:
        # the next turn of a conversation: the last request repeats the first one's prompt
        # and answer (sampled_segment, in a case of seed 0), then says something new
        first = out[0]
        answer = sampled_segment(0, 0, first.prompt_len, first.decode)
        out[-1] = dataclasses.replace(out[-1], prompt=first.prompt + (answer, (200, 16)),
                                      arrival=8)
    return tuple(out)


def _timing(draw) -> Timing:
    return Timing(store_latency=draw(_pick(LATENCIES)),
                  load_latency=draw(_pick(LATENCIES)),
                  max_num_batched_tokens=draw(_pick((2048, 256, 64))),
                  max_num_seqs=draw(_pick((32, 2, 1))))


@st.composite
def cases(draw, families: tuple[str, ...] = FAMILIES, asserts: bool | None = True,
          path: str | None = None) -> Case:
    """A whole case: a layout, a workload and its transfer timings. ``path`` (one of
    :data:`PATHS`) puts every case on that connector path; None draws the campaign's mix."""
    layout = _layout(draw, families)
    flag = draw(_pick((True, False))) if asserts is None else asserts
    requests = _workload(draw)
    # vLLM refuses at start-up a model whose longest request cannot fit in the GPU pool; keep
    # every request admissible on its own, so that waiting forever is a finding, not a given.
    need = max(sum(1 if g.kind == "ring" else -(-(r.prompt_len + r.decode) // g.block_size)
                   for g in layout.groups) for r in requests)
    if draw(_ints(0, 3)) == 0:
        # a pool that barely holds the longest request: the GPU prefix cache evicts what the
        # next request would hit, so that the CPU tier serves it (loads, fences, preemption)
        layout = layout.with_engine(num_gpu_blocks=need + 1 + draw(_pick((2, 4, 8))))
    elif layout.engine.num_gpu_blocks <= need + 1:
        layout = layout.with_engine(num_gpu_blocks=need + 16)
    timing = _timing(draw)
    spec = layout.engine.speculative
    if spec is not None:
        # drafts accepted per verification step (drawn last: other cases draw as before)
        requests = tuple([dataclasses.replace(r, accept=tuple(
            draw(st.lists(_ints(0, spec.num_tokens), min_size=1, max_size=4))))
            if draw(_ints(0, 3)) else r for r in requests])
    # now and then the CPU tier's ARC policy, and a request that reads no prefix cache (drawn
    # last, as above)
    if draw(_ints(0, 9)) == 9:
        layout = layout.with_engine(eviction_policy="arc")
    requests = tuple([dataclasses.replace(r, skip_reading_prefix_cache=True)
                      if draw(_ints(0, 9)) == 9 else r for r in requests])
    # one transfer job slower or faster than the rest, or one that never completes (None)
    if draw(_ints(0, 9)) == 9:
        timing = dataclasses.replace(timing, jobs=(JobTiming(
            kind=draw(_pick(("store", "load"))), index=draw(_pick((0, 1, 2))),
            latency=draw(_pick((9, 0, 4, None)))),))
    # and an operator's reset_prefix_cache call (refused while a block is in use)
    events = ((CaseEvent(step=draw(_pick((6, 2, 12))), do="reset_prefix_cache"),)
              if draw(_ints(0, 9)) == 9 else ())
    # now and then a sliding-window group that keeps the blocks of a few trailing tokens more
    # (multi-module MTP's extra_retained_tokens; drawn last, as above)
    if draw(_ints(0, 9)) == 9 and any(g.kind in ("sliding_window", "sliding_window_mla")
                                      for g in layout.groups):
        extra = draw(_pick((1, 3, 15)))
        layout = dataclasses.replace(layout, groups=tuple(
            dataclasses.replace(g, extra_retained_tokens=extra)
            if g.kind in ("sliding_window", "sliding_window_mla") else g
            for g in layout.groups))
    # rarely, a transfer that fails (every release's worker stops there: the run is cut short)
    faults = ((TransferFault(kind=draw(_pick(FAULT_KINDS)), job=draw(_pick((0, 1, 2)))),)
              if draw(_ints(0, 19)) == 19 else ())
    layout, requests = _connector_path(draw, layout, requests, timing, path)
    return Case(layout=layout, requests=requests, timing=timing, asserts=flag, events=events,
                faults=faults)


#: the connector paths :func:`cases` draws (:mod:`simsched.connectors`): the OffloadingConnector
#: with a CPU tier (the model's), SimpleCPUOffloadConnector, a MultiConnector with NIXL, and
#: tiered offloading with a file-system tier behind the CPU tier
PATHS = ("offloading", "simple_cpu", "multi", "fs")


def _connector_path(draw, layout: Layout, requests: tuple[RequestSpec, ...], timing: Timing,
                    path: str | None) -> tuple[Layout, tuple[RequestSpec, ...]]:
    """Now and then another of vLLM's offloading paths (drawn last, as above; ``path`` forces
    one): ``SimpleCPUOffloadConnector`` (eager or lazy), a ``MultiConnector`` of the
    ``OffloadingConnector`` and NIXL with some requests pulled from a prefill instance, or
    tiered offloading with a file-system tier behind the CPU tier. The SimpleCPU and fs paths
    serve a prefix from their tier only once it has left the GPU pool (or the CPU tier): two
    cases in three of them come back to a conversation after another user's request."""
    if path is None:
        drawn = draw(_ints(0, 19))
        path = "offloading" if drawn < 17 else PATHS[drawn - 16]
    if path == "offloading":
        return layout, requests
    if path == "simple_cpu":
        layout = layout.with_engine(connector=Connector(
            "simple_cpu", lazy_offload=draw(_pick((False, True)))))
    elif path == "multi":
        order = draw(_pick((MULTI_CHILDREN, MULTI_CHILDREN[::-1])))
        requests = tuple([dataclasses.replace(r, remote_prefill=draw(_pick((1, 2, 4))))
                          if draw(_ints(0, 1)) else r for r in requests])
        return layout.with_engine(connector=Connector("multi", order=order)), requests
    else:
        tier = SecondaryTier("fs", io_latency=draw(_pick((2, 1, 4))))
        layout = layout.with_engine(secondary_tiers=(tier,))
    if draw(_ints(0, 2)) < 2:    # the come-back first: the shrinker keeps the tier serving
        layout, requests = _come_back(draw, layout, requests, timing)
    return layout, requests


def _come_back(draw, layout: Layout, requests: tuple[RequestSpec, ...], timing: Timing
               ) -> tuple[Layout, tuple[RequestSpec, ...]]:
    """A conversation's second turn after another user's request, appended to the workload:
    A (a short prompt), then F (longer than anything else, so that the GPU pool, which holds F
    and at most one block more, evicts A's cached blocks), then B (A's prompt and something
    new). SimpleCPU's CPU pool holds every prompt's blocks (a drawn slack, now and then one
    block too few): B loads A's from it. Tiered offloading's CPU tier holds F's chunks and a
    slack of fewer than A's: F's store evicts A's chunks, and B's lookup promotes them from the
    fs tier (a store larger than the whole tier would be dropped). Each request arrives once
    the requests before it have finished, run one after another."""
    n, mnbt = len(requests), timing.max_num_batched_tokens
    chunk = _chunk_tokens(layout)
    # A's prompt is whole chunks (blocks a tier keeps); B's new turn is up to two more, and a
    # part of one (room for a block past its hit)
    a_len = chunk * draw(_pick((2, 4, 1, 8)))
    tail = chunk * draw(_pick((1, 2, 0))) + draw(_pick((16, 1)))
    slack = draw(_pick((0, 1, 2, -1)))
    f_len = (max(max(r.prompt_len + r.decode for r in requests), a_len + tail + 16)
             + draw(_pick((16, 64, 0))))

    def blocks(tokens: int) -> int:
        return sum(1 if g.kind == "ring" else -(-tokens // g.block_size) for g in layout.groups)

    if layout.engine.secondary_tiers:
        cpu = -(-f_len // chunk) + max(slack, 0)
    else:
        cpu = sum(blocks(r.prompt_len) for r in requests) + blocks(a_len) + blocks(f_len) + slack

    def steps(r: RequestSpec) -> int:
        return -(-r.prompt_len // mnbt) + r.decode + timing.store_latency + 4

    start = max(r.arrival for r in requests) + sum(steps(r) for r in requests)
    a = RequestSpec(id=f"r{n}", prompt=((300, a_len),), arrival=start, decode=2)
    f = RequestSpec(id=f"r{n + 1}", prompt=((301, f_len),), arrival=start + steps(a), decode=2)
    b = RequestSpec(id=f"r{n + 2}", prompt=a.prompt + ((302, tail),),
                    arrival=f.arrival + steps(f), decode=draw(_pick((4, 1, 16))))
    requests += (a, f, b)
    # the null block, F's (as vLLM's start-up check counts them) and a block or none of A's:
    # F's allocation evicts the rest of them
    case = Case(layout=layout, requests=requests, timing=timing)
    pool = max(blocks(f_len + 2), kv_cache_blocks_needed(case, max_model_len(case))) + 1
    return layout.with_engine(num_gpu_blocks=pool + draw(_pick((0, 1))),
                              cpu_chunks=max(cpu, 1)), requests


def _chunk_tokens(layout: Layout) -> int:
    """The tokens of the OffloadingConnector's smallest chunk for ``layout`` (as the default
    profile derives it: at least a scheduler block), or of the engine's block where no release
    offloads it (refused at boot)."""
    try:
        geometry = derive(layout)
    except ConfigError:
        return cache_block_size(layout.groups)
    return min(g.tokens_per_chunk for g in geometry.groups)


@st.composite
def planned_cases(draw, asserts: bool | None = True) -> Case:
    """A case of a model family given as its layers (``simsched.families``): each release's
    own planner groups them and runs its start-up checks, so what it shows is a deployment's.
    The workload and timings are drawn as :func:`cases` draws them; the pool holds 24 to 96
    blocks a group the family's planner builds, or barely the longest request."""
    family = draw(st.sampled_from(tuple(FAMILY_LAYERS)))
    layers, flags, groups = FAMILY_LAYERS[family]
    flag = draw(_pick((True, False))) if asserts is None else asserts
    requests = _workload(draw)
    spec = flags.get("speculative")
    if spec is not None:
        requests = tuple([dataclasses.replace(r, accept=tuple(
            draw(st.lists(_ints(0, spec["num_tokens"]), min_size=1, max_size=4))))
            if draw(_ints(0, 3)) else r for r in requests])
    blocks = draw(_pick((32, 24, 48, 96))) * groups
    longest = max(r.prompt_len + r.decode for r in requests)
    blocks = max(blocks, groups * -(-longest // 16) + 1 + draw(_pick((2, 4, 8))))
    layout = Layout.from_json({"layers": layers, "engine": dict(
        flags, num_gpu_blocks=blocks, cpu_chunks=draw(_pick((16, 64, 256))))})
    return Case(layout=layout, requests=requests, timing=_timing(draw), asserts=flag)


def edge_scores(case: Case) -> dict[str, float]:
    """How close a case is to the edges where this bug class lives, for ``hypothesis.target``:
    a chunk smaller than the hash unit, a block size that divides nothing else, a GPU pool
    barely larger than the workload needs, a store still in flight when its request ends."""
    groups, engine = case.layout.groups, case.layout.engine
    sizes = [g.block_size for g in groups]
    unit = engine.prefix_match_unit or min(sizes)
    bpc = engine.blocks_per_chunk or 1
    lonely = sum(1 for a in sizes if all(a % b and b % a for b in sizes if b != a))
    tokens = sum(r.prompt_len + r.decode for r in case.requests)
    need = sum(-(-tokens // b) for b in sizes)
    return {
        "hash-unit-over-chunk": max(unit / (b * bpc) for b in sizes),
        "block-size-divides-nothing": float(lonely),
        "pool-pressure": min(need / engine.num_gpu_blocks, 4.0),
        "store-outlives-request": float(case.timing.store_latency
                                        - min((r.decode for r in case.requests), default=1)),
    }


def family_of(layout: Layout) -> str:
    """The realistic family a layout looks like (for coverage reports); 'free' otherwise. A
    layout of layers is the ``simsched.families`` family it is (``layers:<name>``)."""
    if layout.layers:
        return f"layers:{layers_family_of(layout) or 'other'}"
    kinds = tuple(g.kind for g in layout.groups)
    if any(g.drafter for g in layout.groups):
        return "drafter"
    if len(kinds) == 1 and kinds[0] in ("full", "mla"):
        return "dense"
    if "ring" in kinds and set(kinds) <= {"mla", "full", "ring"} and len(kinds) == 2:
        return "mla_ring"
    if "sliding_window_mla" in kinds and "mla" in kinds:
        return "deepseek_v4"
    if "mamba" in kinds and "full" in kinds and len(kinds) == 2:
        return "mamba_hybrid"
    if set(kinds) == {"full", "sliding_window"}:
        return "gpt_oss"
    return "free"


def example_layout(family: str, seed: int = 0) -> Layout:
    """One realistic layout of a family (drawn reproducibly, with the
    engine knobs the strategy draws for it)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    got: list[Layout] = []

    @hseed(seed)
    @settings(max_examples=1, database=None, suppress_health_check=list(HealthCheck),
              deadline=None)
    @given(layouts(families=(family,)), st.just(None))
    def draw(layout, _):
        if not got:
            got.append(layout)

    draw()
    return got[0]
