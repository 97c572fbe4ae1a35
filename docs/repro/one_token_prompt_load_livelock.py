"""vLLM alone (no simsched): a one-token prompt whose token the CPU tier holds is loaded again
and again and never scheduled, when an offload chunk is one token (GPU ``block_size`` 1).

The real ``Scheduler`` with the real ``OffloadingConnector`` (its own CPU offloading manager),
driven step by step as the engine core and the offloading worker do: ``schedule()``, then
``update_from_output()`` with every transfer job of the step reported complete
(``OffloadingWorkerMetadata.completed_jobs``, loads also ``finished_recving``).

``a`` (prompt ``[t0, t1, ...]``) is stored chunk by chunk and finishes; ``b`` arrives with the
prompt ``[t0]``. Its GPU hit is 0 (``KVCacheManager.get_computed_blocks`` leaves the last
prompt token to be recomputed); the connector finds the stored chunk of ``t0``: a hit of 1,
loaded asynchronously. When the load completes, ``Scheduler._update_waiting_for_remote_kv``
re-computes the last token of a full prompt hit: ``num_computed_tokens = num_tokens - 1``,
which for a one-token prompt is 0. The next ``schedule()`` takes ``num_computed_tokens == 0``
for a fresh request: it asks the connector again, which answers 1 again, and loads again.
``b`` never runs. A longer prompt (or a chunk of more than one token) keeps
``num_computed_tokens > 0`` after the load and is scheduled at once.

Run with a release's own environment, e.g.::

    PYTHONPATH=~/.cache/simsched/releases/0.33.0 ~/.cache/simsched/base/bin/python \\
        docs/repro/one_token_prompt_load_livelock.py [mla|full]

Prints the steps of ``b`` and exits 1 when ``b`` is still unscheduled after 200 steps.
"""
import copy
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

logging.getLogger("vllm").setLevel(logging.ERROR)

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig,  # noqa: E402
                         ModelConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import common  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1 import kv_cache_interface as kvi  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BLOCK = 1           # GPU block size = tokens per offload chunk
NUM_GPU_BLOCKS = 512
KIND = sys.argv[1] if len(sys.argv) > 1 else "mla"


def engine():
    model_dir = Path(tempfile.mkdtemp()) / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 16}))
    spec_cls = kvi.MLAAttentionSpec if KIND == "mla" else kvi.FullAttentionSpec
    spec = spec_cls(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float16)
    # the CPU tier's chunk, as CPUOffloadingSpec sizes it (rounded up to its alignment)
    align = 1
    try:
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
        align = int(getattr(CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 1))
    except ImportError:
        pass
    chunk_bytes = -(-spec.page_size_bytes // align) * align
    vc = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=1024),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": chunk_bytes * 256}))
    vc.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    sc = copy.copy(vc.scheduler_config)
    sc.max_num_batched_tokens, sc.max_num_seqs = 64, 2
    if hasattr(sc, "disable_hybrid_kv_cache_manager"):
        sc.disable_hybrid_kv_cache_manager = False
    vc.scheduler_config = sc
    tensor_fields = {f for f in kvi.KVCacheTensor.__dataclass_fields__}
    size = spec.page_size_bytes * NUM_GPU_BLOCKS
    tensor = (kvi.KVCacheTensor(size=size, shared_by=["model.layers.0.attn"])
              if "shared_by" in tensor_fields else
              kvi.KVCacheTensor(size=size, layers=["model.layers.0.attn"], layer_stride=0,
                                block_stride=spec.page_size_bytes))
    kvc = kvi.KVCacheConfig(num_blocks=NUM_GPU_BLOCKS, kv_cache_tensors=[tensor],
                            kv_cache_groups=[kvi.KVCacheGroupSpec(["model.layers.0.attn"],
                                                                  spec)])
    kw = dict(vllm_config=vc, kv_cache_config=kvc, log_stats=False)
    params = Scheduler.__init__.__code__.co_varnames
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
    vc, sched = engine()
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    hasher = kcu.get_request_block_hasher(BLOCK, hash_fn)

    def request(rid, prompt, max_tokens):
        return Request(request_id=rid, prompt_token_ids=prompt, pooling_params=None,
                       sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_time=0.0, block_hasher=hasher)

    print("vLLM", vllm.__version__, f"{KIND}/{BLOCK}")
    sched.add_request(request("a", [7, 8, 9, 10, 11, 12, 13, 14], 1))
    b_added = b_ran = False
    loads_of_b = 0
    for step in range(200):
        if step == 3 and not b_added:
            sched.add_request(request("b", [7], 4))     # a's first token, alone
            b_added = True
        out = sched.schedule()
        meta = out.kv_connector_metadata
        jobs = dict(getattr(meta, "store_jobs", None) or {})
        loads = dict(getattr(meta, "load_jobs", None) or {})
        jobs.update(loads)
        loads_of_b += sum(j.req_id == "b" for j in loads.values())
        order = list(out.num_scheduled_tokens)
        b_ran |= "b" in order
        sampled = []
        for rid in order:
            r = sched.requests[rid]
            sampled.append([5] if r.num_computed_tokens >= r.num_tokens else [])
        kvo = None
        if jobs:        # the offloading worker: every job of the step done
            kvo = KVConnectorOutput(
                finished_recving={j.req_id for j in loads.values()} or None,
                kv_connector_worker_meta=common.OffloadingWorkerMetadata(
                    completed_jobs=dict.fromkeys(jobs, 1)))
        extra = {"logprobs": None} if "logprobs" in ModelRunnerOutput.__dataclass_fields__ \
            else {}
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=sampled, kv_connector_output=kvo, **extra))
        if step < 12 and b_added:
            b = sched.requests.get("b")
            print(f"step {step}: b {b.status.name if b else 'finished'}, computed "
                  f"{b.num_computed_tokens if b else '-'}, loads of b so far {loads_of_b}")
        if b_added and "b" not in sched.requests:
            print(f"b finished at step {step}")
            return 0
    print(f"after 200 steps: b scheduled {b_ran}, loaded {loads_of_b} times, "
          f"status {sched.requests['b'].status.name}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
