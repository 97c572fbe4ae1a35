"""Does every ``bug`` finding of a campaign replay as its report states?

For each bug finding of ``OUT/report.json``: ``simsched replay CASE`` on the releases it names
affected (must exit 1, each of them FAIL with the finding's signature or one of its aliases) and,
in a second run, on the releases it names clean (must exit 0, each of them pass). Prints one line
per finding and the totals; exits 1 on any mismatch.

Run: ``python bench/replay_findings.py OUT``  (``OUT`` as ``simsched fuzz --out`` wrote it)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

STATUS = re.compile(r"\s+(\d+\.\d+\.\d+): (pass|FAIL|skip|\S+)\s*(\S*)")


def replay(case: Path, releases: list[str]) -> tuple[int, dict[str, tuple[str, str]]]:
    """Exit code and, per release, (status word, signature) as ``simsched replay`` prints."""
    args = ["simsched", "replay", str(case)] + sum((["--release", v] for v in releases), [])
    p = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    status: dict[str, tuple[str, str]] = {}
    for line in p.stdout.splitlines():
        m = STATUS.match(line)
        if m and m.group(1) not in status:
            status[m.group(1)] = (m.group(2), m.group(3))
    return p.returncode, status


def signatures(finding: dict) -> set[str]:
    aliases = {":".join(a[:2]) if a[0] == "invariant" else ":".join(a[:2] + a[3:4])
               for a in finding.get("aliases") or []}
    return {finding["signature"], *aliases}


def check(out: Path, finding: dict) -> list[str]:
    """What differs from the report: the affected releases must exit 1 and FAIL with the
    finding's signature (or an alias), the clean ones exit 0 and pass."""
    case, sigs = out / finding["case"], signatures(finding)
    wrong = []
    for releases, stated, want_rc in ((finding["releases_affected"], "affected", 1),
                                      (finding["releases_clean"], "clean", 0)):
        if not releases:
            continue
        rc, status = replay(case, releases)
        if rc != want_rc:
            wrong.append(f"exit {rc} on the {stated} releases")
        for v in releases:
            word, sig = status.get(v, ("missing", ""))
            ok = word == "FAIL" and sig in sigs if want_rc else word == "pass"
            if not ok:
                wrong.append(f"{v}: {word} {sig}, stated {stated}")
    return wrong


def main() -> int:
    out = Path(sys.argv[1])
    report = json.loads((out / "report.json").read_text())
    bugs = [f for f in report["findings"] if f["class"] == "bug"]
    checks = mismatches = 0
    for f in bugs:
        wrong = check(out, f)
        checks += len(f["releases_affected"]) + len(f["releases_clean"])
        mismatches += len(wrong)
        print(f"{f['id']}: affected {f['releases_affected']}, clean {f['releases_clean']}: "
              f"{'; '.join(wrong) or 'as stated'}", flush=True)
    print(f"{len(bugs)} bug findings in {len({f['cluster'] for f in bugs})} clusters, "
          f"{checks} release checks, {mismatches} mismatches")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
