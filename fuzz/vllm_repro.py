"""A finding as a pytest file that needs vLLM alone: ``repros/<id>/test_vllm_<name>.py``.

The file builds what the engine builds at start-up (a ``VllmConfig`` over a tiny Llama
``config.json``, the ``KVCacheConfig`` of the case's groups, the ``Scheduler`` with the
``OffloadingConnector`` and its real CPU offloading manager) the way the release harness does
(``simsched/vllm/inside/build.py``, ``engine.RealEngine.boot``), written out plainly, and a
worker stand-in that plays the case's steps (``engine._Run._go``): sampled tokens, and each store
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
  is in flight and no request is still to come (``engine._Run._stall``);
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
:func:`verify` runs the file with each installed release's plain environment (``simsched releases
env``) from an empty folder: it must fail on each affected release and pass on each clean one.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fuzz.triage import START_UP_STAGES
from simsched.case import VOCAB, Case
from simsched.geometry import max_model_len
from simsched.layout import RetentionUnset
from simsched.model import STALL_STEPS

# What the harness bounds (engine.MAX_LOADS_UNSCHEDULED, engine.DEFAULT_STEP_CAP).
MAX_LOADS_UNSCHEDULED = 2
STEP_CAP = 20_000
VERIFY_TIMEOUT_S = 300

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
    why = [("async scheduling", eng.async_scheduling),
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
    (``engine._Run._check_reloads``)."""
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
        parts.update(_CHECKS[short_name(data)](parts, case))
    return parts


def _speculative(case: Case, parts: dict) -> dict:
    """Speculative decoding, sync scheduling (``engine._Run._propose_drafts`` and its
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


def _check_reloads(parts: dict) -> dict:
    """INV-8 on loads (``engine._Run._check_reloads``): a request loaded again and again
    between two steps that schedule it."""
    return {"before_loop": parts["before_loop"]
            + "    loads_unscheduled = {}  # request -> its loads since it ran\n",
            "after_update": (
                "        for rid in output.req_ids:\n"
                "            loads_unscheduled.pop(rid, None)\n"
                "        for _, rid in done.values():\n"
                "            if rid is not None:\n"
                "                n = loads_unscheduled[rid] = loads_unscheduled.get(rid, 0) + 1\n"
                f"                if n > {MAX_LOADS_UNSCHEDULED}:\n"
                "                    raise AssertionError(f\"{rid} loaded {n} times, never "
                "scheduled\")\n")}


def _check_stall(parts: dict) -> dict:
    """INV-8 liveness (``engine._Run._stall``): no token scheduled for more than
    ``STALL_STEPS`` steps while no transfer is in flight and no request is still to come."""
    return {"before_loop": parts["before_loop"]
            + "    idle = 0  # steps scheduling nothing, no transfer in flight, none to come\n",
            "after_schedule": (
                "        to_come = [r for r in REQUESTS if r[2] > t"
                + (" and r[0] not in withdrawn" if parts["skip"] else "") + "]\n"
                "        busy = out.total_num_scheduled_tokens or pending or to_come\n"
                "        idle = 0 if busy else idle + 1\n"
                f"        assert idle <= {STALL_STEPS}, f\"{{list(sched.requests)}}: nothing "
                "scheduled, no transfer for {idle} steps\"\n")}


def _check_lookups(parts: dict) -> dict:
    """INV-9 (``engine._Run._check_lookup``, ``invariants.expected_lookup_hit``): every
    lookup finds at least what the CPU tier holds ready."""
    return {"offload_import": "from vllm.v1.kv_offload.base import make_offload_key\n",
            "helpers": LOOKUP_HELPERS,
            "before_loop": "    watch_lookups(sched, hash_block_size)\n" + parts["before_loop"]}


def _check_caps(parts: dict, load: bool) -> dict:
    """INV-10 (``engine._Run._check_caps``, ``invariants.check_store_cap``/``check_load_cap``):
    a store job's keys end within its request's ``max_offload_tokens``; a load job's keys span
    at most its ``max_load_tokens`` (the caps as the release parses ``kv_transfer_params``).
    The key of block hash i names the prompt's tokens [0, (i + 1) * hash_block_size)."""
    cap = "max_load_tokens" if load else "max_offload_tokens"
    span = "span" if load else "ends[-1]"
    check = (f"\n            cap = getattr(cs._req_status[job.req_id], {cap!r}, None)  # INV-10\n"
             "            index = {h: i for i, h in "
             "enumerate(sched.requests[job.req_id].block_hashes)}\n"
             "            ends = sorted((index[get_offload_block_hash(k)] + 1) * hash_block_size"
             "\n                          for k in cs._jobs[j].keys)\n"
             + ("            span = ends[-1] - ends[0] + min(s.block_size for s, _ in GROUPS)"
                " * BLOCKS_PER_CHUNK\n" if load else "")
             + f"            assert cap is None or {span} <= cap, f\"keys to {{ends}}, {cap} "
             "{cap}\"")
    parts = {"offload_import": "from vllm.v1.kv_offload.base import get_offload_block_hash\n",
             "before_loop": parts["before_loop"]
             + "    cs = sched.connector.connector_scheduler  # its jobs' keys, the caps parsed\n"}
    jobs = "loads" if load else "stores"
    return {**parts, "job_check": f"        for j, job in {jobs}.items():{check}\n"}


