"""Plotting and table helpers for the notebooks in ``notebooks/`` (kept thin: the logic lives here).

Three themes, one per notebook:

* layouts: :func:`geometry_rows` (the derived geometry per behaviour profile, as a table),
  :func:`draw_layout` (per group, one token axis: tokens -> blocks -> offload chunks -> hashes ->
  keys), :func:`sweep` and :func:`draw_sweep` (which settings of one knob boot, crash or
  misbehave, target by target);
* campaigns: :func:`load_campaign`, :func:`draw_timeline`, :func:`draw_throughput`,
  :func:`draw_example_rate`, :func:`draw_coverage`, :func:`draw_arcs`, :func:`release_matrix`
  and :func:`draw_release_matrix`; :func:`write_report_plots` draws the PNGs that a campaign's
  ``report.md`` links;
* findings: :func:`occupancy` (block and chunk occupancy per step, parsed from
  ``simsched-trace/1`` lines), :func:`draw_occupancy` and :func:`draw_release_strip`.

matplotlib runs on the Agg backend when there is no display and no notebook kernel, so every
helper also works in a headless script or test. :func:`save_figure` writes PNGs; the notebooks
write ``docs/fig_*.png`` through it (``$SIMSCHED_FIG_DIR`` sends them elsewhere).
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import matplotlib

if ("MPLBACKEND" not in os.environ and "ipykernel" not in sys.modules
        and not os.environ.get("DISPLAY")):
    matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from simsched.case import Case  # noqa: E402
from simsched.geometry import derive, resolve_block_sizes  # noqa: E402
from simsched.layout import Layout, LayoutError  # noqa: E402
from simsched.outcome import diff_config  # noqa: E402
from simsched.profiles import (DEFAULT_PROFILE, PROFILES, ConfigError, Profile,  # noqa: E402
                               get_profile)

#: the repository root (the notebooks find ``notebooks/data`` and ``docs`` from here)
REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "notebooks" / "data"
DOCS_DIR = REPO_ROOT / "docs"

OK, MISBEHAVE, UNSUPPORTED, INVALID = "boots", "misbehaves", "not run", "invalid layout"
STATE_COLOURS = {OK: "#4caf50", MISBEHAVE: "#ffb300", UNSUPPORTED: "#bdbdbd", INVALID: "#ffffff"}
CRASH_COLOURS = ["#e53935", "#8e24aa", "#d81b60", "#5e35b1", "#f4511e", "#6d4c41", "#c2185b",
                 "#3949ab", "#b71c1c", "#4a148c"]


# --- small utilities -----------------------------------------------------------------------------

def version_key(name: str) -> tuple:
    """Sort key: releases by version, then model profiles in PROFILES order."""
    if re.fullmatch(r"\d+\.\d+\.\d+", name):
        return (0, tuple(int(x) for x in name.split(".")), "")
    prof = name.removeprefix("model:")
    order = list(PROFILES).index(prof) if prof in PROFILES else len(PROFILES)
    return (1, (order,), prof)


def fig_dir(default: str | Path | None = None) -> Path:
    """Where figures go: ``$SIMSCHED_FIG_DIR``, else ``default``, else ``docs/``."""
    return Path(os.environ.get("SIMSCHED_FIG_DIR") or default or DOCS_DIR)


def save_figure(fig, name: str, folder: str | Path | None = None) -> Path:
    """Write ``fig`` as ``<folder>/<name>`` (PNG, 110 dpi) and return the path."""
    out = fig_dir(folder) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return out


@dataclass
class Table:
    """Rows of dicts that render as an HTML table in a notebook and as Markdown elsewhere."""

    rows: list[dict]
    columns: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.columns:
            for r in self.rows:
                self.columns += [k for k in r if k not in self.columns]

    def _cell(self, row: dict, col: str) -> str:
        v = row.get(col, "")
        return "" if v is None else str(v)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(self._cell(r, c))}</td>"
                                        for c in self.columns) + "</tr>" for r in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def to_markdown(self) -> str:
        lines = ["| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(self._cell(r, c).replace("|", "\\|") for c in self.columns)
                  + " |" for r in self.rows]
        return "\n".join(lines)

    __str__ = to_markdown

    def __len__(self) -> int:
        return len(self.rows)


def close_pool(pool) -> None:
    """Close a :class:`~simsched.targets.Releases` pool (its workers exit in parallel)."""
    pool.close()


# --- layouts -------------------------------------------------------------------------------------

def layout_from(obj: Any) -> Layout:
    """A Layout from a Layout, a JSON text, a dict (a layout or a case) or a file path."""
    if isinstance(obj, Layout):
        return obj
    if isinstance(obj, Case):
        return obj.layout
    if isinstance(obj, Path) or (isinstance(obj, str) and not obj.lstrip().startswith("{")):
        obj = json.loads(Path(obj).read_text())
    elif isinstance(obj, str):
        obj = json.loads(obj)
    if isinstance(obj, dict) and "layout" in obj:
        obj = obj["layout"]
    return Layout.from_json(obj)


def geometry_rows(layout: Layout, num_tokens: int = 256,
                  profiles: Iterable[str] | None = None, asserts: bool = True) -> Table:
    """The model's ``config_outcome`` for ``layout`` under each profile, one row per profile."""
    from simsched.geometry import config_outcome
    rows = []
    for name in profiles or PROFILES:
        p = get_profile(name)
        out = config_outcome(layout, num_tokens, p, asserts)
        row = {"profile": name, "releases": ", ".join(p.releases) or "(proposal)"}
        if out["status"] == "ok":
            g = out["geometry"]
            row.update({
                "outcome": "ok", "hash unit": g["tokens_per_hash"],
                "scheduler block": g["scheduler_block_size"],
                "blocks/chunk": g["blocks_per_chunk"], "alignment": g["alignment_tokens"],
                "offloaded groups (tok/block, tok/chunk, hash/chunk, window)": "; ".join(
                    f"g{x['group_id']}: {x['tokens_per_block']}, {x['tokens_per_chunk']}, "
                    f"{x['hashes_per_chunk']}, {x['sliding_window_in_chunks']}"
                    for x in g["groups"]),
                "keys for the request": " ".join(
                    f"g{x['group_id']}:{len(k)}" for x, k in zip(g["groups"],
                                                                  out["offload_keys"]))})
        else:
            row.update({"outcome": f"{out['exception']} in {out['function']}",
                        "hash unit": "", "scheduler block": "", "blocks/chunk": "",
                        "alignment": "",
                        "offloaded groups (tok/block, tok/chunk, hash/chunk, window)":
                            out["message"][:90], "keys for the request": ""})
        rows.append(row)
    return Table(rows)


