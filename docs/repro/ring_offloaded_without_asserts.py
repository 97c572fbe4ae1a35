"""vLLM alone (no simsched): 0.29.0/0.30.0 offload a ring group (``CircularBufferSpec``, not
prefix-cacheable, one block per request); with asserts stripped (``python -O``) the boot checks
that stop it are gone and the ring's one block is stored under prefix keys.

With asserts on, the engine refuses the layout at start-up: ``get_sliding_window_size_in_chunks``
(``assert isinstance(kv_cache_spec, FullAttentionSpec)``) for a ring alone, the divisibility
assert of ``build_offloading_config`` beside an MLA group (PR #55037's chain,
docs/invariants.md). Under ``python -O`` the real ``Scheduler`` with the real
``OffloadingConnector`` runs, and the first step's store job keys the ring group like an
attention group:

* ``ring/4`` alone, a 64-token prompt: chunk 0 (the key of tokens [0, 4)) is stored from the
  ring's one block, which after the step's forward holds the open group's last raw keys, not
  tokens [0, 4) (campaign clusters ``INV-4-store-ring``, ``INV-6-write-ring``);
* ``mla/64 + ring/132``, a 164-token prompt: the ring's 132-token block is paired with the key
  of hash 1 (tokens up to 128), not of its 132 tokens (``INV-3-store-ring``).

0.31.0 leaves the ring out of offloading (a ring alone: "KV offloading found no eligible cache
groups."). Run, for instance::

    PYTHONPATH=~/.cache/simsched/releases/0.30.0 ~/.cache/simsched/base/bin/python -O \\
        docs/repro/ring_offloaded_without_asserts.py [ring|mla+ring]
"""
import copy
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
logging.getLogger("vllm").setLevel(logging.ERROR)

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig,  # noqa: E402
                         ModelConfig, VllmConfig)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1 import kv_cache_interface as kvi  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

SHAPE = sys.argv[1] if len(sys.argv) > 1 else "ring"
NUM_GPU_BLOCKS = 64


def specs():
    ring = dict(num_kv_heads=1, head_size=16, dtype=torch.float16)
    if SHAPE == "ring":
        return [kvi.CircularBufferSpec(block_size=4, **ring)], 64
    return [kvi.MLAAttentionSpec(block_size=64, **ring),
            kvi.CircularBufferSpec(block_size=132, **ring)], 164


def engine(group_specs):
    model_dir = Path(tempfile.mkdtemp()) / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": len(group_specs), "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float16",
        "head_dim": 16}))
    page = sum(s.page_size_bytes for s in group_specs)
    vc = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=1024),
        cache_config=CacheConfig(block_size=group_specs[0].block_size,
                                 enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": (page + 4096) * 256}))
    vc.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    sc = copy.copy(vc.scheduler_config)
    sc.max_num_batched_tokens, sc.max_num_seqs = 2048, 2
    sc.disable_hybrid_kv_cache_manager = False
    vc.scheduler_config = sc
    layers = [f"model.layers.{i}.attn" for i in range(len(group_specs))]
    kvc = kvi.KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=[kvi.KVCacheTensor(size=page * NUM_GPU_BLOCKS, layers=layers,
                                            layer_stride=0, block_stride=page)],
        kv_cache_groups=[kvi.KVCacheGroupSpec([name], spec)
                         for name, spec in zip(layers, group_specs)])
    hash_unit = min(s.block_size for s in group_specs)
    kw = dict(vllm_config=vc, kv_cache_config=kvc, log_stats=False)
    params = Scheduler.__init__.__code__.co_varnames
    if "structured_output_manager" in params:
        from vllm.v1.structured_output import StructuredOutputManager
        kw["structured_output_manager"] = StructuredOutputManager(vc)
    if "block_size" in params:
        kw["block_size"] = hash_unit
    if "hash_block_size" in params:
        kw["hash_block_size"] = hash_unit
    return vc, Scheduler(**kw), hash_unit


def main() -> int:
    import vllm
    print("vLLM", vllm.__version__, SHAPE, "asserts", "on" if __debug__ else "off (-O)")
    group_specs, prompt_len = specs()
    try:
        vc, sched, hash_unit = engine(group_specs)
    except AssertionError as e:
        import traceback
        fr = traceback.extract_tb(e.__traceback__)[-1]
        print(f"start-up refused: AssertionError in {fr.name}: {fr.line}")
        return 0
    except ValueError as e:
        print(f"start-up refused: ValueError: {e}")
        return 0
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    req = Request(request_id="r0", prompt_token_ids=list(range(1, prompt_len + 1)),
                  sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
                  pooling_params=None, arrival_time=0.0,
                  block_hasher=kcu.get_request_block_hasher(hash_unit, hash_fn))
    sched.add_request(req)
    out = sched.schedule()
    cs = sched.connector.connector_scheduler
    from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx
    hash_index = {bytes(h): j for j, h in enumerate(req.block_hashes)}
    tables = [[b.block_id for b in m.req_to_blocks.get("r0", [])]
              for m in sched.kv_cache_manager.coordinator.single_type_managers]
    print(f"scheduled {out.num_scheduled_tokens}, block tables per group {tables}")
    for jid, job in (out.kv_connector_metadata.store_jobs or {}).items():
        keys = cs._jobs[jid].keys
        for k in keys:
            g, j = get_offload_group_idx(k), hash_index.get(bytes(get_offload_block_hash(k)))
            kind = type(group_specs[g]).__name__
            print(f"  store job {jid}: group {g} ({kind}, block {group_specs[g].block_size}):"
                  f" key of hash {j} = tokens [0, {(j + 1) * hash_unit})")
        print(f"  store job {jid}: source blocks {[int(b) for b in job.src_spec.block_ids]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
