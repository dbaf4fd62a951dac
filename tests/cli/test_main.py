"""The entry point: a missing optional package is one line naming the extra to install, exit 2; the commands that
need no torch start without importing it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY, RunMain, cli_env


def test_missing_optional_package_names_its_extra(
    run_main: RunMain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sets = [x for kv in (*TINY, f"run.output_dir={tmp_path}", "run.name=r") for x in ("--set", kv)]
    code, _, _ = run_main("train", *sets)
    assert code == 0
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if kubetrain[export] were not installed
    code, _, err = run_main("export", str(tmp_path / "r"), "--format", "gguf", "-o", str(tmp_path / "m.gguf"))
    assert code == 2
    assert err.strip() == "error: this needs the optional package 'gguf': pip install 'kubetrain[export]'"
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("command", [["train"], ["generate"], ["export"], ["runs", "show"], ["doctor"], ["prepare"]])
def test_help_shows_flags_as_flags_and_each_default_on_its_line(
    run_main: RunMain, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run_main(*command, "--help")
    assert code == 0 and "--help" in out
    assert "<bool>" not in out  # --dry-run, --json, --chat, --help take no value
    if command == ["generate"]:
        prompt = next(line for line in out.splitlines() if "--prompt" in line)
        assert prompt.rstrip().endswith("[default: (a newline)]")  # not "[default:" and "]" on two lines


def test_version_and_the_debug_flag_are_in_the_help(run_main: RunMain) -> None:
    import torch

    import kubetrain

    code, out, _ = run_main("--version")
    assert code == 0 and out.startswith(f"kubetrain {kubetrain.__version__} (torch {torch.__version__}, Python ")
    code, out, _ = run_main("--help")
    assert code == 0 and "--version" in out and "--debug" in out and "KUBETRAIN_DEBUG=1" in out


# Each command runs through the real entry point, in one fresh interpreter (the test's own has torch loaded).
WITHOUT_TORCH = """
import json, sys
from kubetrain.cli import main
codes = []
for args in json.loads(sys.argv[1]):
    try:
        main(args)
    except SystemExit as e:
        codes.append(e.code)
print(json.dumps({"codes": codes, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
"""


def test_commands_that_need_no_torch_start_without_importing_it(tmp_path: Path) -> None:
    # torch takes seconds and hundreds of MiB to import: --help, a config, the runs here, a manifest with no memory
    # request to check (the check builds the model) and a mistyped command (the error path: one line, exit 2) must
    # not wait for it
    commands = [["--help"], ["k8s", "--help"], ["train", "--help"], ["runs", "list"], ["runs", "show", "nope"],
                ["config", "show", "--preset", "tiny"], ["config", "validate", "--preset", "tiny"],
                ["k8s", "render", "--preset", "tiny", "--set", "run.check_memory=false"], ["nosuch"]]
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, json.dumps(commands)], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["codes"] == [0, 0, 0, 0, 2, 0, 0, 0, 2], done.stderr
    assert result["torch"] == []
