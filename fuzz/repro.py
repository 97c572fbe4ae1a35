"""Writing a shrunk finding out as files worth attaching upstream.

Per finding, ``repros/<id>/`` holds ``case.json`` (the shrunk case), ``test_repro.py`` (a
standalone pytest file: it needs only simsched and the installed releases, and fails on exactly the
releases where the finding is present) and ``README.md`` (the text of an upstream issue). A
``bug`` finding of a kind :mod:`fuzz.vllm_repro` writes also gets ``test_vllm_<name>.py``, a test
that needs vLLM alone, verified on the installed releases when asked (``verify``), and
``vllm_repro.json`` (what the verification found). A ``bug`` finding also gets ``ISSUE.md``
(:mod:`fuzz.issue`): the text of a vLLM issue, ready to paste.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from simsched.outcome import describe

TEST_TEMPLATE = '''"""Repro of simsched finding {id}: {signature}.

Layout: {layout}
Present in: {affected}. Absent from: {clean}.
Run: python -m pytest {path}  (needs simsched and `simsched releases install`).
It runs the case step by step on each installed release's real Scheduler: it fails where the
finding is present, passes where the case ran and it is absent, and skips (naming why) a
release where the case cannot run (unsupported, refused at start-up).
"""

from pathlib import Path

import pytest

from simsched.case import load_case
from simsched.replay import shows
from simsched.targets import Releases

CASE = load_case(Path(__file__).with_name("case.json"))
SIGNATURE = {signature!r}


def _installed():
    from simsched.vllm.releases import installed
    return [r.version for r in installed()]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed() as p:
        yield p


def test_some_release_is_installed():
    assert _installed(), "no vLLM release installed: run `simsched releases install`"


@pytest.mark.parametrize("release", _installed())
def test_repro(pool, release):
    target = next(t for t in pool.targets() if t.version == release)
    present, ran, outcome = shows(CASE, target, SIGNATURE)
    if not ran:   # no claim either way where the case cannot run
        pytest.skip(f"vLLM {{release}}: {{outcome}}")
    assert not present, f"vLLM {{release}}: {{SIGNATURE}} is present: {{outcome}}"
'''


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def title(data: dict) -> str:
    """The issue's title: what raised where (a crash), which field differs (a divergence), or
    which invariant broke and what it says (an invariant finding names no function)."""
    if data["kind"] == "invariant":
        from simsched.invariants import INVARIANTS
        inv = data.get("invariant") or "?"
        return f"# {inv} broken: {INVARIANTS.get(inv, 'unknown invariant')} (invariant)"
    return (f"# {data['exception'] or data['kind']} in `{data['function'] or data['field']}`"
            f" ({data['kind']})")


def issue_text(data: dict, case_text: str, outcomes: dict, trace: list[str] | None = None,
               path: str | None = None) -> str:
    """The README of a repro: the text of an upstream bug report (``trace``: the model's step
    trace up to the failure, under a profile that shows it; ``path``: the connector path the
    model does not mirror, if the case is on one)."""
    lines = [title(data), "", f"**Layout:** `{data['layout']}`", ""]
    geo = next((o["geometry"] for o in outcomes.values()
                if isinstance(o, dict) and o.get("status") == "ok"), None)
    if geo:
        lines += ["**Derived geometry where it configures** (hash unit "
                  f"{geo['tokens_per_hash']} tokens, scheduler block {geo['scheduler_block_size']}):",
                  "", "| group | tokens/block | tokens/chunk | hashes/chunk | window (chunks) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {g['group_id']} | {g['tokens_per_block']} | {g['tokens_per_chunk']} | "
                  f"{g['hashes_per_chunk']} | {g['sliding_window_in_chunks']} |" for g in geo["groups"]]
        lines.append("")
    if data.get("file"):
        lines += [f"**Failing code:** `vllm/{data['file']}`"
                  + (f" line {data['line']}" if data.get("line") else "")
                  + f", in `{data['function']}`: `{data.get('message') or ''}`", ""]
    lines += [f"**Present in:** {', '.join(data['releases_affected']) or 'no installed release'}  ",
              f"**Absent from:** {', '.join(data['releases_clean']) or 'no installed release'}  ",
              f"**Model profiles predicting it:** {', '.join(data['profiles_affected']) or 'none'}  ",
              f"**Python asserts:** {'on' if data['asserts'] else 'stripped (python -O)'}", "",
              "## What each target does with this case", ""]
    lines += [f"- `{name}`: {describe(o)}" for name, o in outcomes.items()]
    if path is not None:
        lines += ["", f"The model does not mirror this connector path ({path}): the finding is "
                  "the real run's own, checked alone; `simsched replay case.json "
                  "--all-releases` shows each release's run."]
    if trace:
        lines += ["", "## Trace up to the failure (simsched model, "
                  f"{trace[0].split('profile=')[-1].split()[0] if trace else ''})", "", "```"]
        lines += trace[-40:] if len(trace) > 40 else trace
        lines += ["```"]
    lines += ["", "## Case", "", "```json", case_text.rstrip(), "```", "",
              "Reproduce: `simsched replay case.json --all-releases`, or "
              "`python -m pytest test_repro.py`.", ""]
    return "\n".join(lines)


def trace_profile(data: dict) -> str | None:
    """The profile the README shows the model's trace under: the first that shows the
    finding, else the first affected release's; None if neither."""
    from simsched.profiles import profile_for_release
    from simsched.vllm.releases import release_of
    names = data["profiles_affected"] or [profile_for_release(release_of(v)).name
                                           for v in data["releases_affected"][:1]]
    return names[0] if names else None


