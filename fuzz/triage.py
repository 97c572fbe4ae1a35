"""Triage: what an observation says about vLLM, and which observations share a cause.

Every observation of a case (:class:`simsched.replay.Observation`) gets a **class**:

``bug``
    a real release crashed with an exception that is not a clean refusal (an ``AssertionError``,
    an ``IndexError``, a ``ValueError`` out of ``islice``...), at start-up or later, or broke an
    invariant on its real, step-by-step run;
``validation``
    a real release refused the configuration at start-up with an exception that names the
    problem: a ``ValueError``, ``TypeError`` or ``NotImplementedError`` with a message, raised by
    a ``raise`` statement of vLLM's own code (vLLM doing its job);
``model-gap``
    the model disagrees with a release whose run broke no invariant (a configuration or trace
    difference, or an invariant the model predicts for a release that ran clean);
``synthetic``
    a bug shown only on a layout of groups written by hand that no affected release's planner
    builds for any model (``simsched.planning.group_layout_reach``): no deployment reaches it,
    so it is never reported as a ``bug`` of vLLM (the reason says what the planner builds);
``proposal``
    shows only under a hypothetical fix profile (it judges a fix; no release has it): one
    cluster per fix profile, what the fix would leave broken;
``predicted``
    the model predicts it under a release's profile, and the campaign ran no real step to
    check it (``--target model`` or ``--target config`` only);
``tool-error``
    simsched itself raised (the model, the harness, a release worker that died or hung):
    never a finding about vLLM.

and a **cluster key**, the cause it stands for (ClusterFuzz's crash state): a crash by its
exception, vLLM file, function and the text of the raising line (the text, not the number:
lines move between releases); an invariant by its ID, the first bad operation and the group
kinds of the layout; a model gap by what differs. Observations with one key are one cluster,
whatever the layout, the profiles, the asserts mode or the releases they show on.
"""

from __future__ import annotations

from dataclasses import dataclass

from simsched.invariants import INV_OPS
from simsched.layout import Layout
from simsched.model import unmodelled_knobs
from simsched.outcome import Observation
from simsched.profiles import PROFILES
from simsched.vllm.releases import is_release

BUG, SYNTHETIC, VALIDATION, MODEL_GAP, PROPOSAL, PREDICTED, TOOL_ERROR = (
    "bug", "synthetic", "validation", "model-gap", "proposal", "predicted", "tool-error")
#: the order in which a campaign hunts new clusters and a report lists them (a bug is found
#: as one and made ``synthetic`` when it is recorded, once every release has run it)
CLASSES = (BUG, SYNTHETIC, VALIDATION, MODEL_GAP, PROPOSAL, PREDICTED)

#: configuration stages of a release (the config chain and the real engine's boot): a clean
#: refusal can only happen here; later, the same exception is a bug
START_UP_STAGES = frozenset({"resolve", "build_offloading_config", "spec", "from_spec",
                             "scheduler", "boot", "add_request"})
REFUSAL_EXCEPTIONS = frozenset({"ValueError", "TypeError", "NotImplementedError"})
#: the kind whose scheduler-side manager a kind shares: the spec registry at the end of
#: ``vllm/v1/core/single_type_kv_cache_manager.py`` (0.25.1-0.33.0) registers
#: ``MLAAttentionSpec`` with ``FullAttentionManager`` and ``SlidingWindowMLASpec`` with
#: ``SlidingWindowManager``; every other kind has a manager of its own
SAME_MANAGER = {"mla": "full", "sliding_window_mla": "sliding_window"}
#: a release worker's own failures: the case is saved, the cause is not known to be vLLM's
WORKER_FAILURES = frozenset({"WorkerDied", "WorkerTimeout", "HarnessError", "WorkerError"})

@dataclass(frozen=True)
class Triage:
    klass: str
    key: tuple          # the cluster key: equal keys, one cause

    @property
    def cluster(self) -> str:
        return cluster_name(self.key)


@dataclass
class Seen:
    """One triaged observation of a case: the observation, its class and its cluster key."""

    obs: Observation
    klass: str
    key: tuple


