"""Blind campaign runs: how fast a fresh campaign finds upstream PR #55037's bug class.

    python bench/bench_campaign.py [--seeds 10] [--budget 600] [--target model|0.30.0]
                                   [--steer target|coverage|both|none]
    python bench/bench_campaign.py --scaling [--budget 60]
    python bench/bench_campaign.py --tracing-cost [--target 0.30.0]
    python bench/bench_campaign.py --compare-steer [--seeds 5] [--budget 60]
                                   [--target 0.30.0|lockstep:0.33.0]

For each seed, a fresh output folder and database; the campaign stops at the first finding of the
class (the boot AssertionError in build_offloading_config, the islice ValueError in
update_offload_keys, or the offload_keys/offload_block_ids AssertionError in _build_store_jobs)
and reports the time to it and whether its shrunk case is the known minimum (2 groups,
1 request, 1 step). ``--scaling`` measures examples/s with --workers 1 and 2 in one run.

``--compare-steer`` runs, per seed, one full-budget campaign per steering mode (seed-major, so
that the machine's load drifts alike over the modes) on one release, every one with arc coverage
collected in the release worker (the same tracing cost for every mode); ``lockstep:X.Y.Z`` runs
whole cases on the real Scheduler of X.Y.Z beside the model: the time to the first
finding of the class, the distinct signatures found, and the arcs of vLLM's offloading code
covered at 10 s, 30 s and the end.
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

from fuzz.campaign import DEFAULT_STEER, STEER_CHOICES, Campaign  # noqa: E402
from simsched.targets import Releases  # noqa: E402

CLASS = {"crash:AssertionError:build_offloading_config", "crash:ValueError:update_offload_keys",
         "crash:AssertionError:_build_store_jobs"}


def of_the_class(finding) -> bool:
    """One of the three crashes, whatever layout shows it (a Mamba group outside align mode
    trips the same boot assert as a ring does). ``build_offloading_config`` has other asserts
    (``offload_block_size`` with mixed block sizes; a finding of its own since fingerprints, see
    ``Campaign.fingerprint``): the boot assert is the one whose message names the divisibility,
    in vLLM and in the model alike."""
    if str(finding.signature) not in CLASS:
        return False
    return (finding.signature.function != "build_offloading_config"
            or "not divisible by tokens_per_hash" in (finding.outcome.get("message") or ""))


def at_line(finding: dict) -> str:
    """Where the finding raises: the vLLM file and line (release) or the model's mirror."""
    if finding.get("line"):
        return f"{Path(finding['file'] or '?').name}:{finding['line']}"
    return "model"


def blind_run(seed: int, budget: float, target: str, steer: str = DEFAULT_STEER) -> dict:
    with tempfile.TemporaryDirectory() as out, Releases.installed(
            None if target == "model" else [target],
            coverage=steer in ("coverage", "both")) as pool:
        campaign = Campaign(Path(out), pool, model=target == "model",
                            run_releases=[] if target == "model" else [target], budget=budget,
                            seed_=seed, asserts=True, progress=lambda s: None,
                            stop_when=of_the_class, steer=steer)
        t0 = time.monotonic()
        campaign.run()
        hit = next((f for f in campaign.findings.values() if of_the_class(f)), None)
        if hit is None:
            return {"seed": seed, "found": False, "wall_s": time.monotonic() - t0}
        return {"seed": seed, "found": True, "signature": str(hit.signature),
                "time_s": hit.found_after_s, "layout": hit.case.layout.describe(),
                "groups": len(hit.case.layout.groups), "requests": len(hit.case.requests),
                "steps": hit.to_json()["steps"], "at": at_line(hit.to_json()),
                "startup_s": campaign.warmup_s}


def arcs_at(timeline: list[dict], t: float) -> int:
    return max((e["arcs"] for e in timeline if e["t"] <= t), default=0)


def steer_run(pool: Releases, seed: int, budget: float, target: str, steer: str) -> dict:
    """One full-budget campaign on one release, coverage collected whatever the steering."""
    version = target.removeprefix("lockstep:")
    with tempfile.TemporaryDirectory() as out:
        campaign = Campaign(Path(out), pool, model=False, run_releases=[version], budget=budget,
                            seed_=seed, asserts=True, progress=lambda s: None, steer=steer,
                            steps="every" if target.startswith("lockstep:") else "none")
        data = campaign.run()
    first = min((f.found_after_s for f in campaign.findings.values() if of_the_class(f)),
                default=None)
    return {"seed": seed, "steer": steer, "first_class_s": first,
            "signatures": len({str(f.signature) for f in campaign.findings.values()}),
            "found": sorted(str(f.signature) for f in campaign.findings.values()),
            "examples": data["examples"], "arcs": data.get("vllm_arcs", 0),
            "arcs_10": arcs_at(data.get("arcs_timeline", []), 10.0),
            "arcs_30": arcs_at(data.get("arcs_timeline", []), 30.0)}


