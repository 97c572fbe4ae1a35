"""A layout of layers -> the ``KVCacheConfig`` the release's own planner builds (runs inside a
release worker only; vLLM is imported by the methods, as they run there).

A deployment never writes its KV cache groups: each attention layer declares a spec, and the
engine core hands them to the release's planner (``get_kv_cache_configs``), which groups the
layers, sizes the pool and runs the start-up checks. :class:`Planner` runs the same calls on the
specs of a layout's layers, and for a hybrid model with Mamba layers first plays the platform's
block-size alignment. Its ``builder`` is the worker's
:class:`~simsched.vllm.inside.build.ConfigBuilder` (the base ``VllmConfig``, the spec classes
and fields this release has, a model config per attention shape), which holds one planner.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
from typing import Any

import torch

from simsched.layout import KINDS, Layout

from .refusal import Refused, Unsupported, raised_in, refusal


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

    def __init__(self, builder: Any):
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
        vc.model_config = self.builder.attention_model_config(attention[0])
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
            if raised_in(e, "_check_enough_kv_cache_memory"):
                raise Refused(str(e)) from None
            raise Refused(refusal(e)) from None
        except NotImplementedError as e:
            # the planner cannot lay these layers out (page sizes it cannot unify, a mix of
            # specs it has no grouping for): the engine does not start
            raise Refused(refusal(e)) from None
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