def group_kinds(layout: Layout) -> str:
    """The kinds of a layout's groups, as a cluster sees them: ``full+ring``, ``full+mamba``."""
    return "+".join(g.kind + ("-drafter" if g.drafter else "") for g in layout.groups)


def manager_kinds(kinds: str) -> str:
    """Group kinds as the scheduler's managers see them: one step-level cause shows alike on
    kinds that share a manager (``mla`` is ``full``, ``sliding_window_mla`` is
    ``sliding_window``), so they are one cluster."""
    def manager(kind: str) -> str:
        base, drafter, _ = kind.partition("-drafter")
        return SAME_MANAGER.get(base, base) + drafter
    return "+".join(sorted({manager(k) for k in kinds.split("+") if k}))


def is_refusal(outcome: dict) -> bool:
    """vLLM refused the configuration: a named exception, with a message, raised at start-up
    by a ``raise`` statement of vLLM's own code (not by Python under it: ``islice``'s
    ValueError in ``update_offload_keys`` is a bug)."""
    source = (outcome.get("source") or "").lstrip()
    return (outcome.get("stage") in START_UP_STAGES
            and outcome.get("exception") in REFUSAL_EXCEPTIONS
            and bool(outcome.get("message"))
            and source.startswith("raise "))


def crash_key(outcome: dict) -> tuple:
    source = " ".join((outcome.get("source") or "").split())
    return ("crash", outcome.get("exception") or "?", outcome.get("file") or "",
            outcome.get("function") or "?", source)


def message_words(message: str | None) -> str:
    """An exception's message with its numbers masked, for telling one check's message in two
    releases (empty for a message too short to tell anything)."""
    import re
    text = re.sub(r"\d+", "N", " ".join((message or "").split()))
    return text if len(text) >= 20 else ""


def triage_release(obs, layout: Layout, run_clean: bool | None) -> Triage | None:
    """An observation on a real release. ``run_clean``: the release's step-by-step run broke
    nothing (None: no step ran). None: a divergence on a run that broke something (the
    broken invariant or the crash is the finding; the divergence is its consequence)."""
    sig, out = obs.signature, obs.outcome
    if sig.kind == "crash":
        if sig.exception in WORKER_FAILURES or sig.function == "release_worker":
            return Triage(TOOL_ERROR, ("tool", sig.exception, sig.function))
        return Triage(VALIDATION if is_refusal(out) else BUG, crash_key(out))
    if sig.kind == "invariant":
        # the kinds of the groups where it broke, where the run names them; else the layout's
        op = out.get("op") or INV_OPS.get(sig.invariant, "?")
        kinds = manager_kinds(out.get("group_kinds") or group_kinds(layout))
        return Triage(BUG, ("invariant", sig.invariant, op, kinds))
    # a divergence from the model: the model's gap, unless the release's run broke something
    # (then the bug of that run is the finding, and this is its consequence)
    if run_clean is False:
        return None
    if unmodelled := unmodelled_knobs(layout):
        return Triage(MODEL_GAP, ("model-gap", f"not modelled: {', '.join(unmodelled)}"))
    return Triage(MODEL_GAP, ("model-gap", sig.function))


def model_failed(outcome: dict) -> bool:
    """The model's own code raised (simsched's failure, never a finding about vLLM)."""
    return (outcome.get("function") or "").startswith("simsched") \
        or outcome.get("stage") == "model"


def triage_model(obs, releases_run: dict[str, bool], stepping: bool = True) -> Triage | None:
    """An observation on the model under a profile; ``releases_run``: release -> its real run
    was clean, for the releases that ran the case step by step; ``stepping``: the campaign runs
    real steps at all. None: nothing to report on its own (the real runs of the profile's
    releases show it, and the release's observation is the finding; or its releases did not
    run the case, where real steps were the check)."""
    sig, out = obs.signature, obs.outcome
    if model_failed(out):
        return Triage(TOOL_ERROR, ("tool", sig.exception, sig.function))
    profile = PROFILES.get(obs.target.split(":", 1)[1])
    if profile is None or not profile.releases:
        # one cluster per fix proposal: what the fix leaves broken, its signatures variants
        return Triage(PROPOSAL, ("proposal", obs.target.split(":", 1)[1]))
    ran = {v: clean for v, clean in releases_run.items() if v in profile.releases}
    if not ran:
        return None if stepping else Triage(PREDICTED, ("predicted", str(sig)))
    if all(ran.values()):
        return Triage(MODEL_GAP, ("model-gap", f"model predicts {sig}"))
    return None


