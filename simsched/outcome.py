"""Outcomes of the config-level chain, their signatures, and the model-versus-release diff.

An outcome is a JSON object with ``status`` ``ok`` (derived geometry and offload keys), ``error``
(exception type, raising function, file, stage) or ``unsupported`` (the release cannot express the
layout). The model (:func:`simsched.geometry.config_outcome`) and a release worker produce the
same format, so they compare field by field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Observation:
    """One signature seen on one target for one case; ``level``: what ran to see it (``model``:
    the model, every step; ``config``: a release's config chain; ``steps``: a release's real
    Scheduler, every step)."""

    signature: "Signature"
    target: str
    outcome: dict
    level: str = "config"


@dataclass(frozen=True, order=True)
class Signature:
    """What makes two findings the same finding."""

    kind: str            # crash | invariant | divergence
    exception: str = ""  # exception type name, for crashes
    function: str = ""   # raising function, for crashes; the differing field, for divergences
    invariant: str = ""  # invariant ID, for invariant findings

    def __str__(self) -> str:
        parts = [self.kind, self.exception, self.function, self.invariant]
        return ":".join(p for p in parts if p)

    @classmethod
    def parse(cls, text: str) -> "Signature":
        kind, *rest = text.split(":")
        if kind == "crash" and len(rest) == 2:
            return cls(kind, rest[0], rest[1])
        if kind == "divergence" and len(rest) == 1:
            return cls(kind, function=rest[0])
        if kind == "invariant" and len(rest) == 1:
            return cls(kind, invariant=rest[0])
        raise ValueError(f"not a finding signature: {text!r}")

    def to_json(self) -> str:
        return str(self)


def crash_signature(outcome: dict) -> Signature | None:
    """The crash an outcome shows, if any."""
    if outcome.get("status") != "error":
        return None
    return Signature("crash", outcome["exception"], outcome["function"])


def finding_signature(finding: dict) -> Signature:
    """The signature of a step-level finding (``simsched.model.run_case``, lockstep)."""
    if finding.get("kind") == "invariant":
        return Signature("invariant", invariant=finding["inv_id"])
    return Signature("crash", finding["exception"], finding.get("function") or "?")


def diff_config(model: dict, real: dict) -> list[str]:
    """Fields where the model's prediction and a release's outcome disagree (empty: agree).

    Errors agree when exception type and raising function agree (messages and files may differ);
    successful outcomes agree when the derived geometry and the offload keys (as hash indices)
    agree. An ``unsupported`` outcome on either side compares as agreement: nothing was run.
    """
    if "unsupported" in (model.get("status"), real.get("status")):
        return []
    if model["status"] != real["status"]:
        return ["status"]
    if model["status"] == "error":
        return [f for f in ("exception", "function") if model[f] != real[f]]
    out = []
    mg, rg = model["geometry"], real["geometry"]
    for f in ("scheduler_block_size", "tokens_per_hash", "blocks_per_chunk", "alignment_tokens"):
        if mg[f] != rg[f]:
            out.append(f"geometry.{f}")
    if [g["group_id"] for g in mg["groups"]] != [g["group_id"] for g in rg["groups"]]:
        out.append("geometry.offloaded_groups")
    else:
        for m, r in zip(mg["groups"], rg["groups"]):
            for f in ("tokens_per_block", "tokens_per_chunk", "hashes_per_chunk",
                      "sliding_window_in_chunks", "drafter"):
                if m[f] != r[f]:
                    out.append(f"geometry.groups.{f}")
    if model.get("num_hashes") != real.get("num_hashes"):
        out.append("num_hashes")
    if model.get("offload_keys") != real.get("offload_keys"):
        out.append("offload_keys")
    return sorted(set(out))


def describe(outcome: dict) -> str:
    """An outcome in one line, for reports and error messages."""
    status = outcome.get("status")
    if status == "error":
        return (f"{outcome['exception']} in {outcome['function']} ({outcome.get('stage', '?')}): "
                f"{outcome.get('message', '')}")
    if status == "unsupported":
        return f"unsupported: {outcome.get('reason', '')}"
    if status == "ran":
        return describe_run(outcome)
    if status == "refused":
        return f"refused at start-up: {outcome.get('reason', '')}"
    if status == "worker":
        return (f"not run: the release worker failed ({outcome.get('exception')}: "
                f"{outcome.get('message', '')})")
    if status == "invalid":
        return f"not run: invalid case ({outcome.get('reason', '')})"
    g = outcome["geometry"]
    groups = ", ".join(f"g{x['group_id']}: {x['tokens_per_chunk']} tok/chunk, "
                       f"{x['hashes_per_chunk']} hash/chunk" for x in g["groups"])
    return f"ok: hash unit {g['tokens_per_hash']}, {groups}"


def describe_run(outcome: dict) -> str:
    """A real step-by-step run (status ``ran``) in one line."""
    steps, found = outcome.get("steps", 0), outcome.get("findings") or []
    if not found:
        gap = outcome.get("divergence")
        return (f"ran {steps} steps: clean" + (f" (the model differs at step {gap['step']}: "
                                               f"{gap['kind']})" if gap else ""))
    f = found[0]
    where = "at start-up" if f.get("stage") in ("boot", "add_request") and not f.get("step") \
        else f"at step {f.get('step')}"
    if f.get("kind") == "invariant":
        return f"ran {steps} steps: {f['inv_id']} {where}: {f.get('detail', '')}"
    return (f"ran {steps} steps: {f.get('exception')} in {f.get('function')} {where}: "
            f"{f.get('message', '')}")
