"""Where a shrunk finding shows, and which other cluster keys are the same cause.

:func:`replay_everywhere` runs the shrunk case on every behaviour profile and, step by step, on
every installed release, and fills in the finding's releases: affected, clean (ran every step
there, nothing showed), other (shows another crash or broken invariant), refused (a clean
start-up error: its fix, or the check the crash replaced), not run. A cause seen under several
keys is one cluster, the other keys its aliases: the same crash where a release's code has it
elsewhere (:func:`moved`), the releases that refuse a start-up crash's case (:func:`refusals`),
and what the case shows in the other asserts mode (:func:`twins`). A bug on a layout of groups
written by hand is judged against each affected release's planner (:func:`judge_reach`): a
layout no deployment reaches is ``synthetic``.
"""

from __future__ import annotations

from dataclasses import replace

from fuzz import triage as tri
from fuzz.evaluate import Evaluator
from fuzz.finding import Finding
from fuzz.triage import Seen
from simsched.outcome import describe
from simsched.planning import REACHED, SYNTHETIC, group_layout_reach
from simsched.profiles import PROFILES
from simsched.replay import observe


def replay_everywhere(ev: Evaluator, finding: Finding) -> None:
    """Run a shrunk finding on every profile and, step by step, on every installed release;
    fill in where its cause shows, where it ran clean, and where it could not run. A bug seen
    with asserts stripped is run with asserts on too (and the other way round): what the
    other mode shows on the same releases is the same cause (its aliases)."""
    outcomes: dict = {}
    obs = observe(finding.case, ev.fingerprint_targets, ev.all_release_targets, outcomes,
                  steps=[])
    obs += ev.run_steps(finding.case, ev.all_release_targets, outcomes)
    seen = ev.triage(finding.case, obs, outcomes)
    finding.outcomes = outcomes
    classes = [s.klass for s in seen if s.key == finding.key]
    if classes:   # every release and profile ran now: the class they say
        finding.klass = min(classes, key=lambda k: (tri.CLASSES + (tri.TOOL_ERROR,)).index(k))
    if finding.signature.kind == "crash" and finding.klass == tri.BUG:
        finding.aliases = moved(finding, seen)
    refused = refusals(finding, seen)
    finding.aliases = sorted(set(finding.aliases) | {s.key for s in refused.values()},
                             key=repr)
    keys = {finding.key, *finding.aliases}
    hit = {s.obs.target for s in seen if s.key in keys}
    finding.profiles_affected = [p for p in PROFILES if any(
        o.target == f"model:{p}" and o.signature == finding.signature for o in obs)]
    # a release where the case shows another crash or broken invariant is not clean:
    # clean means it ran every step there and nothing showed
    other = {s.obs.target: str(s.obs.signature) for s in seen
             if s.obs.level != "model" and s.key not in keys
             and s.klass in (tri.BUG, tri.VALIDATION)}
    for t in ev.all_release_targets:
        outcome = outcomes[t.name]
        if t.name in refused:
            sig = refused[t.name].obs.signature
            finding.releases_refused[t.name] = f"refuses it at start-up: {sig}"
        elif t.name in hit:
            finding.releases_affected.append(t.name)
        elif t.name in other:
            finding.releases_other[t.name] = f"shows {other[t.name]} instead"
        elif outcome.get("status") == "ran":
            finding.releases_clean.append(t.name)
        else:
            finding.releases_not_run[t.name] = describe(outcome)
    if finding.klass == tri.BUG and finding.releases_affected:
        finding.aliases = sorted(set(finding.aliases) | set(twins(ev, finding)), key=repr)
        judge_reach(finding, ev.all_release_targets)

