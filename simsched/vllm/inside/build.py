"""Layout -> real vLLM config objects (runs inside a release worker only).

:class:`ConfigBuilder` builds the expensive base ``VllmConfig`` (a real ``ModelConfig`` over a tiny
Llama ``config.json``) once per worker, then derives each layout's ``VllmConfig`` and
``KVCacheConfig`` cheaply by shallow copies of the sub-configs that change. A layout of groups
gets its ``KVCacheConfig`` built by hand; a layout of layers gets the one the release's own
planner builds (:class:`Planner`).

Release differences are detected by what exists (dataclass fields, module attributes), never by
version strings; :data:`ConfigBuilder.features` lists what was detected. A kind or knob a release
cannot express raises :class:`Unsupported`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch

from simsched.layout import KINDS, Layout, RetentionUnset, cache_block_size, deployment_refusal

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 1 << 20,
    "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 16,
}
HEAD_SIZE = 16
DTYPE = torch.float16
ENGINE_ID = "simsched"


class Unsupported(Exception):
    """The release cannot express this layout (a kind or an engine knob it lacks)."""


class Refused(Exception):
    """The release's planner refused the engine at start-up (its ValueError's message)."""


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
        self.offloading(layout, vc, kvc)
        self.retention(layout, vc, kvc)
        return vc, kvc

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
    def planner(self) -> "Planner":
        if self._planner is None:
            self._planner = Planner(self)
        return self._planner

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


def _raised_in(exc: BaseException, function: str) -> bool:
    """Whether ``function`` is on the traceback of ``exc`` (the check that refused)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


