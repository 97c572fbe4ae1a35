"""Scheduler rules of the real vLLM the model mirrors, one test per rule, on the hand-made cases
of ``simsched.lockstep.HANDMADE``. Each expectation is derived from the rule as the vLLM source
states it (function named in each test), not from the model's output; each case also runs under
lockstep against real releases in tests/test_lockstep.py (test_agreement_on_rule_cases).
"""

from __future__ import annotations

import copy

from simsched.case import Case
from simsched.lockstep import HANDMADE
from simsched.model import run_case


def trace(name: str, profile: str = "prefix-cacheable-windows-in-config",
          dense: bool = False) -> list[str]:
    """The model's trace of a hand-made case; ``dense``: with ``retention_interval`` null (the
    flag's None: every block cached, as the rules below were read with), not the release's
    default."""
    case = copy.deepcopy(HANDMADE[name])
    if dense:
        case["layout"].setdefault("engine", {})["retention_interval"] = "dense"
    r = run_case(Case.from_json(case), profile)
    assert r.ok, r.findings
    return r.trace


def blocks_of(line: str) -> set[int]:
    """Block IDs named by an ``alloc`` or ``load`` line."""
    out = set()
    for part in line.split()[2:]:
        if "=" not in part:
            continue
        ids = part.split("=", 1)[1]
        out |= {int(x) for x in ids.split(",") if x != "-"}
    return out


def first(lines: list[str], prefix: str) -> int:
    return next(i for i, x in enumerate(lines) if x.startswith(prefix))


def test_abort_during_load_keeps_blocks_until_the_load_completes():
    """Scheduler.finish_requests: a request aborted in WAITING_FOR_REMOTE_KVS whose load has not
    reported finished_recving is freed with delay_free_blocks=True; its blocks go back to the
    pool in _update_from_kv_xfer_finished, when the load completes. So c, admitted between b's
    abort and the end of b's load, cannot be given b's load destination blocks."""
    t = trace("abort_load")
    load = first(t, "load ")
    assert t[load].split()[2] == "b"
    jid = t[load].split()[1]
    abort, admit_c = t.index("finish b aborted"), first(t, "alloc c ")
    done = t.index(f"done {jid} load")
    assert load < abort < admit_c < done          # the case exercises the window
    assert not blocks_of(t[load]) & blocks_of(t[admit_c]), (t[load], t[admit_c])


def test_admission_needs_blocks_for_the_whole_sequence():
    """KVCacheManager.allocate_slots(full_sequence_must_fit=True) from the waiting loop of
    Scheduler.schedule (SchedulerConfig.scheduler_reserve_full_isl, True by default in every
    release): a waiting request is admitted only when the blocks for its whole sequence are free,
    not just those of its first chunk. a (48-token prompt, 10 output tokens) holds 4 of the 7
    usable blocks from step 2 on; b needs cdiv(64, 16) = 4 blocks, 3 are free: b waits for a to
    finish, although its first chunk (31 tokens, budget 32) would fit in 2."""
    t = trace("full_seq")
    assert t.index("sched a 1") < first(t, "sched b ")                 # b waited with a running
    assert first(t, "sched b ") > t.index("finish a finished")


def test_load_admission_leaves_the_in_flight_reservations_free():
    """Scheduler.schedule, waiting loop: an async load is admitted with
    reserved_blocks = _inflight_prefill_reserved_blocks(), the blocks the in-flight prefills and
    loads still need for their whole sequence (_request_remaining_blocks); allocate_slots fails
    when the load's blocks exceed free - reserved. l1 loads 6 chunks and needs cdiv(196, 16) = 13
    blocks, so it reserves 7; with 15 - 6 = 9 free, l2's load (6 blocks; its whole sequence, 7
    blocks, fits) does not: l2 loads only once l1 has left the in-flight set and finished."""
    t = trace("reserve")
    l1 = next(i for i, x in enumerate(t) if x.startswith("load ") and x.split()[2] == "l1")
    l2 = next(i for i, x in enumerate(t) if x.startswith("load ") and x.split()[2] == "l2")
    assert len(blocks_of(t[l1])) == 6 and len(blocks_of(t[l2])) == 6
    assert l1 < t.index("sched l1 100") < t.index("finish l1 finished") < l2


