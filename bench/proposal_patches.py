"""The fix proposals of upstream PR #55037 as patches against vLLM 0.30.0, built from the
installed releases' own files, and their comparison (``simsched compare``) on the same cases.

Patches (``git diff`` format, paths ``a/vllm/...``; copies in ``examples/patches/``):

``upstream-scope``
    the change of ``offloading/config.py`` between 0.30.0 and 0.31.0 that scopes the offloaded
    groups to the prefix-cacheable ones (its first two hunks: ``get_offloading_group_ids`` and
    the worker stride it keeps; the other hunks of that diff are an unrelated MLA change);
``assert-only``
    #55037's proposal: the divisibility assert of ``build_offloading_config`` checks only the
    prefix-cacheable groups (every group when none is), the offloaded groups unchanged;
``scope-groups``
    #54743's proposal as the PR text describes it: ``get_offloading_group_ids`` returns the
    prefix-cacheable groups, nothing else changed;
``no-alloc-fence``
    ``update_state_after_alloc`` no longer records the blocks allocated in this batch. A
    control: 0.30.0's ``build_connector_meta`` records the same blocks again from the scheduler
    output, so this changes nothing a run shows;
``no-realloc-fence``
    a deliberately wrong patch: ``build_connector_meta`` no longer flushes the store jobs that
    still read a block allocated anew in this batch (the fence before a block is overwritten).

    python bench/proposal_patches.py --write examples/patches    # the patch files
    python bench/proposal_patches.py --budget 300                 # the comparison table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simsched.vllm import releases, unidiff  # noqa: E402

BASE = "0.30.0"
CONFIG = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py"
SCHEDULER = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"

ASSERT_OLD = """    for group in groups:
        assert group.tokens_per_block % tokens_per_hash == 0, ("""
ASSERT_NEW = """    # Groups that opt out of prefix caching (a CircularBufferSpec ring) are never
    # addressed by block hashes: the hash unit does not constrain their block size.
    # The same filter, fallback included, as resolve_kv_cache_block_sizes().
    asserted_groups = [
        group
        for group, (_, spec_group) in zip(groups, selected_groups)
        if spec_group.kv_cache_spec.prefix_cacheable
    ] or list(groups)
    for group in asserted_groups:
        assert group.tokens_per_block % tokens_per_hash == 0, ("""
SCOPE_OLD = """    if kv_cache_config.hisparse_host_num_blocks is None:
        return tuple(range(len(kv_cache_config.kv_cache_groups)))"""
SCOPE_NEW = """    if kv_cache_config.hisparse_host_num_blocks is None:
        return kv_cache_config.prefix_cacheable_group_ids"""
FENCE_OLD = """            self._current_batch_allocated_block_ids.update(
                block.block_id for block in group_blocks if block.block_id != 0
            )
"""
REALLOC_FENCE_OLD = """        # Flush jobs that contain re-allocated blocks.
        if (
            self._block_id_to_pending_jobs
            and not self._block_id_to_pending_jobs.keys().isdisjoint(
                self._current_batch_allocated_block_ids
            )
        ):
            self._current_batch_jobs_to_flush.update(
                jid
                for bid in self._current_batch_allocated_block_ids
                if bid in self._block_id_to_pending_jobs
                for jid in self._block_id_to_pending_jobs[bid]
            )

"""


def _source(version: str, path: str) -> str:
    found = releases.find(version)
    if found is None:
        raise SystemExit(f"vLLM {version} is not installed: simsched releases install {version}")
    return (found.path / path).read_text()


def _replaced(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the 0.30.0 source changed: {old[:60]!r} not found once"
    return text.replace(old, new)


def upstream_scope() -> str:
    """The first two hunks of 0.30.0 -> 0.31.0 of offloading/config.py, as a patch."""
    old, new = _source(BASE, CONFIG), _source("0.31.0", CONFIG)
    (fp,) = unidiff.parse(unidiff.diff(CONFIG, old, new), "0.30.0..0.31.0")
    fp.hunks = [h for h in fp.hunks if any("prefix_cacheable_group_ids" in x
                                           or "all_groups_selected" in x for x in h.old + h.new)]
    assert len(fp.hunks) == 2, "expected the scoping hunk and the stride hunk"
    return unidiff.diff(CONFIG, old, unidiff.patched_text(fp, old, "0.30.0..0.31.0"))


def assert_only() -> str:
    old = _source(BASE, CONFIG)
    return unidiff.diff(CONFIG, old, _replaced(old, ASSERT_OLD, ASSERT_NEW))


def scope_groups() -> str:
    old = _source(BASE, CONFIG)
    return unidiff.diff(CONFIG, old, _replaced(old, SCOPE_OLD, SCOPE_NEW))


def no_alloc_fence() -> str:
    old = _source(BASE, SCHEDULER)
    return unidiff.diff(SCHEDULER, old, _replaced(old, FENCE_OLD, ""))


def no_realloc_fence() -> str:
    old = _source(BASE, SCHEDULER)
    return unidiff.diff(SCHEDULER, old, _replaced(old, REALLOC_FENCE_OLD, ""))


PATCHES = {"upstream-scope": upstream_scope, "assert-only": assert_only,
           "scope-groups": scope_groups, "no-alloc-fence": no_alloc_fence,
           "no-realloc-fence": no_realloc_fence}
#: the comparisons of the table: (A, B); the model's profiles stand for the proposals
COMPARISONS = [("upstream-scope", BASE), ("assert-only", BASE), ("scope-groups", BASE),
               ("assert-only", "scope-groups"),
               ("assert-only", "model:fix-assert-only"),
               ("scope-groups", "model:prefix-cacheable"),
               ("model:fix-assert-only", "model:prefix-cacheable"),
               # baselines: what the model differs in from the releases its profiles stand for
               (BASE, "model:every-group"), ("0.31.0", "model:prefix-cacheable")]


def write(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, build in PATCHES.items():
        path = folder / f"{name}.diff"
        path.write_text(build())
        out.append(path)
    return out


def main() -> int:
    from fuzz.compare import WHATS, compare
    from simsched.vllm import derived
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--write", type=Path, help="write the patch files here and stop")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds per comparison")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("compare-proposals"))
    ap.add_argument("--table-only", action="store_true",
                    help="print the table of the comparisons already in --out")
    args = ap.parse_args()
    if args.write:
        for path in write(args.write):
            print(path)
        return 0
    folder = args.out / "patches"
    names = {f"pr-{name}" for name in PATCHES}
    if not args.table_only:
        write(folder)
    for name in [] if args.table_only else PATCHES:
        if releases.find(f"pr-{name}") is not None:
            derived.remove(f"pr-{name}")
        derived.add(f"pr-{name}", BASE, patch=folder / f"{name}.diff", progress=lambda s: None)
    rows = []
    for a, b in COMPARISONS:
        a, b = (f"pr-{x}" if f"pr-{x}" in names else x for x in (a, b))
        out = args.out / f"{a}--{b}"
        if args.table_only:
            data = json.loads((out / "compare.json").read_text())
        else:
            data = compare(a, b, budget=args.budget, seed_=args.seed, out=out,
                           progress=lambda s: print(s, file=sys.stderr, flush=True))
        rows.append(data)
        print(f"{a} vs {b}: " + ", ".join(f"{len(data[w])} {w}" for w in WHATS)
              + f" ({data['examples']} cases)", flush=True)
    print("\n| A | B | cases | " + " | ".join(WHATS) + " |")
    print("|---|---|---|" + "---|" * len(WHATS))
    for d in rows:
        cells = ["; ".join(f"{' '.join(map(str, e['key']))} (`{e['layout']}`)" for e in d[w])
                 or "none" for w in WHATS]
        print(f"| {d['a']} | {d['b']} | {d['examples']} | "
              + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
