"""A finding as a pytest file that needs vLLM alone: ``repros/<id>/test_vllm_<name>.py``.

The file builds what the engine builds at start-up (a ``VllmConfig`` over a tiny Llama
``config.json``, the ``KVCacheConfig`` of the case's groups, the ``Scheduler`` with the
``OffloadingConnector`` and its real CPU offloading manager) the way the release harness does
(``simsched/vllm/inside/build.py``, ``engine.RealEngine.boot``), written out plainly, and a
worker stand-in that plays the case's steps (``run.Run._go``): sampled tokens, and each store
and load job reported done ``store_latency`` / ``load_latency`` steps after it was scheduled.

What it checks, by the finding's kind:

* a crash (at start-up or at a step): nothing; vLLM's exception propagates and fails the test;
* INV-3 (``store``, a key paired with another chunk): each key of a store job ends where the
  chunk it keys ends (its place in its group's offload keys, at the release's blocks per
  chunk; ``invariants.check_store_job``);
* INV-6 (``write``, by a request's forward): no block a store job still reads (created at an
  earlier step, neither flushed nor done) among the blocks a step writes: a request's blocks
  holding the tokens it computes, a ring group's first block (``shadow.write_computed``);
* INV-8 on ``load`` (a request loaded again and again and never scheduled): inline, the loads
  of a request between two steps that schedule it, bounded as the harness bounds them;
* INV-8 ``liveness``: no token scheduled for more than ``STALL_STEPS`` steps while no transfer
  is in flight and no request is still to come (``liveness.Liveness.check``);
* INV-9 (``lookup``): every answer of the connector's ``get_num_new_matched_tokens`` against the
  chunks the CPU manager holds ready (its own ``lookup``), the window each group needs, the last
  token and ``max_load_tokens`` where the release reads it (``invariants.expected_lookup_hit``,
  with every group's reach taken as full attention's but a sliding window's: it expects no more
  than the harness does);
* INV-10 (``cap``): a store job's keys end within the request's ``max_offload_tokens``, a load
  job's keys span at most its ``max_load_tokens``, as the release parsed them.

Every file also fails when a request is unfinished at the step cap. A case run with asserts
stripped is run under ``python -O`` (the file refuses to run otherwise): what breaks where the
assert is gone is the bug (an offloaded ring group's ``islice`` in ``update_offload_keys``).
This module writes the file: which findings it can write (:func:`supported`), its name and title,
and the values it fills in; the file's fixed text is :mod:`fuzz.vllm_repro_template`, each
invariant's inline check :mod:`fuzz.vllm_repro_checks`, and its verification on the installed
releases (it must fail on each affected release and pass on each clean one)
:mod:`fuzz.vllm_repro_verify`.
"""

from __future__ import annotations

import re
import textwrap

from fuzz.triage import START_UP_STAGES
from fuzz.vllm_repro_checks import CHECKS, MAX_LOADS_UNSCHEDULED
from fuzz.vllm_repro_template import (ACCEPT_ALL, ACCEPT_PATTERN, SAMPLED, SPEC_HELPERS,
                                      TEMPLATE)
from simsched.case import VOCAB, Case
from simsched.geometry import max_model_len
from simsched.layout import RetentionUnset
from simsched.model import STALL_STEPS

# What the harness bounds (engine.DEFAULT_STEP_CAP).
STEP_CAP = 20_000

# kind -> (vLLM spec class, its extra constructor fields from the group)
SPECS = {
    "full": ("FullAttentionSpec", ()), "mla": ("MLAAttentionSpec", ()),
    "sliding_window": ("SlidingWindowSpec", ("sliding_window",)),
    "sliding_window_mla": ("SlidingWindowMLASpec", ("sliding_window",)),
    "chunked_local": ("ChunkedLocalAttentionSpec", ("attention_chunk_size",)),
    "mamba": ("MambaSpec", ()), "ring": ("CircularBufferSpec", ()),
    "cross_attention": ("CrossAttentionSpec", ()),
}


class NotGenerated(Exception):
    """The finding or its case is of a kind the generator does not write yet; says which."""


#: the invariant findings the generator writes, (invariant, op) -> the test's short name
INVARIANT_KINDS = {("INV-3", "store"): "store_key_names_other_chunk",
                   ("INV-6", "write"): "store_source_rewritten",
                   ("INV-8", "load"): "livelock_load", ("INV-8", "liveness"): "stall",
                   ("INV-9", "lookup"): "lookup_misses_ready_prefix", ("INV-10", "cap"): "cap"}


