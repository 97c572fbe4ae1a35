"""The seam between a run and the KV connector it drives: what the harness reads of a
connector, and hands to it, in the connector's own terms. One implementation today,
:class:`simsched.vllm.inside.offloading.OffloadingConnectorDriver`; a driver of another
connector (``SimpleCPUOffloadConnector``, a ``MultiConnector`` of several, tiered offloading)
implements the same methods beside it, and the run, the offloading worker, the hit oracle and
the model runner take it as they take this one.

Items: a job's chunks as the content shadow judges them, per chunk ``(group_id, chunk_idx,
hash_idx, key, [(block_index, block_id), ...])``, ``key`` the model's content key
(:func:`simsched.model.request.make_key`) of the chunk's last token."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class ScheduledJobs(NamedTuple):
    """The jobs one ``SchedulerOutput`` hands the worker: job ID -> the connector's job of the
    loads and the stores, the job IDs to flush (the worker waits for them before the step
    runs), and the metadata that carried them."""

    meta: Any
    loads: dict
    stores: dict
    flush: set


class ExternalWrite(NamedTuple):
    """KV another connector writes into a request's GPU blocks (a P/D decode instance's NIXL
    pull of a remote prefill): per KV cache group the block IDs its metadata names, and when
    the write lands (the step whose output reports the request in ``finished_recving``)."""

    rid: str
    blocks: list
    due: int
    who: str


class ConnectorDriver(Protocol):
    # -- read at boot, from the connector's scheduler side -------------------------------------
    #: per offloaded KV cache group: ``group_id``, ``tokens_per_block``, ``tokens_per_chunk``,
    #: ``cow_source`` (stores of one boundary block whose index the job names)
    groups: list
    group_by_id: dict
    #: ``tokens_per_hash`` and ``groups``, as the invariants' checks take them
    geometry: Any
    tph: int
    blocks_per_chunk: int
    #: the connector stores partial tails (one block per group at a boundary inside a chunk)
    partial_tails: bool
    #: per-request cap name (``max_offload_tokens``, ``max_load_tokens``) -> the connector
    #: honours it
    caps_supported: dict[str, bool]

    def drafter_groups(self, case) -> set[int]:
        """The groups the connector treats as EAGLE drafter groups (INV-9's eagle-tail rule)."""

    def kv_transfer_params(self, spec) -> dict:
        """What the case's request adds to its ``kv_transfer_params`` for this connector (a
        P/D request: ``do_remote_prefill`` and the ``remote_*`` keys), else ``{}``."""

    # -- lookups ------------------------------------------------------------------------------
    def observe_lookups(self, observer) -> None:
        """Hand every answered ``get_num_new_matched_tokens`` to ``observer(request,
        num_computed_tokens, answer, max_num_new_tokens)``."""

    def stop_observing(self) -> None: ...

    def reads_load_cap(self, rid: str) -> bool:
        """The connector bounds this request's loads by its ``max_load_tokens``."""

    def tier_holds(self, request, block_hash, gid: int) -> bool:
        """The offload tier still holds the chunk ending at ``block_hash`` of group ``gid``."""

    # -- the jobs of a step -------------------------------------------------------------------
    def has_jobs(self) -> bool:
        """The connector has jobs it has not been told are done."""

    def scheduled_jobs(self, out) -> ScheduledJobs:
        """The jobs in ``SchedulerOutput.kv_connector_metadata``."""

    def job_items(self, jid: int, tjob, is_store: bool, requests) -> tuple[list, list | None]:
        """The job's items, and its keys in the order the connector completes them (or
        None)."""

    def job_slots(self, tjob, is_store: bool):
        """The offload tier's slots the job writes or reads, one per item, or None."""

    def external_writes(self, out, t: int) -> list[ExternalWrite]:
        """The writes into GPU blocks another connector's worker starts with this
        ``SchedulerOutput`` (scheduled at ``t``), none for a connector that has no such
        worker."""

    def held_blocks(self) -> dict:
        """GPU block ID -> the references the connector holds on it itself (blocks it touched
        for its transfers), holders for INV-1 beside the requests' tables."""

    # -- their completion ---------------------------------------------------------------------
    def connector_output(self, completed_jobs: list[int], finished_recving: set[str]):
        """The ``KVConnectorOutput`` of a model runner output reporting these jobs and these
        requests' loads done, or None."""

    def worker_refusal(self, vc, kvc, meta, jid: int) -> str | None:
        """Job ``jid`` fails on the connector's own worker side: what it raised, or None."""

    # -- the offload tier's content, clock and lifetime -------------------------------------
    #: steps a lookup may defer beyond the case's transfer latencies, waiting on the
    #: connector's own work (the fs tier's probe and read: :mod:`simsched.vllm.inside.tiering`)
    lookup_defer_steps: int
    #: tokens a lookup's hit ends on a multiple of, beyond INV-9's chunk rules (1: none)
    hit_alignment: int
    #: the engine goes idle with the connector's transfers in flight (nothing makes
    #: ``Scheduler.has_requests()`` true for them): once every request finished the run ends
    #: there, its jobs stranded, instead of stepping on to collect them
    strands_at_idle: bool

    def cpu_tier(self):
        """The worker's view of the CPU tier's content
        (:class:`simsched.vllm.inside.cpu_tier.CpuTier`)."""

    def before_schedule(self, step: int) -> list[str]:
        """Called before every ``schedule()``: work the connector's tiers do outside the
        worker's output (the fs tier's I/O) happens here, at a fixed point; the trace lines
        of what completed."""

    def tier_io_live(self) -> bool:
        """That work is in flight (a secondary tier's read or write queued): the tier is not
        quiet, for INV-8's stall check."""

    def close(self) -> None:
        """The run ended (however): release what the connector holds outside the process."""


def observe_lookups(owner, observer) -> None:
    """Every lookup ``owner`` answers (its ``get_num_new_matched_tokens``: the
    OffloadingConnector's scheduler, SimpleCPU's manager) is handed to ``observer(request,
    num_computed_tokens, answer, max_num_new_tokens)`` once answered: an attribute of this
    run's own object, which :func:`stop_observing` drops."""
    answer = owner.get_num_new_matched_tokens

    def observed(request, num_computed_tokens, *args, **kw):
        out = answer(request, num_computed_tokens, *args, **kw)
        observer(request, num_computed_tokens, out,
                 kw.get("max_num_new_tokens", args[0] if args else None))
        return out

    owner.get_num_new_matched_tokens = observed


def stop_observing(owner) -> None:
    vars(owner).pop("get_num_new_matched_tokens", None)
