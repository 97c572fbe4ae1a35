"""The layout language: what reaches vLLM's offloading scheduler.

A layout is the KV cache groups of a model (their kinds and block sizes) plus the engine knobs that
shape offloading. It is plain data: ``Layout.from_json`` validates a JSON object and refuses an
impossible layout with a :class:`LayoutError` that names the field and the reason; ``to_json``
gives the same object back. Configurations that vLLM itself rejects (for instance both
``blocks_per_chunk`` and ``offload_block_size`` set) are *not* refused here: predicting and
observing vLLM's own error is the point of the tool.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from simsched.connectors import Connector, SecondaryTier, secondary_tiers_from_json
from simsched.fields import MAX_TOKENS, LayoutError, boolean, choice, integer, take

#: Group kinds and what each one is in vLLM (``vllm/v1/kv_cache_interface.py``).
KINDS: dict[str, str] = {
    "full": "FullAttentionSpec",
    "mla": "MLAAttentionSpec",
    "sliding_window": "SlidingWindowSpec",
    "sliding_window_mla": "SlidingWindowMLASpec",
    "chunked_local": "ChunkedLocalAttentionSpec",
    "mamba": "MambaSpec",
    "ring": "CircularBufferSpec",
    "cross_attention": "CrossAttentionSpec",
}
#: Kinds whose attention reaches back only a bounded number of tokens.
WINDOWED_KINDS = ("sliding_window", "sliding_window_mla")
#: Kinds whose manager frees the blocks out of reach and puts the null block in their place
#: (``remove_skipped_blocks``; a hit pads them with it): the only tables with null blocks.
SKIPPING_KINDS = ("sliding_window", "sliding_window_mla", "chunked_local", "mamba")
#: Kinds whose block size is scaled by decode context parallelism (attention specs).
DCP_SHARDED_KINDS = tuple(k for k in KINDS if k != "mamba")
#: Kinds vLLM's KV cache manager refuses under decode context parallelism (``dcp_size`` > 1),
#: in every release 0.25.1-0.33.0, by asserts only: ``SlidingWindowManager`` and
#: ``ChunkedLocalAttentionManager.find_longest_cache_hit`` ("DCP not support sliding window /
#: chunked local attn now.", ``v1/core/single_type_kv_cache_manager.py``),
#: ``SlidingWindowSpec.max_memory_usage_bytes`` at start-up ("DCP not support sliding window.",
#: ``v1/kv_cache_interface.py``) and, in a hybrid layout, ``HybridKVCacheCoordinator.__init__``
#: ("DCP with hybrid KV cache layouts only supports full-attention and Mamba groups",
#: ``v1/core/kv_cache_coordinator.py``; 0.25.1: "DCP not support hybrid attn now."). No
#: deployment serves such a layout; under ``python -O`` the asserts vanish and the managers
#: look hits up at the unscaled block size, KV no engine computes. A ring (``CircularBufferSpec``,
#: 0.29.0 on) is refused by the same coordinator assert: the models that build one (DeepSeek
#: V4.1's compressor, ``models/deepseek_v41/compressor.py``) leave it ``dcp_sharded``, and 0.31.0
#: on accept only full attention, Mamba and replicated groups under DCP.
DCP_UNSUPPORTED_KINDS = ("sliding_window", "sliding_window_mla", "chunked_local", "ring")


def dcp_refusal(groups, enable_prefix_caching: bool = True) -> str | None:
    """Why no release serves these groups under decode context parallelism (None: some may).
    Besides :data:`DCP_UNSUPPORTED_KINDS`, a model of Mamba layers alone: with one group the
    ``UnitaryKVCacheCoordinator`` hands its ``dcp_world_size`` to ``MambaManager.
    find_longest_cache_hit``, which asserts "DCP not support mamba now." at the first lookup in
    every release 0.25.1-0.33.0 (``v1/core/single_type_kv_cache_manager.py``); the hybrid
    coordinator passes 1 to Mamba groups (their state is replicated, not sharded)."""
    bad = sorted({g.kind for g in groups if g.kind in DCP_UNSUPPORTED_KINDS})
    if bad:
        return (f"vLLM does not support DCP with {', '.join(bad)} groups (its asserts \"DCP "
                "not support ... now.\" in single_type_kv_cache_manager.py, the hybrid "
                "coordinator's, the start-up sizing's)")
    if len(groups) == 1 and groups[0].kind == "mamba" and enable_prefix_caching:
        return ("vLLM does not support DCP with a Mamba model's one group under prefix caching "
                "(MambaManager.find_longest_cache_hit asserts \"DCP not support mamba now.\")")
    return None


def cache_block_size(groups) -> int:
    """``cache_config.block_size`` as the engine sets it: the first attention target group's."""
    attention = [g for g in groups if g.kind != "mamba" and not g.drafter]
    return (attention[0] if attention else groups[0]).block_size


