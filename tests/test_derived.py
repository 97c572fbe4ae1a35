"""Derived targets: applying patches, overlaying trees, and every bad input as one line.

The unified-diff tests and the bad-input tests run on fake homes (no vLLM needed: each input
fails before the smoke import). The tests at the end build real targets on 0.30.0 (the base env
and 0.30.0 must be installed: `simsched releases install 0.30.0`) in a home of their own whose
base env and release are links to the installed ones."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simsched.vllm import derived, releases as rel, unidiff
from simsched.vllm.releases import ReleaseError

ROOT = Path(__file__).resolve().parent.parent
FILE = "vllm/x.py"
OLD = "".join(f"line {i}\n" for i in range(1, 21))


def patch_text(old: str, new: str, path: str = FILE) -> str:
    return unidiff.diff(path, old, new)


def tree_of(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


# --- the unified diff ------------------------------------------------------------------------

def test_patch_changes_creates_and_deletes(tmp_path):
    tree = tree_of(tmp_path / "t", {FILE: OLD, "vllm/gone.py": "x = 1\n"})
    new = OLD.replace("line 3\n", "line three\n").replace("line 18\n", "")
    text = patch_text(OLD, new) + patch_text("", "y = 2\n", "vllm/new.py").replace(
        "--- a/vllm/new.py", "--- /dev/null") + patch_text("x = 1\n", "", "vllm/gone.py").replace(
        "+++ b/vllm/gone.py", "+++ /dev/null")
    changed = unidiff.apply(unidiff.parse(text, "p.diff"), tree, "p.diff")
    assert changed == ["vllm/gone.py", "vllm/new.py", FILE]
    assert (tree / FILE).read_text() == new
    assert (tree / "vllm/new.py").read_text() == "y = 2\n"
    assert not (tree / "vllm/gone.py").exists()


def test_patch_applies_at_an_offset_and_keeps_a_missing_final_newline(tmp_path):
    old = OLD + "last"                                # no newline at the end
    new = old.replace("line 12\n", "line twelve\n").replace("last", "final")
    text = patch_text(old, new)
    assert "\\ No newline at end of file" in text
    shifted = "added 1\nadded 2\n" + old              # the hunks' line numbers are 2 off now
    tree = tree_of(tmp_path / "t", {FILE: shifted})
    unidiff.apply(unidiff.parse(text, "p.diff"), tree, "p.diff")
    assert (tree / FILE).read_text() == "added 1\nadded 2\n" + new


def test_patch_never_writes_through_a_hard_link(tmp_path):
    base = tree_of(tmp_path / "base", {FILE: OLD})
    (tmp_path / "t" / "vllm").mkdir(parents=True)
    os.link(base / FILE, tmp_path / "t" / FILE)
    unidiff.apply(unidiff.parse(patch_text(OLD, OLD + "more\n"), "p"), tmp_path / "t", "p")
    assert (base / FILE).read_text() == OLD and (tmp_path / "t" / FILE).read_text() != OLD


@pytest.mark.parametrize("text, needle", [
    ("not a diff\n", "p.diff: not a unified diff"),
    ("--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-a\n+b\n", "setup.py is outside the vllm/"),
    ("--- a/vllm/../x.py\n+++ b/vllm/../x.py\n@@ -1 +1 @@\n-a\n+b\n", "outside the vllm/"),
    ("diff --git a/vllm/a.py b/vllm/b.py\nrename from vllm/a.py\n", "a rename or copy"),
    ("--- a/vllm/a.py\n+++ b/vllm/b.py\n@@ -1 +1 @@\n-a\n+b\n", "a rename is not supported"),
    ("diff --git a/vllm/a.so b/vllm/a.so\nBinary files a/vllm/a.so and b/vllm/a.so differ\n",
     "a binary patch"),
    ("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,3 +1,3 @@\n-a\n+b\n", "truncated"),
    ("--- a/vllm/x.py\n+++ b/vllm/x.py\n", "vllm/x.py: no hunk"),
])
def test_unreadable_patches(text, needle):
    with pytest.raises(unidiff.PatchError, match=needle.replace("(", r"\(")):
        unidiff.parse(text, "p.diff")


def test_a_hunk_that_does_not_match_is_named(tmp_path):
    tree = tree_of(tmp_path / "t", {FILE: OLD})
    good = OLD.replace("line 2\n", "line two\n")
    bad = OLD.replace("line 15\n", "line 15 edited\n")
    text = patch_text(OLD, good) + patch_text(OLD.replace("line 16\n", "other\n"),
                                              bad.replace("line 16\n", "other\n")).replace(
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n", "")
    files = unidiff.parse(text, "fix.diff")
    with pytest.raises(unidiff.PatchError, match=r"fix.diff: hunk 2 of vllm/x.py \(@@ -12,"):
        unidiff.apply(files, tree, "fix.diff")
    assert (tree / FILE).read_text() == OLD          # nothing written


# --- bad input, on a fake home: one line, nothing left behind ---------------------------------

@pytest.fixture
def fake(tmp_path):
    closure = tmp_path / "closure.txt"
    closure.write_text("# fake\n")
    home = tmp_path / "home"
    (home / "base" / "bin").mkdir(parents=True)
    (home / "base" / "bin" / "python").symlink_to(sys.executable)
    (home / "base" / rel.BASE_MARKER).write_text(json.dumps({"closure_sha256": "x"}))
    release = home / "releases" / "0.30.0"
    (release / "vllm").mkdir(parents=True)
    (release / FILE).write_text(OLD)
    (release / rel.RELEASE_MARKER).write_text(json.dumps({"version": "0.30.0"}))
    taken = home / "derived" / "taken"
    taken.mkdir(parents=True)
    (taken / rel.DERIVED_MARKER).write_text(json.dumps({"name": "taken", "base": "0.30.0"}))
    return home


def cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simsched.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, "SIMSCHED_HOME": str(home)},
                          timeout=120)


def _patch(tmp_path: Path, old: str, new: str) -> Path:
    path = tmp_path / "fix.diff"
    path.write_text(patch_text(old, new))
    return path


@pytest.mark.parametrize("case, needle", [
    ("no-apply", "fix.diff: hunk 1 of vllm/x.py (@@ -1,7 +1,7 @@) does not apply"),
    ("no-vllm", "no vllm/ package there"),
    ("taken", "target 'taken' already exists; remove it first"),
    ("release-name", "target name '0.30.0'"),
    ("no-base", "--base 0.29.0: not an installed release (installed: 0.30.0)"),
    ("no-file", "--patch"),
    ("both", "not allowed with argument"),
])
def test_bad_input_is_one_line_and_leaves_nothing(fake, tmp_path, case, needle):
    wrong = _patch(tmp_path, OLD.replace("line 4", "line four"), OLD.replace("line 4", "LINE"))
    args = {"no-apply": ["fix", "--base", "0.30.0", "--patch", str(wrong)],
            "no-vllm": ["fix", "--base", "0.30.0", "--tree", str(tmp_path)],
            "taken": ["taken", "--base", "0.30.0", "--patch", str(wrong)],
            "release-name": ["0.30.0", "--base", "0.30.0", "--patch", str(wrong)],
            "no-base": ["fix", "--base", "0.29.0", "--patch", str(wrong)],
            "no-file": ["fix", "--base", "0.30.0", "--patch", str(tmp_path / "none.diff")],
            "both": ["fix", "--base", "0.30.0", "--patch", str(wrong), "--tree", "."]}[case]
    before = sorted(p.name for p in (fake / "derived").iterdir())
    r = cli(fake, "releases", "add", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    if case != "both":      # argparse's own usage message is two lines
        assert r.stderr.count("\n") == 1, r.stderr
    assert sorted(p.name for p in (fake / "derived").iterdir()) == before
    assert [t.version for t in rel.installed_derived(fake)] == ["taken"]


def test_remove(fake):
    r = cli(fake, "releases", "remove", "0.30.0")
    assert r.returncode == 2 and "no derived target '0.30.0' (a pinned release" in r.stderr
    assert r.stderr.count("\n") == 1
    assert cli(fake, "releases", "remove", "taken").returncode == 0
    assert rel.installed_derived(fake) == [] and (fake / "releases" / "0.30.0").exists()


def test_unknown_target_in_a_campaign_is_one_line(fake, tmp_path):
    r = cli(fake, "fuzz", "--releases", "nope", "--budget", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "nope: not a known vLLM release" in r.stderr
    assert "simsched releases add" in r.stderr and r.stderr.count("\n") == 1


def test_derived_targets_stand_apart_from_release_ranges():
    from fuzz.triage import regressed_fixed
    got = regressed_fixed(["0.29.0", "0.30.0", "fix"], ["0.31.0", "other"],
                          ["0.29.0", "0.30.0", "0.31.0", "fix", "other"])
    assert got == ("0.29.0 to 0.30.0: present since 0.29.0 (oldest run), fixed in 0.31.0; "
                   "fix: present; other: absent")


# --- real targets on 0.30.0 --------------------------------------------------------------------

@pytest.fixture(scope="module")
def linked_home(tmp_path_factory):
    """A home whose base env and 0.30.0 are links to the installed ones (derived targets built
    here never touch the user's home)."""
    real = rel.simsched_home()
    have = {r.version: r for r in rel.installed(real)}
    assert "0.30.0" in have, ("vLLM 0.30.0 is not installed: run `simsched releases install "
                              "0.30.0`")
    home = tmp_path_factory.mktemp("home")
    (home / "releases").mkdir()
    (home / "base").symlink_to(real / "base", target_is_directory=True)
    (home / "releases" / "0.30.0").symlink_to(have["0.30.0"].path, target_is_directory=True)
    return home


def test_tree_target_is_re_read_when_the_tree_changed(linked_home, tmp_path):
    base = rel.find("0.30.0", linked_home)
    sched = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
    original = (base.path / sched).read_text()
    tree = tree_of(tmp_path / "checkout", {
        "vllm/__init__.py": (base.path / "vllm/__init__.py").read_text(),
        sched: original + "\nSIMSCHED_EDIT = 1\n"})
    got = derived.add("dev", "0.30.0", tree=tree, home=linked_home, progress=lambda s: None)
    assert got.base == "0.30.0" and got.release == "0.30.0"
    marker = json.loads((got.path / rel.DERIVED_MARKER).read_text())
    assert marker["files"] == [sched] and marker["vllm_version"] == "0.30.0"
    assert (got.path / sched).read_text().endswith("SIMSCHED_EDIT = 1\n")
    assert (base.path / sched).read_text() == original        # the base is untouched
    assert os.stat(got.path / "vllm/config/__init__.py").st_ino == \
        os.stat(base.path / "vllm/config/__init__.py").st_ino   # links, not copies
    assert not derived.refresh(got, home=linked_home, progress=lambda s: None)
    (tree / sched).write_text(original + "\nSIMSCHED_EDIT = 2\n")
    assert derived.refresh(got, home=linked_home, progress=lambda s: None)
    assert (got.path / sched).read_text().endswith("SIMSCHED_EDIT = 2\n")
    derived.remove("dev", linked_home)
    assert rel.find("dev", linked_home) is None and base.path.exists()


def test_a_tree_that_does_not_import_is_one_line(linked_home, tmp_path):
    tree = tree_of(tmp_path / "checkout",
                   {"vllm/__init__.py": "import vllm.no_such_module\n"})
    with pytest.raises(ReleaseError) as e:
        derived.add("broken", "0.30.0", tree=tree, home=linked_home, progress=lambda s: None)
    assert str(e.value).startswith("broken: smoke import failed: ")
    assert "No module named 'vllm.no_such_module'" in str(e.value) and "\n" not in str(e.value)
    assert list((linked_home / "derived").iterdir()) == []
