"""The harness's driver of a ``MultiConnector`` of the ``OffloadingConnector`` and the
``NixlConnector``: a P/D decode instance that receives prefills through NIXL while it offloads
to CPU (``engine.connector: {"kind": "multi", "order": [...]}``, :mod:`simsched.connectors`).

Scheduler side, nothing played: the real ``Scheduler`` builds the real ``MultiConnector`` over
the real ``OffloadingConnector`` (its CPU manager included) and the real ``NixlConnector``
(``NixlPullConnector``: its scheduler role imports no ``nixl``, 0.30.0
``vllm/distributed/nixl_utils.py:50-82`` resolves ``NixlWrapper`` for the worker role only).
The children are built from the list in the case's order; the first child that offers tokens
serves a request (0.30.0 ``multi_connector.py:411-430``).

Worker side, played: everything the offloading worker does is
:class:`~simsched.vllm.inside.offloading.OffloadingConnectorDriver`'s, on the
``OffloadingConnector`` child (``sched.connector._connectors[i]``) and its part of the
``MultiKVConnectorMetadata`` (``metadata[i]``, child order, ``multi_connector.py:448-459``).
The NIXL worker: a request with ``remote_prefill`` carries ``kv_transfer_params`` with
``do_remote_prefill`` and the ``remote_*`` keys (``pull_scheduler.py:136-185`` does no transfer
without them); NIXL's ``reqs_to_recv`` names its blocks, which the run's
:class:`~simsched.vllm.inside.external_kv.ExternalKV` writes with the request's prompt KV
``remote_prefill`` steps after its admission, and which ``finished_recving`` then reports.
The step's completions go through the release's own ``MultiConnector`` worker methods
(``get_transfer_results`` / ``get_finished``, ``build_connector_worker_meta``) on a shell whose
children report what the harness played: the union of ``finished_recving`` and a
``MultiKVConnectorWorkerMetadata`` of one slot per child (a bare ``OffloadingWorkerMetadata``
trips ``update_connector_output``'s assert, 0.30.0 ``multi_connector.py:463-467``)."""

from __future__ import annotations

from types import SimpleNamespace

from simsched.model.nixl_scheduler import worker_reports
from simsched.vllm.inside.connector import ExternalWrite
from simsched.vllm.inside.offloading import OffloadingConnectorDriver

_MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
#: the children by the case's names: the connector each builds, its role on a decode instance
CHILDREN = {"offloading": ("OffloadingConnector", "kv_both"),
            "nixl": ("NixlConnector", "kv_consumer")}


def kv_transfer(builder, layout, vc, kvc) -> None:
    """``KVTransferConfig(kv_connector="MultiConnector")`` as a deployment passes it: the
    children in the case's order, the OffloadingConnector's extra config as
    :meth:`~simsched.vllm.inside.build.ConfigBuilder.offloading` builds it (its CPU tier). No
    child carries an ``engine_id``: ``_get_connector_classes_and_configs`` passes one of its
    own beside the child's keys (0.30.0 ``multi_connector.py:238-241``, a TypeError)."""
    builder.offloading(layout, vc, kvc)
    off = vc.kv_transfer_config
    children = []
    for name in layout.engine.connector.order:
        cls, role = CHILDREN[name]
        child = {"kv_connector": cls, "kv_role": role}
        if name == "offloading":
            child["kv_connector_extra_config"] = dict(off.kv_connector_extra_config)
        children.append(child)
    vc.kv_transfer_config = builder.KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", engine_id=off.engine_id,
        kv_connector_extra_config={"connectors": children})


def driver(sched, tph: int, case) -> "MultiConnectorDriver":
    return MultiConnectorDriver(sched, tph, case)


class _PlayedChild:
    """A child's worker role as the step's output reports what the harness played: the
    requests whose KV it received, its worker metadata (the offloading worker's completed
    jobs; NIXL has none)."""

    def __init__(self, results_cls):
        self.results_cls = results_cls
        self.recving: set[str] = set()
        self.meta = None

    def get_finished(self, finished_req_ids):
        recving, self.recving = self.recving, set()
        return set(), recving

    def get_transfer_results(self, finished_req_ids):
        sending, recving = self.get_finished(finished_req_ids)
        return self.results_cls(finished_sending=sending, finished_recving=recving)

    def build_connector_worker_meta(self):
        meta, self.meta = self.meta, None
        return meta


