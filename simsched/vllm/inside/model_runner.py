"""The GPU worker's model runner as the harness plays it, on the content shadow.

* The forward pass writes the KV of the tokens each request has scheduled into its blocks
  (``Shadow.write_computed``): INV-6 when it writes a block a pending store has not read yet.
* One sampled token per request whose prefill is complete, ``simsched.case.sampled_token``
  (the model samples the same ids).
* Speculative decoding (sync scheduling): ``k`` drafts per request of an executed batch through
  ``Scheduler.update_draft_token_ids`` (as ``EngineCore.post_step``), the tokens that follow the
  request's known ones; a step that scheduled drafts accepts the first ones as the request's
  ``accept`` pattern says (``RequestSpec.accepted``; padding drafts ``-1`` never) and samples one
  token after them, so ``update_from_output`` rolls back over the rejected ones.
* Speculative decoding under async scheduling: the scheduler sees placeholder drafts only
  (``AsyncScheduler._update_after_schedule``, ``-1`` each) and the worker verifies its own, the
  tokens that follow the known ones, accepted as the pattern says. The scheduler schedules the
  next step before it learns the rejections, so its ``num_computed_tokens`` counts them; the
  worker writes the step's KV from its own count, the scheduler's minus the drafts it rejected
  in the previous batch (0.33.0 ``gpu_model_runner.py:1343-1367``, ``prev_num_draft_len``,
  applied by ``correct_spec_decode_token_counts`` :1515-1536; every release 0.25.1+).
* The ``ModelRunnerOutput`` of a batch, with the connector's output the driver builds.
"""

from __future__ import annotations

from simsched import invariants as inv
from simsched.case import sampled_token
from simsched.vllm.inside.pool_checks import block_tables


