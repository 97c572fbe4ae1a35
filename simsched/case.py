"""A case: a layout plus a workload, the unit that the model and every release worker run.

Case files are JSON data (``format: simsched-case/1``); they are parsed and validated, never
evaluated. Prompts are lists of segments ``[seed, length]``: two requests whose prompts start with
the same segments share that prefix token for token, which is how a workload asks for prefix hits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

from simsched.fields import LayoutError, boolean, choice, integer, take
from simsched.layout import Layout

CASE_FORMAT = "simsched-case/1"
VOCAB: Final = 32000


_STEP = 104729
_STEP_INV = pow(_STEP, -1, VOCAB)          # 104729 is prime: invertible modulo the vocabulary
_TABLE: list[int] = [(j * _STEP + 17) % VOCAB for j in range(2 * VOCAB)]


def segment_tokens(seed: int, length: int) -> list[int]:
    """The token ids of one prompt segment: a fixed function of (seed, position),
    ``(seed * 7919 + i * 104729 + 17) % VOCAB`` for position ``i``.

    That is ``_TABLE[(i + d) % VOCAB]`` with ``d * 104729 == seed * 7919 (mod VOCAB)``: slices of
    one precomputed period instead of a modulo per token."""
    d = seed * 7919 * _STEP_INV % VOCAB
    if d + length <= len(_TABLE):
        return _TABLE[d:d + length]
    out = _TABLE[d:VOCAB]
    while len(out) < length:
        out += _TABLE[:min(VOCAB, length - len(out))]
    return out


def sampled_token(seed: int, index: int, pos: int) -> int:
    """The token request ``index`` samples at ``pos`` in a case whose seed is ``seed`` mod VOCAB
    (the model and the harness both sample it; the token depends on the seed's residue only:
    callers pass it reduced, which keeps every term far below 2**63)."""
    return (seed * 1000003 + index * 7919 + pos * 104729 + 3) % VOCAB


_INV_7919 = pow(7919, -1, VOCAB)


def sampled_segment(seed: int, index: int, position: int, length: int) -> tuple[int, int]:
    """The prompt segment ``(s, length)`` whose tokens are the ``length`` tokens that request
    ``index`` of a case of seed ``seed`` samples from ``position`` on (a multi-turn prompt that
    repeats an earlier answer). Both are progressions of step 104729 modulo VOCAB
    (:func:`segment_tokens`, :func:`sampled_token`), so ``s`` solves
    ``s * 7919 + 17 == sampled_token(seed, index, position)`` (mod VOCAB)."""
    first = sampled_token(seed % VOCAB, index, position)
    return ((first - 17) * _INV_7919 % VOCAB, length)


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload. Times are scheduler steps."""

    id: str
    prompt: tuple[tuple[int, int], ...]    # segments (seed, length)
    arrival: int = 0
    decode: int = 1                         # output tokens to generate
    abort_at: int | None = None             # step at which the request is aborted
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    # speculative decoding: drafts the worker accepts at the request's k-th verification step
    # (a step that scheduled drafts for it): accept[k % len(accept)], at most the drafts
    # scheduled; None accepts every draft
    accept: tuple[int, ...] | None = None
    # SamplingParams.skip_reading_prefix_cache: the request reads no prefix cache, GPU or CPU
    # (its blocks are still cached and offloaded)
    skip_reading_prefix_cache: bool = False
    # a P/D request (a ``multi`` connector, simsched.connectors): its prompt's KV is pulled from
    # a prefill instance through NIXL (kv_transfer_params do_remote_prefill) and lands this many
    # steps after the step that admits it (the NIXL worker's finished_recving); None: local
    remote_prefill: int | None = None

    @property
    def withdrawn(self) -> bool:
        """Aborted before it arrives (``abort_at < arrival``): the request is never sent to the
        engine (vLLM cannot abort a request it has not seen); it counts as aborted. At
        ``abort_at == arrival`` it arrives and is aborted before that step is scheduled."""
        return self.abort_at is not None and self.abort_at < self.arrival

    def accepted(self, k: int, drafts: int) -> int:
        if self.accept is None:
            return drafts
        return min(drafts, self.accept[k % len(self.accept)])

    @property
    def prompt_len(self) -> int:
        return sum(length for _, length in self.prompt)

    def prompt_tokens(self) -> list[int]:
        out: list[int] = []
        for seed, length in self.prompt:
            out.extend(segment_tokens(seed, length))
        return out

    @classmethod
    def from_json(cls, obj: Any, path: str) -> "RequestSpec":
        obj = take(obj, path, {f.name for f in fields(cls)})
        rid = obj.get("id")
        if not isinstance(rid, str) or not rid:
            raise LayoutError(f"{path}.id", "a non-empty string is required")
        prompt = obj.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            raise LayoutError(f"{path}.prompt", "a non-empty list of [seed, length] is required")
        segments = []
        for i, seg in enumerate(prompt):
            if (not isinstance(seg, list) or len(seg) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in seg)
                    or seg[0] < 0 or seg[1] < 1):
                raise LayoutError(f"{path}.prompt[{i}]",
                                  f"expected [seed >= 0, length >= 1], got {seg!r}")
            segments.append((seg[0], seg[1]))
        accept = obj.get("accept")
        if accept is not None:
            if (not isinstance(accept, list) or not accept or len(accept) > 1024
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 16
                               for x in accept)):
                raise LayoutError(f"{path}.accept", "a list of 1 to 1024 integers 0 to 16 "
                                  f"is required, got {accept!r}")
            accept = tuple(accept)
        return cls(
            id=rid,
            prompt=tuple(segments),
            arrival=integer(obj, "arrival", path, default=0, lo=0),
            decode=integer(obj, "decode", path, default=1, lo=1, hi=1 << 16),
            abort_at=integer(obj, "abort_at", path, default=None, optional=True, lo=0),
            max_load_tokens=integer(obj, "max_load_tokens", path, default=None, optional=True, lo=0),
            max_offload_tokens=integer(obj, "max_offload_tokens", path, default=None, optional=True,
                                    lo=0),
            accept=accept,
            skip_reading_prefix_cache=boolean(obj, "skip_reading_prefix_cache", path, False),
            remote_prefill=integer(obj, "remote_prefill", path, default=None, optional=True,
                                   hi=1024),
        )

    def to_json(self) -> dict:
        out: dict[str, Any] = {"id": self.id, "prompt": [list(s) for s in self.prompt]}
        for f in fields(self)[2:]:
            if getattr(self, f.name) != f.default:
                v = getattr(self, f.name)
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True)
class JobTiming:
    """One transfer job's own latency: the ``index``-th store (or load) job the connector
    creates, counted from 0 in the order of creation. ``latency`` None: the job never completes
    (a copy that hangs: the worker never reports it)."""

    kind: str          # "store" or "load"
    index: int
    latency: int | None

    @classmethod
    def from_json(cls, obj: Any, path: str) -> "JobTiming":
        obj = take(obj, path, {"store", "load", "latency"})
        kinds = [k for k in ("store", "load") if k in obj]
        if len(kinds) != 1:
            raise LayoutError(path, "exactly one of store or load (the job's index) is required")
        latency = obj.get("latency", ...)
        if latency is not None:
            if latency is ... or isinstance(latency, bool) or not isinstance(latency, int) \
                    or not 0 <= latency <= 1000:
                raise LayoutError(f"{path}.latency", "an integer 0 to 1000, or null (never "
                                  f"completes), is required, got "
                                  f"{'nothing' if latency is ... else repr(latency)}")
        return cls(kind=kinds[0], index=integer(obj, kinds[0], path, lo=0), latency=latency)

    def to_json(self) -> dict:
        return {self.kind: self.index, "latency": self.latency}


