"""NIXL's scheduler side on a P/D decode instance (``NixlPullConnectorScheduler``), simplified.

Mirrors ``distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`` and the part of
``nixl/base_scheduler.py`` a decode instance runs (0.25.1-0.33.0). A request pulled from a
prefill instance (``kv_transfer_params`` with ``do_remote_prefill``:
``RequestSpec.remote_prefill``) offers its prompt beyond the local prefix hit as tokens loaded
asynchronously
(``get_num_new_matched_tokens``); ``update_state_after_alloc`` records the pull of the request's
blocks that hold no prefix hit, once per request (``do_remote_prefill`` is cleared there), and
``build_connector_meta`` hands the step's pulls to the worker (``reqs_to_recv``).

The worker is the harness's play of it (``simsched.vllm.inside.external_kv``), and the model
plays it the same way: a pull with blocks, or one its request is parked for (``awaiting_kvs``,
0.30.0+), lands ``remote_prefill`` steps after the step that starts it and is reported in
``finished_recving``; a pull with neither only notifies the prefill instance and is never
reported (0.25.1-0.29.0 park a request whose blocks were all clipped away, and leave it there).
"""

from __future__ import annotations

from dataclasses import dataclass

from simsched.model.block_pool import NULL
from simsched.model.request import Request


@dataclass
class Recv:
    """A pull of ``reqs_to_recv``: the request's local blocks per KV cache group, and whether
    the request is parked in WAITING_FOR_REMOTE_KVS for it (``awaiting_kvs``)."""
    rid: str
    blocks: list[list[int]]
    awaiting_kvs: bool

    @property
    def reported(self) -> bool:
        return worker_reports(self.blocks, self.awaiting_kvs)


def worker_reports(blocks, awaiting_kvs: bool) -> bool:
    """The NIXL worker pulls an entry of ``reqs_to_recv`` and reports it in
    ``finished_recving``: it has blocks, or its request waits for it (``awaiting_kvs``); an
    entry of neither only notifies the prefill instance (the harness plays the worker so:
    ``simsched.vllm.inside.multi``)."""
    return awaiting_kvs or any(blocks)


class NixlPullConnectorScheduler:
    """``blocks_per_sw``: per KV cache group, the blocks a sliding-window group keeps of a pull
    (the window's blocks and one more; 0: every block), or None where every group is full
    attention (the hybrid KV cache manager is needed for none: no clipping); ``ssm_spec_blocks``:
    per group, a Mamba group's speculative scratch blocks (None: not a Mamba group, or a release
    before 0.27.0, which pulls every unhashed block of it); ``backoff``: the prompt's trailing
    tokens the decoder recomputes (``_prefill_backoff``: a Mamba model's last one, whose state
    h(N-1) the prefill instance sends); ``awaiting_kvs``: the release (0.30.0+) tells the worker
    that a request is parked for its pull, and the worker reports such a pull even with no
    blocks to write.

    Not modelled (``simsched.model.unmodelled_path``): multi-module MTP's lookahead back-off
    (0.31.0+)."""

    def __init__(self, blocks_per_sw: list[int] | None, ssm_spec_blocks: list[int | None],
                 backoff: int, awaiting_kvs: bool):
        self.blocks_per_sw = blocks_per_sw
        self.ssm_spec_blocks = ssm_spec_blocks
        self.backoff = backoff
        self.awaiting_kvs = awaiting_kvs
        # the requests whose kv_transfer_params still say do_remote_prefill
        self.remote_prefill: set[str] = set()
        self.reqs_need_recv: dict[str, Recv] = {}

    @classmethod
    def for_layout(cls, layout, awaiting_kvs: bool, clips_ssm: bool
                   ) -> "NixlPullConnectorScheduler":
        """The clipping as ``NixlBaseConnectorScheduler.__init__`` derives it: the hybrid KV
        cache manager is needed when a group is not full attention (``_is_hma_required``), a
        ``SlidingWindowSpec`` group keeps ``cdiv(sliding_window, block_size) + 1`` blocks, and
        (0.27.0+, ``clips_ssm``) a Mamba group its running-state block."""
        groups = layout.groups
        mamba = [g.kind == "mamba" for g in groups]
        spec_blocks = [layout.num_speculative_blocks if m and clips_ssm else None
                       for m in mamba]
        if all(g.kind in ("full", "mla") for g in groups):
            return cls(None, spec_blocks, 0, awaiting_kvs)
        return cls([-(-g.sliding_window // g.block_size) + 1
                    if g.kind in ("sliding_window", "sliding_window_mla") else 0
                    for g in groups], spec_blocks, 1 if any(mamba) else 0, awaiting_kvs)

    def _get_remote_prefill_token_count(self, num_prompt: int) -> int:
        """The prompt less the trailing tokens the decoder recomputes."""
        if self.backoff and num_prompt > self.backoff:
            return num_prompt - self.backoff
        return num_prompt

    def on_new_request(self, req: Request) -> None:
        if req.spec is not None and req.spec.remote_prefill is not None:
            self.remote_prefill.add(req.rid)

    def get_num_new_matched_tokens(self, req: Request, num_computed: int) -> int:
        """Remote prefill: the whole prompt beyond ``num_computed``, loaded asynchronously."""
        if req.rid in self.remote_prefill:
            count = self._get_remote_prefill_token_count(req.num_prompt) - num_computed
            if count > 0:
                return count
        return 0

    def update_state_after_alloc(self, req: Request, tables: list[list[int]],
                                 num_external: int, block_keys: list) -> None:
        """The pull of the request's blocks without a block hash (``block_keys[b]`` None), the
        null placeholders left out, clipped to the windows; with no tokens to pull (another
        child serves the request, or a full local hit) a pull of no blocks, which only
        notifies the prefill instance. Only one transfer per request."""
        if req.rid not in self.remote_prefill:
            return
        blocks: list[list[int]] = []
        if num_external > 0:
            blocks = [[b for b in table if b != NULL and block_keys[b] is None]
                      for table in tables]
            blocks = self.get_exchange_clipped_blocks(blocks)
        self.reqs_need_recv[req.rid] = Recv(req.rid, blocks,
                                            self.awaiting_kvs and num_external > 0)
        self.remote_prefill.discard(req.rid)

    def get_exchange_clipped_blocks(self, blocks: list[list[int]]) -> list[list[int]]:
        """(``get_sw_clipped_blocks`` up to 0.26.0) A sliding-window group keeps the tail its
        window reaches, a Mamba group its running state."""
        if self.blocks_per_sw is None:
            return blocks
        clipped = []
        for group, n_sw, n_spec in zip(blocks, self.blocks_per_sw, self.ssm_spec_blocks):
            if n_sw:
                group = group[-n_sw:]
            elif group and n_spec is not None:
                # clip_ssm_state_blocks: the speculative scratch slots go, the running state
                # stays (never nothing: an empty list reads as a full prefix hit)
                scratch = min(n_spec, len(group) - 1)
                if scratch:
                    group = group[:-scratch]
                group = group[-1:]
            clipped.append(group)
        return clipped

    def request_finished(self, req: Request) -> None:
        """A request finished (aborted) before it was ever allocated still notifies the prefill
        instance, which holds its blocks: a pull of no blocks."""
        if req.rid in self.remote_prefill:
            self.reqs_need_recv[req.rid] = Recv(req.rid, [], False)
            self.remote_prefill.discard(req.rid)

    def build_connector_meta(self) -> list[Recv]:
        """The step's ``reqs_to_recv``, in the order they were recorded; cleared once the
        workers start them."""
        recvs = list(self.reqs_need_recv.values())
        self.reqs_need_recv.clear()
        return recvs
