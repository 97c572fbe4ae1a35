"""Decode context parallelism (``dcp_size`` > 1) on the real releases: the layouts vLLM refuses
under DCP, the start-up check's sizing under DCP, and 0.26.0's DCP finding. Real-vLLM tests
FAIL (never skip) when a release is missing."""

from __future__ import annotations

import pytest

from simsched.case import Case
from simsched.geometry import max_blocks_per_request
from simsched.layout import Group
from simsched.lockstep import lockstep
from simsched.targets import Releases

RELEASES = ["0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.31.0", "0.33.0"]

#: shrunk cases of the 20-minute campaign: a windowed or chunked-local group under DCP, asserts
#: stripped. vLLM asserts each unsupported (``SlidingWindowManager.find_longest_cache_hit``:
#: "DCP not support sliding window attn now."; ``SlidingWindowSpec.max_memory_usage_bytes``;
#: the hybrid coordinator's "DCP with hybrid KV cache layouts only supports full-attention and
#: Mamba groups"); under ``python -O`` the real run looked hits up at the unscaled block size
#: (0.31.0: r1's table was block 10 twenty times) and broke INV-4
UNSUPPORTED = {
    "sliding_window_mla": {"layout": {"groups": [{"kind": "sliding_window_mla", "block_size": 3,
                                                  "sliding_window": 128}],
                                      "engine": {"dcp_size": 2}},
                           "requests": [{"id": "r0", "prompt": [[0, 64]]},
                                        {"id": "r1", "prompt": [[0, 64]]}],
                           "asserts": False},
    "sliding_window": {"layout": {"groups": [{"kind": "sliding_window", "block_size": 4,
                                              "sliding_window": 16}],
                                  "engine": {"dcp_size": 2}},
                       "requests": [{"id": "r0", "prompt": [[0, 64]]},
                                    {"id": "r1", "prompt": [[0, 16]]}],
                       "asserts": False},
    "chunked_local+full": {"layout": {"groups": [{"kind": "chunked_local", "block_size": 4,
                                                  "attention_chunk_size": 64},
                                                 {"kind": "full", "block_size": 16}],
                                      "engine": {"dcp_size": 2}},
                           "requests": [{"id": "r0", "prompt": [[0, 2304]]},
                                        {"id": "r1", "prompt": [[0, 64]]}],
                           "asserts": False},
    # AssertionError-__init-c856fd of the next campaign, asserts on: the coordinator's "DCP with
    # hybrid KV cache layouts only supports full-attention, Mamba, and replicated draft groups,
    # got: CircularBufferSpec" (0.31.0 on; 0.26.0 has no ring at all)
    "mla+ring": {"layout": {"groups": [{"kind": "mla", "block_size": 64},
                                       {"kind": "ring", "block_size": 4}],
                            "engine": {"dcp_size": 2}},
                 "requests": [{"id": "r0", "prompt": [[0, 64]]}]},
    # AssertionError-find_longest_cache_hit-ca75d8 of the 2026-12-02 campaign, asserts on, on
    # 0.25.1-0.26.0 (later releases refuse it at start-up first): a Mamba model's one group
    # under the unitary coordinator, MambaManager's "DCP not support mamba now."
    "mamba": {"layout": {"groups": [{"kind": "mamba", "block_size": 16,
                                     "mamba_cache_mode": "align"}],
                         "engine": {"dcp_size": 2}},
              "requests": [{"id": "r0", "prompt": [[0, 64]]}]},
}

#: cross attention under DCP: CrossAttentionSpec.max_memory_usage_bytes counts
#: cdiv(max_num_encoder_input_tokens, block_size) blocks, the spec's block size unscaled: 2048
#: encoder tokens in blocks of 2 are 1024 blocks, one more than the 1023 usable ones
CROSS = {"layout": {"groups": [{"kind": "cross_attention", "block_size": 2}],
                    "engine": {"dcp_size": 2}},
         "requests": [{"id": "r0", "prompt": [[0, 64]]}]}

#: 0.26.0: full/8 + align-mode Mamba/8 under DCP 2 with the OffloadingConnector; r1 [1]*16 is
#: r2's prefix. docs/repro/dcp_mamba_connector_hit_0260.py shows it with vLLM alone
MAMBA_HIT = {"layout": {"groups": [{"kind": "full", "block_size": 8},
                                   {"kind": "mamba", "block_size": 8,
                                    "mamba_cache_mode": "align"}],
                        "engine": {"blocks_per_chunk": 2, "dcp_size": 2}},
             "requests": [{"id": "r0", "prompt": [[0, 64]]}, {"id": "r1", "prompt": [[1, 16]]},
                          {"id": "r2", "prompt": [[1, 64]]}]}


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(RELEASES, timeout=120) as p:
        yield p


