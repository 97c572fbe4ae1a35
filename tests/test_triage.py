"""Triage: classes and cluster keys of observations, and release ranges (fuzz/triage.py)."""

from fuzz import triage as tri
from simsched.layout import Group, Layout
from simsched.outcome import Observation, Signature

RING = Layout(groups=(Group("full", 16), Group("ring", 4)))


def crash(exception, function, source, stage="build_offloading_config", message="m"):
    out = {"status": "error", "exception": exception, "function": function, "stage": stage,
           "file": "distributed/kv_transfer/kv_connector/v1/offloading/config.py",
           "line": 91, "source": source, "message": message}
    return Observation(Signature("crash", exception, function), "0.30.0", out)


def test_a_bare_assert_at_start_up_is_a_bug():
    o = crash("AssertionError", "build_offloading_config",
              "assert group.tokens_per_block % tokens_per_hash == 0, (")
    assert tri.triage_release(o, RING, None).klass == tri.BUG


def test_a_raised_value_error_at_start_up_is_validation():
    o = crash("ValueError", "build_offloading_config",
              'raise ValueError("KV offloading found no eligible cache groups.")')
    assert tri.triage_release(o, RING, None).klass == tri.VALIDATION


def test_a_value_error_out_of_python_is_a_bug():
    """islice's ValueError in update_offload_keys (the reference PR's third crash): vLLM did not
    raise it on purpose, and it is not at start-up."""
    o = crash("ValueError", "update_offload_keys",
              "for h in islice(block_hashes, start, None, step):", stage="update_offload_keys")
    assert tri.triage_release(o, RING, None).klass == tri.BUG
    o = crash("ValueError", "build_offloading_config", "x = islice(a, -1)")
    assert tri.triage_release(o, RING, None).klass == tri.BUG


def test_a_refusal_without_message_or_after_start_up_is_a_bug():
    o = crash("ValueError", "f", 'raise ValueError("x")', message="")
    assert tri.triage_release(o, RING, None).klass == tri.BUG
    o = crash("ValueError", "f", 'raise ValueError("x")', stage="schedule")
    assert tri.triage_release(o, RING, None).klass == tri.BUG


def test_crash_cluster_is_the_raising_line_text_not_its_number():
    a = crash("AssertionError", "build_offloading_config", "assert  a % b == 0")
    b = crash("AssertionError", "build_offloading_config", "assert a % b == 0")
    b.outcome["line"] = 120
    c = crash("AssertionError", "build_offloading_config", "assert len(u) == 1")
    ka, kb, kc = (tri.triage_release(x, RING, None).key for x in (a, b, c))
    assert ka == kb != kc


def test_worker_failures_are_tool_errors():
    o = Observation(Signature("crash", "WorkerDied", "release_worker"), "0.30.0",
                    {"status": "worker"})
    assert tri.triage_release(o, RING, None).klass == tri.TOOL_ERROR


def test_invariant_cluster_is_id_op_and_the_kinds_where_it_broke():
    def inv(kinds):
        out = {"kind": "invariant", "inv_id": "INV-6", "step": 1, "detail": "block 9"}
        if kinds:
            out["group_kinds"] = kinds
        return Observation(Signature("invariant", invariant="INV-6"), "0.30.0", out, "steps")
    three = Layout(groups=(Group("full", 16), Group("sliding_window", 16, sliding_window=128),
                           Group("ring", 16)))
    one = Layout(groups=(Group("ring", 16),))
    assert tri.triage_release(inv("ring"), three, False).key == \
        tri.triage_release(inv(None), one, False).key == ("invariant", "INV-6", "write", "ring")
    assert tri.triage_release(inv(None), three, False).key[3] == "full+ring+sliding_window"