def innermost_vllm_frame(exc: BaseException, vllm_dir: str) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback in vLLM's own code (``vllm_dir``): the
    function that raised, or refused."""
    prefix = vllm_dir + os.sep
    inner = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename).startswith(prefix):
            inner = frame
    return inner


def _refusal(exc: BaseException) -> str:
    """A planner's refusal in one line: the exception, the vLLM function that raised it, and its
    message."""
    vllm_dir = os.path.dirname(os.path.abspath(importlib.import_module("vllm").__file__))
    inner = innermost_vllm_frame(exc, vllm_dir)
    function = inner.name if inner is not None else "?"
    return f"{type(exc).__name__} in {function}: {' '.join(str(exc).split())}"


class Planner:
    """A layout of layers -> the ``KVCacheConfig`` the release's own planner builds.

    A deployment never writes its KV cache groups: each attention layer declares a spec
    (``Attention.get_kv_cache_spec``), and ``EngineCore._initialize_kv_caches`` hands them to
    ``get_kv_cache_configs`` (``v1/core/kv_cache_utils.py``; ``kv_cache_planning.py`` from
    0.33.0), which groups the layers, sizes the pool and runs the start-up checks: the longest
    request must fit the pool as the release counts it (``_check_enough_kv_cache_memory``; from
    0.29.0 with the null block held back). The same calls run here on the specs of the layout's
    layers, with ``num_gpu_blocks_override`` for the case's pool (a flag every release's planner
    honours: it checks and sizes against that many blocks)."""

    #: the layout language's kinds (``simsched.layout.KINDS``) by spec class name
    KIND_OF_SPEC = {name: kind for kind, name in KINDS.items()}
    DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

    def __init__(self, builder: ConfigBuilder):
        self.builder = builder
        module = importlib.import_module("vllm.v1.core.kv_cache_utils")
        self.generate_scheduler_kv_cache_config = module.generate_scheduler_kv_cache_config
        try:        # 0.33.0 moved the planner out of kv_cache_utils
            module = importlib.import_module("vllm.v1.core.kv_cache_planning")
        except ImportError:
            pass
        self.planning = module
        # 0.33.0: the global groups are computed first, then passed in
        self.takes_global_groups = "global_kv_cache_groups" in inspect.signature(
            module.get_kv_cache_configs).parameters

    def layer_specs(self, layout: Layout, cache_config=None) -> dict[str, Any]:
        """One spec per layer, named as a model's layers are; the drafter's layers after the
        target's, as the drafter model registers them after the target model."""
        block_size = layout.engine.block_size or 16
        if any(x.kind == "mamba" for x in layout.layers):
            # the hybrid model's block size, as the platform aligned it (ConfigBuilder.vllm_config)
            cache_config = cache_config or self.builder.vllm_config(layout).cache_config
            block_size = cache_config.block_size
        # MambaBase.get_kv_cache_spec: vllm_config.num_speculative_tokens (0.25.1-0.28.0:
        # speculative_config's) under speculative decoding
        spec_blocks = getattr(layout, "num_speculative_blocks", 0)
        layers = [x for x in layout.layers if not x.drafter] + [
            x for x in layout.layers if x.drafter]
        specs: dict[str, Any] = {}
        for layer in layers:
            prefix = "drafter.layers" if layer.drafter else "model.layers"
            for _ in range(layer.count):
                specs[f"{prefix}.{len(specs)}.attn"] = self.spec(layer, block_size, cache_config,
                                                                 spec_blocks)
        return specs

    def mamba_spec(self, layer, cache_config, num_speculative_blocks: int) -> Any:
        """A Mamba layer's spec as ``MambaBase.get_kv_cache_spec`` builds it
        (``model_executor/layers/mamba/abstract.py``; 0.25.1:44-60, 0.28.0:63-79, 0.30.0:67-86,
        0.33.0:72-91): the layer's state shapes and dtypes, ``cache_config.mamba_block_size``
        and ``mamba_page_size_padded`` as the platform's hybrid alignment left them, its
        ``mamba_type``, the engine's ``mamba_cache_mode``, and a state block per speculative
        token."""
        b = self.builder
        names = b.spec_fields["mamba"]
        dtype = self.DTYPES[layer.dtype]
        kw: dict[str, Any] = {"shapes": tuple(layer.shapes),
                              "dtypes": tuple(dtype for _ in layer.shapes),
                              "block_size": cache_config.mamba_block_size,
                              "page_size_padded": cache_config.mamba_page_size_padded,
                              "mamba_type": self.mamba_type(layer.mamba_type)}
        if "mamba_cache_mode" in names:
            kw["mamba_cache_mode"] = cache_config.mamba_cache_mode
        if num_speculative_blocks:
            kw["num_speculative_blocks"] = num_speculative_blocks
        return b.spec_classes["mamba"](**kw)

    @staticmethod
    def mamba_type(name: str) -> Any:
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        try:
            return MambaAttentionBackendEnum[name.upper()]
        except KeyError:
            raise Unsupported(f"mamba_type {name!r}: this release's "
                              "MambaAttentionBackendEnum has no such member") from None

    def attention_model_config(self, layer) -> Any:
        """A ``ModelConfig`` of a model whose attention layers are ``layer`` (its KV heads,
        head size and dtype in the model's ``config.json``): the platform sizes the attention
        page from ``model_config.get_num_kv_heads`` / ``get_head_size`` / ``dtype``. One a
        worker per shape."""
        key = (layer.num_kv_heads, layer.head_size, layer.dtype)
        cache = self.__dict__.setdefault("_model_configs", {})
        if key not in cache:
            from vllm.config import ModelConfig
            cfg = dict(TINY_LLAMA, num_key_value_heads=layer.num_kv_heads,
                       num_attention_heads=layer.num_kv_heads * 2, head_dim=layer.head_size,
                       hidden_size=layer.num_kv_heads * 2 * layer.head_size,
                       torch_dtype=layer.dtype)
            path = Path(self.builder.model_dir).parent / (
                "simsched-tiny-llama-%d-%d-%s" % key)
            path.mkdir(parents=True, exist_ok=True)
            (path / "config.json").write_text(json.dumps(cfg, indent=1))
            cache[key] = ModelConfig(model=str(path), skip_tokenizer_init=True,
                                     dtype=layer.dtype, max_model_len=1 << 20)
        return cache[key]

    def align_hybrid(self, layout: Layout, vc) -> None:
        """``vc.cache_config`` (a copy) as a GPU deployment of this hybrid model has it: the
        engine's ``mamba_cache_mode``, then the release's own
        ``Platform._align_hybrid_block_size`` (``platforms/interface.py``; run by
        ``update_block_size_for_backend`` for a hybrid model at executor start-up, every
        release 0.25.1-0.33.0): it raises ``block_size`` until an attention page holds a Mamba
        state page (to a multiple of the backend's smallest kernel block), sets
        ``mamba_block_size`` (align: ``block_size``) and ``mamba_page_size_padded`` (the
        attention page). Stubbed, as a CPU worker has neither: the model class
        (``ModelRegistry.resolve_model_cls``: a class giving the Mamba layers' shapes and
        dtypes) and the layers' attention backends (FlashAttention, a GPU deployment's
        default, imported on CPU; 0.32.0+ asks the model's layers for them,
        ``_find_non_ssm_backends``)."""
        mamba = next(x for x in layout.layers if x.kind == "mamba")
        attention = [x for x in layout.layers if x.kind != "mamba" and not x.drafter]
        if any(x.kind in ("mla", "sliding_window_mla") for x in attention):
            raise Unsupported("Mamba layers beside MLA: the alignment sizes an MLA model's "
                              "attention page from its model config, which the worker lacks")
        cc = vc.cache_config
        for name in ("mamba_block_size", "mamba_page_size_padded"):
            if not hasattr(cc, name):
                raise Unsupported(f"Mamba layers: CacheConfig has no {name}")
        if not hasattr(cc, "mamba_cache_mode"):
            if mamba.mamba_cache_mode != "none":
                raise Unsupported("mamba_cache_mode: CacheConfig has no mamba_cache_mode")
        else:
            cc.mamba_cache_mode = mamba.mamba_cache_mode
        try:
            from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        except Exception as e:   # noqa: BLE001
            raise Unsupported(f"Mamba layers: FlashAttentionBackend does not import on CPU "
                              f"({type(e).__name__}: {e})") from None
        from vllm.model_executor.models import ModelRegistry
        from vllm.platforms.interface import Platform

        dtype = self.DTYPES[mamba.dtype]
        shapes = tuple(mamba.shapes)

        class HybridModel:
            """The hybrid model class the registry resolves (``IsHybrid``)."""
            @classmethod
            def get_mamba_state_shape_from_config(cls, vllm_config):
                return shapes

            @classmethod
            def get_mamba_state_dtype_from_config(cls, vllm_config):
                return tuple(dtype for _ in shapes)

        class GpuPlatform(Platform):
            @classmethod
            def _find_non_ssm_backends(cls, vllm_config):
                return [FlashAttentionBackend]

            @classmethod
            def _find_non_ssm_backend(cls, vllm_config):
                return FlashAttentionBackend

        align = vc.model_config
        vc.model_config = self.attention_model_config(attention[0])
        ModelRegistry.resolve_model_cls = lambda *a, **k: (HybridModel, "HybridModel")
        try:
            GpuPlatform._align_hybrid_block_size(vc, FlashAttentionBackend)
        finally:
            del ModelRegistry.resolve_model_cls
            vc.model_config = align
        if cc.mamba_block_size is None:
            # "none" mode: MambaModelConfig.verify_and_update_config makes the Mamba block
            # max_model_len (a state a request), the case's, which this config does not have yet
            raise Unsupported("mamba_cache_mode none: a Mamba block of max_model_len tokens is "
                              "not planned here yet")

    def spec(self, layer, block_size: int, cache_config=None, num_speculative_blocks: int = 0
             ) -> Any:
        b = self.builder
        cls = b.spec_classes.get(layer.kind)
        if cls is None:
            raise Unsupported(f"kind {layer.kind!r}: this release has no {KINDS[layer.kind]}")
        if layer.kind == "mamba":
            return self.mamba_spec(layer, cache_config, num_speculative_blocks)
        mla = layer.kind in ("mla", "sliding_window_mla")
        kw: dict[str, Any] = {"block_size": block_size, "dtype": self.DTYPES[layer.dtype],
                              # MLA caches one latent vector per token, shared by the heads
                              "num_kv_heads": 1 if mla else layer.num_kv_heads,
                              "head_size": layer.head_size}
        if layer.kind == "ring":
            # as DeepSeek V4.1's CompressorStateCache and Qwen4-exp's QSA cache declare their
            # ring: its own capacity, one head of state rows, no value half
            kw.update(block_size=layer.block_size, num_kv_heads=1)
            if "head_size_v" in b.spec_fields[layer.kind]:
                kw["head_size_v"] = 0
        if layer.kind in ("sliding_window", "sliding_window_mla"):
            kw["sliding_window"] = layer.sliding_window
        if layer.kind == "chunked_local":
            kw["attention_chunk_size"] = layer.attention_chunk_size
        if layer.drafter and "is_draft" in b.spec_fields[layer.kind]:
            kw["is_draft"] = True
        return cls(**kw)

    def plan(self, layout: Layout, vc) -> Any:
        """The scheduler's ``KVCacheConfig`` (``generate_scheduler_kv_cache_config``), or
        :class:`Refused` with the planner's message."""
        vc = copy.copy(vc)
        cc = vc.cache_config = copy.copy(vc.cache_config)
        cc.num_gpu_blocks_override = layout.engine.num_gpu_blocks
        if hasattr(cc, "kv_cache_layout") and cc.kv_cache_layout is None:
            # 0.29.0+: the engine core resolves the physical layout before planning
            # (resolve_kv_cache_layout); a value set beforehand is honoured as it is. The
            # scheduler never reads it: the legacy default NHD's
            cc.kv_cache_layout = "LBNHC"
        specs = [self.layer_specs(layout, cc)]
        memory = [1 << 50]          # the planner replaces it by the override's blocks
        try:
            if self.takes_global_groups:
                groups = self.planning.get_global_kv_cache_groups(vc, specs)
                configs = self.planning.get_kv_cache_configs(vc, specs, memory, groups)
            else:
                configs = self.planning.get_kv_cache_configs(vc, specs, memory)
        except ValueError as e:
            if _raised_in(e, "_check_enough_kv_cache_memory"):
                raise Refused(str(e)) from None
            raise Refused(_refusal(e)) from None
        except NotImplementedError as e:
            # the planner cannot lay these layers out (page sizes it cannot unify, a mix of
            # specs it has no grouping for): the engine does not start
            raise Refused(_refusal(e)) from None
        return self.generate_scheduler_kv_cache_config(configs)

    @functools.cached_property
    def holds_null_block(self) -> bool:
        """Whether the release's start-up check counts the pool less the null block (0.29.0
        on) or the whole pool: asked of its own planner, with one full-attention layer of 8
        blocks and a max_model_len of 128 tokens, which fit only with the null block."""
        layout = Layout.from_json({"layers": [{"kind": "full"}],
                                   "engine": {"num_gpu_blocks": 8}})
        vc = self.builder.vllm_config(layout)
        vc.model_config = copy.copy(vc.model_config)
        vc.model_config.max_model_len = 128
        try:
            self.plan(layout, vc)
        except Refused:
            return True
        return False

    def groups(self, kvc) -> list[dict]:
        """The planned groups as the layout language writes them (``Group.to_json``)."""
        out = []
        for g in kvc.kv_cache_groups:
            spec = g.kv_cache_spec
            kind = self.KIND_OF_SPEC.get(type(spec).__name__)
            if kind is None:
                raise Unsupported(f"the planner built a {type(spec).__name__} group, which the "
                                  "layout language does not name")
            group: dict[str, Any] = {"kind": kind, "block_size": spec.block_size}
            if len(g.layer_names) != 1:
                group["layers"] = len(g.layer_names)
            if kind in ("sliding_window", "sliding_window_mla"):
                group["sliding_window"] = spec.sliding_window
            if kind == "chunked_local":
                group["attention_chunk_size"] = spec.attention_chunk_size
            if kind == "mamba":
                group["mamba_cache_mode"] = getattr(spec, "mamba_cache_mode", "none")
            if getattr(g, "is_eagle_group", False):
                group["drafter"] = True
            out.append(group)
        return out
