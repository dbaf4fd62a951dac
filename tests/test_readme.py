"""The README's two commands: they are there, first, and the run command works for real."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands() -> list[str]:
    """The commands of the README's first code block (which must be a bash block)."""
    if not README.is_file():
        pytest.fail(f"{README} is missing: it must start with the run and test commands")
    text = README.read_text(encoding="utf-8")
    first = re.search(r"^```(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert first is not None, "README.md has no code block"
    assert first.group(1) == "bash", "the README's first code block must be ```bash"
    lines = (line.strip() for line in first.group(2).splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_starts_with_the_run_and_the_test_command() -> None:
    run, test = readme_commands()[:2]
    setup, train = (part.strip() for part in run.split("&&"))
    assert shlex.split(setup)[0] == "scripts/setup"
    assert shlex.split(train)[:2] == [".venv/bin/kubetrain", "train"]
    assert shlex.split(test)[0] == "scripts/test"
    for script in ("scripts/setup", "scripts/test", ".ci/run"):
        assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    assert "scripts/test" in ci  # CI runs the README's test command
    # ... and then the compat stage (older torches, GBs of downloads), which the newcomer's command leaves out
    assert ci.index("scripts/test") < ci.index("scripts/test-compat")
    assert "test-compat" not in (ROOT / "scripts" / "test").read_text()


@pytest.mark.slow
def test_readme_run_command_trains_and_ends_with_a_sample_and_the_run_directory(tmp_path: Path) -> None:
    """`.venv/bin/kubetrain train` as written (this checkout's source stands in for the installed one)."""
    train = readme_commands()[0].split("&&")[1]
    args = shlex.split(train)[1:]
    done = subprocess.run([sys.executable, "-m", "kubetrain", *args], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    out = done.stdout.strip().splitlines()

    losses = [float(m.group(1)) for line in out if (m := re.match(r"step \d+/\d+ \| loss ([\d.]+)", line))]
    assert len(losses) >= 10
    assert losses[-1] < losses[0] - 1.0, losses  # the loss falls visibly

    assert out[-1].startswith("run directory: ")
    run = Path(out[-1].removeprefix("run directory: "))
    assert run.is_absolute() and run.is_relative_to(tmp_path)
    for name in ("config.yaml", "meta.json", "metrics.jsonl"):
        assert (run / name).is_file(), name
    assert out[-2].startswith("done: ")
    # The generated sample comes just before: between the two rules, starting with the eval prompt.
    assert out[-3] == "--------------"
    start = out.index("--- sample ---")
    assert start < len(out) - 3
    assert out[start + 1].startswith("And God said")
