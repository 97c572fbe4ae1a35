"""Benchmark: the model against real releases, step for step, on another connector path.

The first N distinct cases the campaign's strategy draws on a path (``fuzz.strategies.cases(
path=...)``, derandomized: the same cases every run), each run in lockstep (``simsched.lockstep``)
on every release given. Per release: cases that agree step for step, that diverge (by the kind
of the first differing line), that the model does not cover (``unmodelled_path``), and that the
release did not run step by step (refused or unsupported at start-up, or a boot crash both
sides agree on). The divergent cases are written to ``--out`` for reading.

``--where`` keeps only the drawn cases of one kind (of up to 40 N examples): ``async-spec``
(speculative decoding under async scheduling), ``dcp`` (``dcp_size`` > 1), ``mamba`` (a Mamba
group).

Run: ``python bench/bench_lockstep_paths.py [--path multi] [--cases 100]
[--releases 0.30.0,0.33.0] [--where async-spec] [--out DIR]``. Prints Markdown.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from fuzz.strategies import FAMILIES, PATHS, cases  # noqa: E402
from simsched.lockstep import lockstep, stepped  # noqa: E402
from simsched.model import unmodelled_path  # noqa: E402
from simsched.profiles import profile_for_release  # noqa: E402
from simsched.targets import Releases  # noqa: E402


#: the kinds of case ``--where`` keeps
WHERE = {
    "async-spec": lambda c: (c.layout.engine.async_scheduling
                             and c.layout.engine.speculative is not None),
    "dcp": lambda c: c.layout.engine.dcp_size > 1,
    "mamba": lambda c: any(g.kind == "mamba" for g in c.layout.groups),
}


def drawn_cases(n: int, path: str, where: str | None = None) -> list:
    """The first ``n`` distinct cases of ``4 n`` the strategy draws on ``path`` (``where``: the
    first ``n`` of that kind, of ``40 n``)."""
    if where:
        return _drawn_where(n, path, WHERE[where])
    drawn: dict[str, object] = {}

    @settings(max_examples=4 * n, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases(families=FAMILIES, path=path))
    def draw(case):
        drawn.setdefault(repr(case.to_json()), case)
    draw()
    return list(drawn.values())[:n]


def _drawn_where(n: int, path: str, keep) -> list:
    # (a function of its own: derandomize seeds the draw from the test function, and the plain
    # draw above stays the one the figures in BENCHMARKS.md were measured on)
    drawn: dict[str, object] = {}

    @settings(max_examples=40 * n, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases(families=FAMILIES, path=path))
    def draw(case):
        if keep(case):
            drawn.setdefault(repr(case.to_json()), case)
    draw()
    return list(drawn.values())[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", default="multi", choices=PATHS)
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--releases", default="0.30.0,0.33.0")
    ap.add_argument("--where", default=None, choices=sorted(WHERE))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    versions = args.releases.split(",")
    drawn = drawn_cases(args.cases, args.path, args.where)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    kind = f" ({args.where})" if args.where else ""
    print(f"{len(drawn)} cases{kind} drawn on the {args.path} path.\n")
    print("| release | agree | diverge (first line) | not modelled | not stepped | seconds |")
    print("|---|---|---|---|---|---|")
    with Releases.installed(versions, timeout=120) as pool:
        for v in versions:
            agree, unmodelled, not_stepped = 0, 0, 0
            diverged: collections.Counter = collections.Counter()
            t0 = time.perf_counter()
            profile = profile_for_release(pool.release_of(v))
            for k, case in enumerate(drawn):
                if unmodelled_path(case.layout, profile) is not None:
                    unmodelled += 1
                    continue
                res = lockstep(case, v, pool)
                if res.divergence is not None:
                    diverged[res.divergence.kind] += 1
                    if out:
                        (out / f"{args.path}-{v}-{k}.json").write_text(
                            json.dumps(case.to_json()))
                elif stepped(res.real) and res.model is not None:
                    agree += 1
                else:
                    not_stepped += 1
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(diverged.items())) or "0"
            print(f"| {v} | {agree} | {kinds} | {unmodelled} | {not_stepped} | "
                  f"{time.perf_counter() - t0:.0f} |")


if __name__ == "__main__":
    main()
