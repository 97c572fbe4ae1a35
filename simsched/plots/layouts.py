"""Figures and tables of one layout: the geometry the model derives for it under each behaviour
profile (:func:`geometry_rows`), and per KV cache group one token axis, tokens -> GPU blocks ->
offload chunks -> hash units -> offload keys (:func:`draw_layout`): where a chunk gets no key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from simsched.plots.common import Table

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from simsched.case import Case
from simsched.geometry import derive, resolve_block_sizes
from simsched.layout import Layout
from simsched.profiles import DEFAULT_PROFILE, PROFILES, ConfigError, Profile, get_profile


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
