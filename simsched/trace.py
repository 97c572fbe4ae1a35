"""The release-neutral trace: one line per fact, byte-for-byte deterministic.

Format ``simsched-trace/1`` (another engineer can produce it from real vLLM; tokens separated by
single spaces, lists comma-separated without spaces, groups written ``g<id>``)::

    # simsched-trace/1 profile=<name> asserts=<on|off>
    step <n>                                  a scheduler step begins (n counts from 0)
    sched <rid> <tokens>                      tokens scheduled for a request in this step
    alloc <rid> g<id>=<b,b,...> ...           new block IDs per group (0 = null placeholder)
    preempt <rid>                             the request was preempted (its blocks freed)
    store <job> <rid> g<id>:<hash_idx>=<b,...> ...   a store job: per chunk, its key (group, index
                                              of the request's block hash that names it) and
                                              source block IDs
    load <job> <rid> g<id>:<hash_idx>=<b,...> ...    a load job, same shape (destination blocks)
    flush <job,...>                           store jobs the worker must finish before this step
    done <job> <store|load>                   a job completed (reported by the worker)
    tier <cascade|promote> <job> <n> checked  a secondary tier's job of n keys completed
                                              before this step's schedule() (tiered
                                              offloading: the harness runs the tier's I/O) and
                                              its bytes were checked (INV-T1 / INV-T2)
    failed <job> <store|load>                 a job of the case's faults failed: the offloading
                                              worker raises, the run stops (last line)
    end waiting on <store|load> <job>[, ...] (never completes)[; held back: <rid>=<how>,...]
                                              nothing but jobs that never complete (case
                                              timing.jobs, latency null) is left, and the
                                              requests they hold back: the run stops (last line)
    end flush waits on <store|load> <job> (never completes)
                                              the worker must finish such a job before the step
                                              (flush): it waits forever, the run stops (last line)
    recv <rid> g<id>=<b,...> ...              another connector's worker starts writing the
                                              request's KV into these blocks (``multi``: the NIXL
                                              pull of a remote prefill)
    landed <rid>                              that write landed (finished_recving reports it)
    finish <rid> <finished|aborted>           a request finished
    check <ok|INV-n>                          invariants checked after the step
    crash <Exception> <function> <stage>      the scheduler raised (last line)
    violation <INV-n> <detail>                an invariant failed (last line)

Keys are never raw hashes: ``g0:3`` is group 0's key made from the request's block hash 3 (hash
index counted in ``tokens_per_hash`` units).
"""

from __future__ import annotations

TRACE_FORMAT = "simsched-trace/1"


def fmt_blocks(blocks) -> str:
    return ",".join(map(str, blocks)) if blocks else "-"


def fmt_alloc(rid: str, per_group) -> str:
    return f"alloc {rid} " + " ".join(f"g{g}={fmt_blocks(b)}" for g, b in enumerate(per_group))


def fmt_job(job) -> str:
    kind = "store" if job.is_store else "load"
    parts = [f"g{gid}:{hidx}={fmt_blocks([b for _, b in blocks])}"
             for gid, _, hidx, _, blocks in job.items]
    return f"{kind} {job.jid} {job.rid} " + (" ".join(parts) if parts else "-")


def fmt_recv(rid: str, per_group) -> str:
    """``recv <rid> g<id>=<b,...> ...``: the blocks another connector's pull writes."""
    return f"recv {rid} " + " ".join(f"g{g}={fmt_blocks(b)}" for g, b in enumerate(per_group))


def header(profile: str, asserts: bool) -> str:
    return f"# {TRACE_FORMAT} profile={profile} asserts={'on' if asserts else 'off'}"


def fmt_hung_end(jobs, held) -> str:
    """The last line of a run stopped with only never-completing jobs left: ``jobs``, (job ID,
    is_store) pairs; ``held``, (request ID, how) pairs: the requests they hold back and how
    (``load``, ``lookup``, ``blocks``)."""
    names = ", ".join(f"{'store' if s else 'load'} {j}" for j, s in sorted(jobs))
    tail = f"; held back: {','.join(f'{r}={h}' for r, h in sorted(held))}" if held else ""
    return f"end waiting on {names} (never completes){tail}"


def fmt_hung_flush(jid: int, is_store: bool) -> str:
    """The last line of a run whose step flushes a job that never completes."""
    return f"end flush waits on {'store' if is_store else 'load'} {jid} (never completes)"
