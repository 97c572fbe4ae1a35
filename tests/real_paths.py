"""What the tests of the connector paths the model does not mirror share
(:mod:`simsched.connectors`): the releases they run on, and a real run that went to its end."""

from simsched.lockstep import lockstep

RELEASES = ["0.30.0", "0.33.0"]


def run_real(pool, version: str, case, mutant: str | None = None) -> dict:
    """``case`` on ``version``'s real Scheduler, step by step (checked on the real run alone):
    its outcome, which must be a run to the end (``ok``), not a refusal or a harness error."""
    real = lockstep(case, version, pool, mutant=mutant).real
    assert real["status"] == "ok", real
    return real


def distinct_drawn_cases(n: int, path: str | None = None, families: tuple | None = None
                         ) -> list:
    """The first ``n`` distinct cases of ``4 n`` the campaign's strategy draws (derandomized:
    the same cases every run), on connector path ``path`` (``fuzz.strategies.PATHS``) or, with
    None, the campaign's mix; of the layout ``families`` given, or of all."""
    from hypothesis import HealthCheck, given, settings

    from fuzz.strategies import FAMILIES, cases
    drawn: dict[str, object] = {}

    @settings(max_examples=4 * n, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases(families=families or FAMILIES, path=path))
    def draw(case):
        drawn.setdefault(repr(case.to_json()), case)
    draw()
    return list(drawn.values())[:n]


def run_checked(pool, version: str, case) -> tuple[dict, tuple]:
    """``case`` on ``version``, step by step, with no error of the harness (a failed worker, a
    harness finding): its outcome, and ``(status, findings)`` for a test's message. A run that
    stopped on vLLM's own refusal or finding is fine here."""
    real = lockstep(case, version, pool).real
    summary = (real.get("status"), [f.get("inv_id") or f.get("exception")
                                    for f in real.get("findings", [])])
    assert real.get("status") not in ("worker", "error"), real
    assert not any(f.get("kind") == "harness" for f in real.get("findings", [])), real
    return real, summary


def mutant_catches(pool, version: str, cases: list, mutant: str, inv_id: str) -> tuple[int, list]:
    """How many of ``cases`` ``mutant`` is caught on by ``inv_id`` alone, counting only those
    that run clean to their end without the mutant (the invariant fires on the mutant, not on
    vLLM's own finding): the count, and every case's findings for the test's message."""
    caught, outcomes = 0, []
    for case in cases:
        real = lockstep(case, version, pool, mutant=mutant).real
        found = [f.get("inv_id") or f.get("exception") for f in real.get("findings", [])]
        outcomes.append(found)
        assert real.get("status") not in ("worker", "error"), real
        if found == [inv_id]:
            clean = lockstep(case, version, pool).real
            caught += clean.get("status") == "ok" and clean["findings"] == []
    return caught, outcomes


def drawn_lockstep(pool, version: str, n: int, path: str, drawn: list | None = None
                   ) -> tuple[int, int, list]:
    """The first ``n`` distinct cases drawn on ``path`` (or the cases ``drawn``), each one the
    model mirrors under the release's profile (``unmodelled_path``) run in lockstep on
    ``version``: how many agree step for step, how many the model does not mirror, and the
    diverging ones (case, divergence). A case the release does not run step by step (its own
    refusal) counts in none."""
    from simsched.lockstep import lockstep, stepped
    from simsched.model import unmodelled_path
    from simsched.profiles import profile_for_release
    profile = profile_for_release(version)
    agreed, unmodelled, diverged = 0, 0, []
    for case in drawn if drawn is not None else distinct_drawn_cases(n, path):
        if unmodelled_path(case.layout, profile) is not None:
            unmodelled += 1
            continue
        res = lockstep(case, version, pool)
        if not stepped(res.real):
            continue
        if res.divergence is not None or res.model is None:
            diverged.append((case.to_json(), res.divergence and res.divergence.describe()))
        else:
            agreed += 1
    print(version, f"{agreed} agree, {unmodelled} unmodelled, {len(diverged)} diverge")
    return agreed, unmodelled, diverged
