"""Installing vLLM releases: unit tests on a fake home (fast, no network), plus one real check
that the default home holds working releases."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simsched.vllm import installer as inst
from simsched.vllm import release_cli
from simsched.vllm import releases as rel
from simsched.vllm.releases import InstalledRelease, Release, ReleaseError


def fake_home(tmp_path: Path, closure: Path) -> Path:
    """A home whose base env looks complete: marker for `closure`, python = this interpreter."""
    home = tmp_path / "home"
    bin_dir = home / "base" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    marker = {"closure_sha256": inst.sha256_of(closure), "torch": "fake"}
    (home / "base" / rel.BASE_MARKER).write_text(json.dumps(marker))
    return home


def fake_release(home: Path, version: str, closure: Path, sha: str = "ab" * 32) -> Path:
    path = home / "releases" / version
    path.mkdir(parents=True)
    marker = {"version": version, "wheel_sha256": sha, "closure_sha256": inst.sha256_of(closure)}
    (path / rel.RELEASE_MARKER).write_text(json.dumps(marker))
    return path


@pytest.fixture
def closure(tmp_path: Path) -> Path:
    path = tmp_path / "closure.txt"
    path.write_text("# fake closure\n")
    return path


class CountingDownloader:
    def __init__(self, payload: bytes = b"not a wheel"):
        self.calls: list[str] = []
        self.payload = payload

    def __call__(self, release: Release, python: Path, dest: Path) -> Path:
        self.calls.append(release.version)
        wheel = dest / release.wheel
        wheel.write_bytes(self.payload)
        return wheel


def test_known_releases_table():
    assert rel.DEFAULT_RELEASES == ("0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
                                    "0.30.0", "0.31.0", "0.32.0", "0.33.0")
    for version, release in rel.KNOWN_RELEASES.items():
        assert release.wheel == f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
        assert len(release.sha256) == 64 and int(release.sha256, 16) >= 0


def test_closure_is_pinned_and_hashed_without_triton():
    names = []
    for line in rel.CLOSURE_FILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req, *hashes = line.split(" --hash=")
        assert "==" in req and hashes and all(h.startswith("sha256:") for h in hashes), line
        names.append(req.split("==")[0].lower())
    assert "torch" in names and "xgrammar" in names
    # what `simsched releases env` promises: pytest and its dependencies
    assert {"pytest", "pluggy", "iniconfig", "packaging", "pygments"} <= set(names)
    assert "triton" not in names and "zmq" not in names


def test_unknown_release(tmp_path):
    with pytest.raises(ReleaseError, match=r"unknown vLLM release '0.99.0'; known: 0.25.1, 0.26.0"):
        inst.install(["0.99.0"], home=tmp_path / "home", progress=lambda _: None)
    assert not (tmp_path / "home").exists()  # rejected before touching anything
    with pytest.raises(ReleaseError, match="unknown vLLM release '0.99.0'"):
        rel.resolve("0.99.0", home=tmp_path / "home")


def test_hash_mismatch_rejected_before_install(tmp_path, closure):
    home = fake_home(tmp_path, closure)
    table = {"9.9.9": Release("9.9.9", "vllm-9.9.9-py3-none-any.whl", "0" * 64)}
    download = CountingDownloader(b"tampered")
    with pytest.raises(ReleaseError, match="9.9.9: sha256 mismatch .* expected 0{64}, got "):
        inst.install(["9.9.9"], home=home, progress=lambda _: None, releases=table,
                    download=download, closure=closure)
    assert download.calls == ["9.9.9"]
    assert not any((home / "downloads").iterdir())  # the bad file is gone
    assert not any((home / "releases").iterdir())  # nothing installed, no temp dir left
    assert rel.installed(home) == []


def test_verified_download_is_reused(tmp_path, closure):
    """A wheel already downloaded and verified (install killed after download) is not fetched
    again; the install then fails at pip on the fake wheel and leaves no release behind."""
    home = fake_home(tmp_path, closure)
    payload = b"fake wheel"
    table = {"9.9.9": Release("9.9.9", "vllm-9.9.9-py3-none-any.whl",
                              hashlib.sha256(payload).hexdigest())}
    (home / "downloads").mkdir()
    (home / "downloads" / "vllm-9.9.9-py3-none-any.whl").write_bytes(payload)
    download = CountingDownloader(payload)
    with pytest.raises(ReleaseError, match="9.9.9: pip install"):
        inst.install(["9.9.9"], home=home, progress=lambda _: None, releases=table,
                    download=download, closure=closure)
    assert download.calls == []
    assert list((home / "releases").iterdir()) == []


def test_second_install_does_not_download(tmp_path, closure):
    home = fake_home(tmp_path, closure)
    fake_release(home, "0.30.0", closure, sha=rel.KNOWN_RELEASES["0.30.0"].sha256)
    download, lines = CountingDownloader(), []
    got = inst.install(["0.30.0"], home=home, progress=lines.append, download=download,
                      closure=closure)
    assert download.calls == []
    assert lines == ["[1/1] vllm 0.30.0: already installed"]
    assert [r.version for r in got] == ["0.30.0"]


def test_leftovers_of_a_killed_install_are_removed(tmp_path, closure):
    home = fake_home(tmp_path, closure)
    fake_release(home, "0.30.0", closure, sha=rel.KNOWN_RELEASES["0.30.0"].sha256)
    half = home / "releases" / ".tmp-0.33.0-xyz"
    (half / "vllm").mkdir(parents=True)
    inst.install(["0.30.0"], home=home, progress=lambda _: None, download=CountingDownloader(),
                closure=closure)
    assert not half.exists()


def test_installed_lists_complete_releases_sorted(tmp_path, closure):
    home = fake_home(tmp_path, closure)
    for version in ("0.30.0", "0.9.0", "0.10.0"):
        fake_release(home, version, closure)
    (home / "releases" / "0.31.0").mkdir()  # no marker: incomplete
    (home / "releases" / ".tmp-0.32.0-abc").mkdir()  # an interrupted install
    got = rel.installed(home)
    assert [r.version for r in got] == ["0.9.0", "0.10.0", "0.30.0"]
    assert got[0] == InstalledRelease("0.9.0", home / "releases" / "0.9.0",
                                      home / "base" / "bin" / "python", "ab" * 32)
    assert rel.installed(tmp_path / "empty") == []


def test_resolve(tmp_path, closure):
    home = fake_home(tmp_path, closure)
    for version in ("0.30.0", "0.33.0"):
        fake_release(home, version, closure)
    assert [r.version for r in rel.resolve("all", home)] == ["0.30.0", "0.33.0"]
    assert [r.version for r in rel.resolve("releases", home)] == ["0.30.0", "0.33.0"]
    assert [r.version for r in rel.resolve("0.33.0", home)] == ["0.33.0"]
    with pytest.raises(ReleaseError, match=r"0.31.0 not installed .*simsched releases install 0.31.0"):
        rel.resolve("0.31.0", home)
    with pytest.raises(ReleaseError, match="no vLLM releases installed"):
        rel.resolve("all", tmp_path / "empty")


def test_worker_env(tmp_path, closure):
    home = fake_home(tmp_path, closure)
    release = InstalledRelease("0.30.0", home / "releases" / "0.30.0",
                               home / "base" / "bin" / "python", "")
    env = rel.worker_env(release)
    path = env["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(release.path)
    assert (Path(path[1]) / "simsched" / "__init__.py").exists()
    assert env["PYTHONHASHSEED"] == "0"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_CACHE_ROOT"].startswith(str(release.path))
    assert rel.worker_command(release) == [str(release.python)]


def test_cli_errors_are_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SIMSCHED_HOME", str(tmp_path / "home"))
    assert rel.simsched_home() == tmp_path / "home"
    assert release_cli.cli_install(["0.99.0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("simsched: error: unknown vLLM release '0.99.0'") and err.count("\n") == 1
    assert release_cli.cli_list() == 0
    assert "vllm 0.30.0" in capsys.readouterr().out


# --- real: needs `simsched releases install 0.30.0 0.33.0` to have run ----------------------


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_real_release_imports_in_worker(version, monkeypatch):
    monkeypatch.delenv("SIMSCHED_HOME", raising=False)
    have = {r.version: r for r in rel.installed()}
    assert version in have, (f"vLLM {version} not installed in {rel.simsched_home()}: "
                             f"run `simsched releases install {version}`")
    release = have[version]
    code = "import simsched, vllm; print(vllm.__version__, vllm.__file__)"
    proc = subprocess.run(rel.worker_command(release) + ["-c", code], text=True,
                          capture_output=True, env={**os.environ, **rel.worker_env(release)},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got_version, got_file = proc.stdout.split()[-2:]
    assert got_version == version
    assert Path(got_file).is_relative_to(release.path)


def test_changed_closure_makes_base_stale(tmp_path, closure):
    home = fake_home(tmp_path, closure)
    assert inst.base_ready(home, closure)
    closure.write_text("# fake closure, one more pin\n")
    assert not inst.base_ready(home, closure)
    assert not inst.base_ready(tmp_path / "empty", closure)