def compare_steer(seeds: int, budget: float, target: str, modes: list[str]) -> int:
    rows = []
    with Releases.installed([target.removeprefix("lockstep:")], coverage=True) as pool:
        for seed in range(seeds):
            for mode in modes:
                r = steer_run(pool, seed, budget, target, mode)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"Steering modes on target {target}, {seeds} seeds, budget {budget:g} s each, arc "
          "coverage collected in every mode.\n")
    print("| steer | seed | first of the class (s) | signatures | examples | arcs at 10 s | "
          "arcs at 30 s | arcs at end |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (modes.index(r["steer"]), r["seed"])):
        first = f"{r['first_class_s']:.2f}" if r["first_class_s"] is not None else "-"
        print(f"| {r['steer']} | {r['seed']} | {first} | {r['signatures']} | {r['examples']} | "
              f"{r['arcs_10']} | {r['arcs_30']} | {r['arcs']} |")
    print("\n| steer | median first (s) | median signatures | union of signatures | "
          "median examples | median arcs at 10 s | median arcs at 30 s | median arcs at end |")
    print("|---|---|---|---|---|---|---|---|")
    med = statistics.median
    for mode in modes:
        rs = [r for r in rows if r["steer"] == mode]
        firsts = [r["first_class_s"] for r in rs if r["first_class_s"] is not None]
        union = len({s for r in rs for s in r["found"]})
        print(f"| {mode} | {med(firsts):.2f} ({len(firsts)}/{len(rs)} found) | "
              f"{med(r['signatures'] for r in rs)} | {union} | {med(r['examples'] for r in rs)} | "
              f"{med(r['arcs_10'] for r in rs)} | {med(r['arcs_30'] for r in rs)} | "
              f"{med(r['arcs'] for r in rs)} |" if firsts else f"| {mode} | - | ... |")
    return 0


def tracing_cost(target: str, n: int = 300, repeats: int = 5) -> list[tuple[bool, float]]:
    """Cases per second through a release's config chain in one batch call, with and without
    the coverage tracer (the same generated cases; median of ``repeats`` batches)."""
    from hypothesis import HealthCheck, given, seed, settings

    from fuzz.strategies import cases
    from simsched.targets import config_item
    items: list[dict] = []

    @settings(max_examples=n, database=None, suppress_health_check=list(HealthCheck))
    @seed(1)
    @given(cases())
    def collect(case):
        items.append(config_item(case))

    collect()
    out = []
    for coverage in (False, True):
        with Releases.installed([target], coverage=coverage) as pool:
            worker = pool.worker(target)
            worker.call("config_batch", items=items)      # warm: imports, request cache
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                worker.call("config_batch", items=items)
                times.append(time.perf_counter() - t0)
            out.append((coverage, len(items) / statistics.median(times)))
    return out


def scaling(budget: float) -> list[tuple[int, float, float, float]]:
    """Steady-state generation: a first campaign finds the easy findings, then one and two
    workers each resume from a copy of its output, so that shrinking new findings (which stops
    generation) weighs the same on both sides. Per worker count: examples/s, worker-seconds spent
    shrinking new findings, and examples per worker-second spent generating."""
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
            generating = workers * budget - data.get("shrinking_s", 0.0)
            rates.append((workers, data["examples"] / budget, data.get("shrinking_s", 0.0),
                          data["examples"] / generating))
    return rates


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budget", type=float, default=600.0)
    ap.add_argument("--target", default="model")
    ap.add_argument("--scaling", action="store_true")
    ap.add_argument("--steer", default=DEFAULT_STEER, choices=STEER_CHOICES)
    ap.add_argument("--compare-steer", action="store_true")
    ap.add_argument("--tracing-cost", action="store_true",
                    help="config-chain cases/s of one release with and without coverage tracing")
    ap.add_argument("--modes", default=",".join(STEER_CHOICES),
                    help="steering modes compared by --compare-steer")
    args = ap.parse_args()
    if args.tracing_cost:
        target = "0.30.0" if args.target == "model" else args.target
        rates = tracing_cost(target)
        print(f"| release {target} config chain | cases/s |\n|---|---|")
        for cov, rate in rates:
            print(f"| {'coverage traced' if cov else 'untraced'} | {rate:,.0f} |")
        print(f"\ntraced / untraced: {rates[1][1] / rates[0][1]:.2f}")
        return 0
    if args.compare_steer:
        return compare_steer(args.seeds, args.budget, args.target, args.modes.split(","))
    if args.scaling:
        rates = scaling(args.budget)
        print("| workers | examples/s | worker-seconds shrinking | examples per generating "
              "worker-second |\n|---|---|---|---|")
        for w, r, shrink, gen in rates:
            print(f"| {w} | {r:.1f} | {shrink:.1f} | {gen:.1f} |")
        print(f"\nratio 2 workers / 1 worker: {rates[1][1] / rates[0][1]:.2f} (examples/s), "
              f"{2 * rates[1][3] / rates[0][3]:.2f} (generating throughput, 2 x per worker)")
        return 0
    rows = [blind_run(s, args.budget, args.target, args.steer) for s in range(args.seeds)]
    found = [r for r in rows if r["found"]]
    minimal = [r for r in found if (r["groups"], r["requests"], r["steps"]) == (2, 1, 1)]
    smaller = [r for r in found if r["groups"] < 2 and (r["requests"], r["steps"]) == (1, 1)]
    print(f"Blind runs on target {args.target}, {args.seeds} seeds, budget {args.budget:g} s "
          f"each, steering {args.steer} (time excludes release worker start-up).\n")
    print("| seed | finding | raised at | time to it (s) | shrunk layout | groups | requests "
          "| steps |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["found"]:
            print(f"| {r['seed']} | {r['signature']} | {r['at']} | {r['time_s']:.2f} | "
                  f"`{r['layout']}` | {r['groups']} | {r['requests']} | {r['steps']} |")
        else:
            print(f"| {r['seed']} | not found in {r['wall_s']:.0f} s | | | | | | |")
    if found:
        print(f"\nmedian time to the first finding of the class: "
              f"{statistics.median(r['time_s'] for r in found):.2f} s; found in {len(found)}/"
              f"{len(rows)} seeds; shrunk to the known minimum (2 groups, 1 request, 1 step) in "
              f"{len(minimal)}/{len(rows)}, further (one group) in {len(smaller)}/{len(rows)}")
        lines: dict[str, int] = {}
        for r in found:
            lines[r["at"]] = lines.get(r["at"], 0) + 1
        print("raised at: " + ", ".join(f"{at} in {n}" for at, n in sorted(lines.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
