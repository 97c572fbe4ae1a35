"""``simsched fuzz``: one campaign, or several worker processes sharing one corpus.

With ``--workers N`` each worker process runs its own :class:`~fuzz.campaign.Campaign` (its own
seed stream and its own release workers) against the shared example database and the shared
output folder: findings are files (``repros/<id>/``), written atomically as they are found, and
every process re-reads them before it looks for the next one, so no two processes record the same
finding twice. The parent merges the workers' figures into ``report.json`` at the end. A run with
one worker and a given ``--seed`` is deterministic; with several, which worker finds what first
depends on timing.

Ctrl-C (SIGINT) or SIGTERM at any moment loses no finding: each is on disk before it is
reported, the report is rewritten on the way out, and the same command resumes.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FuzzOptions:
    out: str = "simsched-out"
    budget: float = 120.0
    seed: int = 0
    target: str = "all"
    asserts: str = "both"
    releases: str | None = None
    timeout: float = 60.0
    workers: int = 1
    db: str | None = None
    steer: str = "target"     # see fuzz.campaign.STEER_CHOICES
    real_share: float | None = None   # see fuzz.evaluate.REAL_SHARE
    verify_repros: bool = False   # run each bug's vLLM-only test on every release (minutes)


def _sigterm_as_interrupt(*_):
    raise KeyboardInterrupt


def run_campaign(opts: FuzzOptions, index: int | None = None) -> dict:
    """One campaign; ``index`` set when it runs as worker process number ``index``."""
    from fuzz.campaign import Campaign, parse_target
    from fuzz.database import open_database
    from simsched.targets import Releases

    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    only = opts.releases.split(",") if opts.releases else None
    with Releases.installed(only, timeout=opts.timeout,
                            coverage=opts.steer in ("coverage", "both")) as pool:
        model, rels, steps = parse_target(opts.target, list(pool.versions))
        prefix = "" if index is None else f"[w{index}] "
        campaign = Campaign(
            Path(opts.out), pool, model=model, run_releases=rels, budget=opts.budget,
            seed_=opts.seed if index is None else opts.seed * 1009 + index,
            asserts={"on": True, "off": False, "both": None}[opts.asserts],
            steps=steps, steer=opts.steer,
            **({} if opts.real_share is None else {"real_share": opts.real_share}),
            database=open_database(opts.db, Path(opts.out)),
            stats_name="report" if index is None else f"w{index}",
            verify_repros=opts.verify_repros,
            progress=lambda s: print(prefix + s, file=sys.stderr, flush=True))
        return campaign.run()


def _child(opts: FuzzOptions, index: int) -> None:
    try:
        run_campaign(opts, index)
    except KeyboardInterrupt:
        pass


def fuzz(opts: FuzzOptions) -> dict:
    """Run ``simsched fuzz``; returns the report."""
    from fuzz.campaign import STEER_CHOICES, parse_target
    from fuzz.evaluate import CampaignError
    from fuzz.finding import load_findings
    from fuzz.database import open_database
    from fuzz.report import merge
    from simsched.targets import Releases

    if opts.workers < 1:
        raise CampaignError(f"--workers {opts.workers}: at least 1")
    only = opts.releases.split(",") if opts.releases else None
    if opts.steer not in STEER_CHOICES:
        raise CampaignError(f"--steer {opts.steer!r}: expected one of {', '.join(STEER_CHOICES)}")
    with Releases.installed(only) as pool:      # check targets and the database up front
        _, rels, _ = parse_target(opts.target, list(pool.versions))
        versions = list(pool.versions)
    if opts.steer in ("coverage", "both") and not rels:
        raise CampaignError(f"--steer {opts.steer}: coverage steering measures vLLM's code inside "
                            f"the release workers; --target {opts.target} runs no release")
    open_database(opts.db, Path(opts.out))
    if opts.workers == 1:
        return run_campaign(opts)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    for old in (Path(opts.out) / "workers").glob("w*.json"):
        old.unlink()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(opts, i), name=f"simsched-fuzz-w{i}")
             for i in range(opts.workers)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:     # the children got the same SIGINT; let them write and exit
        for p in procs:
            p.join(timeout=30)
    for p in procs:
        if p.is_alive():
            p.terminate()
    findings, damaged = load_findings(Path(opts.out))
    for path, why in damaged:
        print(f"warning: {path}: not a readable finding ({why}); left as is", file=sys.stderr)
    base = {"format": "simsched-report/1", "seed": opts.seed, "budget_s": opts.budget,
            "targets": [opts.target], "releases_installed": versions}
    return merge(Path(opts.out), findings, base)