def _queue_after_pass(profile: str) -> tuple[list[str], int]:
    """One waiting pass that skipped x (no lookup result), then y (load admitted), and stopped
    at z; w was never reached."""
    from simsched.model.request import WAITING, WAITING_FOR_LOAD
    from simsched.model import Model
    from simsched.profiles import PROFILES
    reqs = [{"id": r, "prompt": [[1, 32]]} for r in "xyzw"]
    m = Model(Case.from_json({"layout": HANDMADE["load"]["layout"], "requests": reqs}),
              PROFILES[profile])
    m.q.run_until(0)                                   # the arrivals (and the first step)
    m.waiting = [m.reqs[r] for r in "xyzw"]
    m.n_held = 0
    for r in "xyzw":
        m.reqs[r].status, m.reqs[r].num_computed = WAITING, 0
    m.reqs["y"].status = WAITING_FOR_LOAD
    m._requeue_skipped(2)
    return [r.rid for r in m.waiting], m.n_held


def test_skipped_requests_requeue_per_release():
    """Scheduler.schedule drains a first queue before ``waiting`` and puts the requests it skipped
    back at the front of their queue, in the order skipped (step_skipped_* then
    prepend_requests). Up to 0.30.0 every skipped request goes to ``skipped_waiting``
    (_select_waiting_queue_for_scheduling: skipped_waiting first); from 0.31.0 only those holding
    KV blocks (_holds_kv_blocks: loading or loaded) go to ``kv_holding_waiting``, drained first,
    and the others to the front of ``waiting``."""
    assert _queue_after_pass("every-group") == (["x", "y", "z", "w"], 2)          # 0.30.0
    assert _queue_after_pass("prefix-cacheable-windows-in-config") == (["y", "x", "z", "w"], 1)


def test_loaded_blocks_are_cached_only_when_the_waiting_loop_promotes_the_request():
    """Scheduler._update_waiting_for_remote_kv caches a request's loaded blocks when the waiting
    loop reaches it (_try_promote_blocked_waiting_request, 0.31.0+
    _handle_blocked_waiting_request), not when the load reports finished_recving. b's load
    completes, then b is aborted before the next step: finish_requests frees it at once (the
    load is done), and its loaded blocks carry no hash, so BlockPool.free_blocks puts them at the
    front of the free queue (KVCacheManager.free: tail first). c, admitted next, takes them,
    last block first."""
    t = trace("promote")
    load = first(t, "load ")
    assert t[load].split()[2] == "b"
    assert t.index(f"done {t[load].split()[1]} load") < t.index("finish b aborted") < \
        first(t, "alloc c ")
    dests = [int(p.split("=")[1]) for p in t[load].split()[3:]]
    c = [int(x) for x in t[first(t, "alloc c ")].split("=")[1].split(",")]
    assert c == dests[::-1], (t[load], c)


def test_window_block_leaving_with_the_last_token_is_freed_before_the_request():
    """Scheduler._connector_finished frees the blocks out of a window
    (kv_cache_manager.remove_skipped_blocks on the processed tokens) before the request's blocks
    are freed (KVCacheManager.free: group by group, each tail first; BlockPool.free_blocks puts
    unhashed blocks at the front of the free queue, hashed ones at its tail). a (48-token prompt,
    16 output tokens) finishes with 63 tokens computed: its window of 32 now skips 32 tokens, so
    its second window block s1 is freed first. Free queue afterwards: s3 f3 (unhashed: a's last,
    partial blocks) | the three blocks a never took (the pool holds one request of the longest
    length, as vLLM's start-up check asks) | s0 (freed during the decode) s1 f2 f1 f0 s2; b (64
    tokens, 4 blocks per group, full group first) takes it in that order."""
    t = trace("window_finish", dense=True)
    a = [x for x in t if x.startswith("alloc a ") and "g0=-" not in x]
    f = [int(b) for x in a for b in x.split()[2][3:].split(",")]
    s = [int(b) for x in a for b in x.split()[3][3:].split(",")]
    assert len(f) == len(s) == 4
    fresh = [b for b in range(1, 12) if b not in f + s]
    order = [s[3], f[3]] + fresh + [s[0], s[1], f[2], f[1], f[0], s[2]]
    b = t[first(t, "alloc b ")].split()
    assert b[2] == "g0=" + ",".join(map(str, order[:4]))
    assert b[3] == "g1=" + ",".join(map(str, order[4:8]))


