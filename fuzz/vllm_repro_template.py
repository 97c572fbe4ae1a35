"""The fixed text of a vLLM-only repro file (:mod:`fuzz.vllm_repro` fills it in): the
``Scheduler`` with the ``OffloadingConnector`` and its real CPU offloading manager, built over a
tiny Llama ``VllmConfig`` as the release harness builds them (``simsched/vllm/inside/build.py``,
``engine.RealEngine.boot``), and a worker stand-in that plays the case's steps (``run.Run._go``):
the tokens it samples, the drafts it proposes and accepts under speculative decoding, and each
store and load job reported done after its latency.
"""

SAMPLED = ("    sampled = [[(SEED * 1000003 + int(r.arrival_time) * 7919 + r.num_tokens * 104729"
           " + 3) % 32000]\n               if r.num_computed_tokens >= r.num_tokens else [] "
           "for r in reqs]\n")

SPEC_HELPERS = '''

def token(r, pos):
    return (SEED * 1000003 + int(r.arrival_time) * 7919 + pos * 104729 + 3) % 32000
{accepted}

def propose_drafts(sched, out, order):
    """The drafter after a step (EngineCore.post_step): the tokens after each request's own."""
    k = 0 if getattr(out, "skip_drafts", False) else out.num_spec_tokens_to_schedule
    reqs = [sched.requests.get(rid) for rid in order]
    drafts = [[token(r, r.num_tokens + j) for j in range(k)] if r else [] for r in reqs]
    sched.update_draft_token_ids(DraftTokenIds(list(order), drafts))
'''

#: the drafts the worker accepts at a verification step: every one (no request has a pattern)
ACCEPT_ALL = '''

def accepted(out, r):
    """The drafts the worker accepts at r's verification step: all (of padding, -1: none)."""
    drafts = out.scheduled_spec_decode_tokens.get(r.request_id, [])
    return len(drafts) if any(x != -1 for x in drafts) else 0
'''

#: ... or as each request's pattern says, in turn, where it has one
ACCEPT_PATTERN = '''

def accepted(out, r):
    """The drafts the worker accepts at r's verification step: as ACCEPT says in turn, else
    all (of padding, -1: none)."""
    drafts = out.scheduled_spec_decode_tokens.get(r.request_id, [])
    if not any(x != -1 for x in drafts):
        return 0
    k = VERIFIED[r.request_id] = VERIFIED.get(r.request_id, -1) + 1
    pattern = ACCEPT.get(r.request_id)
    return len(drafts) if pattern is None else min(len(drafts), pattern[k % len(pattern)])
'''