def _lenient_geometry(layout: Layout, profile: Profile):
    """(geometry or None, note): the profile's geometry; where it raises, the same profile
    with asserts stripped (what the code would compute past the assert), or None."""
    try:
        return derive(layout, profile, True), ""
    except ConfigError as e:
        note = f"{profile.name}: {e.exception} in {e.function}"
    try:
        return derive(layout, profile, False), note + " (drawn as with asserts stripped)"
    except ConfigError:
        return None, note


def draw_layout(layout: Layout, profile: str | Profile = DEFAULT_PROFILE, *, span: int | None = None,
                ax=None, title: str | None = None):
    """Per KV cache group, one token axis with four lanes: blocks, offload chunks, hash units,
    keys. A chunk that ends on no hash boundary gets no key and is drawn red: with
    ``full/16 + ring/4`` a ring chunk of 4 tokens sits under a 16-token hash unit."""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    geo, note = _lenient_geometry(layout, prof)
    if geo is not None:
        tph, offloaded = geo.tokens_per_hash, {g.group_id: g for g in geo.groups}
    else:
        offloaded = {}
        try:
            tph = resolve_block_sizes(layout, prof)[1]
        except ConfigError:
            tph = None
    sizes = [g.block_size * (layout.engine.dcp_size if g.dcp_sharded else 1)
             for g in layout.groups]
    chunk_sizes = [g.tokens_per_chunk for g in offloaded.values()]
    if span is None:
        span = 2 * max([*sizes, *chunk_sizes, tph or 1])
        span = min(max(span, 32), 4096)
    n = len(layout.groups)
    lanes = ("blocks", "chunks", "hashes", "keys")
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 0.9 + 1.25 * n))
    else:
        fig = ax.figure
    colours = ("#90caf9", "#a5d6a7", "#ffe082", "#ce93d8")
    y = 0.0
    yticks, ylabels = [], []
    for gi, group in reversed(list(enumerate(layout.groups))):
        g = offloaded.get(gi)
        for li, lane in reversed(list(enumerate(lanes))):
            yy = y
            yticks.append(yy + 0.4)
            ylabels.append(f"g{gi} {lane}")
            if lane == "blocks":
                step = sizes[gi]
                segs = [(s, step) for s in range(0, span, step)]
                ax.broken_barh(segs, (yy, 0.8), facecolors=colours[0], edgecolors="#1565c0",
                               linewidth=0.6)
            elif lane == "chunks" and g is not None and g.tokens_per_chunk > 0:
                step = g.tokens_per_chunk
                segs = [(s, step) for s in range(0, span, step)]
                bad = g.hashes_per_chunk == 0 or (tph and step % tph)
                ax.broken_barh(segs, (yy, 0.8), facecolors="#ef9a9a" if bad else colours[1],
                               edgecolors="#2e7d32" if not bad else "#c62828", linewidth=0.6)
            elif lane == "hashes" and tph:
                segs = [(s, tph) for s in range(0, span, tph)]
                ax.broken_barh(segs, (yy, 0.8), facecolors=colours[2], edgecolors="#f57f17",
                               linewidth=0.6)
            elif lane == "keys" and g is not None and g.tokens_per_chunk > 0 and tph:
                tpc = g.tokens_per_chunk
                for c in range(0, math.ceil(span / tpc)):
                    end = (c + 1) * tpc
                    keyed = end % tph == 0 and g.hashes_per_chunk > 0
                    ax.add_patch(Rectangle((c * tpc, yy), tpc, 0.8, linewidth=0.6,
                                           facecolor=colours[3] if keyed else "#ef5350",
                                           edgecolor="#6a1b9a" if keyed else "#b71c1c"))
                    if keyed and tpc >= span / 24:
                        ax.text(c * tpc + tpc / 2, yy + 0.4, f"h{end // tph - 1}",
                                ha="center", va="center", fontsize=7)
            elif lane in ("chunks", "keys"):
                ax.text(span / 2, yy + 0.4, "not offloaded" if g is None else "", ha="center",
                        va="center", fontsize=8, color="#616161")
            y += 1
        label = f"g{gi} {group.kind}/{group.block_size}"
        if g is not None:
            label += (f": {g.tokens_per_chunk} tok/chunk, {g.hashes_per_chunk} hash/chunk"
                      + ("  <- chunk smaller than the hash unit: never keyed"
                         if g.hashes_per_chunk == 0 else ""))
        ax.text(0, y + 0.05, label, fontsize=9, va="bottom",
                color="#b71c1c" if g is not None and g.hashes_per_chunk == 0 else "black")
        y += 0.9
    ax.set_xlim(0, span)
    ax.set_ylim(-0.2, y + 0.2)
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlabel("token position")
    head = title or f"{layout.describe()}  under {prof.name}"
    sub = (f"hash unit {tph} tokens" if tph else "no hash unit") + (f"  |  {note}" if note else "")
    ax.set_title(f"{head}\n{sub}", fontsize=10)
    ax.legend(handles=[Patch(facecolor=colours[0], label="GPU block"),
                       Patch(facecolor=colours[1], label="offload chunk"),
                       Patch(facecolor=colours[2], label="hash unit"),
                       Patch(facecolor=colours[3], label="chunk with a key (h<i>: hash index)"),
                       Patch(facecolor="#ef5350", label="chunk with no key")],
              loc="upper right", fontsize=7, ncol=5, bbox_to_anchor=(1, -0.12 - 0.05 / max(n, 1)))
    return fig


