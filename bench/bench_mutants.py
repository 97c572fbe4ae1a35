"""Mutation benchmark: does the default campaign find bugs it was given no hint of?

For each mutant of :mod:`simsched.vllm.inside.mutants` (a deliberate bug patched into the real
release's offloading code) and each seed, a default campaign (the model as pre-screen, every
release's config chain, real Scheduler steps where the model points and on the share of all
cases) runs against one release whose worker has the mutant patched in for its whole life. The
campaign is not told: it sees a release. The mutant counts as **found** when the campaign
records a ``bug`` finding whose shrunk case, run step by step on the same release *without* the
mutant, does not show that finding: its first bad step is the mutant's effect, not one of the
release's own bugs. The time to it is the campaign's ``found_after_s`` (from the start of
fuzzing; worker start-up excluded).

Run: ``python bench/bench_mutants.py [--release 0.33.0] [--seeds 3] [--budget 300]
[--mutants a,b,...]``; prints one JSON line per run on stderr and the table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fuzz.campaign import Campaign  # noqa: E402
from fuzz.evaluate import REAL_SHARE  # noqa: E402
from simsched.replay import observe  # noqa: E402
from simsched.targets import Releases  # noqa: E402
from simsched.vllm.inside.mutants import MUTANTS  # noqa: E402  (imports no vLLM)


def the_mutants_effect(finding, clean_pool: Releases, release: str) -> bool:
    """A bug finding the unmutated release does not show on the same case."""
    if finding.klass != "bug" or release not in finding.releases_affected:
        return False
    target = next(t for t in clean_pool.targets() if t.version == release)
    obs = observe(finding.case, [], [target], {}, config=False)
    return not any(o.signature == finding.signature for o in obs)


def one_run(mutant: str, seed: int, release: str, budget: float, clean_pool: Releases,
            real_share: float = REAL_SHARE) -> dict:
    with tempfile.TemporaryDirectory() as out, \
            Releases.installed([release], mutant=mutant, timeout=120) as pool:
        hits: list = []

        def stop(finding) -> bool:
            if the_mutants_effect(finding, clean_pool, release):
                hits.append(finding)
                return True
            return False

        campaign = Campaign(Path(out), pool, model=True, run_releases=[release], budget=budget,
                            seed_=seed, asserts=True, progress=lambda s: None, stop_when=stop,
                            real_share=real_share)
        t0 = time.monotonic()
        data = campaign.run()
        row = {"mutant": mutant, "seed": seed, "share": real_share, "found": bool(hits),
               "examples": data["examples"], "wall_s": round(time.monotonic() - t0, 1),
               "real_steps": data["summary"]["real_steps"]}
        if hits:
            f = hits[0]
            row.update(time_s=round(f.found_after_s, 1), signature=str(f.signature),
                       layout=f.case.layout.describe(), step=f.to_json()["first_bad_step"])
        return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", default="0.33.0")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--mutants", default=",".join(MUTANTS))
    ap.add_argument("--real-share", type=float, default=REAL_SHARE)
    args = ap.parse_args(argv)
    names = args.mutants.split(",")
    rows = []
    with Releases.installed([args.release], timeout=120) as clean_pool:
        for name in names:
            for seed in range(args.seeds):
                row = one_run(name, seed, args.release, args.budget, clean_pool,
                              args.real_share)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"Mutants against {args.release}, {args.seeds} seeds x {args.budget:g} s, default "
          f"campaign (no hint of the mutant), real share {args.real_share:g}.\n")
    print("| mutant | found (seeds) | median time to it (s) | what the campaign reported |")
    print("|---|---|---|---|")
    found_mutants = 0
    for name in names:
        rs = [r for r in rows if r["mutant"] == name]
        hit = [r for r in rs if r["found"]]
        found_mutants += bool(hit)
        med = f"{statistics.median(r['time_s'] for r in hit):.1f}" if hit else "-"
        what = ", ".join(sorted({f"{r['signature']} on `{r['layout']}`" for r in hit})) or "-"
        print(f"| {name} | {len(hit)}/{len(rs)} | {med} | {what} |")
    print(f"\n{found_mutants} of {len(names)} mutants found "
          f"({100 * found_mutants / max(1, len(names)):.0f}%); "
          f"{sum(r['found'] for r in rows)} of {len(rows)} runs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
