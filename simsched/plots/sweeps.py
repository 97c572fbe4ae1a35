"""Sweeps of one knob of a layout (``engine.<field>`` or ``groups[i].<field>``): which settings
boot, crash or misbehave, target by target (the model's behaviour profiles, and real releases'
config chains batched per release), as a table and a colour grid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from simsched.plots.common import CRASH_COLOURS, Table

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from simsched.case import Case
from simsched.layout import Layout, LayoutError
from simsched.outcome import diff_config
from simsched.profiles import PROFILES, get_profile

#: a sweep's cell states (a crash is ``crash: <Exception> in <function>``)
OK, MISBEHAVE, UNSUPPORTED, INVALID = "boots", "misbehaves", "not run", "invalid layout"
STATE_COLOURS = {OK: "#4caf50", MISBEHAVE: "#ffb300", UNSUPPORTED: "#bdbdbd", INVALID: "#ffffff"}


KNOB_PATTERN = re.compile(r"^(engine\.(\w+)|groups\[(\d+)\]\.(\w+))$")


def with_knob(layout: Layout, knob: str, value: Any) -> Layout:
    """``layout`` with one knob set: ``engine.<field>`` or ``groups[i].<field>``; the result is
    validated like any layout (a LayoutError for an impossible value)."""
    m = KNOB_PATTERN.match(knob)
    if not m:
        raise ValueError(f"knob {knob!r}: expected engine.<field> or groups[<i>].<field>")
    obj = layout.to_json()
    if m.group(2):
        obj.setdefault("engine", {})[m.group(2)] = value
    else:
        obj["groups"][int(m.group(3))][m.group(4)] = value
    return Layout.from_json(obj)


def classify(outcome: dict, model: dict | None = None) -> str:
    """One cell of a sweep: ``boots``, ``misbehaves`` (configures, but an offloaded group gets
    zero hashes per chunk, or a release disagrees with its profile's prediction), ``not run``
    (the release cannot express it) or ``crash: <Exception> in <function>``."""
    status = outcome.get("status")
    if status == "unsupported":
        return UNSUPPORTED
    if status == "error":
        return f"crash: {outcome['exception']} in {outcome['function']}"
    if any(g["hashes_per_chunk"] == 0 for g in outcome["geometry"]["groups"]):
        return MISBEHAVE
    if model is not None and diff_config(model, outcome):
        return MISBEHAVE
    return OK


@dataclass
class Sweep:
    knob: str
    values: list
    targets: list[str]
    cells: dict            # (target, value index) -> state
    outcomes: dict         # (target, value index) -> outcome
    layouts: list          # Layout or the LayoutError message, per value

    def table(self) -> Table:
        rows = []
        for t in self.targets:
            row = {"target": t}
            for i, v in enumerate(self.values):
                row[f"{self.knob.split('.')[-1]}={v}"] = self.cells[(t, i)]
            rows.append(row)
        return Table(rows)


def sweep(layout: Layout, knob: str, values: list, *, releases=None,
          profiles: Iterable[str] | None = None, num_tokens: int = 256,
          asserts: bool = True) -> Sweep:
    """Run ``layout`` with ``knob`` set to each value on model profiles and on real releases
    (``releases``: a :class:`~simsched.targets.Releases` pool or None), batched per release."""
    from simsched.targets import ModelTarget
    from simsched.case import RequestSpec
    cases: list[Case | None] = []
    variants: list = []
    for v in values:
        try:
            lay = with_knob(layout, knob, v)
        except LayoutError as e:
            variants.append(str(e))
            cases.append(None)
            continue
        variants.append(lay)
        cases.append(Case(layout=lay, requests=(RequestSpec("r0", ((0, num_tokens),)),),
                          asserts=asserts))
    models = [ModelTarget(get_profile(p)) for p in (profiles if profiles is not None else PROFILES)]
    rel_targets = releases.targets() if releases is not None else []
    cells: dict = {}
    outcomes: dict = {}
    valid = [i for i, c in enumerate(cases) if c is not None]
    predicted: dict = {}
    for t in models:
        for i in valid:
            outcomes[(t.name, i)] = predicted[(t.profile.name, i)] = t.config(cases[i])
    for t in rel_targets:
        res = t.config_many([cases[i] for i in valid]) if valid else []
        for i, out in zip(valid, res):
            outcomes[(t.name, i)] = out
            predicted.setdefault((t.profile.name, i),
                                 ModelTarget(t.profile).config(cases[i]))
    names = [t.name for t in rel_targets] + [t.name for t in models]
    for name in names:
        for i in range(len(values)):
            if cases[i] is None:
                cells[(name, i)] = INVALID
                continue
            out = outcomes[(name, i)]
            model = None
            if not name.startswith("model:"):
                from simsched.profiles import profile_for_release
                from simsched.vllm.releases import release_of
                model = predicted[(profile_for_release(release_of(name)).name, i)]
            cells[(name, i)] = classify(out, model)
    return Sweep(knob, list(values), names, cells, outcomes, variants)


def _state_colours(states: Iterable[str]) -> dict[str, str]:
    colours = dict(STATE_COLOURS)
    crashes = sorted({s for s in states if s.startswith("crash")})
    for i, s in enumerate(crashes):
        colours[s] = CRASH_COLOURS[i % len(CRASH_COLOURS)]
    return colours


def draw_sweep(result: Sweep, ax=None, title: str | None = None):
    """The sweep as a colour grid: rows targets (releases, then model profiles), columns values."""
    states = set(result.cells.values())
    colours = _state_colours(states)
    order = list(colours)
    index = {s: i for i, s in enumerate(order)}
    grid = [[index[result.cells[(t, i)]] for i in range(len(result.values))]
            for t in result.targets]
    if ax is None:
        fig, ax = plt.subplots(figsize=(1.6 + 0.75 * len(result.values),
                                        1.2 + 0.32 * len(result.targets)))
    else:
        fig = ax.figure
    ax.imshow(grid, cmap=ListedColormap([colours[s] for s in order]), vmin=-0.5,
              vmax=len(order) - 0.5, aspect="auto")
    ax.set_xticks(range(len(result.values)))
    ax.set_xticklabels([str(v) for v in result.values])
    ax.set_yticks(range(len(result.targets)))
    ax.set_yticklabels(result.targets, fontsize=8)
    ax.set_xlabel(result.knob)
    ax.set_xticks([x - 0.5 for x in range(1, len(result.values))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(result.targets))], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.2)
    ax.tick_params(which="minor", length=0)
    used = [s for s in order if s in states]
    ax.legend(handles=[Patch(facecolor=colours[s], edgecolor="#9e9e9e", label=s) for s in used],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title(title or f"sweep of {result.knob}", fontsize=10)
    return fig
