"""What every family of the notebooks' figures shares: where figures go, the table a notebook
renders, the order of targets (releases by version, then the model's behaviour profiles), and the
colours of a target's state for a finding (affected, clean, not run).

matplotlib runs on the Agg backend when there is no display and no notebook kernel, so every
helper also works in a headless script or test: this module picks the backend, and every other
module of the package imports pyplot after it.
"""

from __future__ import annotations

import html
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

if ("MPLBACKEND" not in os.environ and "ipykernel" not in sys.modules
        and not os.environ.get("DISPLAY")):
    matplotlib.use("Agg")

from simsched.profiles import PROFILES  # noqa: E402

#: the repository root (the notebooks find ``notebooks/data`` and ``docs`` from here)
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DATA_DIR = REPO_ROOT / "notebooks" / "data"
DOCS_DIR = REPO_ROOT / "docs"

CRASH_COLOURS = ["#e53935", "#8e24aa", "#d81b60", "#5e35b1", "#f4511e", "#6d4c41", "#c2185b",
                 "#3949ab", "#b71c1c", "#4a148c"]

#: a target's state for one finding: the campaign's release matrix and a finding's release strip
AFFECTED, CLEAN, NOT_RUN, NOT_IN_CAMPAIGN = "affected", "clean", "not run", "not in campaign"
MATRIX_COLOURS = {AFFECTED: "#e53935", CLEAN: "#43a047", NOT_RUN: "#bdbdbd",
                  NOT_IN_CAMPAIGN: "#f5f5f5"}


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
