"""A request as the scheduler, the KV cache manager and the connector see it
(``vllm/v1/request.py``), and the keys that name its KV: the block hashes of the GPU prefix
cache and the offload keys.

A key names a group's KV for a token prefix: the group ID and the prefix's identity
(``Request.ident``, a chained hash of the tokens, a signed 64-bit int in [-2**63, 2**63)), as
vLLM's ``make_offload_key`` appends the group index to a block hash. The pair is one int, made by
``make_key`` and taken apart by ``key_group`` / ``key_ident`` only:

    key = ident + group_id * 2**64

Each group's keys fill their own range [group_id * 2**64 - 2**63, group_id * 2**64 + 2**63), the
ranges in group order: a bijection, and keys order exactly as the ``(group_id, ident)`` pairs
(the eviction heap of ``cpu_manager.RankedCPUManager`` breaks ties by key). Group 0's keys are
its idents themselves.
"""

from __future__ import annotations

from typing import Any, Final, Sequence

# Request.status (RequestStatus): the finished states compare above the others
WAITING: Final = 0
RUNNING: Final = 1
WAITING_FOR_LOAD: Final = 2
FINISHED: Final = 3
ABORTED: Final = 4

#: the type of a key (an int of up to 68 bits)
Key = int

KEY_GROUP_SHIFT: Final = 64
_IDENT_BIAS: Final = 1 << 63          # ident + _IDENT_BIAS is in [0, 2**64)
#: the seed of every chain of prefix identities (the identity of the empty prefix)
NONE_HASH: Final = 0x5EED


def make_key(gid: int, ident: int) -> Key:
    """The key of group ``gid``'s KV for the prefix of identity ``ident``."""
    return ident + (gid << KEY_GROUP_SHIFT)


def key_group(key: Key) -> int:
    """The group id of ``key``."""
    return (key + _IDENT_BIAS) >> KEY_GROUP_SHIFT


def key_ident(key: Key) -> int:
    """The prefix identity of ``key``."""
    return key - (key_group(key) << KEY_GROUP_SHIFT)


