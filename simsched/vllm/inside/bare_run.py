"""The bare Scheduler's speed (op ``run_case`` with ``bare``, ``bench/bench_model.py --real``):
no trace, no content shadow, no invariant check."""

from __future__ import annotations

import gc
import time

from simsched.case import Case, sampled_token


class BareRun:
    """The real Scheduler (+ KVCacheManager + OffloadingConnector) driven through a case by the
    smallest worker side that keeps it going: per step ``schedule()``, one sampled token per
    request whose prefill completes (``sampled_token``, as :class:`~simsched.vllm.inside.run.Run`),
    transfer completions reported through the connector's driver as the checked run reports
    them (a job due ``latency`` steps after its creation, flushed jobs at once),
    ``update_from_output()``. The real ``Request`` objects (prompt block hashes included) are
    built before the timed loop; ``loop_wall``/``loop_cpu`` time the loop only (boot and request
    construction excluded), run with the start-up heap frozen as EngineCore runs the
    Scheduler."""

    def __init__(self, eng, case: Case, step_cap: int):
        self.eng, self.case, self.step_cap = eng, case, step_cap

    def go(self) -> dict:
        eng, case = self.eng, self.case
        vc, kvc, sched, sbs, tph = eng.boot(case)
        self.sched, self.driver = sched, eng.connector_driver(sched, tph, case)
        hasher = eng.probe.hasher(vc, tph)
        self.reqs = {}
        for i, spec in enumerate(case.requests):
            sp = eng.SamplingParams(max_tokens=spec.decode, ignore_eos=True)
            self.reqs[spec.id] = (i, spec, eng.probe.Request(
                request_id=spec.id, prompt_token_ids=spec.prompt_tokens(), sampling_params=sp,
                pooling_params=None, arrival_time=float(i), block_hasher=hasher))
        # EngineCore freezes its start-up heap once the engine is built (``freeze_gc_heap``: a
        # full collection, then ``gc.freeze()``), so that the Scheduler serves with the cyclic
        # collector no longer walking torch's and vLLM's objects (unfrozen, a full collection
        # here walks about 615,000 of them): timed likewise, and unfrozen after the loop
        gc.collect()
        gc.freeze()
        try:
            return self._loop()
        finally:
            gc.unfreeze()

    def _loop(self) -> dict:
        # one function: the loop is what is timed, kept to the calls the engine core makes
        eng, case, sched, driver, reqs = self.eng, self.case, self.sched, self.driver, self.reqs
        arrivals = sorted(((spec.arrival, i, r) for i, spec, r in reqs.values()),
                          key=lambda x: (x[0], x[1]))
        aborts = sorted((spec.abort_at, i, spec.id) for i, spec, _ in reqs.values()
                        if spec.abort_at is not None)
        timing, seed = case.timing, case.seed
        store_lat, load_lat = timing.store_latency, timing.load_latency
        MRO = eng.ModelRunnerOutput
        extra = {"logprobs": None} if "logprobs" in eng.mro_params else {}
        aborted = eng.RequestStatus.FINISHED_ABORTED
        counters = {"steps": 0, "stores": 0, "loads": 0, "preemptions": 0, "finished": 0,
                    "aborted": 0, "scheduled_tokens": 0}
        pending: dict[int, tuple[int, str | None]] = {}   # job id -> (due, rid for a load)
        finished: set[str] = set()
        unfinished = len(reqs)
        ai = bi = 0
        t = arrivals[0][0] if arrivals else 0
        c0, w0 = time.process_time(), time.perf_counter()
        while unfinished > 0 or sched.has_requests() or pending:
            while ai < len(arrivals) and arrivals[ai][0] <= t:
                if arrivals[ai][2].request_id not in finished:    # not aborted before arrival
                    sched.add_request(arrivals[ai][2])
                ai += 1
            while bi < len(aborts) and aborts[bi][0] <= t:
                rid = aborts[bi][2]
                bi += 1
                if rid not in finished:
                    if reqs[rid][1].arrival <= t:
                        sched.finish_requests([rid], aborted)
                    finished.add(rid)
                    unfinished -= 1
                    counters["aborted"] += 1
            if not sched.has_requests() and not pending:
                nxt = [x[0] for x in arrivals[ai:ai + 1]] + [x[0] for x in aborts[bi:bi + 1]]
                if not nxt:
                    break
                t = max(t + 1, min(nxt))
                continue
            out = sched.schedule()
            counters["steps"] += 1
            counters["preemptions"] += len(getattr(out, "preempted_req_ids", None) or ())
            sj = driver.scheduled_jobs(out)
            for jid, tj in sj.loads.items():
                pending[jid] = (t + load_lat, tj.req_id)
                counters["loads"] += 1
            for jid in sj.stores:
                pending[jid] = (t + store_lat, None)
                counters["stores"] += 1
            for jid in sj.flush:
                if jid in pending:
                    pending[jid] = (t, pending[jid][1])
            scheduled = out.num_scheduled_tokens
            order = list(scheduled)
            sampled = []
            for rid in order:
                counters["scheduled_tokens"] += scheduled[rid]
                req = reqs[rid][2]
                # schedule() has advanced num_computed_tokens: the prefill is complete
                sampled.append([sampled_token(seed, reqs[rid][0], req.num_tokens)]
                               if req.num_computed_tokens >= req.num_tokens else [])
            kvo = None
            done = [jid for jid, (due, _) in pending.items() if due <= t + 1]
            if done:
                recving = {pending[j][1] for j in done if pending[j][1] is not None}
                for j in done:
                    del pending[j]
                kvo = driver.connector_output(done, recving)
            mro = MRO(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                      sampled_token_ids=sampled, kv_connector_output=kvo, **extra)
            sched.update_from_output(out, mro)
            for rid in order:
                if rid not in finished and reqs[rid][2].is_finished():
                    finished.add(rid)
                    unfinished -= 1
                    counters["finished"] += 1
            if counters["steps"] >= self.step_cap:
                return {"status": "stuck", "counters": counters}
            t += 1
        return {"status": "ok", "counters": counters, "loop_cpu": time.process_time() - c0,
                "loop_wall": time.perf_counter() - w0}