TEMPLATE = '''"""{title}

{about}
"""
{dataclasses_import}import json

{pytest_import}import torch

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
{config_imports}from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.sched.scheduler import Scheduler
{offload_import}from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import {outputs_imports}KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import {request_imports}
from vllm.v1.structured_output import StructuredOutputManager

TINY_LLAMA = {{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 1 << 20}}
ATTN = dict(num_kv_heads=1, head_size=16, dtype=torch.float16)
# The KV cache groups in KVCacheConfig order: (spec, number of layers).
GROUPS = [{groups}]
NUM_GPU_BLOCKS, CPU_CHUNKS, BLOCKS_PER_CHUNK = {num_gpu_blocks}, {cpu_chunks}, {bpc}
EXTRA_CONFIG = {extra!r}  # kv_connector_extra_config besides cpu_bytes_to_use
MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, MAX_MODEL_LEN = {batched}, {seqs}, {max_model_len}
STORE_LATENCY, LOAD_LATENCY = {store}, {load}  # steps until the worker reports a job done
# (id, segments (seed, length), arrival, max_tokens, abort step, kv_transfer_params, SamplingParams)
REQUESTS = [{requests}]
SEED, STEP_CAP{spec_names} = {seed}, {step_cap}{spec_values}
{spec_constants}

def make_scheduler(model_dir):
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    layers = [f"model.layers.{{i}}.attn" for i in range(sum(n for _, n in GROUPS))]
    names = iter(layers)
    groups = [kvi.KVCacheGroupSpec([next(names) for _ in range(n)], spec) for spec, n in GROUPS]
    page = sum(spec.page_size_bytes * n for spec, n in GROUPS)
    shared = ({{"shared_by": layers}} if "shared_by" in kvi.KVCacheTensor.__dataclass_fields__
              else {{"layers": layers, "layer_stride": 0, "block_stride": page}})  # (to 0.28)
    tensor = kvi.KVCacheTensor(size=page * NUM_GPU_BLOCKS, **shared)
    kv_cache_config = kvi.KVCacheConfig(num_blocks=NUM_GPU_BLOCKS, kv_cache_tensors=[tensor],
                                        kv_cache_groups=groups)
    align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT  # the CPU tier's chunk, aligned
    chunk = -(-page * BLOCKS_PER_CHUNK // align) * align
    vc = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=MAX_MODEL_LEN),
        cache_config=CacheConfig({cache}),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={{**EXTRA_CONFIG, "cpu_bytes_to_use": chunk * CPU_CHUNKS}}))
    vc.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
{engine_lines}    if hasattr(kv_cache_config, "prefix_cache_retention_interval"):  # as the planner copies it
        kv_cache_config.prefix_cache_retention_interval = (
            vc.cache_config.prefix_cache_retention_interval)
    sc = vc.scheduler_config
    sc.max_num_batched_tokens, sc.max_num_seqs = MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
    sc.disable_hybrid_kv_cache_manager = False  # as on CUDA (on CPU vLLM merges the groups)
    block_size, hash_block_size = kcu.resolve_kv_cache_block_sizes(kv_cache_config, vc)
    sched = Scheduler(vllm_config=vc, kv_cache_config=kv_cache_config, log_stats=False,
                      structured_output_manager=StructuredOutputManager(vc),
                      block_size=block_size, hash_block_size=hash_block_size)
    assert len(sched.kv_cache_manager.coordinator.single_type_managers) == len(GROUPS)
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    return sched, kcu.get_request_block_hasher(hash_block_size, hash_fn), hash_block_size


def make_request(index, hasher):
    rid, segments, _, decode, _, params, sampling = REQUESTS[index]
    tokens = [(seed * 7919 + i * 104729 + 17) % 32000 for seed, n in segments for i in range(n)]
    extra = {{"extra_args": {{"kv_transfer_params": params}}}} if params else {{}}
    extra.update(sampling)
    return Request(request_id=rid, prompt_token_ids=tokens, pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=decode, ignore_eos=True, **extra),
                   arrival_time=float(index), block_hasher=hasher)


def worker_output(sched, out, t, pending):
    """Step t's output: a token per request at its end; the transfers due, out of pending."""
    order = list(out.num_scheduled_tokens)
    reqs = [sched.requests[rid] for rid in order]  # arrival_time: the request's index
{sampled}    done = {{j: pending.pop(j) for j in sorted(pending) if pending[j][0] <= t + 1}}
    loads = {{rid for _, rid in done.values() if rid is not None}}
    kvo = KVConnectorOutput(finished_recving=loads or None,
                            kv_connector_worker_meta=OffloadingWorkerMetadata(
                                completed_jobs=dict.fromkeys(done, 1))) if done else None
    return ModelRunnerOutput(req_ids=order, req_id_to_index={{r: i for i, r in enumerate(order)}},
                             sampled_token_ids=sampled, kv_connector_output=kvo), done
{helpers}

def test_{name}(tmp_path):
{debug_guard}    sched, hasher, hash_block_size = make_scheduler(tmp_path)
    pending = {{}}  # job id -> (step due, request of a load)
{before_loop}    for t in range(STEP_CAP):
        for i, (rid, _, arrival, _, abort_at, _, _) in enumerate(REQUESTS):
            if arrival == t{skip}:
                sched.add_request(make_request(i, hasher))
{abort_lines}{event_lines}        if not sched.has_requests() and not pending:
            if all(r[2] <= t for r in REQUESTS):
                return  # every request finished
            continue  # nothing to do before the next arrival
        out = sched.schedule()
        meta = out.kv_connector_metadata
{after_schedule}        stores, loads = meta.store_jobs or {{}}, meta.load_jobs or {{}}
        pending.update({{j: (t + STORE_LATENCY, None) for j in stores}})
        pending.update({{j: (t + LOAD_LATENCY, job.req_id) for j, job in loads.items()}})
        for j in set(meta.jobs_to_flush or ()) & set(pending):  # a flushed store ends now
            pending[j] = (t, pending[j][1])
{job_check}        output, done = worker_output(sched, out, t, pending)
        sched.update_from_output(out, output)
{drafter}{after_update}    raise AssertionError(f"requests unfinished after {{STEP_CAP}} steps: {{list(sched.requests)}}")
'''
