"""Shrinking toward one cause: :class:`Hunt` (the cluster key a campaign round hunts, and the
targets that must still show it while hypothesis shrinks the case) and :func:`simplify` (what
hypothesis's shrinker cannot do across layout families: drop whole KV cache groups, requests,
events and engine knobs, one at a time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace

from fuzz.triage import Seen
from simsched.case import Case, Timing
from simsched.layout import Engine, Layout, LayoutError
from simsched.outcome import Signature

#: seconds a round shrinks for at most (hypothesis's shrinker, then :func:`simplify`)
SHRINK_SECONDS = 10.0


def simplify(case: Case, still_shows, obs, seconds: float = SHRINK_SECONDS):
    """What hypothesis's shrinker cannot do across layout families: drop whole groups, requests
    and engine knobs, one at a time, keeping each change under which the finding still shows;
    for at most ``seconds`` (each try may run real releases step by step)."""
    stop = time.monotonic() + seconds
    def candidates(c: Case):
        # a layout of layers is a model as a deployment declares it, its groups the planner's:
        # it stays whole (a group dropped or a flag reset would pair the layers with groups no
        # planner builds from them), and only the workload shrinks
        groups = () if c.layout.layers else c.layout.groups
        for i in range(len(groups)):
            if len(groups) > 1:
                rest = groups[:i] + groups[i + 1:]
                if not any(g.drafter for g in rest) or c.layout.engine.speculative is not None:
                    yield replace(c, layout=replace(c.layout, groups=rest))
        for i in range(1, len(c.requests)):
            yield replace(c, requests=c.requests[:i] + c.requests[i + 1:])
        for i in range(len(c.events)):
            yield replace(c, events=c.events[:i] + c.events[i + 1:])
        if c.faults:
            yield replace(c, faults=())
        if c.timing.jobs:
            yield replace(c, timing=replace(c.timing, jobs=()))
        for i, r in enumerate(c.requests):
            if r.skip_reading_prefix_cache:
                plain = replace(r, skip_reading_prefix_cache=False)
                yield replace(c, requests=c.requests[:i] + (plain,) + c.requests[i + 1:])
        default = Engine()
        for f in fields(Engine) if not c.layout.layers else ():
            if getattr(c.layout.engine, f.name) != getattr(default, f.name):
                yield replace(c, layout=c.layout.with_engine(**{f.name: getattr(default, f.name)}))
        if c.timing != Timing():
            yield replace(c, timing=Timing())

    improved = True
    while improved:
        improved = False
        for cand in candidates(case):
            if time.monotonic() > stop:
                return case, obs
            try:
                Layout.from_json(cand.layout.to_json())   # still a valid layout
            except LayoutError:
                continue
            found = still_shows(cand)
            if found is not None:
                case, obs, improved = cand, found, True
                break
    return case, obs


@dataclass
class Hunt:
    """The cause a round shrinks toward, and what must run to see it."""

    key: tuple
    klass: str
    signature: Signature
    fingerprint: tuple[str, ...]
    models: list
    configs: list
    steps: list
    shown: frozenset       # the targets that must still show it

    def matches(self, key: tuple) -> bool:
        """``key`` stands for the hunted cause: the same key; or, for an invariant, the same ID
        and operation on fewer group kinds. An invariant's key names the layout's kinds where
        the run names no group it broke in (a stall), so a shrink that drops a group whose
        kind does not matter changes the key: a Mamba block wider than the budget stalls
        0.25.1-0.26.0 alone as beside a full-attention group, one cause."""
        if key == self.key:
            return True
        return (key[0] == self.key[0] == "invariant" and key[1:3] == self.key[1:3]
                and set(key[3].split("+")) < set(self.key[3].split("+")))

    def showing(self, seen: list[Seen]) -> Seen | None:
        """The observation of the hunted cause, if every target that must still show it does."""
        hits = [s for s in seen if self.matches(s.key)]
        if not self.shown <= {s.obs.target for s in hits}:
            return None
        return next((s for s in hits if s.key == self.key), hits[0])

    def still_shown(self, seen: list[Seen]) -> bool:
        return self.showing(seen) is not None