def unmirrored_path(case, data: dict) -> str | None:
    """The connector path of ``case`` the model does not mirror under :func:`trace_profile`
    (``simsched.model.unmodelled_path``), if any."""
    from simsched.model import unmodelled_path
    from simsched.profiles import get_profile
    name = trace_profile(data)
    return unmodelled_path(case.layout, get_profile(name) if name else None)


def model_trace(case, data: dict) -> list[str] | None:
    """The model's trace of the case under :func:`trace_profile`; None on a connector path the
    model does not mirror there (its trace would be another path's)."""
    from simsched.model import run_case
    name = trace_profile(data)
    if name is None or unmirrored_path(case, data) is not None:
        return None
    try:
        return run_case(case, name).trace
    except Exception:   # the model crashing is itself the finding; the README says so above
        return None


def vllm_test(folder: Path, finding, data: dict, verify: bool) -> list[str]:
    """Write the vLLM-only test of a ``bug`` finding; the README lines that say which test is
    which and whether the vLLM-only one was verified (:func:`fuzz.vllm_repro_verify.verify`)."""
    from fuzz import triage as tri
    from fuzz import vllm_repro, vllm_repro_verify
    lines = ["", "## Tests", "",
             "- `test_repro.py`: runs the case on simsched's harness of each installed release "
             "(guards simsched's own regressions; needs simsched)."]
    if finding.klass != tri.BUG:
        return lines
    try:
        text = vllm_repro.render(finding.case, data)
    except vllm_repro.NotGenerated as e:
        return lines + [f"- no vLLM-only test: {e}."]
    path = folder / f"test_vllm_{vllm_repro.short_name(data)}.py"
    _write(path, text)
    what = f"- `{path.name}`: needs vLLM alone (and pytest): " \
           f"`$(simsched releases env X.Y.Z) -m pytest {path.name}`"
    if not verify:
        return lines + [what + "; not verified (`simsched repro case.json` verifies it)."]
    from simsched.vllm.releases import installed, installed_derived
    releases = [r for r in installed() + installed_derived() if r.version in finding.installed]
    verdict = vllm_repro_verify.verify(path, data, releases)
    _write(folder / "vllm_repro.json", json.dumps(verdict.to_json(), indent=1) + "\n")
    runs = ", ".join(f"{v} {r}" for v, r in verdict.results.items())
    state = "verified" if verdict.verified else f"**unverified**: {verdict.reason}"
    return lines + [what + f"; {state} (run from an empty folder: {runs})."]


