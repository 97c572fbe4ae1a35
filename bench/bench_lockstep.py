"""Benchmark: lockstep replay on real vLLM releases.

* replayed real steps per second per worker on the workload of ``bench/bench_model.py``
  (N requests, prompts 208-1191 tokens, 8 shared 256-token prefixes, full16 + sliding16(w128) +
  full16, GPU pool 1,200 blocks), and the model-to-real speed ratio on the same workload in the
  same run (the model with full checks and trace, as lockstep runs it);
* agreement rate over N generated cases per release and layout (``simsched.lockstep``), with
  the first divergences by kind; with ``--families``, over cases of model families whose
  groups each release's own planner builds (``simsched.families``), where a case the release
  refuses at start-up is ``refused`` (not run, neither agreement nor difference).

Run: ``python bench/bench_lockstep.py [--cases N] [--releases 0.30.0,0.33.0] [--layouts L,..]
[--families all|F,..] [--async] [--no-speed] [--sizes 16,64] [--runs 5]``. Prints Markdown.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import workload  # noqa: E402

from simsched.families import FAMILIES, family_case  # noqa: E402
from simsched.lockstep import LAYOUTS, generate_case, lockstep, run_real  # noqa: E402
from simsched.model import run_case  # noqa: E402
from simsched.profiles import profile_for_release  # noqa: E402
from simsched.targets import Releases  # noqa: E402


def speed(pool, versions, sizes=(16, 64), runs: int = 5) -> None:
    """Per release and size, ``runs`` alternating pairs (one real lockstep run, one model run with
    full checks and trace, as lockstep runs it): medians of steps/s and of per-pair ratios."""
    print(f"Medians of {runs} alternating runs per row.\n")
    print("| release | requests | steps | stores | loads | preemptions | real run (s) | "
          "real steps/s | model steps/s | model / real (median of per-run ratios) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    med = statistics.median
    for v in versions:
        prof = profile_for_release(v)
        for n in sizes:
            case = workload(n)
            run_real(case, v, pool, timeout=600)          # warm-up (imports, first build)
            reals, models, ratios, walls = [], [], [], []
            c = None
            for _ in range(runs):
                real = run_real(case, v, pool, timeout=600)
                if real.get("status") != "ok":
                    break
                c = real["counters"]
                t0 = time.perf_counter()
                m = run_case(case, prof)
                tm = time.perf_counter() - t0
                rs, ms = c["steps"] / real["wall"], m.counters["steps"] / tm
                reals.append(rs), models.append(ms), ratios.append(ms / rs)
                walls.append(real["wall"])
            if c is None or len(reals) < runs:
                print(f"| {v} | {n} | {real.get('status')}: {real.get('message', '')} |")
                continue
            print(f"| {v} | {n} | {c['steps']} | {c['stores']} | {c['loads']} | "
                  f"{c['preemptions']} | {med(walls):.2f} | {med(reals):,.0f} | "
                  f"{med(models):,.0f} | {med(ratios):.1f} |")


def agreement(pool, versions, n_cases: int, layouts, async_scheduling: bool = False,
              show_seeds: bool = False, make=None) -> None:
    """``make(seed, name)``: the case of a seed and layout (default :func:`generate_case`)."""
    make = make or (lambda seed, layout: generate_case(seed, layout,
                                                       async_scheduling=async_scheduling))
    print()
    print("| release | layout | cases | agree | divergences by kind (first differing line) |"
          " real findings |")
    print("|---|---|---|---|---|---|")
    for v in versions:
        for layout in layouts:
            kinds: collections.Counter = collections.Counter()
            seeds: dict[str, list[int]] = collections.defaultdict(list)
            finds: collections.Counter = collections.Counter()
            agree = 0
            for seed in range(n_cases):
                r = lockstep(make(seed, layout), v, pool)
                if r.agree:
                    agree += 1
                elif r.divergence is not None:
                    kinds[r.divergence.kind] += 1
                    seeds[r.divergence.kind].append(seed)
                else:
                    kinds[r.real.get("status", "?")] += 1
                    seeds[r.real.get("status", "?")].append(seed)
                for o in r.observations:
                    if o.signature.kind != "divergence":
                        finds[str(o.signature)] += 1
            kd = ", ".join(f"{k} {n}" for k, n in kinds.most_common()) or "-"
            fd = ", ".join(f"{k} {n}" for k, n in finds.most_common()) or "-"
            name = layout + (" (async)" if async_scheduling else "")
            ran = n_cases - kinds["refused"]
            print(f"| {v} | {name} | {n_cases} | {agree} of {ran} run "
                  f"({100 * agree / max(ran, 1):.1f}%) | {kd} | {fd} |", flush=True)
            if show_seeds:
                for k, ss in seeds.items():
                    print(f"<!-- {v} {name} {k}: seeds {' '.join(map(str, ss))} -->", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=30)
    ap.add_argument("--releases", default="0.30.0,0.33.0")
    ap.add_argument("--layouts", default="full16,full16+sw16w128+full16,full16+ring4")
    ap.add_argument("--sizes", default="16,64")
    ap.add_argument("--runs", type=int, default=5, help="alternating real/model runs per row")
    ap.add_argument("--async", dest="async_scheduling", action="store_true",
                    help="generated cases under async scheduling (AsyncScheduler, batch queue "
                         "of depth 2)")
    ap.add_argument("--families", default="",
                    help="model families (simsched.families, 'all'), planned by each release, "
                         "instead of --layouts")
    ap.add_argument("--no-speed", action="store_true", help="agreement only")
    ap.add_argument("--show-seeds", action="store_true",
                    help="after each row, the diverging seeds by kind (as a Markdown comment)")
    args = ap.parse_args()
    versions = args.releases.split(",")
    layouts = [x for x in args.layouts.split(",") if x in LAYOUTS]
    with Releases.installed(versions, timeout=600) as pool:
        if not args.no_speed:
            speed(pool, versions, tuple(int(x) for x in args.sizes.split(",")), args.runs)
        if args.cases > 0 and args.families:
            families = list(FAMILIES) if args.families == "all" else args.families.split(",")
            agreement(pool, versions, args.cases, families, show_seeds=args.show_seeds,
                      make=family_case)
        elif args.cases > 0:
            agreement(pool, versions, args.cases, layouts, args.async_scheduling,
                      args.show_seeds)


if __name__ == "__main__":
    main()
