"""vLLM alone (no simsched): a CPU transfer that fails stops the OffloadingConnector's worker.

The offloading worker (``OffloadingConnectorWorker``, ``offloading/worker.py``) hands each store
and load job to its ``OffloadingWorker`` (the copy engine: ``submit_store`` / ``submit_load``) and
collects the results in ``get_finished``, which asserts every one succeeded ("we currently do not
support job failures", 0.25.1 to 0.33.0). A failed copy (a CUDA error, a CPU tier that could not
be written) is not reported to the scheduler as a failed job or as invalid blocks
(``get_block_ids_with_load_errors``, the path ``kv_load_failure_policy`` acts on, is not
implemented by this connector): the worker raises and the engine stops.

The real ``Scheduler`` with the real ``OffloadingConnector`` creates a store job for request
``a``'s first chunk; a worker-role ``OffloadingConnector`` of the same config takes the step's
connector metadata as the model runner passes it (``prepare_store_kv`` after the forward pass,
``start_kv_transfers`` at the next step), with a copy engine that reports that store failed.
``load`` fails instead the load of a second request ``b`` that hits ``a``'s stored chunks
(the GPU prefix cache reset first, so that the hit is on the CPU tier).

Run with a release's own environment, e.g.::

    PYTHONPATH=~/.cache/simsched/releases/0.33.0 ~/.cache/simsched/base/bin/python \\
        docs/repro/offloading_transfer_failure.py [store|load]

Exits 1 when the worker raised on the failed job, 0 when it reported the failure.
"""
import copy
import json
import logging
import sys
import tempfile
import traceback
from pathlib import Path

import torch

logging.getLogger("vllm").setLevel(logging.ERROR)

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig,  # noqa: E402
                         ModelConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import common  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1 import kv_cache_interface as kvi  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BLOCK = 16          # GPU block size = tokens per offload chunk
NUM_GPU_BLOCKS = 64
KIND = "full"


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


FAIL = sys.argv[1] if len(sys.argv) > 1 else "store"


class FailingCopyEngine(OffloadingWorker):
    """The GPU<->CPU copy engine: every job it is given finishes; ``fail`` (a job id) fails."""

    def __init__(self):
        self.submitted: list[int] = []
        self.fail: int | None = None
        self.failed_reported = False

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.submitted.append(job_id)
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False) -> bool:
        self.submitted.append(job_id)
        return True

    def get_finished(self) -> list:
        done, self.submitted = self.submitted, []
        self.failed_reported |= self.fail in done
        return [TransferResult(job_id=j, success=j != self.fail) for j in done]

    def wait(self, job_ids) -> None:
        return


def main() -> int:
    import vllm
    vc, sched = engine()
    kvc = sched.kv_cache_config
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    hasher = kcu.get_request_block_hasher(BLOCK, hash_fn)
    worker = OffloadingConnector(vc, KVConnectorRole.WORKER, kvc).connector_worker
    worker.worker = engine_ = FailingCopyEngine()   # where register_kv_caches puts it

    def request(rid, prompt, max_tokens):
        return Request(request_id=rid, prompt_token_ids=prompt, pooling_params=None,
                       sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_time=0.0, block_hasher=hasher)

    print("vLLM", vllm.__version__, f"failing the first {FAIL} job")
    sched.add_request(request("a", list(range(100, 148)), 1))
    for step in range(40):
        if step == 4:       # a's GPU blocks dropped: b's hit is on the CPU tier
            assert sched.reset_prefix_cache()
            sched.add_request(request("b", list(range(100, 148)) + [7], 1))
        out = sched.schedule()
        meta = out.kv_connector_metadata
        stores = dict(getattr(meta, "store_jobs", None) or {})
        loads = dict(getattr(meta, "load_jobs", None) or {})
        target = loads if FAIL == "load" else stores
        if engine_.fail is None and target:
            engine_.fail = min(target)
            print(f"step {step}: {FAIL} job {engine_.fail} of {target[engine_.fail].req_id} fails")
        try:    # the model runner: transfers start, the forward pass, stores queued, results
            worker.start_kv_transfers(meta)
            worker.prepare_store_kv(meta)
            _, recving = worker.get_finished(set())
        except AssertionError:
            frame = traceback.extract_tb(sys.exc_info()[2])[-1]
            print(f"step {step}: the worker raised AssertionError in {frame.name} "
                  f"({frame.filename.split('vllm/')[-1]}:{frame.lineno}: {frame.line})")
            return 1
        wm = worker.build_connector_worker_meta()
        order = list(out.num_scheduled_tokens)
        sampled = [[5] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                   else [] for r in order]
        kvo = KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=wm)
        extra = {"logprobs": None} if "logprobs" in ModelRunnerOutput.__dataclass_fields__ \
            else {}
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=sampled, kv_connector_output=kvo, **extra))
        if engine_.failed_reported:
            print(f"step {step}: the worker reported the failed job: {wm}")
            return 0
    print("no job failed within 40 steps")
    return 2


if __name__ == "__main__":
    sys.exit(main())
