"""The inline checks a vLLM-only repro file carries for an invariant finding
(:mod:`fuzz.vllm_repro`): what the release harness checks at each step of a real Scheduler
(``simsched/vllm/inside/``: INV-3 store keys, INV-6 writes under a pending store, INV-8 reloads
and stalls, INV-9 lookups, INV-10 caps), written out as lines of the file's step loop and
helpers. Each check is a function of the file's parts so far (:data:`CHECKS`, by the test's
short name) returning the parts it adds; :data:`MARKS` are the words its failure says, which
verification looks for.
"""

from __future__ import annotations

from simsched.case import Case
from simsched.model import STALL_STEPS

# What the harness bounds (engine.MAX_LOADS_UNSCHEDULED).
MAX_LOADS_UNSCHEDULED = 2


def _check_reloads(parts: dict) -> dict:
    """INV-8 on loads (``liveness.Liveness.check_reloads``): a request loaded again and again
    between two steps that schedule it."""
    return {"before_loop": parts["before_loop"]
            + "    loads_unscheduled = {}  # request -> its loads since it ran\n",
            "after_update": (
                "        for rid in output.req_ids:\n"
                "            loads_unscheduled.pop(rid, None)\n"
                "        for _, rid in done.values():\n"
                "            if rid is not None:\n"
                "                n = loads_unscheduled[rid] = loads_unscheduled.get(rid, 0) + 1\n"
                f"                if n > {MAX_LOADS_UNSCHEDULED}:\n"
                "                    raise AssertionError(f\"{rid} loaded {n} times, never "
                "scheduled\")\n")}


def _check_stall(parts: dict) -> dict:
    """INV-8 liveness (``liveness.Liveness.check``): no token scheduled for more than
    ``STALL_STEPS`` steps while no transfer is in flight and no request is still to come."""
    return {"before_loop": parts["before_loop"]
            + "    idle = 0  # steps scheduling nothing, no transfer in flight, none to come\n",
            "after_schedule": (
                "        to_come = [r for r in REQUESTS if r[2] > t"
                + (" and r[0] not in withdrawn" if parts["skip"] else "") + "]\n"
                "        busy = out.total_num_scheduled_tokens or pending or to_come\n"
                "        idle = 0 if busy else idle + 1\n"
                f"        assert idle <= {STALL_STEPS}, f\"{{list(sched.requests)}}: nothing "
                "scheduled, no transfer for {idle} steps\"\n")}


def _check_lookups(parts: dict) -> dict:
    """INV-9 (``hit_oracle.HitOracle._check``, ``invariants.expected_lookup_hit``): every
    lookup finds at least what the CPU tier holds ready."""
    return {"offload_import": "from vllm.v1.kv_offload.base import make_offload_key\n",
            "helpers": LOOKUP_HELPERS,
            "before_loop": "    watch_lookups(sched, hash_block_size)\n" + parts["before_loop"]}


def _check_caps(parts: dict, load: bool) -> dict:
    """INV-10 (``offload_worker.OffloadWorker._check_caps``,
    ``invariants.check_store_cap``/``check_load_cap``): a store job's keys end within its
    request's ``max_offload_tokens``; a load job's keys span at most its ``max_load_tokens``
    (the caps as the release parses ``kv_transfer_params``).
    The key of block hash i names the prompt's tokens [0, (i + 1) * hash_block_size)."""
    cap = "max_load_tokens" if load else "max_offload_tokens"
    span = "span" if load else "ends[-1]"
    check = (f"\n            cap = getattr(cs._req_status[job.req_id], {cap!r}, None)  # INV-10\n"
             "            index = {h: i for i, h in "
             "enumerate(sched.requests[job.req_id].block_hashes)}\n"
             "            ends = sorted((index[get_offload_block_hash(k)] + 1) * hash_block_size"
             "\n                          for k in cs._jobs[j].keys)\n"
             + ("            span = ends[-1] - ends[0] + min(s.block_size for s, _ in GROUPS)"
                " * BLOCKS_PER_CHUNK\n" if load else "")
             + f"            assert cap is None or {span} <= cap, f\"keys to {{ends}}, {cap} "
             "{cap}\"")
    parts = {"offload_import": "from vllm.v1.kv_offload.base import get_offload_block_hash\n",
             "before_loop": parts["before_loop"]
             + "    cs = sched.connector.connector_scheduler  # its jobs' keys, the caps parsed\n"}
    jobs = "loads" if load else "stores"
    return {**parts, "job_check": f"        for j, job in {jobs}.items():{check}\n"}


def _check_pairs(parts: dict) -> dict:
    """INV-3 (``invariants.check_store_job``): each key of a store job, the block hash of the
    prompt's tokens [0, (i + 1) * hash_block_size), names the end of the chunk it keys: its
    place c in its group's offload keys (``RequestOffloadState``), (c + 1) * block size * blocks
    per chunk tokens (the blocks per chunk as the release's config reads them, as the harness
    takes them)."""
    return {"offload_import": "from vllm.v1.kv_offload.base import get_offload_block_hash, "
                              "get_offload_group_idx\n",
            "before_loop": parts["before_loop"]
            + "    cs = sched.connector.connector_scheduler  # its jobs' keys, the requests' keys\n"
            "    bpc = getattr(cs.config, \"blocks_per_chunk\", None) or "
            "cs.config.block_size_factor  # (to 0.26)\n",
            "job_check": parts["job_check"] + (
                "        for j, job in stores.items():  # INV-3: a key ends where its chunk ends\n"
                "            state = cs._req_status[job.req_id]\n"
                "            index = {h: i for i, h in "
                "enumerate(sched.requests[job.req_id].block_hashes)}\n"
                "            for k in cs._jobs[j].keys:\n"
                "                g = get_offload_group_idx(k)\n"
                "                c = next(gs.offload_keys.index(k) for gs in state.group_states\n"
                "                         if k in gs.offload_keys)\n"
                "                end = (index[get_offload_block_hash(k)] + 1) * hash_block_size\n"
                "                want = (c + 1) * GROUPS[g][0].block_size * bpc  # as the release "
                "reads it\n"
                "                assert end == want, f\"g{g}: the key of tokens to {end} keys "
                "chunk {c} (to {want})\"\n")}


