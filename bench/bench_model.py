"""Benchmark: simulated scheduler steps per second of simsched.model on a realistic workload.

Workload (as measured on real vLLM in docs/reference): N requests, prompts 208-1191 tokens, 8
shared 256-token prefixes, decode 16-64 tokens; layout full16 + sliding16(window 128) + full16;
GPU pool 1,200 blocks; max_num_batched_tokens 2048; max_num_seqs 32; store/load latency 1-3 steps.
Run: ``python bench/bench_model.py``. Prints Markdown tables.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simsched.case import Case  # noqa: E402
from simsched.model import run_case  # noqa: E402

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
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = run_case(case, "prefix-cacheable-windows-in-config", checks=checks, trace=trace)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return result, med


def main() -> None:
    print("| requests | mode | steps | stores | loads | preemptions | median run (ms) | steps/s |"
          " x real (1,872-2,371) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (16, 64, 256):
        case = workload(n)
        for checks, trace in (("fast", False), ("fast", True), ("full", True)):
            res, med = measure(case, checks, trace)
            c = res.counters
            sps = c["steps"] / med
            assert res.ok, res.findings
            mode = f"checks={checks} trace={'on' if trace else 'off'}"
            print(f"| {n} | {mode} | {c['steps']} | {c['stores']} | {c['loads']} | "
                  f"{c['preemptions']} | {med * 1e3:.1f} | {sps:,.0f} | "
                  f"{sps / REAL_STEPS_PER_S[1]:.1f}-{sps / REAL_STEPS_PER_S[0]:.1f} |")


if __name__ == "__main__":
    main()