def supported(case: Case, data: dict) -> None:
    """Raise :class:`NotGenerated` unless the generator can write this finding."""
    eng = case.layout.engine
    why = [(f"engine.connector={eng.connector.describe()} (the file drives the "
            "OffloadingConnector alone)", eng.connector.kind != "offloading"),
           ("engine.secondary_tiers (the file drives the CPU tier alone)",
            bool(eng.secondary_tiers)),
           ("async scheduling", eng.async_scheduling),
           ("a drafter group", any(g.drafter for g in case.layout.groups)),
           ("no request", not case.requests),
           ("per-job transfer timings (timing.jobs)", bool(case.timing.jobs)),
           ("failed transfers (faults)", bool(case.faults))]
    if data.get("invariant") == "INV-3":  # a chunk's tokens: block size x blocks per chunk
        why += [("a Mamba group or DCP (another chunk size)",
                 eng.dcp_size != 1 or any(g.kind == "mamba" for g in case.layout.groups)),
                ("a key without source blocks", "paired with chunk" not in
                 (data.get("message") or ""))]
    if data.get("invariant") == "INV-6":  # the blocks a step writes, as the shadow counts them
        why += [("a Mamba group (its state copies, partial tails)",
                 any(g.kind == "mamba" for g in case.layout.groups)),
                ("a block a load writes (not a request's forward)",
                 " by request " not in (data.get("message") or ""))]
    if data.get("invariant") == "INV-9":   # the chunk arithmetic of the inline lookup oracle
        # (and every group offloaded by every release: no group bounds the load from the GPU)
        why += [("DCP", eng.dcp_size != 1),
                ("a ring or cross-attention group",
                 any(g.kind in ("ring", "cross_attention") for g in case.layout.groups))]
    for reason, holds in why:
        if holds:
            raise NotGenerated(f"not generated yet for a case with {reason}")
    if data["kind"] == "crash":
        return
    if data["kind"] == "invariant" and (data.get("invariant"), data.get("op")) \
            in INVARIANT_KINDS:
        return
    raise NotGenerated(f"not generated yet for a {data['kind']} finding "
                       f"({data.get('invariant') or data.get('signature')}"
                       f"{' on ' + data['op'] if data.get('op') else ''})")


def short_name(data: dict) -> str:
    """``boot_assert_build_offloading_config`` (a start-up stage raised), ``step_crash_...``,
    or the invariant's (``livelock_load``, ``lookup_misses_ready_prefix``, ``cap_store``)."""
    if data["kind"] == "invariant":
        name = INVARIANT_KINDS[(data.get("invariant"), data.get("op"))]
        if name == "cap":   # the detail names the job: "store 0 g0:2 ...", "load 3 ..."
            name += "_" + ("load" if (data.get("message") or "").startswith("load") else "store")
        return name
    exc = {"AssertionError": "assert"}.get(data.get("exception") or "", "crash")
    where = "boot" if data.get("stage") in START_UP_STAGES else "step"
    name = re.sub(r"[^a-z0-9]+", "_", (data.get("function") or "").lower()).strip("_")
    return f"{where}_{exc}_{name}"[:60].rstrip("_")


# --- the file ------------------------------------------------------------------------------

def _spec(group, num_speculative_blocks: int = 0) -> str:
    cls, extra = SPECS[group.kind]
    args = [f"block_size={group.block_size}"] + [f"{f}={getattr(group, f)}" for f in extra]
    if group.kind == "mamba":
        args.append("shapes=((4, 8),), dtypes=(torch.float16,)")
        if group.mamba_cache_mode != "none":
            args.append(f"mamba_cache_mode={group.mamba_cache_mode!r}")
        if num_speculative_blocks:      # as build.ConfigBuilder.make_spec
            args.append(f"num_speculative_blocks={num_speculative_blocks}")
    else:
        args.append("**ATTN")
    return f"kvi.{cls}({', '.join(args)})"