def _tier_evicts(request_ranks: bool, finish_first: bool) -> list[int]:
    """Request a stores 4 chunks (positions 16..64 tokens), then request b stores 2 new chunks
    into a full 4-chunk tier: the indices of a's chunks evicted."""
    from types import SimpleNamespace as NS
    from simsched.model.request import make_key
    from simsched.model.cpu_manager import RankedCPUManager
    cfgs = [NS(group_id=0, tokens_per_chunk=16)]
    keys_a, keys_b = [make_key(0, i) for i in range(4)], [make_key(0, 10 + i) for i in range(2)]
    a = NS(req=NS(rid="a"), groups=[NS(keys=keys_a)])
    b = NS(req=NS(rid="b"), groups=[NS(keys=keys_b)])
    tier = RankedCPUManager(4, request_ranks, cfgs)
    assert tier.prepare_store(keys_a, a) == keys_a
    tier.complete_store(keys_a, [None] * len(keys_a))
    if finish_first:
        tier.on_request_finished(a)
    assert tier.prepare_store(keys_b, b) == keys_b
    return [i for i, k in enumerate(keys_a) if k not in tier.chunks]


def test_cpu_lru_ranks_from_0310():
    """vllm/v1/kv_offload/cpu/policies/lru.py, LRUCachePolicy from 0.31.0: eviction takes the
    evictable chunks of lowest rank. 0.31.0/0.32.0: insert() gives each new chunk the next rank,
    so a's head (inserted first) goes first. 0.33.0: insert() ranks a chunk
    (request rank, -position) ("tails precede heads"), so a's tail goes first. Either way
    on_request_finished() re-ranks the request's chunks reversed(head to tail), the head last
    (most recent): a's tail goes first."""
    assert _tier_evicts(False, False) == [0, 1]
    assert _tier_evicts(True, False) == [2, 3]
    assert _tier_evicts(False, True) == [2, 3]
    assert _tier_evicts(True, True) == [2, 3]


def segment_of(lines: list[str], wanted: str) -> list[str]:
    """The step segment (``step n`` up to the next ``step``) holding the line ``wanted``."""
    i = lines.index(wanted)
    start = max(j for j in range(i + 1) if lines[j].startswith("step "))
    end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("step ")), len(lines))
    return lines[start:end]


def _sync(name: str) -> list[str]:
    obj = dict(HANDMADE[name])
    obj["layout"] = {"groups": obj["layout"]["groups"],
                     "engine": dict(obj["layout"]["engine"], async_scheduling=False)}
    r = run_case(Case.from_json(obj))
    assert r.ok, r.findings
    return r.trace


def test_async_decode_is_scheduled_before_its_token_and_seen_one_step_later():
    """AsyncScheduler._update_after_schedule gives a request past its prefill one output
    placeholder; Scheduler.schedule then schedules it for num_tokens + placeholders -
    num_computed tokens before the token is known, and skips it once its last token is in flight
    (num_computed + 2 - placeholders >= num_prompt + max_tokens). EngineCore.step_with_batch_queue
    processes a batch's output after scheduling the next batch. So a (prompt 32, decode 3) is
    scheduled 32, 1, 1 tokens at steps 0-2 as without async scheduling, but its finish is seen in
    step 3, which schedules nothing; its store (latency 1, reported in the output of step 0) is
    seen in step 1, after step 1 is scheduled."""
    t = trace("async_decode")
    assert [x for x in t if x.startswith("sched ")] == ["sched a 32", "sched a 1", "sched a 1"]
    fin = segment_of(t, "finish a finished")
    assert fin[0] == "step 3" and not [x for x in fin if x.startswith("sched ")]
    assert segment_of(t, "done 0 store")[0] == "step 1"
    s = _sync("async_decode")       # the same case scheduled synchronously
    assert segment_of(s, "finish a finished")[0] == "step 2"
    assert segment_of(s, "done 0 store")[0] == "step 0"


def test_async_abort_defers_the_free_of_blocks_a_batch_in_flight_writes():
    """Scheduler.defer_block_free (more than one concurrent batch and a KV-consumer connector,
    the OffloadingConnector being kv_both): a request aborted while a batch that schedules it is
    in flight has its blocks put on deferred_frees (_free_request_blocks) and returned to the
    pool only when that batch's output is processed (_drain_deferred_frees), after the next
    schedule. So b, admitted in the step right after a's abort, gets none of a's blocks; without
    async scheduling a's blocks are free at once and b's first block is a's last (unhashed,
    prepended to the free queue)."""
    t = trace("async_abort")
    a = blocks_of(t[first(t, "alloc a ")])
    b = blocks_of(t[first(t, "alloc b ")])
    assert a and b and not a & b
    s = _sync("async_abort")
    assert blocks_of(s[first(s, "alloc a ")]) & blocks_of(s[first(s, "alloc b ")])