def deployment_refusal(layout: "Layout") -> str | None:
    """Why no engine of any release builds this layout (None: some may). The release harness
    answers ``unsupported`` for it, and a campaign reports nothing the model alone shows on it.

    - With Mamba prefix caching ("align") every release sets ``cache_config.mamba_block_size =
      cache_config.block_size`` (the platform's hybrid block-size alignment, after raising the
      attention block to fit the Mamba page): an align-mode Mamba group of another size is a
      layout no engine has.
    - With prefix caching on, ``MambaModelConfig.verify_and_update_config`` (run for every hybrid
      model through ``HybridAttentionMambaModelConfig``) turns ``mamba_cache_mode`` "none" into
      "align" ("all" where 0.25.1's model supports it): no engine runs a "none" Mamba group with
      prefix caching, and the state it would reach (0.33.0's ``MambaManager`` asserts "Mamba
      prefix caching requires mamba_cache_mode='align'") is not a deployment's.
    - Under decode context parallelism, :func:`dcp_refusal`.
    """
    groups, eng = layout.groups, layout.engine
    block_size = cache_block_size(groups)
    for g in groups:
        if g.kind == "mamba" and g.mamba_cache_mode == "align" and g.block_size != block_size:
            return (f"mamba_cache_mode align: Mamba block size {g.block_size} is not the "
                    f"engine's block size {block_size} (vLLM sets mamba_block_size = block_size "
                    "in align mode)")
    if eng.enable_prefix_caching and any(g.kind == "mamba" and g.mamba_cache_mode == "none"
                                         for g in groups):
        return ("mamba_cache_mode none with prefix caching: vLLM sets it to align "
                "(MambaModelConfig.verify_and_update_config)")
    if eng.dcp_size != 1:
        why = dcp_refusal(groups, eng.enable_prefix_caching)
        if why:
            return f"dcp_size {eng.dcp_size}: {why}"
    return None
MAMBA_CACHE_MODES = ("none", "align")
#: Layer kinds a layout of layers declares (``Layer``): each becomes the spec its name says, with
#: the layer's own heads, head size and dtype; the release's planner groups them
LAYER_KINDS = ("full", "mla", "sliding_window", "sliding_window_mla", "chunked_local", "ring",
               "mamba")
#: a Mamba layer's type (``MambaSpec.mamba_type``: ``MambaAttentionBackendEnum``'s members, by
#: name): Jamba's Mamba layers (``MambaMixer``) are mamba1, Qwen3-Next's Gated DeltaNet layers
#: gdn_attn; both declare the spec ``MambaBase.get_kv_cache_spec`` builds. Not mamba2 yet: from
#: 0.32.0 ``MambaMixer2.get_kv_cache_spec`` adds a prefill checkpoint block
#: (``num_prefill_checkpoint_blocks=1``, 0.32.0 mamba_mixer2.py:1098-1107)
MAMBA_TYPES = ("mamba1", "gdn_attn")
#: KV cache dtypes of a layer (``ModelConfig.dtype`` names; ``--kv-cache-dtype auto``)
LAYER_DTYPES = ("float16", "bfloat16", "float32")
SPEC_METHODS = ("eagle", "eagle3", "mtp", "ngram")

MAX_BLOCK_SIZE = 1 << 16


