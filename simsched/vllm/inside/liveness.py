"""INV-8 on the real run: every request finishes. A stall (nothing scheduled, no transfer in
flight, no request still to come) for more than ``STALL_STEPS`` steps, a request loaded again
and again without running, the step cap; and where only jobs that never complete are in flight
(``timing.jobs``, latency null) the run stops cleanly, naming what holds each request back."""

from __future__ import annotations

from simsched import invariants as inv
from simsched.model.scheduler import MAX_STEPS_AFTER_LAST, STALL_STEPS
from simsched.trace import fmt_hung_end
from simsched.vllm.inside.stops import Ended

#: loads a request may complete without a token of it being scheduled in between: a waiting
#: request is loaded once per admission (a preempted one again after it ran); a third load in
#: a row means its loaded tokens are dropped and it is looked up afresh at every step
#: (INV-8, op ``load``: the one-token-prompt livelock of block size 1, found at the step cap
#: before, 20,000 steps)
MAX_LOADS_UNSCHEDULED = 2

class Liveness:
    """``requests``, ``worker``, ``oracle``, ``driver``: the run's
    :class:`~simsched.vllm.inside.case_requests.CaseRequests`,
    :class:`~simsched.vllm.inside.offload_worker.OffloadWorker`,
    :class:`~simsched.vllm.inside.hit_oracle.HitOracle` and connector driver; ``running``:
    the release's ``RequestStatus.RUNNING``."""

    def __init__(self, requests, worker, oracle, driver, running, step_cap: int):
        self.requests, self.worker, self.oracle = requests, worker, oracle
        self.driver = driver
        self.running, self.step_cap = running, step_cap
        self.stall = 0                                # steps without progress
        self.after_last = 0                           # steps since every request finished
        self.loads_unscheduled: dict[str, int] = {}  # rid -> loads since it last ran

    def check_reloads(self, step: int, order: list[str], done: list) -> None:
        """INV-8 on loads: a request loaded again and again without ever running. A completed
        load counts as progress for the stall check, so without this a request whose loaded
        tokens are dropped (``_update_waiting_for_remote_kv`` sets ``num_computed_tokens`` to
        ``num_tokens - 1``, 0 for a one-token prompt, and the next ``schedule()`` takes it for
        a new request) keeps the run going until the step cap."""
        for rid in order:
            self.loads_unscheduled.pop(rid, None)
        for job in done:
            if job.is_store:
                continue
            n = self.loads_unscheduled[job.rid] = self.loads_unscheduled.get(job.rid, 0) + 1
            if n > MAX_LOADS_UNSCHEDULED:
                raise inv.InvariantViolation(
                    "INV-8", step, f"{job.rid}: loaded {n} times without being "
                    f"scheduled in between", op="load")

    def check(self, step: int, steps: int, progress: bool, future: bool,
              unfinished: int) -> None:
        """After a step (``steps`` of them so far): ``progress``, a token scheduled or a job
        reported; ``future``, a request still to arrive or be aborted."""
        if progress or self.worker.live() or self.driver.tier_io_live() or future:
            self.stall = 0
        else:
            self.stall += 1
            if self.stall > STALL_STEPS and self.worker.hung():
                self._end_hung(step)
            if self.stall > STALL_STEPS:
                stuck = self.requests.unfinished()[:5]
                raise inv.InvariantViolation("INV-8", step, f"no progress for "
                                             f"{self.stall} steps with the tier quiet; "
                                             f"stuck: {stuck}")
        # the engine steps while Scheduler.has_requests(), which counts the connector's pending
        # work (has_pending_push_work): a step that makes more of it every time never idles
        self.after_last = self.after_last + 1 if unfinished <= 0 and not future else 0
        v = inv.check_goes_idle(step, self.after_last, MAX_STEPS_AFTER_LAST)
        if v is not None:
            raise v
        if steps >= self.step_cap:
            raise inv.InvariantViolation("INV-8", step, f"{unfinished} requests "
                                         f"unfinished after {self.step_cap} steps")

    def _end_hung(self, step: int) -> None:
        """Nothing has moved for ``STALL_STEPS`` steps and only jobs that never complete are in
        flight (the release's engine would step on forever: ``Scheduler.has_requests`` holds
        while the connector has jobs, ``has_pending_push_work``). The run stops with
        ``end waiting on ...`` when every unfinished request is held back by them
        (``inv.held_back``); one that is not is stuck for another reason (INV-8)."""
        hung = [(j.jid, j.is_store, j.rid) for j in self.worker.hung()]
        reqs = self.requests.reqs
        # the connector's own GPU pins, with only these jobs in flight: theirs
        pins = bool(self.driver.held_blocks())
        held = [(rid, inv.held_back(rid, reqs[rid].status == self.running,
                                    self.oracle.waits_on_hung(rid), hung, pins))
                for rid in self.requests.unfinished()]
        v = inv.check_hung_end(step, self.stall, hung, held)
        if v is not None:
            raise v
        raise Ended(fmt_hung_end([(jid, is_store) for jid, is_store, _ in hung], held))
