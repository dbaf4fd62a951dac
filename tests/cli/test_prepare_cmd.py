"""`kubetrain prepare`: token shards + meta.json, a cache hit on the second call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Cli, RunMain


def text_args(tmp: Path, text: str) -> list[str]:
    (tmp / "corpus.txt").write_text(text, encoding="utf-8")
    return ["--set", "data.sources.0.kind=text", "--set", f"data.sources.0.path={tmp / 'corpus.txt'}"]


def test_prepare_json_then_cache_hit(run_main: RunMain, tmp_cwd: Path) -> None:
    args = text_args(tmp_cwd, "Let there be light.\n" * 200)
    code, out, err = run_main("prepare", *args, "--json")
    assert (code, err) == (0, "")
    info = json.loads(out.strip().splitlines()[-1])
    folder = Path(info["folder"])
    assert folder.parent == Path("runs/.data")  # the cache lives under run.output_dir by default
    assert info["tokens"] == 20 * 200 + 2
    assert info["train_tokens"] + info["val_tokens"] == info["tokens"]
    assert (folder / "parts/00000.bin").stat().st_size == 2 * info["tokens"]  # uint16, one part
    stamp = (folder / "parts/00000.bin").stat().st_mtime_ns

    code, out, _ = run_main("prepare", *args)
    assert code == 0
    assert out.strip().splitlines() == [
        f"{folder}: {info['tokens']:,} tokens ({info['train_tokens']:,} train, {info['val_tokens']:,} val), "
        "byte tokenizer, vocab 256"
    ]  # no "preparing" line: nothing was done
    assert (folder / "parts/00000.bin").stat().st_mtime_ns == stamp


def test_prepare_says_what_it_does_the_first_time(run_main: RunMain, tmp_cwd: Path) -> None:
    cache = ["--set", f"data.cache_dir={tmp_cwd / 'c'}"]
    code, out, _ = run_main("prepare", *text_args(tmp_cwd, "words " * 500), *cache)
    assert code == 0
    assert out.startswith(f"preparing data into {tmp_cwd / 'c'}")


def test_prepare_a_bpe_tokenizer(run_main: RunMain, tmp_cwd: Path) -> None:
    bpe = ["--set", "data.tokenizer.kind=bpe", "--set", "data.tokenizer.vocab_size=300"]
    text = text_args(tmp_cwd, "And God said, Let there be light.\n" * 1000)
    code, out, _ = run_main("prepare", *text, *bpe, "--json")
    assert code == 0
    info = json.loads(out.strip().splitlines()[-1])
    assert info["tokenizer_kind"] == "bpe"
    assert (Path(info["folder"]) / "tokenizer" / "tokenizer.json").is_file()
    assert info["tokens"] < 34 * 1000 / 3  # merges compress


def test_prepare_checks_the_block_size(run_main: RunMain, tmp_cwd: Path) -> None:
    code, _, err = run_main("prepare", *text_args(tmp_cwd, "tiny"), "--set", "data.val_fraction=0")
    assert code == 2
    assert "fewer than one window of block_size + 1 (129)" in err


@pytest.mark.slow
def test_prepare_in_a_real_process(cli: Cli, tmp_cwd: Path) -> None:
    done = cli("prepare", *text_args(tmp_cwd, "Let there be light.\n" * 300), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["vocab_size"] == 256
