"""Verification of a vLLM-only repro file (:mod:`fuzz.vllm_repro`) on the installed releases:
the file runs with each release's plain environment (``simsched releases env``) from an empty
folder, and must fail on each affected release (with the finding's exception, or its inline
check's words) and pass on each clean one.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fuzz.vllm_repro import short_name
from fuzz.vllm_repro_checks import MARKS

VERIFY_TIMEOUT_S = 300


@dataclass
class Verdict:
    verified: bool
    reason: str                       # why not verified ("" when verified)
    results: dict = field(default_factory=dict)   # release -> "failed" / "passed" / "error: ..."

    def to_json(self) -> dict:
        return {"verified": self.verified, "reason": self.reason, "results": self.results}


def run_on(path: Path, release, asserts: bool = True) -> tuple[str, str]:
    """Run the test file with ``release``'s plain environment from an empty folder (with
    ``python -O`` unless ``asserts``): its result (``passed``, ``failed``, ``error``) and
    pytest's output."""
    from simsched.vllm.releases import env_prefix
    with tempfile.TemporaryDirectory(prefix="simsched-vllm-repro-") as tmp:
        local = Path(tmp) / path.name
        local.write_text(path.read_text())
        try:
            proc = subprocess.run(env_prefix(release) + ([] if asserts else ["-O"])
                                  + ["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                     local.name],
                                  cwd=tmp, text=True, capture_output=True,
                                  timeout=VERIFY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "error", f"timed out after {VERIFY_TIMEOUT_S} s"
    result = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
    return result, proc.stdout + proc.stderr


def verify(path: Path, data: dict, releases) -> Verdict:
    """Fails on each affected release (with the finding's exception for a crash), passes on
    each clean one; a release the case did not run on is run and reported, nothing required."""
    results, wrong = {}, []
    # what the failure must say: the crash's exception, or the inline check's own message
    mark = data.get("exception") if data["kind"] == "crash" else MARKS[short_name(data)]
    for release in releases:
        got, output = run_on(path, release, data["asserts"])
        v = release.version
        errors = [line for line in output.splitlines() if line.startswith("E ")]
        if got == "failed" and mark and not any(mark in line for line in errors):
            got = "failed otherwise"
        results[v] = got
        want = ("failed" if v in data["releases_affected"]
                else "passed" if v in data["releases_clean"] else None)
        if want is not None and got != want:
            last = [l for l in output.splitlines() if l.strip()][-1:] or [""]
            wrong.append(f"{v}: {got}, expected {want} ({last[0].strip()[:160]})")
    missing = [v for v in data["releases_affected"] + data["releases_clean"]
               if v not in results]
    if missing:
        wrong.append(f"not installed: {', '.join(missing)}")
    if not data["releases_affected"]:
        wrong.append("no affected release to fail on")
    return Verdict(not wrong, "; ".join(wrong), results)
