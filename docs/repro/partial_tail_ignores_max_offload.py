"""vLLM alone (no simsched): _build_partial_tail_store_jobs and max_offload_tokens, 0.30.0
(and 0.32.0, 0.33.0).

    PYTHONPATH=~/.cache/simsched/releases/0.30.0 ~/.cache/simsched/base/bin/python \
        docs/repro/partial_tail_ignores_max_offload.py

The real OffloadingConnectorScheduler._build_partial_tail_store_jobs (and the real
RequestOffloadState.__post_init__ parsing kv_transfer_params) on a request of 48 prompt tokens,
groups full/32 + mamba/32(align), tokens_per_hash 16, whose KV cache manager hands over the
Mamba boundary state at 48 (a partial tail: 48 % 32 != 0). Only the connector's own state is
stubbed (config, CPU manager, events).
  max_offload_tokens=0  -> a store job keying both groups at 48 is built (0 read as "no cap":
                           `req_status.max_offload_tokens or req.num_prompt_tokens`), while
                           _calc_num_offloadable_tokens stores no chunk under the same cap
  max_offload_tokens=32 -> AssertionError (`assert boundary <= max_boundary`), where
                           _build_aligned_boundary_store_jobs skips such a boundary
  prompt 64, max_offload_tokens=0 -> the same store at 48: a boundary inside a block of a
                           longer prompt (0.32.0+ cut a 64-token prefill 32 + 16 + 16, and the
                           Mamba state at 48 is handed over; campaign cluster INV-10-cap-full)
"""
from types import SimpleNamespace as NS

import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as m


def run(cap, prompt=48):
    req = NS(request_id="a", num_prompt_tokens=prompt, num_tokens=49,
             kv_transfer_params={"max_offload_tokens": cap},
             block_hashes=[bytes([i]) * 32 for i in range(3)])
    gcfgs = (NS(group_idx=0, tokens_per_block=32, tokens_per_chunk=32, requires_cow_source=False),
             NS(group_idx=1, tokens_per_block=32, tokens_per_chunk=32, requires_cow_source=True))
    config = NS(kv_group_configs=gcfgs, supports_partial_tail=True, tokens_per_hash=16,
                offload_prompt_only=True, num_workers=1)
    ctx = NS(set_offload_key_position=lambda key, tokens: None)    # 0.32.0+ key positions
    st = m.RequestOffloadState(config=config, req=req, req_context=ctx, offloading_context=None)
    st.group_states[0].block_ids.extend([1, 3])          # the full group's table
    s = object.__new__(m.OffloadingConnectorScheduler)
    s.config, s._req_status, s._jobs, s._job_counter = config, {"a": st}, {}, 0
    s._partial_tail_block_size, s._cow_source_groups = 32, frozenset({1})
    s._block_id_to_pending_jobs = {}
    s._max_eagle_proof_margin, s._eagle_proof_margins = 0, {}   # 0.33.0: no EAGLE drafter
    s._events_tracker = NS(record_partial_store=lambda *a: None, record_store=lambda *a: None)
    s._connector_stats = NS(increase_counter=lambda *a: None)
    s.manager = NS(prepare_store=lambda keys, ctx: NS(keys_to_store=list(keys),
                                                      store_spec=None))
    out = NS(kv_connector_block_state=NS(boundary_state_offloads={"a": [(1, 5, 48)]}))
    print(f"prompt {prompt}, max_offload_tokens={cap}: parsed {st.max_offload_tokens}, chunk stores up to "
          f"{s._calc_num_offloadable_tokens(st, 48)} tokens")
    try:
        jobs = s._build_partial_tail_store_jobs(out)
        for jid, tj in jobs.items():
            print(f"  partial-tail store job {jid}: blocks {list(tj.src_spec.block_ids)}, "
                  f"keys of tokens up to 48 for {len(s._jobs[jid].keys)} groups")
    except AssertionError as e:
        import traceback
        print("  AssertionError at", [l.strip() for l in traceback.format_exc().splitlines() if "assert " in l][-1])


run(0)
run(32)
run(0, prompt=64)
