"""vLLM-only repros: the plain release environment (`simsched releases env`), the generated
``test_vllm_*.py`` files (fuzz/vllm_repro.py) and their verification on real releases
(fuzz/vllm_repro_verify.py).

The real checks need `simsched releases install` to have run; they FAIL when a release they
name is missing."""

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz import vllm_repro, vllm_repro_verify
from simsched.case import Case
from simsched.connectors import Connector, SecondaryTier
from simsched.lockstep import HANDMADE
from simsched.vllm import installer as inst
from simsched.vllm import releases as rel
from simsched.vllm.releases import InstalledRelease, ReleaseError

ROOT = Path(__file__).resolve().parent.parent


def _installed(version: str) -> InstalledRelease:
    have = {r.version: r for r in rel.installed()}
    assert version in have, (f"vLLM {version} not installed in {rel.simsched_home()}: "
                             f"run `simsched releases install {version}`")
    return have[version]


def _cli(*args: str, cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "simsched.cli", *args], cwd=cwd, env=env,
                          text=True, capture_output=True, timeout=timeout)


# --- simsched releases env ---------------------------------------------------------------


def test_env_prefix_has_only_the_release_on_the_path(tmp_path):
    release = InstalledRelease("0.30.0", tmp_path / "releases" / "0.30.0",
                               tmp_path / "base" / "bin" / "python", "")
    parts = rel.env_prefix(release)
    assert parts[0] == "env" and parts[-1] == str(release.python)
    assigned = dict(p.split("=", 1) for p in parts if "=" in p)
    assert assigned["PYTHONPATH"] == str(release.path)     # no simsched root beside it
    assert assigned["PYTHONSAFEPATH"] == "1"               # nor the current directory
    assert assigned["VLLM_NO_USAGE_STATS"] == assigned["HF_HUB_OFFLINE"] == "1"
    assert ["-u", "PYTHONHOME"] == parts[1:3] and "PYTHONOPTIMIZE" in parts


def test_env_prefix_refuses_white_space(tmp_path):
    release = InstalledRelease("0.30.0", tmp_path / "my releases" / "0.30.0",
                               tmp_path / "base" / "bin" / "python", "")
    with pytest.raises(ReleaseError, match="white space"):
        rel.env_prefix(release)


def test_env_of_an_unknown_release_is_a_one_line_error():
    for version in ("0.99.0", "0.30.0,0.33.0"):
        proc = _cli("releases", "env", version)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.startswith("simsched: error: ") and proc.stderr.count("\n") == 1


def test_changed_closure_updates_the_base_in_place(tmp_path, monkeypatch):
    """A base env built from another closure is updated by pip, not removed and rebuilt
    (release workers of other processes may be running on it)."""
    home = tmp_path / "home"
    (home / "base" / "bin").mkdir(parents=True)
    (home / "base" / "bin" / "python").symlink_to(sys.executable)
    (home / "base" / rel.BASE_MARKER).write_text(json.dumps({"closure_sha256": "old"}))
    (home / "base" / "keep").write_text("a file of the installed env")
    closure = tmp_path / "closure.txt"
    closure.write_text("# one more pin\n")
    calls = []
    monkeypatch.setattr(inst, "_run", lambda cmd, what, **kw: calls.append(cmd) or "2.13.0+cpu\n")
    inst._ensure_base(home, closure, lambda msg: None)
    assert (home / "base" / "keep").exists()
    assert not any("venv" in cmd for cmd in calls)
    assert any(cmd[1:4] == ["-m", "pip", "install"] and str(closure) in cmd for cmd in calls)
    assert inst.base_ready(home, closure)


def test_release_env_runs_vllm_and_pytest_but_not_simsched(tmp_path):
    """From the simsched checkout itself (where the cwd would make simsched importable) and
    from an empty folder."""
    proc = _cli("releases", "env", "0.33.0")
    assert proc.returncode == 0, proc.stderr
    prefix = shlex.split(proc.stdout.strip())
    assert prefix[-1] == str(_installed("0.33.0").python)
    test = tmp_path / "test_plain.py"
    test.write_text(
        "import importlib.util\n\n"
        "import pytest\nimport vllm\n\n\n"
        "def test_plain():\n"
        "    assert vllm.__version__ == '0.33.0'\n"
        "    assert importlib.util.find_spec('simsched') is None\n"
        "    with pytest.raises(ModuleNotFoundError):\n"
        "        import simsched  # noqa: F401\n")
    for cwd in (ROOT, tmp_path):
        run = subprocess.run(prefix + ["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                       str(test)], cwd=cwd, text=True, capture_output=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "1 passed" in run.stdout


# --- the generated test files ------------------------------------------------------------


# PR #55037's boot assert with a full-attention group (``simsched replay``: AssertionError in
# build_offloading_config at start-up on 0.29.0 and 0.30.0; 0.31.0 leaves the ring out and
# runs both steps; 0.25.1-0.28.0 have no CircularBufferSpec)
RING = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                              {"kind": "ring", "block_size": 4}]},
        "requests": [{"id": "r0", "prompt": [[0, 64]]}]}
