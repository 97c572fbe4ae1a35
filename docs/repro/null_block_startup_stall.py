"""vLLM alone (no simsched): before 0.29.0 an engine whose KV cache pool holds its longest
request only by counting the null block starts, and that request is never scheduled.

``EngineCore._initialize_kv_caches`` sizes the pool with ``get_kv_cache_configs``, which checks
that one request of ``max_model_len`` tokens fits (``_check_enough_kv_cache_memory``). Up to
0.28.0 it checks against every block of the pool; but the ``BlockPool`` holds one block back
for good (the null block), so a pool of 8 blocks gives out 7. One full-attention layer, blocks
of 16 tokens, ``max_model_len`` 128 and 8 blocks: the check passes (128 tokens need 8 blocks),
the engine starts, and a request of 126 prompt tokens and 2 to generate waits forever (its
prefill needs 8 blocks; ``allocate_slots`` never finds them). 0.29.0 checks against the pool
less the null block ("Reserve the null block BlockPool permanently holds back") and refuses to
start, naming the longest request it could serve (112 tokens).

The pool is set with ``num_gpu_blocks_override`` (which every release's planner honours: it
checks and sizes against that many blocks); on a GPU the same pool comes from the memory left
for the KV cache. Run with a release's own environment, e.g.::

    PYTHONPATH=~/.cache/simsched/releases/0.28.0 ~/.cache/simsched/base/bin/python \\
        docs/repro/null_block_startup_stall.py

Exits 1 when the engine started and the request was still unscheduled after 50 steps (0.25.1
to 0.28.0), 0 when the engine refused to start (0.29.0 on) or the request ran.
"""
import copy
import inspect
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

logging.getLogger("vllm").setLevel(logging.ERROR)

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1 import kv_cache_interface as kvi  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

try:                    # 0.33.0 moved the planner out of kv_cache_utils
    from vllm.v1.core import kv_cache_planning as planning  # noqa: E402
except ImportError:
    planning = kcu

BLOCK, NUM_GPU_BLOCKS, MAX_MODEL_LEN = 16, 8, 128


def engine():
    model_dir = Path(tempfile.mkdtemp()) / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 16}))
    vc = VllmConfig(device_config=DeviceConfig(device="cpu"),
                    model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                             dtype="float16", max_model_len=MAX_MODEL_LEN),
                    cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True))
    vc.cache_config.num_gpu_blocks_override = NUM_GPU_BLOCKS
    if hasattr(vc.cache_config, "kv_cache_layout"):      # 0.29.0+: resolved by the engine core
        vc.cache_config.kv_cache_layout = "LBNHC"
    sc = copy.copy(vc.scheduler_config)
    if hasattr(sc, "disable_hybrid_kv_cache_manager"):   # the GPU platform's default
        sc.disable_hybrid_kv_cache_manager = False
    vc.scheduler_config = sc
    specs = [{"model.layers.0.attn": kvi.FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float16)}]
    memory = [1 << 40]      # replaced by num_gpu_blocks_override's blocks
    if "global_kv_cache_groups" in inspect.signature(planning.get_kv_cache_configs).parameters:
        groups = planning.get_global_kv_cache_groups(vc, specs)
        configs = planning.get_kv_cache_configs(vc, specs, memory, groups)
    else:
        configs = planning.get_kv_cache_configs(vc, specs, memory)
    kvc = kcu.generate_scheduler_kv_cache_config(configs)
    vc.cache_config.num_gpu_blocks = kvc.num_blocks
    kw = dict(vllm_config=vc, kv_cache_config=kvc, log_stats=False)
    params = inspect.signature(Scheduler.__init__).parameters
    if "structured_output_manager" in params:
        from vllm.v1.structured_output import StructuredOutputManager
        kw["structured_output_manager"] = StructuredOutputManager(vc)
    if "block_size" in params:
        kw["block_size"] = BLOCK
    if "hash_block_size" in params:
        kw["hash_block_size"] = BLOCK
    return vc, Scheduler(**kw)


def main() -> int:
    import vllm
    print("vLLM", vllm.__version__)
    try:
        vc, sched = engine()
    except ValueError as e:
        print("refused at start-up:", str(e).splitlines()[0][:200])
        return 0
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    request = Request(request_id="a", prompt_token_ids=list(range(1000, 1126)),
                      pooling_params=None, arrival_time=0.0,
                      sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
                      block_hasher=kcu.get_request_block_hasher(BLOCK, hash_fn))
    sched.add_request(request)
    print(f"started: {sched.kv_cache_manager.block_pool.get_num_free_blocks()} free blocks "
          f"of {NUM_GPU_BLOCKS}; a needs {-(-request.num_tokens // BLOCK)} for its prefill")
    for step in range(50):
        out = sched.schedule()
        if out.num_scheduled_tokens:
            print(f"step {step}: scheduled {dict(out.num_scheduled_tokens)}")
            return 0
    print(f"a unscheduled after 50 steps ({request.status.name}): the engine cannot serve the "
          "request its start-up check admitted")
    return 1


if __name__ == "__main__":
    sys.exit(main())