def _check_pairs(parts: dict) -> dict:
    """INV-3 (``invariants.check_store_job``): each key of a store job, the block hash of the
    prompt's tokens [0, (i + 1) * hash_block_size), names the end of the chunk it keys: its
    place c in its group's offload keys (``RequestOffloadState``), (c + 1) * block size * blocks
    per chunk tokens (the blocks per chunk as the release's config reads them, as the harness
    takes them)."""
    return {"offload_import": "from vllm.v1.kv_offload.base import get_offload_block_hash, "
                              "get_offload_group_idx\n",
            "before_loop": parts["before_loop"]
            + "    cs = sched.connector.connector_scheduler  # its jobs' keys, the requests' keys\n"
            "    bpc = getattr(cs.config, \"blocks_per_chunk\", None) or "
            "cs.config.block_size_factor  # (to 0.26)\n",
            "job_check": parts["job_check"] + (
                "        for j, job in stores.items():  # INV-3: a key ends where its chunk ends\n"
                "            state = cs._req_status[job.req_id]\n"
                "            index = {h: i for i, h in "
                "enumerate(sched.requests[job.req_id].block_hashes)}\n"
                "            for k in cs._jobs[j].keys:\n"
                "                g = get_offload_group_idx(k)\n"
                "                c = next(gs.offload_keys.index(k) for gs in state.group_states\n"
                "                         if k in gs.offload_keys)\n"
                "                end = (index[get_offload_block_hash(k)] + 1) * hash_block_size\n"
                "                want = (c + 1) * GROUPS[g][0].block_size * bpc  # as the release "
                "reads it\n"
                "                assert end == want, f\"g{g}: the key of tokens to {end} keys "
                "chunk {c} (to {want})\"\n")}


def _check_writes(parts: dict, case: Case) -> dict:
    """INV-6 (``engine._Run._schedule_execute``, ``shadow.write_computed``): no block a store
    job still reads (created at an earlier step, neither flushed nor reported done) is written
    by a step's forward: a request's blocks holding the tokens it computes, a ring group's
    first block at every step."""
    rings = {i for i, g in enumerate(case.layout.groups) if g.kind == "ring"}
    return {"helpers": parts["helpers"] + WRITES_HELPER.format(rings=rings or "set()"),
            "before_loop": parts["before_loop"]
            + "    reads = {}  # store job -> the GPU blocks it reads until done (a flushed one: "
            "first)\n",
            "job_check": parts["job_check"] + (
                "        hit = written_blocks(sched, out) & {b for j in reads if pending[j][0] > t"
                " for b in reads[j]}\n"
                "        assert not hit, f\"blocks {sorted(hit)} written while a store still "
                "reads them\"\n"
                "        reads.update({j: [int(b) for b in job.src_spec.block_ids] for j, job in "
                "stores.items()})\n"),
            "after_update": parts["after_update"]
            + "        for j in done:\n            reads.pop(j, None)\n"}


WRITES_HELPER = '''
RINGS = {rings}  # the ring groups: a circular buffer in its first block


def written_blocks(sched, out):
    """The GPU blocks a step's forward writes: each request's blocks holding the tokens it
    computes (schedule() has counted them), and a ring group's first block at every step."""
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    written = set()
    for rid, n in out.num_scheduled_tokens.items():
        end = sched.requests[rid].num_computed_tokens
        for g, ((spec, _), m) in enumerate(zip(GROUPS, managers)):
            table, bs = m.req_to_blocks.get(rid, []), spec.block_size
            span = table[:1] if g in RINGS else table[(end - n) // bs:-(-end // bs)]
            written |= {{b.block_id for b in span if not b.is_null}}
    return written
'''


