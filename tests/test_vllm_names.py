"""The model's classes and hooks are named as vLLM names them.

Each row names a model class, the vLLM class it mirrors (its file in an installed release) and
the methods both have. The names are checked against the release's own source (parsed, not
imported), so a row cannot name a vLLM class or method that does not exist; then against the
model. A release that is not installed fails the test."""

from __future__ import annotations

import ast
import importlib

import pytest

from simsched.vllm import releases as rel

CONNECTOR = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
CPU_MANAGER = "v1/kv_offload/cpu/manager.py"

#: (model module, class, release, vLLM file, vLLM class, methods of both)
MIRRORS = [
    ("simsched.model.offloading_scheduler", "OffloadingConnectorScheduler", "0.33.0", CONNECTOR,
     "OffloadingConnectorScheduler",
     ["on_new_request", "get_num_new_matched_tokens", "_lookup_complete_chunks",
      "update_state_after_alloc", "build_connector_meta", "_build_store_jobs",
      "request_finished"]),
    ("simsched.model.offloading_scheduler", "RequestOffloadState", "0.33.0", CONNECTOR, "RequestOffloadState", []),
    ("simsched.model.offloading_scheduler", "RequestGroupState", "0.33.0", CONNECTOR, "RequestGroupState", []),
    ("simsched.model.cpu_manager", "CPUOffloadingManager", "0.33.0", CPU_MANAGER,
     "CPUOffloadingManager",
     ["lookup", "prepare_load", "touch", "complete_load", "prepare_store", "complete_store",
      "on_request_finished"]),
    ("simsched.model.cpu_manager", "RankedCPUManager", "0.33.0", "v1/kv_offload/cpu/policies/lru.py",
     "LRUCachePolicy", ["evict", "touch", "on_request_finished"]),
    ("simsched.model.cpu_manager", "CPUOffloadingManager", "0.30.0",
     "v1/kv_offload/cpu/policies/lru.py", "LRUCachePolicy", ["evict", "touch"]),
    ("simsched.model.cpu_manager", "ChunkStatus", "0.33.0", "v1/kv_offload/cpu/policies/base.py",
     "ChunkStatus", ["is_ready"]),
    *[("simsched.model.tiering_manager", "TieringOffloadingManager", v,
       "v1/kv_offload/tiering/manager.py", "TieringOffloadingManager",
       ["lookup", "_initiate_promotion", "_flush_pending_promotions", "prepare_store",
        "complete_store", "create_store_job", "prepare_load", "complete_load", "on_new_request",
        "on_request_finished", "_maybe_finalize_request", "on_schedule_end", "has_pending_work",
        "_maybe_process_finished_jobs", "_process_finished_jobs", "_next_job_id"])
      for v in ("0.30.0", "0.33.0")],
    ("simsched.model.tiering_manager", "RequestState", "0.33.0",
     "v1/kv_offload/tiering/manager.py", "RequestState", []),
    ("simsched.model.fs_tier", "FileSystemTierManager", "0.33.0",
     "v1/kv_offload/tiering/fs/manager.py", "FileSystemTierManager",
     ["lookup", "submit_store", "submit_load", "get_finished_jobs"]),
    ("simsched.model.fs_tier", "AsyncLookupManager", "0.33.0",
     "v1/kv_offload/tiering/async_lookup.py", "AsyncLookupManager",
     ["lookup", "flush", "drain_results", "cleanup"]),
    ("simsched.model.fs_tier", "LookupState", "0.33.0", "v1/kv_offload/tiering/async_lookup.py",
     "LookupState", []),
    ("simsched.model.fs_tier", "TransferJob", "0.33.0", "v1/kv_offload/tiering/base.py",
     "TransferJob", []),
    ("simsched.model.multi_connector", "MultiConnector", "0.33.0",
     "distributed/kv_transfer/kv_connector/v1/multi_connector.py", "MultiConnector",
     ["on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
      "request_finished"]),
    ("simsched.model.nixl_scheduler", "NixlPullConnectorScheduler", "0.33.0",
     "distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py",
     "NixlPullConnectorScheduler",
     ["get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"]),
    ("simsched.model.nixl_scheduler", "NixlPullConnectorScheduler", "0.33.0",
     "distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py",
     "NixlBaseConnectorScheduler",
     ["on_new_request", "build_connector_meta", "get_exchange_clipped_blocks",
      "_get_remote_prefill_token_count"]),
    ("simsched.model.block_pool", "BlockPool", "0.33.0", "v1/core/block_pool.py", "BlockPool",
     ["get_new_blocks", "free_blocks", "touch", "get_num_free_blocks"]),
    ("simsched.model.block_pool", "FreeKVCacheBlockQueue", "0.33.0", "v1/core/kv_cache_utils.py",
     "FreeKVCacheBlockQueue", ["popleft_n", "remove", "append_n", "prepend_n",
                               "get_all_free_blocks"]),
    ("simsched.model.block_pool", "BlockHashToBlockMap", "0.33.0", "v1/core/block_pool.py",
     "BlockHashToBlockMap", ["get_one_block", "insert", "pop"]),
    ("simsched.model.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "0.33.0",
     "v1/core/single_type_kv_cache_manager.py", "SingleTypeKVCacheManager",
     ["get_num_skipped_tokens", "get_num_blocks_to_allocate", "remove_skipped_blocks",
      "cache_blocks", "reachable_block_mask", "new_step_starts"]),
    ("simsched.model.single_type_kv_cache_manager", "SlidingWindowManager", "0.33.0",
     "v1/core/single_type_kv_cache_manager.py", "SlidingWindowManager",
     ["get_num_skipped_tokens", "reachable_block_mask"]),
    ("simsched.model.single_type_kv_cache_manager", "ChunkedLocalAttentionManager", "0.33.0",
     "v1/core/single_type_kv_cache_manager.py", "ChunkedLocalAttentionManager",
     ["get_num_skipped_tokens"]),
    ("simsched.model.single_type_kv_cache_manager", "MambaManager", "0.33.0",
     "v1/core/single_type_kv_cache_manager.py", "MambaManager",
     ["get_num_skipped_tokens", "get_num_blocks_to_allocate", "remove_skipped_blocks",
      "reachable_block_mask", "new_step_starts"]),
    ("simsched.model.single_type_kv_cache_manager", "CircularBufferManager", "0.33.0",
     "v1/core/single_type_kv_cache_manager.py", "CircularBufferManager",
     ["get_num_blocks_to_allocate", "remove_skipped_blocks"]),
    ("simsched.model.single_type_kv_cache_manager", "FullAttentionManager", "0.33.0",
     "v1/core/single_type_kv_cache_manager.py", "FullAttentionManager", []),
    ("simsched.model.simple_cpu_scheduler", "SimpleCPUOffloadScheduler", "0.30.0",
     "v1/simple_kv_offload/manager.py", "SimpleCPUOffloadScheduler",
     ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
      "prepare_store_specs", "_prepare_lazy_store_specs", "_prepare_eager_store_specs",
      "_select_eager_blocks_to_store", "_process_store_event", "_process_store_completion",
      "request_finished", "has_pending_stores"]),
    ("simsched.model.simple_cpu_scheduler_legacy", "LegacySimpleCPUOffloadScheduler", "0.29.0",
     "v1/simple_kv_offload/manager.py", "SimpleCPUOffloadScheduler",
     ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
      "prepare_store_specs", "_prepare_lazy_store_specs", "_prepare_eager_store_specs",
      "_process_store_event", "_process_store_completion", "request_finished",
      "has_pending_stores"]),
    ("simsched.model.kv_cache_manager", "KVCacheManager", "0.33.0", "v1/core/kv_cache_manager.py",
     "KVCacheManager", ["get_computed_blocks", "allocate_slots", "remove_skipped_blocks",
                        "free"]),
]


def _vllm_methods(version: str, path: str, cls: str) -> set[str]:
    have = {r.version: r for r in rel.installed()}
    assert version in have, f"vLLM {version} not installed: run `simsched releases install`"
    tree = ast.parse((have[version].path / "vllm" / path).read_text())
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    assert node is not None, f"vLLM {version} has no class {cls} in {path}"
    return {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))}


@pytest.mark.parametrize("module, cls, version, path, vllm_cls, methods", MIRRORS,
                         ids=[f"{m[1]}~{m[4]}@{m[2]}" for m in MIRRORS])
def test_model_class_is_named_as_vllm(module, cls, version, path, vllm_cls, methods):
    vllm = _vllm_methods(version, path, vllm_cls)
    assert set(methods) <= vllm, f"not methods of vLLM's {vllm_cls}: {set(methods) - vllm}"
    model_cls = getattr(importlib.import_module(module), cls, None)
    assert model_cls is not None, f"{module} has no class {cls} (vLLM's {vllm_cls})"
    # (a method or a property: a compiled class holds its properties as descriptors)
    missing = [m for m in methods if not hasattr(model_cls, m)]
    assert not missing, f"{module}.{cls} lacks vLLM's {vllm_cls} methods {missing}"