RING_FINDING = {
    "id": "ring-boot", "kind": "crash", "signature": "crash:AssertionError:build_offloading_config",
    "exception": "AssertionError", "function": "build_offloading_config",
    "file": "distributed/kv_transfer/kv_connector/v1/offloading/config.py",
    "message": "tokens_per_block=4 not divisible by tokens_per_hash=16.", "asserts": True,
    "layout": "full/16 + ring/4", "stage": "build_offloading_config",
    "releases_affected": ["0.29.0", "0.30.0"], "releases_clean": ["0.31.0"]}
# docs/repro/one_token_prompt_load_livelock.py as a case: b's one-token prompt is a's first
# chunk; `simsched replay` shows INV-8 on load on every release 0.25.1-0.33.0
LIVELOCK = {"layout": {"groups": [{"kind": "mla", "block_size": 1}],
                       "engine": {"num_gpu_blocks": 512}},
            "requests": [{"id": "a", "prompt": [[3, 8]], "decode": 1},
                         {"id": "b", "prompt": [[3, 1]], "arrival": 3, "decode": 4}],
            "timing": {"max_num_batched_tokens": 64, "max_num_seqs": 2}}
LIVELOCK_FINDING = {"id": "livelock", "kind": "invariant", "signature": "invariant:INV-8",
                    "invariant": "INV-8", "op": "load", "asserts": True, "layout": "mla/1",
                    "stage": "step",
                    "releases_affected": ["0.29.0", "0.33.0"], "releases_clean": []}


def _render(tmp_path: Path, case: dict, finding: dict) -> Path:
    text = vllm_repro.render(Case.from_json(case), finding)
    path = tmp_path / f"test_vllm_{vllm_repro.short_name(finding)}.py"
    path.write_text(text)
    return path


def _imports(path: Path) -> set[str]:
    import ast
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("case,finding,name", [
    (RING, RING_FINDING, "test_vllm_boot_assert_build_offloading_config.py"),
    (LIVELOCK, LIVELOCK_FINDING, "test_vllm_livelock_load.py"),
    ("MAX_LOAD", "MAX_LOAD_FINDING", "test_vllm_lookup_misses_ready_prefix.py"),
    ("TAIL", "TAIL_FINDING", "test_vllm_cap_store.py"),
    ("TAIL", "LOAD_CAP_FINDING", "test_vllm_cap_load.py"),
    ("TAIL", "STALL_FINDING", "test_vllm_stall.py"),
    ("EAGLE_CHUNKED", "EAGLE_CHUNKED_FINDING",
     "test_vllm_step_assert_find_longest_cache_hit.py"),
    ("RING_REWRITE", "RING_REWRITE_FINDING", "test_vllm_store_source_rewritten.py"),
    ("RING_KEYS", "RING_KEYS_FINDING", "test_vllm_store_key_names_other_chunk.py")])