@dataclass(frozen=True)
class Timing:
    """When transfers complete, in scheduler steps after the step that created the job."""

    store_latency: int = 1
    load_latency: int = 1
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 32
    jobs: tuple[JobTiming, ...] = ()     # per-job overrides of the two latencies

    def latency(self, kind: str, index: int) -> int | None:
        """The latency of the ``index``-th ``kind`` ("store" or "load") job; None if it never
        completes."""
        for job in self.jobs:
            if job.kind == kind and job.index == index:
                return job.latency
        return self.store_latency if kind == "store" else self.load_latency

    @classmethod
    def from_json(cls, obj: Any, path: str = "timing") -> "Timing":
        obj = take(obj, path, {f.name for f in fields(cls)})
        jobs = obj.get("jobs", [])
        if not isinstance(jobs, list):
            raise LayoutError(f"{path}.jobs", "expected a list of {store | load, latency}")
        return cls(
            store_latency=integer(obj, "store_latency", path, default=1, lo=0, hi=1000),
            load_latency=integer(obj, "load_latency", path, default=1, lo=0, hi=1000),
            max_num_batched_tokens=integer(obj, "max_num_batched_tokens", path, default=2048),
            max_num_seqs=integer(obj, "max_num_seqs", path, default=32, hi=4096),
            jobs=_jobs(jobs, f"{path}.jobs"),
        )

    @property
    def hangs(self) -> bool:
        """Some job never completes (``"latency": null``)."""
        return any(j.latency is None for j in self.jobs)

    def to_json(self) -> dict:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                               if f.name != "jobs" and getattr(self, f.name) != f.default}
        if self.jobs:
            out["jobs"] = [j.to_json() for j in self.jobs]
        return out


