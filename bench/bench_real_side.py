"""The real side of the main campaign: what the harness costs against the bare Scheduler.

1. A default campaign (``--budget`` seconds, ``--seed``) on ``--releases`` records every case it
   runs step by step on a release, with the seconds the campaign spent on it (the real run with
   its content shadow, invariants and trace, plus the model's trace it is diffed with).
2. The same cases, on the same workers, run again ``--runs`` times each way, alternating:
   the harness alone (``run_case``: shadow, invariants, trace; no model) and the bare Scheduler
   (``run_case`` with ``bare``: the Scheduler, the connector and the smallest worker side that
   keeps it going, no trace, no shadow, no check). Both include building the Scheduler, as the
   campaign's runs do.

Prints real steps per second: in the campaign, harness alone, bare; and the ratios.

Run: ``python bench/bench_real_side.py [--releases 0.33.0] [--budget 120] [--seed 1] [--runs 3]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fuzz.campaign import Campaign  # noqa: E402
from simsched.targets import Releases  # noqa: E402
from simsched.vllm.worker import HarnessError  # noqa: E402


class Recording(Campaign):
    """A default campaign that keeps the cases it runs step by step."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.stepped: list = []     # (case, version, steps, seconds in the campaign)

    def evaluate(self, case, sampled=False):
        before = {v: (st["real_steps"], st["step_seconds"]) for v, st in self.per_release.items()}
        seen = super().evaluate(case, sampled)
        for v in self._stepped_last:
            st = self.per_release[v]
            steps0, secs0 = before.get(v, (0, 0.0))
            if st["real_steps"] > steps0:
                self.stepped.append((case, v, st["real_steps"] - steps0,
                                     st["step_seconds"] - secs0))
        return seen


def timed(pool: Releases, case, version: str, bare: bool) -> tuple[int, float, float, float]:
    """Steps, the whole call's seconds (boot included) and the Scheduler loop's, wall and CPU
    of the worker process (boot and, for the bare run, its start-up heap collection excluded;
    CPU seconds do not count the time other processes of a loaded machine take)."""
    worker = pool.worker(version, case.asserts)
    t0 = time.perf_counter()
    out = worker.call("run_case", timeout=300, case=case.to_json(), bare=bare)
    wall = time.perf_counter() - t0
    return (out.get("counters", {}).get("steps", 0), wall, out.get("loop_wall") or 0.0,
            out.get("loop_cpu") or 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--releases", default="0.33.0")
    ap.add_argument("--budget", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    versions = args.releases.split(",")
    with Releases.installed(versions, timeout=300) as pool, tempfile.TemporaryDirectory() as out:
        c = Recording(Path(out), pool, model=True, run_releases=versions, budget=args.budget,
                      seed_=args.seed, asserts=True, progress=lambda s: None)
        data = c.run()
        steps = sum(s for _, _, s, _ in c.stepped)
        secs = sum(t for _, _, _, t in c.stepped)
        harness, bare, h_loop, b_loop, h_cpu, b_cpu = [], [], [], [], [], []
        for _ in range(args.runs):
            h = [0.0, 0.0, 0.0, 0.0]
            b = [0.0, 0.0, 0.0, 0.0]
            for case, v, _, _ in c.stepped:
                try:   # a case vLLM itself raises on (a bug finding) has no bare loop to time
                    pair = [timed(pool, case, v, bare=is_bare) for is_bare in (False, True)]
                except HarnessError:
                    continue
                for acc, run in zip((h, b), pair):
                    for i, x in enumerate(run):
                        acc[i] += x
            harness.append(h[0] / h[1])
            bare.append(b[0] / b[1])
            h_loop.append(h[0] / h[2])
            b_loop.append(b[0] / b[2])
            h_cpu.append(h[0] / h[3])
            b_cpu.append(b[0] / b[3])
    med = statistics.median
    in_campaign = steps / secs if secs else 0.0
    print(f"Default campaign, {args.budget:g} s, seed {args.seed}, releases {args.releases}: "
          f"{data['examples']} examples ({data['examples_per_s']}/s), {len(c.stepped)} cases "
          f"run step by step, {int(steps):,} real steps.\n")
    print("| measure | real steps/s, whole calls | of bare | real steps/s, the loop | of bare "
          "| per CPU second, the loop | of bare |")
    print("|---|---|---|---|---|---|---|")
    print(f"| in the campaign (real run + model trace + diff) | {in_campaign:,.0f} | "
          f"{in_campaign / med(bare):.0%} | | | | |")
    print(f"| the harness alone (shadow, invariants, trace), median of {args.runs} | "
          f"{med(harness):,.0f} | {med(harness) / med(bare):.0%} | {med(h_loop):,.0f} | "
          f"{med(h_loop) / med(b_loop):.0%} | {med(h_cpu):,.0f} | "
          f"{med(h_cpu) / med(b_cpu):.0%} |")
    print(f"| the bare Scheduler, median of {args.runs} | {med(bare):,.0f} | 100% | "
          f"{med(b_loop):,.0f} | 100% | {med(b_cpu):,.0f} | 100% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
