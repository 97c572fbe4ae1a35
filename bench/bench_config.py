"""Config-level differential: model versus real releases on hypothesis-generated layouts.

    python bench/bench_config.py [--n 10000] [--releases 0.30.0,0.33.0] [--seed 0] [--asserts on]

For each release: layouts/s through one persistent worker (batches of 500, median of the
batches), and every disagreement between the release and the model under the release's profile,
counted by field with one example each. Prints Markdown for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from fuzz.strategies import config_cases  # noqa: E402
from simsched.outcome import describe, diff_config  # noqa: E402
from simsched.targets import ModelTarget, Releases  # noqa: E402


def generate(n: int, seed_: int, asserts: bool | None) -> list:
    cases = []

    @seed(seed_)
    @settings(max_examples=n, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(config_cases(asserts=asserts))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def differential(cases, pool, batch=500):
    rows, examples = [], {}
    for target in pool.targets():
        model = ModelTarget(target.profile)
        target.config_many(cases[:5])     # start the workers before timing
        rates, diffs, unsupported = [], Counter(), 0
        for i in range(0, len(cases), batch):
            chunk = cases[i:i + batch]
            t0 = time.perf_counter()
            real = target.config_many(chunk)
            rates.append(len(chunk) / (time.perf_counter() - t0))
            for case, r in zip(chunk, real):
                unsupported += r.get("status") == "unsupported"
                m = model.config(case)
                for f in diff_config(m, r):
                    diffs[f] += 1
                    examples.setdefault((target.version, f),
                                        (case.layout.describe(), case.asserts, describe(m), describe(r)))
        rows.append((target.version, target.profile.name, len(cases), unsupported,
                     statistics.median(rates), sum(1 for _ in diffs), diffs))
    return rows, examples


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--releases", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--asserts", choices=("on", "off", "both"), default="both")
    args = ap.parse_args()
    asserts = {"on": True, "off": False, "both": None}[args.asserts]
    t0 = time.perf_counter()
    cases = generate(args.n, args.seed, asserts)
    print(f"generated {len(cases)} cases in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    only = args.releases.split(",") if args.releases else None
    with Releases.installed(only, timeout=600) as pool:
        rows, examples = differential(cases, pool)
    print(f"\nConfig-level differential, {len(cases)} hypothesis cases (seed {args.seed}, "
          f"asserts {args.asserts}).\n")
    print("| release | profile | cases | unsupported | layouts/s (median of batches) | "
          "disagreeing cases by field |")
    print("|---|---|---|---|---|---|")
    for version, profile, n, unsup, rate, _, diffs in rows:
        d = ", ".join(f"{f}: {c}" for f, c in sorted(diffs.items())) or "none"
        print(f"| {version} | {profile} | {n} | {unsup} | {rate:,.0f} | {d} |")
    if examples:
        print("\nOne example per disagreement:\n")
        for (version, f), (layout, asserts, m, r) in sorted(examples.items()):
            print(f"- {version} `{f}`: `{layout}` (asserts {'on' if asserts else 'off'})  \n"
                  f"  model: {m}  \n  real: {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
