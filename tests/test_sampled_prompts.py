"""Prompts that repeat an earlier request's answer (``{"sampled": id, "length": n}``): the
segment's tokens, its validation, and the release's prefix hit on the blocks the earlier
request filled while decoding. Real-vLLM tests FAIL (never skip) when a release is missing."""

import pytest

from simsched.case import Case, sampled_segment, sampled_token, segment_tokens
from simsched.layout import LayoutError
from simsched.lockstep import lockstep
from simsched.targets import Releases

VERSIONS = ["0.30.0", "0.33.0"]


@pytest.fixture(scope="module")
def pool():
    with Releases.installed(VERSIONS, timeout=120) as p:
        yield p


def _turns(answer) -> Case:
    """a: 32 prompt tokens, 33 sampled, so its first 64 tokens fill four blocks of 16 (the
    last sampled token is never computed). b, once a is done, is a's prompt, then ``answer``,
    then 16 new tokens."""
    return Case.from_json({
        "seed": 7,
        "layout": {"groups": [{"kind": "full", "block_size": 16}],
                   "engine": {"num_gpu_blocks": 64}},
        "requests": [{"id": "a", "prompt": [[1, 32]], "decode": 33},
                     {"id": "b", "prompt": [[1, 32], answer, [200, 16]], "arrival": 40}]})


@pytest.mark.parametrize("seed,index,position", [(0, 0, 32), (7, 3, 1), (2**62, 1, 5000)])
def test_the_segment_is_the_tokens_the_request_samples(seed, index, position):
    s, n = sampled_segment(seed, index, position, 50)
    assert n == 50
    assert segment_tokens(s, n) == [sampled_token(seed % 32000, index, position + i)
                                    for i in range(n)]


def test_sampled_segments_are_validated():
    case = _turns({"sampled": "a"})
    assert case.requests[1].prompt[1] == sampled_segment(7, 0, 32, 33)
    assert case.repeated_outputs() == [("b", "a")]
    assert Case.from_json(case.to_json()) == case
    assert _turns({"sampled": "a", "length": 5}).requests[1].prompt[1][1] == 5
    assert _turns([3, 33]).repeated_outputs() == []
    for bad, where in (({"sampled": "b"}, r"requests\[1\]\.prompt\[1\]\.sampled: the id of an "
                                          r"earlier request is required, got 'b'"),
                       ({"sampled": "a", "length": 34}, r"requests\[1\]\.prompt\[1\]\.length"),
                       ({"sampled": "a", "length": 0}, r"requests\[1\]\.prompt\[1\]\.length"),
                       ({"sampled": "a", "tokens": 3}, r"requests\[1\]\.prompt\[1\]")):
        with pytest.raises(LayoutError, match=where):
            _turns(bad)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_next_turn_hits_the_blocks_the_answer_filled(pool, version):
    """With the answer repeated, the release finds a's four blocks (its prompt and the first 32
    tokens it sampled) and b computes only its last 17 tokens; with another segment of the
    same length in its place, only a's prompt (two blocks) is hit. The model agrees."""
    repeat = lockstep(_turns({"sampled": "a"}), version, pool)
    assert repeat.agree and repeat.observations == [], repeat.summary()
    assert "sched b 17" in repeat.real["trace"], repeat.real["trace"]
    other = lockstep(_turns([3, 33]), version, pool)
    assert other.agree, other.summary()
    assert "sched b 49" in other.real["trace"], other.real["trace"]
