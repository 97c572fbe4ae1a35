"""Model gaps of campaign c20b, each checked against the real releases step by step.

Real-vLLM tests FAIL (never skip) when a release is missing: ``Releases.installed([...])`` raises.
"""

from __future__ import annotations

import pytest

from simsched.case import Case
from simsched.geometry import profile_for_release
from simsched.lockstep import lockstep
from simsched.model import run_case
from simsched.targets import Releases

LEGACY = ["0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0"]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(LEGACY + ["0.29.0", "0.30.0", "0.33.0"], timeout=120) as p:
        yield p


def stores(trace: list[str]) -> list[str]:
    return [x for x in trace if x.startswith("store ")]


# --- gap-trace_store-4d4914: align-mode Mamba before 0.29.0 ----------------------------------

#: one 64-token prompt beside an align-mode Mamba group: up to 0.28.0 (no
#: take_boundary_state_offloads, no _build_aligned_boundary_store_jobs) the Mamba state block is
#: part of the chunk store job; from 0.29.0 it is a boundary job of its own, before the chunk job
MAMBA_ONE = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                   {"kind": "mamba", "block_size": 16,
                                    "mamba_cache_mode": "align"}]},
             "requests": [{"id": "r0", "prompt": [[0, 64]]}]}


@pytest.mark.parametrize("version", LEGACY)
def test_model_stores_align_mamba_in_the_chunk_job_before_0290(version):
    """The store line is the one 0.25.1-0.28.0's real Scheduler emits for this case."""
    res = run_case(Case.from_json(MAMBA_ONE), profile_for_release(version))
    assert stores(res.trace) == ["store 0 r0 g0:0=1 g0:1=2 g0:2=3 g0:3=4 g1:3=5"]


@pytest.mark.parametrize("version", LEGACY + ["0.29.0"])
def test_align_mamba_store_jobs_agree(pool, version):
    res = lockstep(Case.from_json(MAMBA_ONE), version, pool)
    assert res.agree, res.summary()
    want = (["store 0 r0 g1:3=5", "store 1 r0 g0:0=1 g0:1=2 g0:2=3 g0:3=4"]
            if version == "0.29.0" else ["store 0 r0 g0:0=1 g0:1=2 g0:2=3 g0:3=4 g1:3=5"])
    assert stores(res.real["trace"]) == want