def extend_ident(ident: list[int], tokens: Sequence[int], unit: int) -> None:
    """``ident[k] = hash((ident[k - 1], tuple(tokens[k * unit:(k + 1) * unit])))``
    (``ident[-1]`` read as ``NONE_HASH``) for every whole unit of ``tokens``."""
    prev = ident[-1] if ident else NONE_HASH
    for k in range(len(ident), len(tokens) // unit):
        prev = hash((prev, tuple(tokens[k * unit:(k + 1) * unit])))
        ident.append(prev)


def ident_at(ident: list[int], unit: int, end: int) -> int | None:
    """The identity of the prefix ``[0, end)`` in the chain ``ident`` (None: not that long)."""
    k = end // unit - 1
    if k < 0:
        return NONE_HASH
    return ident[k] if k < len(ident) else None


class Request:
    """A request: its tokens, the identities of their prefixes, its block tables.

    ``ident[k]`` is a chained hash of the tokens ``[0, (k + 1) * unit)``: the token identity of a
    prefix. vLLM's block hashes (one per ``tokens_per_hash`` tokens) are a subsequence of it.
    ``tables[gid]`` is the request's block table in group ``gid`` (vLLM's managers keep it in
    ``req_to_blocks``).
    """

    __slots__ = ("rid", "index", "spec", "tokens", "num_prompt", "max_tokens", "num_computed",
                 "ident", "unit", "status", "tables", "arrival", "off", "num_cached",
                 "load_target", "finish_step", "num_cached_blocks", "quiet_until", "fast_until",
                 "fast_blocks", "key_lists", "prefix_of", "prefix_units",
                 "shared_prefix_boundary", "skip_reading_prefix_cache")

    def __init__(self, rid: str, index: int, spec, prompt: Sequence[int], max_tokens: int,
                 unit: int, num_groups: int, prefix_of: Request | None = None,
                 prefix_units: int = 0):
        """``prefix_of``: an earlier request whose prompt starts with the same tokens as this one
        for ``prefix_units`` whole units: their identities (and keys) are its own, not hashed
        again."""
        self.rid, self.index, self.spec = rid, index, spec
        self.tokens: list[int] = list(prompt)      # a copy: prompt may be another request's
        self.num_prompt = len(prompt)
        self.max_tokens = max_tokens
        self.num_computed = 0
        self.unit = unit
        self.ident: list[int] = prefix_of.ident[:prefix_units] if prefix_of is not None else []
        self.prefix_of = prefix_of
        self.prefix_units = len(self.ident)
        self.status = WAITING
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.arrival = spec.arrival if spec is not None else 0
        # SamplingParams.skip_reading_prefix_cache: no GPU prefix hit, no CPU lookup
        self.skip_reading_prefix_cache: bool = spec is not None and spec.skip_reading_prefix_cache
        self.off: Any = None    # the connector's RequestOffloadState (offload.RequestOffloadState)
        self.num_cached = 0        # GPU prefix hit tokens at admission
        self.load_target = 0       # tokens computed once the in-flight load completes
        self.finish_step: int | None = None
        self.num_cached_blocks = [0] * num_groups   # blocks already offered to the prefix cache
        self.quiet_until = -1      # see KVCacheManager.quiet_bound
        self.fast_until = -1       # the model's quiet-decode bound (Model._fast_bound)
        self.fast_blocks: list[tuple[int, int]] = []   # see Model._fast_bound
        # keys(): the key lists made so far, by (group id, stride)
        self.key_lists: dict[tuple[int, int], list[Key]] = {}
        self._extend_ident()
        # set at each GPU lookup (KVCacheManager.get_computed_blocks): the full-attention groups'
        # longer hit when a sparse-retention group cut it short, else 0; a reachable boundary of
        # the sliding-window and Mamba masks (cache_blocks, the connector's store mask)
        self.shared_prefix_boundary = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def _extend_ident(self) -> None:
        extend_ident(self.ident, self.tokens, self.unit)

    def keys(self, gid: int, stride: int) -> list[Key]:
        """``[make_key(gid, ident_at(k * stride)) for k = 1, 2, ...]`` as far as the tokens are
        known: the GPU prefix-cache keys of a group's blocks (``stride`` = its block size) and
        the offload keys of its chunks (``stride`` = tokens per chunk). Built once per (group,
        stride) and extended as tokens arrive; the lists are shared, callers copy the slices
        they keep."""
        if not gid and stride == self.unit:
            return self.ident       # group 0's keys a unit apart: the identities themselves
        keys = self.key_lists.get((gid, stride))
        per = stride // self.unit
        if keys is None:
            # the keys of the shared prefix are the earlier request's (all known from the start)
            p = self.prefix_of
            keys = p.keys(gid, stride)[:self.prefix_units // per] if p is not None else []
            self.key_lists[(gid, stride)] = keys
        ident = self.ident
        for j in range((len(keys) + 1) * per - 1, len(ident) // per * per, per):
            keys.append(make_key(gid, ident[j]))
        return keys

    def append_tokens(self, new: list[int]) -> None:
        self.tokens.extend(new)
        self._extend_ident()

    def ident_at(self, end: int) -> int | None:
        """Identity of the prefix ``[0, end)`` (``end`` a multiple of the unit), None if unknown."""
        return ident_at(self.ident, self.unit, end)

    def worker_view(self, accepted: list[int]) -> WorkerView:
        """The request as the worker sees it in a step whose accepted drafts the scheduler learns
        only with the step's output (async scheduling)."""
        return WorkerView(self, accepted)

    @property
    def finished(self) -> bool:
        return self.status >= FINISHED


class WorkerView:
    """A request with the drafts the worker accepted in a step its scheduler has not seen the
    output of: its block tables and the identities of its prefixes, known tokens and accepted
    drafts, as the content shadow reads them (``tables``, ``ident_at``)."""

    __slots__ = ("tables", "unit", "ident")

    def __init__(self, req: Request, accepted: list[int]):
        self.tables, self.unit = req.tables, req.unit
        self.ident = list(req.ident)
        extend_ident(self.ident, req.tokens + accepted, req.unit)

    def ident_at(self, end: int) -> int | None:
        return ident_at(self.ident, self.unit, end)
