"""The case's requests as the run sends them to the real ``Scheduler``: per request ID the real
``Request`` (prompt block hashes by the release's own hasher), its index in the case, and the
token identity tracker the content shadow checks it by (:class:`simsched.model.request.Request`,
the model's)."""

from __future__ import annotations

from typing import Any

from simsched.case import Case
from simsched.model.request import Request as IdentRequest


class CaseRequests:
    """``call(stage, fn, *args)``: the run's wrapper of a call into vLLM (its exception a
    crash of ``stage``); ``transfer_params(spec)``: what the connector adds to a request's
    ``kv_transfer_params`` (the driver's ``kv_transfer_params``)."""

    def __init__(self, eng, case: Case, sched, hasher, unit: int, call,
                 transfer_params=lambda spec: {}):
        self.eng, self.case, self.sched = eng, case, sched
        self.transfer_params = transfer_params
        self.hasher, self.unit, self.call = hasher, unit, call
        self.reqs: dict[str, Any] = {}            # rid -> vllm Request
        self.ident: dict[str, IdentRequest] = {}  # rid -> token identity tracker
        self.index: dict[str, int] = {}
        self.hash_index: dict[str, dict] = {}
        self.finished: set[str] = set()

    def add(self, i: int, spec) -> None:
        """``Scheduler.add_request`` of the case's request ``i``: its sampling params carry the
        request's per-request caps (``kv_transfer_params``) and cache opt-out."""
        eng = self.eng
        params: dict[str, Any] = {"max_tokens": spec.decode, "ignore_eos": True}
        ktp = {}
        if spec.max_load_tokens is not None:
            ktp["max_load_tokens"] = spec.max_load_tokens
        if spec.max_offload_tokens is not None:
            ktp["max_offload_tokens"] = spec.max_offload_tokens
        ktp.update(self.transfer_params(spec))
        if ktp:
            params["extra_args"] = {"kv_transfer_params": ktp}
        if spec.skip_reading_prefix_cache:
            params["skip_reading_prefix_cache"] = True
        sp = eng.SamplingParams(**params)
        prompt = spec.prompt_tokens()
        req = self.call("add_request", lambda: eng.probe.Request(
            request_id=spec.id, prompt_token_ids=prompt, sampling_params=sp,
            pooling_params=None, arrival_time=float(i), block_hasher=self.hasher))
        self.reqs[spec.id] = req
        self.index[spec.id] = i
        self.ident[spec.id] = IdentRequest(spec.id, i, spec, prompt, spec.prompt_len + spec.decode,
                                           self.unit, len(self.case.layout.groups))
        self.call("add_request", self.sched.add_request, req)

    def spec(self, rid: str):
        """The case's ``RequestSpec`` of ``rid``."""
        return self.case.requests[self.index[rid]]

    def hidx(self, rid: str, block_hash) -> int:
        """The index of ``block_hash`` among the request's block hashes (-1: not one of its)."""
        req = self.reqs[rid]
        hashes = req.block_hashes
        m = self.hash_index.setdefault(rid, {})
        if len(m) < len(hashes):
            for j in range(len(m), len(hashes)):
                m.setdefault(bytes(hashes[j]), j)
        return m.get(bytes(block_hash), -1)

    def unfinished(self) -> list[str]:
        return [r for r in self.reqs if r not in self.finished]