# --- speculative decoding -----------------------------------------------------------------------

def sched_counts(t: list[str], rid: str) -> list[int]:
    return [int(x.split()[2]) for x in t if x.startswith(f"sched {rid} ")]


def step_of(t: list[str], i: int) -> int:
    """The step number of trace line ``i``."""
    return int(next(t[j] for j in range(i, -1, -1) if t[j].startswith("step ")).split()[1])


def test_rejected_drafts_roll_back_num_computed_tokens():
    """Scheduler.schedule schedules num_tokens_with_spec - num_computed_tokens tokens (the drafts
    set by update_draft_token_ids after each step that sampled); update_from_output rolls
    num_computed_tokens back over the rejected drafts and appends the accepted ones plus one
    sampled token. a: prompt 40, max 9 output tokens, 2 n-gram drafts a step, accepting 0, 2,
    1, 0, 2 (the ``accept`` pattern cycled). Prefill: 40 computed, 1 output token. Then every
    step schedules 1 + 2 = 3 tokens; computed/output after each: 41/2, 44/5, 46/7, 47/8, and at
    the fifth decode step 2 accepted + 1 make 11 > 9: a finishes (step 5). Its blocks: 3 for
    the prompt's 40 slots; the fourth (slots 48..63) is needed first when computed 46 + 3
    scheduled = 49 slots (step 4), not at step 3 (44 + 3 = 47 slots)."""
    t = trace("spec_reject")
    assert sched_counts(t, "a") == [40, 3, 3, 3, 3, 3]
    new_block = [step_of(t, i) for i, x in enumerate(t)
                 if x.startswith("alloc a ") and x != "alloc a g0=-"]
    assert new_block == [0, 4]
    assert step_of(t, t.index("finish a finished")) == 5


def test_all_drafts_accepted_finish_sooner():
    """The same request accepting every draft (no ``accept``: all accepted) gains 3 tokens a
    step: output 1, 4, 7, 10 >= 9, so it finishes at step 3 instead of step 5."""
    case = dict(HANDMADE["spec_reject"])
    case["requests"] = [{k: v for k, v in case["requests"][0].items() if k != "accept"}]
    r = run_case(Case.from_json(case), "prefix-cacheable-windows-in-config")
    assert r.ok, r.findings
    assert sched_counts(r.trace, "a") == [40, 3, 3, 3]
    assert step_of(r.trace, r.trace.index("finish a finished")) == 3


def test_eagle_reserves_lookahead_slots():
    """VllmConfig.num_lookahead_tokens is num_speculative_tokens for EAGLE-style methods (0 for
    n-gram): allocate_slots(num_lookahead_tokens=...) from the running loop reserves slots for
    computed + scheduled + 2 tokens. Same request and acceptance as spec_reject: at step 3
    computed 44 + 3 + 2 = 49 slots need the fourth block, one step before n-gram needs it (and
    in both groups, target and drafter)."""
    t = trace("spec_lookahead")
    assert sched_counts(t, "a") == [40, 3, 3, 3, 3, 3]
    grown = [(step_of(t, i), x) for i, x in enumerate(t)
             if x.startswith("alloc a ") and x != "alloc a g0=- g1=-"]
    assert [s for s, _ in grown] == [0, 3]
    assert all(len(blocks_of(x)) == 2 for _, x in grown[1:])


def test_new_decode_request_is_padded_to_the_spec_size():
    """Scheduler.schedule, waiting loop: a request with one token to compute (b: 33-token prompt,
    a GPU prefix hit of 32 tokens from a's prompt blocks), admitted while a running request was
    scheduled in the step and no prefill is, is padded to 1 + num_spec_tokens tokens ("Pad new
    decode requests to uniform spec decoding size"); scheduled_spec_decode_tokens holds k -1s,
    which the worker rejects: b gets one output token from that step, so with 3 output tokens
    and every real draft accepted it needs one more step (not finishing at admission)."""
    t = trace("spec_pad")
    admit = first(t, "sched b ")
    assert t[admit] == "sched b 3"
    assert blocks_of(t[admit + 1]) >= {1, 2}          # the GPU prefix hit: a's prompt blocks
    assert sched_counts(t, "b") == [3, 3]
    assert step_of(t, t.index("finish b finished")) == step_of(t, admit) + 1


