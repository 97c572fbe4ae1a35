"""One cause seen in both asserts modes is one cluster: a real release's assert, and what breaks
where ``python -O`` strips it. Needs vLLM 0.30.0 installed (`simsched releases install`):
without it this test fails."""

import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from fuzz import clustering
from fuzz.campaign import Campaign
from fuzz.finding import Finding
from simsched.case import Case
from simsched.targets import Releases

pytestmark = pytest.mark.real

# a lone ring group (CircularBufferSpec, one block per request): 0.30.0 offloads it; its boot
# asserts (get_sliding_window_size_in_chunks) refuse it, and under python -O the ring's one
# block is stored under the prefix key of tokens [0, 4) (docs/repro/ring_offloaded_without_asserts.py)
RING = {"layout": {"groups": [{"kind": "ring", "block_size": 4}]},
        "requests": [{"id": "r0", "prompt": [[0, 64]]}], "asserts": False}


@contextmanager
def _campaign(installed: list[str], run_on: str, asserts: bool = True):
    """A campaign stepping ``run_on``, with ``installed`` in its pool (a finding's replay)."""
    with Releases.installed(installed, timeout=300) as pool, \
            tempfile.TemporaryDirectory() as out:
        yield Campaign(Path(out), pool, model=True, run_releases=[run_on], budget=1, seed_=0,
                       asserts=asserts, progress=lambda s: None)


def _first_bug(c: Campaign, case: Case, release: str) -> tuple:
    """The case's first bug on ``release``'s real run, and a finding made of it."""
    outcomes: dict = {}
    seen = c.triage(case, c.run_steps(case, c.release_targets, outcomes), outcomes)
    bug = next(s for s in seen if s.klass == "bug")
    return bug, Finding(id=release, key=bug.key, klass="bug", signature=bug.obs.signature,
                        case=case, present_on=(release,), fingerprint=(), first_target=release,
                        outcome=bug.obs.outcome, found_after_s=0.0, examples_before=0)


def test_an_invariant_without_asserts_joins_the_assert_that_guards_it():
    case = Case.from_json(RING)
    with _campaign(["0.30.0"], "0.30.0", asserts=False) as c:
        bug, f = _first_bug(c, case, "0.30.0")
        assert bug.key[0] == "invariant", bug.key          # asserts stripped: no crash
        clustering.replay_everywhere(c, f)
        assert f.releases_affected == ["0.30.0"]
        crashes = [a for a in f.aliases if a[0] == "crash"]
        assert [(a[1], a[3]) for a in crashes] == [
            ("AssertionError", "get_sliding_window_size_in_chunks")], f.aliases
        # and the assert, found first, names the invariant as its own
        on = replace(case, asserts=True)
        crash, g = _first_bug(c, on, "0.30.0")
        assert crash.key == crashes[0]
        clustering.replay_everywhere(c, g)
        assert g.releases_affected == ["0.30.0"] and bug.key in g.aliases, g.aliases


# an offload block smaller than the GPU block: 0.25.1 asserts it in OffloadingSpec.__init__
# (v1/kv_offload/base.py, ``offloaded_block_size % gpu_block_size == 0``), 0.26.0 in
# build_offloading_config (offloading/config.py, ``tokens_per_chunk % tokens_per_block == 0``)
SMALL_OFFLOAD_BLOCK = {"layout": {"groups": [{"kind": "sliding_window", "block_size": 128,
                                              "sliding_window": 128}],
                                  "engine": {"offload_block_size": 64}},
                       "requests": [{"id": "r0", "prompt": [[0, 64]]}]}


def test_a_start_up_assert_moved_rewritten_and_fixed_is_one_cluster():
    """0.25.1 and 0.26.0 assert the offload block size in two places; 0.30.0 refuses the same
    case with a ValueError saying which block size to use (offloading/config.py): one cause,
    fixed in 0.30.0 by a clean refusal."""
    case = Case.from_json(SMALL_OFFLOAD_BLOCK)
    with _campaign(["0.25.1", "0.26.0", "0.30.0"], "0.26.0") as c:
        bug, f = _first_bug(c, case, "0.26.0")
        assert bug.key[1:4] == ("AssertionError", "distributed/kv_transfer/kv_connector/v1/"
                                "offloading/config.py", "build_offloading_config"), bug.key
        clustering.replay_everywhere(c, f)
        assert f.releases_affected == ["0.25.1", "0.26.0"], (f.releases_affected,
                                                             f.releases_other)
        # (besides the ZeroDivisionError both raise in CPUOffloadingSpec with asserts stripped)
        assert [(a[2], a[3]) for a in f.aliases if a[1] == "AssertionError"] == [
            ("v1/kv_offload/base.py", "__init__")], f.aliases
        assert f.releases_clean == [] and list(f.releases_refused) == ["0.30.0"], \
            (f.releases_refused, f.releases_other)
        assert "ValueError" in f.releases_refused["0.30.0"]
        refusals = [a for a in f.aliases if a[1] == "ValueError"]
        assert [a[3] for a in refusals] == ["build_offloading_config"], f.aliases
        assert f.to_json()["range"] == ("0.25.1 to 0.26.0: present since 0.25.1 (oldest run), "
                                        "fixed in 0.30.0 (refused at start-up)")


# an align-mode Mamba block of 96 tokens under a 64-token budget, asserts stripped (with them,
# validate_block_size refuses the engine): 0.26.0 schedules no sub-block chunk and the request
# stalls, beside a full-attention group or alone (the full group's kind does not matter)
WIDE_MAMBA_STALL = {"layout": {"groups": [{"kind": "full", "block_size": 96},
                                          {"kind": "mamba", "block_size": 96,
                                           "mamba_cache_mode": "align"}]},
                    "requests": [{"id": "r0", "prompt": [[0, 128]]}],
                    "timing": {"max_num_batched_tokens": 64}, "asserts": False}


def test_an_invariant_shrinks_onto_fewer_group_kinds():
    from fuzz.shrink import Hunt, simplify
    case = Case.from_json(WIDE_MAMBA_STALL)
    with _campaign(["0.26.0"], "0.26.0", asserts=False) as c:
        bug, _ = _first_bug(c, case, "0.26.0")
        assert bug.key == ("invariant", "INV-8", "liveness", "full+mamba"), bug.key
        hunt = Hunt(bug.key, "bug", bug.obs.signature, (), [], [], c.release_targets,
                    frozenset({"0.26.0"}))
        shrunk, s = simplify(case, lambda x: hunt.showing(c.shrink_run(x, hunt)), bug)
        assert [g.kind for g in shrunk.layout.groups] == ["mamba"]
        assert s.key == ("invariant", "INV-8", "liveness", "mamba")
        # a stall of another operation, or of more kinds, is not the hunted cause
        assert not hunt.matches(("invariant", "INV-8", "load", "mamba"))
        assert not hunt.matches(("invariant", "INV-8", "liveness", "full+mamba+ring"))