# --- sweeps --------------------------------------------------------------------------------------

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


# --- campaigns -----------------------------------------------------------------------------------

def load_campaign(folder: str | Path) -> dict:
    """``report.json`` of a campaign output folder, checked for ``simsched-report/1``; each
    finding gets ``repro_dir`` (the folder of its repro, or None when it is not there)."""
    folder = Path(folder)
    data = json.loads((folder / "report.json").read_text())
    if data.get("format") != "simsched-report/1":
        raise ValueError(f"{folder}/report.json: not a simsched-report/1 file "
                         f"(format {data.get('format')!r})")
    for f in data["findings"]:
        d = folder / Path(f["case"]).parent
        f["repro_dir"] = str(d) if (d / "case.json").exists() else None
    data["folder"] = str(folder)
    return data


def campaign_summary(data: dict) -> Table:
    return Table([{"seed": data["seed"], "budget (s)": data["budget_s"],
                   "elapsed (s)": data["elapsed_s"],
                   "worker start-up (s)": data.get("worker_startup_s"),
                   "examples": data["examples"], "examples/s": data["examples_per_s"],
                   "findings": len(data["findings"]),
                   "releases": ", ".join(data["releases_installed"]) or "none"}])


def _time_axes(ax):
    """The axes of a plot against seconds into the campaign (a new figure when ``ax`` is None)."""
    if ax is None:
        _fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.set_xlabel("seconds into the campaign")
    ax.grid(alpha=0.3)
    return ax


