from simsched.case import Case
from simsched.model import run_case


def mk(groups, reqs, asserts=True, timing=None, **engine):
    obj = {"layout": {"groups": groups, "engine": engine}, "requests": reqs, "asserts": asserts}
    if timing:
        obj["timing"] = timing
    return Case.from_json(obj)


FULL16 = [{"kind": "full", "block_size": 16}]


def test_single_request_clean():
    c = mk(FULL16, [{"id": "a", "prompt": [[1, 100]], "decode": 5}], num_gpu_blocks=64)
    r = run_case(c, "prefix-cacheable")
    assert r.ok, r.findings
    assert r.counters["stores"] == 1
    assert r.counters["finished"] == 1
