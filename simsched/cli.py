"""The ``simsched`` command line.

    simsched fuzz [--budget S] [--seed N] [--target T] [--out DIR]   a campaign
    simsched replay CASE.json [--release X | --all-releases | --model [--profile P]]
    simsched repro CASE.json [--out DIR] [--no-shrink]              a repro folder, verified
    simsched run CASE.json [--profile P]                            the model's step trace
    simsched geometry CASE.json [--profile P]                       derived geometry
    simsched profiles                                               behaviour profiles
    simsched releases install [X.Y.Z ...] | list | env X.Y.Z        real vLLM releases
    simsched releases add NAME --base X.Y.Z (--patch F | --tree P)   a patched release
    simsched releases remove NAME
    simsched compare A B [--budget S] [--seed N] [--out DIR]         what a change changes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class UsageError(Exception):
    pass


def _fail(msg: str) -> int:
    print(f"simsched: error: {msg}", file=sys.stderr)
    return 2


def cmd_profiles(args) -> int:
    from simsched.profiles import DEFAULT_PROFILE, PROFILES
    for p in PROFILES.values():
        rel = ", ".join(p.releases) if p.releases else "upstream proposal"
        mark = " (default)" if p.name == DEFAULT_PROFILE else ""
        print(f"{p.name}{mark}\n    stands for: {rel}\n    {p.summary}")
    return 0


def cmd_geometry(args) -> int:
    from simsched.case import load_case
    from simsched.geometry import config_outcome
    from simsched.profiles import DEFAULT_PROFILE
    case = load_case(args.case)
    num = case.requests[0].prompt_len if case.requests else 0
    out = config_outcome(case.layout, num, args.profile or DEFAULT_PROFILE, case.asserts)
    print(json.dumps(out, indent=1))
    return 0 if out["status"] == "ok" else 1


def cmd_replay(args) -> int:
    """Run a case; exit 1 exactly when something shows: on a release, a crash or a broken
    invariant of its real run (step by step, or its config chain with ``--config-only``); on the
    model, any finding. A release where the case could not run says why; a release worker that
    died or hung is a tool error (exit 2 when nothing else showed); if nothing showed and no
    release could run it, exit 3."""
    from simsched.case import load_case
    from simsched.outcome import describe
    from simsched.profiles import PROFILES, get_profile
    from simsched.replay import observe
    from simsched.targets import ModelTarget, Releases
    case = load_case(args.case)
    if args.model:
        names = [args.profile] if args.profile else list(PROFILES)
        models = [ModelTarget(get_profile(n)) for n in names]
        only: list[str] | None = []
    elif args.release:
        models, only = [], args.release
    else:
        models, only = [], None
    traces: dict = {}
    with Releases.installed(only) as pool:
        if only is None and not pool.versions:
            return _fail("no vLLM release installed: run `simsched releases install`")
        outcomes: dict = {}
        releases = pool.targets() if only != [] else []
        obs = observe(case, models, releases, outcomes, config=args.config_only,
                      steps=[] if args.config_only else None, traces=traces)
    # a release's difference from the model is the model's to explain, not the release's fault;
    # a release worker that died or hung is simsched's failure, never a finding about vLLM
    tool = [o for o in obs if o.signature.function == "release_worker"]
    shown = [o for o in obs if (o.signature.kind != "divergence" or o.level == "model")
             and o not in tool]
    print(f"case: {case.layout.describe()}  (asserts {'on' if case.asserts else 'off'}; "
          f"{'config chain only' if args.config_only else 'every step on the real Scheduler'})")
    for name, outcome in outcomes.items():
        sigs = sorted({str(o.signature) for o in shown if o.target == name})
        broke = sorted({o.signature.exception for o in tool if o.target == name})
        ran = name.startswith("model:") or outcome.get("status") in ("ran", "ok", "error")
        verdict = ("FAIL " + ", ".join(sigs) if sigs else
                   "tool error (simsched's worker, not vLLM): " + ", ".join(broke) if broke else
                   "pass" if ran else "not run")
        print(f"  {name:>38}: {verdict}  | {describe(outcome)}")
    for name, res in traces.items():
        bad = _first_bad_step(res)
        if bad:
            print(f"\n{name}: the first bad step, with the steps before it (real trace):")
            print("\n".join(f"    {x}" for x in bad))
    by_sig: dict[str, list[str]] = {}
    for o in shown:
        by_sig.setdefault(str(o.signature), []).append(o.target)
    for sig, where in sorted(by_sig.items()):
        present = sorted(set(where))
        absent = [n for n in outcomes if n not in present]
        print(f"{sig}: present in {', '.join(present)}; absent from {', '.join(absent) or '-'}")
    if shown:
        return 1
    if tool:
        return 2
    ran = [o for name, o in outcomes.items()
           if name.startswith("model:") or o.get("status") in ("ran", "ok", "error")]
    return 0 if ran or not outcomes else 3


def _first_bad_step(res, before: int = 3) -> list[str]:
    """The real trace from ``before`` steps ahead of the first crash or violation to it."""
    trace = res.real.get("trace") or []
    bad = next((i for i, x in enumerate(trace) if x.startswith(("crash ", "violation "))), None)
    if bad is None:
        return []
    starts = [i for i in range(bad + 1) if trace[i].startswith("step ")]
    first = starts[-before - 1] if len(starts) > before else (starts[0] if starts else 0)
    return trace[first:bad + 1]


def cmd_run(args) -> int:
    from simsched.model import cli_run
    return cli_run(args.case, args.profile)


def cmd_fuzz(args) -> int:
    from fuzz.evaluate import CampaignError
    from fuzz.database import DatabaseError
    from fuzz.runner import FuzzOptions, fuzz
    opts = FuzzOptions(out=args.out, budget=args.budget, seed=args.seed, target=args.target,
                       asserts=args.asserts, releases=args.releases, timeout=args.timeout,
                       workers=args.workers, db=args.db,
                       steer="none" if args.no_steer else args.steer,
                       real_share=args.real_share, verify_repros=args.verify_repros)
    try:
        data = fuzz(opts)
    except (CampaignError, DatabaseError) as e:
        return _fail(str(e))
    summ = data.get("summary", {})
    per_class = ", ".join(f"{n} {k}" for k, n in summ.get("clusters", {}).items()) or "none"
    print(f"{summ.get('clusters_total', 0)} clusters ({per_class}) from "
          f"{len(data['findings'])} findings in {args.out}/report.md "
          f"({data['examples']} examples, {data['examples_per_s']}/s, "
          f"{summ.get('real_steps', 0):,} real steps)"
          + ("; interrupted: run the same command to resume" if data.get("interrupted") else ""))
    for f in data["findings"]:
        print(f"  [{f.get('class', '?')}] {f['id']}: {f['layout']} | present in "
              f"{', '.join(f['releases_affected']) or '-'} | profiles "
              f"{', '.join(f['profiles_affected']) or '-'}")
    errors = data.get("tool_errors") or []
    for e in errors:
        print(f"  tool error (simsched, not vLLM): {e['exception']} in {e['function']} on "
              f"{e['target']}, case {args.out}/{e['case']}", file=sys.stderr)
    if data.get("interrupted"):
        return 130
    return 1 if errors else 0


def cmd_compare(args) -> int:
    """Run the same cases on two targets; exit 1 when A introduces a bug B does not show (or
    simsched itself failed: a tool error), else 0."""
    from fuzz.compare import WHATS, CompareError, compare
    try:
        data = compare(args.a, args.b, budget=args.budget, seed_=args.seed, out=args.out,
                       asserts={"on": True, "off": False, "both": None}[args.asserts],
                       timeout=args.timeout, max_cases=args.cases,
                       progress=lambda s: print(s, file=sys.stderr, flush=True))
    except CompareError as e:
        return _fail(str(e))
    print(f"{args.a} against {args.b}: "
          + ", ".join(f"{len(data[w])} {w}" for w in WHATS)
          + f" ({data['examples']} cases) in {args.out}/compare.md")
    for what in WHATS:
        for e in data[what]:
            print(f"  [{what}] {' '.join(map(str, e['key']))}: {e['layout']} ({e['case']})")
    for t in data["tool_errors"]:
        print(f"  tool error (simsched, not vLLM) on {t['target']}: {t['signature']}",
              file=sys.stderr)
    return 1 if data["introduced"] or data["tool_errors"] else 0


def cmd_repro(args) -> int:
    """Write the repro folder of the first bug a case shows (shrunk unless --no-shrink), its
    vLLM-only test verified on the releases; exit 1 when that test is unverified or none could
    be written."""
    import json as json_
    from fuzz.repro import repro_case
    from simsched.case import load_case
    case = load_case(args.case)
    only = [v.strip() for v in args.releases.split(",") if v.strip()] if args.releases else None
    folder = repro_case(case, Path(args.out) if args.out else None, shrink=not args.no_shrink,
                        releases=only, timeout=args.timeout,
                        progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"wrote {folder}/: {', '.join(sorted(p.name for p in folder.iterdir()))}")
    verdict = folder / "vllm_repro.json"
    if not verdict.exists():
        print("no vLLM-only test (see README.md)")
        return 1
    v = json_.loads(verdict.read_text())
    print(("verified" if v["verified"] else f"unverified: {v['reason']}") + ": "
          + ", ".join(f"{k} {r}" for k, r in v["results"].items()))
    return 0 if v["verified"] else 1


def cmd_releases(args) -> int:
    from simsched.vllm import release_cli
    if args.action == "install":
        return release_cli.cli_install(args.versions)
    if args.action == "env":
        return release_cli.cli_env(args.version)
    if args.action == "add":
        return release_cli.cli_add(args.name, args.base, args.patch, args.tree)
    if args.action == "remove":
        return release_cli.cli_remove(args.name)
    return release_cli.cli_list()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simsched", description="Simulate and fuzz vLLM's native KV "
                                "offloading scheduler, checked against real vLLM releases.")
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fuzz", help="run a time-boxed fuzz campaign")
    f.add_argument("--budget", type=float, default=120.0, help="seconds (default 120)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--target", default="all",
                   help="all (default: the model, every release's config chain, and real "
                   "Scheduler steps where the model points and on a share of all cases), config "
                   "(the model and the config chains only), lockstep (every case step by step "
                   "on every release, diffed with the model), releases (every case step by step, "
                   "no model), a release such as 0.30.0, or model")
    f.add_argument("--out", default="simsched-out", help="output folder (default simsched-out/)")
    f.add_argument("--asserts", choices=("on", "off", "both"), default="both",
                   help="run vLLM with asserts on, stripped (python -O), or both (default)")
    f.add_argument("--releases", help="comma-separated installed releases to use "
                   "(default: every installed release)")
    f.add_argument("--timeout", type=float, default=60.0, help="per-call worker time limit (s)")
    f.add_argument("--workers", type=int, default=1, help="fuzzing processes sharing one corpus")
    f.add_argument("--db", help="example database: a directory (default OUT/hypothesis-db) or "
                   "a redis://host:port/db URL shared by campaigns on several machines")
    f.add_argument("--steer", choices=("target", "coverage", "both", "none"), default="target",
                   help="steer generation toward the edges: target (hypothesis.target on edge "
                   "scores of the case, default), coverage (arcs of vLLM's offloading code "
                   "covered inside the release workers), both, or none")
    f.add_argument("--no-steer", action="store_true", help="same as --steer none")
    f.add_argument("--real-share", type=float, default=None,
                   help="share of cases run step by step on the newest release whatever the "
                   "model says (default 0.25; with --target all)")
    f.add_argument("--verify-repros", action="store_true",
                   help="run each bug's vLLM-only test (repros/<id>/test_vllm_*.py) on every "
                   "installed release when it is written (about 20 s a release); without it the "
                   "test is written unverified (`simsched repro` verifies one)")
    f.set_defaults(fn=cmd_fuzz)

    r = sub.add_parser("replay", help="run one case step by step on real releases; exit 1 when "
                       "it shows a finding")
    r.add_argument("case")
    r.add_argument("--config-only", action="store_true",
                   help="run only the releases' config chain (boot, first offload keys)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--release", action="append", help="a release (repeatable)")
    g.add_argument("--all-releases", action="store_true", help="every installed release (default)")
    g.add_argument("--model", action="store_true", help="the model (every profile, or --profile)")
    r.add_argument("--profile")
    r.set_defaults(fn=cmd_replay)

    c = sub.add_parser("compare", help="run the same generated cases on two targets (a patched "
                       "release and its base, two releases, a profile of the model) and report "
                       "what A fixes, introduces and changes; exit 1 when A introduces a bug")
    c.add_argument("a", help="a release, a derived target (releases add) or model:PROFILE")
    c.add_argument("b", help="the same kinds: typically A's base release")
    c.add_argument("--budget", type=float, default=120.0, help="seconds (default 120)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default="compare-out", help="output folder (default compare-out/)")
    c.add_argument("--asserts", choices=("on", "off", "both"), default="on",
                   help="run vLLM with asserts on (default), stripped (python -O), or both")
    c.add_argument("--timeout", type=float, default=60.0, help="per-call worker time limit (s)")
    c.add_argument("--cases", type=int, help="stop after this many cases (the budget still "
                   "applies): the same seed and count give the same cases")
    c.set_defaults(fn=cmd_compare)

    rp = sub.add_parser("repro", help="write the repro folder of the bug a case shows (the "
                        "case shrunk, a simsched test and a vLLM-only test verified on each "
                        "installed release)")
    rp.add_argument("case")
    rp.add_argument("--out", help="the folder to write (default repros/<id>/)")
    rp.add_argument("--no-shrink", action="store_true", help="keep the case as it is")
    rp.add_argument("--releases", help="comma-separated installed releases (default: all)")
    rp.add_argument("--timeout", type=float, default=120.0, help="per-call worker time limit (s)")
    rp.set_defaults(fn=cmd_repro)

    rn = sub.add_parser("run", help="run a case on the model and print its step trace")
    rn.add_argument("case")
    rn.add_argument("--profile")
    rn.set_defaults(fn=cmd_run)

    ge = sub.add_parser("geometry", help="print the derived geometry of a case or layout file")
    ge.add_argument("case")
    ge.add_argument("--profile")
    ge.set_defaults(fn=cmd_geometry)

    sub.add_parser("profiles", help="list the behaviour profiles").set_defaults(fn=cmd_profiles)

    rel = sub.add_parser("releases", help="install or list real vLLM releases")
    rel_sub = rel.add_subparsers(dest="action", required=True)
    ri = rel_sub.add_parser("install", help="install releases (default: 0.25.1 to 0.33.0)")
    ri.add_argument("versions", nargs="*")
    rel_sub.add_parser("list", help="list installed releases")
    re_ = rel_sub.add_parser("env", help="print a command prefix that runs plain vLLM code of an "
                             "installed release (simsched not importable, pytest there): "
                             "$(simsched releases env 0.33.0) -m pytest FILE")
    re_.add_argument("version")
    ra = rel_sub.add_parser("add", help="add a derived target: an installed release with a "
                            "patch applied (git diff of a vLLM checkout) or a checkout's "
                            "vllm/ .py files over it; then usable as a release by NAME")
    ra.add_argument("name")
    ra.add_argument("--base", required=True, help="the installed release it is built on")
    src = ra.add_mutually_exclusive_group(required=True)
    src.add_argument("--patch", help="a unified diff with paths a/vllm/...")
    src.add_argument("--tree", help="a vLLM source checkout (the folder holding vllm/); "
                     "re-read when it changed, at the start of each campaign")
    rr = rel_sub.add_parser("remove", help="remove a derived target")
    rr.add_argument("name")
    rel.set_defaults(fn=cmd_releases)
    return p


def main(argv: list[str] | None = None) -> int:
    from simsched.layout import LayoutError
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except LayoutError as e:
        return _fail(str(e))
    except KeyError as e:   # unknown profile and the like
        return _fail(str(e.args[0]) if e.args else str(e))
    except Exception as e:
        if type(e).__name__ in ("ReleaseError", "CampaignError"):
            return _fail(str(e))
        raise


if __name__ == "__main__":
    sys.exit(main())