class RetentionUnset:
    """``engine.retention_interval`` left out of the case: the release's own default, what an
    engine started without ``--prefix-cache-retention-interval`` has in its ``CacheConfig`` and
    ``KVCacheConfig`` (``profiles.retention_interval``), as is an explicit JSON null;
    ``"dense"`` is the flag's ``None``. 0.29.0's ``EngineArgs`` tells the two apart the same way
    (``PREFIX_CACHE_RETENTION_INTERVAL_UNSET``, ``engine/arg_utils.py``)."""

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "RETENTION_UNSET"        # copies and pickles are the one instance


RETENTION_UNSET = RetentionUnset()


def _retention(obj: dict, path: str) -> int | None | RetentionUnset:
    """Absent or null: the release's default; ``"dense"``: ``--prefix-cache-retention-interval
    None`` (every block cached), None inside."""
    value = obj.get("retention_interval")
    if value is None:
        return RETENTION_UNSET
    if value == "dense":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LayoutError(f"{path}.retention_interval",
                          f"expected an integer >= 0, \"dense\" or null, got {value!r}")
    return value


@dataclass(frozen=True)
class Group:
    """One KV cache group: its kind, block size in tokens, and kind-specific sizes."""

    kind: str
    block_size: int
    layers: int = 1
    sliding_window: int | None = None        # sliding_window, sliding_window_mla
    attention_chunk_size: int | None = None  # chunked_local
    mamba_cache_mode: str | None = None      # mamba: "none" or "align"
    drafter: bool = False                    # an EAGLE/MTP drafter group beside its target
    # sliding window (0.28.0+): trailing tokens whose blocks are kept, not attended
    # (SlidingWindowSpec.extra_retained_tokens; multi-module MTP re-prefills them)
    extra_retained_tokens: int = 0

    @property
    def spec_name(self) -> str:
        return KINDS[self.kind]

    @property
    def prefix_cacheable(self) -> bool:
        """Whether vLLM addresses this group's blocks by block hashes (``spec.prefix_cacheable``)."""
        return self.kind != "ring"

    @property
    def dcp_sharded(self) -> bool:
        return self.kind in DCP_SHARDED_KINDS

    @classmethod
    def from_json(cls, obj: Any, path: str) -> "Group":
        allowed = {f.name for f in fields(cls)}
        obj = take(obj, path, allowed)
        kind = choice(obj, "kind", path, tuple(KINDS))
        group = cls(
            kind=kind,
            block_size=integer(obj, "block_size", path, hi=MAX_BLOCK_SIZE),
            layers=integer(obj, "layers", path, default=1, hi=1024),
            sliding_window=integer(obj, "sliding_window", path, default=None, optional=True),
            attention_chunk_size=integer(obj, "attention_chunk_size", path, default=None,
                                      optional=True),
            mamba_cache_mode=(choice(obj, "mamba_cache_mode", path, MAMBA_CACHE_MODES, "none")
                              if kind == "mamba" else obj.get("mamba_cache_mode")),
            drafter=boolean(obj, "drafter", path, False),
            extra_retained_tokens=integer(obj, "extra_retained_tokens", path, default=0, lo=0,
                                       hi=1 << 16),
        )
        group._check(path)
        return group

    def _check(self, path: str) -> None:
        needs = {"sliding_window": self.kind in WINDOWED_KINDS,
                 "attention_chunk_size": self.kind == "chunked_local",
                 "mamba_cache_mode": self.kind == "mamba"}
        for name, needed in needs.items():
            value = getattr(self, name)
            if needed and value is None:
                raise LayoutError(f"{path}.{name}", f"required for kind {self.kind!r}")
            if not needed and value is not None:
                raise LayoutError(f"{path}.{name}", f"not used by kind {self.kind!r}")
        if self.drafter and self.kind not in ("full", "mla", "sliding_window"):
            raise LayoutError(f"{path}.drafter", f"a drafter group is attention, not {self.kind!r}")
        if self.extra_retained_tokens and self.kind not in WINDOWED_KINDS:
            raise LayoutError(f"{path}.extra_retained_tokens",
                              f"not used by kind {self.kind!r} (a sliding-window field)")

    def to_json(self) -> dict:
        out = {"kind": self.kind, "block_size": self.block_size}
        if self.layers != 1:
            out["layers"] = self.layers
        for name in ("sliding_window", "attention_chunk_size", "mamba_cache_mode"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.drafter:
            out["drafter"] = True
        if self.extra_retained_tokens:
            out["extra_retained_tokens"] = self.extra_retained_tokens
        return out


@dataclass(frozen=True)
class Layer:
    """Attention layers of a model as its attention modules declare them (``get_kv_cache_spec``
    of each ``Attention`` / ``MLAAttention`` layer), ``count`` of them alike. A layout of layers
    leaves the grouping to the release: its planner (``get_kv_cache_configs``) builds the KV cache
    groups a deployment of that model gets, and its start-up checks run on them."""

    kind: str
    count: int = 1
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    sliding_window: int | None = None        # sliding_window, sliding_window_mla
    attention_chunk_size: int | None = None  # chunked_local
    drafter: bool = False                    # a layer of the EAGLE/MTP drafter (is_draft)
    # ring: the capacity of the layer's CircularBufferSpec, its own block size (a compressor's
    # or QSA's ring of the open token group; the other layers take --block-size)
    block_size: int | None = None
    # mamba: the layer's state shapes (MambaBase.get_state_shape, e.g. a conv state and an SSM
    # state; each in ``dtype``), its MambaSpec.mamba_type, and the engine's mamba_cache_mode
    shapes: tuple[tuple[int, ...], ...] | None = None
    mamba_type: str | None = None
    mamba_cache_mode: str | None = None

    @classmethod
    def from_json(cls, obj: Any, path: str) -> "Layer":
        obj = take(obj, path, {f.name for f in fields(cls)})
        mamba = obj.get("kind") == "mamba"
        if mamba:
            for name in ("num_kv_heads", "head_size", "sliding_window", "attention_chunk_size",
                         "block_size", "drafter"):
                if name in obj:
                    raise LayoutError(f"{path}.{name}", "not used by kind 'mamba' (its page is "
                                      "its state shapes; its block size is the engine's)")
        elif obj.get("kind") in LAYER_KINDS:
            for name in ("shapes", "mamba_type", "mamba_cache_mode"):
                if name in obj:
                    raise LayoutError(f"{path}.{name}", f"not used by kind {obj['kind']!r}")
        layer = cls(
            kind=choice(obj, "kind", path, LAYER_KINDS),
            count=integer(obj, "count", path, default=1, hi=256),
            num_kv_heads=integer(obj, "num_kv_heads", path, default=8, hi=256),
            head_size=integer(obj, "head_size", path, default=128, hi=1024),
            dtype=choice(obj, "dtype", path, LAYER_DTYPES, "bfloat16"),
            sliding_window=integer(obj, "sliding_window", path, default=None, optional=True),
            attention_chunk_size=integer(obj, "attention_chunk_size", path, default=None,
                                      optional=True),
            drafter=boolean(obj, "drafter", path, False),
            block_size=integer(obj, "block_size", path, default=None, optional=True,
                            hi=MAX_BLOCK_SIZE),
            shapes=_shapes(obj, path) if mamba else None,
            mamba_type=choice(obj, "mamba_type", path, MAMBA_TYPES) if mamba else None,
            mamba_cache_mode=(choice(obj, "mamba_cache_mode", path, MAMBA_CACHE_MODES, "align")
                              if mamba else None),
        )
        needs = {"sliding_window": layer.kind in WINDOWED_KINDS,
                 "attention_chunk_size": layer.kind == "chunked_local",
                 "block_size": layer.kind == "ring"}
        for name, needed in needs.items():
            if needed != (getattr(layer, name) is not None):
                raise LayoutError(f"{path}.{name}", f"required for kind {layer.kind!r}" if needed
                                  else f"not used by kind {layer.kind!r}")
        return layer

    def to_json(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "kind" and value != f.default:
                out[f.name] = [list(x) for x in value] if f.name == "shapes" else value
        return out


def _shapes(obj: dict, path: str) -> tuple[tuple[int, ...], ...]:
    """A Mamba layer's state shapes: 1 to 4 states, each 1 to 4 dimensions of 1 to 65536."""
    where = f"{path}.shapes"
    value = obj.get("shapes")
    if value is None:
        raise LayoutError(where, "required for kind 'mamba' (e.g. [[256, 3], [4, 32, 32]])")
    ok = isinstance(value, list) and 1 <= len(value) <= 4 and all(
        isinstance(s, list) and 1 <= len(s) <= 4 and all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 65536 for d in s)
        for s in value)
    if not ok:
        raise LayoutError(where, "expected 1 to 4 state shapes, each a list of 1 to 4 integers "
                          f"from 1 to 65536, got {value!r}")
    return tuple(tuple(s) for s in value)


@dataclass(frozen=True)
class Speculative:
    method: str
    num_tokens: int

    def to_json(self) -> dict:
        return asdict(self)


#: the CPU tier's built-in cache policies (``CachePolicyFactory``; before 0.27.0 the manager's
#: ``_CACHE_POLICIES``): every release has both
EVICTION_POLICIES = ("lru", "arc")


@dataclass(frozen=True)
class Engine:
    """The engine knobs that reach the offloading scheduler."""

    blocks_per_chunk: int | None = None     # kv_connector_extra_config["blocks_per_chunk"]
    offload_block_size: int | None = None   # kv_connector_extra_config["block_size"]
    prefix_match_unit: int | None = None    # cache_config.prefix_match_unit
    enable_prefix_caching: bool = True
    dcp_size: int = 1                       # decode context parallel size
    speculative: Speculative | None = None
    async_scheduling: bool = False
    # cache_config.prefix_cache_retention_interval (None: dense); unset: the release's default
    retention_interval: int | None | RetentionUnset = RETENTION_UNSET
    num_gpu_blocks: int = 1024
    cpu_chunks: int = 256                   # capacity of the CPU tier, in offload chunks
    offload_prompt_only: bool = True        # kv_connector_extra_config["offload_prompt_only"]
    # kv_connector_extra_config["eviction_policy"]: the CPU tier's CachePolicy, "lru" or "arc"
    eviction_policy: str = "lru"
    # cache_config.block_size (--block-size) of a layout of layers; a layout of groups names
    # each group's block size instead
    block_size: int | None = None
    # the KV connector and its tiers (simsched.connectors): the OffloadingConnector with a CPU
    # tier by default
    connector: Connector = field(default_factory=Connector)
    secondary_tiers: tuple[SecondaryTier, ...] = ()

    @classmethod
    def from_json(cls, obj: Any, path: str = "engine") -> "Engine":
        obj = take(obj, path, {f.name for f in fields(cls)})
        spec = obj.get("speculative")
        if spec is not None:
            spath = f"{path}.speculative"
            spec = take(spec, spath, {"method", "num_tokens"})
            spec = Speculative(method=choice(spec, "method", spath, SPEC_METHODS),
                               num_tokens=integer(spec, "num_tokens", spath, hi=16))
        connector = (Connector.from_json(obj["connector"], f"{path}.connector")
                     if "connector" in obj else Connector())
        return cls(
            blocks_per_chunk=integer(obj, "blocks_per_chunk", path, default=None, optional=True,
                                  hi=4096),
            offload_block_size=integer(obj, "offload_block_size", path, default=None, optional=True,
                                    hi=MAX_TOKENS),
            prefix_match_unit=integer(obj, "prefix_match_unit", path, default=None, optional=True,
                                   hi=MAX_BLOCK_SIZE),
            enable_prefix_caching=boolean(obj, "enable_prefix_caching", path, True),
            dcp_size=integer(obj, "dcp_size", path, default=1, hi=64),
            speculative=spec,
            async_scheduling=boolean(obj, "async_scheduling", path, False),
            retention_interval=_retention(obj, path),
            num_gpu_blocks=integer(obj, "num_gpu_blocks", path, default=1024, lo=2, hi=1 << 20),
            cpu_chunks=integer(obj, "cpu_chunks", path, default=256, lo=1, hi=1 << 20),
            offload_prompt_only=boolean(obj, "offload_prompt_only", path, True),
            eviction_policy=choice(obj, "eviction_policy", path, EVICTION_POLICIES, "lru"),
            block_size=integer(obj, "block_size", path, default=None, optional=True,
                            hi=MAX_BLOCK_SIZE),
            connector=connector,
            secondary_tiers=secondary_tiers_from_json(obj, path, connector),
        )

    def to_json(self) -> dict:
        out: dict[str, Any] = {}
        defaults = Engine()
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(defaults, f.name):
                if isinstance(value, (Speculative, Connector)):
                    value = value.to_json()
                elif f.name == "secondary_tiers":
                    value = [t.to_json() for t in value]
                elif f.name == "retention_interval" and value is None:
                    value = "dense"
                out[f.name] = value
        return out


@dataclass(frozen=True)
class Layout:
    """KV cache groups in the order vLLM's ``KVCacheConfig.kv_cache_groups`` lists them.

    A layout of ``layers`` describes the model instead, and its groups are what a release's
    planner builds of them (``simsched.planning``): empty until then, and the planner's once
    planned (the release harness plans again and checks it builds the same groups)."""

    groups: tuple[Group, ...]
    engine: Engine = field(default_factory=Engine)
    layers: tuple[Layer, ...] = ()

    @classmethod
    def from_json(cls, obj: Any, path: str = "layout") -> "Layout":
        obj = take(obj, path, {"groups", "engine", "layers"})
        layers = obj.get("layers")
        if layers is not None and (not isinstance(layers, list) or not layers):
            raise LayoutError(f"{path}.layers", "a non-empty list of layers is expected")
        groups = obj.get("groups", [] if layers else None)
        if not isinstance(groups, list) or not (groups or layers):
            raise LayoutError(f"{path}.groups", "a non-empty list of groups is required "
                              "(or layout.layers)")
        if len(groups) > 16:
            raise LayoutError(f"{path}.groups", f"at most 16 groups, got {len(groups)}")
        parsed = tuple(Group.from_json(g, f"{path}.groups[{i}]") for i, g in enumerate(groups))
        engine = Engine.from_json(obj.get("engine", {}), f"{path}.engine")
        layout = cls(groups=parsed, engine=engine,
                     layers=tuple(Layer.from_json(x, f"{path}.layers[{i}]")
                                  for i, x in enumerate(layers or ())))
        layout._check(path)
        return layout

    def _check(self, path: str) -> None:
        spec = self.engine.speculative
        if spec is None and any(g.drafter for g in self.groups):
            i = next(i for i, g in enumerate(self.groups) if g.drafter)
            raise LayoutError(f"{path}.groups[{i}].drafter",
                              "a drafter group needs engine.speculative")
        if self.layers:
            if spec is None and any(x.drafter for x in self.layers):
                raise LayoutError(f"{path}.layers", "a drafter layer needs engine.speculative")
            if all(x.drafter for x in self.layers):
                raise LayoutError(f"{path}.layers", "a model needs at least one target layer")
            self._check_mamba_layers(path)
            return      # the groups are the release's planner's, eagle-marked as it marks them
        if self.engine.block_size is not None:
            raise LayoutError(f"{path}.engine.block_size", "only with layout.layers (each "
                              "group names its own block size)")
        if all(g.drafter for g in self.groups):
            raise LayoutError(f"{path}.groups", "a layout needs at least one target group")

    def _check_mamba_layers(self, path: str) -> None:
        """A hybrid model's Mamba layers as vLLM sizes them: one state layout for the model
        (``get_mamba_state_shape_from_config``), one ``cache_config.mamba_cache_mode`` for the
        engine, which ``MambaModelConfig.verify_and_update_config`` makes "align" under prefix
        caching, and attention beside them (an attention-free model's Mamba block is
        ``max_model_len``, not in the layer language)."""
        mamba = [(i, x) for i, x in enumerate(self.layers) if x.kind == "mamba"]
        if not mamba:
            return
        i, first = mamba[0]
        for j, x in mamba[1:]:
            for name in ("shapes", "dtype", "mamba_type", "mamba_cache_mode"):
                if getattr(x, name) != getattr(first, name):
                    raise LayoutError(f"{path}.layers[{j}].{name}", f"a model's Mamba layers "
                                      f"share one {name} (layers[{i}] has "
                                      f"{getattr(first, name)!r})")
        if first.mamba_cache_mode == "none" and self.engine.enable_prefix_caching:
            raise LayoutError(f"{path}.layers[{i}].mamba_cache_mode", "none with prefix caching: "
                              "vLLM makes it align (MambaModelConfig.verify_and_update_config)")
        if all(x.kind == "mamba" or x.drafter for x in self.layers):
            raise LayoutError(f"{path}.layers", "Mamba layers need attention layers beside them "
                              "(a hybrid model)")

    @property
    def planned(self) -> bool:
        """Whether the layout has its KV cache groups (a layout of layers: once planned)."""
        return bool(self.groups)

    def as_groups(self) -> "Layout":
        """A planned layout of layers as the layout of its groups alone (the config chain,
        which sizes nothing, runs the groups; the step runs replan the layers)."""
        if not self.layers:
            return self
        return Layout(groups=self.groups, engine=replace(self.engine, block_size=None))

    def to_json(self) -> dict:
        out: dict[str, Any] = {}
        if self.layers:
            out["layers"] = [x.to_json() for x in self.layers]
        if self.groups or not self.layers:
            out["groups"] = [g.to_json() for g in self.groups]
        engine = self.engine.to_json()
        if engine:
            out["engine"] = engine
        return out

    @property
    def hybrid(self) -> bool:
        """``ModelConfig.is_hybrid``: Mamba layers beside the target model's attention layers
        (an ``IsHybrid`` model; Mamba groups alone are an attention-free model)."""
        return any(g.kind == "mamba" for g in self.groups) and any(
            g.kind != "mamba" and not g.drafter for g in self.groups)

    @property
    def num_speculative_blocks(self) -> int:
        """``MambaSpec.num_speculative_blocks`` of the layout's Mamba groups: the number of
        speculative tokens under speculative decoding, 0 without, as every release's
        ``MambaBase.get_kv_cache_spec`` sets it (``model_executor/layers/mamba/abstract.py``:
        0.25.1:55-59 and 0.28.0:74-78 ``speculative_config.num_speculative_tokens``; 0.30.0:81-85
        and 0.33.0:86-90 ``vllm_config.num_speculative_tokens``, but 0 under
        ``cache_config.use_kda_recoverssm`` (0.29.0-0.31.0) or ``use_replayssm`` (0.32.0+), both
        off by default). The state blocks the Mamba manager keeps after the running state for
        the drafts' states."""
        spec = self.engine.speculative
        return spec.num_tokens if spec is not None else 0

    def with_engine(self, **changes: Any) -> "Layout":
        return replace(self, engine=replace(self.engine, **changes))

    def describe(self) -> str:
        """The layout on one line, e.g. ``mla/64 + ring/4 | blocks_per_chunk=1``."""
        parts = [] if self.groups else [f"{x.count}x{x.kind}" + ("[drafter]" if x.drafter else "")
                                        for x in self.layers]
        for g in self.groups:
            extra = (g.sliding_window or g.attention_chunk_size or
                     (g.mamba_cache_mode if g.kind == "mamba" else None))
            parts.append(f"{g.kind}/{g.block_size}" + (f"(w={extra})" if extra else "")
                         + ("[drafter]" if g.drafter else ""))
        values = dict(self.engine.to_json())
        if "connector" in values:
            values["connector"] = self.engine.connector.describe()
        if "secondary_tiers" in values:
            values["secondary_tiers"] = "+".join(f"{t.kind}(io={t.io_latency})"
                                                 for t in self.engine.secondary_tiers)
        knobs = " ".join(f"{k}={v}" for k, v in values.items())
        return " + ".join(parts) + (f" | {knobs}" if knobs else "")
