"""``repros/<id>/ISSUE.md``: a ``bug`` finding as a vLLM issue, ready to paste.

It says what vLLM's bug template asks and a maintainer needs to act: the releases present and
absent as ranges, what a deployment runs to reach the state (model family, the ``vllm serve``
flags the case sets), the minimal steps, expected and actual behaviour, the vLLM file and line
(read in the release's own source), the vLLM-only test inline with its verdict, and which
simsched behaviour profile says where the fix belongs. Short, like a good upstream issue.
"""

from __future__ import annotations

import json
from pathlib import Path

from fuzz import triage as tri
from fuzz import vllm_repro
from fuzz.strategies import family_of
from simsched.case import Case
from simsched.invariants import INVARIANTS
from simsched.layout import Layout, RetentionUnset
from simsched.vllm.releases import KNOWN_RELEASES

_ranges = vllm_repro.release_ranges

#: the realistic model family a layout looks like (fuzz/strategies.py ``family_of``)
FAMILIES = {
    "dense": "a dense model (one attention group: Llama-like full attention, or DeepSeek V3-like "
             "MLA)",
    "mla_ring": "a model with a compression ring group beside its attention (DeepSeek V4's "
                "compressor)",
    "deepseek_v4": "DeepSeek V4 (MLA + sliding-window MLA groups)",
    "mamba_hybrid": "a Mamba hybrid (full attention + Mamba layers, e.g. Nemotron-H, Granite 4)",
    "gpt_oss": "gpt-oss (full + sliding-window attention)",
    "drafter": "a model served with an EAGLE / MTP drafter whose layers form their own group",
}


def environment(data: dict) -> str:
    """Present, absent (ran every step clean) and not run (with why), as release ranges."""
    not_run = data.get("releases_not_run") or {}
    other = data.get("releases_other") or {}
    refused = data.get("releases_refused") or {}
    seen = set(data["releases_affected"]) | set(data["releases_clean"]) | set(not_run) \
        | set(other) | set(refused)
    # over every release simsched knows: one not run breaks a range
    order = sorted(seen | set(KNOWN_RELEASES), key=tri._vkey)
    parts = [f"Present in {_ranges(data['releases_affected'], order)}"]
    if data["releases_clean"]:
        parts.append(f"absent from {_ranges(data['releases_clean'], order)}")
    if refused:
        why = str(next(iter(refused.values())))
        parts.append(f"refused cleanly at start-up on {_ranges(list(refused), order)} "
                     f"({why.removeprefix('refuses it at start-up: ')[:90]})")
    by_reason: dict[str, list[str]] = {}
    for v, why in {**not_run, **other}.items():
        by_reason.setdefault(str(why).split(";")[0][:90], []).append(v)
    parts += [f"not reached on {_ranges(vs, order)} ({why})" for why, vs in by_reason.items()]
    untried = [v for v in order if v not in seen]
    if untried:
        parts.append(f"not tried on {_ranges(untried, order)}")
    asserts = "" if data["asserts"] else " With Python's asserts stripped (`python -O`)."
    return "; ".join(parts) + "." + asserts


def family(layout: Layout) -> str:
    if layout.layers:       # a model as its layers: the groups are the release planner's
        layers = " + ".join(f"{x.count} {x.kind}" + (" (drafter)" if x.drafter else "")
                            for x in layout.layers)
        name = family_of(layout).removeprefix("layers:")
        return (f"a model of {layers} layers" + (f" (the {name} family of simsched.families)"
                                                 if name != "other" else ""))
    name = family_of(layout)
    if name == "deepseek_v4" and any(g.kind == "ring" for g in layout.groups):
        return "DeepSeek V4 (MLA + sliding-window MLA groups, and its compression ring)"
    if name in FAMILIES:
        return FAMILIES[name]
    kinds = " + ".join(dict.fromkeys(g.kind for g in layout.groups))
    return f"a hybrid of {kinds} KV cache groups (no common model family)"