def only_proposals(seen: list) -> list:
    """Drop a proposal whose signature also shows on a release or under a release's profile in
    the same case: a proposal is what shows only under hypothetical fixes."""
    real = {str(s.obs.signature) for s in seen if s.klass != PROPOSAL}
    real |= {str(s.obs.signature) for s in seen if s.obs.level == "model"
             and (p := PROFILES.get(s.obs.target.split(":", 1)[1])) is not None and p.releases}
    return [s for s in seen if s.klass != PROPOSAL or str(s.obs.signature) not in real]


def cluster_name(key: tuple) -> str:
    """A short, stable, readable name for a cluster key."""
    import hashlib
    head = {"crash": lambda k: f"{k[1]}-{k[3]}", "invariant": lambda k: f"{k[1]}-{k[2]}-{k[3]}",
            "model-gap": lambda k: f"gap-{k[1]}", "proposal": lambda k: f"proposal-{k[1]}",
            "predicted": lambda k: f"predicted-{k[1]}", "tool": lambda k: f"tool-{k[1]}"}
    text = head.get(key[0], lambda k: "-".join(map(str, k)))(key)
    slug = "".join(ch if ch.isalnum() or ch in "-_+" else "_" for ch in text)[:60].strip("_")
    return f"{slug}-{hashlib.sha1(repr(key).encode()).hexdigest()[:6]}"


# --- release ranges ----------------------------------------------------------------------------

def _vkey(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in v.split("."))


def ranges(affected: list[str], installed: list[str]) -> list[tuple[str, str]]:
    """The affected releases as runs of consecutive installed releases: [(first, last)]; a
    derived target, outside the order of releases, is a run of its own, last."""
    order = sorted((v for v in installed if is_release(v)), key=_vkey)
    hit = set(affected)
    out: list[tuple[str, str]] = []
    for v in order:
        if v in hit:
            if out and order.index(out[-1][1]) == order.index(v) - 1:
                out[-1] = (out[-1][0], v)
            else:
                out.append((v, v))
    return out + [(v, v) for v in sorted(hit) if not is_release(v)]


def regressed_fixed(affected: list[str], clean: list[str], installed: list[str],
                    refused: list[str] = ()) -> str:
    """"regressed in / fixed in" as ClusterFuzz says it, over the releases that really ran;
    ``refused``: releases that refuse the case at start-up with a clean error instead of the
    crash (the fix of a start-up assert: 0.30.0 raises a ``ValueError`` naming the offload
    block size where 0.25.1-0.29.0 assert)."""
    # a derived target (a patched release, a source tree) has no place in the release order:
    # said apart, by name
    affected_all = set(affected)
    others = sorted(v for v in set(affected) | set(clean) | set(refused) if not is_release(v))
    affected, clean, refused = ([v for v in vs if is_release(v)]
                                for vs in (affected, clean, refused))
    ran = sorted(set(affected) | set(clean) | set(refused), key=_vkey)
    parts = []
    for first, last in ranges(affected, ran):
        i, j = ran.index(first), ran.index(last)
        before = f"regressed in {first}" if i > 0 else f"present since {first} (oldest run)"
        after = "not fixed in the newest"
        if j + 1 < len(ran):
            after = f"fixed in {ran[j + 1]}" + (
                " (refused at start-up)" if ran[j + 1] in refused else "")
        span = first if first == last else f"{first} to {last}"
        parts.append(f"{span}: {before}, {after}")
    parts += [f"{v}: {'present' if v in affected_all else 'absent'}" for v in others]
    return "; ".join(parts) or "-"
