"""Hypothesis strategies for layouts and cases.

Layouts come in realistic families (a dense model, gpt-oss style full + sliding window, Mamba
hybrids, the DeepSeek V4 family, MLA + ring as in upstream PR #55037, drafter groups beside a target)
and free-form. Sizes are drawn from ``sampled_from`` lists that start with the roundest values, and
group lists shrink toward fewer groups, so hypothesis's shrinker moves toward small, round layouts.
The free-form family comes first: shrinking any failure tends toward it.
"""

from __future__ import annotations

from hypothesis import strategies as st

from simsched.case import Case, RequestSpec
from simsched.layout import KINDS, Engine, Group, Layout, Speculative

# Roundest first: hypothesis shrinks a sampled_from toward its first element.
BLOCK_SIZES = (16, 4, 32, 64, 8, 1, 2, 128, 256, 12, 48, 96, 1152, 3, 5)
WINDOWS = (128, 64, 16, 256, 1024, 4096, 100, 1)
CHUNK_SIZES = (64, 16, 128, 256, 8192, 100)
BLOCKS_PER_CHUNK = (1, 2, 4, 8, 3, 16)
PROMPT_LENGTHS = (64, 16, 1, 128, 256, 1000, 1152, 2304, 4096)

FAMILIES = ("free", "dense", "gpt_oss", "mamba_hybrid", "deepseek_v4", "mla_ring", "drafter")


def _group(kind: str, block_size: int, draw) -> Group:
    extra: dict = {}
    if kind in ("sliding_window", "sliding_window_mla"):
        extra["sliding_window"] = draw(st.sampled_from(WINDOWS))
    elif kind == "chunked_local":
        extra["attention_chunk_size"] = draw(st.sampled_from(CHUNK_SIZES))
    elif kind == "mamba":
        extra["mamba_cache_mode"] = draw(st.sampled_from(("align", "none")))
    return Group(kind=kind, block_size=block_size, **extra)


@st.composite
def groups_free(draw) -> tuple[Group, ...]:
    n = draw(st.integers(1, 4))
    return tuple(_group(draw(st.sampled_from(tuple(KINDS))), draw(st.sampled_from(BLOCK_SIZES)),
                        draw) for _ in range(n))


@st.composite
def groups_family(draw, family: str) -> tuple[Group, ...]:
    bs = st.sampled_from(BLOCK_SIZES)
    if family == "free":
        return draw(groups_free())
    if family == "dense":
        return (Group(draw(st.sampled_from(("full", "mla"))), draw(bs)),)
    if family == "gpt_oss":
        b = draw(bs)
        window = draw(st.sampled_from(WINDOWS))
        n_full = draw(st.integers(1, 2))
        return tuple([Group("full", b)] * n_full + [Group("sliding_window", b, sliding_window=window)])
    if family == "mamba_hybrid":
        attn = draw(bs)
        mamba = draw(st.sampled_from((attn, attn * 2, attn * 4, 528, 1056)))
        mode = draw(st.sampled_from(("align", "none")))
        return (Group("full", attn), Group("mamba", mamba, mamba_cache_mode=mode))
    if family == "deepseek_v4":
        mla = draw(st.sampled_from((64, 128, 256)))
        groups = [Group("mla", mla), Group("mla", draw(st.sampled_from((64, 128, 256))))]
        groups.append(Group("sliding_window_mla", draw(st.sampled_from((64, 128))),
                            sliding_window=128))
        if draw(st.booleans()):
            groups.append(Group("ring", draw(st.sampled_from((4, 8, 16, 132)))))
        return tuple(groups)
    if family == "mla_ring":
        return (Group(draw(st.sampled_from(("mla", "full"))), draw(st.sampled_from((64, 16, 1152)))),
                Group("ring", draw(st.sampled_from((4, 8, 132)))))
    if family == "drafter":
        b = draw(bs)
        target = draw(st.sampled_from(("full", "mla")))
        return (Group(target, b), Group("full", draw(st.sampled_from((b, 16))), drafter=True))
    raise ValueError(f"unknown layout family {family!r}")


def _maybe(draw, values, p_none: float = 0.75):
    return None if draw(st.integers(0, 99)) < p_none * 100 else draw(st.sampled_from(values))


@st.composite
def engines(draw, groups: tuple[Group, ...]) -> Engine:
    spec = None
    if any(g.drafter for g in groups) or draw(st.integers(0, 9)) == 9:
        spec = Speculative(method=draw(st.sampled_from(("eagle", "mtp", "ngram"))),
                           num_tokens=draw(st.sampled_from((1, 2, 3, 4))))
        if any(g.drafter for g in groups) and spec.method == "ngram":
            spec = Speculative("eagle", spec.num_tokens)
    chunking = draw(st.integers(0, 9))
    return Engine(
        blocks_per_chunk=draw(st.sampled_from(BLOCKS_PER_CHUNK)) if 5 <= chunking < 8 else None,
        offload_block_size=(draw(st.sampled_from((256, 64, 128, 100, 1152)))
                            if chunking in (8, 9) else None),
        prefix_match_unit=_maybe(draw, (16, 4, 8, 32, 64), 0.85),
        dcp_size=1 if draw(st.integers(0, 9)) < 8 else draw(st.sampled_from((2, 4))),
        speculative=spec,
        async_scheduling=draw(st.integers(0, 9)) == 9,
        retention_interval=_maybe(draw, (0, 256, 1024, 100), 0.85),
        num_gpu_blocks=draw(st.sampled_from((1024, 64, 256, 4096))),
        cpu_chunks=draw(st.sampled_from((256, 16, 1024))),
    )


@st.composite
def layouts(draw, families: tuple[str, ...] = FAMILIES) -> Layout:
    family = draw(st.sampled_from(families))
    groups = draw(groups_family(family))
    return Layout(groups=groups, engine=draw(engines(groups)))


@st.composite
def config_cases(draw, families: tuple[str, ...] = FAMILIES, asserts: bool | None = True) -> Case:
    """A case for the config-level chain: a layout and one request to key."""
    layout = draw(layouts(families))
    length = draw(st.sampled_from(PROMPT_LENGTHS))
    flag = draw(st.sampled_from((True, False))) if asserts is None else asserts
    return Case(layout=layout, requests=(RequestSpec(id="r0", prompt=((0, length),)),),
                asserts=flag)


def family_of(layout: Layout) -> str:
    """The realistic family a layout looks like (for coverage reports); 'free' otherwise."""
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
