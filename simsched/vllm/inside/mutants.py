"""Test-only mutants of the real vLLM offloading scheduler (applied inside a release worker).

A mutant is a deliberate bug patched into the release's own functions, to show that the lockstep
harness (content shadow + invariants + trace diff) detects that kind of bug on real code. They are
reachable only through the explicit ``mutant`` argument of the worker's ``run_case`` op;
:func:`apply` returns the function that undoes the patch (the engine calls it after the case).

=======================  ==========================================================  ==========
name                     bug                                                         caught by
=======================  ==========================================================  ==========
store_shift_chunk        a store job's source blocks taken one chunk too early       INV-4
drop_fence               ``jobs_to_flush`` dropped: re-allocated blocks are written  INV-6
                         before the store that reads them
load_reverse             a load's destination blocks reversed                        INV-5
key_wrong_hash           chunk 0's offload key built from block hash 1 (and back)    INV-3
lookup_first_chunk_only  the lookup stops after the first chunk past the GPU hit     INV-9
                         (``_lookup_complete_chunks``)
lookup_defer_forever     once a hit exists, the lookup defers (``None``) forever     INV-8, op
                         (``get_num_new_matched_tokens``)                            ``lookup``
lookup_refuse_window     no hit at all when a sliding-window group is offloaded      INV-9
                         (``_lookup_complete_chunks``)
=======================  ==========================================================  ==========
"""

from __future__ import annotations

from typing import Callable

_SCHED = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"


def _mod():
    import importlib
    return importlib.import_module(_SCHED)


def _set_block_ids(spec, ids: list[int]) -> None:
    old = spec.block_ids
    try:
        import numpy as np
        if isinstance(old, np.ndarray):
            spec.block_ids = np.array(ids, dtype=old.dtype)
            return
    except ImportError:
        pass
    spec.block_ids = type(old)(ids) if isinstance(old, (list, tuple)) else list(ids)


def _patch(cls, name: str, make: Callable) -> Callable[[], None]:
    orig = cls.__dict__[name]
    setattr(cls, name, make(orig))
    return lambda: setattr(cls, name, orig)


def store_shift_chunk():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def _build_store_jobs(self, *args, **kw):
            jobs = orig(self, *args, **kw)
            bpc = self.config.blocks_per_chunk
            for tj in jobs.values():
                st = self._req_status.get(tj.req_id)
                if st is None:
                    continue
                pos = {}
                for gs in st.group_states:
                    for i, b in enumerate(gs.block_ids):
                        pos.setdefault(b, (gs, i))
                new = []
                for b in tj.src_spec.block_ids:
                    gs, i = pos.get(int(b), (None, None))
                    new.append(int(gs.block_ids[i - bpc]) if gs is not None and i >= bpc
                               and gs.block_ids[i - bpc] else int(b))
                _set_block_ids(tj.src_spec, new)
            return jobs
        return _build_store_jobs
    return _patch(cls, "_build_store_jobs", make)


def drop_fence():
    cls = _mod().OffloadingConnectorScheduler
    name = "_build_connector_meta" if "_build_connector_meta" in cls.__dict__ \
        else "build_connector_meta"

    def make(orig):
        def build(self, *args, **kw):
            meta = orig(self, *args, **kw)
            if getattr(meta, "jobs_to_flush", None):
                meta.jobs_to_flush = set()
            return meta
        return build
    return _patch(cls, name, make)


def load_reverse():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def update_state_after_alloc(self, request, *args, **kw):
            before = set(self._current_batch_load_jobs)
            out = orig(self, request, *args, **kw)
            for jid in set(self._current_batch_load_jobs) - before:
                spec = self._current_batch_load_jobs[jid].dst_spec
                _set_block_ids(spec, [int(b) for b in spec.block_ids][::-1])
            return out
        return update_state_after_alloc
    return _patch(cls, "update_state_after_alloc", make)


def key_wrong_hash():
    m = _mod()
    cls = m.RequestOffloadState
    seen: set[int] = set()

    def make(orig):
        def update_offload_keys(self, *args, **kw):
            out = orig(self, *args, **kw)
            for gs in self.group_states:
                keys = gs.offload_keys
                if id(gs) not in seen and len(keys) >= 2:
                    seen.add(id(gs))
                    keys[0], keys[1] = keys[1], keys[0]
            return out
        return update_offload_keys
    return _patch(cls, "update_offload_keys", make)


def lookup_first_chunk_only():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def _lookup_complete_chunks(self, req_status, *args, **kw):
            hit = orig(self, req_status, *args, **kw)
            if not hit:
                return hit
            tpc = max(g.tokens_per_chunk for g in self.config.kv_group_configs)
            start = req_status.num_locally_computed_tokens
            return min(hit, (start // tpc + 1) * tpc - start)
        return _lookup_complete_chunks
    return _patch(cls, "_lookup_complete_chunks", make)


def lookup_defer_forever():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def get_num_new_matched_tokens(self, *args, **kw):
            hit, load_async = orig(self, *args, **kw)
            return (None, False) if hit else (hit, load_async)
        return get_num_new_matched_tokens
    return _patch(cls, "get_num_new_matched_tokens", make)


def lookup_refuse_window():
    cls = _mod().OffloadingConnectorScheduler

    def make(orig):
        def _lookup_complete_chunks(self, req_status, *args, **kw):
            hit = orig(self, req_status, *args, **kw)
            return 0 if hit and self._sliding_window_groups else hit
        return _lookup_complete_chunks
    return _patch(cls, "_lookup_complete_chunks", make)


MUTANTS: dict[str, Callable[[], Callable[[], None]]] = {
    "store_shift_chunk": store_shift_chunk,
    "drop_fence": drop_fence,
    "load_reverse": load_reverse,
    "key_wrong_hash": key_wrong_hash,
    "lookup_first_chunk_only": lookup_first_chunk_only,
    "lookup_defer_forever": lookup_defer_forever,
    "lookup_refuse_window": lookup_refuse_window,
}


def apply(name: str) -> Callable[[], None]:
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}")
    return MUTANTS[name]()