def _check_writes(parts: dict, case: Case) -> dict:
    """INV-6 (``model_runner.ModelRunner._forward``, ``shadow.write_computed``): no block a store
    job still reads (created at an earlier step, neither flushed nor reported done) is written
    by a step's forward: a request's blocks holding the tokens it computes, a ring group's
    first block at every step."""
    rings = {i for i, g in enumerate(case.layout.groups) if g.kind == "ring"}
    return {"helpers": parts["helpers"] + WRITES_HELPER.format(rings=rings or "set()"),
            "before_loop": parts["before_loop"]
            + "    reads = {}  # store job -> the GPU blocks it reads until done (a flushed one: "
            "first)\n",
            "job_check": parts["job_check"] + (
                "        hit = written_blocks(sched, out) & {b for j in reads if pending[j][0] > t"
                " for b in reads[j]}\n"
                "        assert not hit, f\"blocks {sorted(hit)} written while a store still "
                "reads them\"\n"
                "        reads.update({j: [int(b) for b in job.src_spec.block_ids] for j, job in "
                "stores.items()})\n"),
            "after_update": parts["after_update"]
            + "        for j in done:\n            reads.pop(j, None)\n"}


WRITES_HELPER = '''
RINGS = {rings}  # the ring groups: a circular buffer in its first block


def written_blocks(sched, out):
    """The GPU blocks a step's forward writes: each request's blocks holding the tokens it
    computes (schedule() has counted them), and a ring group's first block at every step."""
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    written = set()
    for rid, n in out.num_scheduled_tokens.items():
        end = sched.requests[rid].num_computed_tokens
        for g, ((spec, _), m) in enumerate(zip(GROUPS, managers)):
            table, bs = m.req_to_blocks.get(rid, []), spec.block_size
            span = table[:1] if g in RINGS else table[(end - n) // bs:-(-end // bs)]
            written |= {{b.block_id for b in span if not b.is_null}}
    return written
'''


LOOKUP_HELPERS = '''

def ready_beyond(sched, request, num_local, hash_block_size):
    """INV-9: the tokens past the GPU hit a lookup must find: up to the largest chunk end e at
    which every group holds ready (stored: the CPU manager's lookup is HIT) the chunks e needs
    (a sliding window W: those of [e - W + 1, e)), short of the last token (recomputed to
    sample) and within max_load_tokens where the release reads it."""
    cs = sched.connector.connector_scheduler
    state = cs._req_status[request.request_id]
    cap = request.num_tokens - 1
    if getattr(state, "max_load_tokens", None) is not None:
        cap = min(cap, num_local + state.max_load_tokens)

    def ready(g, spec, end):
        per_chunk, window = spec.block_size * BLOCKS_PER_CHUNK, getattr(spec, "sliding_window", 0)
        first = max(num_local, min(end - window + 1, end - 1)) if window else num_local
        hashes = [(c + 1) * per_chunk // hash_block_size - 1
                  for c in range(first // per_chunk, -(-end // per_chunk))]
        return all(h < len(request.block_hashes) and cs.manager.lookup(make_offload_key(
            request.block_hashes[h], g), state.req_context).name == "HIT" for h in hashes)
    unit = max(spec.block_size for spec, _ in GROUPS) * BLOCKS_PER_CHUNK
    ends = range(cap // unit * unit, num_local + unit - 1, -unit)
    return next((e - num_local for e in ends
                 if all(ready(g, spec, e) for g, (spec, _) in enumerate(GROUPS))), 0)


def watch_lookups(sched, hash_block_size):
    """Every lookup the connector answers, checked (a deferral, None, is not a miss)."""
    cs = sched.connector.connector_scheduler
    lookup = cs.get_num_new_matched_tokens

    def checked(request, num_computed_tokens, *args, **kwargs):
        out = lookup(request, num_computed_tokens, *args, **kwargs)
        got = out[0] if isinstance(out, tuple) else out
        want = ready_beyond(sched, request, num_computed_tokens, hash_block_size)
        assert got is None or got >= want, (
            f"{request.request_id}: the CPU tier holds {want} tokens ready beyond the GPU hit "
            f"of {num_computed_tokens}; the lookup found {got}")
        return out
    cs.get_num_new_matched_tokens = checked
'''


#: the words each inline check fails with (a failure without them is another failure)
MARKS = {"store_key_names_other_chunk": "keys chunk", "store_source_rewritten": "still reads",
         "livelock_load": "never scheduled", "stall": "nothing scheduled, no transfer",
         "lookup_misses_ready_prefix": "the lookup found", "cap_store": "max_offload_tokens",
         "cap_load": "max_load_tokens"}
CHECKS = {"livelock_load": lambda parts, case: _check_reloads(parts),
          "stall": lambda parts, case: _check_stall(parts),
          "lookup_misses_ready_prefix": lambda parts, case: _check_lookups(parts),
          "cap_store": lambda parts, case: _check_caps(parts, False),
          "cap_load": lambda parts, case: _check_caps(parts, True),
          "store_source_rewritten": _check_writes,
          "store_key_names_other_chunk": lambda parts, case: _check_pairs(parts)}