def test_eagle_drops_the_last_block_of_a_gpu_hit():
    """find_longest_cache_hit(drop_eagle_block=True) for EAGLE: the last matched block is dropped
    (the drafter needs the tokens before the generation point recomputed). b's prompt is a's
    48-token prompt, whose 3 blocks are cached. 0.30.0/0.31.0: the hit is capped at
    num_tokens - 1 = 47, 2 blocks match, one is dropped: 16 tokens; the connector's lookup from
    there finds chunks 1 and 2 ready, the drafter group pops its trailing chunk
    (_lookup_complete_chunks, is_eagle_group): one chunk (16 tokens) is loaded, 16 computed.
    0.32.0+ (HybridKVCacheCoordinator, eagle_proof_margin): an EAGLE group matches one block past
    the cap (3 blocks) before dropping one: a GPU hit of 32, nothing to load, 16 computed."""
    for profile, loads in (("every-group", 1), ("prefix-cacheable", 1),
                           ("prefix-cacheable-strict-unit", 0),
                           ("prefix-cacheable-windows-in-config", 0)):
        t = trace("spec_eagle_hit", profile)
        assert sched_counts(t, "b") == [16], profile
        load = [x for x in t if x.startswith("load ")]
        assert len(load) == loads, (profile, load)
        if loads:
            assert load[0].split()[2] == "b" and "g0:1=" in load[0] and "g0:2" not in load[0]


def test_mamba_align_state_is_stored_and_loaded_as_one_boundary_block():
    """Align-mode Mamba (OffloadingConnectorScheduler), 0.30.0: the Mamba group
    requires_cow_source, so _build_store_jobs skips it; MambaManager.cache_blocks hands each
    cached state block over (take_boundary_state_offloads) and _build_aligned_boundary_store_jobs,
    called before _build_store_jobs, makes one store job per boundary that ends a chunk within the
    offloadable tokens: a's state at 64 (hash index 3, the block at index 3) is job 0, a's four
    full-attention chunks job 1. f's state at 96 is its own job too. b's CPU hit of 64 tokens
    loads one Mamba key, the state at 64, into the one state block update_state_after_alloc finds
    (index 3). b's next chunk (_mamba_block_aligned_split, 0.30.0: the last cacheable position is
    84 - 84 % 16 = 80, inside (64, 84)) is 16 tokens, its state at index 4 = cdiv(80, 16) - 1."""
    t = trace("mamba_load", "every-group", dense=True)
    stores = [x for x in t if x.startswith("store ")]
    a0, a1 = stores[0].split(), stores[1].split()
    assert a0[:3] == ["store", "0", "a"] and len(a0) == 4 and a0[3].startswith("g1:3=")
    assert a1[:3] == ["store", "1", "a"] and all(p.startswith("g0:") for p in a1[3:])
    assert len(a1) == 3 + 4
    assert any(x.split()[2] == "f" and x.split()[3:] == [x.split()[3]]
               and x.split()[3].startswith("g1:5=") for x in stores)
    load = t[first(t, "load ")].split()
    assert load[2] == "b"
    g1 = [p for p in load[3:] if p.startswith("g1:")]
    assert len(g1) == 1 and g1[0].startswith("g1:3=")
    state = int(g1[0].split("=")[1])
    assert first(t, "sched b 16") < first(t, "sched b 4")
    alloc_b = t[first(t, "alloc b ")].split()
    g1_table = [int(x) for x in alloc_b[3].split("=")[1].split(",")]
    assert g1_table[:3] == [0, 0, 0] and g1_table[3] == state
    assert len(g1_table) == 5 and g1_table[4] != 0


