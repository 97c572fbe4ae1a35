"""vLLM alone: a model whose every layer is sliding-window (Mistral-7B-v0.1: sliding_window=4096,
no layer_types) served with SimpleCPUOffloadConnector (VLLM_USE_SIMPLE_KV_OFFLOAD=1
--kv-offloading-size N). The release's planner makes one SlidingWindowSpec group; the connector's
scheduler manager asserts a full-attention group exists, with no message."""
import json, tempfile, pathlib, logging, traceback, torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager
try:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
logging.getLogger("vllm").setLevel(logging.ERROR)
d = pathlib.Path(tempfile.mkdtemp())
(d / "config.json").write_text(json.dumps({   # Mistral-7B-v0.1's shape, shrunk
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
    "sliding_window": 4096}))
mc = ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="float16", max_model_len=8192)
W = mc.get_sliding_window()
spec = kvi.SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float16, sliding_window=W)
layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
vc = VllmConfig(device_config=DeviceConfig(device="cpu"), model_config=mc,
                cache_config=CacheConfig(block_size=16, enable_prefix_caching=True, sliding_window=W),
                kv_transfer_config=KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                                                    kv_connector_extra_config={"cpu_bytes_to_use": 1 << 24}))
vc.scheduler_config.disable_hybrid_kv_cache_manager = False   # as on CUDA
groups = get_kv_cache_groups(vc, {l: spec for l in layers})    # the release's own planner
print("sliding_window", W, "| planner groups:", [type(g.kv_cache_spec).__name__ for g in groups])
page = spec.page_size_bytes * len(layers)
shared = ({"shared_by": layers} if "shared_by" in kvi.KVCacheTensor.__dataclass_fields__
          else {"layers": layers, "layer_stride": 0, "block_stride": page})
kvc = kvi.KVCacheConfig(num_blocks=1024, kv_cache_groups=groups,
                        kv_cache_tensors=[kvi.KVCacheTensor(size=page * 1024, **shared)])
vc.cache_config.num_gpu_blocks = 1024
bs, hbs = kcu.resolve_kv_cache_block_sizes(kvc, vc)
try:
    Scheduler(vllm_config=vc, kv_cache_config=kvc, log_stats=False,
              structured_output_manager=StructuredOutputManager(vc), block_size=bs, hash_block_size=hbs)
    print("scheduler built: OK")
except AssertionError as e:
    f = traceback.extract_tb(e.__traceback__)[-1]
    print(f"AssertionError({str(e)!r}) at {f.filename.split('/vllm/')[-1]}:{f.lineno}: {f.line}")
