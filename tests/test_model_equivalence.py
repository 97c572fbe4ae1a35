"""The model's output is pinned: trace text, findings and counters of a corpus of cases.

Each golden file under ``tests/data/model_golden/`` holds one case (as JSON), the profile it runs
under, and what ``run_case`` produced for it when recorded: with ``checks="full", trace=True``
(the trace text byte for byte, the findings, the counters) and with ``checks="fast"`` both with and
without the trace. Optimisations of the model must leave all of it identical.

Re-record after an intended semantic change (then review the golden diff)::

    SIMSCHED_RECORD_GOLDEN=1 python -m pytest tests/test_model_equivalence.py
"""

from __future__ import annotations

import json
import os

import pytest

from model_corpus import GOLDEN_DIR, corpus
from simsched.case import Case
from simsched.model import run_case

RECORD = os.environ.get("SIMSCHED_RECORD_GOLDEN") == "1"


def outcome(case_json: dict, profile: str) -> dict:
    case = Case.from_json(case_json)
    full = run_case(case, profile, checks="full", trace=True)
    fast_t = run_case(case, profile, checks="fast", trace=True)
    fast = run_case(case, profile, checks="fast", trace=False)
    out = {"full": {"findings": full.findings, "counters": full.counters},
           "fast_trace": {"findings": fast_t.findings, "counters": fast_t.counters},
           "fast": {"findings": fast.findings, "counters": fast.counters,
                    "trace": fast.trace_text()}}
    texts = {"full": full.trace_text(), "fast_trace": fast_t.trace_text()}
    return out, texts


def _paths(name: str):
    return GOLDEN_DIR / f"{name}.json", GOLDEN_DIR / f"{name}.trace", \
        GOLDEN_DIR / f"{name}.fast.trace"


def record() -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for p in GOLDEN_DIR.iterdir():
        p.unlink()
    names = []
    for name, case_json, profile in corpus():
        out, texts = outcome(case_json, profile)
        meta, trace, fast_trace = _paths(name)
        meta.write_text(json.dumps({"name": name, "profile": profile, "case": case_json,
                                    **out}, indent=1, sort_keys=True) + "\n")
        trace.write_text(texts["full"])
        if texts["fast_trace"] != texts["full"]:
            fast_trace.write_text(texts["fast_trace"])
        names.append(name)
    (GOLDEN_DIR / "INDEX").write_text("\n".join(names) + "\n")


if RECORD:
    record()

NAMES = (GOLDEN_DIR / "INDEX").read_text().split() if (GOLDEN_DIR / "INDEX").exists() else []


def test_corpus_recorded():
    assert len(NAMES) > 100, "no goldens: run with SIMSCHED_RECORD_GOLDEN=1"


@pytest.mark.parametrize("name", NAMES)
def test_model_output_unchanged(name):
    meta_p, trace_p, fast_trace_p = _paths(name)
    meta = json.loads(meta_p.read_text())
    out, texts = outcome(meta["case"], meta["profile"])
    assert texts["full"] == trace_p.read_text(), f"{name}: full trace differs"
    want_fast = fast_trace_p.read_text() if fast_trace_p.exists() else trace_p.read_text()
    assert texts["fast_trace"] == want_fast, f"{name}: fast trace differs"
    for mode in ("full", "fast_trace", "fast"):
        got = json.loads(json.dumps(out[mode]))
        assert got == meta[mode], f"{name}: {mode} findings/counters differ"