#: the words each inline check fails with (a failure without them is another failure)
MARKS = {"store_key_names_other_chunk": "keys chunk", "store_source_rewritten": "still reads",
         "livelock_load": "never scheduled", "stall": "nothing scheduled, no transfer",
         "lookup_misses_ready_prefix": "the lookup found", "cap_store": "max_offload_tokens",
         "cap_load": "max_load_tokens"}
_CHECKS = {"livelock_load": lambda parts, case: _check_reloads(parts),
           "stall": lambda parts, case: _check_stall(parts),
           "lookup_misses_ready_prefix": lambda parts, case: _check_lookups(parts),
           "cap_store": lambda parts, case: _check_caps(parts, False),
           "cap_load": lambda parts, case: _check_caps(parts, True),
           "store_source_rewritten": _check_writes,
           "store_key_names_other_chunk": lambda parts, case: _check_pairs(parts)}


SAMPLED = ("    sampled = [[(SEED * 1000003 + int(r.arrival_time) * 7919 + r.num_tokens * 104729"
           " + 3) % 32000]\n               if r.num_computed_tokens >= r.num_tokens else [] "
           "for r in reqs]\n")

SPEC_HELPERS = '''

def token(r, pos):
    return (SEED * 1000003 + int(r.arrival_time) * 7919 + pos * 104729 + 3) % 32000
{accepted}

def propose_drafts(sched, out, order):
    """The drafter after a step (EngineCore.post_step): the tokens after each request's own."""
    k = 0 if getattr(out, "skip_drafts", False) else out.num_spec_tokens_to_schedule
    reqs = [sched.requests.get(rid) for rid in order]
    drafts = [[token(r, r.num_tokens + j) for j in range(k)] if r else [] for r in reqs]
    sched.update_draft_token_ids(DraftTokenIds(list(order), drafts))
'''

#: the drafts the worker accepts at a verification step: every one (no request has a pattern)
ACCEPT_ALL = '''

def accepted(out, r):
    """The drafts the worker accepts at r's verification step: all (of padding, -1: none)."""
    drafts = out.scheduled_spec_decode_tokens.get(r.request_id, [])
    return len(drafts) if any(x != -1 for x in drafts) else 0
'''

#: ... or as each request's pattern says, in turn, where it has one
ACCEPT_PATTERN = '''

def accepted(out, r):
    """The drafts the worker accepts at r's verification step: as ACCEPT says in turn, else
    all (of padding, -1: none)."""
    drafts = out.scheduled_spec_decode_tokens.get(r.request_id, [])
    if not any(x != -1 for x in drafts):
        return 0
    k = VERIFIED[r.request_id] = VERIFIED.get(r.request_id, -1) + 1
    pattern = ACCEPT.get(r.request_id)
    return len(drafts) if pattern is None else min(len(drafts), pattern[k % len(pattern)])
'''

LOOKUP_HELPERS = '''

def ready_beyond(sched, request, num_local, hash_block_size):
    """INV-9: the tokens past the GPU hit a lookup must find: up to the largest chunk end e at
    which every group holds ready (stored: the CPU manager's lookup is HIT) the chunks e needs
    (a sliding window W: those of [e - W + 1, e)), short of the last token (recomputed to
    sample) and within max_load_tokens where the release reads it."""
    cs = sched.connector.connector_scheduler
    state = cs._req_status[request.request_id]
    cap = request.num_tokens - 1
    if getattr(state, "max_load_tokens", None) is not None:
        cap = min(cap, num_local + state.max_load_tokens)

    def ready(g, spec, end):
        per_chunk, window = spec.block_size * BLOCKS_PER_CHUNK, getattr(spec, "sliding_window", 0)
        first = max(num_local, min(end - window + 1, end - 1)) if window else num_local
        hashes = [(c + 1) * per_chunk // hash_block_size - 1
                  for c in range(first // per_chunk, -(-end // per_chunk))]
        return all(h < len(request.block_hashes) and cs.manager.lookup(make_offload_key(
            request.block_hashes[h], g), state.req_context).name == "HIT" for h in hashes)
    unit = max(spec.block_size for spec, _ in GROUPS) * BLOCKS_PER_CHUNK
    ends = range(cap // unit * unit, num_local + unit - 1, -unit)
    return next((e - num_local for e in ends
                 if all(ready(g, spec, e) for g, (spec, _) in enumerate(GROUPS))), 0)


def watch_lookups(sched, hash_block_size):
    """Every lookup the connector answers, checked (a deferral, None, is not a miss)."""
    cs = sched.connector.connector_scheduler
    lookup = cs.get_num_new_matched_tokens

    def checked(request, num_computed_tokens, *args, **kwargs):
        out = lookup(request, num_computed_tokens, *args, **kwargs)
        got = out[0] if isinstance(out, tuple) else out
        want = ready_beyond(sched, request, num_computed_tokens, hash_block_size)
        assert got is None or got >= want, (
            f"{request.request_id}: the CPU tier holds {want} tokens ready beyond the GPU hit "
            f"of {num_computed_tokens}; the lookup found {got}")
        return out
    cs.get_num_new_matched_tokens = checked
'''

