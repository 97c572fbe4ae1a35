"""The config-level chain on REAL vLLM releases (see test_worker.release_spec for how releases
are found; missing releases make these tests fail, not skip)."""

from __future__ import annotations

import random

import pytest

from simsched.vllm.worker import ReleaseWorker
from test_worker import FULL16_RING4, release_spec

CONFIG = "distributed/kv_transfer/kv_connector/v1/offloading/config.py"
SCHEDULER = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"


@pytest.fixture(scope="module")
def workers():
    pool: dict[tuple[str, bool], ReleaseWorker] = {}

    def get(version: str, asserts: bool = True) -> ReleaseWorker:
        key = (version, asserts)
        if key not in pool:
            pool[key] = ReleaseWorker(release_spec(version, asserts=asserts), timeout=300)
        return pool[key]

    yield get
    for w in pool.values():
        w.close()


def one(worker: ReleaseWorker, layout: dict, num_tokens: int = 100) -> dict:
    [out] = worker.config_batch([{"layout": layout, "num_tokens": num_tokens}])
    return out


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0"])
def test_reference_chain_boot_assert(workers, version):
    out = one(workers(version), FULL16_RING4)
    assert out["status"] == "error", out
    assert out["stage"] == "build_offloading_config"
    assert out["exception"] == "AssertionError"
    assert out["function"] == "build_offloading_config"
    assert out["file"] == CONFIG
    assert out["message"].startswith("tokens_per_block=4 not divisible by tokens_per_hash=16")


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0"])
def test_reference_chain_without_asserts_reaches_islice(workers, version):
    out = one(workers(version, asserts=False), FULL16_RING4)
    assert out["status"] == "error", out
    assert out["stage"] == "update_offload_keys"
    assert out["exception"] == "ValueError"
    assert out["function"] == "update_offload_keys"
    assert out["file"] == SCHEDULER
    assert out["message"].startswith("Indices for islice() must be None or an integer")


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0", "0.33.0"])
@pytest.mark.parametrize("asserts", [True, False])
def test_reference_chain_fixed_releases_leave_the_ring_out(workers, version, asserts):
    out = one(workers(version, asserts), FULL16_RING4)
    assert out["status"] == "ok", out
    geo = out["geometry"]
    assert [g["group_id"] for g in geo["groups"]] == [0]
    assert geo["scheduler_block_size"] == 16 and geo["tokens_per_hash"] == 16
    assert out["num_hashes"] == 6 and out["offload_keys"] == [[0, 1, 2, 3, 4, 5]]


def test_offload_keys_are_hash_indices(workers):
    layout = {"groups": [{"kind": "full", "block_size": 16},
                         {"kind": "sliding_window", "block_size": 16, "sliding_window": 64}],
              "engine": {"blocks_per_chunk": 2}}
    out = one(workers("0.33.0"), layout, 100)
    assert out["status"] == "ok", out
    assert out["num_hashes"] == 6
    assert out["offload_keys"] == [[1, 3, 5], [1, 3, 5]]
    g0, g1 = out["geometry"]["groups"]
    assert (g0["tokens_per_chunk"], g0["hashes_per_chunk"], g0["sliding_window_in_chunks"]) \
        == (32, 2, None)
    assert g1["sliding_window_in_chunks"] == 2
    assert out["geometry"]["alignment_tokens"] == 32


def test_engine_rejections_are_observed(workers):
    both = {"groups": [{"kind": "full", "block_size": 16}],
            "engine": {"blocks_per_chunk": 2, "offload_block_size": 32}}
    out = one(workers("0.30.0"), both)
    assert (out["status"], out["stage"], out["exception"]) == \
        ("error", "build_offloading_config", "ValueError")


def test_old_release_unsupported_kinds_and_knobs(workers):
    w = workers("0.25.1")
    assert one(w, FULL16_RING4)["status"] == "unsupported"
    bpc = {"groups": [{"kind": "full", "block_size": 16}], "engine": {"blocks_per_chunk": 2}}
    out = one(w, bpc)
    assert out["status"] == "unsupported" and "blocks_per_chunk" in out["reason"]
    obs = {"groups": [{"kind": "full", "block_size": 16}], "engine": {"offload_block_size": 32}}
    out = one(w, obs, 100)
    assert out["status"] == "ok" and out["geometry"]["blocks_per_chunk"] == 2
    assert out["geometry"]["alignment_tokens"] is None       # 0.25.1 has no alignment_tokens
    assert out["offload_keys"] == [[1, 3, 5]]
    kept = {"groups": [{"kind": "sliding_window", "block_size": 16, "sliding_window": 32,
                        "extra_retained_tokens": 3}]}
    out = one(w, kept)
    assert out["status"] == "unsupported" and "extra_retained_tokens" in out["reason"]


