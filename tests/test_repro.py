"""fuzz/repro.py: the files a finding is written out as."""

from fuzz.repro import issue_text

CASE_TEXT = '{"format": "simsched-case/1", "layout": {"groups": []}}\n'


def finding_data(**kw) -> dict:
    data = {"kind": "crash", "exception": "AssertionError", "function": "build_offloading_config",
            "field": None, "invariant": None, "layout": "full/16 + ring/4", "file": None,
            "releases_affected": ["0.30.0"], "releases_clean": ["0.31.0"],
            "profiles_affected": [], "asserts": True}
    data.update(kw)
    return data


def test_crash_title_names_the_exception_and_the_function():
    text = issue_text(finding_data(), CASE_TEXT, {})
    assert text.splitlines()[0] == "# AssertionError in `build_offloading_config` (crash)"


def test_divergence_title_names_the_field():
    text = issue_text(finding_data(kind="divergence", exception=None, function=None,
                                   field="tokens_per_hash"), CASE_TEXT, {})
    assert text.splitlines()[0] == "# divergence in `tokens_per_hash` (divergence)"


def test_invariant_title_names_the_invariant_and_what_it_says():
    # an invariant finding has no function: its title is the invariant, never "in `None`"
    text = issue_text(finding_data(kind="invariant", exception=None, function=None,
                                   invariant="INV-8"), CASE_TEXT, {})
    title = text.splitlines()[0]
    assert title == ("# INV-8 broken: every request finishes or is aborted (liveness once the "
                     "tier is quiet) (invariant)")
    assert "None" not in title


def test_a_case_the_model_does_not_mirror_shows_no_model_trace():
    """A finding on a connector path the model does not mirror is the real run's own: its README
    shows no trace of the model (which would be another path's) and says why. The multi path
    with MTP is such a path on every release; SimpleCPU is mirrored on every release (0.25.1-
    0.29.0 by the legacy manager's model)."""
    from fuzz.repro import model_trace, unmirrored_path
    from simsched.case import Case
    mtp = Case.from_json({"layout": {"groups": [{"kind": "full", "block_size": 16}], "engine": {
        "connector": {"kind": "multi"}, "speculative": {"method": "mtp", "num_tokens": 2}}},
        "requests": [{"id": "R", "prompt": [[0, 64]]}]})
    old = finding_data(kind="invariant", invariant="INV-8", releases_affected=["0.29.0"])
    assert model_trace(mtp, old) is None
    why = "engine.connector=multi(offloading+nixl) with MTP"
    assert unmirrored_path(mtp, old) == why
    text = issue_text(old, CASE_TEXT, {}, None, unmirrored_path(mtp, old))
    assert "Trace up to the failure" not in text
    assert f"does not mirror this connector path ({why})" in text
    case = Case.from_json({"layout": {"groups": [{"kind": "full", "block_size": 16}], "engine": {
        "connector": {"kind": "simple_cpu", "lazy_offload": True}}},
        "requests": [{"id": "R", "prompt": [[0, 64]]}]})
    assert unmirrored_path(case, old) is None
    assert "sched R 64" in model_trace(case, old)
    data = finding_data(kind="invariant", invariant="INV-8", releases_affected=["0.30.0"])
    assert unmirrored_path(case, data) is None
    assert "sched R 64" in model_trace(case, data)
    # the default path and the multi path keep the model's trace
    plain = Case.from_json({"layout": {"groups": [{"kind": "full", "block_size": 16}]},
                            "requests": [{"id": "R", "prompt": [[0, 64]]}]})
    assert model_trace(plain, data)
    multi = Case.from_json({"layout": {"groups": [{"kind": "full", "block_size": 16}], "engine": {
        "connector": {"kind": "multi", "order": ["offloading", "nixl"]}}},
        "requests": [{"id": "R", "prompt": [[0, 64]], "remote_prefill": 1}]})
    assert "recv R g0=1,2,3,4" in model_trace(multi, data)