def judge_reach(finding: Finding, release_targets: list) -> None:
    """A bug on a layout of groups written by hand: each affected release's planner says
    whether it builds those groups for some model (``planning.group_layout_reach``). Where
    none does, no deployment reaches the state: the finding is ``synthetic``, with the
    planner's answer as its reason."""
    if finding.case.layout.layers:
        return
    by_version = {t.version: t for t in release_targets}
    answers = {v: group_layout_reach(finding.case, v, by_version[v].pool)
               for v in finding.releases_affected if v in by_version}
    reached = [why for how, why in answers.values() if how == REACHED]
    if reached:
        finding.deployment = f"reached: {reached[-1]}"
    elif answers and all(how == SYNTHETIC for how, _ in answers.values()):
        finding.klass = tri.SYNTHETIC
        finding.deployment = f"synthetic: {list(answers.values())[-1][1]}"
    elif answers:
        finding.deployment = (f"written as groups, not checked against a planner: "
                              f"{list(answers.values())[-1][1]}")

def moved(finding: Finding, seen: list[Seen]) -> list[tuple]:
    """The same crash where a release's code has it elsewhere: the shrunk case raises the
    same exception on another release from the same function in another file or line
    (0.33.0 moved ``get_sliding_window_size_in_chunks`` into ``offloading/config.py``), or
    from the same statement in another function (0.25.1 keeps the offload checks in
    ``OffloadingSpec.__init__``), or with the same message, its numbers aside (a check
    rewritten with the same words), or at the same start-up stage (a check moved and
    rewritten: 0.25.1's ``OffloadingSpec.__init__`` asserts ``offloaded_block_size %
    gpu_block_size == 0`` where 0.26.0's ``build_offloading_config`` asserts
    ``tokens_per_chunk % tokens_per_block == 0``; the shrunk case is the one configuration
    both refuse). Another exception (an assert that became a ``ValueError``), statement,
    function, message and stage is another finding."""
    _, exc, _, function, source = finding.key
    words = tri.message_words(finding.outcome.get("message"))
    stage = finding.outcome.get("stage")
    start_up = stage in tri.START_UP_STAGES
    return sorted({s.key for s in seen if s.klass == tri.BUG and s.obs.level != "model"
                   and s.key[0] == "crash" and s.key != finding.key and s.key[1] == exc
                   and (s.key[3] == function or s.key[4] == source
                        or (words and tri.message_words(s.obs.outcome.get("message"))
                            == words)
                        or (start_up and s.obs.outcome.get("stage") == stage))},
                  key=repr)

def refusals(finding: Finding, seen: list[Seen]) -> dict[str, Seen]:
    """Releases that refuse a start-up crash's shrunk case with a clean error: one cause
    with the crash, its fix where they come after it (the offload block smaller than the
    GPU block: 0.25.1-0.29.0 assert in ``build_offloading_config``, 0.30.0 raises a
    ``ValueError`` saying which block size to use; a lone ring group: 0.29.0-0.30.0 assert
    in ``get_sliding_window_size_in_chunks``, 0.31.0 finds no eligible cache group), and
    where they come before it, the check the crash replaced (the range says "regressed
    in")."""
    if (finding.klass != tri.BUG or finding.signature.kind != "crash"
            or finding.outcome.get("stage") not in tri.START_UP_STAGES):
        return {}
    return {s.obs.target: s for s in seen
            if s.obs.level != "model" and s.klass == tri.VALIDATION}

def twins(ev: Evaluator, finding: Finding) -> list[tuple]:
    """The bug keys the case shows in the other asserts mode on the affected releases: one
    cause, seen once as the assert that guards against it and once as what breaks where
    ``python -O`` strips that assert (a ring group offloaded: 0.29.0's boot assert with
    asserts on, its one block stored under a prefix key without them)."""
    other = replace(finding.case, asserts=not finding.case.asserts)
    targets = [t for t in ev.all_release_targets if t.name in finding.releases_affected]
    outcomes: dict = {}
    seen = ev.triage(other, ev.run_steps(other, targets, outcomes), outcomes)
    return sorted({s.key for s in seen if s.klass == tri.BUG and s.key != finding.key},
                  key=repr)
