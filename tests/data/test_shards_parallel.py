"""`prepare` by several processes at once, a process that died mid-way, and memory that does not grow with a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kubetrain.config import Config, load_config
from kubetrain.data.shards import data_key, prepare, prepare_in_processes
from kubetrain.data.sources import builtin_corpus_path
from tests.conftest import cli_env


def corpus(tmp_path: Path) -> Path:
    """Text files (one much longer than a part) and a JSONL file: parts inside files and across them."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    text = builtin_corpus_path().read_text(encoding="utf-8")
    (folder / "a.txt").write_text(text[:400_000], encoding="utf-8")
    (folder / "b.txt").write_text("Ça va très bien.\n" * 2000, encoding="utf-8")
    (folder / "c.txt").write_text("", encoding="utf-8")
    rows = [{"text": text[i : i + 700]} for i in range(0, 200_000, 700)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return folder


def config(tmp_path: Path, cache: str, *extra: str) -> Config:
    folder = corpus(tmp_path) if not (tmp_path / "corpus").exists() else tmp_path / "corpus"
    return load_config(overrides=[
        f"data.cache_dir={tmp_path / cache}", "data.part_mb=0.03", "data.tokenizer.kind=bpe",
        "data.tokenizer.vocab_size=512",
        f"data.sources=[{{kind: text, path: {folder}}}, {{kind: jsonl, path: {tmp_path / 'd.jsonl'}, weight: 1.5}}]",
        *extra,
    ])


@pytest.mark.slow
def test_three_processes_prepare_the_same_tokens_as_one(tmp_path: Path) -> None:
    one = prepare(config(tmp_path, "one"))
    three = prepare_in_processes(config(tmp_path, "three"), 3)
    assert len(one.segments) > 20  # parts inside the long file, and the JSONL's 1.5 copies
    assert np.array_equal(np.asarray(one.tokens()[:]), np.asarray(three.tokens()[:]))
    assert (one.meta["parts"], one.meta["checksums"]) == (three.meta["parts"], three.meta["checksums"])
    # The tokens are those of whole documents: each text file encoded in one piece, then EOS.
    tok = one.tokenizer()
    eos = [tok.eos_id]
    files = sorted((tmp_path / "corpus").iterdir())
    expected = [i for f in files if f.stat().st_size for i in tok.encode(f.read_text(encoding="utf-8")) + eos]
    assert np.asarray(one.tokens()[: len(expected)]).tolist() == expected
    rows = [json.loads(line)["text"] for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    jsonl = [i for r in rows + rows[: len(rows) // 2] for i in tok.encode(r) + eos]
    assert np.asarray(one.tokens()[len(expected) :]).tolist() == jsonl


def test_work_left_by_a_process_that_died_is_taken_over(tmp_path: Path) -> None:
    cfg = config(tmp_path, "cache", "data.tokenizer.kind=byte")
    expected = np.asarray(prepare(config(tmp_path, "reference", "data.tokenizer.kind=byte")).tokens()[:])
    key = data_key(cfg)
    work = tmp_path / "cache" / f".{key}.partial"
    (work / "parts").mkdir(parents=True)
    (work / "claims").mkdir()
    (work / "parts" / "00000.bin.tmp-99999").write_bytes(b"\x01\x02" * 100)  # half-written by the dead one
    claim = work / "claims" / "part-00000"
    claim.write_text("otherhost:99999")
    old = time.time() - 600
    os.utime(claim, (old, old))
    got = prepare(cfg)
    assert np.array_equal(np.asarray(got.tokens()[:]), expected)
    assert not work.exists()


PEAK = """
import resource, sys
from kubetrain.config import load_config
from kubetrain.data.shards import prepare
prepare(load_config(overrides=sys.argv[1:]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_kib(tmp_path: Path, mb: int) -> int:
    """Peak RSS of a fresh process that prepares one line of `mb` MB (words, no line break)."""
    words = (builtin_corpus_path().read_text(encoding="utf-8").replace("\n", " ") * 2)[: 1 << 20]
    f = tmp_path / f"line-{mb}.txt"
    with open(f, "w", encoding="utf-8") as out:
        for _ in range(mb):
            out.write(words)
    args = [f"data.cache_dir={tmp_path / f'cache-{mb}'}", "data.sources.0.kind=text", f"data.sources.0.path={f}",
            "data.tokenizer.kind=byte"]
    done = subprocess.run([sys.executable, "-c", PEAK, *args], capture_output=True, text=True, env=cli_env(),
                          check=True, timeout=300)
    f.unlink()
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_file(tmp_path: Path) -> None:
    small, big = peak_kib(tmp_path, 8), peak_kib(tmp_path, 64)
    # Whole-file encoding held the text and its ids (~10 bytes a token): +500 MB for 56 MB more text.
    assert big < small * 1.25 + 20_000, (small, big)


def test_a_process_waiting_for_the_tokenizer_sees_the_data_finished_elsewhere(tmp_path: Path) -> None:
    # Another process holds the tokenizer, then finishes everything and moves the folder into place while this
    # one waits (seen in a two-pod job: the waiting rank looked for the tokenizer in the moved folder forever).
    import shutil
    import threading

    cfg = config(tmp_path, "cache", "data.tokenizer.kind=byte")
    reference = prepare(config(tmp_path, "reference", "data.tokenizer.kind=byte"))
    key = data_key(cfg)
    work = tmp_path / "cache" / f".{key}.partial"
    (work / "claims").mkdir(parents=True)
    (work / "claims" / "tokenizer").write_text("otherhost:1")  # alive: its owner is at work
    got: list[np.ndarray] = []
    waiting = threading.Thread(target=lambda: got.append(np.asarray(prepare(cfg).tokens()[:])), daemon=True)
    waiting.start()
    time.sleep(1.0)
    shutil.copytree(reference.folder, tmp_path / "cache" / ".copy")
    os.rename(tmp_path / "cache" / ".copy", tmp_path / "cache" / key)
    shutil.rmtree(work)
    waiting.join(timeout=60)
    assert not waiting.is_alive() and np.array_equal(got[0], np.asarray(reference.tokens()[:]))