def draw_timeline(data: dict, ax=None):
    """Cumulative findings over the campaign's time (``timeline``), one marker per finding."""
    ax = _time_axes(ax)
    tl = sorted(data.get("timeline", []), key=lambda e: e["t"])
    ts = [0.0] + [e["t"] for e in tl] + [data["elapsed_s"]]
    ns = [0] + list(range(1, len(tl) + 1)) + [len(tl)]
    ax.step(ts, ns, where="post", color="#c62828")
    ax.plot([e["t"] for e in tl], range(1, len(tl) + 1), "o", color="#c62828", markersize=4)
    ax.set_ylabel("findings")
    ax.set_title(f"findings over time ({len(data['findings'])} in the report)", fontsize=10)
    return ax.figure


def draw_throughput(data: dict, ax=None):
    """Examples generated against time (the timeline records the count at each finding)."""
    ax = _time_axes(ax)
    tl = sorted(data.get("timeline", []), key=lambda e: e["t"])
    ts = [0.0] + [e["t"] for e in tl] + [data["elapsed_s"]]
    ex = [0] + [e["examples"] for e in tl] + [data["examples"]]
    ax.plot(ts, ex, "-o", color="#1565c0", markersize=3)
    ax.set_ylabel("examples")
    ax.set_title(f"throughput: {data['examples_per_s']} examples/s overall", fontsize=10)
    return ax.figure


def draw_coverage(data: dict, axes=None):
    """Examples per layout family and per knob or group kind (``families``, ``knobs``)."""
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, colour in zip(axes, ("families", "knobs"), ("#00897b", "#5e35b1")):
        items = sorted(data.get(key, {}).items(), key=lambda kv: kv[1])
        ax.barh([k for k, _ in items], [v for _, v in items], color=colour)
        ax.set_title(f"coverage: {key}", fontsize=10)
        ax.set_xlabel("examples")
        ax.tick_params(axis="y", labelsize=8)
    return axes[0].figure