def test_generated_file_is_short_plain_and_lint_clean(tmp_path, case, finding, name):
    case, finding = (globals()[x] if isinstance(x, str) else x for x in (case, finding))
    path = _render(tmp_path, case, finding)
    assert path.name == name
    assert _imports(path) - set(sys.stdlib_module_names) <= {"vllm", "torch", "pytest"}
    lines = path.read_text().splitlines()
    assert max(len(line) for line in lines) <= 100
    if len(case["requests"]) == 1:     # the issue's bound for a one-request case
        assert len(lines) < 150
    lint = subprocess.run([sys.executable, "-m", "pyflakes", str(path)], text=True,
                          capture_output=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert lines[0].startswith('"""[Bug][KV offloading]: ')


def test_a_mamba_spec_under_speculative_decoding_has_its_speculative_blocks(tmp_path):
    """As the harness builds it (build.ConfigBuilder.make_spec) and a deployment's
    MambaBase.get_kv_cache_spec does: num_speculative_blocks = the drafts of the case."""
    case = {**TAIL, "layout": {**TAIL["layout"], "engine": {
        **TAIL["layout"]["engine"], "speculative": {"method": "mtp", "num_tokens": 2}}}}
    path = _render(tmp_path, case, TAIL_FINDING)
    text = path.read_text()
    assert text.count("num_speculative_blocks=2") == 1
    assert max(len(line) for line in text.splitlines()) <= 100
    plain = _render(tmp_path, TAIL, TAIL_FINDING).read_text()
    assert "num_speculative_blocks" not in plain


def test_asserts_stripped_case_is_run_with_python_O(tmp_path):
    case = dict(RING, asserts=False)
    finding = dict(RING_FINDING, asserts=False, exception="ValueError",
                   function="update_offload_keys")
    text = _render(tmp_path, case, finding).read_text()
    assert "if __debug__:\n        pytest.fail(" in text
    assert "releases env 0.30.0) -O -m pytest" in text


def test_kinds_not_written_yet_say_why():
    spec = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                       "engine": {"speculative": {"method": "eagle", "num_tokens": 2}}},
            "requests": [{"id": "r0", "prompt": [[0, 64]]}]}
    spec["layout"]["engine"]["async_scheduling"] = True
    with pytest.raises(vllm_repro.NotGenerated, match="async scheduling"):
        vllm_repro.render(Case.from_json(spec), RING_FINDING)
    inv4 = dict(LIVELOCK_FINDING, invariant="INV-4", op="store")
    with pytest.raises(vllm_repro.NotGenerated, match="INV-4"):
        vllm_repro.render(Case.from_json(LIVELOCK), inv4)
    with pytest.raises(vllm_repro.NotGenerated, match="a Mamba group"):
        vllm_repro.render(Case.from_json(STALL), dict(RING_REWRITE_FINDING, asserts=True))
    unpaired = dict(RING_KEYS_FINDING, message="job 1 group 1: 2 keys, 1 source chunks")
    with pytest.raises(vllm_repro.NotGenerated, match="a key without source blocks"):
        vllm_repro.render(Case.from_json(RING_KEYS), unpaired)
    # the file drives the OffloadingConnector over its CPU tier: a finding of another path
    # gets no file that would pass where the path fails (the campaign's lazy SimpleCPU stall)
    stall = Case.from_json(STALL)
    lazy = dataclasses.replace(stall, layout=stall.layout.with_engine(
        connector=Connector("simple_cpu", lazy_offload=True)))
    with pytest.raises(vllm_repro.NotGenerated, match="connector=simple_cpu"):
        vllm_repro.render(lazy, RING_FINDING)
    tiered = dataclasses.replace(stall, layout=stall.layout.with_engine(
        secondary_tiers=(SecondaryTier("fs"),)))
    with pytest.raises(vllm_repro.NotGenerated, match="secondary_tiers"):
        vllm_repro.render(tiered, RING_FINDING)


def test_verify_wants_fail_where_affected_and_pass_where_clean(tmp_path, monkeypatch):
    """The verdict's logic, on canned runs: what each release's run must give."""
    runs = {"0.29.0": ("failed", "E   AssertionError: tokens_per_block=4"),
            "0.30.0": ("failed", "E   ValueError: something else"),
            "0.31.0": ("passed", "1 passed")}
    monkeypatch.setattr(vllm_repro_verify, "run_on", lambda path, r, asserts: runs[r.version])
    rels = [InstalledRelease(v, tmp_path, tmp_path, "") for v in runs]
    verdict = vllm_repro_verify.verify(tmp_path / "t.py", RING_FINDING, rels)
    assert not verdict.verified
    assert verdict.results == {"0.29.0": "failed", "0.30.0": "failed otherwise",
                               "0.31.0": "passed"}
    assert verdict.reason.startswith("0.30.0: failed otherwise, expected failed")
    runs["0.30.0"] = ("failed", "E   AssertionError: tokens_per_block=4")
    assert vllm_repro_verify.verify(tmp_path / "t.py", RING_FINDING, rels).verified
    wider = dict(RING_FINDING, releases_clean=["0.31.0", "0.32.0"])
    verdict = vllm_repro_verify.verify(tmp_path / "t.py", wider, rels)
    assert "not installed: 0.32.0" in verdict.reason


def test_repro_command_bad_input_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"layout": {"groups": []}}')
    for path in (bad, tmp_path / "missing.json"):
        proc = _cli("repro", str(path), "--no-shrink")
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.startswith("simsched: error: ") and proc.stderr.count("\n") == 1


# --- ISSUE.md ------------------------------------------------------------------------------


def test_issue_environment_gives_release_ranges_and_why_a_release_did_not_run():
    from fuzz import issue
    data = dict(RING_FINDING, releases_clean=["0.31.0", "0.32.0", "0.33.0"],
                releases_not_run={v: "unsupported: no CircularBufferSpec" for v in
                                  ("0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0")})
    assert issue.environment(data) == (
        "Present in 0.29.0 to 0.30.0; absent from 0.31.0 to 0.33.0; not reached on 0.25.1 to "
        "0.28.0 (unsupported: no CircularBufferSpec).")
    assert issue.environment(dict(data, asserts=False)).endswith("stripped (`python -O`).")


