"""Campaign reports: ``report.json`` (the stable contract people script against) and ``report.md``.

``report.json`` (``format: simsched-report/1``) holds the campaign's figures and a ``findings``
list; every finding has ``id``, ``signature``, ``kind`` (crash, invariant, divergence),
``exception``, ``function``, ``file`` (relative to the ``vllm`` package, or to the project for a
model finding), ``releases_affected``, ``releases_clean``, ``profiles_affected``, ``case`` (path
relative to the output folder) and the sizes ``groups``, ``requests``, ``steps``. Both files are
written atomically: a campaign killed at any moment leaves the last complete report. At the end
of a campaign, report.md links PNG plots written beside it (:data:`simsched.plots.REPORT_PLOTS`):
findings over time, examples per second (from ``samples``), coverage of layout families and
knobs, and, when the release workers collected it, the arcs of vLLM's offloading code covered
(``vllm_arcs``, ``arcs_timeline``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def markdown(data: dict, plots: list[tuple[str, str]] | None = None,
             plot_error: str | None = None) -> str:
    lines = ["# simsched campaign report", "",
             f"Seed {data['seed']}, budget {data['budget_s']} s, elapsed {data['elapsed_s']} s, "
             f"{data['examples']} examples ({data['examples_per_s']}/s).  ",
             f"Targets: {', '.join(data['targets']) or 'none'}.  ",
             f"Releases installed: {', '.join(data['releases_installed']) or 'none'}.", "",
             f"## Findings ({len(data['findings'])})", ""]
    if data["findings"]:
        lines += ["| id | kind | what | layout | present in | absent from | profiles | asserts |",
                  "|---|---|---|---|---|---|---|---|"]
        for f in data["findings"]:
            what = f"{f.get('exception') or ''} {f.get('function') or f.get('field') or ''}".strip()
            lines.append(
                f"| [{f['id']}]({f['case'].rsplit('/', 1)[0]}/README.md) | {f['kind']} | {what} | "
                f"`{f['layout']}` | {', '.join(f['releases_affected']) or '-'} | "
                f"{', '.join(f['releases_clean']) or '-'} | "
                f"{', '.join(f['profiles_affected']) or '-'} | {'on' if f['asserts'] else 'off'} |")
    else:
        lines.append("No findings.")
    if plots or plot_error:
        lines += ["", "## Plots", ""]
        for title, name in plots or []:
            lines += [f"![{title}]({name})", ""]
        if plot_error:
            lines.append(f"Plots not drawn: {plot_error}")
    lines += ["", "## Coverage", "", "Layout families: "
              + (", ".join(f"{k} {v}" for k, v in data["families"].items()) or "none"), "",
              "Knobs and kinds: " + (", ".join(f"{k} {v}" for k, v in data["knobs"].items())
                                     or "none"), ""]
    if "vllm_arcs" in data:
        lines += [f"vLLM offloading code covered inside the release workers: "
                  f"{data['vllm_arcs']} arcs (steering: {data.get('steer', '?')}).", ""]
    return "\n".join(lines)


def write_worker_stats(out: Path, name: str, data: dict) -> None:
    """A worker process's figures (its findings are on disk already)."""
    folder = Path(out) / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    _atomic(folder / f"{name}.json", json.dumps(
        {k: v for k, v in data.items() if k != "findings"}, indent=1) + "\n")


def merge(out: Path, findings: list[dict], base: dict) -> dict:
    """One report from the worker processes' figures and every finding on disk."""
    parts = []
    for path in sorted((Path(out) / "workers").glob("*.json")):
        try:
            parts.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    data = dict(base)
    data["workers"] = len(parts)
    data["examples"] = sum(p.get("examples", 0) for p in parts)
    data["model_steps"] = sum(p.get("model_steps", 0) for p in parts)
    data["shrinking_s"] = round(sum(p.get("shrinking_s", 0.0) for p in parts), 3)
    el = max((p.get("elapsed_s", 0.0) for p in parts), default=0.0)
    data["elapsed_s"] = el
    data["examples_per_s"] = round(data["examples"] / el, 1) if el else 0.0
    data["model_steps_per_s"] = round(data["model_steps"] / el, 1) if el else 0.0
    data["interrupted"] = any(p.get("interrupted") for p in parts)
    data["worker_startup_s"] = max((p.get("worker_startup_s", 0.0) for p in parts), default=0.0)
    for key in ("families", "knobs"):
        total: dict = {}
        for p in parts:
            for k, v in p.get(key, {}).items():
                total[k] = total.get(k, 0) + v
        data[key] = dict(sorted(total.items()))
    data["timeline"] = sorted((t for p in parts for t in p.get("timeline", [])),
                              key=lambda t: t["t"])
    data["samples"] = _sum_samples([p.get("samples", []) for p in parts])
    arcs = [p for p in parts if "vllm_arcs" in p]
    if arcs:   # each worker process has its own release workers: the largest, not a sum
        best = max(arcs, key=lambda p: p["vllm_arcs"])
        data["vllm_arcs"], data["arcs_timeline"] = best["vllm_arcs"], best["arcs_timeline"]
    if parts:
        data["steer"] = parts[0].get("steer")
    data["findings"] = findings
    write(out, data, plots=True)
    return data


def _sum_samples(series: list[list[dict]]) -> list[dict]:
    """Several workers' (t, examples) samples as one series: at each sample time, the sum of
    every worker's latest count."""
    times = sorted({e["t"] for ser in series for e in ser})
    out = []
    for t in times:
        total = 0
        for ser in series:
            total += max((e["examples"] for e in ser if e["t"] <= t), default=0)
        out.append({"t": t, "examples": total})
    return out


def write(out: Path, data: dict, plots: bool = False) -> None:
    """Write report.json and report.md; with ``plots`` (at the end of a campaign) also the
    PNGs that report.md links (:func:`simsched.plots.write_report_plots`), beside it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _atomic(out / "report.json", json.dumps(data, indent=1) + "\n")
    drawn, error = None, None
    if plots:
        try:
            from simsched.plots import write_report_plots
            drawn = write_report_plots(data, out)
        except Exception as e:   # noqa: BLE001 - the report itself must still be written
            error = f"{type(e).__name__}: {e}"
    _atomic(out / "report.md", markdown(data, drawn, error))
