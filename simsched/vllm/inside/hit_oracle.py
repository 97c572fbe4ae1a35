"""INV-9 and the liveness of deferred lookups, on every lookup the connector answers.

At every ``get_num_new_matched_tokens`` (observed on the run's own connector, its answer checked
once given) the hit is held against one computed from the CPU tier's content alone
(``inv.expected_lookup_hit``): a request's chunks are ready when the scheduler was told their
store completed and the tier still holds them. A lookup that defers ("ask me again later") is
INV-8 when it outlasts every transfer it could wait for. A finding (or an error of the harness)
is kept and raised once ``schedule()`` returns (:meth:`HitOracle.raise_kept`), never inside
it."""

from __future__ import annotations

from simsched import invariants as inv
from simsched.model.request import make_key

#: steps beyond the case's longest transfer latency that a lookup may keep deferring, counted
#: from the last completion it could be waiting for (see ``HitOracle._deferral``): a job created
#: at ``t`` is reported before the step at ``t + latency``, one step later under async
#: scheduling (the batch queue), and a chunk stored in the step of the lookup is pending one
#: step more
DEFER_MARGIN = 2

#: what a token of each layout kind attends to, for INV-9's oracle (``inv.reach_chunks``);
#: kinds not named are taken as full attention (every chunk: the least the oracle can demand)
_REACH = {"sliding_window": "window", "sliding_window_mla": "window",
          "chunked_local": "local", "mamba": "state"}


