"""`kubetrain runs compare` and `runs plot` through the real entry point, on runs `kubetrain train` made."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from matplotlib.image import imread

from kubetrain.cli import main
from tests.conftest import RunMain

TINY = ["run.threads=1", "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
        "train.max_steps=10", "train.micro_batch_size=4", "train.warmup_steps=2", "train.log_every_steps=5",
        "eval.every_steps=5", "eval.windows=2", "eval.sample_tokens=8", "checkpoint.every_steps=5"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/a and runs/b, trained by the real CLI; b has a lower learning rate."""
    out = tmp_path_factory.mktemp("cli-runs") / "runs"
    for name, lr in (("a", "3e-3"), ("b", "1e-3")):
        sets = [*TINY, f"run.output_dir={out}", f"run.name={name}", f"train.lr={lr}"]
        with pytest.raises(SystemExit) as exited:
            main(["train", *[arg for kv in sets for arg in ("--set", kv)]])
        assert exited.value.code in (0, None)
    return out


def test_compare_table(trained: Path, run_main: RunMain) -> None:
    code, out, _ = run_main("runs", "compare", str(trained / "a"), str(trained / "b"))
    assert code == 0
    assert "final val" in out and "config differences" in out
    lr_row = next(line for line in out.splitlines() if "train.lr" in line)
    assert lr_row.index("0.003") < lr_row.index("0.001")  # one column per run, in the order given
    assert "model.n_embd" not in out  # equal keys are left out


def test_compare_json(trained: Path, run_main: RunMain) -> None:
    code, out, _ = run_main("runs", "compare", str(trained / "a"), str(trained / "b"), "--json")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert [r["run"] for r in result["runs"]] == ["a", "b"]
    assert [r["steps"] for r in result["runs"]] == [10, 10]
    assert result["config_diff"] == {"run.name": ["a", "b"], "train.lr": [0.003, 0.001]}


def test_plot_writes_png(trained: Path, tmp_path: Path, run_main: RunMain) -> None:
    png = tmp_path / "cmp.png"
    code, out, _ = run_main("runs", "plot", str(trained / "a"), str(trained / "b"), "-o", str(png))
    assert code == 0 and f"wrote {png}" in out
    assert imread(png).shape == (500, 1200, 4)


def test_list_and_show_still_work(trained: Path, run_main: RunMain) -> None:
    code, out, _ = run_main("runs", "list", str(trained), "--json")
    assert code == 0 and [r["name"] for r in json.loads(out.strip().splitlines()[-1])] == ["a", "b"]
    code, out, _ = run_main("runs", "show", str(trained / "a"), "--json")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["step"] == 10


def test_show_prints_values_for_a_reader(trained: Path, run_main: RunMain) -> None:
    code, out, _ = run_main("runs", "show", str(trained / "a"))
    assert code == 0
    shown = dict(line.strip().split(": ", 1) for line in out.splitlines())
    assert "None" not in out and shown["phase"] == "-" and shown["phases"] == "-"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", shown["started_at"])  # not epoch seconds
    assert re.fullmatch(r"\d\.\d{4}", shown["best_val_loss"]) and shown["tokens"] == "1,280"
    assert shown["checkpoints"] == "step-000005, step-000010"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["runs", "compare", "{missing}"], "error: no such run directory: {missing}"),
        (["runs", "compare", "{root}"], "error: not a run directory"),
        (["runs", "plot", "{a}", "-o", "{tmp}/loss.jpg"], "error: the plot is a PNG"),
        (["runs", "plot", "{a}", "--x", "time"], "error: --x must be 'step' or 'tokens'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(trained: Path, tmp_path: Path, run_main: RunMain,
                                          args: list[str], message: str) -> None:
    fill = {"missing": str(tmp_path / "nope"), "root": str(tmp_path), "a": str(trained / "a"),
            "tmp": str(tmp_path)}
    code, _, err = run_main(*[a.format(**fill) for a in args])
    assert code == 2
    assert err.strip().count("\n") == 0 and err.startswith(message.format(**fill))