def test_mamba_align_prefill_chunks_end_at_cacheable_block_boundaries():
    """Scheduler._mamba_block_aligned_split (cache_config.mamba_cache_mode "align"): a prefill
    chunk never runs past the last cacheable block boundary: 0.30.0 and 0.31.0 take
    num_tokens - num_tokens % block_size, 0.32.0+ get_mamba_prefill_checkpoint_position
    ((num_tokens - 1) // block_size * block_size, one token left to recompute). a's 64-token
    prompt: one chunk on 0.30.0 (64 is not inside (0, 64)), 48 + 16 on 0.33.0; b's 20 tokens
    after its 64-token hit: 16 + 4 on both (80 is inside (64, 84))."""
    old, new = (trace("mamba_load", "every-group", dense=True),
                trace("mamba_load", dense=True))
    assert [x for x in old if x.startswith("sched a ")][:1] == ["sched a 64"]
    assert [x for x in new if x.startswith("sched a ")][:2] == ["sched a 48", "sched a 16"]
    for t in (old, new):
        assert [x for x in t if x.startswith("sched b ")][:2] == ["sched b 16", "sched b 4"]


def test_async_window_blocks_are_freed_on_the_processed_tokens():
    """KVCacheManager.allocate_slots frees the blocks out of a window with remove_skipped_blocks
    on max(0, total_computed_tokens - request.num_in_flight_tokens) ("in-flight steps' attention
    windows still read blocks below the optimistic boundary"), while the blocks to add count every
    computed token. a (48-token prompt, window 32, 3 blocks per group) decodes at step 1: 49
    tokens need a fourth block in each group, and get_num_skipped_tokens(48) = 48 - 32 + 1 = 17
    puts a's first window block out of reach. Synchronously it is freed at step 1: a holds 7 of
    the 11 usable blocks and b (32 tokens, 2 blocks per group) fits in the 4 left at step 1. Under
    async scheduling the prefill's 48 tokens are still in flight at step 1 (processed 0): a holds
    8, b does not fit; at step 2 the prefill's output is processed (48 tokens, the first decode
    in flight), the block is freed and b is admitted."""
    t = trace("async_window")
    assert segment_of(t, "sched b 32")[0] == "step 2"
    s = _sync("async_window")
    assert segment_of(s, "sched b 32")[0] == "step 1"


def test_blocks_of_every_group_fence_pending_stores_from_0330():
    """0.33.0's OffloadingConnectorScheduler.update_state_after_alloc, called by the waiting loop
    of Scheduler.schedule for each admitted request, adds the request's blocks of every KV cache
    group (get_blocks: GPU hits and groups that are not offloaded included), with or without a
    load, to _current_batch_allocated_block_ids; build_connector_meta flushes the pending jobs of
    those blocks (_block_id_to_pending_jobs). Up to 0.32.0 it returns at once without a load, and
    _update_req_states counts only the offloaded groups' new blocks, so a ring group's block
    (not offloaded from 0.31.0) is never checked.

    a (32 tokens: full blocks 1, 2, ring block 3) finishes at step 0 with its store of blocks 1, 2
    pending (latency 6); request_finished registers them as its store's deferred fences. Its
    blocks are freed group by group, tail first: ring block 3 (no hash) to the front of the free
    queue, hashed 2 then 1 at its tail: 3 4 5 6 7 2 1. b (70 tokens: 5 full blocks, 1 ring block)
    takes 3-7 for its full group and 2 for its ring group. 0.33.0: store 0 is flushed in step 1;
    0.32.0: b's step writes block 2 while store 0 still reads it (INV-6, as the real 0.32.0
    does in lockstep)."""
    t = trace("ring_fence")
    step1 = segment_of(t, "sched b 70")
    assert "alloc b g0=3,4,5,6,7 g1=2" in step1 and "flush 0" in step1
    r = run_case(Case.from_json(HANDMADE["ring_fence"]), "prefix-cacheable-strict-unit")
    assert not r.ok and [f["inv_id"] for f in r.findings] == ["INV-6"]
    assert not [x for x in r.trace if x.startswith("flush")]


#: finding divergence-trace_end-e66b97: r2 is aborted at step 2, before it arrives at step 3; r0
#: keeps the engine busy past step 3 (decode 8), so a request that arrived would be scheduled
WITHDRAWN = {"layout": {"groups": [{"kind": "full", "block_size": 16}]},
             "requests": [{"id": "r0", "prompt": [[0, 64]], "decode": 8},
                          {"id": "r2", "prompt": [[0, 64]], "arrival": 3, "abort_at": 2}]}


