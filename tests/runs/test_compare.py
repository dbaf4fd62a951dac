"""`runs compare` data: summaries of real runs, config differences, phases, bad paths."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from kubetrain import runs
from kubetrain.errors import UserInputError
from kubetrain.runs.compare import compare
from kubetrain.runs.reader import expand, read_metrics

from .conftest import TOKENS_PER_STEP


def test_compare_two_runs(two_runs: tuple[Path, Path]) -> None:
    fast, slow = two_runs
    result = compare([fast, slow])
    assert result["config_diff"] == {"run.name": ["obs", "slow"], "train.lr": [0.003, 0.001]}
    for summary, path in zip(result["runs"], (fast, slow), strict=True):
        records = read_metrics(path / runs.METRICS_FILE)
        train = [r for r in records if r["kind"] == "train"]
        evals = [r for r in records if r["kind"] == "eval"]
        best = min(evals, key=lambda r: r["val_loss"])
        assert summary["run"] == path.name and summary["status"] == "finished"
        assert summary["steps"] == 20 and summary["tokens"] == 20 * TOKENS_PER_STEP
        assert summary["final_train_loss"] == train[-1]["loss"]
        assert summary["best_train_loss"] == min(r["loss"] for r in train)
        assert summary["final_val_loss"] == evals[-1]["val_loss"]
        assert (summary["best_val_loss"], summary["best_val_step"]) == (best["val_loss"], best["step"])
        assert summary["tokens_per_second"] > 0
        assert summary["mfu"] is None  # no known peak FLOPS on a CPU


def test_phases_expand_in_order_and_secrets_stay_hidden(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    fast, slow = two_runs
    root = tmp_path / "multi"
    shutil.copytree(slow, root / "phases" / "pretrain")
    shutil.copytree(fast, root / "phases" / "code")
    runs.update_meta(root / "phases" / "pretrain", started_at=1.0)
    runs.update_meta(root / "phases" / "code", started_at=2.0)
    config = yaml.safe_load((root / "phases" / "code" / runs.CONFIG_FILE).read_text())
    config["eval"]["sample_prompt"] = "hf_abcdefghijklmnopqrstuvwx"
    (root / "phases" / "code" / runs.CONFIG_FILE).write_text(yaml.safe_dump(config))
    assert [label for label, _ in expand([root])] == ["multi/pretrain", "multi/code"]
    diff = compare([root])["config_diff"]
    assert diff["eval.sample_prompt"] == ["And God said", "***"]


def test_same_names_are_told_apart_by_path(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    fast, _ = two_runs
    other = tmp_path / "elsewhere" / fast.name
    shutil.copytree(fast, other)
    assert [label for label, _ in expand([fast, other])] == [str(fast), str(other)]
    assert compare([fast, other])["config_diff"] == {}


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="no such run directory"):
        expand([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match="not a run directory"):
        expand([tmp_path / "empty"])
