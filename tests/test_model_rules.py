"""Scheduler rules of the real vLLM the model mirrors, one test per rule, on the hand-made cases
of ``simsched.lockstep.HANDMADE``. Each expectation is derived from the rule as the vLLM source
states it (function named in each test), not from the model's output; each case also runs under
lockstep against real releases in tests/test_lockstep.py (test_agreement_on_rule_cases).
"""

from __future__ import annotations

from simsched.case import Case
from simsched.lockstep import HANDMADE
from simsched.model import run_case


def trace(name: str, profile: str = "prefix-cacheable-windows-in-config") -> list[str]:
    r = run_case(Case.from_json(HANDMADE[name]), profile)
    assert r.ok, r.findings
    return r.trace


def blocks_of(line: str) -> set[int]:
    """Block IDs named by an ``alloc`` or ``load`` line."""
    out = set()
    for part in line.split()[2:]:
        if "=" not in part:
            continue
        ids = part.split("=", 1)[1]
        out |= {int(x) for x in ids.split(",") if x != "-"}
    return out


def first(lines: list[str], prefix: str) -> int:
    return next(i for i, x in enumerate(lines) if x.startswith(prefix))


def test_abort_during_load_keeps_blocks_until_the_load_completes():
    """Scheduler.finish_requests: a request aborted in WAITING_FOR_REMOTE_KVS whose load has not
    reported finished_recving is freed with delay_free_blocks=True; its blocks go back to the
    pool in _update_from_kv_xfer_finished, when the load completes. So c, admitted between b's
    abort and the end of b's load, cannot be given b's load destination blocks."""
    t = trace("abort_load")
    load = first(t, "load ")
    assert t[load].split()[2] == "b"
    jid = t[load].split()[1]
    abort, admit_c = t.index("finish b aborted"), first(t, "alloc c ")
    done = t.index(f"done {jid} load")
    assert load < abort < admit_c < done          # the case exercises the window
    assert not blocks_of(t[load]) & blocks_of(t[admit_c]), (t[load], t[admit_c])
