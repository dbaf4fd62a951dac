"""Phases: run in order, each from the previous phase's weights, completed ones skipped, --phase runs one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.conftest import RunMain
from tests.train.conftest import kubetrain, sets

pytestmark = pytest.mark.slow


def _config(tmp: Path) -> Path:
    (tmp / "code.txt").write_text("def add(a, b):\n    return a + b\n" * 200)
    cfg = {
        "run": {"name": "staged"},
        "phases": [
            {"name": "pretrain", "train": {"max_steps": 6}},
            {"name": "code", "init_from": "final",
             "data": {"sources": [{"kind": "text", "path": str(tmp / "code.txt")}]},
             "train": {"max_steps": 4, "lr": 1e-3}},
            {"name": "instruct", "reset_optimizer": False, "train": {"max_steps": 3}},
        ],
    }
    path = tmp / "phased.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_phases_run_in_order_chain_weights_and_skip_completed(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    extra = sets("eval.every_steps=2", "checkpoint.every_steps=2")
    proc = kubetrain("train", str(cfg), *extra, "--json", cwd=tmp_path)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    root = tmp_path / "runs" / "staged" / "phases"
    assert sorted(p.name for p in root.iterdir()) == ["code", "instruct", "pretrain"]
    assert result["run_dir"].endswith("instruct") and result["steps"] == 3
    assert "starting from the weights of" in proc.stdout
    for i, name in enumerate(("pretrain", "code", "instruct")):  # the console names each phase as it starts
        assert f"phase {name} ({i + 1} of 3): " in proc.stdout
    assert "weights and optimizer state of" in proc.stdout  # instruct keeps the optimizer
    for name, steps in (("pretrain", 6), ("code", 4), ("instruct", 3)):
        meta = json.loads((root / name / "meta.json").read_text())
        assert meta["status"] == "finished" and meta["step"] == steps and meta["phase"] == name
    code_cfg = yaml.safe_load((root / "code" / "config.yaml").read_text())
    assert code_cfg["train"]["lr"] == 1e-3 and code_cfg["data"]["sources"][0]["kind"] == "text"
    # a second call skips every completed phase and trains nothing
    before = load_file(root / "instruct" / "checkpoints" / "step-000003" / "model.safetensors")
    again = kubetrain("train", str(cfg), *extra, "--json", cwd=tmp_path)
    assert "tokens per step" not in again.stdout
    assert "phase code (2 of 3): finished before, skipped" in again.stdout
    after = load_file(root / "instruct" / "checkpoints" / "step-000003" / "model.safetensors")
    assert all(before[k].equal(after[k]) for k in before)


def test_single_phase_and_unknown_phase(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    kubetrain("train", str(cfg), *sets(), "--phase", "pretrain", cwd=tmp_path)
    root = tmp_path / "runs" / "staged" / "phases"
    assert [p.name for p in root.iterdir()] == ["pretrain"]
    bad = kubetrain("train", str(cfg), *sets(), "--phase", "pretrian", cwd=tmp_path, check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: --phase pretrian: no such phase (phases: pretrain, code, instruct)"


@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_generate_and_export_a_run_of_phases_use_the_last_finished_phase(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    kubetrain("train", str(cfg), *sets("train.max_steps=2"), "--phase", "pretrain", cwd=tmp_path)
    kubetrain("train", str(cfg), *sets("train.max_steps=2"), "--phase", "code", cwd=tmp_path)
    staged = tmp_path / "runs" / "staged"
    said = f"runs/staged: using phase code, the last one that finished ({staged.relative_to(tmp_path)}/phases/code)"
    sample = kubetrain("generate", "runs/staged", "--prompt", "def", "--max-new-tokens", "4", cwd=tmp_path)
    assert sample.stdout.startswith("def") and sample.stderr.strip() == said
    exported = kubetrain("export", "runs/staged", "-f", "hf", "-o", "hf", "--json", cwd=tmp_path)
    assert json.loads(exported.stdout)["checkpoint"].startswith("runs/staged/phases/code/checkpoints/step-")
    assert said in exported.stderr
    (staged / "phases" / "code" / "meta.json").write_text(json.dumps({"status": "running"}))
    (staged / "phases" / "pretrain" / "meta.json").write_text(json.dumps({"status": "failed"}))
    none = kubetrain("generate", "runs/staged", cwd=tmp_path, check=False)
    assert none.returncode == 2 and "none has finished yet" in none.stderr and none.stderr.count("\n") == 1


def test_phase_with_a_bad_override_is_refused_before_training(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    phases = [{"name": "a", "train": {"max_steps": 3}}, {"name": "b", "train": {"max_step": 3}}]
    path.write_text(yaml.safe_dump({"phases": phases}))
    bad = kubetrain("train", str(path), *sets(), cwd=tmp_path, check=False)
    assert bad.returncode == 2
    assert "phase 'b'" in bad.stderr and "did you mean 'max_steps'" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "runs" / "default").exists()


def test_a_run_whose_third_phase_failed_is_failed_in_runs_list_and_show(run_main: RunMain, tmp_path: Path) -> None:
    path = tmp_path / "phased.yaml"
    phases = [{"name": "pretrain", "train": {"max_steps": 2}}, {"name": "code", "train": {"max_steps": 2}},
              {"name": "instruct", "data": {"sources": [{"kind": "text", "path": str(tmp_path / "missing.txt")}]}}]
    path.write_text(yaml.safe_dump({"run": {"name": "staged"}, "phases": phases}))
    code, _, err = run_main("train", str(path), *sets("eval.every_steps=2", "checkpoint.every_steps=2"))
    assert code == 2 and "data path not found" in err  # phase 3 failed before it wrote anything
    code, out, _ = run_main("runs", "list", "runs", "--json")
    assert code == 0
    [row] = json.loads(out)
    assert (row["name"], row["status"], row["phase"]) == ("staged", "failed", "instruct")
    code, out, _ = run_main("runs", "show", "runs/staged", "--json")
    assert json.loads(out)["status"] == "failed"


def _bpe_config(tmp: Path, phase_tokenizer: dict[str, object] | None = None, code_steps: int = 4) -> Path:
    """Two phases on different texts, the tokenizer a BPE of 300 tokens trained at prepare time."""
    (tmp / "prose.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    (tmp / "code.txt").write_text("def add(a, b):\n    return a + b\n" * 300)
    code: dict[str, object] = {"sources": [{"kind": "text", "path": str(tmp / "code.txt")}]}
    if phase_tokenizer is not None:
        code["tokenizer"] = phase_tokenizer
    cfg = {
        "run": {"name": "bpe"},
        "data": {"sources": [{"kind": "text", "path": str(tmp / "prose.txt")}],
                 "tokenizer": {"kind": "bpe", "vocab_size": 300}},
        "phases": [{"name": "pretrain", "train": {"max_steps": 2}},
                   {"name": "code", "init_from": "final", "data": code, "train": {"max_steps": code_steps}}],
    }
    path = tmp / "bpe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _tokenizer_of(checkpoint: Path) -> str:
    return str(json.loads((checkpoint / "meta.json").read_text())["tokenizer"])


def test_a_later_phase_reuses_the_bpe_the_first_phase_trained(tmp_path: Path) -> None:
    cfg = _bpe_config(tmp_path)
    extra = sets("checkpoint.every_steps=2", "eval.every_steps=2")
    proc = kubetrain("train", str(cfg), *extra, cwd=tmp_path)
    root = tmp_path / "runs" / "bpe" / "phases"
    pretrain, code = root / "pretrain", root / "code"
    assert "starting from the weights of runs/bpe/phases/pretrain/checkpoints/step-000002" in proc.stdout
    assert proc.stdout.count("training the BPE tokenizer") == 1  # pretrain's; code tokenizes its text with it
    assert "phases/pretrain/tokenizer" in proc.stdout  # code says whose tokenizer it reads its data with
    first = _tokenizer_of(pretrain / "checkpoints" / "step-000002")
    assert first.startswith("bpe:") and _tokenizer_of(code / "checkpoints" / "step-000004") == first
    saved = [(run / "tokenizer" / "tokenizer.json").read_text() for run in (pretrain, code)]
    assert saved[0] == saved[1]
    tok = yaml.safe_load((code / "config.yaml").read_text())["data"]["tokenizer"]
    assert (tok["kind"], tok["path"]) == ("bpe", "runs/bpe/phases/pretrain/tokenizer")  # the resolved config says so

    # the code phase, given more steps, resumes from its own checkpoint with the same tokenizer and data
    cfg = _bpe_config(tmp_path, code_steps=6)
    again = kubetrain("train", str(cfg), *extra, "--phase", "code", cwd=tmp_path)
    assert "training the BPE tokenizer" not in again.stdout and "preparing data" not in again.stdout
    assert "resuming from runs/bpe/phases/code/checkpoints/step-000004" in again.stdout
    assert _tokenizer_of(code / "checkpoints" / "step-000006") == first
    assert json.loads((code / "meta.json").read_text())["step"] == 6


def test_a_phase_with_a_tokenizer_of_its_own_is_refused_the_previous_weights(tmp_path: Path) -> None:
    cfg = _bpe_config(tmp_path, phase_tokenizer={"kind": "bpe", "vocab_size": 300})
    bad = kubetrain("train", str(cfg), *sets("checkpoint.every_steps=2", "eval.every_steps=2"), cwd=tmp_path,
                    check=False)
    assert bad.returncode != 0 and "was trained with tokenizer" in bad.stderr


def test_a_phase_whose_previous_phase_has_not_trained_its_tokenizer_is_refused(tmp_path: Path) -> None:
    cfg = _bpe_config(tmp_path)
    bad = kubetrain("train", str(cfg), *sets(), "--phase", "code", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "train phase pretrain first" in bad.stderr and bad.stderr.count("\n") == 1
    record = json.loads((tmp_path / "runs" / "bpe" / "phases.json").read_text())
    assert (record["status"], record["phase"]) == ("failed", "code")
