"""`kubetrain generate RUN_DIR --prompt TEXT`: continue a prompt with a trained run's weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain.cli import main
from tests.conftest import TINY, Cli, RunMain


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny trained run shared by the tests of this file."""
    out = tmp_path_factory.mktemp("gen")
    args = [a for kv in [*TINY, f"run.output_dir={out}", "run.name=gen"] for a in ("--set", kv)]
    with pytest.raises(SystemExit) as done:
        main(["train", *args])
    assert done.value.code == 0
    return out / "gen"


def test_generate_prints_the_prompt_and_its_continuation(run_main: RunMain, run_dir: Path) -> None:
    code, out, err = run_main("generate", str(run_dir), "--prompt", "And God", "--max-new-tokens", "20",
                              "--seed", "3")
    assert (code, err) == (0, "")
    assert out.startswith("And God")
    assert len(out) > len("And God\n")


def test_seeded_and_greedy_generation_repeat(run_main: RunMain, run_dir: Path) -> None:
    for how in (["--seed", "5"], ["--temperature", "0"]):
        once, again = (run_main("generate", str(run_dir), "--prompt", "In", *how, "--max-new-tokens", "30")[1]
                       for _ in range(2))
        assert once == again


def test_generate_from_a_checkpoint_folder(run_main: RunMain, run_dir: Path) -> None:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    code, out, _ = run_main("generate", str(run_dir / "checkpoints" / latest), "--prompt", "The",
                            "--temperature", "0", "--max-new-tokens", "10")
    assert code == 0
    same = run_main("generate", str(run_dir), "--checkpoint", "latest", "--prompt", "The",
                    "--temperature", "0", "--max-new-tokens", "10")[1]
    assert out == same


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "error: --prompt is empty"),
        (["--checkpoint", "newest"], "error: --checkpoint must be 'best' or 'latest'"),
    ],
)
def test_bad_generate_arguments(run_main: RunMain, run_dir: Path, args: list[str], message: str) -> None:
    code, _, err = run_main("generate", str(run_dir), *args)
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1


def test_a_run_without_checkpoints(run_main: RunMain, run_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    code, _, err = run_main("generate", str(empty), "--prompt", "x")
    assert code == 2
    assert err == f"error: {empty} has no complete checkpoint yet\n"


@pytest.mark.slow
def test_generate_in_a_real_process(cli: Cli, run_dir: Path) -> None:
    done = cli("generate", str(run_dir), "--prompt", "And God said", "--max-new-tokens", "16", "--seed", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("And God said")


def test_generate_feeds_the_prompt_like_transformers(run_main: RunMain, hf_full_run: Path) -> None:
    """Greedy generation from a Hugging Face run matches transformers' own on the same weights (BOS included)."""
    import torch

    from kubetrain.models.load import load_trained

    prompt = "reverse: red cat"
    code, out, err = run_main("generate", str(hf_full_run), "--prompt", prompt, "--temperature", "0",
                              "--max-new-tokens", "8")
    assert (code, err) == (0, "")
    model, tokenizer, _, _ = load_trained(hf_full_run)
    hf_tok = tokenizer.tok  # type: ignore[attr-defined]
    inputs = hf_tok(prompt, return_tensors="pt")
    assert int(inputs["input_ids"][0, 0]) == hf_tok.bos_token_id
    with torch.no_grad():
        theirs = model.lm.generate(**inputs, do_sample=False, max_new_tokens=8, eos_token_id=hf_tok.eos_token_id,
                                pad_token_id=hf_tok.pad_token_id)
    new = theirs[0, inputs["input_ids"].shape[1]:].tolist()
    if hf_tok.eos_token_id in new:
        new = new[: new.index(hf_tok.eos_token_id)]
    assert out == prompt + hf_tok.decode(new) + "\n"


def test_generate_takes_the_runs_threads_as_train_does(run_dir: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import cli_env

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: torch's default is one thread already")
    env = cli_env()
    env.pop("OMP_NUM_THREADS")  # torch's default then: a thread per core, however loaded the machine is
    probe = ("import atexit, sys, torch; atexit.register(lambda: print('threads', torch.get_num_threads(), "
             "file=sys.stderr)); from kubetrain.cli import main; main(sys.argv[1:])")
    done = subprocess.run([sys.executable, "-c", probe, "generate", str(run_dir), "--prompt", "In",
                           "--max-new-tokens", "4"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "threads 1"  # the run's run.threads=1 (TINY)
