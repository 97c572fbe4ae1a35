"""vLLM alone: SimpleCPUOffloadConnector(lazy_offload=True) never lets the engine idle once
the GPU prefix cache holds more hashed blocks than the CPU pool. Drives the real v1 Scheduler
the way EngineCore does (step while scheduler.has_requests()), playing the worker: every
store event reported done (SimpleCPUOffloadWorkerMetadata) the step after it is scheduled.
usage: [BS=16 GPU=2048 NREQ=4 PLEN=8000 MNBT=2048 SW=0] python simple_cpu_lazy_never_idle.py [CPU_BLOCKS] [-v]
  defaults (BS=1 GPU=4228 NREQ=1 PLEN=4196 MNBT=64, CPU 256) are the campaign's shrunk case; SW=128 adds a
  sliding-window group (the first campaign's variant); CPU_BLOCKS > GPU blocks is the idle control.
Exit 1 and "BUG" when the engine still has_requests() 1000 steps after every request finished."""
import json, sys, tempfile, pathlib, logging
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
from vllm.v1.structured_output import StructuredOutputManager
logging.getLogger("vllm").setLevel(logging.ERROR)

import os
BS, GPU_BLOCKS = int(os.environ.get("BS", 1)), int(os.environ.get("GPU", 4228))
CPU_BLOCKS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "-v" else 256
VERBOSE = "-v" in sys.argv
NREQ, PLEN, MNBT = int(os.environ.get("NREQ", 1)), int(os.environ.get("PLEN", 4196)), int(os.environ.get("MNBT", 64))
PROMPTS = [[(r * 7919 + i * 104729 + 17) % 32000 for i in range(PLEN)] for r in range(NREQ)]

d = pathlib.Path(tempfile.mkdtemp())
(d / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 1 << 20}))
spec = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float16)
SW = int(os.environ.get("SW", 0))  # add a sliding-window group of this window (0: none)
specs = [spec] + ([kvi.SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=16,
                                         dtype=torch.float16, sliding_window=SW)] if SW else [])
layers = [f"model.layers.{i}.self_attn.attn" for i in range(len(specs))]
page = sum(s.page_size_bytes for s in specs)
shared = ({"shared_by": layers} if "shared_by" in kvi.KVCacheTensor.__dataclass_fields__
          else {"layers": layers, "layer_stride": 0, "block_stride": page})
kvc = kvi.KVCacheConfig(num_blocks=GPU_BLOCKS, kv_cache_groups=[kvi.KVCacheGroupSpec([l], s) for l, s in zip(layers, specs)],
                        kv_cache_tensors=[kvi.KVCacheTensor(size=page * GPU_BLOCKS, **shared)])
vc = VllmConfig(
    device_config=DeviceConfig(device="cpu"),
    model_config=ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="float16", max_model_len=PLEN + 16),
    cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
    kv_transfer_config=KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": page * CPU_BLOCKS,
                                   "lazy_offload": True}))
vc.cache_config.num_gpu_blocks = GPU_BLOCKS
vc.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on CUDA
if hasattr(kvc, "prefix_cache_retention_interval"):
    kvc.prefix_cache_retention_interval = vc.cache_config.prefix_cache_retention_interval
vc.scheduler_config.max_num_batched_tokens, vc.scheduler_config.max_num_seqs = MNBT, NREQ
block_size, hash_block_size = kcu.resolve_kv_cache_block_sizes(kvc, vc)
sched = Scheduler(vllm_config=vc, kv_cache_config=kvc, log_stats=False,
                  structured_output_manager=StructuredOutputManager(vc),
                  block_size=block_size, hash_block_size=hash_block_size)
mgr = sched.connector.scheduler_manager
print(f"GPU blocks {GPU_BLOCKS}, CPU blocks {mgr.num_cpu_blocks}, lazy target {mgr._target_free}")
hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
kcu.init_none_hash(hash_fn)
hasher = kcu.get_request_block_hasher(hash_block_size, hash_fn)
for i, p in enumerate(PROMPTS):
    sched.add_request(Request(request_id=f"r{i}", prompt_token_ids=p, pooling_params=None,
                              sampling_params=SamplingParams(max_tokens=16, ignore_eos=True),
                              arrival_time=float(i), block_hasher=hasher))

pending, step, last_finish, stores = [], 0, None, 0
while sched.has_requests():          # EngineCore.step(): `if not scheduler.has_requests(): idle`
    out = sched.schedule()
    meta = out.kv_connector_metadata
    done, pending = pending, []
    if meta.store_event >= 0:
        pending.append(meta.store_event); stores += len(meta.store_gpu_blocks)
    order = list(out.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens + out.num_scheduled_tokens[r]
                >= sched.requests[r].num_tokens else [] for r in order]
    kvo = (KVConnectorOutput(kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
        completed_store_events=dict.fromkeys(done, 1))) if done else None)
    sched.update_from_output(out, ModelRunnerOutput(
        req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
        sampled_token_ids=sampled, kv_connector_output=kvo))
    if last_finish is None and not sched.has_unfinished_requests():
        last_finish = step
        print(f"step {step}: every request finished ({stores} blocks stored so far)")
    if last_finish is not None and step - last_finish in (10, 100, 1000):
        print(f"step {step}: {step - last_finish} steps after the last finish, has_requests()="
              f"{sched.has_requests()}, blocks stored so far {stores}, store event {meta.store_event}")
    fq = sched.kv_cache_manager.block_pool.free_block_queue
    if VERBOSE: print(f"  step {step}: sched {out.total_num_scheduled_tokens} tok, store {len(meta.store_gpu_blocks)} blocks, free {fq.num_free_blocks}, cursor {mgr._cursor.block_id if mgr._cursor else None}")
    step += 1
    if last_finish is not None and step - last_finish > 1000:
        print("BUG: engine never idles: lazy offload re-stores evicted blocks forever"); sys.exit(1)
print(f"step {step}: engine idle ({stores} blocks stored); OK")
