"""The corpus of ``tests/test_model_equivalence.py``: cases whose model output is pinned.

The corpus is generated here (deterministically, from ``random.Random`` seeds and the layout
families and size lists of ``fuzz/strategies.py``) only when the goldens are recorded; the golden
files store each case as JSON, so the test replays exactly the recorded cases even if this
generator changes later.

Record (or re-record after an intended semantic change of the model)::

    SIMSCHED_RECORD_GOLDEN=1 python -m pytest tests/test_model_equivalence.py

which rewrites ``tests/data/model_golden/`` (review the diff before committing it).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fuzz.strategies import (BLOCK_SIZES, BLOCKS_PER_CHUNK, CHUNK_SIZES,  # noqa: E402
                             FAMILIES, WINDOWS)
from simsched.case import Case  # noqa: E402
from simsched.profiles import PROFILES  # noqa: E402

GOLDEN_DIR = ROOT / "tests" / "data" / "model_golden"
#: the profiles the corpus was recorded with, in their order then (the generated cases draw from
#: this list: a profile added later, such as every-group-no-clamp-chunked-mamba, must not reshuffle
#: them)
ALL_PROFILES = ["every-group-no-clamp", "legacy-spec-init", "legacy-dcp-all",
                "legacy-mamba-block-size", "every-group", "prefix-cacheable",
                "prefix-cacheable-strict-unit", "prefix-cacheable-windows-in-config",
                "fix-assert-only", "fix-assert-and-window", "fix-skip-zero-hash",
                "every-group-no-clamp+skip-zero-hash"]
assert set(ALL_PROFILES) <= set(PROFILES)
FULL16 = [{"kind": "full", "block_size": 16}]
RING_LAYOUTS = [[{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}],
                [{"kind": "mla", "block_size": 64}, {"kind": "ring", "block_size": 4}]]


def _case(groups, reqs, asserts=True, timing=None, **engine) -> dict:
    obj = {"layout": {"groups": groups, "engine": engine}, "requests": reqs,
           "asserts": asserts}
    if timing:
        obj["timing"] = timing
    return Case.from_json(obj).to_json()


def handwritten() -> list[tuple[str, dict, str]]:
    """The cases of tests/test_model.py and tests/test_invariants.py (unbroken model)."""
    out = []
    out.append(("single", _case(FULL16, [{"id": "a", "prompt": [[1, 100]], "decode": 5}],
                                num_gpu_blocks=64), "prefix-cacheable"))
    reqs = [{"id": "a", "prompt": [[1, 100]], "decode": 4},
            {"id": "b", "prompt": [[1, 100]], "arrival": 3, "decode": 2}]
    for li, groups in enumerate(RING_LAYOUTS):
        for prof in ALL_PROFILES:
            for asserts in (True, False):
                out.append((f"ring{li}-{prof}-{'a' if asserts else 'na'}",
                            _case(groups, reqs, asserts, num_gpu_blocks=64), prof))
    fin = _case(FULL16, [{"id": "a", "prompt": [[1, 40]], "decode": 8}], num_gpu_blocks=64)
    out.append(("finish-0300", fin, "every-group"))
    out.append(("finish-0290", fin, "every-group-no-clamp"))
    load = _case(FULL16, [{"id": "a", "prompt": [[1, 96], [2, 20]], "decode": 2},
                          {"id": "x", "prompt": [[9, 740]], "arrival": 4, "decode": 2},
                          {"id": "b", "prompt": [[1, 96], [3, 20]], "arrival": 8, "decode": 2}],
                 num_gpu_blocks=48, timing={"store_latency": 2, "load_latency": 1})
    out.append(("load", load, "prefix-cacheable"))
    fence = _case(FULL16, [{"id": "a", "prompt": [[1, 64]], "decode": 1},
                           {"id": "x", "prompt": [[9, 700]], "arrival": 1, "decode": 2}],
                  num_gpu_blocks=48, timing={"store_latency": 5})
    out.append(("fence", fence, "prefix-cacheable"))
    nopc = _case(FULL16, [{"id": "a", "prompt": [[1, 96]], "decode": 1},
                          {"id": "b", "prompt": [[1, 96], [3, 20]], "arrival": 2, "decode": 2}],
                 num_gpu_blocks=48, enable_prefix_caching=False,
                 timing={"store_latency": 20, "load_latency": 1})
    out.append(("no-prefix-caching", nopc, "prefix-cacheable"))
    out.append(("never-fits", _case(FULL16, [{"id": "a", "prompt": [[1, 2000]], "decode": 2}],
                                    num_gpu_blocks=16), "prefix-cacheable"))
    return out


def bench_workload(n: int, seed: int = 0, latency: int = 2, **engine) -> dict:
    """``bench/bench_model.py``'s workload (copied so the corpus never follows its edits)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        length = rng.randint(208, 1191)
        prefix = rng.randrange(8)
        prompt = [[1000 + prefix, min(256, length)]]
        if length > 256:
            prompt.append([5000 + i, length - 256])
        reqs.append({"id": f"r{i}", "prompt": prompt,
                     "arrival": i // 4, "decode": rng.randint(16, 64)})
    return Case.from_json({
        "layout": {"groups": [{"kind": "full", "block_size": 16},
                              {"kind": "sliding_window", "block_size": 16, "sliding_window": 128},
                              {"kind": "full", "block_size": 16}],
                   "engine": {"num_gpu_blocks": 1200, "cpu_chunks": 4096, **engine}},
        "requests": reqs,
        "timing": {"store_latency": latency, "load_latency": latency,
                   "max_num_batched_tokens": 2048, "max_num_seqs": 32}}).to_json()


def _group(rng: random.Random, kind: str, bs: int) -> dict:
    g = {"kind": kind, "block_size": bs}
    if kind in ("sliding_window", "sliding_window_mla"):
        g["sliding_window"] = rng.choice(WINDOWS[:4])
    elif kind == "chunked_local":
        g["attention_chunk_size"] = rng.choice(CHUNK_SIZES[:4])
    elif kind == "mamba":
        g["mamba_cache_mode"] = rng.choice(("align", "none"))
    return g


def gen_layout(rng: random.Random) -> dict:
    family = rng.choice(FAMILIES)
    bs = rng.choice(BLOCK_SIZES[:5])
    if family == "free":
        kinds = ["full", "mla", "sliding_window", "chunked_local", "mamba", "ring",
                 "cross_attention", "sliding_window_mla"]
        groups = [_group(rng, rng.choice(kinds), rng.choice(BLOCK_SIZES[:5]))
                  for _ in range(rng.randint(1, 3))]
    elif family == "dense":
        groups = [_group(rng, rng.choice(("full", "mla")), bs)]
    elif family == "gpt_oss":
        groups = [_group(rng, "full", bs)] * rng.randint(1, 2) + [
            _group(rng, "sliding_window", bs)]
    elif family == "mamba_hybrid":
        groups = [_group(rng, "full", bs), _group(rng, "mamba", rng.choice((bs, 2 * bs, 4 * bs)))]
    elif family == "deepseek_v4":
        groups = [_group(rng, "mla", 64), _group(rng, "mla", rng.choice((64, 128))),
                  {"kind": "sliding_window_mla", "block_size": 64, "sliding_window": 128}]
        if rng.random() < 0.5:
            groups.append(_group(rng, "ring", rng.choice((4, 8, 16))))
    elif family == "mla_ring":
        groups = [_group(rng, rng.choice(("mla", "full")), rng.choice((64, 16))),
                  _group(rng, "ring", rng.choice((4, 8)))]
    else:   # drafter
        groups = [_group(rng, rng.choice(("full", "mla")), bs),
                  dict(_group(rng, "full", rng.choice((bs, 16))), drafter=True)]
    engine: dict = {"num_gpu_blocks": rng.choice((64, 128, 256, 1024)),
                    "cpu_chunks": rng.choice((16, 64, 1024))}
    if any(g.get("drafter") for g in groups) or rng.random() < 0.15:
        engine["speculative"] = {"method": rng.choice(("eagle", "mtp")),
                                 "num_tokens": rng.choice((1, 2, 3))}
    r = rng.random()
    if r < 0.2:
        engine["blocks_per_chunk"] = rng.choice(BLOCKS_PER_CHUNK[:4])
    elif r < 0.3:
        engine["offload_block_size"] = rng.choice((64, 128, 256))
    if rng.random() < 0.1:
        engine["dcp_size"] = 2
    if rng.random() < 0.1:
        engine["enable_prefix_caching"] = False
    return {"groups": groups, "engine": engine}


def gen_requests(rng: random.Random) -> list[dict]:
    reqs = []
    n = rng.randint(1, 8)
    prefixes = [rng.choice((16, 64, 96, 128, 256)) for _ in range(3)]
    for i in range(n):
        prompt = []
        if rng.random() < 0.7:
            p = rng.randrange(3)
            prompt.append([1 + p, prefixes[p]])
        if rng.random() < 0.8 or not prompt:
            prompt.append([100 + i, rng.randint(1, 200)])
        r = {"id": f"q{i}", "prompt": prompt, "arrival": rng.randint(0, 12),
             "decode": rng.randint(1, 24)}
        if rng.random() < 0.1:
            r["abort_at"] = rng.randint(0, 20)
        if rng.random() < 0.1:
            r["max_load_tokens"] = rng.choice((0, 32, 64, 128))
        if rng.random() < 0.1:
            r["max_offload_tokens"] = rng.choice((0, 32, 64, 128))
        reqs.append(r)
    return reqs


def _startable(case: Case) -> Case:
    """The case with a GPU pool vLLM's start-up check accepts (check_enough_kv_cache_memory:
    one request of the longest length fits), grown only where it is too small (no draw
    changes: the other cases stay as they were)."""
    from dataclasses import replace

    from simsched.geometry import kv_cache_blocks_needed, max_model_len
    need = kv_cache_blocks_needed(case, max_model_len(case)) + 1     # and the null block
    if case.layout.engine.num_gpu_blocks >= need:
        return case
    return replace(case, layout=case.layout.with_engine(num_gpu_blocks=need))


def generated(count: int = 300, seed: int = 20240601) -> list[tuple[str, dict, str]]:
    from simsched.layout import LayoutError
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        layout = gen_layout(rng)
        obj = {"layout": layout, "requests": gen_requests(rng),
               "asserts": rng.random() < 0.8,
               "timing": {"store_latency": rng.choice((0, 1, 2, 3)),
                          "load_latency": rng.choice((0, 1, 2)),
                          "max_num_batched_tokens": rng.choice((2048, 512, 128, 64)),
                          "max_num_seqs": rng.choice((32, 4, 2))}}
        try:
            case = Case.from_json(obj)
        except LayoutError:
            continue
        case = _startable(case)
        out.append((f"gen{len(out):03d}", case.to_json(), rng.choice(ALL_PROFILES)))
    return out


def corpus() -> list[tuple[str, dict, str]]:
    out = handwritten()
    out.append(("bench16", bench_workload(16), "prefix-cacheable-windows-in-config"))
    out.append(("bench16-pc", bench_workload(16, seed=1, latency=1), "prefix-cacheable"))
    out.append(("bench16-0290", bench_workload(16, seed=2, latency=3), "every-group-no-clamp"))
    out.append(("bench64", bench_workload(64), "prefix-cacheable-windows-in-config"))
    out.append(("bench16-tight", bench_workload(16, seed=3, num_gpu_blocks=300, cpu_chunks=64),
                "prefix-cacheable"))
    out.append(("bench16-spec", bench_workload(16, seed=4, latency=0,
                                               speculative={"method": "mtp", "num_tokens": 2}),
                "every-group"))
    out.extend(generated())
    return out
