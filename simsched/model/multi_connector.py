"""The ``MultiConnector``'s scheduler side, over the OffloadingConnector and NIXL.

Mirrors ``distributed/kv_transfer/kv_connector/v1/multi_connector.py`` (0.25.1-0.33.0), the
hooks a P/D decode instance that offloads to CPU calls: every child looks the request up, in the
configured order, and the first child that offers tokens serves it
(``get_num_new_matched_tokens``, ``_requests_to_connector``); after the allocation the chosen
child is told the tokens to load and every other child zero (``update_state_after_alloc``:
0.25.1 hands the others no blocks, 0.26.0+ the request's blocks, which only the offloading
child's 0.33.0 reads, to mark them allocated in this batch); each child hears of a new and a
finished request.
"""

from __future__ import annotations

from simsched.model.nixl_scheduler import NixlPullConnectorScheduler
from simsched.model.offloading_common import Job
from simsched.model.offloading_scheduler import OffloadingConnectorScheduler
from simsched.model.request import Request


class MultiConnector:
    """``order``: the children's names (``offloading``, ``nixl``) in the case's order."""

    def __init__(self, order: tuple[str, ...], offloading: OffloadingConnectorScheduler,
                 nixl: NixlPullConnectorScheduler):
        self.order = order
        self.off, self.nixl = offloading, nixl
        # request ID -> the name of the child that serves it (the last lookup that offered)
        self.requests_to_connector: dict[str, str] = {}
        # what the offloading child answered at the request's last lookup (the hit oracle
        # judges its lookup alone)
        self.offloading_hit: int | None = None

    def on_new_request(self, req: Request) -> None:
        self.off.on_new_request(req)
        self.nixl.on_new_request(req)

    def get_num_new_matched_tokens(self, req: Request, num_computed: int) -> int | None:
        """The first child's offer that is not zero; None (ask again at a later step) as soon
        as a child's lookup is not done, the children after it unasked."""
        offered = 0
        for name in self.order:
            if name == "offloading":
                toks = self.offloading_hit = self.off.get_num_new_matched_tokens(req,
                                                                                  num_computed)
            else:
                toks = self.nixl.get_num_new_matched_tokens(req, num_computed)
            if toks is None:
                return None
            if offered == 0 and toks > 0:
                self.requests_to_connector[req.rid] = name
                offered = toks
        return offered

    def update_state_after_alloc(self, req: Request, tables: list[list[int]], num_external: int,
                                 block_keys: list, scheduled: bool = True) -> Job | None:
        """The chosen child gets the tokens to load, the other zero; the offloading child's
        load job, if it loads. ``scheduled``: the request runs in this step (not parked for a
        transfer). (0.25.1 gives the other child no blocks: neither child reads them then.)"""
        chosen = self.requests_to_connector.get(req.rid)
        job = None
        for name in self.order:
            n = num_external if name == chosen else 0
            if name == "offloading":
                job = self.off.update_state_after_alloc(req, tables, n, block_keys, scheduled)
            else:
                self.nixl.update_state_after_alloc(req, tables, n, block_keys)
        return job

    def request_finished(self, req: Request) -> None:
        self.off.request_finished(req)
        self.nixl.request_finished(req)