def write_repro(out: Path, finding, folder: Path | None = None,
                verify: bool = False) -> Path:
    """``out/repros/<id>/`` (or ``folder``): the files of a finding. ``verify``: run its
    vLLM-only test on every installed release (minutes for ten)."""
    folder = Path(folder) if folder is not None else Path(out) / "repros" / finding.id
    folder.mkdir(parents=True, exist_ok=True)
    data = finding.to_json()
    case_text = finding.case.dumps()
    _write(folder / "case.json", case_text)
    _write(folder / "test_repro.py", TEST_TEMPLATE.format(
        id=finding.id, signature=str(finding.signature), layout=data["layout"],
        affected=", ".join(data["releases_affected"]) or "none installed",
        clean=", ".join(data["releases_clean"]) or "none installed",
        path=f"repros/{finding.id}/test_repro.py"))
    readme = issue_text(data, case_text, finding.outcomes, model_trace(finding.case, data),
                        unmirrored_path(finding.case, data))
    _write(folder / "README.md", readme + "\n".join(vllm_test(folder, finding, data, False))
           + "\n")
    write_issue(folder, finding, data)
    write_finding(out, finding, folder)
    if verify:   # minutes: after the durable record, the README then says what it found
        _write(folder / "README.md", readme + "\n".join(vllm_test(folder, finding, data, True))
               + "\n")
        write_issue(folder, finding, data)
    return folder


def write_issue(folder: Path, finding, data: dict) -> None:
    """``ISSUE.md`` of a ``bug`` finding (:mod:`fuzz.issue`), with its vLLM-only test inline."""
    from fuzz import issue
    from fuzz import triage as tri
    if finding.klass == tri.BUG:
        _write(folder / "ISSUE.md", issue.issue_md(finding.case, data, folder))


def write_finding(out: Path, finding, folder: Path | None = None) -> None:
    """``finding.json``: the durable record of a finding, read back on resume."""
    folder = Path(folder) if folder is not None else Path(out) / "repros" / finding.id
    _write(folder / "finding.json", json.dumps(finding.to_json(), indent=1) + "\n")


def repro_case(case, folder: Path | None = None, out: Path = Path("."), *, shrink: bool = True,
               releases: list[str] | None = None, timeout: float = 120.0,
               progress=lambda s: None) -> Path:
    """``simsched repro``: run ``case`` step by step on every installed release (or
    ``releases``) and the model's profiles, take the first ``bug`` cluster it shows, shrink
    the case toward it unless ``shrink`` is false (:func:`fuzz.shrink.simplify`, as a
    campaign finishes its shrinking), replay the result everywhere and write its folder
    (default ``out/repros/<id>/``) with its vLLM-only test verified."""
    from fuzz import clustering
    from fuzz import triage as tri
    from fuzz.evaluate import CampaignError, Evaluator
    from fuzz.finding import Finding, finding_id, present_on
    from fuzz.shrink import Hunt, simplify
    from simsched.targets import Releases
    with Releases.installed(releases, timeout=timeout) as pool:
        if not pool.versions:
            raise CampaignError("no vLLM release installed: run `simsched releases install`")
        ev = Evaluator(pool, run_releases=list(pool.versions), steps="every")
        seen = ev.evaluate(case)
        bugs = sorted((s for s in seen if s.klass == tri.BUG), key=lambda s: repr(s.key))
        if not bugs:
            shown = sorted({f"{s.klass} {tri.cluster_name(s.key)}" for s in seen})
            raise CampaignError(f"{case.layout.describe()}: no bug on vLLM "
                                f"{', '.join(pool.versions)}"
                                + (f" (shows {'; '.join(shown)})" if shown else ""))
        first = bugs[0]
        models, configs, steps, shown = ev._hunt_targets(seen, first.key)
        hunt = Hunt(first.key, first.klass, first.obs.signature,
                    ev.fingerprint(case, first.obs.signature), models, configs, steps,
                    frozenset(shown))
        if shrink:
            progress(f"{tri.cluster_name(hunt.key)} on {', '.join(sorted(shown))}; shrinking")

            def still_shows(cand):
                if not ev.same_bug(cand, hunt):
                    return None
                seen = ev.shrink_run(cand, hunt)
                return next(s for s in seen if s.key == hunt.key) \
                    if hunt.still_shown(seen) else None

            case, first = simplify(case, still_shows, first)
        finding = Finding(
            id=finding_id(hunt.key), key=hunt.key, klass=hunt.klass,
            signature=first.obs.signature, case=case, present_on=present_on(hunt.shown),
            fingerprint=hunt.fingerprint, first_target=first.obs.target,
            outcome=first.obs.outcome, found_after_s=0.0, examples_before=0,
            installed=tuple(pool.versions))
        progress(f"replaying {case.layout.describe()} on every release")
        clustering.replay_everywhere(ev, finding)
    progress(f"writing and verifying the vLLM-only test on {', '.join(finding.installed)}")
    return write_repro(out, finding, folder, verify=True)
