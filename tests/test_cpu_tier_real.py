"""The model's CPU tier against vLLM's own ``CPUOffloadingManager`` with the LRU policy.

Random operations (stores of a request's chunks, their completions in any order, loads and
their completions, touches, request finishes) run on the model's tier and, through
``simsched releases env``, on the manager of each release where the policy changed: 0.30.0
(the evictable list), 0.31.0 (recency ranks), 0.33.0 (ranks by request and token position).
After every store both sides must have stored the same keys, refused the same stores and
evicted the same chunks. A release that is not installed fails the test."""

from __future__ import annotations

import json
import random
import subprocess
from types import SimpleNamespace as NS

import pytest

from simsched.model.request import key_group, key_ident, make_key
from simsched.model.cpu_manager import CPUOffloadingManager, RankedCPUManager, tuple_set_order
from simsched.vllm import releases as rel

TPC = 16            # tokens per chunk, both groups

# The release side: vLLM alone, reading the operations on stdin, printing what each store did.
REAL = r'''
import json, sys
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager


def key(k):
    group, ident = k
    return make_offload_key(ident.to_bytes(8, "big"), group)


def replay(run):
    manager = CPUOffloadingManager(num_chunks=run["capacity"], cache_policy="lru")
    contexts, out = {}, []
    for op, rid, keys in run["ops"]:
        if rid not in contexts:
            ctx = contexts[rid] = ReqContext(req_id=rid)
            manager.on_new_request(ctx)
            if hasattr(ctx, "set_offload_key_position"):      # 0.31.0+
                for k, end in run["positions"][rid]:
                    ctx.set_offload_key_position(key(k), end)
        ctx, ks = contexts[rid], [key(k) for k in keys]
        if op == "store":
            res = manager.prepare_store(ks, ctx)
            out.append(None if res is None else
                       [sorted(ks.index(k) for k in res.keys_to_store),
                        sorted(k.hex() for k in res.evicted_keys)])
        elif op == "complete_store":
            manager.complete_store(ks, ctx)
        elif op == "load":
            manager.prepare_load(ks, ctx)
        elif op == "complete_load":
            manager.complete_load(ks, ctx)
        elif op == "touch":
            manager.touch(ks, ctx)
        elif op == "finish":
            manager.on_request_finished(ctx)
    return out


print(json.dumps([replay(run) for run in json.load(sys.stdin)]))
'''


def _real_key_hex(k: int) -> str:
    return (key_ident(k).to_bytes(8, "big") + key_group(k).to_bytes(4, "big")).hex()


def _requests(rng: random.Random, n: int) -> dict:
    """Requests of two groups whose chunks share idents across the groups at each position
    (equal hash units) and across requests (shared prefixes)."""
    reqs = {}
    for r in range(n):
        prefix = rng.randrange(3)
        idents = [1000 * prefix + i if i < rng.randint(0, 4) else 10 ** 6 + 100 * r + i
                  for i in range(rng.randint(3, 7))]
        reqs[f"r{r}"] = NS(req=NS(rid=f"r{r}"),
                           groups=[NS(keys=[make_key(g, h) for h in idents]) for g in (0, 1)])
    return reqs


def _run(seed: int, lru: str):
    """One random run: the operations, the model's record of each store, the positions."""
    rng = random.Random(seed)
    capacity = rng.choice([4, 6, 10])
    tier = (CPUOffloadingManager(capacity) if lru == "list"
            else RankedCPUManager(capacity, lru == "request-ranks",
                               [NS(group_id=g, tokens_per_chunk=TPC) for g in (0, 1)]))
    reqs = _requests(rng, 6)
    live, finished = ["r0", "r1"], set()
    writing, loading, ops, model = [], [], [], []
    for _ in range(70):
        rid = rng.choice(live)
        st = reqs[rid]
        op = rng.randrange(8)
        if op <= 2:
            keys = []
            for gs in st.groups:
                lo = rng.randrange(len(gs.keys))
                keys += gs.keys[lo:lo + rng.randint(0, 3)]
            if not keys:
                continue
            before = set(tier.chunks)
            got = tier.prepare_store(keys, st)
            ops.append(("store", rid, keys))
            model.append(None if got is None else
                         [sorted(keys.index(k) for k in got),
                          sorted(_real_key_hex(k) for k in before - set(tier.chunks))])
            if got:
                writing.append(got)
        elif op == 3 and writing:
            done = writing.pop(rng.randrange(len(writing)))
            tier.complete_store(done, [None] * len(done))
            # vLLM walks a job's keys as its set holds them: the order the model gives it
            ops.append(("complete_store", rid, tuple_set_order(done)))
        elif op == 4:
            ready = [k for gs in st.groups for k in gs.keys if tier.is_ready(k)]
            if ready:
                keys = list(dict.fromkeys(ready[:rng.randint(1, 3)]))
                tier.prepare_load(keys, st)
                ops.append(("load", rid, keys))
                loading.append((rid, keys))
        elif op == 5 and loading:
            lrid, keys = loading.pop(0)
            tier.complete_load(keys)
            ops.append(("complete_load", lrid, tuple_set_order(keys)))
        elif op == 6 and lru == "list":
            keys = st.groups[rng.randrange(2)].keys
            lo = rng.randrange(len(keys))
            tier.touch_range(keys, lo, len(keys))
            ops.append(("touch", rid, keys[lo:]))
        elif op == 7 and not any(r == rid for r, _ in loading) and len(live) > 1:
            tier.on_request_finished(st)
            ops.append(("finish", rid, []))
            live.remove(rid)
            finished.add(rid)
            fresh = [r for r in reqs if r not in finished and r not in live]
            if fresh:
                live.append(fresh[0])
    positions = {rid: [[[key_group(k), key_ident(k)], (i + 1) * TPC]
                       for gs in st.groups for i, k in enumerate(gs.keys)]
                 for rid, st in reqs.items()}
    wire = [(op, rid, [[key_group(k), key_ident(k)] for k in keys]) for op, rid, keys in ops]
    return {"capacity": capacity, "ops": wire, "positions": positions}, model


@pytest.mark.parametrize("version, lru", [("0.30.0", "list"), ("0.31.0", "ranks"),
                                          ("0.33.0", "request-ranks")])
def test_cpu_tier_evicts_as_the_release_does(version, lru):
    have = {r.version: r for r in rel.installed()}
    assert version in have, f"vLLM {version} not installed: run `simsched releases install`"
    runs = [_run(seed, lru) for seed in range(120)]
    proc = subprocess.run(rel.env_prefix(have[version]) + ["-c", REAL],
                          input=json.dumps([r for r, _ in runs]), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evicting = 0
    reals = json.loads(proc.stdout.splitlines()[-1])   # (after any log line of vLLM)
    for seed, ((run, model), real) in enumerate(zip(runs, reals)):
        assert model == real, f"seed {seed}: the model's stores differ from vLLM {version}'s"
        evicting += sum(1 for m in model if m is None or m[1])
    assert evicting > 100           # the runs do fill the tier