def test_issue_flags_are_only_what_the_case_sets():
    from fuzz import issue
    plain = issue.serve_flags(Case.from_json(RING))
    assert plain[0] == "--block-size 16" and len(plain) == 2
    assert '"kv_connector": "OffloadingConnector"' in plain[1]
    case = json.loads(json.dumps(RING))
    case["layout"]["engine"] = {"blocks_per_chunk": 2, "dcp_size": 2, "retention_interval": 32,
                                "speculative": {"method": "eagle", "num_tokens": 2},
                                "async_scheduling": True}
    case["timing"] = {"max_num_batched_tokens": 64}
    flags = issue.serve_flags(Case.from_json(case))
    assert '"kv_connector_extra_config": {"blocks_per_chunk": 2' in flags[1]
    assert flags[2:] == [
        "--prefix-cache-retention-interval 32", "--decode-context-parallel-size 2",
        '--speculative-config \'{"method": "eagle", "num_speculative_tokens": 2}\'',
        "--async-scheduling", "--max-num-batched-tokens 64"]


def test_write_repro_writes_an_issue_for_a_bug(tmp_path):
    """ISSUE.md of the livelock (a bug): vLLM's title, the family and flags, the steps in
    words, the layout caveat, the vLLM-only test inline; not for another class."""
    from fuzz import repro
    from fuzz.finding import Finding
    from simsched.outcome import Signature
    case = Case.from_json(LIVELOCK)
    finding = Finding(
        id="livelock", key=("invariant", "INV-8", "load", "mla"), klass="bug",
        signature=Signature("invariant", invariant="INV-8"), case=case, present_on=("0.33.0",),
        fingerprint=(), first_target="0.33.0", found_after_s=0.0, examples_before=0,
        outcome={"op": "load", "stage": "step", "detail": "b: loaded 3 times without being "
                 "scheduled"}, releases_affected=["0.29.0", "0.33.0"],
        releases_clean=[], installed=("0.29.0", "0.33.0"))
    folder = repro.write_repro(tmp_path, finding)
    text = (folder / "ISSUE.md").read_text()
    assert text.startswith("# [Bug][KV offloading]: a request loaded from the CPU tier again "
                           "and again is never scheduled")
    assert "Present in 0.29.0 and 0.33.0; not tried on 0.25.1 to 0.28.0 and 0.30.0 to " \
        "0.32.0." in text
    assert "a dense model" in text and "--block-size 1 \\\n" in text
    assert "--max-num-batched-tokens 64 \\\n  --max-num-seqs 2\n```" in text
    assert "2. `b` arrives at step 3: prompt the first 1 token of A, 4 output tokens." in text
    assert "built by hand" in text
    assert "```python\n\"\"\"[Bug][KV offloading]" in text and "not verified yet" in text
    assert "### Actual\n\nb: loaded 3 times without being scheduled." in text
    other = Finding(**{**finding.__dict__, "id": "gap", "klass": "model-gap"})
    assert not (repro.write_repro(tmp_path, other) / "ISSUE.md").exists()


# --- real: each generated file run through `simsched releases env` from an empty folder ----


# simsched.lockstep.HANDMADE["max_load_window"] (docs/repro/max_load_window_hit_loss.py): b's
# lookup, max_load_tokens 48, finds 0 where the ready chunks give 48 (`simsched replay`: INV-9 on
# 0.31.0 and 0.33.0, 0.28.0-0.30.0 clean: no max_load_tokens field; the generated file, run on
# all ten: fails on 0.31.0-0.33.0, passes on 0.25.1-0.30.0)
MAX_LOAD = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                                  {"kind": "sliding_window", "block_size": 16,
                                   "sliding_window": 32}],
                       "engine": {"num_gpu_blocks": 16}},
            "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                         {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                         {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8, "decode": 2,
                          "max_load_tokens": 48}]}
MAX_LOAD_FINDING = {
    "id": "max-load", "kind": "invariant", "signature": "invariant:INV-9", "invariant": "INV-9",
    "op": "lookup", "asserts": True, "layout": "full/16 + sliding_window/16(w=32)",
    "stage": "step", "message": "b: ready chunks cover 48 tokens beyond the GPU hit of 0, "
    "lookup found 0", "releases_affected": ["0.31.0", "0.33.0"], "releases_clean": ["0.30.0"]}
# tests/test_real_caps.py's partial tail under max_offload_tokens 0
# (docs/repro/partial_tail_ignores_max_offload.py): `simsched replay` shows INV-10 on 0.28.0 to
# 0.31.0 and 0.33.0 clean; the generated file, run on all ten: fails on 0.28.0-0.31.0, passes on
# 0.25.1-0.27.1 (no partial tail) and 0.32.0-0.33.0 (the 48-token prompt in one chunk)
TAIL = {"layout": {"groups": [{"kind": "full", "block_size": 32},
                              {"kind": "mamba", "block_size": 32, "mamba_cache_mode": "align"}],
                   "engine": {"num_gpu_blocks": 16, "prefix_match_unit": 16}},
        "requests": [{"id": "a", "prompt": [[7, 48]], "decode": 3, "max_offload_tokens": 0}]}
TAIL_FINDING = {
    "id": "tail-cap", "kind": "invariant", "signature": "invariant:INV-10", "invariant": "INV-10",
    "op": "cap", "asserts": True, "layout": "full/32 + mamba/32(align) | prefix_match_unit=16",
    "stage": "step", "message": "store 0 g0:2 holds tokens up to 48 beyond max_offload_tokens 0",
    "releases_affected": ["0.30.0"], "releases_clean": ["0.33.0"]}


