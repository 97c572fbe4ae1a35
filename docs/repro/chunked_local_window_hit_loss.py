"""vLLM alone (no simsched): an offloaded chunked-local-attention group is looked up as a sliding
window of one attention chunk, so a hit ending at an attention-chunk boundary, which needs none
of that group's KV, is refused when the group's earlier chunks are not in the CPU tier.

A token at position p of a chunked-local layer (attention chunk C) attends to
``[p // C * C, p]`` only; vLLM's own GPU prefix cache knows it
(``ChunkedLocalAttentionManager.find_longest_cache_hit``: the blocks before
``max_length // attention_chunk_size * attention_chunk_size`` are null). The offloading
connector instead gives the group ``get_sliding_window_size_in_chunks`` =
``cdiv(attention_chunk_size, tokens_per_chunk)`` ("Attention never reaches back past one
chunk"), and ``_lookup_complete_chunks`` demands that many ready chunks before the hit's end.

Here: full attention + chunked local (C = 64), 16-token chunks, a 109-token request whose full
attention chunks 0-5 are HIT and whose chunked-local chunks are all MISS. Resuming at 64 needs
full chunks 0-3 only: a 64-token hit. vLLM finds 0 (0.30.0 to 0.33.0; 0.29.0 under the
harness too, whose GroupOffloadConfig this stand-in does not build).

    PYTHONPATH=~/.cache/simsched/releases/0.33.0 ~/.cache/simsched/base/bin/python \\
        docs/repro/chunked_local_window_hit_loss.py
"""
import logging
from types import SimpleNamespace

import torch

logging.getLogger("vllm").setLevel(logging.ERROR)

from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as S  # noqa: E402
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec  # noqa: E402

TPC = 16            # tokens per block = tokens per chunk (blocks_per_chunk 1)
get_window = getattr(S, "get_sliding_window_size_in_chunks", None)
if get_window is None:      # 0.33.0: moved to offloading/config.py
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_sliding_window_size_in_chunks as get_window)


def group(idx, spec):
    return S.GroupOffloadConfig(
        group_idx=idx, tokens_per_block=TPC, tokens_per_chunk=TPC, hashes_per_chunk=1,
        kv_event_group_spec=None, sliding_window_size_in_chunks=get_window(spec, TPC),
        kv_cache_spec=spec, manager_cls=None)


def lookup(num_tokens: int, stored_local: bool) -> int | None:
    kw = dict(block_size=TPC, num_kv_heads=1, head_size=64, dtype=torch.float16)
    groups = [group(0, FullAttentionSpec(**kw)),
              group(1, ChunkedLocalAttentionSpec(attention_chunk_size=64, **kw))]

    def manager_lookup(key, ctx):
        gid, _ = key
        return S.LookupResult.HIT if gid == 0 or stored_local else S.LookupResult.MISS

    this = SimpleNamespace(
        config=SimpleNamespace(kv_group_configs=tuple(groups)),
        manager=SimpleNamespace(lookup=manager_lookup),
        _events_tracker=SimpleNamespace(record_lookup=lambda *a, **k: None),
        _lookup_groups=(0, 1), _sliding_window_groups=(1,), _mamba_align_size=None,
        _chunks_being_loaded=None)
    cls = S.OffloadingConnectorScheduler
    this._maximal_prefix_lookup = cls._maximal_prefix_lookup.__get__(this)
    this._sliding_window_lookup = cls._sliding_window_lookup.__get__(this)
    n_chunks = num_tokens // TPC
    state = SimpleNamespace(
        num_locally_computed_tokens=0, max_load_tokens=None, req_context=None,
        req=SimpleNamespace(num_tokens=num_tokens, request_id="r5"),
        group_states=[SimpleNamespace(offload_keys=[(g.group_idx, c) for c in range(n_chunks)],
                                      lookup_hit_end_chunk_idx=0) for g in groups])
    return cls._lookup_complete_chunks(this, state)


if __name__ == "__main__":
    import vllm
    print("vLLM", vllm.__version__, "chunked-local window in chunks:",
          get_window(ChunkedLocalAttentionSpec(attention_chunk_size=64, block_size=TPC,
                                               num_kv_heads=1, head_size=64,
                                               dtype=torch.float16), TPC))
    print("109 tokens, full chunks HIT, chunked-local chunks MISS:", lookup(109, False),
          "(a hit at 64 needs no chunked-local KV)")
    print("109 tokens, every chunk HIT:", lookup(109, True))
