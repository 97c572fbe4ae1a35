"""Differential check of two trees of the model: same traces, findings and counters, case by case.

For optimisations of the model that must not change what it does (the golden corpus of
``tests/test_model_equivalence.py`` pins about 240 cases; this runs thousands more)::

    python bench/model_equivalence.py gen CASES.jsonl [--lockstep-seeds 200] [--hypothesis 1500]
    python bench/model_equivalence.py digest CASES.jsonl > A.txt    # in (PYTHONPATH of) tree A
    python bench/model_equivalence.py digest CASES.jsonl > B.txt    # in tree B
    diff A.txt B.txt

``gen`` writes generated cases (the lockstep generator over every layout of
``simsched.lockstep.LAYOUTS``, synchronous and async, and derandomized hypothesis draws of
``fuzz.strategies.cases``) with a profile each, cycling through every profile, and the speed
benchmark's workload of 16 and 64 requests under every profile; ``digest`` runs
each case with ``checks="full", trace=True``, ``checks="fast", trace=True`` and ``checks="fast",
trace=False`` and prints one SHA-256 per case of the traces, findings and counters. Run
``digest`` with ``PYTHONPATH`` set to the tree under test (``SIMSCHED_PURE=1`` for its sources).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

# after PYTHONPATH: ``digest`` runs the tree PYTHONPATH names, whichever tree this file is in
sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))


def gen(path: str, lockstep_seeds: int, n_hypothesis: int) -> None:
    from hypothesis import HealthCheck, given, settings

    from fuzz.strategies import cases
    from simsched.lockstep import LAYOUTS, generate_case
    from simsched.profiles import PROFILES

    profiles = list(PROFILES)
    out = []
    for layout in LAYOUTS:
        for seed in range(lockstep_seeds):
            for asy in (False, True):
                case = generate_case(seed, layout, async_scheduling=asy)
                out.append((f"lockstep-{layout}-{seed}{'-async' if asy else ''}",
                            case.to_json()))
    drawn: list = []

    @settings(max_examples=n_hypothesis, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases(asserts=None))
    def draw(case):
        drawn.append(case.to_json())

    draw()
    out += [(f"hypothesis-{i}", c) for i, c in enumerate(drawn)]
    items = [{"name": name, "profile": profiles[i % len(profiles)], "case": case}
             for i, (name, case) in enumerate(out)]
    # the speed benchmark's workload (bench_model.workload) under every profile
    from bench_model import workload
    for n in (16, 64):
        items += [{"name": f"bench-{n}", "profile": p, "case": workload(n).to_json()}
                  for p in profiles]
    with open(path, "w") as f:
        for item in items:
            f.write(json.dumps(item, sort_keys=True) + "\n")
    print(f"{len(items)} cases written to {path}", file=sys.stderr)


def digest(path: str) -> None:
    from simsched import compiled
    from simsched.case import Case
    from simsched.model import run_case

    import simsched
    print(f"# {Path(simsched.__file__).parent} {'compiled' if compiled() else 'source'}",
          file=sys.stderr)
    for line in open(path):
        item = json.loads(line)
        case = Case.from_json(item["case"])
        h = hashlib.sha256()
        for checks, trace in (("full", True), ("fast", True), ("fast", False)):
            r = run_case(case, item["profile"], checks=checks, trace=trace)
            h.update(r.trace_text().encode())
            h.update(json.dumps([r.findings, r.counters], sort_keys=True).encode())
        print(item["name"], item["profile"], h.hexdigest()[:16])


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "gen":
        seeds = int(argv[argv.index("--lockstep-seeds") + 1]) if "--lockstep-seeds" in argv \
            else 200
        hyp = int(argv[argv.index("--hypothesis") + 1]) if "--hypothesis" in argv else 1500
        gen(argv[1], seeds, hyp)
    elif len(argv) == 2 and argv[0] == "digest":
        digest(argv[1])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