class MultiConnectorDriver:
    """A :class:`~simsched.vllm.inside.connector.ConnectorDriver`: what the run reads of the
    offloading child is its :class:`OffloadingConnectorDriver`'s (``off``, every attribute and
    method not defined here); NIXL's part is the pulls and their ``finished_recving``."""

    def __init__(self, sched, tph: int, case):
        import importlib

        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        multi = importlib.import_module(_MULTI)
        if not isinstance(sched.connector, multi.MultiConnector):
            raise RuntimeError(f"harness: the scheduler's connector is "
                               f"{type(sched.connector).__name__}, not a MultiConnector")
        self.order = list(case.layout.engine.connector.order)
        self.at = {name: i for i, name in enumerate(self.order)}
        self.child = sched.connector._connectors[self.at["offloading"]]
        self.off = OffloadingConnectorDriver(sched, tph, connector=self.child)
        self.specs = {r.id: r for r in case.requests}
        self.block_sizes = [g.block_size for g in case.layout.groups]
        self.pulled: set[str] = set()      # requests NIXL pulls, until they are reported
        results = getattr(base, "KVConnectorTransferResults", None)
        self.played = [_PlayedChild(results) for _ in self.order]
        self.shell = self._worker_shell(multi.MultiConnector)
        self.transfer_results = results is not None and hasattr(self.shell,
                                                                "get_transfer_results")

    def __getattr__(self, name: str):
        # (only for names not found on the instance: the offloading child's driver)
        if name == "off":
            raise AttributeError(name)
        return getattr(self.off, name)

    def _worker_shell(self, cls):
        """The release's ``MultiConnector`` worker methods over the played children
        (``_connectors``, ``_extra_async_saves``: what they read)."""
        shell = object.__new__(cls)
        shell._connectors = self.played
        shell._extra_async_saves = {}
        return shell

    # -- a P/D request ---------------------------------------------------------------------
    def kv_transfer_params(self, spec) -> dict:
        """A request pulled from a prefill instance: ``do_remote_prefill`` and what
        ``update_state_after_alloc`` needs to pull (0.30.0 ``pull_scheduler.py:136-185``:
        ``remote_block_ids`` and the four ``remote_*`` keys; ``tp_size`` for the heartbeats of
        ``on_new_request``, ``base_scheduler.py:199-238``). The prefill instance's block IDs
        are passed through to the worker only."""
        if spec.remote_prefill is None:
            return {}
        n = spec.prompt_len
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(range(1, 1 + -(-n // bs))) for bs in self.block_sizes],
                "remote_engine_id": "simsched-prefill", "remote_request_id": f"p-{spec.id}",
                "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}

    # -- the jobs of a step ----------------------------------------------------------------
    def _part(self, out, name: str):
        meta = getattr(out, "kv_connector_metadata", None)
        return None if meta is None else meta.metadata[self.at[name]]

    def scheduled_jobs(self, out):
        """The offloading child's jobs, in its part of the ``MultiKVConnectorMetadata``."""
        return self.off.scheduled_jobs(SimpleNamespace(
            kv_connector_metadata=self._part(out, "offloading")))

    def external_writes(self, out, t: int) -> list[ExternalWrite]:
        """NIXL's pulls the step starts: ``reqs_to_recv`` with local blocks (the request's
        unhashed blocks, per group, ``base_scheduler.py:455-501``); an entry without blocks
        only notifies the prefill instance (a full local hit, or another child served it,
        ``pull_scheduler.py:150-178``), unless it is ``awaiting_kvs`` (0.30.0+: the request
        is parked in WAITING_FOR_REMOTE_KVS, its blocks all clipped away, as for a chunked
        local prompt ending on an attention-chunk boundary), which the worker reports done
        all the same (``pull_worker.py`` 0.30.0:74, 450; 0.28.0-0.29.0 have no such flag and do
        not). Each lands its request's ``remote_prefill`` steps after this one."""
        meta = self._part(out, "nixl")
        pulls = []
        for rid, rm in (getattr(meta, "reqs_to_recv", None) or {}).items():
            groups = list(rm.local_block_ids or ())
            if groups and not isinstance(groups[0], (list, tuple)):
                groups = [groups]
            groups = [[int(b) for b in g] for g in groups]
            if not worker_reports(groups, bool(getattr(rm, "awaiting_kvs", False))):
                continue
            spec = self.specs.get(rid)
            latency = spec.remote_prefill if spec and spec.remote_prefill else 1
            self.pulled.add(rid)
            pulls.append(ExternalWrite(rid, groups, t + latency, f"NIXL recv of {rid}"))
        return pulls

    # -- their completion ------------------------------------------------------------------
    def connector_output(self, completed_jobs: list[int], finished_recving: set[str]):
        """The step's ``KVConnectorOutput`` as the release's ``MultiConnector`` worker builds
        it from its children's: the offloading worker's completed jobs and loads, NIXL's
        landed pulls (``get_transfer_results`` unions their ``finished_recving``,
        ``build_connector_worker_meta`` gives one slot per child, 0.30.0
        ``multi_connector.py:339-357, 390-400``)."""
        if not completed_jobs and not finished_recving:
            return None
        landed = finished_recving & self.pulled
        self.pulled -= landed
        off_out = self.off.connector_output(completed_jobs, finished_recving - landed)
        off_child, nixl_child = self.played[self.at["offloading"]], self.played[self.at["nixl"]]
        if off_out is not None:
            off_child.recving = set(off_out.finished_recving or ())
            off_child.meta = off_out.kv_connector_worker_meta
        nixl_child.recving = set(landed)
        if self.transfer_results:
            res = self.shell.get_transfer_results(set())
            sending, recving = res.finished_sending, res.finished_recving
        else:       # 0.25.1: get_finished
            sending, recving = self.shell.get_finished(set())
        return self.off.KVConnectorOutput(
            finished_sending=sending or None, finished_recving=recving or None,
            kv_connector_worker_meta=self.shell.build_connector_worker_meta())

    def worker_refusal(self, vc, kvc, meta, jid: int) -> str | None:
        """A failed job on the offloading child's own worker role (``meta``: its part of the
        step's metadata; its ``VllmConfig``: the copy the ``MultiConnector`` built it with)."""
        from simsched.vllm.inside import transfer_faults
        return transfer_faults.worker_refusal(SimpleNamespace(connector=self.child),
                                              self.child._vllm_config, kvc, meta, jid)