def random_items(n: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    items = []
    for _ in range(n):
        groups = []
        for _ in range(r.randint(1, 4)):
            kind = r.choice(["full", "full", "mla", "sliding_window", "chunked_local", "mamba",
                             "ring", "cross_attention", "sliding_window_mla"])
            g = {"kind": kind, "block_size": r.choice([4, 8, 16, 16, 32, 64])}
            if kind in ("sliding_window", "sliding_window_mla"):
                g["sliding_window"] = r.choice([64, 128, 1024])
            if kind == "chunked_local":
                g["attention_chunk_size"] = r.choice([64, 256])
            if kind == "mamba":
                g["mamba_cache_mode"] = r.choice(["none", "align"])
            groups.append(g)
        engine = {}
        if r.random() < 0.3:
            engine["blocks_per_chunk"] = r.choice([1, 2, 4])
        if r.random() < 0.1:
            engine["offload_block_size"] = r.choice([32, 64])
        if r.random() < 0.2:
            engine["prefix_match_unit"] = r.choice([4, 8, 16])
        items.append({"layout": {"groups": groups, "engine": engine},
                      "num_tokens": r.randint(1, 2000)})
    return items


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_a_batch_answers_every_item(workers, version):
    # Throughput is measured in bench/bench_config.py (BENCHMARKS.md), not here.
    w = workers(version)
    items = random_items(200, 2)
    out = w.config_batch(items)
    assert len(out) == 200
    assert {o["status"] for o in out} <= {"ok", "error", "unsupported"}


# --- prefix_cache_retention_interval: one value on both sides ---------------------------------

SW_FULL = [{"kind": "full", "block_size": 16},
           {"kind": "sliding_window", "block_size": 16, "sliding_window": 128}]
HYBRID_EAGLE = {"groups": [{"kind": "full", "block_size": 16},
                           {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}],
                "engine": {"speculative": {"method": "eagle", "num_tokens": 1}}}


def boot_retention(worker: ReleaseWorker, layout: dict) -> dict:
    return worker.call("boot_retention", case={"layout": layout})


@pytest.mark.parametrize("version, default, hybrid_eagle", [
    # no config field; the coordinator reads VLLM_PREFIX_CACHE_RETENTION_INTERVAL, unset: None
    ("0.28.0", "absent", "absent"),
    ("0.29.0", 0, None),              # EngineArgs.create_engine_config: dense for hybrid+EAGLE
    ("0.30.0", 0, 0), ("0.33.0", 0, 0)])
def test_unset_retention_is_one_value_on_both_sides(workers, version, default, hybrid_eagle):
    """With the knob left out, the booted engine's KVCacheConfig (read by the KV cache manager)
    carries the CacheConfig's value (read by the connector, 0.30.0+), as
    get_kv_cache_config_from_groups copies it: the release's default (config/cache.py)."""
    w = workers(version)
    connector = "absent" if version < "0.30.0" else default
    manager = None if default == "absent" else default
    assert boot_retention(w, {"groups": SW_FULL}) == {
        "cache_config": default, "kv_cache_config": default, "kv_cache_manager": manager,
        "connector": connector}
    out = boot_retention(w, HYBRID_EAGLE)
    assert out["kv_cache_config"] == out["cache_config"] == hybrid_eagle
    assert out["kv_cache_manager"] == (None if hybrid_eagle == "absent" else hybrid_eagle)


@pytest.mark.parametrize("version", ["0.29.0", "0.33.0"])
@pytest.mark.parametrize("value", [None, 64])
def test_set_retention_reaches_both_sides(workers, version, value):
    """A case's value, null (--prefix-cache-retention-interval None) included, on every side."""
    layout = {**HYBRID_EAGLE, "engine": {**HYBRID_EAGLE["engine"],
                                         "retention_interval": "dense" if value is None else value}}
    out = boot_retention(workers(version), layout)
    assert out == {"cache_config": value, "kv_cache_config": value, "kv_cache_manager": value,
                   "connector": value if version >= "0.30.0" else "absent"}
