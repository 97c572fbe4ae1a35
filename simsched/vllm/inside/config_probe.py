"""The config-level call chain of the offloading connector, on a release's REAL functions.

Per item ``{"layout": <layout json>, "num_tokens": N}``, in the order the engine runs them:

``resolve``                  ``resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)``
``build_offloading_config``  0.26.0+: ``offloading/config.py:build_offloading_config``;
                             0.25.1: ``OffloadingSpecFactory.create_spec(vllm_config,
                             kv_cache_config)`` (its checks live in ``OffloadingSpec.__init__``)
``spec``                     0.26.0+: ``OffloadingSpecFactory.create_spec(offloading_config)``
``from_spec``                ``SchedulerOffloadConfig.from_spec(...)`` (signature probed)
``scheduler``                ``spec.get_manager()`` and ``manager.on_new_request`` (the part of
                             ``OffloadingConnectorScheduler`` a request needs; the full
                             constructor is the separate op ``scheduler_construct``)
``request``                  a real ``Request`` with N prompt tokens, hashed at tokens_per_hash
``update_offload_keys``      ``RequestOffloadState(...).update_offload_keys()``

Each item is isolated: any exception becomes an ``{"status": "error", ...}`` outcome.
"""

from __future__ import annotations

import collections
import inspect
import os
from typing import Any

from simsched.case import segment_tokens
from simsched.connectors import Connector
from simsched.layout import Layout, LayoutError

from .build import ConfigBuilder
from .refusal import Unsupported, innermost_vllm_frame

MESSAGE_LIMIT = 300


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    line = text.splitlines()[0] if text else ""
    return line[:MESSAGE_LIMIT]


class StageError(Exception):
    def __init__(self, stage: str, exc: BaseException):
        self.stage = stage
        self.exc = exc


