"""The default campaign's throughput, this tree against another checkout, side by side.

Runs ``simsched fuzz --budget B --seed S`` (the README's main job, shortened) from this tree and
from ``--base`` (a checkout of an earlier commit, its model compiled in place: ``python setup.py
build_ext --inplace`` with mypy installed), alternately, ``--runs`` times each, and prints the
medians of each report's examples per second, real Scheduler steps per second and findings.
Worker start-up is not in the figures (a campaign's clock starts once its workers are ready).

Run: ``python bench/bench_campaign_speed.py --base ../simsched-before [--budget 120]
[--seed 1] [--runs 3] [--releases 0.30.0,0.33.0]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(tree: Path, budget: float, seed: int, releases: str | None) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "simsched.cli", "fuzz", "--budget", str(budget),
               "--seed", str(seed), "--out", out]
        if releases:
            cmd += ["--releases", releases]
        subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=budget + 1800)
        data = json.loads((Path(out) / "report.json").read_text())
    real = data.get("summary", {}).get("real_steps", 0)
    # the model's share of the seconds the campaign spent running cases (report ``seconds``:
    # the model under every profile, and each release's config and step runs)
    secs = data.get("seconds", {})
    spent = secs.get("model", 0.0) + sum(v for k, v in secs.items()
                                         if k not in ("model", "shrinking"))
    # the same share on the offloading path alone: the other connector paths
    # (simsched.connectors) are checked on the real run alone, their step runs add release time
    # the model has no part in
    other = sum(st.get("seconds", 0.0) for path, st in data.get("per_path", {}).items()
                if path != "offloading")
    return {"examples_per_s": data["examples_per_s"],
            "model_share": secs.get("model", 0.0) / spent if spent else 0.0,
            "model_share_offloading_path": (secs.get("model", 0.0) / (spent - other)
                                            if spent > other else 0.0),
            "real_steps_per_s": real / data["elapsed_s"] if data["elapsed_s"] else 0.0,
            "findings": len(data["findings"]),
            "clusters": data.get("summary", {}).get("clusters_total", len(data["findings"]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--budget", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--releases")
    args = ap.parse_args(argv)
    rows: dict[str, list[dict]] = {"base": [], "this tree": []}
    for _ in range(args.runs):
        for name, tree in (("base", args.base.resolve()), ("this tree", ROOT)):
            r = one(tree, args.budget, args.seed, args.releases)
            rows[name].append(r)
            print(name, json.dumps(r), file=sys.stderr, flush=True)
    med = statistics.median
    print(f"`simsched fuzz --budget {args.budget:g} --seed {args.seed}`"
          + (f" `--releases {args.releases}`" if args.releases else "")
          + f", medians of {args.runs} alternating runs.\n")
    print("| tree | examples/s | real steps/s | model share of case time | the same, offloading "
          "path | findings | clusters |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in rows.items():
        print(f"| {name} | {med(r['examples_per_s'] for r in rs):.1f} | "
              f"{med(r['real_steps_per_s'] for r in rs):.0f} | "
              f"{100 * med(r['model_share'] for r in rs):.1f}% | "
              f"{100 * med(r['model_share_offloading_path'] for r in rs):.1f}% | "
              f"{med(r['findings'] for r in rs):.0f} | {med(r['clusters'] for r in rs):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