def _jobs(jobs: list, path: str) -> tuple[JobTiming, ...]:
    parsed = tuple(JobTiming.from_json(j, f"{path}[{i}]") for i, j in enumerate(jobs))
    seen: set[tuple[str, int]] = set()
    for j in parsed:
        if (j.kind, j.index) in seen:
            raise LayoutError(path, f"{j.kind} {j.index} given twice")
        seen.add((j.kind, j.index))
    return parsed


#: what a case event does: ``Scheduler.reset_prefix_cache()``, as an operator's
#: ``/reset_prefix_cache`` call reaches the engine core between two steps
EVENT_KINDS = ("reset_prefix_cache",)


@dataclass(frozen=True)
class CaseEvent:
    """An engine call at a time of the case's clock (the one of arrivals and aborts): after that
    time's arrivals and aborts, before its step is scheduled."""

    step: int
    do: str

    @classmethod
    def from_json(cls, obj: Any, path: str) -> "CaseEvent":
        obj = take(obj, path, {"step", "do"})
        return cls(step=integer(obj, "step", path, lo=0), do=choice(obj, "do", path, EVENT_KINDS))

    def to_json(self) -> dict:
        return {"step": self.step, "do": self.do}


#: how a transfer job fails: the copy engine reports the job unsuccessful
#: (``TransferResult.success`` False) to the offloading worker's ``get_finished``
FAULT_KINDS = ("store_failed", "load_failed")


@dataclass(frozen=True)
class TransferFault:
    """The ``job``-th store (``store_failed``) or load (``load_failed``) job the connector
    creates, counted from 0 in the order of creation as ``timing.jobs`` counts them, fails: the
    worker learns it when the job would have completed (its latency)."""

    kind: str
    job: int

    @property
    def job_kind(self) -> str:
        return "store" if self.kind == "store_failed" else "load"

    @classmethod
    def from_json(cls, obj: Any, path: str) -> "TransferFault":
        obj = take(obj, path, {"job", "kind"})
        return cls(kind=choice(obj, "kind", path, FAULT_KINDS), job=integer(obj, "job", path, lo=0))

    def to_json(self) -> dict:
        return {"job": self.job, "kind": self.kind}


@dataclass(frozen=True)
class Case:
    layout: Layout
    requests: tuple[RequestSpec, ...] = ()
    timing: Timing = field(default_factory=Timing)
    seed: int = 0
    asserts: bool = True    # False: run vLLM with asserts stripped (python -O)
    events: tuple[CaseEvent, ...] = ()
    faults: tuple[TransferFault, ...] = ()

    def fault(self, job_kind: str, index: int) -> TransferFault | None:
        """The fault of the ``index``-th ``job_kind`` ("store" or "load") job, if any."""
        for f in self.faults:
            if f.job_kind == job_kind and f.job == index:
                return f
        return None

    @classmethod
    def from_json(cls, obj: Any) -> "Case":
        obj = take(obj, "", {"format", "layout", "requests", "timing", "seed", "asserts",
                              "events", "faults"})
        fmt = obj.get("format", CASE_FORMAT)
        if fmt != CASE_FORMAT:
            raise LayoutError("format", f"expected {CASE_FORMAT!r}, got {fmt!r}")
        if "layout" not in obj:
            raise LayoutError("layout", "required")
        layout = Layout.from_json(obj["layout"])
        requests = obj.get("requests", [])
        if not isinstance(requests, list):
            raise LayoutError("requests", "expected a list of requests")
        seed = integer(obj, "seed", "", default=0, lo=0, hi=(1 << 63) - 1)
        parsed = _resolve_sampled(requests, seed)
        remote = next((i for i, r in enumerate(parsed) if r.remote_prefill is not None), None)
        if remote is not None and layout.engine.connector.kind != "multi":
            raise LayoutError(f"requests[{remote}].remote_prefill", "a request pulled from a "
                              "prefill instance arrives through NIXL: engine.connector must be "
                              "a multi connector")
        events = obj.get("events", [])
        if not isinstance(events, list):
            raise LayoutError("events", "expected a list of events")
        faults = obj.get("faults", [])
        if not isinstance(faults, list):
            raise LayoutError("faults", "expected a list of {job, kind}")
        parsed_faults = tuple(TransferFault.from_json(f, f"faults[{i}]")
                              for i, f in enumerate(faults))
        if len(set(parsed_faults)) != len(parsed_faults):
            twice = next(f for f in parsed_faults if parsed_faults.count(f) > 1)
            raise LayoutError("faults", f"{twice.kind} of job {twice.job} given twice")
        return cls(layout=layout, requests=parsed,
                   timing=Timing.from_json(obj.get("timing", {})),
                   seed=seed,
                   asserts=boolean(obj, "asserts", "", True),
                   events=tuple(CaseEvent.from_json(e, f"events[{i}]")
                                for i, e in enumerate(events)),
                   faults=parsed_faults)

    def repeated_outputs(self) -> list[tuple[str, str]]:
        """``(later, earlier)`` for each prompt segment of ``later`` that repeats tokens
        ``earlier`` samples from its first output token on (:func:`sampled_segment`)."""
        out = []
        for j, earlier in enumerate(self.requests):
            # the segment's seed does not depend on its length
            seed, _ = sampled_segment(self.seed, j, earlier.prompt_len, 1)
            out += [(later.id, earlier.id) for later in self.requests[j + 1:]
                    if any(s == seed and n <= earlier.decode for s, n in later.prompt)]
        return out

    def to_json(self) -> dict:
        out: dict[str, Any] = {"format": CASE_FORMAT, "layout": self.layout.to_json(),
                               "requests": [r.to_json() for r in self.requests]}
        timing = self.timing.to_json()
        if timing:
            out["timing"] = timing
        if self.seed:
            out["seed"] = self.seed
        if not self.asserts:
            out["asserts"] = False
        if self.events:
            out["events"] = [e.to_json() for e in self.events]
        if self.faults:
            out["faults"] = [f.to_json() for f in self.faults]
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n"


