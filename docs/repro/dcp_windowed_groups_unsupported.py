"""vLLM alone (no simsched): sliding-window and chunked-local groups under decode context
parallelism are layouts vLLM declares unsupported, by asserts only (every release 0.25.1-0.33.0).

With asserts (``python``): the start-up check's ``SlidingWindowSpec.max_memory_usage_bytes``
("DCP not support sliding window.", ``v1/kv_cache_interface.py``), the hybrid coordinator
("DCP with hybrid KV cache layouts only supports full-attention and Mamba groups",
``v1/core/kv_cache_coordinator.py``; 0.25.1: "DCP not support hybrid attn now.") and the lookup
("DCP not support sliding window attn now.", ``SlidingWindowManager.find_longest_cache_hit``)
each refuse it. With ``python -O`` the asserts vanish and the lookup runs at the spec's unscaled
block size against hashes of the DCP-scaled scheduler block: a second request sharing a cached
64-token prompt gets one block repeated as its hit (0.31.0: block 10, twenty times).

    PYTHONPATH=~/.cache/simsched/releases/0.31.0 ~/.cache/simsched/base/bin/python [-O] \\
        docs/repro/dcp_windowed_groups_unsupported.py
"""
import logging

import torch

logging.disable(logging.WARNING)

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,  # noqa: E402
                                        KVCacheConfig, KVCacheGroupSpec, SlidingWindowMLASpec)
from vllm.v1.request import Request  # noqa: E402

DCP = 2
KW = dict(num_kv_heads=1, head_size=16, dtype=torch.float16)


def manager(groups, scheduler_block_size, hash_block_size=None):
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(groups)])
    return KVCacheManager(kvc, max_model_len=1024, scheduler_block_size=scheduler_block_size,
                          hash_block_size=hash_block_size or scheduler_block_size,
                          enable_caching=True,
                          dcp_world_size=DCP)


def attempt(what, fn):
    try:
        print(f"{what}: {fn()}")
    except AssertionError as e:
        print(f"{what}: AssertionError: {e}")


sw = SlidingWindowMLASpec(block_size=3, sliding_window=128, **KW)
if hasattr(sw, "max_memory_usage_bytes"):
    from types import SimpleNamespace
    vc = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=DCP,
                                                         prefill_context_parallel_size=1),
                         model_config=SimpleNamespace(max_model_len=65),
                         scheduler_config=SimpleNamespace(max_num_batched_tokens=2048),
                         max_in_flight_tokens=2048)
    attempt("start-up: SlidingWindowSpec.max_memory_usage_bytes under DCP 2",
            lambda: sw.max_memory_usage_bytes(vc))

local = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=64, **KW)
full = FullAttentionSpec(block_size=16, **KW)
attempt("start-up: KV cache manager of chunked_local/4 + full/16 under DCP 2",
        lambda: type(manager([local, full], 32, 8).coordinator).__name__)

init_none_hash(sha256)
block = 3 * DCP                     # the scheduler's block: the spec's block times DCP
hasher = get_request_block_hasher(block, sha256)
m = manager([sw], block)


def request(rid):
    return Request(request_id=rid, prompt_token_ids=[0] * 64,
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                   arrival_time=0.0, block_hasher=hasher)


r0 = request("r0")
m.allocate_slots(r0, 64)            # caches r0's 10 full 6-token blocks
print("r0's blocks:", m.get_block_ids("r0")[0])
attempt("lookup: r1 with r0's prompt",
        lambda: (lambda b, n: (b.get_block_ids()[0], n))(*m.get_computed_blocks(request("r1"))[:2]))
