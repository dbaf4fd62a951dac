"""The entry point: a missing optional package is one line naming the extra to install, exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import TINY, RunMain


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