def draw_example_rate(data: dict, ax=None):
    """Examples per second over the campaign (``samples``: examples counted about every second;
    the rate drops to zero while a finding is being shrunk), with the overall average."""
    ax = _time_axes(ax)
    pts = sorted(data.get("samples", []), key=lambda e: e["t"])
    ts, rates = [], []
    for a, b in zip(pts, pts[1:]):
        if b["t"] > a["t"]:
            ts.append(a["t"])
            rates.append((b["examples"] - a["examples"]) / (b["t"] - a["t"]))
    if ts:
        ts.append(pts[-1]["t"])
        rates.append(rates[-1])
        ax.step(ts, rates, where="post", color="#1565c0", linewidth=1)
    ax.axhline(data["examples_per_s"], color="#90a4ae", linestyle="--", linewidth=1,
               label=f"overall {data['examples_per_s']}/s")
    ax.set_ylabel("examples per second")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("examples per second", fontsize=10)
    return ax.figure


def draw_arcs(data: dict, ax=None):
    """Arcs of vLLM's offloading code covered inside the release workers (``arcs_timeline``)."""
    ax = _time_axes(ax)
    pts = sorted(data.get("arcs_timeline", []), key=lambda e: e["t"])
    ax.step([p["t"] for p in pts], [p["arcs"] for p in pts], where="post", color="#6a1b9a")
    ax.set_ylabel("arcs covered")
    ax.set_title(f"vLLM offloading code covered: {data.get('vllm_arcs', 0)} arcs "
                 f"(steering: {data.get('steer', '?')})", fontsize=10)
    return ax.figure


#: the report's plots: file name (beside report.md), title, drawing function, needed key
REPORT_PLOTS = (
    ("plot-findings.png", "Findings over time", draw_timeline, "timeline"),
    ("plot-examples-per-s.png", "Examples per second", draw_example_rate, "samples"),
    ("plot-coverage.png", "Coverage of layout families and knobs", draw_coverage, "families"),
    ("plot-vllm-arcs.png", "vLLM offloading code covered", draw_arcs, "arcs_timeline"),
)


def write_report_plots(data: dict, folder: str | Path) -> list[tuple[str, str]]:
    """Draw the report's plots as PNGs in ``folder`` (always there, whatever
    ``$SIMSCHED_FIG_DIR`` says), each written atomically; returns (title, file name) of each
    plot drawn (a plot whose data the report lacks is skipped)."""
    folder = Path(folder)
    done = []
    for name, title, draw, key in REPORT_PLOTS:
        if key not in data:
            continue
        fig = draw(data)
        tmp = folder / (name + ".tmp")
        try:
            fig.savefig(tmp, dpi=100, bbox_inches="tight", format="png")
        finally:
            plt.close(fig)
        os.replace(tmp, folder / name)
        done.append((title, name))
    return done


AFFECTED, CLEAN, NOT_RUN, NOT_IN_CAMPAIGN = "affected", "clean", "not run", "not in campaign"
MATRIX_COLOURS = {AFFECTED: "#e53935", CLEAN: "#43a047", NOT_RUN: "#bdbdbd",
                  NOT_IN_CAMPAIGN: "#f5f5f5"}


def release_matrix(data: dict) -> tuple[list[str], list[str], list[list[str]]]:
    """(finding ids, releases, states): rows findings, columns releases, each cell
    affected / clean / not run (the release could not run the case) / not in campaign."""
    releases = set(data.get("releases_installed", []))
    for f in data["findings"]:
        releases |= set(f["releases_affected"]) | set(f["releases_clean"])
        releases |= set(f.get("releases_not_run", {}))
    cols = sorted(releases, key=version_key)
    rows, states = [], []
    for f in data["findings"]:
        rows.append(f["id"])
        line = []
        for r in cols:
            if r in f["releases_affected"]:
                line.append(AFFECTED)
            elif r in f["releases_clean"]:
                line.append(CLEAN)
            elif r in f.get("releases_not_run", {}):
                line.append(NOT_RUN)
            else:
                line.append(NOT_IN_CAMPAIGN)
        states.append(line)
    return rows, cols, states


