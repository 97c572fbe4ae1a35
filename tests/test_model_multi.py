"""The model on the ``multi`` connector path (issue 21): a P/D decode instance whose
``MultiConnector`` of the OffloadingConnector and NIXL pulls remote prefills while it offloads
to CPU (``simsched/model/multi_connector.py``, ``nixl_scheduler.py``). Model only, no release:
each expectation is read off the releases' source, cited; ``tests/test_real_multi.py`` runs the
same cases on the releases in lockstep with the model."""

from __future__ import annotations

from simsched.case import Case
from simsched.model import run_case
from simsched.profiles import profile_for_release


def _case(requests: list, blocks: int = 12, order=("offloading", "nixl"),
          groups=None) -> Case:
    return Case.from_json({
        "layout": {"groups": groups or [{"kind": "full", "block_size": 16}],
                   "engine": {"num_gpu_blocks": blocks, "cpu_chunks": 64,
                              "connector": {"kind": "multi", "order": list(order)}}},
        "timing": {"store_latency": 4, "load_latency": 2},
        "requests": requests})


def _trace(case: Case, release: str = "0.33.0") -> list[str]:
    return run_case(case, profile_for_release(release)).trace


def test_a_pulled_request_is_parked_until_its_pull_lands():
    """R's 64 tokens (4 blocks of 16) are all NIXL's to pull (``get_num_new_matched_tokens``:
    the prompt beyond the local hit of 0, loaded asynchronously); the scheduler allocates its
    four blocks (1-4: block 0 is the null block) and parks it. Once the pull lands (2 steps),
    ``_update_waiting_for_remote_kv`` caches the blocks and takes the prompt's last token back
    to recompute it: one token scheduled, and then the OffloadingConnector stores the four
    received blocks."""
    trace = _trace(_case([{"id": "R", "prompt": [[1, 64]], "decode": 2, "remote_prefill": 2}]))
    assert "recv R g0=1,2,3,4" in trace, trace
    landed = trace.index("landed R")
    assert not any(x.startswith("sched R") for x in trace[:landed]), trace
    after = trace[landed:]
    assert next(x for x in after if x.startswith("sched R")) == "sched R 1", trace
    assert any(x.startswith("store ") and x.endswith("R g0:0=1 g0:1=2 g0:2=3 g0:3=4")
               for x in after), trace


#: A's 64 tokens go to CPU; D (160 tokens, 10 blocks of a pool of 11) evicts A's GPU blocks;
#: R2, a P/D request, starts with A's 64 tokens
ROUTED = [{"id": "A", "prompt": [[1, 64]], "decode": 1},
          {"id": "D", "prompt": [[2, 160]], "arrival": 8},
          {"id": "R2", "prompt": [[1, 64], [7, 32]], "arrival": 16, "decode": 2,
           "remote_prefill": 2}]


def test_the_first_child_that_offers_tokens_serves_the_request():
    """``MultiConnector.get_num_new_matched_tokens``: the first child with new matched tokens
    is assigned the request. Offloading first: its CPU hit (A's 4 chunks) is loaded and NIXL,
    told zero tokens, only notifies the prefill instance (a pull of no blocks: no recv).
    NIXL first: it pulls the 80 tokens past the local hit (A's first block, which D left in the
    GPU prefix cache: D's 10 blocks and A's 4 do not fit in 11), into the 5 blocks without a
    block hash (``get_unhashed_block_ids_all_groups``), and nothing is loaded from CPU."""
    on = _trace(_case(ROUTED, order=("offloading", "nixl")))
    no = _trace(_case(ROUTED, order=("nixl", "offloading")))
    assert any(x.startswith("load ") and " R2 " in x for x in on), on
    assert not any(x.startswith("recv R2") for x in on), on
    recv = next(x for x in no if x.startswith("recv R2"))
    assert len(recv.split()[2].split("=")[1].split(",")) == 5, recv
    assert "sched R2 16" not in no and "sched R2 1" in no, no     # the last token recomputed
    assert not any(x.startswith("load ") and " R2 " in x for x in no), no


#: one chunked-local group (attention chunks of 64 tokens) and a 64-token prompt: every block
#: of the prompt lies before the attention chunk its next token opens, so the scheduler gives
#: the pull no block (null placeholders only) and parks the request all the same
CHUNK_EDGE = [{"id": "R", "prompt": [[0, 64]], "remote_prefill": 1}]
LOCAL = [{"kind": "chunked_local", "block_size": 16, "attention_chunk_size": 64}]


def test_a_pull_with_no_blocks_lands_from_0300_and_strands_before():
    """0.30.0 tells the worker the request is parked (``awaiting_kvs``, ``num_external_tokens
    > 0``, 0.30.0 ``nixl/pull_scheduler.py`` update_state_after_alloc) and the worker reports
    it; 0.29.0's entry has no such field, the worker only notifies the prefill instance, and
    the request waits in WAITING_FOR_REMOTE_KVS for good (INV-8; upstream vllm#54714)."""
    new = _trace(_case(CHUNK_EDGE, groups=LOCAL), "0.30.0")
    assert "recv R g0=-" in new and "landed R" in new and "finish R finished" in new, new
    old = _trace(_case(CHUNK_EDGE, groups=LOCAL), "0.29.0")
    assert "landed R" not in old and "finish R finished" not in old, old
    assert old[-1].startswith("violation INV-8"), old


def test_from_0310_a_request_that_skips_the_prefix_cache_is_not_pulled():
    """0.31.0's ``Scheduler.schedule`` sets every connector's answer aside for a request that
    skips reading the prefix cache (``if request.skip_reading_prefix_cache: ext_tokens,
    load_kv_async = 0, False``); 0.30.0 leaves the lookup to the connector, and NIXL pulls."""
    reqs = [{"id": "R", "prompt": [[1, 64]], "decode": 2, "remote_prefill": 2,
             "skip_reading_prefix_cache": True}]
    assert "recv R g0=1,2,3,4" in _trace(_case(reqs), "0.30.0")
    new = _trace(_case(reqs), "0.31.0")
    assert not any(x.startswith("recv ") for x in new), new
    assert "sched R 64" in new, new
