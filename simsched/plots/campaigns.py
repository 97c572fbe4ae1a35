"""Figures and tables of a campaign's ``report.json``: findings over time, examples per second,
coverage of layout families and knobs, vLLM arcs covered, and the findings x releases matrix;
:func:`write_report_plots` draws the PNGs that a campaign's ``report.md`` links.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from simsched.plots.common import (AFFECTED, CLEAN, MATRIX_COLOURS, NOT_IN_CAMPAIGN, NOT_RUN,
                                   REPO_ROOT, Table, version_key)

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch


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