def serve_flags(case: Case) -> list[str]:
    """The ``vllm serve`` flags that build this layout's engine: only those the case sets."""
    eng, timing = case.layout.engine, case.timing
    extra, _ = vllm_repro._extra_config(case)
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {**extra, "cpu_bytes_to_use": "..."}}
    cache = vllm_repro._cache_fields(case)
    flags = [f"--block-size {cache['block_size']}", f"--kv-transfer-config '{json.dumps(kv)}'"]
    if not eng.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if "mamba_cache_mode" in cache:
        flags.append(f"--mamba-cache-mode {cache['mamba_cache_mode']}")
    if eng.prefix_match_unit is not None:
        flags.append(f"--prefix-match-unit {eng.prefix_match_unit}")
    if not isinstance(eng.retention_interval, RetentionUnset):   # None: "dense"
        flags.append(f"--prefix-cache-retention-interval {eng.retention_interval}")
    if eng.dcp_size != 1:
        flags.append(f"--decode-context-parallel-size {eng.dcp_size}")
    if eng.speculative is not None:
        spec = {"method": eng.speculative.method,
                "num_speculative_tokens": eng.speculative.num_tokens}
        flags.append(f"--speculative-config '{json.dumps(spec)}'")
    if eng.async_scheduling:
        flags.append("--async-scheduling")
    if timing.max_num_batched_tokens != 2048:
        flags.append(f"--max-num-batched-tokens {timing.max_num_batched_tokens}")
    if timing.max_num_seqs != 32:
        flags.append(f"--max-num-seqs {timing.max_num_seqs}")
    return flags


