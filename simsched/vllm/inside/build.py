"""Layout -> real vLLM config objects (runs inside a release worker only).

:class:`ConfigBuilder` builds the expensive base ``VllmConfig`` (a real ``ModelConfig`` over a tiny
Llama ``config.json``) once per worker, then derives each layout's ``VllmConfig`` and
``KVCacheConfig`` cheaply by shallow copies of the sub-configs that change. A layout of groups
gets its ``KVCacheConfig`` built by hand; a layout of layers gets the one the release's own
planner builds (:class:`~simsched.vllm.inside.planner.Planner`, one a builder), with a
``ModelConfig`` per attention shape of its layers (:meth:`ConfigBuilder.attention_model_config`).

Release differences are detected by what exists (dataclass fields, module attributes), never by
version strings; :data:`ConfigBuilder.features` lists what was detected. A kind or knob a release
cannot express raises :class:`~simsched.vllm.inside.refusal.Unsupported`; the planner's refusal
:class:`~simsched.vllm.inside.refusal.Refused` (both importable from here, as the engine reads
them).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from simsched.layout import Layout, RetentionUnset, cache_block_size, deployment_refusal
from simsched.model import unmodelled_path

from .planner import Planner
from .refusal import Refused, Unsupported

__all__ = ["ConfigBuilder", "Refused", "Unsupported", "write_model_dir"]

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 1 << 20,
    "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 16,
}
HEAD_SIZE = 16
DTYPE = torch.float16
ENGINE_ID = "simsched"


def _init_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def write_model_dir(cache_dir: str | os.PathLike) -> str:
    path = Path(cache_dir) / "simsched-tiny-llama"
    path.mkdir(parents=True, exist_ok=True)
    cfg = path / "config.json"
    text = json.dumps(TINY_LLAMA, indent=1)
    if not cfg.exists() or cfg.read_text() != text:
        cfg.write_text(text)
    return str(path)


class ConfigBuilder:
    def __init__(self, cache_dir: str | os.PathLike | None = None):
        import vllm.v1.kv_cache_interface as kvi
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                                 ParallelConfig, VllmConfig)

        self.kvi = kvi
        cache_dir = cache_dir or os.environ.get("VLLM_CACHE_ROOT") or "/tmp/simsched-vllm"
        self.model_dir = write_model_dir(cache_dir)
        self.KVTransferConfig = KVTransferConfig
        self.spec_classes = {kind: getattr(kvi, name, None) for kind, name in {
            "full": "FullAttentionSpec", "mla": "MLAAttentionSpec",
            "sliding_window": "SlidingWindowSpec", "sliding_window_mla": "SlidingWindowMLASpec",
            "chunked_local": "ChunkedLocalAttentionSpec", "mamba": "MambaSpec",
            "ring": "CircularBufferSpec", "cross_attention": "CrossAttentionSpec"}.items()}
        self.spec_fields = {k: _init_fields(c) for k, c in self.spec_classes.items() if c}
        self.group_fields = _init_fields(kvi.KVCacheGroupSpec)
        self.config_fields = _init_fields(kvi.KVCacheConfig)
        self.tensor_fields = _init_fields(kvi.KVCacheTensor)
        self.cache_fields = _init_fields(CacheConfig)
        self.parallel_fields = _init_fields(ParallelConfig)
        # prefix_match_unit (0.26+) was hash_block_size (0.25.1) on CacheConfig.
        self.match_unit_field = next((n for n in ("prefix_match_unit", "hash_block_size")
                                      if n in self.cache_fields), None)
        self.retention_field = ("prefix_cache_retention_interval"
                                if "prefix_cache_retention_interval" in self.cache_fields else None)
        # 0.29.0's EngineArgs leaves an interval the user did not give unset until it knows the
        # model and the drafting (create_engine_config); its sentinel marks the release that
        # resolves it so
        import vllm.engine.arg_utils as arg_utils
        self.retention_resolved_by_engine_args = hasattr(
            arg_utils, "PREFIX_CACHE_RETENTION_INTERVAL_UNSET")
        # Before 0.26.0 the scheduler knows no 'blocks_per_chunk' (only 'block_size').
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as sched
        self.knob_blocks_per_chunk = "blocks_per_chunk" in sched.SchedulerOffloadConfig._fields
        self.cpu_alignment = 1
        try:
            from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
            self.cpu_alignment = int(getattr(CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 1))
        except Exception:   # noqa: BLE001 - only the sizing hint
            pass

        model_config = ModelConfig(model=self.model_dir, skip_tokenizer_init=True,
                                   dtype="float16", max_model_len=1 << 20)
        kt = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20},
                              engine_id=ENGINE_ID)
        self.base = VllmConfig(device_config=DeviceConfig(device="cpu"),
                               model_config=model_config,
                               cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                               kv_transfer_config=kt)
        self._planner: Planner | None = None
        self._model_configs: dict[tuple, Any] = {}   # attention shape -> its ModelConfig
        try:        # 0.26.0-0.28.x; 0.25.1's CPU spec tests a block_stride
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
                is_kv_cache_tensor_packed)
            self.tensor_packed = is_kv_cache_tensor_packed
        except ImportError:
            self.tensor_packed = lambda tensor: bool(getattr(tensor, "block_stride", 0))
        self.spec_cls = None
        try:
            from vllm.config import SpeculativeConfig
            self.spec_cls = SpeculativeConfig
        except ImportError:
            pass

    @property
    def features(self) -> dict[str, Any]:
        return {
            "missing_kinds": sorted(k for k, c in self.spec_classes.items() if c is None),
            "prefix_match_unit_field": self.match_unit_field,
            "retention_field": self.retention_field,
            "is_eagle_group": "is_eagle_group" in self.group_fields,
            "kv_cache_tensor_fields": sorted(self.tensor_fields),
            "kv_cache_config_retention": "prefix_cache_retention_interval" in self.config_fields,
            "retention_resolved_by_engine_args": self.retention_resolved_by_engine_args,
            "mamba_cache_mode": "mamba_cache_mode" in self.spec_fields.get("mamba", ()),
            "spec_dcp_sharded_field": "dcp_sharded" in self.spec_fields.get("full", ()),
            "blocks_per_chunk_knob": self.knob_blocks_per_chunk,
        }

    # -- KV cache specs --------------------------------------------------------------------
    def make_spec(self, group, num_speculative_blocks: int = 0) -> Any:
        cls = self.spec_classes.get(group.kind)
        if cls is None:
            raise Unsupported(f"kind {group.kind!r}: this release has no {group.spec_name}")
        names = self.spec_fields[group.kind]
        kw: dict[str, Any] = {"block_size": group.block_size}
        if group.kind == "mamba":
            kw.update(shapes=((4, 8),), dtypes=(DTYPE,))
            if "mamba_cache_mode" in names:
                kw["mamba_cache_mode"] = group.mamba_cache_mode
            elif group.mamba_cache_mode != "none":
                raise Unsupported("mamba_cache_mode: MambaSpec has no mamba_cache_mode field")
            if num_speculative_blocks:
                # as MambaBase.get_kv_cache_spec sets it under speculative decoding
                # (Layout.num_speculative_blocks)
                kw["num_speculative_blocks"] = num_speculative_blocks
        else:
            kw.update(num_kv_heads=1, head_size=HEAD_SIZE, dtype=DTYPE)
            if group.kind in ("sliding_window", "sliding_window_mla"):
                kw["sliding_window"] = group.sliding_window
                if group.extra_retained_tokens:
                    if "extra_retained_tokens" not in names:
                        raise Unsupported(f"extra_retained_tokens: this release's "
                                          f"{group.spec_name} has no such field (0.28.0 on)")
                    kw["extra_retained_tokens"] = group.extra_retained_tokens
            if group.kind == "chunked_local":
                kw["attention_chunk_size"] = group.attention_chunk_size
        if group.drafter and "is_draft" in names:
            kw["is_draft"] = True
        return cls(**kw)

    # -- per-layout configs ---------------------------------------------------------------------
    def build(self, layout: Layout, planning=None) -> tuple[Any, Any]:
        """(VllmConfig, KVCacheConfig) for ``layout``; raises :class:`Unsupported`, and for a
        layout of layers :class:`Refused` where the planner refuses it. ``planning(vc)``: the
        config the planner runs its start-up checks with (the case's ``max_model_len`` and
        scheduler budget), required for a layout of layers."""
        if layout.layers:
            vc = self.vllm_config(layout)
            if planning is None:
                raise Unsupported("a layout of layers is planned with a case (its requests "
                                  "and budget): run it as a case")
            kvc = self.planner.plan(layout, planning(vc))
            built = self.planner.groups(kvc)
            if layout.groups and built != [g.to_json() for g in layout.groups]:
                # planned by another release (or written by hand): no engine of this one runs it
                raise Unsupported(f"this release's planner builds the groups {built} of these "
                                  f"layers, not the case's {[g.to_json() for g in layout.groups]}")
        else:
            kvc = self.kv_cache_config(layout)
            vc = self.vllm_config(layout)
        self.kv_transfer(layout, vc, kvc)
        self.retention(layout, vc, kvc)
        return vc, kvc

    def kv_transfer(self, layout: Layout, vc, kvc) -> None:
        """The case's KV connector (``engine.connector``, ``engine.secondary_tiers``:
        :mod:`simsched.connectors`) as a deployment configures it."""
        module = path_module(layout)
        if module is None:
            self.offloading(layout, vc, kvc)
        else:
            module.kv_transfer(self, layout, vc, kvc)

    def kv_cache_config(self, layout: Layout) -> Any:
        """A layout of groups' ``KVCacheConfig``, built by hand: one tensor shared by every
        layer, the groups in the layout's order."""
        kvi = self.kvi
        groups = []
        tensor_layers: list[str] = []
        bytes_per_block = 0
        n = 0
        for g in layout.groups:
            spec = self.make_spec(g, layout.num_speculative_blocks)
            names = [f"model.layers.{n + i}.attn" for i in range(g.layers)]
            n += g.layers
            tensor_layers += names
            bytes_per_block += spec.page_size_bytes * g.layers
            gkw: dict[str, Any] = {"layer_names": names, "kv_cache_spec": spec}
            if g.drafter:
                if "is_eagle_group" not in self.group_fields:
                    raise Unsupported("drafter: KVCacheGroupSpec has no is_eagle_group")
                gkw["is_eagle_group"] = True
            groups.append(kvi.KVCacheGroupSpec(**gkw))

        num_blocks = layout.engine.num_gpu_blocks
        total = bytes_per_block * num_blocks
        if "shared_by" in self.tensor_fields:        # 0.25.x-0.28.x
            tensor = kvi.KVCacheTensor(size=total, shared_by=tensor_layers)
        else:                                        # 0.29.0+: layers + strides
            tensor = kvi.KVCacheTensor(size=total, layers=tensor_layers,
                                       layer_stride=0, block_stride=bytes_per_block)
        return kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                                 kv_cache_groups=groups)

    def vllm_config(self, layout: Layout) -> Any:
        """The layout's ``VllmConfig`` but for the connector's extra config
        (:meth:`offloading`), derived from the base one."""
        eng = layout.engine
        base = self.base
        vc = copy.copy(base)
        cc = copy.copy(base.cache_config)
        # The engine's cache_config.block_size is the attention block size; Mamba groups in
        # "align" mode share it. A layout no engine builds (layout.deployment_refusal: an
        # align-mode Mamba block of another size, a "none" Mamba group under prefix caching, a
        # layout vLLM refuses under DCP by asserts only) is no behaviour of a release
        cc.block_size = (eng.block_size or 16) if layout.layers else \
            cache_block_size(layout.groups)
        why = deployment_refusal(layout) if layout.groups else None
        if why:
            raise Unsupported(why)
        cc.enable_prefix_caching = eng.enable_prefix_caching
        # An engine whose Mamba layers cache in "align" mode has cache_config.mamba_cache_mode
        # "align" (the specs take it from there); the Scheduler reads it
        # (need_mamba_block_aligned_split: prefill chunks cut at block boundaries)
        if any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in layout.groups) \
                and hasattr(cc, "mamba_cache_mode"):
            cc.mamba_cache_mode = "align"
        if eng.prefix_match_unit is not None:
            if self.match_unit_field is None:
                raise Unsupported("prefix_match_unit: CacheConfig has neither prefix_match_unit "
                                  "nor hash_block_size")
            setattr(cc, self.match_unit_field, eng.prefix_match_unit)
        if not isinstance(eng.retention_interval, RetentionUnset):     # "dense": the flag's None
            if self.retention_field is None:
                raise Unsupported("retention_interval: CacheConfig has no "
                                  "prefix_cache_retention_interval")
            setattr(cc, self.retention_field, eng.retention_interval)
        vc.cache_config = cc

        if eng.dcp_size != 1:
            pc = copy.copy(base.parallel_config)
            pc.decode_context_parallel_size = eng.dcp_size
            vc.parallel_config = pc
        if eng.speculative is not None:
            vc.speculative_config = self.speculative(eng.speculative)
        sc = vc.scheduler_config = copy.copy(base.scheduler_config)
        if eng.async_scheduling:
            if not hasattr(sc, "async_scheduling"):
                raise Unsupported("async_scheduling: SchedulerConfig has no async_scheduling")
            sc.async_scheduling = True
        if any(x.kind == "mamba" for x in layout.layers):
            self.planner.align_hybrid(layout, vc)
        if layout.layers and hasattr(sc, "disable_hybrid_kv_cache_manager"):
            # VllmConfig.__post_init__ on a GPU platform, the OffloadingConnector being
            # SupportsHMA (0.25.1-0.33.0): the hybrid KV cache manager is on, but for a model
            # with chunked local attention, where it is off by default (a latency regression;
            # VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 turns it on, but with EAGLE).
            # Off, the planner turns every local layer into full attention
            # (unify_hybrid_kv_cache_specs)
            sc.disable_hybrid_kv_cache_manager = any(
                x.kind == "chunked_local" for x in layout.layers)
        return vc

    def offloading(self, layout: Layout, vc, kvc) -> None:
        """``kv_connector_extra_config`` as a deployment passes it: the chunking knobs, and a CPU
        tier of ``cpu_chunks`` chunks of the GPU pool's bytes per block."""
        eng = layout.engine
        bpc = 1
        extra: dict[str, Any] = {}
        if eng.blocks_per_chunk is not None:
            if not self.knob_blocks_per_chunk:
                raise Unsupported("blocks_per_chunk: this release reads only "
                                  "kv_connector_extra_config['block_size']")
            extra["blocks_per_chunk"] = eng.blocks_per_chunk
            bpc = eng.blocks_per_chunk
        if eng.offload_block_size is not None:
            extra["block_size"] = eng.offload_block_size
            if eng.blocks_per_chunk is None:
                bpc = max(1, eng.offload_block_size // layout.groups[0].block_size)
        bytes_per_block = self.kv_bytes_per_block(kvc)
        chunk_bytes = (bytes_per_block * bpc + self.cpu_alignment - 1) \
            // self.cpu_alignment * self.cpu_alignment
        extra["cpu_bytes_to_use"] = chunk_bytes * eng.cpu_chunks
        if not eng.offload_prompt_only:
            extra["offload_prompt_only"] = False
        if eng.eviction_policy != "lru":
            extra["eviction_policy"] = eng.eviction_policy
        kt = copy.copy(self.base.kv_transfer_config)
        kt.kv_connector_extra_config = extra
        vc.kv_transfer_config = kt

    def kv_bytes_per_block(self, kvc) -> int:
        """GPU KV bytes of one pool block as the connector counts them, the unit of its CPU
        blocks (``build_offloading_config``'s ``worker_kv_bytes_per_block``; 0.25.1: the CPU
        spec's): from 0.29.0, where a ``KVCacheTensor`` places layers by strides, every tensor
        describes one backing allocation and its size is the whole pool; before, separate
        tensors' sizes add up, and packed ones (``is_kv_cache_tensor_packed``; 0.25.1: a
        ``block_stride``) share one allocation. A hand-built pool has one tensor; the planner's
        has one per layer slot, each shared by a layer of every group."""
        tensors = kvc.kv_cache_tensors
        separate = "shared_by" in self.tensor_fields and not all(
            self.tensor_packed(t) for t in tensors)
        total = sum(t.size for t in tensors) if separate else tensors[0].size
        return total // kvc.num_blocks

    @property
    def planner(self) -> Planner:
        if self._planner is None:
            self._planner = Planner(self)
        return self._planner

    def attention_model_config(self, layer) -> Any:
        """A ``ModelConfig`` of a model whose attention layers are ``layer`` (its KV heads,
        head size and dtype in the model's ``config.json``): the platform sizes the attention
        page from ``model_config.get_num_kv_heads`` / ``get_head_size`` / ``dtype``. One a
        worker per shape."""
        key = (layer.num_kv_heads, layer.head_size, layer.dtype)
        cache = self._model_configs
        if key not in cache:
            from vllm.config import ModelConfig
            cfg = dict(TINY_LLAMA, num_key_value_heads=layer.num_kv_heads,
                       num_attention_heads=layer.num_kv_heads * 2, head_dim=layer.head_size,
                       hidden_size=layer.num_kv_heads * 2 * layer.head_size,
                       torch_dtype=layer.dtype)
            path = Path(self.model_dir).parent / (
                "simsched-tiny-llama-%d-%d-%s" % key)
            path.mkdir(parents=True, exist_ok=True)
            (path / "config.json").write_text(json.dumps(cfg, indent=1))
            cache[key] = ModelConfig(model=str(path), skip_tokenizer_init=True,
                                     dtype=layer.dtype, max_model_len=1 << 20)
        return cache[key]

    def retention(self, layout: Layout, vc, kv_cache_config) -> None:
        """``prefix_cache_retention_interval`` as an engine has it: in ``cache_config`` (the
        connector reads it) and in the ``KVCacheConfig`` (the KV cache manager reads it), where
        the planner copies it (``get_kv_cache_config_from_groups``). A case's value is set by
        :meth:`build`. Left out, it is the ``CacheConfig`` field's own default, which the base
        config already holds, and on 0.29.0 ``EngineArgs.create_engine_config``'s rule: None
        (dense) for a hybrid model with EAGLE-style drafting. A VllmConfig built by hand skips
        EngineArgs, and the tiny Llama is no hybrid model, so the rule is played here on the
        layout, with the real ``SpeculativeConfig.use_eagle()``."""
        if self.retention_field is None:
            return                      # before 0.29.0: no interval, on either side
        cc = vc.cache_config
        if isinstance(layout.engine.retention_interval, RetentionUnset) \
                and self.retention_resolved_by_engine_args and layout.hybrid \
                and vc.speculative_config is not None and vc.speculative_config.use_eagle():
            setattr(cc, self.retention_field, None)
        if "prefix_cache_retention_interval" in self.config_fields:
            kv_cache_config.prefix_cache_retention_interval = getattr(cc, self.retention_field)

    def speculative(self, spec) -> Any:
        """A SpeculativeConfig carrying ``method`` and ``num_speculative_tokens``.

        A real ``SpeculativeConfig`` needs a draft model (or, for ngram, a full engine model
        config) and resolves it in ``__post_init__``. Offline, the smallest honest construction is
        an instance of the real class made without ``__init__``, every field set to its declared
        default and then ``method``/``num_speculative_tokens``: the release's own methods
        (``use_eagle()``, ``use_eagle_block_drop()``, ...) then run on real attribute values.
        """
        if self.spec_cls is None:
            raise Unsupported("speculative: no SpeculativeConfig")
        cls = self.spec_cls
        obj = object.__new__(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = None
            object.__setattr__(obj, f.name, value)
        object.__setattr__(obj, "method", spec.method)
        object.__setattr__(obj, "num_speculative_tokens", spec.num_tokens)
        return obj


def path_module(layout: Layout):
    """The harness's module of the case's connector path (:mod:`simsched.connectors`), which
    builds its ``kv_transfer_config`` (``kv_transfer(builder, layout, vc, kvc)``) and drives it
    (``driver(sched, tph, case)``, a :class:`~simsched.vllm.inside.connector.ConnectorDriver`):
    ``simple_cpu``, ``multi``, ``tiering`` (an ``OffloadingConnector`` with secondary tiers);
    None for the ``OffloadingConnector`` alone (:mod:`~simsched.vllm.inside.offloading`)."""
    engine = layout.engine
    name = "tiering" if engine.secondary_tiers else engine.connector.kind
    if name == "offloading":
        return None
    try:
        return importlib.import_module(f"simsched.vllm.inside.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"simsched.vllm.inside.{name}":
            raise
        raise Unsupported(f"{unmodelled_path(layout)}: the harness does not drive this "
                          "connector path yet") from None
