"""Invariants of the offloading scheduler, each with an ID (see docs/invariants.md).

The model calls the ``check_*`` functions where each invariant can be decided (after every step,
at store read, at load completion, at admission); a failed check raises nothing: it returns an
:class:`InvariantViolation`, which the model records as a finding and stops on.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import chain, compress, repeat
from operator import is_, itemgetter
from typing import Any

from simsched.model.block_pool import NULL
from simsched.model.request import key_ident
from simsched.shadow import chunk_block

INVARIANTS = {
    "INV-1": "blocks conserved: free + held = pool",
    "INV-2": "no block held by two requests, except refcounted prefix-cache hits",
    "INV-3": "every store job pairs keys and source blocks one to one per group",
    "INV-4": "a stored chunk holds exactly the tokens its key names",
    "INV-5": "a load brings back exactly the tokens the request has at those positions",
    "INV-6": "no block reused while a transfer reads or writes it",
    "INV-6b": "no store issued over, and no forward run on, a block whose external write (a "
              "remote prefill pulled by another connector) has not landed",
    "INV-7": "a chunk is loaded only once its store completed",
    "INV-8": "every request finishes or is aborted (liveness once the tier is quiet)",
    "INV-9": "a fully stored, ready prefix is found by the next request sharing it",
    "INV-10": "nothing stored beyond a request's max_offload_tokens, nothing loaded beyond its "
              "max_load_tokens",
    "INV-T1": "a file a secondary tier writes for a key holds the bytes of the key's CPU slot "
              "(tiered offloading, when the cascade completes)",
    "INV-T2": "a CPU slot a promotion fills holds the bytes of its key's file (tiered "
              "offloading, when the read completes)",
}

#: the first bad operation of each invariant, one word (the campaign clusters findings by
#: invariant + op + group kinds); a deferral that never ends (INV-8 on a lookup) says "lookup"
INV_OPS = {
    "INV-1": "pool", "INV-2": "pool", "INV-3": "store", "INV-4": "store", "INV-5": "load",
    "INV-6": "write", "INV-6b": "unlanded", "INV-7": "load", "INV-8": "liveness", "INV-9": "lookup", "INV-10": "cap",
    "INV-T1": "cascade", "INV-T2": "promote",
}


class InvariantViolation(Exception):
    """An invariant broken at a step (a plain class: a dataclass exception does not compile)."""

    def __init__(self, inv_id: str, step: int, detail: str, op: str | None = None):
        self.inv_id, self.step, self.detail = inv_id, step, detail
        self.op = op if op is not None else INV_OPS.get(inv_id, "")

    def __repr__(self) -> str:
        return f"InvariantViolation(inv_id={self.inv_id!r}, step={self.step!r}, " \
            f"detail={self.detail!r})"

    def __str__(self) -> str:
        return f"{self.inv_id} at step {self.step}: {self.detail}"

    def to_json(self) -> dict:
        return {"kind": "invariant", "inv_id": self.inv_id, "step": self.step,
                "detail": self.detail, "what": INVARIANTS[self.inv_id]}

    def to_finding(self) -> dict:
        """:meth:`to_json` with ``op``, the first bad operation (the real run's findings)."""
        out = self.to_json()
        out["op"] = self.op
        return out


def check_pool(step: int, pool, reqs, pins: list[int] | None = None
               ) -> InvariantViolation | None:
    """INV-1 and INV-2 over the whole pool (O(blocks held)). ``pins``: the references a
    connector keeps on blocks itself (the SimpleCPUOffloadConnector's transfers), counted for
    INV-1; INV-2 is about the requests' tables alone."""
    # first-seen order, as the walk below reports it
    holders = Counter(chain.from_iterable([t for req in reqs for t in req.tables]))
    holders.pop(NULL, None)
    refs = holders
    if pins:
        refs = holders + Counter(pins)
    n_free = pool.get_num_free_blocks()
    if n_free + len(refs) != pool.num_blocks - 1:
        return InvariantViolation("INV-1", step, f"free {n_free} + held {len(refs)} != pool "
                                  f"{pool.num_blocks - 1}")
    ref, key = pool.ref, pool.key       # ref[b] == 0: b is in the free queue (BlockPool)
    if len(refs) > 1 and not pins:
        # the common case decided in C; any doubt falls through to the walk that names the block
        get = itemgetter(*holders)
        counts = tuple(holders.values())
        if get(ref) == counts and max(
                compress(counts, map(is_, get(key), repeat(None))), default=1) <= 1:
            return None
    for b, n in refs.items():
        free = ref[b] == 0
        if ref[b] != n:
            return InvariantViolation("INV-1", step, f"block {b}: refcount {ref[b]} but held "
                                      f"{n} times{' and free' if free else ''}")
        if holders.get(b, 0) > 1 and key[b] is None:
            return InvariantViolation("INV-2", step, f"block {b} held by {holders[b]} requests "
                                      "but not a prefix-cache block")
    return None


def check_goes_idle(step: int, steps_after_last: int, limit: int
                    ) -> InvariantViolation | None:
    """INV-8: the engine steps on ``steps_after_last`` steps after every request finished (and
    none is to come) while ``Scheduler.has_requests()`` counts the connector's pending work
    (``has_pending_push_work``); beyond ``limit`` it never goes idle."""
    if steps_after_last <= limit:
        return None
    return InvariantViolation("INV-8", step, f"every request finished {steps_after_last} steps "
                              "ago and the engine never went idle (Scheduler.has_requests() "
                              "stays true)")


#: a chunk promoted from an fs tier this many times for one request still waiting is INV-8
PROMOTION_ROUNDS = 2


def promotion_thrash(step: int, rid: str, rounds: int, cpu_chunks) -> InvariantViolation:
    """INV-8 on promotions: a waiting request whose prefix on the fs tier is longer than the CPU
    tier holds promotes its chunks round after round, each promotion evicting its own promoted
    chunks, and is never admitted."""
    return InvariantViolation(
        "INV-8", step,
        f"{rid}: a chunk of its prefix promoted from the fs tier {rounds} times while its "
        f"lookup keeps deferring: the prefix found on the fs tier is longer than the CPU tier "
        f"({cpu_chunks} chunks) holds, and each promotion evicts the request's own promoted "
        "chunks (TieringOffloadingManager._initiate_promotion -> prepare_write protects only "
        "the promoted key), so it is never admitted. A deployment gets here with "
        "cpu_bytes_to_use smaller than a prompt's prefix found in the fs tier's root_dir (a "
        "long prompt re-sent after a restart, or written by another instance sharing the "
        "directory)", "lookup")


def check_pool_fast(step: int, pool, num_held_entries: int) -> InvariantViolation | None:
    """INV-1 from counters only (the benchmark's cheap mode)."""
    if pool.get_num_free_blocks() + num_held_entries != pool.num_blocks - 1:
        return InvariantViolation("INV-1", step, "free + held != pool")
    return None


def check_store_job(step: int, job, geo) -> InvariantViolation | None:
    """INV-3: one key per chunk, each paired with its chunk's source blocks. ``job``: the
    model's :class:`~simsched.model.offloading_common.Job` or any job with ``items`` (the
    real-vLLM harness)."""
    per_group: dict[int, tuple[int, int]] = {}
    cfgs = {g.group_id: g for g in geo.groups}
    for gid, c, hidx, key, blocks in job.items:
        nk, nb = per_group.get(gid, (0, 0))
        per_group[gid] = (nk + 1, nb + (1 if blocks else 0))
        cfg = cfgs[gid]
        if (hidx + 1) * geo.tokens_per_hash != (c + 1) * cfg.tokens_per_chunk:
            return InvariantViolation("INV-3", step, f"job {job.jid} group {gid}: key of hash "
                                      f"{hidx} paired with chunk {c}")
    for gid, (nk, nb) in per_group.items():
        if nk != nb:
            return InvariantViolation("INV-3", step, f"job {job.jid} group {gid}: {nk} keys, "
                                      f"{nb} source chunks")
    return None


def check_stored_chunk(step: int, job, item, content, req, geo,
                       tpbs: dict | None = None) -> InvariantViolation | None:
    """INV-4: the chunk read for ``item`` holds the tokens its key names. ``content``: the
    chunk's, as :meth:`~simsched.shadow.Shadow.read` gives it (flat). ``tpbs``: tokens per
    block by group id, when the caller has them."""
    gid, c, hidx, key, blocks = item
    end = (hidx + 1) * geo.tokens_per_hash
    last = chunk_block(content, len(content) // 3 - 1) if content else None
    if last is None or last[1] != end or last[2] != key_ident(key) or last[0] != gid:
        return InvariantViolation("INV-4", step, f"job {job.jid} chunk g{gid}:{hidx} (tokens up "
                                  f"to {end}) holds {last}")
    tpb = tpbs[gid] if tpbs is not None else next(g.tokens_per_block for g in geo.groups
                                                  if g.group_id == gid)
    for j, (i, _) in enumerate(blocks[:len(content) // 3]):
        got = chunk_block(content, j)
        want = (gid, (i + 1) * tpb, req.ident_at((i + 1) * tpb))
        if got != want:
            return InvariantViolation("INV-4", step, f"job {job.jid} chunk g{gid}:{hidx} block "
                                      f"index {i} holds {got}, key names {want}")
    return None


def check_loaded(step: int, job, req, shadow, geo, tpbs: dict | None = None
                 ) -> InvariantViolation | None:
    """INV-5: after a load, its destination blocks hold the request's own tokens. ``tpbs``:
    tokens per block by group id, when the caller has them. ``job``: the model's
    :class:`~simsched.model.offloading_common.Job` or any job with ``items`` (the real-vLLM
    harness)."""
    if tpbs is None:
        tpbs = {g.group_id: g.tokens_per_block for g in geo.groups}
    for gid, c, hidx, key, blocks in job.items:
        for i, b in blocks:
            want = (gid, (i + 1) * tpbs[gid], req.ident_at((i + 1) * tpbs[gid]))
            got = shadow.content(b)
            if got != want:
                return InvariantViolation("INV-5", step, f"load {job.jid} g{gid}:{hidx} block "
                                          f"{b} (index {i}) holds {got}, want {want}")
    return None


def check_writes(step: int, written, pending_reads: dict, what: str) -> InvariantViolation | None:
    """INV-6: a block written now is not the source of a store that has not read it yet."""
    if pending_reads:
        for b in written:
            if b in pending_reads:
                return InvariantViolation("INV-6", step, f"block {b} written by {what} while "
                                          f"store job {min(pending_reads[b])} still reads it")
    return None


def check_unlanded(step: int, blocks, unlanded: dict, what: str) -> InvariantViolation | None:
    """INV-6b: ``what`` (a store job issued, a request's forward) uses none of ``blocks`` while
    an external write into it has not landed (``unlanded``: block -> its writer, e.g. ``NIXL
    recv of r3``). The KV there is not the request's yet: a store would keep whatever the block
    held before under the request's keys, a forward would attend to it."""
    if unlanded:
        for b in blocks:
            if b in unlanded:
                return InvariantViolation("INV-6b", step, f"{what} uses block {b} before "
                                          f"{unlanded[b]} has landed")
    return None


class ReadFences:
    """INV-6's fences as the model keeps them: per store job (job ID) the GPU blocks it has yet
    to read, and per block the number of such jobs holding it (``count``, one entry per block
    ID: a write is decided by one list lookup per block, no set per job). ``check`` gives the
    finding :func:`check_writes` (the fences kept per block, as the engine keeps them) gives for
    the same jobs."""

    __slots__ = ("jobs", "count")

    def __init__(self, num_blocks: int):
        self.jobs: dict[int, list] = {}
        self.count: list[int] = [0] * num_blocks

    def add(self, jid: int, bids: list[int]) -> None:
        """Job ``jid`` reads the blocks ``bids`` (replacing its earlier blocks, as a dict
        assignment would). The list is kept as given (not copied): the caller leaves it as it
        is while the job is fenced (the model gives a store job's ``bids``, complete by then)."""
        self.pop(jid)
        self.jobs[jid] = bids
        for b in bids:
            self.count[b] += 1

    def pop(self, jid: int, default: Any = None) -> Any:
        """Job ``jid`` has read its blocks (or never had any): its blocks, else ``default``."""
        blocks = self.jobs.pop(jid, None)
        if blocks is None:
            return default
        for b in blocks:
            self.count[b] -= 1
        return blocks

    def check(self, step: int, written: list, what: str, who: str
              ) -> InvariantViolation | None:
        """INV-6 for the blocks ``written`` by ``what who`` (e.g. ``request r3``): the first
        written block a pending job still reads, named with the lowest such job."""
        if not self.jobs:
            return None
        for b in written:
            if self.count[b]:
                jids = [j for j, s in self.jobs.items() if b in s]
                return InvariantViolation("INV-6", step, f"block {b} written by {what} {who} "
                                          f"while store job {min(jids)} still reads it")
        return None


def check_load_ready(step: int, tier, job) -> InvariantViolation | None:
    """INV-7: every chunk a load job reads is ready (its store completed) when the load is
    prepared (``Job.unready``; vLLM's ``prepare_load`` asserts it)."""
    if job.unready:
        x = job.unready[0]
        return InvariantViolation("INV-7", step, f"load of chunk g{job.gids[x]}:"
                                  f"{job.hidx[x]} whose store has not completed")
    return None


def expected_offload_hit(off, st) -> tuple[int, str | None]:
    """INV-9's oracle: tokens beyond the GPU hit that ready chunks cover for every group, and the
    named rule that excuses a shorter hit (None if none applies)."""
    req, tier = st.req, off.tier
    local = st.num_local
    cap = req.num_tokens - (1 if off.sw_groups else 0)
    if off.supports_max_load and st.max_load_tokens is not None:
        cap = min(cap, local + st.max_load_tokens)
    if off.mamba_align is not None and off.sw_groups:
        cap = cap // off.mamba_align * off.mamba_align
    best, unit = 0, 1
    for cfg, gs in zip(off.cfgs, st.groups):
        tpc = cfg.tokens_per_chunk
        cap = min(cap, len(gs.keys) * tpc)
        unit = unit * tpc // math.gcd(unit, tpc)
    T = cap // unit * unit
    # the largest T (a multiple of unit) whose chunks are all ready. Where a group's chunk c in
    # reach at T is not ready, it is in reach at every smaller T that still covers it (the
    # reach's start only grows with T): the search resumes at the largest T ending before it
    # (T only shrinks: per group, the chunks [v0, v1) known ready from an earlier T are not
    # looked up again)
    known = [(0, 0)] * len(st.groups)
    while T - local >= 1:
        for g, (cfg, gs) in enumerate(zip(off.cfgs, st.groups)):
            tpc, w = cfg.tokens_per_chunk, cfg.sliding_window_in_chunks
            if T % tpc:
                T -= unit
                break
            hi = T // tpc
            lo = local // tpc if w is None else max(local // tpc, hi - w)
            # an EAGLE drafter group pops its trailing chunk (volatile KV): it hits at T only
            # when the chunk after T is ready too (and exists)
            top = hi + 1 if cfg.drafter else hi
            keys = gs.keys
            if top > len(keys):
                c = len(keys)
            else:
                v0, v1 = known[g]
                c = (v0 if v0 < top <= v1 else top) - 1
                while c >= lo and tier.is_ready(keys[c]):
                    c -= 1                         # c: the last chunk in reach not ready
                known[g] = (c + 1, top)
            if c >= lo:
                T = ((c + 1 - (top - hi)) * tpc - 1) // unit * unit
                break
        else:
            best = T - local
            break
    if best and off.being_loaded:
        return best, "being-loaded"
    if 0 < best < max([cfg.tokens_per_chunk for cfg in off.cfgs], default=0):
        # _lookup_complete_chunks: "We can only load less than a chunk, so skip" (a GPU hit
        # that ends inside the last ready chunk leaves less than a chunk to load)
        return best, "less-than-a-chunk"
    return best, None


def check_hit(step: int, off, st, got: int | None) -> InvariantViolation | None:
    if got is None or st.req.skip_reading_prefix_cache:
        return None             # a request that skips reading the prefix cache expects no hit
    want, rule = expected_offload_hit(off, st)
    if got < want and rule is None:
        return InvariantViolation("INV-9", step, f"{st.req.rid}: ready chunks cover {want} tokens "
                                  f"beyond the GPU hit of {st.num_local}, lookup found {got}")
    return None


def check_store_cap(step: int, job, cap: int | None, tokens_per_hash: int
                    ) -> InvariantViolation | None:
    """INV-10 for a store job: every chunk it stores ends within the request's
    ``max_offload_tokens`` (``cap``; None: no cap, or a release without it). A chunk's key names
    the tokens ``[0, (hash index + 1) * tokens_per_hash)``, so that end is what it stores; a cap
    of 0 stores nothing."""
    if cap is None:
        return None
    for gid, c, hidx, key, blocks in job.items:
        end = (hidx + 1) * tokens_per_hash
        if end > cap:
            return InvariantViolation("INV-10", step, f"store {job.jid} g{gid}:{hidx} holds "
                                      f"tokens up to {end} beyond max_offload_tokens {cap}")
    return None


def check_load_cap(step: int, job, cap: int | None, tokens_per_hash: int, tpbs: dict
                   ) -> InvariantViolation | None:
    """INV-10 for a load job: the token positions its destination blocks receive span at most
    the request's ``max_load_tokens`` (``cap``; None: no cap, or a release without it). A block
    at index ``i`` of a group with ``tpbs[gid]`` tokens per block receives the positions
    ``[i * tpb, (i + 1) * tpb)`` up to the end its chunk's key names; the load starts past the
    GPU hit, so the span from its first position to its last bounds what it brings."""
    if cap is None:
        return None
    lo, hi = -1, 0
    for gid, c, hidx, key, blocks in job.items:
        end = (hidx + 1) * tokens_per_hash
        tpb = tpbs[gid]
        for i, _ in blocks:
            start = i * tpb
            if start < end:
                lo = start if lo < 0 else min(lo, start)
                hi = max(hi, min(end, start + tpb))
    if lo >= 0 and hi - lo > cap:
        return InvariantViolation("INV-10", step, f"load {job.jid} brings tokens {lo} to {hi} "
                                  f"({hi - lo}) beyond max_load_tokens {cap}")
    return None


def check_stored_tail(step: int, job, item, content, req, writer, tokens_per_hash: int,
                      exact: bool) -> InvariantViolation | None:
    """INV-4 for a partial-tail chunk (``_build_partial_tail_store_jobs``: one block per group,
    its key naming the tokens ``[0, e)`` with ``e`` inside the block). The block read holds the
    request's tokens up to ``e``: it is the item's group's, written up to ``e`` at least
    (exactly ``e`` when ``exact``: a Mamba state summarises one position), and what wrote it
    has the request's identity at ``e`` (the block's own identity when it is complete, else
    ``writer``'s: the identity tracker of the request whose forward last wrote it, None if
    unknown)."""
    gid, c, hidx, key, blocks = item
    end = (hidx + 1) * tokens_per_hash
    got = chunk_block(content, 0) if content else None
    want = key_ident(key)
    ok = got is not None and got[0] == gid and (got[1] == end if exact else got[1] >= end)
    if ok and got is not None:
        if got[2] is not None:
            ok = req.ident_at(got[1]) == got[2]
        else:
            ok = writer is not None and writer.ident_at(end) == want
    if ok:
        return None
    return InvariantViolation("INV-4", step, f"job {job.jid} partial tail g{gid}:{hidx} (tokens "
                              f"up to {end}) holds {got}")


# --- INV-9 on real runs: the hit a lookup must find, from the CPU tier's content alone ---------

class HitGroup:
    """One offloaded KV cache group as INV-9's real-run oracle sees a request: its chunk size,
    what a token attends to (``reach``: ``full``, ``window`` of ``span`` tokens, chunked
    ``local`` attention of ``span``-token attention chunks, recurrent ``state``), whether it is an
    EAGLE/MTP ``drafter`` group, and per complete chunk of the request whether the CPU tier holds
    it ready (its store's completion reported to the scheduler, not evicted since)."""

    __slots__ = ("tokens_per_chunk", "reach", "span", "ready", "drafter")

    def __init__(self, tokens_per_chunk: int, reach: str, ready: list[bool], span: int = 0,
                 drafter: bool = False):
        self.tokens_per_chunk, self.reach, self.span = tokens_per_chunk, reach, span
        self.ready, self.drafter = ready, drafter


def reach_chunks(g: HitGroup, num_local: int, end: int) -> tuple[int, int] | None:
    """The chunks ``[lo, hi)`` of ``g`` that a request resuming at token ``end`` must load, its
    GPU prefix hit holding ``[0, num_local)``; None when no stored chunk can resume it there."""
    tpc = g.tokens_per_chunk
    first = num_local                   # below the GPU hit the request's KV is on the GPU
    if g.reach == "window":
        # token `end` attends to [end - W + 1, end] (GroupOffloadConfig.
        # load_window_size_in_chunks: cdiv(W - 1 + right padding, tokens_per_chunk) chunks);
        # a hit ends at a stored chunk even where the window needs none before `end` (W = 1),
        # as vLLM's own GPU hit ends at a cached block (SlidingWindowManager.
        # find_longest_cache_hit matches on a cached block, however few the window needs)
        first = max(first, min(end - g.span + 1, end - 1))
    elif g.reach == "local":
        # chunked local attention reaches back to the start of its attention chunk only
        # (get_sliding_window_size_in_chunks: "Attention never reaches back past one chunk")
        first = max(first, end // g.span * g.span)
    elif g.reach == "state":
        # a recurrent group resumes from the one state at `end` ("Mamba depends on a single
        # state"), stored at chunk ends only in align mode (resolve_mamba_align_size)
        if end % tpc:
            return None
        first = max(first, end - 1)
    hi = -(-end // tpc)                 # the chunk holding token end - 1, loaded whole
    if g.drafter:
        # EAGLE-tail: a drafter group's trailing chunk is volatile; _lookup_complete_chunks
        # ("For eagle groups, query one extra chunk that will be popped") proves the hit with
        # the chunk after it
        hi += 1
    return (first // tpc, hi) if first < end else (hi, hi)


def _reach_ready(g: HitGroup, num_local: int, end: int) -> bool:
    span = reach_chunks(g, num_local, end)
    if span is None or span[1] > len(g.ready):
        return False
    return all(g.ready[span[0]:span[1]])


def _loads_some(g: HitGroup, num_local: int, end: int) -> bool:
    """Does a hit ending at ``end`` load a chunk of ``g``? (Where no group's reach needs one,
    nothing stored is served: chunked local attention at an attention-chunk boundary alone.)"""
    span = reach_chunks(g, num_local, end)
    return span is not None and span[0] < span[1]


def expected_lookup_hit(num_local: int, num_tokens: int, groups: list[HitGroup],
                        max_load: int | None = None, bound: int | None = None,
                        align: int = 1) -> int:
    """INV-9's oracle on real runs: the tokens beyond the GPU hit (``num_local``) that a lookup
    must find: up to the largest ``end`` at which every offloaded group's reach
    (:func:`reach_chunks`) is ready, under the rules by which vLLM intends to load less:

    * last-token: the request's last token is always recomputed, to sample the next one
      (Scheduler._update_waiting_for_remote_kv: "on a full prompt hit, we need to re-compute
      the last token"; _lookup_complete_chunks caps the hit at num_tokens - 1 with windows);
    * max-load-tokens: a request's ``kv_transfer_params["max_load_tokens"]``, in whole chunks
      (0.33.0 RequestOffloadState.__post_init__, _lookup_complete_chunks' round_down), passed
      only where the release reads it;
    * gpu-group-bound: a group the connector does not offload bounds the load to the prefix
      the GPU holds of it (OffloadingConnector._max_loadable_tokens: "nothing refills them
      beyond it"), passed only when such a group exists;
    * hit-alignment: a connector whose lookup is a KV cache coordinator's (SimpleCPU's CPU
      pool) ends a hit on a multiple of ``align`` tokens, its scheduler block (the least common
      multiple of the groups' block sizes: ``find_longest_cache_hit``'s ``alignment_tokens``);
    * less-than-a-chunk: a hit of less than a whole chunk past the GPU hit is not loaded
      (_lookup_complete_chunks: "We can only load less than a chunk, so skip.");
    * nothing-stored: INV-9 asks that what is stored be served, so a hit loads at least one
      ready chunk (a reach empty in every group serves nothing)."""
    cap = num_tokens - 1                                    # last-token
    whole = align                                           # hit-alignment
    if max_load is not None:                                # max-load-tokens
        cap = min(cap, num_local + max_load)
        whole = math.lcm(whole, max(g.tokens_per_chunk for g in groups) if groups else 1)
    if bound is not None:                                   # gpu-group-bound
        cap = min(cap, num_local + bound)
    ends = {cap} | {k * g.tokens_per_chunk for g in groups
                    for k in range(num_local // g.tokens_per_chunk + 1,
                                   cap // g.tokens_per_chunk + 1)}
    end = num_local
    for e in sorted(ends, reverse=True):
        if e > num_local and e % whole == 0 and all(_reach_ready(g, num_local, e)
                                                    for g in groups) \
                and any(_loads_some(g, num_local, e) for g in groups):
            end = e
            break
    hit = end - num_local
    if hit < max([g.tokens_per_chunk for g in groups], default=0):   # less-than-a-chunk
        return 0
    return hit


# --- INV-8 beside jobs that never complete (timing.jobs, latency null) ---------------------

def held_back(rid: str, running: bool, defers_on_hung: bool,
              hung: list[tuple[int, bool, str]], stores_pin: bool = False) -> str | None:
    """How jobs that never complete (``hung``: job ID, is a store, its request) hold request
    ``rid`` back, in vLLM's terms, or None: ``load``, its own load (it waits for remote KVs
    until ``finished_recving``, which never comes); ``lookup``, its last lookup deferred on one
    of them (``defers_on_hung``: the connector defers while the request has transfer jobs, and
    on a chunk whose store is in flight or that is being loaded); ``blocks``, it waits for
    admission while a load that never completes holds its request's GPU blocks (allocated
    before the load, freed only once it finishes, also when that request is aborted:
    ``delay_free_blocks``), or a store does where the connector pins the GPU blocks it reads
    until the store completes (``stores_pin``: SimpleCPU's ``touch``, 0.30.0+)."""
    if any(not is_store and owner == rid for _, is_store, owner in hung):
        return "load"
    if defers_on_hung:
        return "lookup"
    if not running and any(stores_pin or not is_store for _, is_store, _ in hung):
        return "blocks"
    return None


def check_hung_end(step: int, stall: int, hung: list[tuple[int, bool, str]],
                   held: list[tuple[str, str | None]]) -> InvariantViolation | None:
    """Nothing has moved for ``stall`` steps with only jobs that never complete in flight: the
    run may stop there when every unfinished request is held back by them (``held``: request,
    :func:`held_back`'s answer); one that is not is stuck for another reason (INV-8)."""
    free = [rid for rid, how in held if how is None]
    if not free:
        return None
    names = ", ".join(f"{'store' if is_store else 'load'} {jid}"
                      for jid, is_store, _ in sorted(hung))
    return InvariantViolation("INV-8", step, f"no progress for {stall} steps with only jobs "
                              f"that never complete in flight ({names}); stuck and not held "
                              f"back by them: {free[:5]}")
