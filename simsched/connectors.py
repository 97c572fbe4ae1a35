"""The KV connector path a case runs: ``engine.connector`` and ``engine.secondary_tiers``.

vLLM offloads KV cache in more than one way, and deployments combine them:

* ``{"kind": "offloading"}`` (the default): ``OffloadingConnector`` with its CPU tier
  (``CPUOffloadingSpec``), what the model mirrors;
* ``{"kind": "simple_cpu", "lazy_offload": bool}``: ``SimpleCPUOffloadConnector``
  (``vllm/v1/simple_kv_offload/``), its own scheduler-side manager over a CPU ``BlockPool``;
  eager offload stores computed blocks as they fill, lazy offload only blocks the GPU pool is
  about to evict (``kv_connector_extra_config["lazy_offload"]``);
* ``{"kind": "multi", "order": [...]}``: a ``MultiConnector`` of the ``OffloadingConnector`` and
  ``NixlConnector``, as on a P/D decode instance that receives prefills through NIXL while it
  offloads to CPU. ``order`` is the list's order, which decides who serves a request both could
  (the first child that offers tokens, ``MultiConnector.get_num_new_matched_tokens``). The
  requests that arrive through NIXL say when their blocks land (``RequestSpec.remote_prefill``).

``engine.secondary_tiers`` (with the ``OffloadingConnector`` only): tiered offloading
(``TieringOffloadingSpec``, ``vllm/v1/kv_offload/tiering/``), the CPU tier as primary and each
entry a secondary tier; ``{"kind": "fs", "io_latency": n}`` is the file-system tier, writing real
files into a directory the harness owns, its reads and writes completing ``n`` steps after they
are submitted (the harness runs the tier's I/O queue itself, so a case replays the same).

The model mirrors the default path, the ``multi`` path (``simsched/model/multi_connector.py``,
``nixl_scheduler.py``; multi-module MTP aside), the ``simple_cpu`` path
(``simsched/model/simple_cpu_scheduler.py``, 0.30.0+; ``simple_cpu_scheduler_legacy.py``,
0.25.1-0.29.0; Mamba groups from 0.27.0, not under fine-grained hash hits:
``model._simple_cpu_gap``) and the ``fs`` tiers (``simsched/model/tiering_manager.py``,
``fs_tier.py``),
:func:`simsched.model.unmodelled_path`: the others are checked on the real run alone, by the
invariants that need no model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simsched.fields import LayoutError, boolean, choice, integer, take

CONNECTOR_KINDS = ("offloading", "simple_cpu", "multi")
#: the children of a ``multi`` connector, by the names the case gives them
MULTI_CHILDREN = ("offloading", "nixl")
TIER_KINDS = ("fs",)


@dataclass(frozen=True)
class Connector:
    kind: str = "offloading"
    lazy_offload: bool = False                   # simple_cpu
    order: tuple[str, ...] = MULTI_CHILDREN      # multi

    @classmethod
    def from_json(cls, obj: Any, path: str) -> "Connector":
        obj = take(obj, path, {"kind", "lazy_offload", "order"})
        kind = choice(obj, "kind", path, CONNECTOR_KINDS)
        if "lazy_offload" in obj and kind != "simple_cpu":
            raise LayoutError(f"{path}.lazy_offload", "only a simple_cpu connector has it")
        order = obj.get("order", list(MULTI_CHILDREN))
        if "order" in obj and kind != "multi":
            raise LayoutError(f"{path}.order", "only a multi connector has it")
        if not isinstance(order, list) or sorted(order) != sorted(MULTI_CHILDREN):
            raise LayoutError(f"{path}.order",
                              f"expected the children {list(MULTI_CHILDREN)} in some order, "
                              f"got {order!r}")
        return cls(kind=kind, lazy_offload=boolean(obj, "lazy_offload", path, False),
                   order=tuple(order))

    def to_json(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "simple_cpu":
            out["lazy_offload"] = self.lazy_offload
        if self.kind == "multi":
            out["order"] = list(self.order)
        return out

    def describe(self) -> str:
        if self.kind == "simple_cpu":
            return f"simple_cpu({'lazy' if self.lazy_offload else 'eager'})"
        if self.kind == "multi":
            return f"multi({'+'.join(self.order)})"
        return self.kind


@dataclass(frozen=True)
class SecondaryTier:
    kind: str = "fs"
    io_latency: int = 1          # steps from a tier read or write's submission to its end

    @classmethod
    def from_json(cls, obj: Any, path: str) -> "SecondaryTier":
        obj = take(obj, path, {"kind", "io_latency"})
        return cls(kind=choice(obj, "kind", path, TIER_KINDS),
                   io_latency=integer(obj, "io_latency", path, default=1, hi=64))

    def to_json(self) -> dict:
        return {"kind": self.kind, "io_latency": self.io_latency}


def secondary_tiers_from_json(obj: dict, path: str, connector: Connector
                              ) -> tuple[SecondaryTier, ...]:
    tiers = obj.get("secondary_tiers", [])
    where = f"{path}.secondary_tiers"
    if not isinstance(tiers, list) or len(tiers) > 2:
        raise LayoutError(where, f"expected a list of at most 2 tiers, got {tiers!r}")
    if tiers and connector.kind != "offloading":
        raise LayoutError(where, "tiered offloading is a spec of the OffloadingConnector "
                                 f"(connector kind offloading), not of {connector.kind}")
    return tuple(SecondaryTier.from_json(t, f"{where}[{i}]") for i, t in enumerate(tiers))