TEMPLATE = '''"""{title}

{about}
"""
{dataclasses_import}import json

{pytest_import}import torch

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
{config_imports}from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.sched.scheduler import Scheduler
{offload_import}from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import {outputs_imports}KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import {request_imports}
from vllm.v1.structured_output import StructuredOutputManager

TINY_LLAMA = {{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 1 << 20}}
ATTN = dict(num_kv_heads=1, head_size=16, dtype=torch.float16)
# The KV cache groups in KVCacheConfig order: (spec, number of layers).
GROUPS = [{groups}]
NUM_GPU_BLOCKS, CPU_CHUNKS, BLOCKS_PER_CHUNK = {num_gpu_blocks}, {cpu_chunks}, {bpc}
EXTRA_CONFIG = {extra!r}  # kv_connector_extra_config besides cpu_bytes_to_use
MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, MAX_MODEL_LEN = {batched}, {seqs}, {max_model_len}
STORE_LATENCY, LOAD_LATENCY = {store}, {load}  # steps until the worker reports a job done
# (id, segments (seed, length), arrival, max_tokens, abort step, kv_transfer_params, SamplingParams)
REQUESTS = [{requests}]
SEED, STEP_CAP{spec_names} = {seed}, {step_cap}{spec_values}
{spec_constants}

def make_scheduler(model_dir):
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    layers = [f"model.layers.{{i}}.attn" for i in range(sum(n for _, n in GROUPS))]
    names = iter(layers)
    groups = [kvi.KVCacheGroupSpec([next(names) for _ in range(n)], spec) for spec, n in GROUPS]
    page = sum(spec.page_size_bytes * n for spec, n in GROUPS)
    shared = ({{"shared_by": layers}} if "shared_by" in kvi.KVCacheTensor.__dataclass_fields__
              else {{"layers": layers, "layer_stride": 0, "block_stride": page}})  # (to 0.28)
    tensor = kvi.KVCacheTensor(size=page * NUM_GPU_BLOCKS, **shared)
    kv_cache_config = kvi.KVCacheConfig(num_blocks=NUM_GPU_BLOCKS, kv_cache_tensors=[tensor],
                                        kv_cache_groups=groups)
    align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT  # the CPU tier's chunk, aligned
    chunk = -(-page * BLOCKS_PER_CHUNK // align) * align
    vc = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=MAX_MODEL_LEN),
        cache_config=CacheConfig({cache}),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={{**EXTRA_CONFIG, "cpu_bytes_to_use": chunk * CPU_CHUNKS}}))
    vc.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
{engine_lines}    if hasattr(kv_cache_config, "prefix_cache_retention_interval"):  # as the planner copies it
        kv_cache_config.prefix_cache_retention_interval = (
            vc.cache_config.prefix_cache_retention_interval)
    sc = vc.scheduler_config
    sc.max_num_batched_tokens, sc.max_num_seqs = MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
    sc.disable_hybrid_kv_cache_manager = False  # as on CUDA (on CPU vLLM merges the groups)
    block_size, hash_block_size = kcu.resolve_kv_cache_block_sizes(kv_cache_config, vc)
    sched = Scheduler(vllm_config=vc, kv_cache_config=kv_cache_config, log_stats=False,
                      structured_output_manager=StructuredOutputManager(vc),
                      block_size=block_size, hash_block_size=hash_block_size)
    assert len(sched.kv_cache_manager.coordinator.single_type_managers) == len(GROUPS)
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    return sched, kcu.get_request_block_hasher(hash_block_size, hash_fn), hash_block_size


def make_request(index, hasher):
    rid, segments, _, decode, _, params, sampling = REQUESTS[index]
    tokens = [(seed * 7919 + i * 104729 + 17) % 32000 for seed, n in segments for i in range(n)]
    extra = {{"extra_args": {{"kv_transfer_params": params}}}} if params else {{}}
    extra.update(sampling)
    return Request(request_id=rid, prompt_token_ids=tokens, pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=decode, ignore_eos=True, **extra),
                   arrival_time=float(index), block_hasher=hasher)


def worker_output(sched, out, t, pending):
    """Step t's output: a token per request at its end; the transfers due, out of pending."""
    order = list(out.num_scheduled_tokens)
    reqs = [sched.requests[rid] for rid in order]  # arrival_time: the request's index
{sampled}    done = {{j: pending.pop(j) for j in sorted(pending) if pending[j][0] <= t + 1}}
    loads = {{rid for _, rid in done.values() if rid is not None}}
    kvo = KVConnectorOutput(finished_recving=loads or None,
                            kv_connector_worker_meta=OffloadingWorkerMetadata(
                                completed_jobs=dict.fromkeys(done, 1))) if done else None
    return ModelRunnerOutput(req_ids=order, req_id_to_index={{r: i for i, r in enumerate(order)}},
                             sampled_token_ids=sampled, kv_connector_output=kvo), done
{helpers}

def test_{name}(tmp_path):
{debug_guard}    sched, hasher, hash_block_size = make_scheduler(tmp_path)
    pending = {{}}  # job id -> (step due, request of a load)
{before_loop}    for t in range(STEP_CAP):
        for i, (rid, _, arrival, _, abort_at, _, _) in enumerate(REQUESTS):
            if arrival == t{skip}:
                sched.add_request(make_request(i, hasher))
{abort_lines}{event_lines}        if not sched.has_requests() and not pending:
            if all(r[2] <= t for r in REQUESTS):
                return  # every request finished
            continue  # nothing to do before the next arrival
        out = sched.schedule()
        meta = out.kv_connector_metadata
{after_schedule}        stores, loads = meta.store_jobs or {{}}, meta.load_jobs or {{}}
        pending.update({{j: (t + STORE_LATENCY, None) for j in stores}})
        pending.update({{j: (t + LOAD_LATENCY, job.req_id) for j, job in loads.items()}})
        for j in set(meta.jobs_to_flush or ()) & set(pending):  # a flushed store ends now
            pending[j] = (t, pending[j][1])
{job_check}        output, done = worker_output(sched, out, t, pending)
        sched.update_from_output(out, output)
{drafter}{after_update}    raise AssertionError(f"requests unfinished after {{STEP_CAP}} steps: {{list(sched.requests)}}")
'''


