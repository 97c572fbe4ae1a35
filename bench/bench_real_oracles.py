"""False positives of the real-run lookup oracles (INV-9 and deferrals, docs/invariants.md).

Runs cases on real releases (release side only) and counts the lookups checked, those whose
ready chunks gave a hit, those deferred, and every finding whose op is ``lookup``:

* ``generated``: ``simsched.lockstep.generate_case`` over every layout of ``LAYOUTS``, ``--seeds``
  seeds, and ``--async-seeds`` more under async scheduling;
* ``heavy``: the same seeds' workloads with 8 requests, shared prefixes of 48-160 tokens, GPU
  pools of 20-32 blocks per group, CPU tiers of 8-256 chunks and (unless ``--no-max-load``) 30%
  of the requests with a ``max_load_tokens``: many more CPU hits.

Run: ``python bench/bench_real_oracles.py [--releases 0.30.0,0.33.0] [--kind heavy]
[--seeds 20] [--async-seeds 0] [--no-max-load]``.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simsched.case import Case  # noqa: E402
from simsched.lockstep import LAYOUTS, generate_case, run_real  # noqa: E402
from simsched.targets import Releases  # noqa: E402


def heavy_case(seed: int, layout: str, async_scheduling: bool, max_load: bool) -> Case:
    obj = generate_case(seed, layout, n_requests=8, async_scheduling=async_scheduling).to_json()
    rng = random.Random(seed * 7 + 1)
    per_token_blocks = len([g for g in LAYOUTS[layout] if g["kind"] != "ring"])
    for r in obj["requests"]:
        r["prompt"][0][1] = rng.choice([48, 64, 96, 128, 160])
        if rng.random() < 0.3 and max_load:
            r["max_load_tokens"] = rng.choice([16, 32, 48, 100])
    obj["layout"]["engine"]["num_gpu_blocks"] = rng.choice([20, 24, 32]) * per_token_blocks
    obj["layout"]["engine"]["cpu_chunks"] = rng.choice([8, 16, 64, 256])
    return Case.from_json(obj)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--releases", default="0.30.0,0.33.0")
    ap.add_argument("--kind", choices=("generated", "heavy"), default="heavy")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--async-seeds", type=int, default=0)
    ap.add_argument("--no-max-load", action="store_true")
    a = ap.parse_args()
    versions = a.releases.split(",")
    runs = [(s, False) for s in range(a.seeds)] + [(s, True) for s in range(a.async_seeds)]
    with Releases.installed(versions, timeout=120) as pool:
        for v in versions:
            counts: collections.Counter = collections.Counter()
            found = []
            for layout in LAYOUTS:
                for seed, asy in runs:
                    case = (heavy_case(seed, layout, asy, not a.no_max_load)
                            if a.kind == "heavy" else
                            generate_case(seed, layout, async_scheduling=asy))
                    res = run_real(case, v, pool)
                    counts["cases"] += 1
                    counts.update(res.get("lookups") or {})
                    found += [(layout, seed, asy, f["inv_id"], f["detail"])
                              for f in res.get("findings", []) if f.get("op") == "lookup"]
            print(f"{v}: {dict(counts)}; lookup findings: {len(found)}")
            for x in found:
                print("   ", *x)


if __name__ == "__main__":
    main()
