"""The Trainer's start-up at more ranks than data work fits in a collective timeout: preparation is shared by
the ranks through the cache folder and waited for there, never inside a collective."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubetrain.data.sources import builtin_corpus_path
from tests.train.conftest import kubetrain, sets


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_three_ranks_train_when_preparing_takes_longer_than_the_collective_timeout(tmp_path: Path) -> None:
    # Training a BPE tokenizer on a few MB takes several seconds on one rank, and the collective timeout is
    # 3 s: before, ranks 1 and 2 waited for rank 0 in a barrier and the job failed ("Timed out waiting").
    text = builtin_corpus_path().read_text(encoding="utf-8")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(text.replace("LORD", f"LORD{i}") for i in range(4)), encoding="utf-8")
    done = kubetrain(
        "train", *sets("run.name=big", "train.max_steps=3", "eval.every_steps=3", "checkpoint.every_steps=3",
                       "eval.sample_prompt=null", "dist.hang_timeout_seconds=null", "dist.timeout_seconds=3",
                       "data.tokenizer.kind=bpe",
                       "data.tokenizer.vocab_size=2048", "data.part_mb=1", "data.sources.0.kind=text",
                       f"data.sources.0.path={corpus}"),
        "--nproc", "3", "--oversubscribe", "--json", cwd=tmp_path, timeout=600,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "finished" and result["steps"] == 3
    meta = json.loads((tmp_path / "runs" / "big" / "meta.json").read_text())
    assert meta["world_size"] == 3
    prepared = next(p for p in (tmp_path / "runs" / ".data").iterdir() if not p.name.startswith("."))
    assert len(json.loads((prepared / "meta.json").read_text())["parts"]) == 4  # 3.4 MB in parts of 1 MiB