# --- verification on the installed releases -----------------------------------------------

@dataclass
class Verdict:
    verified: bool
    reason: str                       # why not verified ("" when verified)
    results: dict = field(default_factory=dict)   # release -> "failed" / "passed" / "error: ..."

    def to_json(self) -> dict:
        return {"verified": self.verified, "reason": self.reason, "results": self.results}


def run_on(path: Path, release, asserts: bool = True) -> tuple[str, str]:
    """Run the test file with ``release``'s plain environment from an empty folder (with
    ``python -O`` unless ``asserts``): its result (``passed``, ``failed``, ``error``) and
    pytest's output."""
    from simsched.vllm.releases import env_prefix
    with tempfile.TemporaryDirectory(prefix="simsched-vllm-repro-") as tmp:
        local = Path(tmp) / path.name
        local.write_text(path.read_text())
        try:
            proc = subprocess.run(env_prefix(release) + ([] if asserts else ["-O"])
                                  + ["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                     local.name],
                                  cwd=tmp, text=True, capture_output=True,
                                  timeout=VERIFY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "error", f"timed out after {VERIFY_TIMEOUT_S} s"
    result = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
    return result, proc.stdout + proc.stderr


def verify(path: Path, data: dict, releases) -> Verdict:
    """Fails on each affected release (with the finding's exception for a crash), passes on
    each clean one; a release the case did not run on is run and reported, nothing required."""
    results, wrong = {}, []
    # what the failure must say: the crash's exception, or the inline check's own message
    mark = data.get("exception") if data["kind"] == "crash" else MARKS[short_name(data)]
    for release in releases:
        got, output = run_on(path, release, data["asserts"])
        v = release.version
        errors = [line for line in output.splitlines() if line.startswith("E ")]
        if got == "failed" and mark and not any(mark in line for line in errors):
            got = "failed otherwise"
        results[v] = got
        want = ("failed" if v in data["releases_affected"]
                else "passed" if v in data["releases_clean"] else None)
        if want is not None and got != want:
            last = [l for l in output.splitlines() if l.strip()][-1:] or [""]
            wrong.append(f"{v}: {got}, expected {want} ({last[0].strip()[:160]})")
    missing = [v for v in data["releases_affected"] + data["releases_clean"]
               if v not in results]
    if missing:
        wrong.append(f"not installed: {', '.join(missing)}")
    if not data["releases_affected"]:
        wrong.append("no affected release to fail on")
    return Verdict(not wrong, "; ".join(wrong), results)
