"""Benchmark: simulated scheduler steps per second of simsched.model on a realistic workload.

Workload (as measured on real vLLM in docs/reference): N requests, prompts 208-1191 tokens, 8
shared 256-token prefixes, decode 16-64 tokens; layout full16 + sliding16(window 128) + full16;
GPU pool 1,200 blocks; max_num_batched_tokens 2048; max_num_seqs 32; store/load latency 1-3 steps.
Run: ``python bench/bench_model.py [--runs N]`` (N runs per row, median; default 5). Prints a
Markdown table: steps/s with ``checks="fast", trace=False`` (the fast mode), with the trace, and
with full checks and the trace, for 16/64/256 requests, and the ratio to the real Scheduler.

``python bench/bench_model.py --real 0.30.0,0.33.0 [--runs N] [--sizes 64]``: side by side in one
run, the model in fast mode and the bare real Scheduler + KVCacheManager + OffloadingConnector of
each release on the same workload (release worker op ``run_case`` with ``bare=True``: the
scheduler loop only, no trace, shadow or checks; boot and request construction excluded; the
start-up heap frozen as EngineCore freezes it, and so is this process's),
alternating one model run and one real run N times; CPU-time medians and their ratio. The model
is timed as the real side is: its event loop (``Model.run``) only, the model built before the
clock starts and released after it stops (:func:`model_loop`), right after a whole
``run_case`` of the same case, as a campaign runs the model case after case. The whole
``run_case`` (building the model, the run, freeing it), run first after the real run as the
rounds before timed it, is shown beside it.

The model runs compiled when the checkout was installed with ``pip install -e .`` (mypyc, see
``setup.py``); ``SIMSCHED_PURE=1`` in the environment runs its Python source instead. The first
line of the output says which.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simsched import compiled  # noqa: E402
from simsched.case import Case  # noqa: E402
from simsched.model import Model, collector_paused, resolve_profile, run_case  # noqa: E402

#: the real Scheduler's steps/s on the 64-request workload per the reference notes (the x real
#: column of the model-only table); ``--real`` measures it side by side instead
REAL_STEPS_PER_S = (1872, 2371)


def workload(n: int, seed: int = 0, latency: int = 2) -> Case:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        length = rng.randint(208, 1191)
        prefix = rng.randrange(8)
        prompt = [[1000 + prefix, min(256, length)]]
        if length > 256:
            prompt.append([5000 + i, length - 256])
        reqs.append({"id": f"r{i}", "prompt": prompt,
                     "arrival": i // 4, "decode": rng.randint(16, 64)})
    return Case.from_json({
        "layout": {"groups": [{"kind": "full", "block_size": 16},
                              {"kind": "sliding_window", "block_size": 16, "sliding_window": 128},
                              {"kind": "full", "block_size": 16}],
                   "engine": {"num_gpu_blocks": 1200, "cpu_chunks": 4096}},
        "requests": reqs,
        "timing": {"store_latency": latency, "load_latency": latency,
                   "max_num_batched_tokens": 2048, "max_num_seqs": 32}})


def measure(case: Case, checks: str, trace: bool, runs: int = 5):
    """Median wall-clock and CPU seconds of ``runs`` runs (CPU time is steadier on a busy box)."""
    walls, cpus, result = [], [], None
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        result = run_case(case, "prefix-cacheable-windows-in-config", checks=checks, trace=trace)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return result, statistics.median(walls), statistics.median(cpus)


MODES = (("fast", False), ("fast", True), ("full", True))


def model_loop(case: Case, profile: str) -> tuple[dict, float]:
    """The model's counterpart of the real side's ``loop_cpu``: CPU seconds of ``Model.run``
    alone in fast mode (the model and its requests' specs built before the clock starts, its
    objects freed after it stops, as the bare real run builds its Scheduler and Request objects
    before its loop and frees them after), with the collector paused as ``run_case`` pauses
    it. Returns the counters and the seconds; the run must be clean."""
    with collector_paused():
        model = Model(case, resolve_profile(profile), checks="fast", trace=False)
        c0 = time.process_time()
        model.run()
        cpu = time.process_time() - c0
        model.release()
    return model.counters, cpu


def model_build() -> str:
    """Which model ran: the modules compiled at install, or their Python source."""
    return "model compiled (mypyc)" if compiled() else "model pure Python"


def side_by_side(versions: list[str], sizes: list[int], runs: int) -> None:
    """Model (fast mode) and bare real Scheduler alternately on one workload; CPU-time medians."""
    from simsched.profiles import profile_for_release
    from simsched.targets import Releases

    print(f"Median of {runs} alternating runs per row (model in fast mode: checks=fast, "
          f"trace off; {model_build()}; real: bare Scheduler loop in the release worker).\n")
    print("| release | requests | model steps | real steps | real stores / loads / preemptions |"
          " model steps/s (CPU, loop) | model steps/s (CPU, whole run_case) | real steps/s (CPU)"
          " | real steps/s (wall) | model / real (ratio of medians) | model / real (median of "
          "per-run ratios) | whole run_case / real (median of per-run ratios) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    # both sides run with their start-up heaps frozen, as vLLM's EngineCore serves
    # (``freeze_gc_heap`` once the engine is built; the worker's bare run does the same)
    gc.collect()
    gc.freeze()
    with Releases.installed(versions, timeout=600) as pool:
        for v in versions:
            prof = profile_for_release(v)
            for n in sizes:
                case = workload(n)
                worker = pool.worker(v, case.asserts)
                worker.call("run_case", timeout=600, case=case.to_json(), bare=True)  # warm-up
                run_case(case, prof, checks="fast", trace=False)
                m_cpu, w_cpu, r_cpu, r_wall, ratios, w_ratios = [], [], [], [], [], []
                for _ in range(runs):
                    # the whole run_case first, right after the real run (as rounds before this
                    # column was added timed the model), then the loop alone, as the model runs
                    # case after case in a campaign (its code and data in the CPU's caches)
                    c0 = time.process_time()
                    m = run_case(case, prof, checks="fast", trace=False)
                    wc = time.process_time() - c0
                    counters, mc = model_loop(case, prof)
                    assert m.ok, m.findings
                    assert counters["steps"] == m.counters["steps"], (counters, m.counters)
                    r = worker.call("run_case", timeout=600, case=case.to_json(), bare=True)
                    if r.get("status") != "ok":
                        raise SystemExit(f"{v}: real run {r.get('status')}: {r}")
                    steps = m.counters["steps"]
                    rs = r["counters"]["steps"] / r["loop_cpu"]
                    m_cpu.append(steps / mc)
                    w_cpu.append(steps / wc)
                    r_cpu.append(rs)
                    r_wall.append(r["counters"]["steps"] / r["loop_wall"])
                    ratios.append(steps / mc / rs)
                    w_ratios.append(steps / wc / rs)
                rc = r["counters"]
                mm, rm = statistics.median(m_cpu), statistics.median(r_cpu)
                print(f"| {v} | {n} | {m.counters['steps']} | {rc['steps']} | {rc['stores']} / "
                      f"{rc['loads']} / {rc['preemptions']} | {mm:,.0f} | "
                      f"{statistics.median(w_cpu):,.0f} | {rm:,.0f} | "
                      f"{statistics.median(r_wall):,.0f} | {mm / rm:.1f} | "
                      f"{statistics.median(ratios):.1f} | {statistics.median(w_ratios):.1f} |")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    runs = int(argv[argv.index("--runs") + 1]) if "--runs" in argv else 5
    if "--real" in argv:
        sizes = [int(x) for x in argv[argv.index("--sizes") + 1].split(",")] \
            if "--sizes" in argv else [64]
        side_by_side(argv[argv.index("--real") + 1].split(","), sizes, runs)
        return
    lo, hi = REAL_STEPS_PER_S
    print(f"Median of {runs} runs per row; {model_build()}; profile "
          "prefix-cacheable-windows-in-config; "
          f"real vLLM Scheduler: {lo:,}-{hi:,} steps/s on the 64-request workload (reference "
          "notes; --real measures it side by side).\n")
    print("| requests | mode | steps | stores | loads | preemptions | median run (ms) | steps/s |"
          f" steps/s (CPU time) | x real ({lo:,}-{hi:,}) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for n in (16, 64, 256):
        case = workload(n)
        for checks, trace in MODES:
            res, wall, cpu = measure(case, checks, trace, runs)
            c = res.counters
            sps, sps_cpu = c["steps"] / wall, c["steps"] / cpu
            assert res.ok, res.findings
            mode = f"checks={checks} trace={'on' if trace else 'off'}"
            summary[(n, checks, trace)] = sps
            print(f"| {n} | {mode} | {c['steps']} | {c['stores']} | {c['loads']} | "
                  f"{c['preemptions']} | {wall * 1e3:.1f} | {sps:,.0f} | {sps_cpu:,.0f} | "
                  f"{sps / hi:.1f}-{sps / lo:.1f} |")
    fast, full = summary[(64, "fast", False)], summary[(64, "full", True)]
    print(f"\n64 requests: fast {fast:,.0f} steps/s ({fast / hi:.1f}-{fast / lo:.1f}x real), "
          f"full checks + trace {full:,.0f} steps/s ({full / hi:.1f}-{full / lo:.1f}x real).")


if __name__ == "__main__":
    main()
