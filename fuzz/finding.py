"""A finding: one cause (a cluster key, :mod:`fuzz.triage`) shrunk to a small case, with where it
shows once replayed on every installed vLLM release and behaviour profile
(:mod:`fuzz.clustering`), as a campaign records it in ``report.json`` and
``repros/<id>/finding.json`` (:meth:`Finding.to_json`), and as it reads findings back from disk
(:func:`load_findings`, the durable record a campaign resumes from).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fuzz import triage as tri
from simsched.case import Case
from simsched.invariants import INV_OPS
from simsched.outcome import Signature
from simsched.planning import deployment_reach

#: the variants (other cases showing a known cause) a finding lists at most
MAX_VARIANTS = 12


@dataclass
class Finding:
    id: str
    key: tuple                     # the cluster key (fuzz.triage): one cause
    klass: str                     # bug, validation, model-gap, proposal, predicted
    signature: Signature
    case: Case
    present_on: tuple[str, ...]    # the campaign's targets showing it when found
    fingerprint: tuple[str, ...]   # the profiles whose config stage shows it (a shrink guard)
    first_target: str
    outcome: dict
    found_after_s: float
    examples_before: int
    releases_affected: list[str] = field(default_factory=list)
    releases_clean: list[str] = field(default_factory=list)
    profiles_affected: list[str] = field(default_factory=list)
    releases_not_run: dict = field(default_factory=dict)  # release -> why it did not run
    releases_other: dict = field(default_factory=dict)    # release -> what it shows instead
    releases_refused: dict = field(default_factory=dict)  # release -> its clean refusal
    outcomes: dict = field(default_factory=dict)     # target -> outcome of the shrunk case
    aliases: list[tuple] = field(default_factory=list)   # keys of the same cause (asserts twins)
    variants: list[dict] = field(default_factory=list)   # other cases showing it, unshrunk
    installed: tuple[str, ...] = ()
    cluster: str = ""              # the cluster it joins; default: its own key's
    deployment: str = ""           # how a deployment reaches it; default: planning.deployment_reach

    def to_json(self) -> dict:
        o = self.outcome
        step = o.get("step") if o.get("stage") not in tri.START_UP_STAGES else None
        return {
            "id": self.id, "class": self.klass,
            "cluster": self.cluster or tri.cluster_name(self.key),
            "cluster_key": _as_list(self.key), "aliases": [_as_list(a) for a in self.aliases],
            "signature": str(self.signature), "kind": self.signature.kind,
            "exception": self.signature.exception or None,
            "function": (self.signature.function if self.signature.kind == "crash" else None),
            "field": (self.signature.function if self.signature.kind == "divergence" else None),
            "invariant": self.signature.invariant or None,
            "op": o.get("op") or INV_OPS.get(self.signature.invariant),
            "file": o.get("file"), "line": o.get("line"), "source": o.get("source"),
            "stage": o.get("stage"), "message": o.get("message") or o.get("detail"),
            "first_bad_step": step,
            "asserts": self.case.asserts,
            "releases_affected": self.releases_affected, "releases_clean": self.releases_clean,
            "releases_not_run": self.releases_not_run,
            "releases_other": self.releases_other,
            "releases_refused": self.releases_refused,
            "range": tri.regressed_fixed(self.releases_affected, self.releases_clean,
                                         list(self.installed), list(self.releases_refused)),
            "profiles_affected": self.profiles_affected,
            "present_on": list(self.present_on),
            "fingerprint": list(self.fingerprint),
            "first_target": self.first_target,
            "layout": self.case.layout.describe(),
            "deployment": self.deployment or deployment_reach(self.case.layout),
            "case": f"repros/{self.id}/case.json",
            "groups": len(self.case.layout.groups), "requests": len(self.case.requests),
            "steps": o.get("steps", 1),
            "variants": self.variants,
            "found_after_s": round(self.found_after_s, 3),
            "examples_before": self.examples_before,
        }



def load_findings(out: Path) -> tuple[list[dict], list[tuple[Path, str]]]:
    """Every finding on disk (``repros/<id>/finding.json``, the durable record, written before
    the report), and the files that could not be read (named, left in place, never deleted)."""
    found, damaged = [], []
    for path in sorted((Path(out) / "repros").glob("*/finding.json")):
        try:
            data = json.loads(path.read_text())
            finding_keys(data)
        except (OSError, ValueError, KeyError, TypeError) as e:
            damaged.append((path, str(e)))
            continue
        found.append(data)
    return found, damaged


def present_on(targets) -> tuple[str, ...]:
    """Where a finding shows: the releases if any, else the model profiles."""
    releases = sorted({t for t in targets if not t.startswith("model:")})
    return tuple(releases) if releases else tuple(sorted(set(targets)))


def finding_id(key: tuple) -> str:
    """A stable, readable id: the cluster's name."""
    return tri.cluster_name(key)


def _as_list(key: tuple) -> list:
    """A cluster key as JSON holds it (its nested tuples as lists)."""
    return [_as_list(v) if isinstance(v, tuple) else v for v in key]


def _as_key(value) -> tuple:
    return tuple(_as_key(v) if isinstance(v, list) else v for v in value)


def finding_keys(data: dict) -> set[tuple]:
    """The cluster keys a finding read from disk stands for (its own and its aliases')."""
    return {_as_key(data["cluster_key"])} | {_as_key(a) for a in data.get("aliases", [])}
