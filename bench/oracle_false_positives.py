"""False-positive measurement of the real-run oracles: generated cases on unmutated releases.

    PYTHONPATH=. python bench/oracle_false_positives.py [--seeds N] [--caps] 0.30.0 0.33.0

Seeds 0..N-1 spread over ``lockstep.LAYOUTS`` (seed ``s`` on layout ``s % len(LAYOUTS)``),
``lockstep.generate_case`` as it is; ``--caps`` also gives each request a cap drawn from a
stream of its own (``max_offload_tokens`` / ``max_load_tokens`` from 0, 16, 32, 48, 64, 100 or
none), so that INV-10 has something to check. Prints every real-run finding (a finding on an
unmutated release is either a real vLLM bug or a false positive of the oracle: each is to be
confirmed with vLLM alone) and a count per invariant.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

from simsched.case import Case
from simsched.lockstep import LAYOUTS, generate_case, run_real
from simsched.targets import Releases

CAPS = (0, 16, 32, 48, 64, 100, None, None, None)


def with_caps(case: Case, seed: int) -> Case:
    rng = random.Random(f"caps-{seed}")
    obj = case.to_json()
    for r in obj["requests"]:
        for name in ("max_offload_tokens", "max_load_tokens"):
            cap = rng.choice(CAPS)
            if cap is not None:
                r[name] = cap
    return Case.from_json(obj)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("versions", nargs="+")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--caps", action="store_true")
    args = ap.parse_args()
    layouts = list(LAYOUTS)
    counts: Counter = Counter()
    with Releases.installed(args.versions, timeout=120) as pool:
        for v in args.versions:
            for seed in range(args.seeds):
                layout = layouts[seed % len(layouts)]
                case = generate_case(seed, layout)
                if args.caps:
                    case = with_caps(case, seed)
                res = run_real(case, v, pool)
                status = res.get("status")
                counts[(v, "cases", status)] += 1
                for f in res.get("findings", []):
                    key = f.get("inv_id") or f"{f.get('kind')}:{f.get('exception')}"
                    counts[(v, "finding", key)] += 1
                    print(f"{v} seed {seed} {layout}: {key} {f.get('detail', '')}"[:300],
                          flush=True)
    for k, n in sorted(counts.items(), key=str):
        print(*k, n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
