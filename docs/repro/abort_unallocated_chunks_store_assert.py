"""vLLM alone (no simsched): aborting a request that holds fewer blocks than its tokens fill
(one waiting with none, one in the middle of its prefill) makes the next ``schedule()`` raise
``AssertionError`` in ``OffloadingConnectorScheduler._build_store_jobs`` (0.26.0).

The real ``Scheduler`` with the real ``OffloadingConnector`` (its own CPU offloading manager),
driven step by step as the engine core and the offloading worker do: ``schedule()``, then
``update_from_output()``, store jobs reported complete two steps after the step that made them
(``OffloadingWorkerMetadata.completed_jobs``); the abort between two steps is the engine core's
``abort_requests``: ``Scheduler.finish_requests(ids, FINISHED_ABORTED)``.

``a`` and ``b`` share a 64-token prompt (four 16-token blocks), ``max_num_seqs`` is 1: ``b``
waits while ``a`` runs; at step 1 (``a`` finished, its store job in flight) the connector
defers ``b``'s lookup (``get_num_new_matched_tokens`` returns None), so ``b`` still has no
block. ``b`` is aborted before step 2. ``request_finished`` calls ``update_offload_keys``: the
keys of all four chunks of the prompt. At step 2 ``_build_store_jobs`` walks the finished
request (``finished_req_ids``), takes ``num_tokens`` (64) as its offloadable tokens and slices
four keys against an empty block list: ``assert len(offload_keys) == len(offload_block_ids)``.
(0.25.1's ``request_finished`` drops the state of a request without transfer jobs.) 0.27.0's
``RequestOffloadState.storable_chunks`` counts only allocated chunks
(``len(group_state.block_ids) // blocks_per_chunk``): no chunk, no job.

``VARIANT=idle``: ``b`` is aborted at step 1 without ever being looked up (``a`` still
decoding): ``request_finished`` keys its prompt all the same. ``VARIANT=prefill``: a budget of
32 tokens, ``a`` aborted after its first prefill chunk: two blocks for four keys.

Run with a release's own environment, e.g.::

    PYTHONPATH=~/.cache/simsched/releases/0.26.0 ~/.cache/simsched/base/bin/python \\
        docs/repro/abort_unallocated_chunks_store_assert.py

Prints the steps and exits 1 when ``schedule()`` raises.
"""
import copy
import json
import logging
import os
import sys
import tempfile
import traceback
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
from vllm.v1.request import Request, RequestStatus  # noqa: E402

BLOCK = 16
NUM_GPU_BLOCKS = 64
STORE_LATENCY = 2
VARIANT = os.environ.get("VARIANT", "deferred")


def engine():
    model_dir = Path(tempfile.mkdtemp()) / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 16}))
    spec = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16,
                                 dtype=torch.float16)
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
    sc.max_num_batched_tokens = 32 if VARIANT == "prefill" else 2048
    sc.max_num_seqs = 1
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

    def request(rid, max_tokens):
        return Request(request_id=rid, prompt_token_ids=list(range(100, 164)),
                       pooling_params=None,
                       sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_time=0.0, block_hasher=hasher)

    print("vLLM", vllm.__version__, "variant", VARIANT)
    sched.add_request(request("a", 1 if VARIANT == "deferred" else 8))
    sched.add_request(request("b", 1))
    abort_step = 2 if VARIANT == "deferred" else 1
    victim = "a" if VARIANT == "prefill" else "b"
    due: dict[int, int] = {}            # store job ID -> step whose output reports it
    for step in range(8):
        if step == abort_step:
            r = sched.requests[victim]
            print(f"abort {victim} before step {step}: {r.status.name}, computed "
                  f"{r.num_computed_tokens}, blocks {sched.kv_cache_manager.get_block_ids(victim)}")
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        try:
            out = sched.schedule()
        except AssertionError:
            print(f"step {step}: schedule() raised")
            traceback.print_exc(limit=-1)
            return 1
        meta = out.kv_connector_metadata
        for jid in dict(getattr(meta, "store_jobs", None) or {}):
            due[jid] = step + STORE_LATENCY - 1
        order = list(out.num_scheduled_tokens)
        print(f"step {step}: scheduled {out.num_scheduled_tokens}, store jobs "
              f"{sorted(getattr(meta, 'store_jobs', None) or {})}")
        sampled = []
        for rid in order:
            r = sched.requests[rid]
            sampled.append([5] if r.num_computed_tokens >= r.num_tokens else [])
        done = [j for j, d in due.items() if d <= step]
        for j in done:
            del due[j]
        kvo = None
        if done:        # the offloading worker: the store jobs due by now are done
            kvo = KVConnectorOutput(kv_connector_worker_meta=common.OffloadingWorkerMetadata(
                completed_jobs=dict.fromkeys(done, 1)))
        extra = {"logprobs": None} if "logprobs" in ModelRunnerOutput.__dataclass_fields__ \
            else {}
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=sampled, kv_connector_output=kvo, **extra))
        if not sched.requests and not due:
            break
    print("no error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