class HitOracle:
    """What the scheduler has been told of the CPU tier, and the lookups it answered.

    ``requests``: :class:`~simsched.vllm.inside.case_requests.CaseRequests`; ``driver``: the
    connector's (its offloaded groups, what its tier holds); ``hung()``: the jobs in flight
    that never complete; ``clock()``: the step being scheduled; ``counts``: how many lookups
    were checked, how many the tier's ready chunks gave a hit, how many deferred."""

    def __init__(self, case, requests, driver, hung, clock, counts: dict):
        self.case, self.requests, self.driver = case, requests, driver
        self.hung, self.clock, self.counts = hung, clock, counts
        self.tph = driver.tph
        self.drafters = driver.drafter_groups(case)
        # a layout group the connector does not offload bounds every load (gpu-group-bound)
        self.gpu_only_groups = len(driver.groups) < len(case.layout.groups)
        self.defer_bound = max([case.timing.store_latency, case.timing.load_latency]
                               + [j.latency for j in case.timing.jobs
                                  if j.latency is not None]) + DEFER_MARGIN \
            + driver.lookup_defer_steps
        self.reported: set = set()       # content keys whose store completion it was told
        self.key_done: dict = {}         # content key -> step of its last reported transfer
        self.req_done: dict[str, int] = {}   # rid -> step of its own last reported transfer
        self.deferred: dict[str, list[int]] = {}     # rid -> steps its lookup deferred
        self.finding: inv.InvariantViolation | None = None
        self.error: BaseException | None = None

    def observe(self, request, num_computed_tokens, out, bound) -> None:
        """The connector answered ``out``: checked, the first finding or error kept."""
        if self.finding is None and self.error is None:
            try:
                self._check(request, int(num_computed_tokens), out, bound)
            except inv.InvariantViolation as v:
                self.finding = v
            except Exception as e:   # noqa: BLE001 - the harness's own failure, not vLLM's
                self.error = e

    def raise_kept(self) -> None:
        if self.error is not None:
            raise self.error
        if self.finding is not None:
            raise self.finding

    def told(self, done: list, step: int) -> None:
        """The scheduler was told these jobs completed at ``step``: what the oracle may count
        on."""
        for job in done:
            self.req_done[job.rid] = step
            for item in job.items:
                self.key_done[item[3]] = step
                if job.is_store:
                    self.reported.add(item[3])

    # -- INV-9 -----------------------------------------------------------------------------
    def _check(self, request, num_local: int, out, bound) -> None:
        """INV-9: a lookup finds at least the hit the CPU tier's ready chunks give
        (``inv.expected_lookup_hit``); a deferred one (``None``) goes to :meth:`_deferral`."""
        got = out[0] if isinstance(out, tuple) else out
        rid = request.request_id
        spec = self.requests.spec(rid)
        groups = self._hit_groups(request)
        # max-load-tokens: only where the release reads it (RequestOffloadState.max_load_tokens)
        max_load = spec.max_load_tokens if self.driver.reads_load_cap(rid) else None
        want = inv.expected_lookup_hit(num_local, int(request.num_tokens), groups, max_load,
                                       bound if self.gpu_only_groups else None,
                                       self.driver.hit_alignment)
        if getattr(request, "skip_reading_prefix_cache", False):
            want = 0        # get_num_new_matched_tokens: such a request reads no prefix
        counts = self.counts
        counts["checked"] += 1
        counts["expected_hit"] += want > 0
        counts["deferred"] += got is None
        if got is None:
            self._deferral(rid, want, num_local)
            return
        self.deferred.pop(rid, None)
        if got < want:
            raise inv.InvariantViolation(
                "INV-9", self.clock(), f"{rid}: ready chunks cover {want} tokens beyond the "
                f"GPU hit of {num_local}, lookup found {got}", "lookup")

    def _hit_groups(self, request) -> list:
        """Per offloaded group, the request's complete chunks as INV-9's oracle sees them: ready
        when the scheduler was told their store completed and the CPU tier still holds them."""
        rid = request.request_id
        ident = self.requests.ident[rid]
        hashes = request.block_hashes
        known = min(len(hashes) * self.tph, len(ident.tokens))
        groups = []
        for g in self.driver.groups:
            lg = self.case.layout.groups[g.group_id]
            tpc = g.tokens_per_chunk
            ready = []
            for c in range(known // tpc):
                key = make_key(g.group_id, ident.ident_at((c + 1) * tpc))
                ready.append(key in self.reported and self.driver.tier_holds(
                    request, hashes[(c + 1) * tpc // self.tph - 1], g.group_id))
            reach = _REACH.get(lg.kind, "full")
            span = lg.sliding_window if reach == "window" else (
                lg.attention_chunk_size if reach == "local" else 0)
            groups.append(inv.HitGroup(tpc, reach, ready, span or 0,
                                       g.group_id in self.drafters))
        return groups

    # -- deferrals (INV-8) -----------------------------------------------------------------
    def _chunk_keys(self, rid: str):
        """The keys of the request's complete chunks, group by group."""
        ident = self.requests.ident[rid]
        for g in self.driver.groups:
            tpc = g.tokens_per_chunk
            for c in range(len(ident.tokens) // tpc):
                yield make_key(g.group_id, ident.ident_at((c + 1) * tpc))

    def _deferral(self, rid: str, want: int, num_local: int) -> None:
        """INV-8 on a lookup: a deferral waits for a transfer in flight (the request's own, or
        a store or load of one of its chunks: HIT_PENDING, ``_chunks_being_loaded``), and each
        such transfer is reported within the case's latency. Counted per step since the last
        completion the request could be waiting for, a deferral that outlasts ``defer_bound``
        steps while its ready chunks give a hit is a finding."""
        step = self.clock()
        since = self.req_done.get(rid, -1)
        for key in self._chunk_keys(rid):
            since = max(since, self.key_done.get(key, -1))
        steps = [s for s in self.deferred.get(rid, ()) if s > since and s != step]
        steps.append(step)
        self.deferred[rid] = steps
        if len(steps) > self.defer_bound and want > 0 and not self.defers_on_hung(rid):
            raise inv.InvariantViolation(
                "INV-8", step, f"{rid}: lookup deferred {len(steps)} steps (bound "
                f"{self.defer_bound}) while ready chunks cover {want} tokens beyond the GPU hit "
                f"of {num_local}", "lookup")

    def defers_on_hung(self, rid: str) -> bool:
        """A deferred lookup of ``rid`` waits on a job that never completes: one of its own
        (``get_num_new_matched_tokens`` defers while the request has transfer jobs), or one
        holding a chunk of its prompt (a store's chunk is HIT_PENDING in the CPU tier until it
        completes, ``_maximal_prefix_lookup`` / ``_sliding_window_lookup`` defer on it; a
        load's is in ``_chunks_being_loaded``)."""
        hung = self.hung()
        if not hung:
            return False
        if any(j.rid == rid for j in hung):
            return True
        keys = {item[3] for j in hung for item in j.items}
        return any(key in keys for key in self._chunk_keys(rid))

    def waits_on_hung(self, rid: str) -> bool:
        """``rid``'s lookup deferred, on a job that never completes."""
        return rid in self.deferred and self.defers_on_hung(rid)
