"""vLLM alone (no simsched): 0.26.0, a hybrid full-attention + Mamba ("align") model under
decode context parallelism with a KV connector claims a GPU prefix hit whose full-attention
blocks it does not hold.

With a connector and Mamba layers, ``Scheduler.schedule`` (0.26.0) looks the waiting request up
with ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group`` and takes
``max(per_group_hits)`` as the local hit. That method calls each manager's
``find_longest_cache_hit`` without ``dcp_world_size`` (default 1), so the full-attention
manager looks its blocks up at the spec's block size (8), not at the DCP-scaled block the
scheduler caches them at (16): it finds none, the Mamba group finds its state at 16, and the
request starts at 16 computed tokens with a fresh full-attention block for tokens [0, 16).
``find_longest_cache_hit`` (the path without a connector, and 0.27.0+, which dropped the
per-group path from the scheduler) passes ``dcp_world_size`` and reuses the block.

Run with a release's environment::

    PYTHONPATH=~/.cache/simsched/releases/0.26.0 ~/.cache/simsched/base/bin/python \\
        docs/repro/dcp_mamba_connector_hit_0260.py        # DCP=1 / NOCONN=1 to compare

Layout: full/8 + mamba/8 (align), DCP 2, the OffloadingConnector (blocks_per_chunk 2); r1 [1]*16
then r2 [1]*16 + [2]*48 (r1 is r2's prefix). Found by simsched as INV-4 on the real run
(a stored chunk of r2 whose block 0 was never written).
"""
import json
import logging
import os
import tempfile

import torch

logging.disable(logging.WARNING)

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,  # noqa: E402
                                         resolve_kv_cache_block_sizes)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, KVCacheTensor, MambaSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

DCP = int(os.environ.get("DCP", "2"))
NUM_BLOCKS = 64

model_dir = os.path.join(tempfile.gettempdir(), "vllm-alone-tiny-llama")
os.makedirs(model_dir, exist_ok=True)
with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 16}, f)

full = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=16, dtype=torch.float16)
mamba = MambaSpec(block_size=8, shapes=((4, 8),), dtypes=(torch.float16,),
                  mamba_cache_mode="align")
layers = ["model.layers.0.attn", "model.layers.1.attn"]
page = full.page_size_bytes + mamba.page_size_bytes
kvc = KVCacheConfig(num_blocks=NUM_BLOCKS,
                    kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS, shared_by=layers)],
                    kv_cache_groups=[KVCacheGroupSpec([layers[0]], full),
                                     KVCacheGroupSpec([layers[1]], mamba)])
kt = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", engine_id="alone",
                      kv_connector_extra_config={"cpu_bytes_to_use": 2 * page * 256,
                                                 "blocks_per_chunk": 2})
vc = VllmConfig(device_config=DeviceConfig(device="cpu"),
                model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True,
                                         dtype="float16", max_model_len=1024),
                cache_config=CacheConfig(block_size=8, enable_prefix_caching=True),
                kv_transfer_config=None if os.environ.get("NOCONN") else kt)
vc.cache_config.mamba_cache_mode = "align"      # what a Mamba hybrid with prefix caching gets
vc.cache_config.num_gpu_blocks = NUM_BLOCKS
vc.parallel_config.decode_context_parallel_size = DCP
block_size, hash_block_size = resolve_kv_cache_block_sizes(kvc, vc)
sched = Scheduler(vllm_config=vc, kv_cache_config=kvc, log_stats=False, block_size=block_size,
                  hash_block_size=hash_block_size,
                  structured_output_manager=StructuredOutputManager(vc))
print(f"DCP {DCP}: scheduler block {block_size}, hash block {hash_block_size}, manager blocks "
      f"{[m.block_size for m in sched.kv_cache_manager.coordinator.single_type_managers]}")

init_none_hash(sha256)
hasher = get_request_block_hasher(hash_block_size, sha256)
prompts = {"r1": [1] * 16, "r2": [1] * 16 + [2] * 48}


def request(rid):
    return Request(request_id=rid, prompt_token_ids=prompts[rid],
                   sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                   pooling_params=None, arrival_time=0.0, block_hasher=hasher)


for rid in prompts:                 # one step each: r1 runs and finishes, then r2 arrives
    sched.add_request(request(rid))
    out = sched.schedule()
    for new in out.scheduled_new_reqs:
        print(f"{new.req_id}: num_computed_tokens {new.num_computed_tokens}, scheduled "
              f"{out.num_scheduled_tokens[new.req_id]}, block tables {new.block_ids}")
    order = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(
        req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
        sampled_token_ids=[[7] for _ in order], kv_connector_output=KVConnectorOutput()))

coord = sched.kv_cache_manager.coordinator
hashes = request("r2").block_hashes
blocks, hits = coord.find_longest_cache_hit_per_group(hashes, len(prompts["r2"]) - 1)
print("find_longest_cache_hit_per_group:", [[b.block_id for b in g] for g in blocks], hits)
blocks, hit, _ = coord.find_longest_cache_hit(hashes, len(prompts["r2"]) - 1)
print("find_longest_cache_hit:          ", [[b.block_id for b in g] for g in blocks], hit)