def _resolve_sampled(requests: list, seed: int) -> tuple[RequestSpec, ...]:
    """The requests, each prompt segment ``{"sampled": id, "length": n}`` made the segment of
    the first ``n`` tokens (default: all) that the earlier request ``id`` samples."""
    parsed: list[RequestSpec] = []
    index: dict[str, int] = {}
    for i, raw in enumerate(requests):
        path = f"requests[{i}]"
        prompt = raw.get("prompt") if isinstance(raw, dict) else None
        if isinstance(prompt, list) and any(isinstance(x, dict) for x in prompt):
            segments = []
            for k, seg in enumerate(prompt):
                if not isinstance(seg, dict):
                    segments.append(seg)
                    continue
                where = f"{path}.prompt[{k}]"
                seg = take(seg, where, {"sampled", "length"})
                rid = seg.get("sampled")
                if rid not in index:
                    raise LayoutError(f"{where}.sampled", f"the id of an earlier request is "
                                      f"required, got {rid!r}")
                earlier = parsed[index[rid]]
                n = integer(seg, "length", where, default=earlier.decode, lo=1, hi=earlier.decode)
                segments.append(list(sampled_segment(seed, index[rid], earlier.prompt_len, n)))
            raw = dict(raw, prompt=segments)
        spec = RequestSpec.from_json(raw, path)
        if spec.id in index:
            raise LayoutError("requests", f"duplicate request id {spec.id!r}")
        index[spec.id] = i
        parsed.append(spec)
    return tuple(parsed)


def load_case(path: str | Path) -> Case:
    """Read a case file; any problem becomes a :class:`LayoutError` naming the file and field."""
    path = Path(path)
    if path.is_dir():
        raise LayoutError(str(path), "is a directory, not a case file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LayoutError(str(path), f"cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")     # JSON files are UTF-8 (RFC 8259), whatever the locale
    except UnicodeDecodeError as e:
        raise LayoutError(str(path), f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LayoutError(str(path), f"not valid JSON (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise LayoutError(str(path), "not valid JSON (nested too deeply)") from None
    except ValueError as e:     # int(): an integer of more digits than Python converts
        raise LayoutError(str(path), f"not valid JSON ({str(e).split(':')[0]})") from None
    if not isinstance(obj, dict):
        raise LayoutError(str(path), "expected a JSON object (a case or a bare layout), got "
                          f"{_json_type(obj)}")
    if "groups" in obj and "layout" not in obj:
        obj = {"layout": obj}   # a bare layout file is a case with no requests
    try:
        return Case.from_json(obj)
    except LayoutError as e:
        raise LayoutError(f"{path}: {e.field}", e.reason) from None


def _json_type(obj: Any) -> str:
    """What a JSON value is, in JSON's words."""
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "a boolean"
    if isinstance(obj, (int, float)):
        return "a number"
    if isinstance(obj, str):
        return "a string"
    return "an array"
