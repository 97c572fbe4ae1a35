"""``simsched compare``: what a change of vLLM changes, on the same cases.

The real tests build patches of 0.30.0 from the installed releases' own files
(``bench/proposal_patches.py``), add them as derived targets in a home of their own (links to
the installed base env, 0.30.0 and 0.31.0), and compare them with 0.30.0 step by step. They need
`simsched releases install 0.30.0 0.31.0`; without it they fail."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.compare import WHATS, Compare, CompareError, compare, seed_cases
from simsched.case import Case
from simsched.replay import observe
from simsched.targets import Releases, ReleaseTarget
from simsched.vllm import derived, releases as rel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import proposal_patches  # noqa: E402

BOOT = ["crash:AssertionError:build_offloading_config"]


def quiet(_: str) -> None:
    pass


# --- the model's profiles: no release needed -----------------------------------------------

def test_profiles_compare_and_the_same_seed_gives_the_same_result(tmp_path):
    """``every-group`` (0.29.0's rule: every group asserted) against ``prefix-cacheable``: the
    ring boot assert is introduced, on the reference PR's layouts."""
    runs = []
    for i in range(2):
        data = compare("model:every-group", "model:prefix-cacheable", budget=120,
                       out=tmp_path / str(i), max_cases=150, progress=quiet)
        for kind in WHATS:
            for e in data.get(kind, []):
                e.pop("found_after_s", None)     # a time; everything else is the seed's
        runs.append({k: v for k, v in data.items() if k != "seconds"})
    assert runs[0] == runs[1]
    boot = [e for e in runs[0]["introduced"] if e["key"] == BOOT]
    assert len(boot) == 1 and boot[0]["layout"] == "full/16 + ring/4"
    assert "mla/64 + ring/4" in boot[0]["variant_layouts"]
    assert runs[0]["fixed"] == [] and runs[0]["tool_errors"] == []
    case = Case.from_json(json.loads((tmp_path / "0" / boot[0]["case"]).read_text()))
    assert [g.kind for g in case.layout.groups] == ["full", "ring"]
    assert "## Introduced: bugs of model:every-group" in (tmp_path / "0" / "compare.md").read_text()


def test_bad_targets(tmp_path):
    with Releases((), bases={}) as pool:
        with pytest.raises(CompareError, match="with itself"):
            Compare("model:every-group", "model:every-group", pool, tmp_path)
        with pytest.raises(CompareError, match="unknown profile 'nope'"):
            Compare("model:nope", "model:every-group", pool, tmp_path)
        with pytest.raises(CompareError, match="0.30.0: not an installed release"):
            Compare("0.30.0", "model:every-group", pool, tmp_path)


def test_cli_exit_code_says_whether_a_introduces_a_bug(tmp_path):
    def run(a, b):
        return subprocess.run([sys.executable, "-m", "simsched.cli", "compare", a, b,
                               "--cases", "20", "--out", str(tmp_path / a)], cwd=ROOT,
                              text=True, capture_output=True, timeout=300)
    bad = run("model:every-group", "model:prefix-cacheable")
    assert bad.returncode == 1 and "[introduced] crash:AssertionError:build_offloading_config" \
        in bad.stdout
    good = run("model:prefix-cacheable", "model:every-group")
    assert good.returncode == 0 and "[fixed] crash:AssertionError:build_offloading_config" \
        in good.stdout


# --- real: patches of 0.30.0 as targets ---------------------------------------------------------

@pytest.fixture(scope="module")
def home(tmp_path_factory):
    real = rel.simsched_home()
    have = {r.version: r for r in rel.installed(real)}
    missing = [v for v in ("0.30.0", "0.31.0") if v not in have]
    assert not missing, f"run `simsched releases install {' '.join(missing)}` first"
    home = tmp_path_factory.mktemp("home")
    (home / "releases").mkdir()
    (home / "base").symlink_to(real / "base", target_is_directory=True)
    for v in ("0.30.0", "0.31.0"):
        (home / "releases" / v).symlink_to(have[v].path, target_is_directory=True)
    old = os.environ.get("SIMSCHED_HOME")
    os.environ["SIMSCHED_HOME"] = str(home)
    yield home
    if old is None:
        del os.environ["SIMSCHED_HOME"]
    else:
        os.environ["SIMSCHED_HOME"] = old


def add(home: Path, name: str, tmp_path: Path) -> Path:
    patch = tmp_path / f"{name}.diff"
    patch.write_text(proposal_patches.PATCHES[name]())
    derived.add(name, "0.30.0", patch=patch, home=home, progress=quiet)
    return patch


def test_the_committed_patches_are_the_ones_built_from_the_releases(home):
    for name, build in proposal_patches.PATCHES.items():
        assert (ROOT / "examples" / "patches" / f"{name}.diff").read_text() == build(), name


def test_the_upstream_fix_fixes_the_boot_assert_and_introduces_nothing(home, tmp_path):
    """The change of offloading/config.py from 0.30.0 to 0.31.0 that scopes the offloaded
    groups to prefix-cacheable ones, as a patch of 0.30.0: the boot assert of the reference PR
    (``full/16 + ring/4``, ``mla/64 + ring/4``) is fixed; nothing is introduced on the
    config-level and step-level cases. The ring's store fence it unmasks (INV-6: 0.31.0 has
    it) is listed apart, as what the patched code reaches where 0.30.0 crashed."""
    add(home, "upstream-scope", tmp_path)
    # a number of cases, not a time: under load a budget goes to the workers' start-up
    data = compare("upstream-scope", "0.30.0", budget=600, out=tmp_path / "out",
                   max_cases=len(seed_cases(True)) + 200, progress=quiet)
    boot = [e for e in data["fixed"] if e["key"] == BOOT]
    assert len(boot) == 1, data["fixed"]
    layouts = [boot[0]["layout"]] + boot[0]["variant_layouts"]
    assert {"full/16 + ring/4", "mla/64 + ring/4"} <= set(layouts)
    assert boot[0]["reproduced"] and "AssertionError in build_offloading_config" in boot[0]["b"]
    assert data["introduced"] == [] and data["tool_errors"] == []
    assert ["invariant:INV-6", "ring"] in [e["key"] for e in data["unmasked"]]
    # cases ran step by step on both, not only their config chains
    assert min(data["real_steps"].values()) > 1000 and data["examples"] == len(seed_cases(True)) + 200


def test_a_wrong_patch_is_introduced_by_invariant_with_a_shrunk_case(home, tmp_path):
    """``no-realloc-fence``: build_connector_meta no longer flushes the store jobs reading a
    block allocated anew. INV-6 is introduced; the shrunk case shows it on the patch and not on
    0.30.0 when replayed alone. ``no-alloc-fence`` (the record in update_state_after_alloc
    only) changes nothing: 0.30.0 records the same blocks again from the scheduler output."""
    add(home, "no-realloc-fence", tmp_path)
    data = compare("no-realloc-fence", "0.30.0", budget=20, out=tmp_path / "out",
                   max_cases=len(seed_cases(True)) + 40, progress=quiet)
    inv6 = [e for e in data["introduced"] if e["key"][0] == "invariant:INV-6"]
    assert inv6 and data["fixed"] == [] and data["tool_errors"] == []
    e = inv6[0]
    assert e["reproduced"] and "INV-6" in e["a"] and "clean" in e["b"]
    assert e["first_difference"]["kind"] == "violation"
    case = Case.from_json(json.loads((tmp_path / "out" / e["case"]).read_text()))
    assert len(case.requests) <= 2
    with Releases.installed(["no-realloc-fence", "0.30.0"]) as pool:
        shown = {}
        for t in pool.targets():
            obs = observe(case, [], [t], {}, config=False)
            shown[t.name] = {str(o.signature) for o in obs if o.target == t.name}
    assert "invariant:INV-6" in shown["no-realloc-fence"]
    assert "invariant:INV-6" not in shown["0.30.0"]

    add(home, "no-alloc-fence", tmp_path)
    data = compare("no-alloc-fence", "0.30.0", budget=20, out=tmp_path / "control",
                   max_cases=len(seed_cases(True)) + 40, progress=quiet)
    assert all(data[w] == [] for w in ("fixed", "introduced", "changed", "tool_errors"))


def test_a_campaign_on_a_derived_target(home, tmp_path):
    """``simsched fuzz --releases NAME`` runs a derived target step by step like a release;
    its profile is its base release's."""
    if rel.find("upstream-scope", home) is None:
        add(home, "upstream-scope", tmp_path)
    out = tmp_path / "fuzz"
    r = subprocess.run([sys.executable, "-m", "simsched.cli", "fuzz", "--releases",
                        "upstream-scope", "--budget", "25", "--asserts", "on", "--out", str(out)],
                       cwd=ROOT, text=True, capture_output=True, timeout=600,
                       env={**os.environ, "SIMSCHED_HOME": str(home)})
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["releases_installed"] == ["upstream-scope"]
    assert report["summary"]["real_steps_per_release"]["upstream-scope"] > 0
    with Releases.installed(["upstream-scope"]) as pool:
        assert ReleaseTarget("upstream-scope", pool).profile.name == \
            ReleaseTarget("0.30.0", Releases(("0.30.0",))).profile.name
