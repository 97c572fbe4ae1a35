"""Blind campaign runs: how fast a fresh campaign finds upstream PR #55037's bug class.

    python bench/bench_campaign.py [--seeds 10] [--budget 600] [--target model|0.30.0]
    python bench/bench_campaign.py --scaling [--budget 60]

For each seed, a fresh output folder and database; the campaign stops at the first finding of the
class (the boot AssertionError in build_offloading_config, the islice ValueError in
update_offload_keys, or the offload_keys/offload_block_ids AssertionError in _build_store_jobs)
and reports the time to it and whether its shrunk case is the known minimum (2 groups,
1 request, 1 step). ``--scaling`` measures examples/s with --workers 1 and 2 in one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz.campaign import Campaign  # noqa: E402
from simsched.targets import Releases  # noqa: E402

CLASS = {"crash:AssertionError:build_offloading_config", "crash:ValueError:update_offload_keys",
         "crash:AssertionError:_build_store_jobs"}


def of_the_class(finding) -> bool:
    """One of the three crashes, whatever layout shows it (a Mamba group outside align mode
    trips the same boot assert as a ring does)."""
    return str(finding.signature) in CLASS


def blind_run(seed: int, budget: float, target: str) -> dict:
    with tempfile.TemporaryDirectory() as out, Releases.installed(
            None if target == "model" else [target]) as pool:
        campaign = Campaign(Path(out), pool, model=target == "model",
                            run_releases=[] if target == "model" else [target], budget=budget,
                            seed_=seed, asserts=True, progress=lambda s: None,
                            stop_when=of_the_class)
        t0 = time.monotonic()
        campaign.run()
        hit = next((f for f in campaign.findings.values() if of_the_class(f)), None)
        if hit is None:
            return {"seed": seed, "found": False, "wall_s": time.monotonic() - t0}
        return {"seed": seed, "found": True, "signature": str(hit.signature),
                "time_s": hit.found_after_s, "layout": hit.case.layout.describe(),
                "groups": len(hit.case.layout.groups), "requests": len(hit.case.requests),
                "steps": hit.to_json()["steps"],
                "startup_s": campaign.warmup_s}


def scaling(budget: float) -> list[tuple[int, float]]:
    """Steady-state generation: a first campaign finds the easy findings, then one and two
    workers each resume from a copy of its output, so that shrinking new findings (which stops
    generation) weighs the same on both sides."""
    def fuzz(out: str, workers: int, seconds: float) -> dict:
        subprocess.run([sys.executable, "-m", "simsched.cli", "fuzz", "--target", "model",
                        "--asserts", "on", "--budget", str(seconds), "--workers", str(workers),
                        "--out", out], capture_output=True, check=True)
        return json.loads((Path(out) / "report.json").read_text())

    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        fuzz(f"{tmp}/warm", 1, 3 * budget)
        for workers in (1, 2):
            shutil.copytree(f"{tmp}/warm", f"{tmp}/w{workers}")
            data = fuzz(f"{tmp}/w{workers}", workers, budget)
            rates.append((workers, data["examples"] / budget))
    return rates


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budget", type=float, default=600.0)
    ap.add_argument("--target", default="model")
    ap.add_argument("--scaling", action="store_true")
    args = ap.parse_args()
    if args.scaling:
        rates = scaling(args.budget)
        print("| workers | examples/s |\n|---|---|")
        for w, r in rates:
            print(f"| {w} | {r:.1f} |")
        print(f"\nratio 2 workers / 1 worker: {rates[1][1] / rates[0][1]:.2f}")
        return 0
    rows = [blind_run(s, args.budget, args.target) for s in range(args.seeds)]
    found = [r for r in rows if r["found"]]
    minimal = [r for r in found if (r["groups"], r["requests"], r["steps"]) == (2, 1, 1)]
    print(f"Blind runs on target {args.target}, {args.seeds} seeds, budget {args.budget:g} s "
          f"each (time excludes release worker start-up).\n")
    print("| seed | finding | time to it (s) | shrunk layout | groups | requests | steps |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["found"]:
            print(f"| {r['seed']} | {r['signature']} | {r['time_s']:.2f} | `{r['layout']}` | "
                  f"{r['groups']} | {r['requests']} | {r['steps']} |")
        else:
            print(f"| {r['seed']} | not found in {r['wall_s']:.0f} s | | | | | |")
    if found:
        print(f"\nmedian time to the first finding of the class: "
              f"{statistics.median(r['time_s'] for r in found):.2f} s; found in {len(found)}/"
              f"{len(rows)} seeds; shrunk to the known minimum (2 groups, 1 request, 1 step) in "
              f"{len(minimal)}/{len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