def test_a_request_aborted_before_it_arrives_is_never_sent():
    """A request is aborted through Scheduler.finish_requests, which looks it up in
    ``self.requests`` and skips an ID it does not know: vLLM cannot abort a request it has not
    seen. ``abort_at < arrival`` therefore means the request is withdrawn before it is sent
    (RequestSpec.withdrawn): it never reaches the scheduler, and counts as aborted, not finished.
    With ``abort_at == arrival`` it arrives, then is aborted before that step is scheduled."""
    r = run_case(Case.from_json(WITHDRAWN))
    assert r.ok, r.findings
    assert not [x for x in r.trace if " r2 " in f"{x} "]
    assert r.counters["aborted"] == 1 and r.counters["finished"] == 1
    same = dict(WITHDRAWN, requests=[WITHDRAWN["requests"][0],
                                     dict(WITHDRAWN["requests"][1], abort_at=3)])
    r = run_case(Case.from_json(same))
    assert r.ok, r.findings
    assert "finish r2 aborted" in r.trace
    assert not [x for x in r.trace if x.startswith("sched r2")]


#: a campaign's case whose load asks the CPU tier for a chunk it evicted meanwhile: vLLM 0.28.0
#: and 0.29.0 crash in ``prepare_load`` (``assert chunk is not None``; under python -O, the
#: AttributeError of the next line), and the model under the profile that mirrors them
MISSING_CHUNK = {"layout": {"groups": [
    {"kind": "sliding_window_mla", "block_size": 12, "sliding_window": 1,
     "extra_retained_tokens": 15},
    {"kind": "sliding_window_mla", "block_size": 8, "sliding_window": 1,
     "extra_retained_tokens": 15}], "engine": {"num_gpu_blocks": 64, "cpu_chunks": 4}},
    "requests": [{"id": "r0", "prompt": [[1, 128]], "decode": 64},
                 {"id": "r1", "prompt": [[0, 64]], "arrival": 3, "decode": 16},
                 {"id": "r2", "prompt": [[1, 128]], "arrival": 3, "decode": 16},
                 {"id": "r3", "prompt": [[1, 128]], "arrival": 1, "decode": 64}],
    "timing": {"store_latency": 0, "load_latency": 0, "max_num_batched_tokens": 256,
               "max_num_seqs": 2},
    "asserts": False, "events": [{"step": 12, "do": "reset_prefix_cache"}]}


def test_a_load_of_a_chunk_the_tier_no_longer_holds_is_vllms_crash():
    """The model predicts vLLM's crash, not one of its own (it raised KeyError, a tool error of
    the campaign): AttributeError under python -O, AssertionError with asserts."""
    res = run_case(Case.from_json(MISSING_CHUNK), "every-group-no-clamp")
    assert [(f["exception"], f["function"]) for f in res.findings] == \
        [("AttributeError", "prepare_load")], res.trace[-3:]
    on = copy.deepcopy(MISSING_CHUNK)
    on["asserts"] = True
    res = run_case(Case.from_json(on), "every-group-no-clamp")
    assert res.findings and res.findings[0]["function"] == "prepare_load", res.trace[-3:]


def test_a_chunked_local_group_of_another_block_size_fails_the_first_lookup():
    """``ChunkedLocalAttentionManager.find_longest_cache_hit`` asserts that its block is the
    hit alignment ("KV cache groups with different block sizes are not compatible with chunked
    local attention now", 0.25.1-0.33.0): beside 16-token full attention (the scheduler block),
    8-token chunked local blocks fail the first request's GPU lookup; 16-token ones do not, nor
    does a request that skips reading the prefix cache (no lookup), nor a run without asserts."""
    def case(block: int, skip: bool = False, asserts: bool = True) -> Case:
        return Case.from_json({"layout": {"groups": [
            {"kind": "full", "block_size": 16},
            {"kind": "chunked_local", "block_size": block, "attention_chunk_size": 32}]},
            "requests": [{"id": "a", "prompt": [[0, 64]], "decode": 2,
                          "skip_reading_prefix_cache": skip}], "asserts": asserts})
    res = run_case(case(8), "prefix-cacheable")
    assert [(f["exception"], f["function"]) for f in res.findings] == \
        [("AssertionError", "find_longest_cache_hit")], res.trace
    assert run_case(case(16), "prefix-cacheable").findings == []
    assert run_case(case(8, skip=True), "prefix-cacheable").findings == []
    assert run_case(case(8, asserts=False), "prefix-cacheable").findings == []