def findings_table(data: dict) -> Table:
    """The findings with their release matrix as text (A affected, . clean, - not run)."""
    ids, cols, states = release_matrix(data)
    mark = {AFFECTED: "A", CLEAN: ".", NOT_RUN: "-", NOT_IN_CAMPAIGN: " "}
    rows = []
    for f, line in zip(data["findings"], states):
        row = {"id": f["id"], "kind": f["kind"],
               "what": f"{f.get('exception') or ''} {f.get('function') or f.get('field') or ''}",
               "layout": f["layout"]}
        row.update({c: mark[s] for c, s in zip(cols, line)})
        row["profiles"] = len(f["profiles_affected"])
        row["repro shipped"] = "yes" if f.get("repro_dir") else ""
        rows.append(row)
    return Table(rows)


def draw_release_matrix(data: dict, ax=None):
    ids, cols, states = release_matrix(data)
    order = list(MATRIX_COLOURS)
    if ax is None:
        fig, ax = plt.subplots(figsize=(2.5 + 0.8 * len(cols), 0.8 + 0.3 * max(len(ids), 1)))
    grid = [[order.index(s) for s in line] for line in states] or [[order.index(NOT_IN_CAMPAIGN)]]
    ax.imshow(grid, cmap=ListedColormap([MATRIX_COLOURS[s] for s in order]), vmin=-0.5,
              vmax=len(order) - 0.5, aspect="auto")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels(cols, rotation=45, ha="right")
    labels = [f"{f['signature'].removeprefix('crash:')} | {f['layout'][:38]}"
              for f in data["findings"]]
    ax.set_yticks(range(len(ids)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xticks([x - 0.5 for x in range(1, len(cols))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(ids))], minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ax.legend(handles=[Patch(facecolor=MATRIX_COLOURS[s], edgecolor="#9e9e9e", label=s)
                       for s in order], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title("findings x releases", fontsize=10)
    return ax.figure


def campaign_figure(data: dict):
    """One figure for the docs: timeline, throughput, family coverage and the release matrix."""
    n = max(len(data["findings"]), 1)
    fig = plt.figure(figsize=(15, 5 + 0.22 * n))
    gs = fig.add_gridspec(2, 3, height_ratios=[1, max(1.2, 0.09 * n)], width_ratios=[1, 1, 1])
    draw_timeline(data, fig.add_subplot(gs[0, 0]))
    draw_throughput(data, fig.add_subplot(gs[0, 1]))
    ax = fig.add_subplot(gs[0, 2])
    items = sorted(data.get("families", {}).items(), key=lambda kv: kv[1])
    ax.barh([k for k, _ in items], [v for _, v in items], color="#00897b")
    ax.set_title("coverage: layout families", fontsize=10)
    draw_release_matrix(data, fig.add_subplot(gs[1, :]))
    folder = Path(data.get("folder", ""))
    if folder.is_absolute() and folder.is_relative_to(REPO_ROOT):
        folder = folder.relative_to(REPO_ROOT)
    fig.suptitle(f"campaign {folder}: seed {data['seed']}, "
                 f"{data['examples']} examples in {data['elapsed_s']} s", fontsize=11)
    fig.tight_layout()
    return fig


# --- findings: traces ----------------------------------------------------------------------------

_KEY = re.compile(r"g(\d+):(\d+)=(\S+)")
_ALLOC = re.compile(r"g(\d+)=(\S+)")


@dataclass
class Occupancy:
    """Per scheduler step (from a ``simsched-trace/1`` trace): GPU blocks held per group (the most
    held at once during the step, before the step's finishes free them), offload
    chunks in flight (stored, not yet done) and completed per group, chunks loaded per group."""

    steps: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    blocks: dict = field(default_factory=dict)          # group -> [blocks held, per step]
    storing: dict = field(default_factory=dict)         # group -> [chunks in flight]
    stored: dict = field(default_factory=dict)          # group -> [chunks stored, cumulative]
    loaded: dict = field(default_factory=dict)          # group -> [chunks loaded, cumulative]
    end: str = ""                                        # last line if crash/violation


def occupancy(trace: list[str]) -> Occupancy:
    held: dict[str, dict[int, set]] = {}      # rid -> group -> blocks
    jobs: dict[str, tuple[str, dict[int, int]]] = {}   # job -> (store|load, group -> chunks)
    occ = Occupancy()
    groups: set[int] = set()
    cum_store: dict[int, int] = {}
    cum_load: dict[int, int] = {}
    snaps: list[tuple[int, dict, dict, dict, dict]] = []
    step = None

    peak: dict[int, int] = {}

    def held_now() -> dict[int, int]:
        blocks: dict[int, set] = {}
        for per in held.values():
            for g, bs in per.items():
                blocks.setdefault(g, set()).update(bs)
        return {g: len(b) for g, b in blocks.items()}

    def note_peak() -> None:
        for g, n in held_now().items():
            peak[g] = max(peak.get(g, 0), n)

    def snapshot():
        if step is None:
            return
        note_peak()
        blocks = dict(peak)
        peak.clear()
        inflight: dict[int, int] = {}
        for kind, per in jobs.values():
            if kind == "store":
                for g, n in per.items():
                    inflight[g] = inflight.get(g, 0) + n
        snaps.append((step, blocks, inflight,
                      dict(cum_store), dict(cum_load)))

    for line in trace:
        if line.startswith("#") or not line.strip():
            continue
        parts = line.split(" ")
        kind = parts[0]
        if kind == "step":
            snapshot()
            step = int(parts[1])
        elif kind == "alloc":
            rid = parts[1]
            for g, bl in _ALLOC.findall(" ".join(parts[2:])):
                g = int(g)
                groups.add(g)
                if bl != "-":
                    held.setdefault(rid, {}).setdefault(g, set()).update(
                        int(b) for b in bl.split(",") if b != "0")
        elif kind in ("store", "load"):
            jid, rid = parts[1], parts[2]
            per: dict[int, int] = {}
            for g, _h, bl in _KEY.findall(" ".join(parts[3:])):
                g = int(g)
                groups.add(g)
                per[g] = per.get(g, 0) + 1
                if kind == "load" and bl != "-":
                    held.setdefault(rid, {}).setdefault(g, set()).update(
                        int(b) for b in bl.split(",") if b != "0")
            jobs[jid] = (kind, per)
        elif kind == "done":
            k, per = jobs.pop(parts[1], (parts[2], {}))
            target = cum_store if k == "store" else cum_load
            for g, n in per.items():
                target[g] = target.get(g, 0) + n
        elif kind in ("finish", "preempt"):
            note_peak()
            held.pop(parts[1], None)
        elif kind in ("crash", "violation"):
            occ.end = line
    snapshot()
    occ.groups = sorted(groups)
    occ.steps = [s[0] for s in snaps]
    for g in occ.groups:
        occ.blocks[g] = [s[1].get(g, 0) for s in snaps]
        occ.storing[g] = [s[2].get(g, 0) for s in snaps]
        occ.stored[g] = [s[3].get(g, 0) for s in snaps]
        occ.loaded[g] = [s[4].get(g, 0) for s in snaps]
    return occ


def draw_occupancy(trace: list[str], axes=None, title: str = ""):
    """GPU blocks held and offload chunks (in flight, stored, loaded) per group over the steps,
    as the trace shows them at the end of each step."""
    occ = occupancy(trace)
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    ax_b, ax_c = axes
    if not occ.steps:
        for ax in axes:
            ax.text(0.5, 0.5, occ.end or "no steps: the case never got past configuration",
                    ha="center", va="center", transform=ax.transAxes, fontsize=9, wrap=True,
                    color="#b71c1c")
            ax.set_axis_off()
        axes[0].set_title(title, fontsize=10)
        return axes[0].figure
    cmap = plt.get_cmap("tab10")
    for i, g in enumerate(occ.groups):
        ax_b.step(occ.steps, occ.blocks[g], where="post", color=cmap(i), label=f"g{g}")
        ax_c.step(occ.steps, occ.stored[g], where="post", color=cmap(i),
                  label=f"g{g} stored (cumulative)")
        ax_c.step(occ.steps, occ.storing[g], where="post", color=cmap(i), linestyle=":",
                  label=f"g{g} store in flight")
        if any(occ.loaded[g]):
            ax_c.step(occ.steps, occ.loaded[g], where="post", color=cmap(i), linestyle="--",
                      label=f"g{g} loaded (cumulative)")
    ax_b.set_title(f"GPU blocks held (peak in step) {title}", fontsize=10)
    ax_c.set_title(f"offload chunks {title}", fontsize=10)
    for ax in axes:
        ax.set_xlabel("scheduler step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if occ.end:
        ax_b.annotate(occ.end, xy=(0.02, 0.92), xycoords="axes fraction", fontsize=8,
                      color="#b71c1c")
    return ax_b.figure


def trace_steps(trace: list[str]) -> list[tuple[str, list[str]]]:
    """The trace cut into (heading, lines) per step, for printing step by step."""
    out: list[tuple[str, list[str]]] = [("configuration", [])]
    for line in trace:
        if line.startswith("#"):
            continue
        if line.startswith("step "):
            out.append((line, []))
        else:
            out[-1][1].append(line)
    return [s for s in out if s[0] != "configuration" or s[1]]


def release_states(signature: str, outcomes: dict) -> dict[str, str]:
    """Per target: affected (shows ``signature``), clean, not run, or the other crash it shows."""
    from simsched.outcome import crash_signature, finding_signature
    states = {}
    for name, o in outcomes.items():
        status = o.get("status")
        if status in ("unsupported", "worker", "refused", "invalid") or o.get("stage") == "worker":
            states[name] = NOT_RUN
            continue
        # a config outcome's crash, or what a step-by-step run (status ``ran``) found
        sigs = ([crash_signature(o)] if status == "error" else
                [finding_signature(f) for f in o.get("findings") or []] if status == "ran"
                else [])
        if any(str(sig) == signature for sig in sigs if sig is not None):
            states[name] = AFFECTED
        elif sigs and sigs[0] is not None:
            sig = sigs[0]
            states[name] = (f"other: {sig.exception} in {sig.function}" if sig.kind == "crash"
                            else f"other: {sig.invariant}")
        else:
            states[name] = CLEAN
    return states


def draw_release_strip(signature: str, outcomes: dict, ax=None, title: str | None = None):
    """One row per target (releases first), coloured by :func:`release_states`."""
    states = release_states(signature, outcomes)
    names = sorted(states, key=version_key)
    colours = dict(MATRIX_COLOURS)
    for i, s in enumerate(sorted({s for s in states.values() if s.startswith("other")})):
        colours[s] = CRASH_COLOURS[(i + 1) % len(CRASH_COLOURS)]
    order = list(colours)
    if ax is None:
        fig, ax = plt.subplots(figsize=(5, 0.6 + 0.3 * len(names)))
    ax.imshow([[order.index(states[n])] for n in names],
              cmap=ListedColormap([colours[s] for s in order]), vmin=-0.5,
              vmax=len(order) - 0.5, aspect="auto")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.set_xticks([])
    for y, n in enumerate(names):
        ax.text(0, y, states[n], ha="center", va="center", fontsize=7)
    ax.set_title(title or signature, fontsize=9)
    return ax.figure
