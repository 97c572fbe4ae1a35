"""The README's two commands are the ones CI and users run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    return [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("    python -m pip install")]


def test_readme_gives_two_setup_commands():
    cmds = readme_commands()
    assert len(cmds) == 2
    assert "simsched fuzz" in cmds[0] and "simsched releases install" in cmds[0]
    assert "pytest" in cmds[1] and "simsched releases install" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in [line.strip() for line in ci]
