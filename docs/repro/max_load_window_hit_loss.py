"""vLLM alone (no simsched): with a sliding-window (or chunked-local, or Mamba) group offloaded,
a request's ``max_load_tokens`` that is a whole number of chunks loses one chunk of its hit.

``OffloadingConnectorScheduler._lookup_complete_chunks`` (0.33.0) caps the hit at
``num_computed + max_load_tokens``, then subtracts 1 for the last prompt token ("the last prompt
token has to be recomputed ... we must reduce by 1"), then rounds down to a chunk. The 1 is meant
for the prompt's end, but it is taken off the max_load_tokens cap too: a 64-token prompt fully
stored, ``max_load_tokens=32``, loads 16 tokens instead of 32 (full attention alone: 32).

Run with a release's own environment, e.g.::

    PYTHONPATH=~/.cache/simsched/releases/0.33.0 ~/.cache/simsched/base/bin/python \\
        docs/repro/max_load_window_hit_loss.py

The real ``_lookup_complete_chunks`` is called on a minimal connector-scheduler state: every
chunk of the request is HIT in the CPU manager; nothing is being loaded.
"""
import logging
from types import SimpleNamespace

import torch

logging.getLogger("vllm").setLevel(logging.ERROR)

from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as S  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

TPC = 16            # tokens per block = tokens per chunk (blocks_per_chunk 1)


def group(idx, spec, window):
    return S.GroupOffloadConfig(
        group_idx=idx, tokens_per_block=TPC, tokens_per_chunk=TPC, hashes_per_chunk=1,
        kv_event_group_spec=None, sliding_window_size_in_chunks=window, kv_cache_spec=spec,
        manager_cls=None)


def lookup(with_window: bool, num_tokens: int, max_load_tokens):
    full = FullAttentionSpec(block_size=TPC, num_kv_heads=1, head_size=64, dtype=torch.float16)
    groups = [group(0, full, None)]
    if with_window:
        sw = SlidingWindowSpec(block_size=TPC, num_kv_heads=1, head_size=64,
                               dtype=torch.float16, sliding_window=32)
        groups.append(group(1, sw, 2))
    n_chunks = num_tokens // TPC
    this = SimpleNamespace(
        config=SimpleNamespace(kv_group_configs=tuple(groups)),
        manager=SimpleNamespace(lookup=lambda key, ctx: S.LookupResult.HIT),
        _events_tracker=SimpleNamespace(record_lookup=lambda *a, **k: None),
        _lookup_groups=tuple(range(len(groups))),
        _sliding_window_groups=(1,) if with_window else (),
        _mamba_align_size=None, _chunks_being_loaded=None)
    cls = S.OffloadingConnectorScheduler
    this._maximal_prefix_lookup = cls._maximal_prefix_lookup.__get__(this)
    this._sliding_window_lookup = cls._sliding_window_lookup.__get__(this)
    state = SimpleNamespace(
        num_locally_computed_tokens=0, max_load_tokens=max_load_tokens, req_context=None,
        req=SimpleNamespace(num_tokens=num_tokens, request_id="b"),
        group_states=[SimpleNamespace(offload_keys=[(g.group_idx, c) for c in range(n_chunks)],
                                      lookup_hit_end_chunk_idx=0) for g in groups])
    return S.OffloadingConnectorScheduler._lookup_complete_chunks(this, state)


if __name__ == "__main__":
    import vllm
    print("vLLM", vllm.__version__)
    print("full attention, 64 tokens stored, max_load_tokens=32:", lookup(False, 64, 32))
    print("full + sliding window, 64 tokens stored, max_load_tokens=32:", lookup(True, 64, 32))
    print("full + sliding window, 64 tokens stored, no max_load_tokens:", lookup(True, 64, None))
    print("full + sliding window, 160 tokens stored, max_load_tokens=48:", lookup(True, 160, 48))
    # a cap of one whole chunk: 16 - 1 rounds down to no chunk at all (the shape of the
    # campaign cluster INV-9-lookup-mla+ring+sliding_window_mla: 64-token chunks, cap 64)
    print("full + sliding window, 32 tokens stored, max_load_tokens=16:", lookup(True, 32, 16))
