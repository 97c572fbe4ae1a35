"""Figures of one finding: block and chunk occupancy per scheduler step parsed from its
``simsched-trace/1`` trace (:func:`occupancy`, :func:`draw_occupancy`), the trace cut step by
step, and each target's state for its signature (:func:`release_states`,
:func:`draw_release_strip`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from simsched.plots.common import (AFFECTED, CLEAN, CRASH_COLOURS, MATRIX_COLOURS, NOT_RUN,
                                   version_key)

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap


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