# the file of a load-cap finding (no real release is known to load past max_load_tokens), on
# HANDMADE["load"] with b's max_load_tokens 32: 0.33.0 loads two of the three ready chunks
# (tests/test_real_oracles.py), 0.29.0 and 0.30.0 do not read the field
LOAD_CAP_FINDING = dict(TAIL_FINDING, message="load 3 brings tokens 0 to 64 (64) beyond "
                        "max_load_tokens 32")
LOAD_UNDER_CAP = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                             "engine": {"num_gpu_blocks": 8}},
                  "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                               {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                               {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8,
                                "decode": 2, "max_load_tokens": 32}]}


def _control(case: dict, **group) -> dict:
    out = json.loads(json.dumps(case))
    out["layout"]["groups"][0].update(group)
    return out


def _pool(case: dict, blocks: int) -> dict:
    out = json.loads(json.dumps(case))
    out["layout"]["engine"]["num_gpu_blocks"] = blocks
    return out


# No release is known to stall a pool it accepts; the quiet-tier check is shown on
# simsched.lockstep.HANDMADE["mamba_stall"], whose 8 blocks a deployment refuses at start-up
# (check_enough_kv_cache_memory; the hand-built KVCacheConfig skips that check): b waits for a
# block forever once f holds the pool. With 16 blocks every request runs.
STALL = {"layout": {"groups": [{"kind": "full", "block_size": 16},
                               {"kind": "mamba", "block_size": 16, "mamba_cache_mode": "align"}],
                    "engine": {"num_gpu_blocks": 8}},
         "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                      {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                      {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8, "decode": 2}]}
STALL_FINDING = {
    "id": "stall", "kind": "invariant", "signature": "invariant:INV-8", "invariant": "INV-8",
    "op": "liveness", "asserts": True, "layout": "full/16 + mamba/16(align)", "stage": "step",
    "message": "no progress for 9 steps with the tier quiet; stuck: ['b']",
    "releases_affected": ["0.30.0"], "releases_clean": []}


#: AssertionError-find_longest_cache_hit-62d723 of the 600 s campaign on 0.30.0 and 0.33.0: a
#: lone chunked-local group with EAGLE, refused by an assert at the first lookup (0.28.0 on)
EAGLE_CHUNKED = {"layout": {"groups": [{"kind": "chunked_local", "block_size": 16,
                                        "attention_chunk_size": 64}],
                            "engine": {"speculative": {"method": "eagle", "num_tokens": 1}}},
                 "requests": [{"id": "r0", "prompt": [[0, 64]]}]}
EAGLE_CHUNKED_FINDING = {
    "id": "eagle-chunked", "kind": "crash", "signature": "crash:AssertionError:"
    "find_longest_cache_hit", "exception": "AssertionError", "function": "find_longest_cache_hit",
    "file": "v1/core/single_type_kv_cache_manager.py", "stage": "schedule", "asserts": True,
    "layout": "chunked_local/16(w=64)", "releases_affected": ["0.30.0", "0.33.0"],
    "releases_clean": []}

#: a CPU hit loaded with latencies 2 and 3 and two-block chunks, a request withdrawn before it
#: arrives
STAND_IN = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                       "engine": {"num_gpu_blocks": 8, "blocks_per_chunk": 2}},
            "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 2},
                         {"id": "f", "prompt": [[9, 96]], "arrival": 4, "decode": 1},
                         {"id": "x", "prompt": [[9, 16]], "arrival": 6, "abort_at": 5},
                         {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 8, "decode": 2}],
            "timing": {"store_latency": 2, "load_latency": 3}}
#: INV-6-write-ring-5b9ac3 of the 600 s campaign on 0.30.0 and 0.33.0: with asserts stripped, a
#: lone ring group is offloaded (0.29.0-0.30.0); its decode rewrites the ring's block while the
#: store of the prompt still reads it. 0.31.0 on offload no ring ("no eligible cache groups")
RING_REWRITE = {"layout": {"groups": [{"kind": "ring", "block_size": 4}]},
                "requests": [{"id": "r0", "prompt": [[0, 64]], "decode": 4}],
                "timing": {"store_latency": 2}, "asserts": False}
RING_REWRITE_FINDING = {
    "id": "INV-6-write-ring-5b9ac3", "kind": "invariant", "signature": "invariant:INV-6",
    "invariant": "INV-6", "op": "write", "asserts": False, "layout": "ring/4",
    "message": "block 1 written by request r0 while store job 0 still reads it",
    "releases_affected": ["0.30.0"], "releases_clean": []}