class ModelRunner:
    """``run``: the :class:`~simsched.vllm.inside.run.Run` (its engine, case, scheduler,
    requests, shadow and the crash wrapper of calls into vLLM); ``tails``,
    ``pending_reads``: the partial tails and the blocks pending stores have not read yet."""

    def __init__(self, run, tails, pending_reads: dict, num_spec: int):
        self.eng, self.case, self.sched = run.eng, run.case, run.sched
        self.requests, self.shadow, self.call = run.requests, run.shadow, run.call
        self.shadow_groups = run.shadow_groups
        self.tails, self.pending_reads, self.num_spec = tails, pending_reads, num_spec
        self.verified: dict[str, int] = {}       # rid -> verification steps so far
        engine = run.case.layout.engine
        # the worker's own drafts behind the scheduler's placeholders (see the module)
        self.worker_drafts = engine.async_scheduling and engine.speculative is not None
        # rid -> drafts rejected in the last executed batch, of the requests that had drafts
        # there (the worker's prev_num_draft_len > 0, corrected by the accepted count)
        self.rejected: dict[str, int] = {}
        # the requests that sampled in the last executed batch: the drafter proposed drafts
        # for them (a request the worker's persistent batch dropped verifies the placeholders)
        self.proposed: set[str] = set()

    def execute(self, step: int, out, scheduled: dict, before: dict) -> dict[str, list[int]]:
        """The forward pass of the batch (``before``: each request's computed tokens before
        the step) and the tokens sampled per request."""
        sampled: dict[str, list[int]] = {}
        spec_sched = dict(getattr(out, "scheduled_spec_decode_tokens", None) or {})
        # (a request not in this batch leaves the worker's persistent batch: no correction)
        rejected_before, self.rejected = self.rejected, {}
        proposed_before, self.proposed = self.proposed, set()
        for rid, n in scheduled.items():
            ident = self.requests.ident[rid]
            start = before.get(rid, 0) - rejected_before.get(rid, 0)
            ident.tables = block_tables(self.sched, rid)
            drafts = list(spec_sched.get(rid, ()))
            d = len(drafts)
            accepted: list[int] = []
            samples = start + n >= len(ident.tokens) + d
            if samples and d:
                own = self.worker_drafts and rid in proposed_before
                accepted = self._verify(rid, ident, drafts, own)
                if self.worker_drafts:
                    self.rejected[rid] = d - len(accepted)
            self._forward(step, rid, ident, start, n)
            # the worker samples when the batch reaches the end of the tokens it knows (under
            # async scheduling it knows the tokens the scheduler has not received yet)
            if samples:
                self.proposed.add(rid)
                pos = start + n - d + len(accepted)
                tok = sampled_token(self.case.seed, self.requests.index[rid], pos)
                sampled[rid] = accepted + [tok]
                if len(ident.tokens) < ident.max_tokens:
                    ident.append_tokens([tok])
            else:
                sampled[rid] = []
        return sampled

    def _verify(self, rid: str, ident, drafts: list, own: bool) -> list[int]:
        """Verification: the first accepted drafts are the request's next tokens (the worker
        proposed them so); the slots of rejected drafts hold KV of no token; padding drafts
        (-1, a new decode request padded to 1 + k tokens) never match. Under async scheduling
        (``own``) the drafts the scheduler sent are placeholders for the worker's own, where the
        drafter proposed some (the request sampled in the last executed batch); the others are
        verified as sent, and never match."""
        if (not own if self.worker_drafts else all(x == -1 for x in drafts)):
            a = 0
        else:
            k = self.verified.get(rid, 0)
            self.verified[rid] = k + 1
            a = self.requests.spec(rid).accepted(k, len(drafts))
        base = len(ident.tokens)
        accepted = [sampled_token(self.case.seed, self.requests.index[rid], base + j)
                    for j in range(a)]
        ident.append_tokens(accepted[:max(0, ident.max_tokens - base)])
        return accepted

    def _forward(self, step: int, rid: str, ident, start: int, n: int) -> None:
        """The KV of positions ``start`` to ``start + n`` written; INV-6 on the blocks a pending
        store has not read (a partial tail's appending request aside)."""
        written = self.shadow.write_computed(ident, self.shadow_groups, start, start + n)
        self.tails.note_writers(rid, written, self.shadow.idents)
        pr = self.pending_reads
        if pr:
            own = [b for b in written if self.tails.appending.get(b) != rid]
            v = inv.check_writes(step, own, pr, f"request {rid}")
            if v is not None:
                raise v

    def output(self, order: list[str], sampled: dict, kv_connector_output):
        """The ``ModelRunnerOutput`` of a batch: the requests in batch order, their sampled
        tokens, the connector's output."""
        eng = self.eng
        return eng.ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=[sampled[r] for r in order], kv_connector_output=kv_connector_output,
            **({"logprobs": None} if "logprobs" in eng.mro_params else {}))

    def propose_drafts(self, out, order: list[str]) -> None:
        """The drafter after an executed step (``EngineCore.post_step``): ``k`` drafts for every
        request of the batch, the tokens that follow the request's known ones (whether the
        worker accepts them is the case's ``accept`` pattern); ``k`` is the scheduler's
        ``num_spec_tokens_to_schedule`` where it has one, none when it says ``skip_drafts``. The
        scheduler drops drafts of requests that are finished or in a prefill chunk."""
        if not (self.num_spec and order and self.eng.DraftTokenIds is not None):
            return
        k = getattr(out, "num_spec_tokens_to_schedule", None)
        k = self.num_spec if k is None else int(k)
        if getattr(out, "skip_drafts", False):
            k = 0
        seed = self.case.seed
        drafts = []
        for rid in order:
            base = self.requests.reqs[rid].num_tokens
            drafts.append([sampled_token(seed, self.requests.index[rid], base + j)
                           for j in range(k)])
        self.call("update_draft_token_ids", self.sched.update_draft_token_ids,
                  self.eng.DraftTokenIds(list(order), drafts))
