"""A failed transfer job (a case's ``faults``), as the release's offloading worker takes it.

Runs inside a release worker only. The harness plays the GPU worker, and with it the copy
engine under the offloading worker: the ``OffloadingWorker`` that ``register_kv_caches`` gets
from the spec (``CpuGpuOffloadingHandlers`` on a GPU). The worker-side connector above it is the
release's own ``OffloadingConnector`` in the worker role, driven as the model runner drives it:
``bind_connector_metadata``, ``handle_preemptions``, ``start_load_kv`` (loads, and the stores deferred from the step
before), ``wait_for_save`` (this step's stores, deferred), ``get_finished``. The copy engine
reports the faulted job with ``TransferResult.success`` False; what the release's worker does
with that result is the answer. Every release from 0.25.1 to 0.33.0 asserts
``transfer_result.success`` in ``OffloadingConnectorWorker.get_finished`` ("we currently do
not support job failures"): the engine stops.
"""

from __future__ import annotations

import copy
import sys
import traceback


def copy_engine_class():
    """A copy engine whose jobs all finish at once, the one named ``fail`` unsuccessfully."""
    from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

    class FailingCopyEngine(OffloadingWorker):
        def __init__(self, fail: int):
            self.fail = fail
            self.submitted: list[int] = []

        def submit_store(self, job_id, src_spec, dst_spec) -> bool:
            self.submitted.append(job_id)
            return True

        def submit_load(self, job_id, src_spec, dst_spec, expedited=False) -> bool:
            self.submitted.append(job_id)
            return True

        def get_finished(self) -> list:
            done, self.submitted = self.submitted, []
            return [TransferResult(job_id=j, success=j != self.fail) for j in done]

        def wait(self, job_ids) -> None:
            return

    return FailingCopyEngine


def worker_refusal(scheduler, vllm_config, kv_cache_config, meta, job_id: int) -> str | None:
    """Job ``job_id`` of ``meta`` (the connector metadata of the step that created it) fails on
    a fresh worker-role connector of the same config: two model-runner steps, the second with
    no new jobs (a store is submitted at the start of the step after its own). The
    AssertionError the release's worker raised, named by its file, line and source, or None
    when the worker took the failure without raising."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    connector = type(scheduler.connector)(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    connector.connector_worker.worker = copy_engine_class()(job_id)
    quiet = copy.copy(meta)
    quiet.load_jobs, quiet.store_jobs = {}, {}
    if hasattr(quiet, "jobs_to_flush"):
        quiet.jobs_to_flush = type(meta.jobs_to_flush)()
    try:
        for step_meta in (meta, quiet):
            connector.bind_connector_metadata(step_meta)
            connector.handle_preemptions(step_meta)     # jobs_to_flush first
            connector.start_load_kv(None)
            connector.wait_for_save()
            connector.get_finished(set())
            connector.clear_connector_metadata()
    except AssertionError:
        frame = traceback.extract_tb(sys.exc_info()[2])[-1]
        where = frame.filename.split("/vllm/", 1)[-1]
        return f"{where}:{frame.lineno} {frame.name}: {frame.line}"
    return None