#: INV-3-store-ring-4cb7cd of the same campaign: with asserts stripped, the ring's 132-token
#: chunk is keyed by the hash of the prompt's first 128 tokens (0.29.0-0.30.0; the assert that
#: asks a chunk to be a whole number of hash blocks is gone)
RING_KEYS = {"layout": {"groups": [{"kind": "mla", "block_size": 64},
                                   {"kind": "ring", "block_size": 132}]},
             "requests": [{"id": "r0", "prompt": [[0, 64]]},
                          {"id": "r1", "prompt": [[0, 128], [101, 16]]}], "asserts": False}
RING_KEYS_FINDING = {
    "id": "INV-3-store-ring-4cb7cd", "kind": "invariant", "signature": "invariant:INV-3",
    "invariant": "INV-3", "op": "store", "asserts": False, "layout": "mla/64 + ring/132",
    "message": "job 1 group 1: key of hash 1 paired with chunk 0",
    "releases_affected": ["0.30.0"], "releases_clean": ["0.33.0"]}

#: name -> (case, finding) of each file the module runs on real releases
GENERATED = {
    "pairs_control": (STAND_IN, dict(RING_KEYS_FINDING, asserts=True)),
    # the INV-6 check on stores, loads, fences and an abort that break nothing
    "writes_control": (STAND_IN, dict(RING_REWRITE_FINDING, asserts=True)),
    "eagle_chunked": (EAGLE_CHUNKED, EAGLE_CHUNKED_FINDING),
    "ring": (RING, RING_FINDING), "livelock": (LIVELOCK, LIVELOCK_FINDING),
    # two-token blocks: b's one token fills no chunk, nothing is loaded (`simsched replay`:
    # clean on 0.29.0 and 0.33.0)
    "livelock_control": (_control(LIVELOCK, block_size=2), LIVELOCK_FINDING),
    "max_load": (MAX_LOAD, MAX_LOAD_FINDING), "tail_cap": (TAIL, TAIL_FINDING),
    "stall": (STALL, STALL_FINDING), "stall_control": (_pool(STALL, 16), STALL_FINDING),
    "load_cap": (LOAD_UNDER_CAP, LOAD_CAP_FINDING),
    # lookups the harness's INV-9 oracle finds clean on 0.30.0 and 0.33.0
    # (tests/test_real_oracles.py::test_real_lookups_meet_the_oracle)
    **{f"lookup_{name}": (HANDMADE[name], MAX_LOAD_FINDING)
       for name in ("load", "window_load", "mamba_load")}}
RUN_ON = ("0.29.0", "0.30.0", "0.31.0", "0.33.0")


#: the files of asserts-stripped cases, run under python -O on these releases
STRIPPED = {"ring_rewrite": (RING_REWRITE, RING_REWRITE_FINDING),
            "ring_keys": (RING_KEYS, RING_KEYS_FINDING)}
STRIPPED_ON = ("0.30.0", "0.33.0")