@pytest.mark.parametrize("version", ["0.26.0", "0.31.0", "0.33.0"])
@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_layouts_vllm_refuses_under_dcp_are_unsupported(pool, version, name):
    """Before: the real run went on (asserts stripped) and broke INV-4 on these layouts (0.26.0
    to 0.28.0, 0.31.0 to 0.33.0) or raised vLLM's assert at the first lookup (Mamba alone). Now
    the harness refuses them as vLLM does: not run, no finding, whatever the model says."""
    res = lockstep(Case.from_json(UNSUPPORTED[name]), version, pool)
    assert res.real["status"] == "unsupported", res.summary()
    assert "vLLM does not support DCP with" in res.real["reason"] or (
        version == "0.26.0" and "no CircularBufferSpec" in res.real["reason"])
    assert res.observations == [], res.summary()


def test_cross_attention_under_dcp_sizes_blocks_unscaled():
    """The model's start-up check counts cross attention's blocks at the spec's block size:
    cdiv(2048, 2), not cdiv(2048, 2 * 2)."""
    g = Group("cross_attention", 2)
    assert max_blocks_per_request(g, 65, 2048, 2, 2048) == 1024
    assert max_blocks_per_request(Group("full", 16), 65, 2048, 2, 2048) == 3   # cdiv(65, 32)


@pytest.mark.parametrize("version", ["0.29.0", "0.33.0"])
def test_cross_attention_under_dcp_is_refused_at_startup_on_both_sides(pool, version):
    """Before: the release refused the case at start-up (1024 blocks needed, 1023 usable) while
    the model counted DCP-scaled blocks (512), ran it and crashed in from_spec: a model gap
    (trace.refused). Now both refuse it with vLLM's message."""
    res = lockstep(Case.from_json(CROSS), version, pool)
    assert res.real["status"] == "refused", res.summary()
    assert res.model.refused is not None and res.observations == [], res.summary()
    assert "(1024 blocks) KV cache is needed" in res.model.refused
    assert "(1024.0 GiB KV cache is needed" in res.real["reason"]      # GiB stand for blocks


@pytest.mark.parametrize("version", ["0.26.0", "0.28.0"])
def test_cross_attention_under_dcp_passes_startup_before_0290_and_fails_at_boot(pool, version):
    """Before 0.29.0 the start-up check counts the null block (vllm-project/vllm#47272): the
    1024 blocks fit the 1024-block pool, the engine starts, and the OffloadingConnector's
    scheduler refuses the spec at boot with vLLM's own assert in
    get_sliding_window_size_in_chunks (cross attention is not a FullAttentionSpec). The model
    passes the same start-up check and stops at the same place."""
    res = lockstep(Case.from_json(CROSS), version, pool)
    assert res.model.refused is None and res.divergence is None, res.summary()
    crash = res.real["findings"]
    assert [(c["stage"], c["exception"], c["function"]) for c in crash] == [
        ("boot", "AssertionError", "get_sliding_window_size_in_chunks")], crash
    assert res.model.trace[-1] == ("crash AssertionError get_sliding_window_size_in_chunks "
                                   "from_spec"), res.model.trace
    assert [o.signature.function for o in res.observations] == [
        "get_sliding_window_size_in_chunks"], res.observations


def test_dcp_mamba_hybrid_with_a_connector_claims_an_unheld_block_0260(pool):
    """Finding (0.26.0, fixed in 0.27.0): with a connector and Mamba layers, schedule() looks a
    waiting request up with find_longest_cache_hit_per_group, which calls the managers without
    dcp_world_size: full attention finds nothing at its unscaled block, the Mamba state is
    found at 16, and r2 starts at 16 computed tokens with a fresh full-attention block 0. The
    store of r2's first chunk reads that never-written block (INV-4)."""
    case = Case.from_json(MAMBA_HIT)
    res = lockstep(case, "0.26.0", pool)
    f = res.real["findings"]
    assert [(x["inv_id"], x["step"]) for x in f] == [("INV-4", 1)], f
    assert "chunk g0:3 block index 0 holds None" in f[0]["detail"]
    assert "sched r2 48" in res.real["trace"]           # 16 tokens claimed computed
    fixed = lockstep(case, "0.27.0", pool)
    assert fixed.real["status"] == "ok" and fixed.real["findings"] == [], fixed.summary()