def test_kinds_that_share_a_manager_are_one_invariant_cluster():
    # vLLM registers MLAAttentionSpec with FullAttentionManager and SlidingWindowMLASpec with
    # SlidingWindowManager: a stall of one token on the full and on the MLA layout is one cause
    stall = Observation(Signature("invariant", invariant="INV-8"), "0.31.0",
                        {"kind": "invariant", "inv_id": "INV-8", "op": "load"}, "steps")
    def key(*groups):
        return tri.triage_release(stall, Layout(groups=groups), False).key
    assert key(Group("full", 16)) == key(Group("mla", 16)) == \
        ("invariant", "INV-8", "load", "full")
    assert key(Group("mla", 16), Group("sliding_window_mla", 16, sliding_window=64)) == \
        key(Group("full", 16), Group("sliding_window", 16, sliding_window=64))
    assert key(Group("full", 16), Group("mla", 16, drafter=True))[3] == "full+full-drafter"
    assert key(Group("full", 16), Group("ring", 16))[3] == "full+ring"


def test_a_divergence_is_a_model_gap_only_on_a_clean_run():
    o = Observation(Signature("divergence", function="trace.store"), "0.33.0", {}, "steps")
    assert tri.triage_release(o, RING, True).klass == tri.MODEL_GAP
    assert tri.triage_release(o, RING, False) is None


def model_obs(profile, sig="invariant:INV-4", function=None):
    out = {"kind": "invariant", "inv_id": "INV-4"}
    if function:
        out = {"kind": "crash", "exception": "KeyError", "function": function, "stage": "model"}
    return Observation(Signature.parse(sig), f"model:{profile}", out, "model")


def test_model_observations():
    # every-group stands for 0.30.0
    assert tri.triage_model(model_obs("every-group"), {"0.30.0": False}) is None
    assert tri.triage_model(model_obs("every-group"), {"0.30.0": True}).klass == tri.MODEL_GAP
    assert tri.triage_model(model_obs("every-group"), {}) is None
    assert tri.triage_model(model_obs("every-group"), {}, stepping=False).klass == tri.PREDICTED
    assert tri.triage_model(model_obs("fix-assert-only"), {}) == \
        tri.Triage(tri.PROPOSAL, ("proposal", "fix-assert-only"))
    crash_in_model = model_obs("every-group", "crash:KeyError:simsched._hit_block",
                               "simsched._hit_block")
    assert tri.triage_model(crash_in_model, {}).klass == tri.TOOL_ERROR


def test_a_proposal_that_a_release_shows_too_is_no_proposal():
    from fuzz.triage import Seen
    prop = Seen(model_obs("fix-assert-only"), tri.PROPOSAL, ("proposal", "fix-assert-only"))
    real = Seen(Observation(Signature("invariant", invariant="INV-4"), "0.30.0", {}, "steps"),
                tri.BUG, ("invariant", "INV-4", "store", "ring"))
    assert tri.only_proposals([prop, real]) == [real]
    assert tri.only_proposals([prop]) == [prop]


def test_ranges():
    installed = ["0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.33.0"]
    assert tri.ranges(["0.29.0", "0.30.0", "0.33.0"], installed) == \
        [("0.29.0", "0.30.0"), ("0.33.0", "0.33.0")]
    text = tri.regressed_fixed(["0.29.0", "0.30.0"], ["0.28.0", "0.31.0", "0.33.0"], installed)
    assert text == "0.29.0 to 0.30.0: regressed in 0.29.0, fixed in 0.31.0"
    assert "not fixed in the newest" in tri.regressed_fixed(["0.33.0"], ["0.31.0"], installed)
    # a release that did not run is no evidence either way
    assert tri.regressed_fixed(["0.30.0"], ["0.33.0"], installed) == \
        "0.30.0: present since 0.30.0 (oldest run), fixed in 0.33.0"
    # a release refusing the case cleanly at start-up ends the range as its fix
    assert tri.regressed_fixed(["0.28.0", "0.29.0"], [], installed, ["0.30.0", "0.31.0"]) == \
        "0.28.0 to 0.29.0: present since 0.28.0 (oldest run), fixed in 0.30.0 (refused at start-up)"