def _run_generated(folder: Path, files: dict, versions, optimize: bool) -> dict:
    """Every file of ``files`` run once per release, all in one pytest process from a folder
    holding only them: {(name, release): (outcome, pytest's summary line)}."""
    import re
    for name, (case, finding) in files.items():
        (folder / f"test_{name}.py").write_text(vllm_repro.render(Case.from_json(case), finding))
    out = {}
    for version in versions:
        proc = subprocess.run(rel.env_prefix(_installed(version)) + (["-O"] if optimize else []) + [
            "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "."], cwd=folder,
            text=True, capture_output=True, timeout=600,
            env={**os.environ, "COLUMNS": "1000"})    # summary lines not cut
        for m in re.finditer(r"^(PASSED|FAILED) test_(\w+)\.py::\S+(.*)$", proc.stdout, re.M):
            out[(m.group(2), version)] = (m.group(1).lower(), m.group(3))
        missing = [n for n in files if (n, version) not in out]
        assert not missing, f"{version}: no result for {missing}: {proc.stdout[-3000:]}"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _run_generated(tmp_path_factory.mktemp("generated"), GENERATED, RUN_ON, False)


@pytest.fixture(scope="module")
def stripped_runs(tmp_path_factory):
    return _run_generated(tmp_path_factory.mktemp("stripped"), STRIPPED, STRIPPED_ON, True)


def test_boot_assert_fails_where_present_and_passes_where_fixed(runs):
    assert [runs[("ring", v)][0] for v in ("0.29.0", "0.30.0", "0.31.0")] == \
        ["failed", "failed", "passed"]
    assert "AssertionError" in runs[("ring", "0.30.0")][1]


def test_a_step_assert_under_speculative_decoding_fails_where_present(runs):
    for v in RUN_ON:
        assert runs[("eagle_chunked", v)] == ("failed", " - AssertionError: Hybrid KV cache is "
                                              "not supported for eagle + chunked local "
                                              "attention."), v


def test_a_rewritten_store_source_fails_where_present_and_its_control_passes(runs,
                                                                            stripped_runs):
    """INV-6 inline: the offloaded ring of 0.30.0 under python -O (0.33.0 offloads no ring and
    refuses the lone ring); the same check on a run with stores, loads and fences passes
    everywhere."""
    for v in RUN_ON:
        assert runs[("writes_control", v)][0] == "passed", v
    assert stripped_runs[("ring_rewrite", "0.30.0")] == (
        "failed", " - AssertionError: blocks [1] written while a store still reads them")
    assert "no eligible cache groups" in stripped_runs[("ring_rewrite", "0.33.0")][1]


def test_a_key_of_another_chunk_fails_where_present_and_its_control_passes(runs, stripped_runs):
    """INV-3 inline: the offloaded ring of 0.30.0 under python -O, clean on 0.33.0 (no ring is
    offloaded); the same check on a run with stores, loads and fences passes everywhere."""
    for v in RUN_ON:
        assert runs[("pairs_control", v)][0] == "passed", v
    assert stripped_runs[("ring_keys", "0.30.0")] == (
        "failed", " - AssertionError: g1: the key of tokens to 128 keys chunk 0 (to 132)")
    assert stripped_runs[("ring_keys", "0.33.0")][0] == "passed"


def test_livelock_fails_where_present_and_its_control_passes(runs):
    """No release is clean of the one-token livelock: the same workload with two-token blocks
    is the file's passing control."""
    for v in ("0.29.0", "0.33.0"):
        assert runs[("livelock", v)] == ("failed", " - AssertionError: b loaded 3 times, never "
                                                   "scheduled"), v
        assert runs[("livelock_control", v)][0] == "passed", v


def test_lookup_missing_a_ready_prefix_fails_where_present_and_passes_where_clean(runs):
    """INV-9 inline: b's lookup against the chunks the CPU tier holds ready, the same numbers
    as the harness's oracle."""
    for v in ("0.31.0", "0.33.0"):
        assert runs[("max_load", v)][0] == "failed", v
        assert "b: the CPU tier holds 48 tokens ready beyond the GPU hit of 0; the lookup " \
            "found 0" in runs[("max_load", v)][1], v
    assert runs[("max_load", "0.30.0")][0] == "passed"   # reads no max_load_tokens
    assert runs[("max_load", "0.29.0")][0] == "passed"


def test_lookup_check_passes_where_the_harness_oracle_is_clean(runs):
    for name in ("load", "window_load", "mamba_load"):
        for v in ("0.30.0", "0.33.0"):
            assert runs[(f"lookup_{name}", v)][0] == "passed", (name, v)


def test_store_past_max_offload_tokens_fails_where_present_and_passes_where_clean(runs):
    for v in ("0.29.0", "0.30.0", "0.31.0"):
        assert runs[("tail_cap", v)] == ("failed", " - AssertionError: keys to [48, 48], "
                                                   "max_offload_tokens 0"), v
    assert runs[("tail_cap", "0.33.0")][0] == "passed"


def test_quiet_stall_fails_where_the_scheduler_stalls_and_passes_with_room(runs):
    """b waits for a block forever; on 0.33.0 f too, preempted at its second chunk (0.32.0+
    cut its 96-token prefill 80 + 16: docs/invariants.md, "align-mode Mamba requests stall")."""
    stuck = {v: "['f', 'b']" if v == "0.33.0" else "['b']" for v in RUN_ON}
    for v in RUN_ON:
        assert runs[("stall", v)] == ("failed", f" - AssertionError: {stuck[v]}: nothing "
                                                "scheduled, no transfer for 9 steps"), v
        assert runs[("stall_control", v)][0] == "passed", v


def test_load_within_max_load_tokens_passes(runs):
    """The load-cap check has no real bug to fail on; it must not fail a release that keeps
    to the cap (0.31.0, 0.33.0) or does not read it (0.29.0, 0.30.0)."""
    assert {v: runs[("load_cap", v)][0] for v in RUN_ON} == dict.fromkeys(RUN_ON, "passed")


def test_verify_runs_a_generated_invariant_file_from_an_empty_folder(tmp_path):
    """fuzz.vllm_repro_verify.verify end to end (each release's plain environment, an empty folder),
    on the INV-10 file: it fails with its own message where present, passes where clean."""
    path = _render(tmp_path, TAIL, TAIL_FINDING)
    verdict = vllm_repro_verify.verify(path, TAIL_FINDING,
                                       [_installed(v) for v in ("0.30.0", "0.33.0")])
    assert verdict.results == {"0.30.0": "failed", "0.33.0": "passed"}, verdict.reason
    assert verdict.verified


def test_repro_command_writes_a_verified_step_crash_with_asserts_stripped(tmp_path):
    """`simsched repro` on a hand-written case: the ring with asserts stripped gets past the
    boot assert and the first step's update_offload_keys raises ValueError (islice) on 0.30.0;
    0.31.0 leaves the ring out and runs clean (both from `simsched replay`)."""
    case = tmp_path / "ring.json"
    case.write_text(json.dumps(dict(RING, asserts=False)))
    proc = _cli("repro", str(case), "--out", str(tmp_path / "out"), "--no-shrink",
                "--releases", "0.30.0,0.31.0", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified: 0.30.0 failed, 0.31.0 passed" in proc.stdout
    out = tmp_path / "out"
    finding = json.loads((out / "finding.json").read_text())
    assert (finding["exception"], finding["function"]) == ("ValueError", "update_offload_keys")
    test = out / "test_vllm_step_crash_update_offload_keys.py"
    assert "releases env 0.30.0) -O -m pytest" in test.read_text()
    readme = (out / "README.md").read_text()
    assert "`test_repro.py`: runs the case on simsched's harness" in readme
    assert f"`{test.name}`: needs vLLM alone" in readme and "; verified (" in readme
    assert (out / "test_repro.py").exists()
    issue = (out / "ISSUE.md").read_text()
    assert issue.startswith("# [Bug][KV offloading]: ValueError in update_offload_keys")
    assert "Present in 0.30.0; absent from 0.31.0" in issue and "`python -O`" in issue
    assert "verified from an empty folder: 0.30.0 failed, 0.31.0 passed" in issue
    assert test.read_text().rstrip() in issue


def test_repro_command_writes_a_verified_lookup_miss(tmp_path):
    """`simsched repro` on the hand-written INV-9 case: the finding, its vLLM-only test verified
    (fails on 0.33.0, passes on 0.30.0) and its ISSUE.md."""
    case = tmp_path / "max_load.json"
    case.write_text(json.dumps(MAX_LOAD))
    proc = _cli("repro", str(case), "--out", str(tmp_path / "out"), "--no-shrink",
                "--releases", "0.30.0,0.33.0", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified: 0.30.0 passed, 0.33.0 failed" in proc.stdout
    out = tmp_path / "out"
    finding = json.loads((out / "finding.json").read_text())
    assert (finding["invariant"], finding["op"]) == ("INV-9", "lookup")
    issue = (out / "ISSUE.md").read_text()
    assert issue.startswith("# [Bug][KV offloading]: a prefix ready in the CPU tier is not hit "
                            "by the lookup")
    assert "gpt-oss (full + sliding-window attention)" in issue
    assert "2. `f` arrives at step 4: prompt 96 tokens of B" in issue
    assert "`max_load_tokens=48`" in issue and "Present in 0.33.0; absent from 0.30.0" in issue


COUNTING_DRIVER = '''import importlib.util, json, sys, tempfile
from pathlib import Path
spec = importlib.util.spec_from_file_location("generated", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
counts = {"steps": 0, "stores": 0, "loads": 0}
schedule = mod.Scheduler.schedule
def counted(self):
    out = schedule(self)
    counts["steps"] += 1
    counts["stores"] += len(out.kv_connector_metadata.store_jobs or {})
    counts["loads"] += len(out.kv_connector_metadata.load_jobs or {})
    return out
mod.Scheduler.schedule = counted
test = next(getattr(mod, n) for n in dir(mod) if n.startswith("test_"))
with tempfile.TemporaryDirectory() as tmp:
    test(Path(tmp))
print(json.dumps(counts))
'''


#: EAGLE with three drafts a step, accepted 3, 0, 1, 0 in turn (a, the last to finish) or all
#: (b): the steps it takes to decode depend on every draft proposed and accepted
SPEC_STAND_IN = {"layout": {"groups": [{"kind": "full", "block_size": 16}],
                            "engine": {"speculative": {"method": "eagle", "num_tokens": 3}}},
                 "requests": [{"id": "a", "prompt": [[7, 64]], "decode": 24,
                               "accept": [3, 0, 1, 0]},
                              {"id": "b", "prompt": [[7, 64], [8, 20]], "arrival": 1,
                               "decode": 6}]}


@pytest.mark.parametrize("case", [STAND_IN, SPEC_STAND_IN], ids=["transfers", "speculative"])
def test_worker_stand_in_plays_the_steps_the_harness_plays(tmp_path, case):
    """The generated file's engine loop and worker stand-in against simsched's harness on the
    same release: the same schedule() calls, store jobs and load jobs."""
    from simsched.lockstep import lockstep
    from simsched.targets import Releases
    release = _installed("0.33.0")
    with Releases.installed(["0.33.0"], timeout=120) as pool:
        real = lockstep(Case.from_json(case), "0.33.0", pool).real
    assert real["status"] == "ok", real
    want = {k: real["counters"][k] for k in ("steps", "stores", "loads")}
    assert want["loads"] >= 1
    path = _render(tmp_path, case, RING_FINDING)
    driver = tmp_path / "count.py"
    driver.write_text(COUNTING_DRIVER)
    run = subprocess.run(rel.env_prefix(release) + [str(driver), str(path)], cwd=tmp_path,
                         text=True, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == want
