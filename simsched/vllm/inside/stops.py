"""How a run of a case stops before its requests finish: raised inside the harness, turned into
the run's outcome by :meth:`simsched.vllm.inside.run.Run.go`."""

from __future__ import annotations


class Crash(Exception):
    """vLLM raised in ``stage`` (an operation of the engine core the harness called): a finding
    naming its innermost vLLM frame."""

    def __init__(self, stage: str, exc: BaseException):
        super().__init__(f"{stage}: {exc!r}")
        self.stage = stage
        self.exc = exc


class TransferFailed(Exception):
    """A faulted job failed and the release's offloading worker raised: the run stops."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Ended(Exception):
    """The run stops cleanly on a job that never completes (``timing.jobs``, latency null):
    ``line``, the trace's last line."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line
