"""KV that another connector's worker writes into GPU blocks, as the harness plays it: on a P/D
decode instance (``MultiConnector`` of the ``OffloadingConnector`` and ``NixlConnector``) the
NIXL worker pulls a remote prefill's KV into the blocks the scheduler allocated for it.

The pull starts with the step whose connector metadata names it (the driver's
``external_writes``: NIXL's ``reqs_to_recv``, read in ``start_load_kv``), and lands at the end
of the step its due time says (``RequestSpec.remote_prefill`` steps after its admission), in
the worker's ``get_transfer_results``, after the step's forward and after the stores that
complete in that step have read their blocks; that step's output reports the request in
``finished_recving``. Landing writes the request's own prompt tokens into the blocks (the KV
the prefill instance computed for them), on the content shadow.

Checked here: INV-6b (:func:`simsched.invariants.check_unlanded`), no store job issued over,
and no forward run on, a block whose pull has not landed; INV-6 when the pull lands in a block
a pending store has not read yet (:func:`simsched.invariants.check_writes`). INV-4 then judges
what a store of such a block reads: the remote prefill's KV of the request's tokens."""

from __future__ import annotations

from simsched import invariants as inv
from simsched.trace import fmt_recv
from simsched.vllm.inside.pool_checks import block_tables


class ExternalKV:
    """``run``: the :class:`~simsched.vllm.inside.run.Run` (scheduler, requests, shadow);
    ``pending_reads``: the blocks pending stores have not read yet (INV-6)."""

    def __init__(self, run, driver, pending_reads: dict):
        self.sched, self.requests, self.shadow = run.sched, run.requests, run.shadow
        self.shadow_groups = run.shadow_groups
        self.driver, self.pending_reads = driver, pending_reads
        self.inflight: list = []                 # ExternalWrite, not landed
        self.unlanded: dict[int, str] = {}       # block -> the write not landed in it

    def live(self) -> bool:
        return bool(self.inflight)

    def started(self, out, t: int, emit) -> None:
        """The writes the step's metadata starts (``start_load_kv``)."""
        for w in self.driver.external_writes(out, t):
            self.inflight.append(w)
            for blocks in w.blocks:
                for b in blocks:
                    self.unlanded[b] = w.who
            emit(fmt_recv(w.rid, w.blocks))

    def check_stores(self, step: int, stores: list) -> None:
        """INV-6b on the step's new store jobs: none reads a block not landed yet."""
        for job in stores:
            blocks = [b for item in job.items for _, b in item[4]]
            v = inv.check_unlanded(step, blocks, self.unlanded, f"store {job.jid} of {job.rid}")
            if v is not None:
                raise v

    def check_forward(self, step: int, scheduled) -> None:
        """INV-6b on the forward: no scheduled request attends to a block not landed yet."""
        if not self.unlanded:
            return
        for rid in scheduled:
            blocks = [b for table in block_tables(self.sched, rid) for b in table]
            v = inv.check_unlanded(step, blocks, self.unlanded, f"the forward of {rid}")
            if v is not None:
                raise v

    def land_due(self, step: int, t: int, emit) -> set[str]:
        """The writes the output of the step at ``t`` reports (due before ``t + 1``), landed:
        their requests, for ``finished_recving``."""
        landed = set()
        for w in [w for w in self.inflight if w.due <= t + 1]:
            self.inflight.remove(w)
            written = self._write(w)
            for b in written:
                self.unlanded.pop(b, None)
            v = inv.check_writes(step, written, self.pending_reads, w.who)
            if v is not None:
                raise v
            emit(f"landed {w.rid}")
            landed.add(w.rid)
        return landed

    def _write(self, w) -> list[int]:
        """The request's prompt KV into the named blocks (:meth:`Shadow.write_landed`), as the
        forward would have written them."""
        return self.shadow.write_landed(
            self.requests.ident[w.rid], int(self.requests.reqs[w.rid].num_prompt_tokens),
            block_tables(self.sched, w.rid), self.shadow_groups, w.blocks)
