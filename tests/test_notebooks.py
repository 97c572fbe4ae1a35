"""The notebooks run top to bottom (nbclient, a temp copy each) and draw their figures; the plot
helpers they call (simsched/plots/) work headless. Notebooks 01 and 03 run the real releases:
without them they fail, never skip. Committed notebooks carry no outputs."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from simsched import plots
from simsched.case import Case
from simsched.lockstep import HANDMADE
from simsched.model import run_case

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT = 300

#: notebook -> (figure it saves, least number of figures it shows, needs real releases)
EXPECTED = {
    "01_layout_explorer.ipynb": ("fig_layout.png", 5, True),
    "02_campaign_report.ipynb": ("fig_campaign.png", 4, False),
    "03_from_finding_to_issue.ipynb": ("fig_finding.png", 1, True),
}


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A ``python3`` kernelspec that runs this interpreter (the one with simsched installed),
    found first through JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (simsched)", "language": "python"}))
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "SIMSCHED_FIG_DIR", "MPLBACKEND")}
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        [str(root)] + ([saved["JUPYTER_PATH"]] if saved["JUPYTER_PATH"] else []))
    os.environ.pop("MPLBACKEND", None)   # the kernel picks its inline backend
    yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def execute(name: str, tmp_path: Path) -> tuple[nbformat.NotebookNode, Path, float]:
    work = tmp_path / "run"
    work.mkdir()
    shutil.copy(NOTEBOOKS / name, work / name)
    figs = tmp_path / "figs"
    os.environ["SIMSCHED_FIG_DIR"] = str(figs)
    nb = nbformat.read(work / name, as_version=4)
    t0 = time.monotonic()
    NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                   resources={"metadata": {"path": str(work)}}).execute()
    nbformat.write(nb, work / name)
    return nb, figs, time.monotonic() - t0


def images(nb) -> int:
    return sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}))


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.real] if EXPECTED[n][2] else []) for n in EXPECTED])
def test_notebook_runs_and_draws(name, kernel_env, tmp_path):
    fig_name, least, real = EXPECTED[name]
    if real:
        from simsched.vllm.releases import installed
        assert installed(), "no vLLM release installed: run `simsched releases install`"
    nb, figs, seconds = execute(name, tmp_path)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert images(nb) >= least, f"{name}: {images(nb)} figures shown, expected >= {least}"
    png = figs / fig_name
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert png.stat().st_size > 10_000
    print(f"{name}: {seconds:.1f} s")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_committed_notebooks_have_no_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, \
                f"{name}: strip outputs before committing"


# --- the helpers, headless -------------------------------------------------------------------------

def test_plots_run_on_agg():
    import matplotlib
    assert matplotlib.get_backend().lower() == "agg"


def test_ring_chunk_under_hash_unit_is_flagged(tmp_path):
    layout = plots.layout_from('{"groups": [{"kind": "full", "block_size": 16},'
                               ' {"kind": "ring", "block_size": 4}]}')
    rows = {r["profile"]: r for r in plots.geometry_rows(layout, 64).rows}
    assert rows["every-group"]["outcome"] == "AssertionError in build_offloading_config"
    assert rows["fix-skip-zero-hash"]["keys for the request"] == "g0:4 g1:0"
    fig = plots.draw_layout(layout, "every-group")
    title = fig.axes[0].get_title()
    assert "hash unit 16" in title and "asserts stripped" in title
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any("never keyed" in t for t in texts)
    assert plots.save_figure(fig, "x.png", tmp_path).stat().st_size > 5000


def test_sweep_on_the_model():
    layout = plots.layout_from('{"groups": [{"kind": "full", "block_size": 16},'
                               ' {"kind": "ring", "block_size": 4}]}')
    s = plots.sweep(layout, "groups[1].block_size", [0, 4, 16])
    assert s.cells[("model:every-group", 0)] == plots.INVALID
    assert s.cells[("model:every-group", 1)].startswith("crash: AssertionError")
    assert s.cells[("model:fix-skip-zero-hash", 1)] == plots.MISBEHAVE
    assert s.cells[("model:fix-skip-zero-hash", 2)] == plots.OK
    assert s.cells[("model:prefix-cacheable", 1)] == plots.OK
    plots.draw_sweep(s)


def test_campaign_matrix_from_shipped_data():
    data = plots.load_campaign(plots.DATA_DIR / "campaign")
    ids, cols, states = plots.release_matrix(data)
    assert cols == sorted(cols, key=plots.version_key) and "0.30.0" in cols
    boot = next(i for i, f in enumerate(data["findings"])
                if f["signature"] == "crash:AssertionError:build_offloading_config"
                and f["layout"] == "mla/64 + ring/4")
    line = dict(zip(cols, states[boot]))
    assert line["0.30.0"] == plots.AFFECTED and line["0.33.0"] == plots.CLEAN
    assert line["0.25.1"] == plots.NOT_RUN
    shipped = [f for f in data["findings"] if f["repro_dir"]]
    assert len(shipped) == 1 and shipped[0]["id"] == ids[boot]
    plots.campaign_figure(data)


def test_occupancy_from_a_trace():
    trace = run_case(Case.from_json(HANDMADE["load"])).trace
    occ = plots.occupancy(trace)
    assert occ.groups == [0] and occ.steps[0] == 0
    assert occ.blocks[0][0] == 4            # a's 64-token prompt: four 16-token blocks
    assert occ.blocks[0][1] == 5            # plus its decode block, before a finishes
    assert occ.stored[0][-1] == 11          # 4 + 6 + 1 chunks stored
    assert occ.loaded[0][-1] == 3           # b loads three chunks back
    plots.draw_occupancy(trace)
    crashed = plots.occupancy(["# h", "crash AssertionError build_offloading_config x"])
    assert not crashed.steps and crashed.end.startswith("crash")
