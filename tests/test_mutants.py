"""Mutants of the real vLLM offloading scheduler, each caught by the lockstep harness.

Each mutant (``simsched/vllm/inside/mutants.py``) is patched into the real release inside its
worker, only through the explicit ``mutant`` argument of ``run_case``. The same case runs clean
without the mutant. Real-vLLM tests FAIL (never skip) when a release is missing.
"""

from __future__ import annotations

import pytest

from simsched.case import Case
from simsched.lockstep import HANDMADE, lockstep
from simsched.targets import Releases

LOAD_CASE, FENCE_CASE = HANDMADE["load"], HANDMADE["fence"]

VERSIONS = ["0.30.0", "0.33.0"]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(VERSIONS, timeout=120) as p:
        yield p


def caught(pool, version, case, mutant):
    clean = lockstep(Case.from_json(case), version, pool)
    assert clean.agree and not clean.real["findings"], clean.summary()
    res = lockstep(Case.from_json(case), version, pool, mutant=mutant)
    assert res.real["mutant"] == mutant
    return sorted(str(o.signature) for o in res.observations), res


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_store_shift_chunk_is_inv4(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "store_shift_chunk")
    assert "invariant:INV-4" in sigs, res.real["findings"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_drop_fence_is_inv6(pool, version):
    sigs, res = caught(pool, version, FENCE_CASE, "drop_fence")
    assert "invariant:INV-6" in sigs, res.real["findings"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_load_reverse_is_inv5(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "load_reverse")
    assert "invariant:INV-5" in sigs, res.real["findings"]
    assert "divergence:trace.load" in sigs


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_key_wrong_hash_is_inv3(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "key_wrong_hash")
    assert "invariant:INV-3" in sigs, res.real["findings"]


def test_mutant_only_through_the_explicit_argument(pool):
    res = lockstep(Case.from_json(LOAD_CASE), "0.33.0", pool)
    assert res.real["mutant"] is None and res.agree
    bad = lockstep(Case.from_json(LOAD_CASE), "0.33.0", pool, mutant="no_such_mutant")
    assert bad.real["status"] == "worker" and "unknown mutant" in bad.real["message"]


# --- lookups: INV-9 and deferrals on the real run (tests/test_real_oracles.py: the oracle) ------

def _lookup_findings(res) -> list[dict]:
    return [f for f in res.real["findings"] if f.get("kind") == "invariant"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_lookup_first_chunk_only_is_inv9(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "lookup_first_chunk_only")
    assert [s for s in sigs if s.startswith("invariant:")] == ["invariant:INV-9"], sigs
    [f] = _lookup_findings(res)
    # b's GPU hit is its first block; a's three further chunks are ready: one found
    assert f["op"] == "lookup" and "cover 48 tokens beyond the GPU hit of 16, lookup found 16" \
        in f["detail"], f


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_lookup_defer_forever_is_a_deferral_finding(pool, version):
    sigs, res = caught(pool, version, LOAD_CASE, "lookup_defer_forever")
    assert [s for s in sigs if s.startswith("invariant:")] == ["invariant:INV-8"], sigs
    [f] = _lookup_findings(res)
    # found by the deferral check (op lookup), before the quiet-tier stall check (liveness)
    assert f["op"] == "lookup" and "lookup deferred 4 steps (bound 3)" in f["detail"], f


@pytest.mark.parametrize("version", VERSIONS)
def test_mutant_lookup_refuse_window_is_inv9(pool, version):
    sigs, res = caught(pool, version, HANDMADE["window_load"], "lookup_refuse_window")
    assert [s for s in sigs if s.startswith("invariant:")] == ["invariant:INV-9"], sigs
    [f] = _lookup_findings(res)
    assert f["op"] == "lookup" and "cover 48 tokens beyond the GPU hit of 0, lookup found 0" \
        in f["detail"], f
    # the same mutant leaves a layout without a window alone
    clean = lockstep(Case.from_json(LOAD_CASE), version, pool, mutant="lookup_refuse_window")
    assert clean.agree and not clean.real["findings"], clean.summary()
