from simsched.case import Case
from simsched.model import run_case


def mk(groups, reqs, asserts=True, timing=None, **engine):
    obj = {"layout": {"groups": groups, "engine": engine}, "requests": reqs, "asserts": asserts}
    if timing:
        obj["timing"] = timing
    return Case.from_json(obj)


FULL16 = [{"kind": "full", "block_size": 16}]


def test_single_request_clean():
    c = mk(FULL16, [{"id": "a", "prompt": [[1, 100]], "decode": 5}], num_gpu_blocks=64)
    r = run_case(c, "prefix-cacheable")
    assert r.ok, r.findings
    assert r.counters["stores"] == 1
    assert r.counters["finished"] == 1


import pytest  # noqa: E402

from simsched.model import cli_run  # noqa: E402
from simsched.profiles import PROFILES  # noqa: E402

RING_LAYOUTS = [[{"kind": "full", "block_size": 16}, {"kind": "ring", "block_size": 4}],
                [{"kind": "mla", "block_size": 64}, {"kind": "ring", "block_size": 4}]]
REQS = [{"id": "a", "prompt": [[1, 100]], "decode": 4},
        {"id": "b", "prompt": [[1, 100]], "arrival": 3, "decode": 2}]


def crash(groups, profile, asserts):
    r = run_case(mk(groups, REQS, asserts, num_gpu_blocks=64), profile)
    f = r.findings[0] if r.findings else None
    return None if f is None else (f["exception"], f["function"], f.get("caller"))


@pytest.mark.parametrize("groups", RING_LAYOUTS)
def test_pr55037_chain(groups):
    assert crash(groups, "every-group-no-clamp", True)[:2] == ("AssertionError",
                                                               "build_offloading_config")
    # asserts off: the islice ValueError on the first admission, before any store job
    assert crash(groups, "every-group-no-clamp", False) == (
        "ValueError", "update_offload_keys", "get_num_new_matched_tokens")
    assert crash(groups, "fix-assert-only", True)[:2] == ("AssertionError",
                                                          "get_sliding_window_size_in_chunks")
    assert crash(groups, "fix-assert-only", False)[:2] == ("ValueError", "update_offload_keys")
    assert crash(groups, "fix-assert-and-window", True)[:2] == ("ValueError",
                                                                "update_offload_keys")
    # the store-job mismatch of 0.29.0: islice fixed (zero-hash skip), no keyed-chunk clamp
    assert crash(groups, "every-group-no-clamp+skip-zero-hash", True)[:2] == (
        "AssertionError", "_build_store_jobs")
    assert crash(groups, "every-group-no-clamp+skip-zero-hash", False) is None
    assert crash(groups, "prefix-cacheable", True) is None
    assert crash(groups, "fix-skip-zero-hash", True) is None


SHARED = [{"id": f"r{i}", "prompt": [[7, 256], [100 + i, 64 + 16 * i]], "arrival": 3 * i,
           "decode": 8 + i} for i in range(6)]
HYBRID = [{"kind": "full", "block_size": 16},
          {"kind": "sliding_window", "block_size": 16, "sliding_window": 64}]