def steps(case: Case) -> list[str]:
    """The case's requests in words; a prompt segment shared by requests is named once."""
    names: dict[int, str] = {}
    lines = []
    for r in case.requests:
        parts = []
        for seed, n in r.prompt:
            again = seed in names
            label = names.setdefault(seed, "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[len(names) % 26])
            parts.append(f"{'the first ' * again}{n} token{'s' * (n != 1)} of {label}")
        caps = [f"`{k}={v}`" for k, v in (("max_load_tokens", r.max_load_tokens),
                                          ("max_offload_tokens", r.max_offload_tokens))
                if v is not None]
        text = (f"`{r.id}` arrives at step {r.arrival}: prompt {' + '.join(parts)}, "
                f"{r.decode} output token{'s' * (r.decode != 1)}")
        if r.abort_at is not None:
            text += f", aborted at step {r.abort_at}"
        lines.append(f"{len(lines) + 1}. {text}" + (f"; kv_transfer_params {', '.join(caps)}"
                                                    if caps else "") + ".")
    t = case.timing
    lines.append(f"{len(lines) + 1}. Each store completes {t.store_latency} step(s) and each "
                 f"load {t.load_latency} step(s) after the step that scheduled it; the GPU "
                 f"pool holds {case.layout.engine.num_gpu_blocks} blocks, the CPU tier "
                 f"{case.layout.engine.cpu_chunks} chunks.")
    return lines


def expected_actual(data: dict) -> tuple[str, str]:
    if data["kind"] == "crash":
        want = ("The engine starts (or refuses the configuration with a clear error)"
                if data.get("stage") in tri.START_UP_STAGES else
                "Every request runs to completion")
        got = f"`{data['exception']}` in `{data['function']}`"
        msg = (data.get("message") or "").strip().rstrip(".")
        return want + ".", got + (f": {msg}" if msg else "") + "."
    inv = data.get("invariant") or "?"
    want = INVARIANTS.get(inv, inv)
    return (f"{want[0].upper()}{want[1:]} ({inv} in simsched's terms).",
            f"{(data.get('message') or '').strip().rstrip('.')}.")


def code_location(data: dict, home: Path | None = None) -> str | None:
    """``vllm/<file>`` line N as the release that showed it first has it (else the newest
    affected one), with the raising line read in that release's own source; where the
    release's line differs from the finding's ``source``, the finding's line is quoted."""
    if not data.get("file"):
        return None
    from simsched.vllm.releases import simsched_home
    affected = data["releases_affected"]
    release = data.get("first_target") if data.get("first_target") in affected else \
        (affected[-1] if affected else None)
    where = f"`vllm/{data['file']}`" + (f" line {data['line']}" if data.get("line") else "")
    where += f", in `{data['function']}`" + (f" (vLLM {release})" if release else "")
    src = Path(home or simsched_home()) / "releases" / str(release) / "vllm" / data["file"]
    line, source = None, (data.get("source") or "").strip()
    if release and data.get("line") and src.exists():
        text = src.read_text().splitlines()
        line = text[data["line"] - 1].strip() if data["line"] <= len(text) else None
    if line and source and source not in line:
        where += " (the release's line there differs; the finding's line below)"
        line = None
    line = line or source
    return where + (f":\n\n```python\n{line}\n```" if line else ".")


def _differ(a, b) -> str:
    """The policy fields in which profiles ``a`` and ``b`` differ, as ``field: a -> b``."""
    from dataclasses import fields

    def shown(v):
        return getattr(v, "__name__", None) or repr(v)
    names = [f.name for f in fields(a) if f.name not in ("name", "summary", "releases")]
    diff = [f"`{n}`: {shown(getattr(a, n))} -> {shown(getattr(b, n))}" for n in names
            if getattr(a, n) != getattr(b, n) and n != "extra"]
    extra = sorted(k for k in set(a.extra) | set(b.extra) if a.extra.get(k) != b.extra.get(k))
    named = diff + [f"`extra.{k}`" for k in extra]
    more = f" and {len(named) - 6} more" if len(named) > 6 else ""
    return "; ".join(named[:6]) + more if named else "no policy field"


def fix_hint(data: dict) -> str:
    """Where the behaviour profiles say the fix belongs (``profiles.PROFILES``): the profile of
    the newest affected release against the clean release after it (the fix) or before it (the
    regression), and the profiles under which simsched's model predicts the finding."""
    from simsched.profiles import profile_for_release
    from simsched.vllm.releases import release_of
    affected, clean = data["releases_affected"], data["releases_clean"]
    lines = []
    if affected:
        after = [v for v in clean if tri._vkey(v) > tri._vkey(affected[-1])]
        before = [v for v in clean if tri._vkey(v) < tri._vkey(affected[0])]
        shown = affected[-1] if after or not before else affected[0]
        bad = profile_for_release(release_of(shown))
        lines.append(f"- vLLM {shown} behaves as profile `{bad.name}`: {bad.summary}.")
        ref = after[:1] or before[-1:]
        if ref:
            good = profile_for_release(release_of(ref[0]))
            what = "fixed" if after else "clean"
            lines.append(f"- vLLM {ref[0]} ({what}) behaves as `{good.name}`"
                         + (": the same profile, so the fix is outside what the profiles name"
                            if good.name == bad.name else
                            f"; they differ in {_differ(bad, good)}") + ".")
    predicted = data.get("profiles_affected") or []
    lines.append("- simsched's model predicts it under "
                 + (", ".join(f"`{p}`" for p in predicted) if predicted else
                    "no profile (the model does not show it: a real-run oracle, or a rule "
                    "the profiles do not name yet)") + ".")
    return "\n".join(lines)


def issue_md(case: Case, data: dict, folder: Path) -> str:
    """The text of ``ISSUE.md`` for finding ``data`` on ``case``, with the vLLM-only test and
    its verdict when ``folder`` holds them."""
    want, got = expected_actual(data)
    out = [f"# {vllm_repro.title(data)}", "",
           "### Your current environment", "",
           f"vLLM with the native CPU KV offloading connector, on CUDA. {environment(data)}",
           "", "### How to reach it", "",
           f"A deployment of {family(case.layout)}, KV cache groups `{data['layout']}`:", "",
           "```bash", "vllm serve MODEL \\", "  " + " \\\n  ".join(serve_flags(case)), "```",
           "", "Steps:", "", *steps(case), "",
           "*The layout:* the test's `KVCacheConfig` is built by hand from these group specs, "
           "not by a model's KV cache planner; check that a model of this family builds it.",
           "", "### Expected", "", want, "", "### Actual", "", got, ""]
    where = code_location(data)
    if where:
        out += ["### Where", "", where, ""]
    tests = sorted(folder.glob("test_vllm_*.py"))
    if tests:
        verdict = folder / "vllm_repro.json"
        state = "not verified yet (`simsched repro case.json` verifies it)"
        if verdict.exists():
            v = json.loads(verdict.read_text())
            runs = ", ".join(f"{r} {res}" for r, res in v["results"].items())
            state = (f"verified from an empty folder: {runs}" if v["verified"]
                     else f"**unverified**: {v['reason']}")
        minus_o = "" if data["asserts"] else " -O"
        out += ["### Test (vLLM alone)", "",
                f"`python{minus_o} -m pytest {tests[0].name}` (drop it in "
                f"`tests/v1/kv_connector/unit/`); {state}.", "",
                "<details><summary>" + tests[0].name + "</summary>", "", "```python",
                tests[0].read_text().rstrip(), "```", "", "</details>", ""]
    out += ["### Where the fix belongs", "", fix_hint(data), "",
            f"Found by simsched (finding `{data['id']}`, cluster `{data.get('cluster')}`).", ""]
    return "\n".join(out)
