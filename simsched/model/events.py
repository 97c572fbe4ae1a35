"""The event core: a SimPy-style queue ordered by ``(time, priority, sequence)``.

Time is in scheduler steps. ``priority`` orders events of the same time (transfer completions
reported by the worker are processed before the next scheduler step, as vLLM feeds
``update_connector_output`` before the next ``schedule()``); ``sequence`` is a per-queue counter
so equal (time, priority) events keep their insertion order. ``run()``, ``step()`` and
``run_until(t)`` share one loop (:meth:`EventQueue._loop`).
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import Any, Callable, Final

# Event kinds; the value is also the default priority (lower runs first at equal time).
STORE_DONE: Final = 0
LOAD_DONE: Final = 1
ARRIVAL: Final = 2
ABORT: Final = 3
STEP: Final = 4
FINISH: Final = 5
PREEMPT: Final = 6
# a case event (Case.events): after the arrivals and aborts of its time, before the step
CASE_EVENT: Final = 7
# a faulted job (Case.faults): scheduled with priority REPORTED - 1, before the other
# completions of its report, which the worker never makes (it raises first)
TRANSFER_FAILED: Final = 8
# another connector's pull landed (a P/D request's NIXL recv, finished_recving): scheduled with
# the priority of a load's completion, after the stores that complete at its time have read
RECV_DONE: Final = 9
#: a transfer's completion is an event of the step whose output reports it, with priority
#: ``REPORTED + jid``: after the step and the frees of its finished requests (``FINISH``), as
#: ``update_from_output`` reads the connector's output last, and in job order (the worker
#: reports a step's finished jobs by job ID; the order decides the CPU tier's recency and the
#: numbering of a secondary tier's cascades)
REPORTED: Final = 16
KIND_NAMES = ("store_done", "load_done", "arrival", "abort", "step", "finish", "preempt",
              "case_event", "transfer_failed", "recv_done")


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, int, Any]] = []
        self._seq = 0                       # per instance: no class-level counters
        self.now = 0
        self.handlers: dict[int, Callable[[Any], None]] = {}

    def schedule(self, time: int, kind: int, data: Any = None, priority: int | None = None) -> None:
        if time < self.now:
            raise ValueError(f"event {KIND_NAMES[kind]} at {time} is in the past (now {self.now})")
        self._seq += 1
        heappush(self._heap, (time, kind if priority is None else priority, self._seq, kind, data))

    def peek(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

    def _loop(self, limit: float, max_events: float) -> int:
        heap, handlers, n = self._heap, self.handlers, 0
        while heap and heap[0][0] <= limit and n < max_events:
            time, _, _, kind, data = heappop(heap)
            self.now = time
            handlers[kind](data)
            n += 1
        return n

    def step(self) -> bool:
        """Process one event; False when the queue is empty."""
        return self._loop(float("inf"), 1) == 1

    def run_until(self, t: float) -> int:
        """Process every event with time <= t; returns how many ran."""
        return self._loop(t, float("inf"))

    def run(self) -> int:
        return self._loop(float("inf"), float("inf"))