class ConfigProbe:
    def __init__(self, builder: ConfigBuilder | None = None):
        import vllm
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as sched
        import vllm.v1.core.kv_cache_utils as kcu
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.kv_offload import base as offload_base
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        from vllm.v1.request import Request

        import logging
        for name in ("vllm", "torch"):     # vLLM (re)configures its logger at import
            logging.getLogger(name).setLevel(logging.WARNING)
        self.builder = builder or ConfigBuilder()
        self.vllm_dir = os.path.dirname(os.path.abspath(vllm.__file__))
        self.sched = sched
        self.kcu = kcu
        self.Request = Request
        self.SamplingParams = SamplingParams
        self.factory = OffloadingSpecFactory
        self.make_offload_key = offload_base.make_offload_key
        # Keys are block_hash + 4-byte group index in 0.25.1-0.33.0; decode with the release's
        # own helpers when it has them, else match make_offload_key(hash, group).
        self.key_hash = getattr(offload_base, "get_offload_block_hash", None)
        self.key_group = getattr(offload_base, "get_offload_group_idx", None)
        self.build_offloading_config = None
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
                build_offloading_config)
            self.build_offloading_config = build_offloading_config
        except ImportError:
            pass
        self.from_spec_params = len(inspect.signature(
            sched.SchedulerOffloadConfig.from_spec).parameters)
        self.hasher_params = set(inspect.signature(kcu.get_request_block_hasher).parameters)
        self.request_params = set(inspect.signature(Request.__init__).parameters)
        algo = self.builder.base.cache_config.prefix_caching_hash_algo
        self.hash_fn = get_hash_fn_by_name(algo)
        kcu.init_none_hash(self.hash_fn)
        self._hashers: dict[tuple[int, int], Any] = {}
        self._sampling = SamplingParams(max_tokens=1)
        self._tokens: list[int] = []
        # Requests are immutable for this chain (only block_hashes are read): an LRU of them
        # keyed by (tokens_per_hash, lookahead, N) saves re-hashing repeated prompt lengths.
        self._requests: collections.OrderedDict = collections.OrderedDict()

    # ---------------------------------------------------------------------------------------
    def error(self, stage: str, exc: BaseException) -> dict:
        inner = innermost_vllm_frame(exc, self.vllm_dir)
        out = {"status": "error", "stage": stage, "exception": type(exc).__name__,
               "function": None, "file": None, "line": None, "message": _first_line(exc)}
        if inner is not None:
            # the raising line's text: a cluster's key (line numbers move between releases),
            # and whether vLLM raised on purpose (``raise ValueError(...)``: a refusal)
            out.update(function=inner.name,
                       file=os.path.relpath(os.path.abspath(inner.filename), self.vllm_dir),
                       line=inner.lineno, source=(inner.line or "").strip()[:200])
        return out

    def run_batch(self, items: list[dict]) -> list[dict]:
        return [self.run_item(item) for item in items]

    def run_item(self, item: dict) -> dict:
        try:
            layout = Layout.from_json(item["layout"])
            num_tokens = int(item.get("num_tokens", 0))
        except (LayoutError, KeyError, TypeError, ValueError) as e:
            return {"status": "invalid", "reason": f"{type(e).__name__}: {e}"}
        try:
            return self._chain(layout, num_tokens)
        except Unsupported as e:
            return {"status": "unsupported", "reason": str(e)}
        except StageError as e:
            return self.error(e.stage, e.exc)

    # ---------------------------------------------------------------------------------------
    def build_chain(self, layout: Layout):
        """Up to the scheduler config: (vllm_config, kv_cache_config, spec, sched_config)."""
        if layout.engine.connector.kind == "multi":
            # a MultiConnector builds its OffloadingConnector child on a copy of the engine's
            # config holding the child's own kv_transfer_config (0.30.0 multi_connector.py
            # _get_connector_classes_and_configs), the one the default path passes
            layout = layout.with_engine(connector=Connector())
        vc, kvc = self.builder.build(layout.as_groups())
        stage = "resolve"
        try:
            scheduler_block_size, tokens_per_hash = self.kcu.resolve_kv_cache_block_sizes(kvc, vc)
            if self.build_offloading_config is not None:
                stage = "build_offloading_config"
                oc = self.build_offloading_config(vc, kvc)
                stage = "spec"
                spec = self.factory.create_spec(oc)
            else:
                stage = "build_offloading_config"
                spec = self.factory.create_spec(vc, kvc)
            stage = "from_spec"
            if self.from_spec_params >= 3:
                sc = self.sched.SchedulerOffloadConfig.from_spec(spec, vc, kvc)
            else:
                sc = self.sched.SchedulerOffloadConfig.from_spec(spec)
        except Exception as e:  # noqa: BLE001 - vLLM's own failure is the observation
            raise StageError(stage, e) from e
        return vc, kvc, spec, sc, scheduler_block_size, tokens_per_hash

    def _chain(self, layout: Layout, num_tokens: int) -> dict:
        vc, kvc, spec, sc, scheduler_block_size, tokens_per_hash = self.build_chain(layout)
        geometry = self.geometry(sc, scheduler_block_size, tokens_per_hash)
        stage = "scheduler"
        try:
            manager = spec.get_manager()
            stage = "request"
            request = self.make_request(vc, tokens_per_hash, num_tokens)
            stage = "scheduler"
            req_context = self.sched._create_req_context(request)
            offloading_context = manager.on_new_request(req_context)
            stage = "update_offload_keys"
            state = self.sched.RequestOffloadState(
                config=sc, req=request, req_context=req_context,
                offloading_context=offloading_context)
            state.update_offload_keys()
        except Exception as e:  # noqa: BLE001
            raise StageError(stage, e) from e
        hashes = list(request.block_hashes)
        keys = []
        if self.key_hash is not None and self.key_group is not None:
            by_hash = {h: i for i, h in enumerate(hashes)}
            for gc, gs in zip(sc.kv_group_configs, state.group_states):
                keys.append([by_hash.get(self.key_hash(k), -1)
                             if self.key_group(k) == gc.group_idx else -1
                             for k in gs.offload_keys])
        else:
            for gc, gs in zip(sc.kv_group_configs, state.group_states):
                index = {self.make_offload_key(h, gc.group_idx): i for i, h in enumerate(hashes)}
                keys.append([index.get(k, -1) for k in gs.offload_keys])
        return {"status": "ok", "geometry": geometry, "num_hashes": len(hashes),
                "offload_keys": keys}

    def geometry(self, sc, scheduler_block_size: int, tokens_per_hash: int) -> dict:
        def pick(obj, *names, default=None):
            for n in names:
                if hasattr(obj, n):
                    return getattr(obj, n)
            return default

        groups = []
        for gc in sc.kv_group_configs:
            groups.append({
                "group_id": gc.group_idx,
                "tokens_per_block": pick(gc, "tokens_per_block", "gpu_block_size"),
                "tokens_per_chunk": pick(gc, "tokens_per_chunk", "offloaded_block_size"),
                "hashes_per_chunk": pick(gc, "hashes_per_chunk", "hash_block_size_factor"),
                "sliding_window_in_chunks": pick(gc, "sliding_window_size_in_chunks",
                                                 "sliding_window_size_in_blocks"),
                "drafter": bool(pick(gc, "is_eagle_group", default=False)),
            })
        return {
            "scheduler_block_size": int(scheduler_block_size),
            "tokens_per_hash": int(pick(sc, "tokens_per_hash", default=tokens_per_hash)),
            "blocks_per_chunk": int(pick(sc, "blocks_per_chunk", "block_size_factor")),
            "alignment_tokens": pick(sc, "alignment_tokens"),
            "groups": groups,
        }

    def hasher(self, vc, tokens_per_hash: int):
        lookahead = 0
        if "num_hash_lookahead_tokens" in self.hasher_params:
            lookahead = int(getattr(vc, "num_hash_lookahead_tokens", 0) or 0)
        key = (tokens_per_hash, lookahead)
        h = self._hashers.get(key)
        if h is None:
            if "num_hash_lookahead_tokens" in self.hasher_params:
                h = self.kcu.get_request_block_hasher(tokens_per_hash, self.hash_fn, lookahead)
            else:
                h = self.kcu.get_request_block_hasher(tokens_per_hash, self.hash_fn)
            self._hashers[key] = h
        return h

    def make_request(self, vc, tokens_per_hash: int, num_tokens: int):
        hasher = self.hasher(vc, tokens_per_hash)
        key = (id(hasher), num_tokens)
        req = self._requests.get(key)
        if req is not None:
            self._requests.move_to_end(key)
            return req
        req = self._new_request(hasher, num_tokens)
        self._requests[key] = req
        if len(self._requests) > 256:
            self._requests.popitem(last=False)
        return req

    def _new_request(self, hasher, num_tokens: int):
        if len(self._tokens) < num_tokens:   # segment_tokens(0, n) is a prefix of (0, m > n)
            self._tokens = segment_tokens(0, max(num_tokens, 2 * len(self._tokens)))
        return self.Request(request_id="probe", prompt_token_ids=self._tokens[:num_tokens],
                            sampling_params=self._sampling, pooling_params=None,
                            block_hasher=hasher)

    def scheduler_construct(self, layout_json: dict) -> dict:
        """Build the real ``OffloadingConnectorScheduler`` for one layout (slower op)."""
        try:
            layout = Layout.from_json(layout_json)
        except LayoutError as e:
            return {"status": "invalid", "reason": f"{type(e).__name__}: {e}"}
        try:
            vc, kvc = self.builder.build(layout.as_groups())
            try:
                if self.build_offloading_config is not None:
                    oc = self.build_offloading_config(vc, kvc)
                    spec = self.factory.create_spec(oc)
                else:
                    spec = self.factory.create_spec(vc, kvc)
                params = inspect.signature(self.sched.OffloadingConnectorScheduler).parameters
                if len(params) >= 3:
                    self.sched.OffloadingConnectorScheduler(spec, vc, kvc)
                else:
                    self.sched.OffloadingConnectorScheduler(spec)
            except Exception as e:  # noqa: BLE001
                return self.error("scheduler", e)
        except Unsupported as e:
            return {"status": "unsupported", "reason": str(e)}
        return {"status": "ok"}
