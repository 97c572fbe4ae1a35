"""Campaign reports: ``report.json`` (the stable contract people script against) and ``report.md``.

``report.json`` (``format: simsched-report/1``) holds the campaign's figures and a ``findings``
list; every finding has ``id``, ``signature``, ``kind`` (crash, invariant, divergence),
``exception``, ``function``, ``file`` (relative to the ``vllm`` package, or to the project for a
model finding), ``releases_affected``, ``releases_clean``, ``profiles_affected``, ``case`` (path
relative to the output folder) and the sizes ``groups``, ``requests``, ``steps``; its ``class``
(bug, validation, model-gap, proposal, predicted: :mod:`fuzz.triage`), its ``cluster`` (the
cause: findings with one cluster are variants of one bug), ``first_bad_step`` and ``range``
("regressed in / fixed in"). A release is in ``releases_clean`` only when the case ran there step
by step and nothing showed; ``releases_other`` names what a release showed instead;
``releases_refused`` names the releases that refuse a start-up crash's case with a clean error
(the crash's fix: they end its ``range``, and the refusal joins its cluster);
``releases_not_run`` says why a release could not run it. A cluster's class is its gravest
member's. The report
also has ``summary`` (clusters per class, cases and real steps per release, examples per second,
seconds per target) and ``tool_errors`` (simsched's own failures, never findings). Both files are
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

from fuzz import triage as tri


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def clusters(findings: list[dict]) -> dict[str, list[dict]]:
    """Findings grouped by cluster (one cause), in the order first found."""
    out: dict[str, list[dict]] = {}
    for f in findings:
        out.setdefault(f.get("cluster") or f["id"], []).append(f)
    return out


def cluster_class(members: list[dict]) -> str:
    """A cluster's class: its gravest member's (a start-up assert joined by the clean refusal
    that fixed it in later releases is a bug, whichever was found first)."""
    order = tri.CLASSES
    return min((m.get("class", "unclassified") for m in members),
               key=lambda k: order.index(k) if k in order else len(order))


def affected(members: list[dict]) -> set[str]:
    """The releases a cluster's cause shows on: those of its members of the cluster's class
    (the clean refusal that fixed a start-up assert is not the assert's presence)."""
    klass = cluster_class(members)
    return {v for m in members if m.get("class") == klass for v in m["releases_affected"]}


def cluster_range(members: list[dict]) -> str:
    """"regressed in / fixed in" of the whole cluster: over its members of the cluster's class,
    a release affected by any of them is affected; one that ran clean or refused the case for
    all of them ends a range (a member alone keeps its own ``range``)."""
    klass = cluster_class(members)
    own = [m for m in members if m.get("class") == klass]
    if len(own) == 1:
        return own[0].get("range", "-")
    hit = affected(members)
    clean = {v for m in own for v in m.get("releases_clean", [])} - hit
    refused = {v for m in own for v in m.get("releases_refused", {})} - hit - clean
    return tri.regressed_fixed(sorted(hit), sorted(clean), [], sorted(refused))


def summary(data: dict) -> dict:
    """The headline figures: clusters per class, what ran per release, where the time went."""
    per_class: dict[str, int] = {}
    for members in clusters(data["findings"]).values():
        k = cluster_class(members)
        per_class[k] = per_class.get(k, 0) + 1
    newest = _newest(data.get("releases_installed", []))
    bugs_newest = sum(1 for m in clusters(data["findings"]).values()
                      if cluster_class(m) == "bug"
                      and newest in affected(m))
    per_release = data.get("per_release", {})
    el = data.get("elapsed_s") or 0.0
    real = sum(st.get("real_steps", 0) for st in per_release.values())
    return {"clusters": per_class, "clusters_total": sum(per_class.values()),
            "bugs_in_newest": bugs_newest, "newest": newest,
            "tool_errors": len(data.get("tool_errors", [])),
            "examples": data.get("examples", 0), "examples_per_s": data.get("examples_per_s", 0),
            "real_steps": real, "real_steps_per_s": round(real / el, 1) if el else 0.0,
            "cases_per_release": {v: st.get("step_cases", 0) for v, st in per_release.items()},
            "real_steps_per_release": {v: st.get("real_steps", 0)
                                       for v, st in per_release.items()},
            # the connector paths (simsched.connectors) the real runs spent steps on
            "real_steps_per_path": {p: st.get("real_steps", 0)
                                    for p, st in data.get("per_path", {}).items()},
            "seconds": data.get("seconds", {})}


def _vkey(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in v.split("."))


def _newest(versions: list[str]) -> str:
    return max(versions, key=_vkey) if versions else ""


def _what(f: dict) -> str:
    if f["kind"] == "invariant":
        return f"{f['invariant']} ({f.get('op') or '?'}): {(f.get('message') or '')[:90]}"
    if f["kind"] == "crash":
        return f"{f['exception']} in `{f['function']}`" + (
            f" (`{f['source'][:60]}`)" if f.get("source") else "")
    return f"{f.get('field') or f['signature']}"


def _step(f: dict) -> str:
    if f.get("first_bad_step") is not None:
        return f"step {f['first_bad_step']}"
    return "start-up" if f["kind"] == "crash" else "-"


def _rows(members_by_cluster: list[list[dict]]) -> list[str]:
    lines = ["| cluster | what broke | minimal layout | first bad step | present in | "
             "regressed in / fixed in | variants | repro | deployment |",
             "|---|---|---|---|---|---|---|---|---|"]
    for members in members_by_cluster:
        klass = cluster_class(members)
        f = min((m for m in members if m.get("class") == klass),
                key=lambda m: (m["groups"], m["requests"], m["id"]))
        releases = sorted(affected(members), key=_vkey)
        variants = sum(1 + len(m.get("variants", [])) for m in members)
        folder = f["case"].rsplit("/", 1)[0]
        lines.append(f"| {f.get('cluster') or f['id']} | {_what(f)} | `{f['layout']}` | "
                     f"{_step(f)} | {', '.join(releases) or '-'} | {cluster_range(members)} | "
                     f"{variants} | [{f['id']}]({folder}/README.md) | "
                     f"{f.get('deployment', '-')} |")
    return lines


SECTIONS = (
    ("synthetic", "Synthetic: bugs on layouts written as groups that no release's planner builds "
                  "(no deployment reaches them)"),
    ("validation", "Validation: vLLM refused the configuration at start-up, naming the problem"),
    ("model-gap", "Model gaps: the model disagrees with a release whose run broke nothing"),
    ("proposal", "Proposals: shows only under a hypothetical fix profile"),
    ("predicted", "Predicted by the model, not checked step by step on a release"),
)


def markdown(data: dict, plots: list[tuple[str, str]] | None = None,
             plot_error: str | None = None) -> str:
    summ = data.get("summary") or summary(data)
    newest = summ["newest"]
    by_cluster = clusters(data["findings"])
    per_class = summ["clusters"]
    head = ", ".join(f"{per_class.get(k, 0)} {k}" for k in
                     ("bug", "synthetic", "validation", "model-gap", "proposal", "predicted")
                     if per_class.get(k) or k == "bug")
    lines = ["# simsched campaign report", "",
             f"**{head}** clusters ({summ['clusters_total']} in all"
             + (f"; {summ['bugs_in_newest']} bug(s) present in the newest installed release, "
                f"{newest}" if newest else "") + f"); {summ['tool_errors']} tool error(s).", "",
             f"Seed {data['seed']}, budget {data['budget_s']} s, elapsed {data['elapsed_s']} s, "
             f"{data['examples']} examples ({data['examples_per_s']}/s), "
             f"{summ['real_steps']:,} real Scheduler steps ({summ['real_steps_per_s']}/s).  ",
             f"Targets: {', '.join(data['targets']) or 'none'}.  ",
             f"Releases installed: {', '.join(data['releases_installed']) or 'none'}.", ""]
    bugs = [m for m in by_cluster.values() if cluster_class(m) == "bug"]
    present = [m for m in bugs if newest in affected(m)]
    fixed = [m for m in bugs if m not in present]
    lines += [f"## Bugs present in {newest or 'the newest release'} ({len(present)})", ""]
    lines += _rows(present) if present else ["None."]
    lines += ["", f"## Bugs fixed since ({len(fixed)})", ""]
    lines += _rows(fixed) if fixed else ["None."]
    for klass, title in SECTIONS:
        members = [m for m in by_cluster.values() if cluster_class(m) == klass]
        if not members:
            continue
        lines += ["", f"<details><summary>{title} ({len(members)})</summary>", ""]
        lines += _rows(members) + ["", "</details>"]
    if data.get("tool_errors"):
        lines += ["", f"## Tool errors ({len(data['tool_errors'])}): simsched itself raised",
                  "", "Not findings about vLLM; each case is saved for simsched's developers.", "",
                  "| exception | where | target | layout | seen | case |", "|---|---|---|---|---|---|"]
        lines += [f"| {e['exception']} | `{e['function']}` | {e['target']} | `{e['layout']}` | "
                  f"{e['count']} | [{e['case']}]({e['case']}) |" for e in data["tool_errors"]]
    if data.get("per_release"):
        lines += ["", "## What ran on each release", "",
                  "| release | config chains | seconds | cases run step by step | real steps | "
                  "seconds (with the model's trace diffed) |", "|---|---|---|---|---|---|"]
        lines += [f"| {v} | {st['config_cases']} | {st['config_seconds']} | {st['step_cases']} | "
                  f"{st['real_steps']:,} | {st['step_seconds']} |"
                  for v, st in data["per_release"].items()]
        if data.get("per_path"):
            lines += ["", "Real runs per connector path (the model mirrors every path, "
                      "`simple_cpu` short of some layouts: `simsched.model.unmodelled_path`):",
                      "",
                      "| connector path | cases run step by step | real steps | seconds |",
                      "|---|---|---|---|"]
            lines += [f"| {p} | {st['step_cases']:.0f} | {st['real_steps']:,.0f} | "
                      f"{st.get('seconds', 0)} |"
                      for p, st in data["per_path"].items()]
        secs = data.get("seconds", {})
        lines += ["", f"Seconds in the model (every profile): {secs.get('model', 0)}; shrinking "
                  f"and recording findings: {secs.get('shrinking', 0)}."]
    if plots or plot_error:
        lines += ["", "## Plots", ""]
        for title, name in plots or []:
            lines += [f"![{title}]({name})", ""]
        if plot_error:
            lines.append(f"Plots not drawn: {plot_error}")
    lines += ["", "## Coverage", "", "Layout families: "
              + (", ".join(f"{k} {v}" for k, v in data["families"].items()) or "none"), "",
              "Knobs and kinds: " + (", ".join(f"{k} {v}" for k, v in data["knobs"].items())
                                     or "none"), "",
              "Layouts of layers (planned by the newest release): "
              + (", ".join(f"{k} {v}" for k, v in data.get("layers", {}).items()) or "none"),
              ""]
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
    for key in ("families", "knobs", "layers"):
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
    data["per_release"] = {}
    for p in parts:
        for v, st in p.get("per_release", {}).items():
            tot = data["per_release"].setdefault(v, {})
            for k, x in st.items():
                tot[k] = round(tot.get(k, 0) + x, 3)
    data["tool_errors"] = [e for p in parts for e in p.get("tool_errors", [])]
    data["seconds"] = {}
    for p in parts:
        for k, v in p.get("seconds", {}).items():
            data["seconds"][k] = round(data["seconds"].get(k, 0.0) + v, 3)
    data["summary"] = summary(data)
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
            from simsched.plots.campaigns import write_report_plots
            drawn = write_report_plots(data, out)
        except Exception as e:   # noqa: BLE001 - the report itself must still be written
            error = f"{type(e).__name__}: {e}"
    _atomic(out / "report.md", markdown(data, drawn, error))
