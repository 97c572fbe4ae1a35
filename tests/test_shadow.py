"""The content shadow (simsched.shadow) against a straightforward reference: slots as
``(gid, end, ident)`` tuples, a chunk as the tuple of its blocks' slot contents, as the shadow
kept them before it held them field by field (GPU slots in three lists, CPU chunks flat).
Random writes, store reads and loads give the same slots, and INV-4 and INV-5 the same findings."""

import random
from types import SimpleNamespace

from simsched import invariants as inv
from simsched.model.block_pool import NULL
from simsched.model.request import Request, key_ident, make_key
from simsched.model.offloading_common import Job
from simsched.shadow import Shadow

UNIT = 4


class RefShadow:
    """The reference: a list of slot tuples."""

    def __init__(self, num_blocks, bpc):
        self.gpu, self.bpc = [None] * num_blocks, bpc

    def write_computed(self, req, groups, start, end):
        for gid, (bs, ring) in enumerate(groups):
            table = req.tables[gid]
            if not table:
                continue
            if ring:
                self.gpu[table[0]] = (gid, end, None)
                continue
            for i in range(start // bs, min(-(-end // bs), len(table))):
                if table[i] != NULL:
                    e = (i + 1) * bs
                    self.gpu[table[i]] = (gid, e, req.ident_at(e)) if e <= end \
                        else (gid, end, None)

    def read(self, bids):
        return tuple(self.gpu[b] for b in bids)

    def write_chunk(self, idx, bids, content):
        """The shadow's write_chunk as it was, over tuples."""
        n = len(content) if content else 0
        if n and n == self.bpc:
            for i, b in zip(idx, bids):
                self.gpu[b] = content[i % n]
            return
        if not n:
            return
        start = n - len(bids)
        if start < 0:
            start = max(0, n + start)
        for y in range(min(len(bids), n - start)):
            self.gpu[bids[y]] = content[start + y]


def ref_stored_chunk(step, job, item, content, req, geo, tpb):
    """check_stored_chunk as it was, over a tuple of slot tuples."""
    gid, c, hidx, key, blocks = item
    end = (hidx + 1) * geo.tokens_per_hash
    if not content or content[-1] is None or content[-1][1] != end \
            or content[-1][2] != key_ident(key) or content[-1][0] != gid:
        return inv.InvariantViolation("INV-4", step, f"job {job.jid} chunk g{gid}:{hidx} (tokens "
                                      f"up to {end}) holds {content[-1] if content else None}")
    for (i, _), got in zip(blocks, content):
        want = (gid, (i + 1) * tpb, req.ident_at((i + 1) * tpb))
        if got != want:
            return inv.InvariantViolation("INV-4", step, f"job {job.jid} chunk g{gid}:{hidx} "
                                          f"block index {i} holds {got}, key names {want}")
    return None


def ref_loaded(step, job, req, gpu, tpb):
    """check_loaded as it was, over the slot tuples."""
    for gid, c, hidx, key, blocks in job.items:
        for i, b in blocks:
            want = (gid, (i + 1) * tpb, req.ident_at((i + 1) * tpb))
            if gpu[b] != want:
                return inv.InvariantViolation("INV-5", step, f"load {job.jid} g{gid}:{hidx} "
                                              f"block {b} (index {i}) holds {gpu[b]}, want {want}")
    return None


def slots(shadow, n):
    return [shadow.content(b) for b in range(n)]


def flat(content):
    return tuple(x for s in content for x in (s if s is not None else (None, None, None)))


def pick_blocks(rng, req, n_groups, bpc):
    """A random group of ``req`` and a run of at most ``bpc`` blocks of its table: (group, table,
    lo, hi), or None if the group's table is empty."""
    g = rng.randrange(n_groups)
    table = req.tables[g]
    if not table:
        return None
    lo = rng.randrange(len(table))
    return g, table, lo, rng.randint(lo + 1, min(len(table), lo + bpc))


def test_shadow_matches_tuple_reference():
    rng = random.Random(7)
    for trial in range(300):
        nb, bpc, bs = rng.choice([6, 12, 24]), rng.choice([1, 2, 3]), rng.choice([4, 8])
        kinds = rng.sample(["full", "sliding_window", "mamba", "ring"], rng.randint(1, 3))
        rules = [(bs, k == "ring") for k in kinds]
        geo = SimpleNamespace(tokens_per_hash=bs, groups=[
            SimpleNamespace(group_id=g, tokens_per_block=bs) for g in range(len(rules))])
        sh, ref = Shadow(nb, bpc), RefShadow(nb, bpc)
        reqs = []
        for r in range(2):
            req = Request(f"r{r}", r, None, [rng.randrange(3) for _ in range(rng.randint(4, 40))],
                          64, UNIT, len(rules))
            for g in range(len(rules)):
                req.tables[g] = [rng.randrange(nb) for _ in range(rng.randint(0, 8))]
            reqs.append(req)
        stored = []
        for step in range(30):
            req = rng.choice(reqs)
            op = rng.random()
            if op < 0.5:
                start = rng.randrange(req.num_tokens)
                end = rng.randint(start + 1, req.num_tokens)
                want = sh.write_computed(req, rules, start, end)
                ref.write_computed(req, rules, start, end)
                assert all(isinstance(b, int) for b in want)
                # with fence counts: the first block written that is fenced (the same writes
                # again: the slots stay as written)
                fenced = [rng.choice([0, 0, 0, 1, 2]) for _ in range(nb)]
                first = sh.write_computed(req, rules, start, end, True, fenced)
                assert first == [b for b in want if fenced[b]][:1]
            elif op < 0.8 or not stored:
                # a store of one chunk of group g: its blocks, its key, read and checked
                picked = pick_blocks(rng, req, len(rules), bpc)
                if picked is None:
                    continue
                g, table, lo, hi = picked
                hidx = rng.choice([hi - 1, rng.randrange(len(table) + 2)])
                ident = req.ident_at((hidx + 1) * bs)
                key = make_key(g, ident) if ident is not None and rng.random() < 0.9 else 12345
                item = (g, hidx, hidx, key, [(i, table[i]) for i in range(lo, hi)])
                job = Job(step, req.rid, True, {key})
                job.set_chunks([item])
                c = sh.read_chunk(job.bids, 0, len(job.bids))
                content = ref.read([b for _, b in item[4]])
                assert c == flat(content) == sh.read(item[4])
                got = inv.check_stored_chunk(step, job, item, c, req, geo)
                want = ref_stored_chunk(step, job, item, content, req, geo, bs)
                assert (got and got.to_json()) == (want and want.to_json())
                stored.append((c, content))
            else:
                # a load of a stored chunk into some blocks of the request, then INV-5
                c, content = rng.choice(stored)
                picked = pick_blocks(rng, req, len(rules), bpc)
                if picked is None:
                    continue
                g, table, lo, hi = picked
                idx = list(range(lo, hi))
                bids = table[lo:hi]
                sh.write_chunk(idx, bids, 0, len(bids), c)
                ref.write_chunk(idx, bids, content)
                job = Job(step, req.rid, False, set())
                job.set_chunks([(g, lo, lo, 0, list(zip(idx, bids)))])
                got = inv.check_loaded(step, job, req, sh, geo)
                want = ref_loaded(step, job, req, ref.gpu, bs)
                assert (got and got.to_json()) == (want and want.to_json())
                # the harness's path: a chunk's flat content written back as it was read
                sh.write(list(zip(idx, bids)), flat(content))
                ref.write_chunk(idx, bids, content)
            assert slots(sh, nb) == ref.gpu, (trial, step)