def hybrid_case(**kw):
    """The benchmark's workload (64 requests, 8 shared prefixes, 3 groups, 1,200 GPU blocks)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_model import workload
    return workload(64)


@pytest.mark.parametrize("profile", [p for p, v in PROFILES.items() if v.keyed_chunk_clamp])
def test_profiles_clean_with_loads(profile):
    r = run_case(hybrid_case(), profile)
    assert r.ok, r.findings
    assert r.counters["loads"] > 0 and r.counters["stores"] > 0


@pytest.mark.parametrize("profile", [p for p, v in PROFILES.items() if not v.keyed_chunk_clamp])
def test_profiles_before_0_30_store_the_uncommitted_last_token_inv4(profile):
    # 0.29.0 and older store up to num_tokens at finish: the last sampled token's KV was never
    # computed, so a chunk ending there holds a stale slot under a key that names it. Decode
    # tokens are only stored with offload_prompt_only off (it defaults to on).
    case = hybrid_case()
    assert run_case(case, profile).ok
    case = Case.from_json(dict(case.to_json(), layout=case.layout.with_engine(
        offload_prompt_only=False).to_json()))
    r = run_case(case, profile)
    assert [f.get("inv_id") for f in r.findings] == ["INV-4"]


def test_finish_store_of_uncommitted_token_0290():
    """0.29.0 stores the block ending at num_tokens on finish: its last slot was never written
    (with offload_prompt_only off; by default only the prompt is stored)."""
    c = mk(FULL16, [{"id": "a", "prompt": [[1, 40]], "decode": 8}], num_gpu_blocks=64,
           offload_prompt_only=False)
    assert run_case(c, "every-group").ok
    r = run_case(c, "every-group-no-clamp")
    assert r.findings and r.findings[0]["inv_id"] == "INV-4"
    c = mk(FULL16, [{"id": "a", "prompt": [[1, 40]], "decode": 8}], num_gpu_blocks=64)
    assert run_case(c, "every-group-no-clamp").ok


def test_determinism():
    a = run_case(hybrid_case(), "prefix-cacheable").trace_text().encode()
    b = run_case(hybrid_case(), "prefix-cacheable").trace_text().encode()
    assert a == b


def test_preemption_clean():
    r = run_case(hybrid_case(), "prefix-cacheable")
    assert r.ok, r.findings
    assert r.counters["preemptions"] > 0


def test_cli_run(tmp_path):
    import io
    p = tmp_path / "c.json"
    p.write_text(hybrid_case().dumps())
    out = io.StringIO()
    assert cli_run(str(p), "prefix-cacheable", out) == 0
    assert out.getvalue().splitlines()[-1].startswith("CLEAN")
    p.write_text(mk(RING_LAYOUTS[0], REQS, num_gpu_blocks=64).dumps())
    out = io.StringIO()
    assert cli_run(str(p), "every-group", out) == 1
    assert "FINDING crash" in out.getvalue().splitlines()[-1]


def test_run_leaves_no_cyclic_garbage():
    """run_case pauses the cyclic collector for the run: it loses nothing by that only if a run
    leaves no cyclic garbage behind. Over the golden corpus (clean runs, crashes and invariant
    findings, every profile, both check modes), a collection after the run frees nothing; and
    run_case leaves the collector as it found it."""
    import gc
    import json

    from model_corpus import GOLDEN_DIR
    names = (GOLDEN_DIR / "INDEX").read_text().split()
    assert len(names) > 100
    first = Case.from_json(json.loads((GOLDEN_DIR / f"{names[0]}.json").read_text())["case"])
    run_case(first)
    assert gc.isenabled()                           # resumed, as it was on
    kinds = set()
    gc.collect()
    gc.disable()        # (so that everything a run makes stays in the youngest generation)
    try:
        for name in names:
            meta = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
            case = Case.from_json(meta["case"])
            for checks in ("full", "fast"):
                res = run_case(case, meta["profile"], checks=checks, trace=checks == "full")
                assert not gc.isenabled()           # left off, as it was
                kinds.update(f["kind"] for f in res.findings)
                assert gc.collect(0) == 0, f"{name} ({checks}): the run left cyclic garbage"
    finally:
        gc.enable()
    assert kinds == {"crash", "invariant"}          # the corpus reaches both kinds of finding


def test_token_depends_on_the_seed_mod_vocab():
    """_token takes the case's seed reduced mod VOCAB (its i64 arithmetic stays exact): the
    token of the plain formula, for any seed up to 2**63 - 1 (Case's bound); a case of a large
    seed runs as one of its residue."""
    import random

    from simsched.case import VOCAB
    from simsched.case import sampled_token as _token

    rng = random.Random(7)
    for _ in range(2000):
        seed = rng.choice([0, 1, VOCAB - 1, VOCAB, (1 << 63) - 1, rng.randrange(1 << 63)])
        index, pos = rng.randrange(1 << 20), rng.randrange(1 << 32)
        want = (seed * 1000003 + index * 7919 + pos * 104729 + 3) % VOCAB
        assert _token(seed % VOCAB, index, pos) == want
    reqs = [{"id": "a", "prompt": [[1, 40]], "decode": 20},
            {"id": "b", "prompt": [[1, 40], [2, 9]], "decode": 12, "arrival": 2}]
    big = (1 << 63) - 1
    obj = {"layout": {"groups": FULL16, "engine": {"num_gpu_blocks": 64}}, "requests": reqs}
    runs = [run_case(Case.from_json({**obj, "seed": s}), "prefix-cacheable").trace_text()
            for s in (big, big % VOCAB)]
    assert runs[0] == runs[1]


# --- EAGLE beside groups whose cache-hit finder never drops a block (issue 17, item 6.1) --------

EAGLE2 = {"method": "eagle", "num_tokens": 2}
CHUNKED_EAGLE = [{"kind": "chunked_local", "block_size": 16, "attention_chunk_size": 64}]
MAMBA_EAGLE = [{"kind": "full", "block_size": 16},
               {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}]
#: b shares a's prompt: its GPU prefix hit is where the model crashed with a KeyError
EAGLE_REQS = {"chunked": [{"id": "a", "prompt": [[0, 100]], "decode": 8},
                          {"id": "b", "prompt": [[0, 100]], "arrival": 12, "decode": 4}],
              "mamba": [{"id": "a", "prompt": [[0, 64]], "decode": 8},
                        {"id": "b", "prompt": [[0, 64]], "arrival": 12, "decode": 4}]}
#: the profiles whose config stage takes a chunked local group (0.25.1-0.27.1 fail it first)
CHUNKED_PROFILES = [p for p in PROFILES if not p.startswith("legacy")]


def eagle_case(kind: str, asserts: bool = True):
    groups = CHUNKED_EAGLE if kind == "chunked" else MAMBA_EAGLE
    return mk(groups, EAGLE_REQS[kind], asserts, num_gpu_blocks=64, speculative=EAGLE2)


@pytest.mark.parametrize("profile", CHUNKED_PROFILES)
def test_eagle_with_chunked_local_fails_the_first_lookup(profile):
    # every group is an EAGLE group without a drafter group, and ChunkedLocalAttentionManager
    # asserts drop_eagle_block is False: the first request's lookup raises (was: the model's
    # own KeyError in _hit_block at b's hit)
    r = run_case(eagle_case("chunked"), profile)
    assert [(f["kind"], f["exception"], f["function"], f["step"]) for f in r.findings] == [
        ("crash", "AssertionError", "find_longest_cache_hit", 0)]
    assert "eagle + chunked local attention" in r.findings[0]["message"]


@pytest.mark.parametrize("profile", CHUNKED_PROFILES)
def test_eagle_with_chunked_local_and_asserts_stripped_keeps_the_hit_block(profile):
    # python -O: the chunked local finder ignores drop_eagle_block, so b's hit keeps its last
    # block (a single group: nothing drops)
    r = run_case(eagle_case("chunked", asserts=False), profile)
    assert r.ok, r.findings
    assert r.counters["finished"] == 2
    hit = next(line for line in r.trace if line.startswith("alloc b"))
    assert hit.startswith("alloc b g0=0,0,0,0,"), hit      # 64 tokens out of reach, no drop


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("asserts", [True, False])
def test_eagle_with_align_mamba_hits_at_a_state_block(profile, asserts):
    # the EAGLE drop applies to full attention first and Mamba searches within its hit (its
    # finder never drops): the hit ends on a cached state (was: one block below it, a KeyError
    # in admission_blocks); align-mode Mamba allocates no lookahead slots
    r = run_case(eagle_case("mamba", asserts), profile)
    extra = PROFILES[profile].extra
    if extra.get("eagle_extra_chunk_windows_only") and not extra.get("eagle_tail_hole"):
        # 0.26.0-0.29.0: every group an EAGLE group, and the full-attention group looks up no
        # chunk past the hit before it pops one: b's lookup finds nothing (INV-9, as 0.27.0's
        # and 0.29.0's real runs of this case break it; 0.25.1's lookup stops at the hole its
        # EAGLE tail leaves)
        assert [f["inv_id"] for f in r.findings] == ["INV-9"], r.findings
    else:
        assert r.ok, r.findings
        assert r.counters["finished"] == 2
    # a's first chunk stops a block before the last whole one (EAGLE backs the last cacheable
    # position off a block) and its state block sits at the chunk's end, not past the
    # lookahead slots, followed by the spec's 2 speculative state blocks (the line of 0.30.0's
    # and 0.33.0's real runs)
    assert r.trace[2:4] == ["sched a 48", "alloc a g0=1,2,3,4 g1=0,0,5,6,7"], r.trace[:6]


# --- vLLM's start-up check of the KV cache pool (issue 17, item 6.5) -------------------------

TOO_LONG = [{"id": "a", "prompt": [[7, 200]], "decode": 2}]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_request_longer_than_the_pool_is_refused_not_a_liveness_finding(profile):
    # 202 tokens need 13 blocks; 8 GPU blocks leave 7 (the null block; before 0.29.0 the
    # check counts all 8): vLLM refuses to start (check_enough_kv_cache_memory) where the
    # model used to report INV-8
    r = run_case(mk(FULL16, TOO_LONG, num_gpu_blocks=8), profile)
    assert r.findings == [] and r.counters["steps"] == 0
    held = PROFILES[profile].extra.get("startup_null_block", True)
    assert r.refused == (
        "To serve at least one request with the model's max seq len (202), (13 blocks) KV cache "
        f"is needed, which is larger than the available KV cache memory ({7 if held else 8} "
        "blocks). Based on the available memory, the estimated maximum model length is "
        f"{112 if held else 128}. Try increasing `gpu_memory_utilization` or decreasing "
        "`max_model_len` when initializing the engine.")
    from simsched.targets import ModelTarget
    assert ModelTarget.named(profile).run(mk(FULL16, TOO_LONG, num_gpu_blocks=8)) == ([], 0)


@pytest.mark.parametrize("groups, blocks", [
    (FULL16, 13),                                        # cdiv(202, 16)
    ([{"kind": "sliding_window", "block_size": 16, "sliding_window": 32}], 5),  # 31 + 32: 4+1
    ([{"kind": "chunked_local", "block_size": 16, "attention_chunk_size": 64}], 6),  # 64 + 32
    ([{"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}], 2),
    (FULL16 + [{"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}], 15),
    (FULL16 + [{"kind": "ring", "block_size": 4}], 14),
])
def test_startup_check_counts_each_group_as_its_spec_does(groups, blocks):
    from simsched.geometry import check_enough_kv_cache_memory
    for pool, refused in ((blocks, True), (blocks + 1, False)):
        c = mk(groups, TOO_LONG, num_gpu_blocks=pool, timing={"max_num_batched_tokens": 32})
        assert (check_enough_kv_cache_memory(c, PROFILES["every-group"]) is not None) \
            == refused, (pool, groups)


@pytest.mark.parametrize("mode, engine, blocks", [
    ("align", {}, 2 + 3),
    ("none", {"enable_prefix_caching": False}, 1 + 3),
])
def test_startup_check_counts_the_mamba_speculative_blocks(mode, engine, blocks):
    """MambaSpec.max_memory_usage_bytes: (2 + num_speculative_blocks) pages in align mode,
    (1 + num_speculative_blocks) otherwise (v1/kv_cache_interface.py, 0.30.0:1034-1045); MTP
    with 3 drafts gives the Mamba spec 3 speculative blocks (MambaBase.get_kv_cache_spec)."""
    from simsched.geometry import check_enough_kv_cache_memory
    groups = [{"kind": "mamba", "block_size": 16, "mamba_cache_mode": mode}]
    for pool, refused in ((blocks, True), (blocks + 1, False)):
        c = mk(groups, TOO_LONG, num_gpu_blocks=pool,
               speculative={"method": "mtp", "num_tokens": 3}, **engine)
        assert (check_enough_kv_cache_memory(c, PROFILES["every-group"]) is not None) \
            == refused, (pool, mode)


def test_lockstep_reports_a_refusal_as_not_run():
    from simsched.lockstep import LockstepResult, _observations
    real = {"status": "refused", "reason": "To serve at least one request ..."}
    res = LockstepResult(mk(FULL16, TOO_LONG, num_gpu_blocks=8), "0.33.0",
                         "prefix-cacheable-windows-in-config", None, real, None)
    assert _observations(res, None) == []
    assert res.summary() == ("0.33.0: not run: refused at start-up: To serve at least one "
                             "request ...")