def _cache_fields(case: Case) -> dict:
    """CacheConfig's fields as ``ConfigBuilder.build`` sets them: the block size of the first
    attention group (else the first group), prefix caching, Mamba's align mode."""
    groups = case.layout.groups
    attn = [g for g in groups if g.kind != "mamba"]
    fields = {"block_size": (attn[0] if attn else groups[0]).block_size,
              "enable_prefix_caching": case.layout.engine.enable_prefix_caching}
    if any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in groups):
        fields["mamba_cache_mode"] = "align"
    return fields


def _extra_config(case: Case) -> tuple[dict, int]:
    """kv_connector_extra_config besides cpu_bytes_to_use, and the GPU blocks per chunk."""
    eng = case.layout.engine
    extra: dict = {}
    bpc = 1
    if eng.blocks_per_chunk is not None:
        extra["blocks_per_chunk"] = bpc = eng.blocks_per_chunk
    if eng.offload_block_size is not None:
        extra["block_size"] = eng.offload_block_size
        if eng.blocks_per_chunk is None:
            bpc = max(1, eng.offload_block_size // case.layout.groups[0].block_size)
    if not eng.offload_prompt_only:
        extra["offload_prompt_only"] = False
    if eng.eviction_policy != "lru":
        extra["eviction_policy"] = eng.eviction_policy
    return extra, bpc


def _engine_lines(case: Case) -> list[str]:
    """Engine knobs off their defaults, set after VllmConfig's own checks as the harness does."""
    eng = case.layout.engine
    lines = []
    if eng.prefix_match_unit is not None:   # hash_block_size before 0.26.0
        lines += ["    unit = 'prefix_match_unit'  # hash_block_size before 0.26.0",
                  "    setattr(vc.cache_config, unit if hasattr(vc.cache_config, unit) else "
                  f"'hash_block_size', {eng.prefix_match_unit})"]
    if not isinstance(eng.retention_interval, RetentionUnset):
        lines.append(f"    vc.cache_config.prefix_cache_retention_interval = "
                     f"{eng.retention_interval}")
    if eng.dcp_size != 1:
        lines.append(f"    vc.parallel_config.decode_context_parallel_size = {eng.dcp_size}")
    if eng.speculative is not None:
        lines += [  # build.ConfigBuilder.speculative
            "    # a SpeculativeConfig without the draft model __post_init__ loads, fields at "
            "default",
            "    vc.speculative_config = spec = object.__new__(SpeculativeConfig)",
            "    spec.__dict__.update({f.name: None if f.default is dataclasses.MISSING else "
            "f.default",
            "                          for f in dataclasses.fields(SpeculativeConfig)},",
            f"                         method={eng.speculative.method!r}, "
            "num_speculative_tokens=NUM_SPEC_TOKENS)"]
    return lines


def _requests(case: Case) -> str:
    rows = []
    for r in case.requests:
        params = {k: v for k, v in (("max_load_tokens", r.max_load_tokens),
                                    ("max_offload_tokens", r.max_offload_tokens))
                  if v is not None}
        sampling = {"skip_reading_prefix_cache": True} if r.skip_reading_prefix_cache else {}
        segments = [tuple(s) for s in r.prompt]
        rows.append(f"({r.id!r}, {segments!r}, {r.arrival}, {r.decode}, {r.abort_at!r}, "
                    f"{params!r}, {sampling!r})")
    return ",\n            ".join(rows)


#: an invariant in plain words, for a title: (invariant, first bad op) or the invariant alone
PLAIN = {
    ("INV-8", "load"): "a request loaded from the CPU tier again and again is never scheduled",
    ("INV-8", "lookup"): "the lookup of a request defers forever while its prefix is ready",
    ("INV-8", None): "requests make no progress while no transfer is in flight",
    ("INV-9", None): "a prefix ready in the CPU tier is not hit by the lookup",
    ("INV-10", "store"): "a store ignores the request's max_offload_tokens",
    ("INV-10", "load"): "a load ignores the request's max_load_tokens",
    ("INV-10", None): "a transfer ignores the request's max_offload_tokens / max_load_tokens",
    ("INV-3", None): "a store job pairs offload keys and GPU blocks out of step",
    ("INV-4", None): "a chunk is stored under a key that names other tokens",
    ("INV-5", None): "a load brings back the KV of other tokens",
    ("INV-6", None): "a block is rewritten while a pending store still reads it",
    ("INV-7", None): "a chunk is loaded before its store completed",
}


def plain(data: dict) -> str:
    """The finding in a few plain words: the exception and function, or the invariant."""
    if data["kind"] == "crash":
        return f"{data['exception']} in {data['function']}"
    inv, op = data.get("invariant"), data.get("op")
    if inv == "INV-10":   # op "cap": the detail names the job ("store 3 g0:2 ...", "load 5 ...")
        op = (data.get("message") or "").split(" ")[0] or None
    return PLAIN.get((inv, op), PLAIN.get((inv, None), f"{inv} broken"))


def title(data: dict) -> str:
    """An upstream issue's title, in vLLM's style."""
    what = plain(data)
    head = f"[Bug][KV offloading]: {what}"
    full = f"{head} on {data['layout']}"
    return full if len(full) <= 96 else head


def _about(data: dict) -> str:
    """The docstring's body: what runs, what the test shows, where, how to run it."""
    if data["kind"] == "crash":
        where = f" (vllm/{data['file']})" if data.get("file") else ""
        msg = (data.get("message") or "").strip().rstrip(".")
        msg = msg if len(msg) <= 90 else msg[:89] + "..."   # whole in the test's failure
        what = (f"The test fails with the {data['exception']} vLLM raises in "
                f"{data['function']}{where}" + (f": {msg}" if msg else "") + ".")
    else:
        what = plain(data)
        what = f"{what[0].upper()}{what[1:]} ({data['invariant']}): " + {
            "livelock_load": f"the test fails when a request is loaded more than "
                             f"{MAX_LOADS_UNSCHEDULED} times between two steps that schedule it.",
            "stall": f"the test fails after {STALL_STEPS} steps that schedule nothing while no "
                     f"transfer is in flight.",
            "lookup_misses_ready_prefix": "the test checks every lookup against the chunks "
                                          "the CPU tier holds ready.",
            "cap_store": "the test checks every store job's keys against the cap.",
            "cap_load": "the test checks every load job's keys against the cap.",
            "store_source_rewritten": "the test fails when a step's forward writes a block "
                                      "that a store job still reads.",
            "store_key_names_other_chunk": "the test checks each store job's keys against "
                                           "the chunks they key.",
        }[short_name(data)]
    mode = "" if data["asserts"] else "With Python's asserts stripped (python -O). "
    text = (f"{mode}{what} Present in vLLM {release_ranges(data['releases_affected'])}; "
            + (f"absent from {release_ranges(data['releases_clean'])}" if data["releases_clean"]
               else "no release run is clean of it")
            + f" (simsched finding {data['id']}).")
    example = (data["releases_affected"] or ["0.33.0"])[-1]
    run = (f"Run: ``$(simsched releases env {example}){'' if data['asserts'] else ' -O'} -m "
           f"pytest FILE``, or in vLLM's tests/v1/kv_connector/.")
    return textwrap.fill(text, 96, break_on_hyphens=False, break_long_words=False) + "\n" + run


def release_ranges(versions: list[str], order: list[str] | None = None) -> str:
    """``0.28.0 to 0.31.0 and 0.33.0``: the releases as runs over ``order`` (default every
    release simsched knows, so that one not run breaks a range)."""
    from fuzz.triage import _vkey, ranges
    from simsched.vllm.releases import KNOWN_RELEASES
    order = order or sorted(set(versions) | set(KNOWN_RELEASES), key=_vkey)
    runs = [a if a == b else f"{a} to {b}" for a, b in ranges(versions, order)]
    return " and ".join(runs) or "no installed release"



def render(case: Case, data: dict) -> str:
    """The text of ``test_vllm_<short name>.py`` for ``case`` showing finding ``data``."""
    supported(case, data)
    extra, bpc = _extra_config(case)
    eng, timing = case.layout.engine, case.timing
    groups = ",\n          ".join(_wrap(f"({_spec(g, case.layout.num_speculative_blocks)}, "
                                         f"{g.layers})", 10)
                                   for g in case.layout.groups)
    cache = _wrap(", ".join(f"{k}={v!r}" for k, v in _cache_fields(case).items()), 33)
    return TEMPLATE.format(
        title=title(data), about=_about(data), groups=groups,
        num_gpu_blocks=eng.num_gpu_blocks, cpu_chunks=eng.cpu_chunks, bpc=bpc, extra=extra,
        cache=cache,
        batched=timing.max_num_batched_tokens, seqs=timing.max_num_seqs,
        store=timing.store_latency, load=timing.load_latency, requests=_requests(case),
        max_model_len=max_model_len(case), seed=case.seed % VOCAB,
        step_cap=STEP_CAP, **_optional(case, data),
        engine_lines="".join(line + "\n" for line in _engine_lines(case)),
        name=short_name(data))


def _wrap(text: str, indent: int, width: int = 96) -> str:
    """A constructor call of the file broken before its Mamba cache mode when too wide."""
    if indent + len(text) <= width or ", mamba_cache_mode=" not in text:
        return text
    head, tail = text.split(", mamba_cache_mode=", 1)
    at = indent + (head.index("(", 1) + 1 if head.startswith("(") else 0)
    return f"{head},\n{' ' * at}mamba_cache_mode={tail}"


def _optional(case: Case, data: dict) -> dict:
    """The parts of the test only some cases need: aborts (a request aborted before its
    arrival is never sent, ``RequestSpec.withdrawn``) and INV-8's check on loads
    (``liveness.Liveness.check_reloads``)."""
    aborts = any(r.abort_at is not None for r in case.requests)
    parts = {"skip": " and rid not in withdrawn" if aborts else "",
             "request_imports": "Request, RequestStatus" if aborts else "Request",
             "before_loop": "", "abort_lines": "", "event_lines": "", "pytest_import": "",
             "debug_guard": "",
             "offload_import": "", "helpers": "", "after_schedule": "", "job_check": "",
             "after_update": "",
             "config_imports": "", "dataclasses_import": "", "outputs_imports": "",
             "spec_constants": "", "spec_names": "", "spec_values": "", "drafter": "",
             "sampled": SAMPLED}
    if aborts:
        parts["before_loop"] = ("    withdrawn = {r[0] for r in REQUESTS "
                                "if r[4] is not None and r[4] < r[2]}\n")
        parts["abort_lines"] = (
            "            if abort_at is not None and abort_at <= t and rid in sched.requests:\n"
            "                sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)\n")
    if case.events:   # Case.events: reset_prefix_cache calls while requests are unfinished
        times = sorted({e.step for e in case.events})
        parts["event_lines"] = (
            f"        if t in {set(times)!r} and (sched.has_requests() or any(r[2] > t for r in "
            "REQUESTS)):\n            sched.reset_prefix_cache()  # an operator's call\n")
    if not case.asserts:   # the layout's bug is what breaks where python -O strips an assert
        parts["pytest_import"] = "import pytest\n"
        parts["debug_guard"] = ("    if __debug__:\n        pytest.fail(\"vLLM's asserts refuse "
                                "this layout before the bug: run with python -O\")\n")
    if case.layout.engine.speculative is not None:
        parts.update(_speculative(case, parts))
    if data["kind"] == "invariant":
        parts.update(CHECKS[short_name(data)](parts, case))
    return parts


def _speculative(case: Case, parts: dict) -> dict:
    """Speculative decoding, sync scheduling (``model_runner.ModelRunner.propose_drafts`` and its
    verification): after each step the drafter proposes the tokens that follow each request's
    known ones; the worker accepts as many as the case's ``accept`` pattern says (else all)."""
    accept = {r.id: list(r.accept) for r in case.requests if r.accept is not None}
    constants = ""
    if accept:
        constants = (f"ACCEPT = {accept!r}  # drafts accepted per verification step (else "
                      "all)\nVERIFIED = {}  # request -> its verification steps so far\n")
    helpers = SPEC_HELPERS.format(accepted=ACCEPT_PATTERN if accept else ACCEPT_ALL)
    return {"config_imports": "from vllm.config import SpeculativeConfig\n",
            "dataclasses_import": "import dataclasses\n", "outputs_imports": "DraftTokenIds, ",
            "spec_constants": constants, "spec_names": ", NUM_SPEC_TOKENS",
            "spec_values": f", {case.layout.engine.speculative.num_tokens}",
            "helpers": helpers + parts["helpers"],
            "sampled": ("    sampled = [[token(r, r.num_tokens + j) for j in range(accepted(out, r)"
                        " + 1)]\n               if r.num_computed_tokens >= r.num_tokens else []"
                        " for r in reqs]\n"),
            "drafter": "        propose_drafts(sched, out, output.req_ids)\n"}
