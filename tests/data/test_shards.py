"""`prepare`: one token shard + meta.json, cached by content, train/val split, clear errors for bad data."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from kubetrain.config import Config, load_config
from kubetrain.data.shards import INDEX_DIR, Prepared, cache_root, data_key, prepare
from kubetrain.errors import DataError

TEXT = "And God said, Let there be light: and there was light.\n" * 40


def config(tmp_path: Path, *overrides: str) -> Config:
    return load_config(overrides=[f"data.cache_dir={tmp_path / 'cache'}", *overrides])


def text_config(tmp_path: Path, text: str = TEXT, *overrides: str) -> Config:
    f = tmp_path / "corpus.txt"
    f.write_text(text, encoding="utf-8")
    return config(tmp_path, "data.sources.0.kind=text", f"data.sources.0.path={f}", *overrides)


def tokens(prepared: Prepared) -> np.ndarray:
    return np.asarray(prepared.tokens()[:])


def test_byte_shard_holds_the_text_and_a_separator(tmp_path: Path) -> None:
    p = prepare(text_config(tmp_path))
    raw = (TEXT + "\n\n").encode("utf-8")  # documents are separated by a blank line when there is no EOS
    assert tokens(p).tobytes() == np.frombuffer(raw, dtype=np.uint8).astype(np.uint16).tobytes()
    assert p.dtype == np.uint16
    assert p.meta["tokens"] == len(raw)
    assert p.meta["vocab_size"] == 256
    assert p.meta["tokenizer_kind"] == "byte"
    assert not p.has_mask and not list(p.folder.rglob("*.mask"))
    assert p.tokenizer().decode(tokens(p).tolist()) == TEXT + "\n\n"


def test_train_val_split(tmp_path: Path) -> None:
    p = prepare(text_config(tmp_path, TEXT, "data.val_fraction=0.1"))
    n = p.meta["tokens"]
    assert p.n_val == int(n * 0.1)
    assert p.n_train + p.n_val == n
    # The validation split is the tail of the shard, never mixed with training tokens.
    assert p.meta["train_tokens"] == n - p.n_val


def test_second_prepare_is_a_cache_hit_that_rewrites_nothing(tmp_path: Path) -> None:
    cfg = text_config(tmp_path)
    first = prepare(cfg)
    stamps = {f: f.stat().st_mtime_ns for f in first.folder.rglob("*")}
    logged: list[str] = []
    second = prepare(cfg, log=logged.append)
    assert second.folder == first.folder
    assert second.meta == first.meta
    assert {f: f.stat().st_mtime_ns for f in first.folder.rglob("*")} == stamps
    assert logged == []  # nothing to prepare, nothing said
    left = sorted(d.name for d in cache_root(cfg).iterdir())
    assert left == [INDEX_DIR, first.folder.name]  # no temporary folders left


def test_changed_content_or_settings_prepare_a_new_shard(tmp_path: Path) -> None:
    cfg = text_config(tmp_path)
    first = prepare(cfg)
    assert prepare(text_config(tmp_path, TEXT + "more")).folder != first.folder
    assert data_key(config_with(cfg, "data.val_fraction=0.2")) != data_key(cfg)
    # The model shape does not change the tokens, so it shares the shard.
    assert data_key(config_with(cfg, "model.n_layer=7")) == data_key(cfg)


def test_a_bpe_trained_before_tokenizes_new_data_and_is_keyed_by_its_files(tmp_path: Path) -> None:
    trained = prepare(text_config(tmp_path, TEXT, "data.tokenizer.kind=bpe", "data.tokenizer.vocab_size=300"))
    for name in ("here", "there"):  # the same tokenizer in two folders (a phase's run and the next one's)
        shutil.copytree(trained.folder / "tokenizer", tmp_path / name)
    other = text_config(tmp_path, "Other words, another corpus.\n" * 40, "data.tokenizer.kind=bpe",
                        "data.tokenizer.vocab_size=300", f"data.tokenizer.path={tmp_path / 'here'}")
    reused = prepare(other)
    assert reused.meta["tokenizer"] == trained.meta["tokenizer"] and reused.folder != trained.folder
    assert data_key(config_with(other, f"data.tokenizer.path={tmp_path / 'there'}")) == data_key(other)
    (tmp_path / "there" / "tokenizer.json").write_text((tmp_path / "there" / "tokenizer.json").read_text() + " ")
    assert data_key(config_with(other, f"data.tokenizer.path={tmp_path / 'there'}")) != data_key(other)


def config_with(cfg: Config, *overrides: str) -> Config:
    from kubetrain.config import apply_override, validate

    raw = cfg.model_dump(mode="json")
    for item in overrides:
        apply_override(raw, item)
    return validate(raw)


def test_bpe_is_trained_on_the_corpus_and_saved_next_to_the_shard(tmp_path: Path) -> None:
    p = prepare(text_config(tmp_path, TEXT, "data.tokenizer.kind=bpe", "data.tokenizer.vocab_size=300"))
    assert (p.folder / "tokenizer" / "tokenizer.json").is_file()
    tok = p.tokenizer()
    assert tok.kind == "bpe" and p.meta["vocab_size"] == tok.vocab_size <= 300
    ids = tokens(p).tolist()
    assert len(ids) < len(TEXT)  # merges compress
    assert ids[-1] == tok.eos_id  # each document ends with <|endoftext|>
    assert tok.decode(ids[:-1]) == TEXT
    assert p.meta["tokenizer"] == tok.fingerprint()


def test_hf_tokenizer_folder_prepare(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.data.test_tokenizers import make_hf_tokenizer_folder

    folder = make_hf_tokenizer_folder(tmp_path / "hf-tok")
    cfg = text_config(tmp_path, TEXT, "data.tokenizer.kind=hf", f"data.tokenizer.path={folder}")
    p = prepare(cfg)
    assert p.meta["tokenizer_kind"] == "hf"
    tok = p.tokenizer()
    assert tok.decode(tokens(p).tolist()[:-1]) == TEXT
    # The tokenizer's files are part of the key: a different tokenizer is a different shard.
    (folder / "tokenizer_config.json").write_text(
        (folder / "tokenizer_config.json").read_text().replace('"<|endoftext|>"', '"<|endoftext|>" ', 1))
    assert data_key(cfg) != p.meta["key"]


def test_several_sources_and_weights(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("aaaa")
    rows = "".join(json.dumps({"text": t}) + "\n" for t in ["b1", "b2", "b3", "b4"])
    (tmp_path / "b.jsonl").write_text(rows)
    both = (f"data.sources=[{{kind: text, path: {tmp_path / 'a.txt'}, weight: 2}},"
            f" {{kind: jsonl, path: {tmp_path / 'b.jsonl'}, weight: 0.5}}]")
    cfg = config(tmp_path, both, "data.val_fraction=0")
    got = tokens(prepare(cfg)).astype(np.uint8).tobytes().decode()
    assert got == "aaaa\n\naaaa\n\nb1\n\nb2\n\n"  # two copies of a, half of b's documents


def test_empty_corpus(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="the corpus is empty"):
        prepare(text_config(tmp_path, ""))
    left = sorted(d.name for d in cache_root(text_config(tmp_path, "")).iterdir())
    # the failed attempt left the index and its work folder, which holds no data, only the error for other
    # processes that prepare the same data
    assert len(left) == 2 and INDEX_DIR in left
    work = next(name for name in left if name != INDEX_DIR)
    assert work.endswith(".partial") and not list((cache_root(text_config(tmp_path, "")) / work).rglob("*.bin"))


def test_empty_jsonl_texts_are_an_empty_corpus(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": ""}\n\n')
    cfg = config(tmp_path, "data.sources.0.kind=jsonl", f"data.sources.0.path={tmp_path / 'd.jsonl'}")
    with pytest.raises(DataError, match="the corpus is empty"):
        prepare(cfg)


def test_bpe_on_an_empty_corpus_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="empty"):
        prepare(text_config(tmp_path, "", "data.tokenizer.kind=bpe"))


def test_block_size_larger_than_the_data(tmp_path: Path) -> None:
    cfg = text_config(tmp_path, "short text", "data.val_fraction=0")
    with pytest.raises(DataError, match=r"has 12 tokens, fewer than one window of block_size \+ 1 \(129\)"):
        prepare(cfg, min_tokens=129)
    # The shard itself was fine and is cached; only this block size does not fit.
    assert prepare(cfg, min_tokens=12).meta["tokens"] == 12


def test_validation_split_smaller_than_a_window(tmp_path: Path) -> None:
    cfg = text_config(tmp_path, TEXT, "data.val_fraction=0.01")
    with pytest.raises(DataError, match="validation split has 22 tokens"):
        prepare(cfg, min_tokens=129)


def test_non_utf8_corpus(tmp_path: Path) -> None:
    f = tmp_path / "bad.txt"
    f.write_bytes(b"ok \xff\xfe bad")
    cfg = config(tmp_path, "data.sources.0.kind=text", f"data.sources.0.path={f}")
    with pytest.raises(DataError, match=r"bad\.txt: not UTF-8 text"):
        prepare(cfg)


def test_builtin_default_prepares(tmp_path: Path) -> None:
    p = prepare(config(tmp_path), min_tokens=129)
    assert p.n_train > 500_000 and p.n_val > 10_000
    assert p.meta["sources"] == [{"kind": "builtin", "path": None, "text_field": "text", "split": "train",
                                  "name": None, "weight": 1.0}]


def test_a_source_given_only_as_a_path_trains_on_that_file(tmp_path: Path) -> None:
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT, encoding="utf-8")
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"data:\n  cache_dir: {tmp_path / 'cache'}\n  sources:\n    - path: {f}\n")
    p = prepare(load_config(yaml_file))
    assert tokens(p).tobytes() == np.frombuffer((TEXT + "\n\n").encode(), np.uint8).astype(np.uint16).tobytes()
    assert p.meta["sources"][0]["kind"] == "text"
    # The same file named with its kind is the same data: one shard, one key.
    assert data_key(text_config(tmp_path)) == data_key(load_config(yaml_file))


def test_a_cache_hit_reads_no_corpus_file_and_verifies_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kubetrain.data import fingerprints

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(TEXT * (i + 1), encoding="utf-8")
        os.utime(corpus / f"{i}.txt", (time.time() - 60, time.time() - 60))
    cfg = config(tmp_path, "data.sources.0.kind=text", f"data.sources.0.path={corpus}")
    first = prepare(cfg)
    shards_files = {f"parts/{i:05d}.bin" for i in range(3)}  # a part per file
    assert set(first.meta["checksums"]) == shards_files
    read: list[str] = []

    def spy(path: Path) -> str:
        read.append(Path(path).relative_to(first.folder).as_posix())
        return file_digest(path)

    file_digest = fingerprints.file_digest
    monkeypatch.setattr(fingerprints, "file_digest", spy)
    assert prepare(cfg).folder == first.folder
    assert sorted(read) == sorted(shards_files)  # the corpus is known by its fingerprints; the shard is checked
    # a shard older than the racy window is hashed once more, then known by the cache's record at each start
    for name in shards_files:
        os.utime(first.folder / name, (time.time() - 60, time.time() - 60))
    read.clear()
    assert prepare(cfg).folder == prepare(cfg).folder == first.folder
    assert sorted(read) == sorted(shards_files)


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_shard_is_prepared_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    cfg = text_config(tmp_path)
    first = prepare(cfg)
    good = tokens(first).copy()
    shard = first.folder / "parts/00000.bin"
    if damage == "flip":
        raw = bytearray(shard.read_bytes())
        raw[100] ^= 1
        shard.write_bytes(bytes(raw))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-2])
    else:
        shard.unlink()
    again = prepare(cfg)
    assert np.array_equal(tokens(again), good)
    err = capsys.readouterr().err
    assert f"warning: the prepared data in {first.folder} is damaged (parts/00000.bin " in err


def test_the_chat_mask_is_checksummed_too(tmp_path: Path, chat_file: Path) -> None:
    cfg = config(tmp_path, "data.sources.0.kind=chat", f"data.sources.0.path={chat_file}",
                 "data.chat.template=chatml", "data.chat.packing=true")
    first = prepare(cfg)
    assert set(first.meta["checksums"]) == {"parts/00000.bin", "parts/00000.mask"}
    mask = first.folder / "parts/00000.mask"
    good = mask.read_bytes()
    mask.write_bytes(bytes(b ^ 1 for b in good))
    assert (prepare(cfg).folder / "parts/00000.mask").read_bytes() == good
