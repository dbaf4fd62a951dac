"""Tokenizers: byte-level, BPE trained on a corpus, a Hugging Face tokenizer folder; save and load back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kubetrain.config import TokenizerConfig
from kubetrain.data.tokenizers import (
    TOKENIZER_FILE,
    ByteTokenizer,
    FastTokenizer,
    HFTokenizer,
    build_tokenizer,
    chunks,
    load_hf_tokenizer,
    load_saved_tokenizer,
    tiktoken_cache_file,
    train_bpe,
)
from kubetrain.errors import DataError

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "Ünïcödé — ok, emoji 🙂 and tabs\tand\nnewlines.",
] * 20


@pytest.mark.parametrize("text", ["", "hello", "Ünïcödé 🙂\n\ttab", "a" * 1000, "\x00 nul"])
def test_byte_tokenizer_round_trips(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_decodes_partial_utf8_and_out_of_range_ids_without_failing() -> None:
    tok = ByteTokenizer()
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # half of a 3-byte character
    assert tok.decode([ord("a"), 300, ord("b")]) == "ab"  # ids of the rounded-up vocab are dropped


def test_byte_tokenizer_specials_are_the_two_bytes_utf8_never_holds() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (256, 0xFE, 0xFF)
    every_char = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    assert max(tok.encode(every_char)) < tok.bos_id  # text never encodes to a special id
    assert tok.decode([*tok.encode("ab"), tok.eos_id, tok.bos_id]) == "ab"


def test_byte_tokenizer_saves_and_loads(tmp_path: Path) -> None:
    ByteTokenizer().save(tmp_path / "tok")
    loaded = load_saved_tokenizer(tmp_path / "tok")
    assert isinstance(loaded, ByteTokenizer)
    assert (loaded.vocab_size, loaded.eos_id, loaded.fingerprint()) == (256, 0xFF, "byte")


@pytest.fixture(scope="module")
def bpe() -> FastTokenizer:
    return train_bpe(TEXTS, vocab_size=300)


def test_bpe_trains_to_the_requested_size_with_an_eos_token(bpe: FastTokenizer) -> None:
    assert bpe.kind == "bpe"
    assert bpe.vocab_size == 300
    assert bpe.eos_id == bpe.tok.token_to_id("<|endoftext|>")
    # Merges were learned: common words take fewer tokens than bytes.
    assert len(bpe.encode("And God said")) < len(b"And God said")


@pytest.mark.parametrize("text", ["And God said, Let there", "Ünïcödé 🙂 never seen: zqxj", " lead space"])
def test_bpe_round_trips_any_text(bpe: FastTokenizer, text: str) -> None:
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_batch_encoding_matches_single(bpe: FastTokenizer) -> None:
    assert bpe.encode_batch(TEXTS[:3]) == [bpe.encode(t) for t in TEXTS[:3]]


def test_bpe_saves_and_loads_with_the_same_ids(bpe: FastTokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / TOKENIZER_FILE).read_text()) == {"kind": "bpe"}
    loaded = load_saved_tokenizer(tmp_path / "tok")
    assert isinstance(loaded, FastTokenizer)
    assert loaded.fingerprint() == bpe.fingerprint()
    assert (loaded.vocab_size, loaded.eos_id) == (bpe.vocab_size, bpe.eos_id)
    for text in TEXTS[:4]:
        assert loaded.encode(text) == bpe.encode(text)


def test_bpe_fingerprint_differs_between_vocabularies(bpe: FastTokenizer) -> None:
    assert train_bpe(TEXTS, vocab_size=280).fingerprint() != bpe.fingerprint()
    assert train_bpe(TEXTS, vocab_size=300).fingerprint() == bpe.fingerprint()  # training is deterministic


def test_build_tokenizer_follows_the_config() -> None:
    assert isinstance(build_tokenizer(TokenizerConfig(kind="byte")), ByteTokenizer)
    tok = build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=270), iter(TEXTS))
    assert tok.kind == "bpe" and tok.vocab_size == 270
    with pytest.raises(DataError, match="no corpus"):
        build_tokenizer(TokenizerConfig(kind="bpe"))
    with pytest.raises(DataError, match=r"needs data\.tokenizer\.path"):
        build_tokenizer(TokenizerConfig(kind="hf"))


def test_bpe_with_a_path_is_the_one_trained_before_not_a_new_one(bpe: FastTokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path / "tok")
    tok = build_tokenizer(TokenizerConfig(kind="bpe", path=str(tmp_path / "tok"), vocab_size=4096))
    assert (tok.kind, tok.vocab_size, tok.fingerprint()) == ("bpe", 300, bpe.fingerprint())
    with pytest.raises(DataError, match=r"no trained BPE tokenizer in .*missing \(no tokenizer\.json\)"):
        build_tokenizer(TokenizerConfig(kind="bpe", path=str(tmp_path / "missing")))


def make_hf_tokenizer_folder(folder: Path) -> Path:
    """A real Hugging Face tokenizer folder, built here (nothing from a hub)."""
    from transformers import PreTrainedTokenizerFast

    raw = train_bpe(TEXTS, vocab_size=290).tok
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf.save_pretrained(str(folder))
    return folder


def test_hf_tokenizer_folder_loads_encodes_and_saves(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    folder = make_hf_tokenizer_folder(tmp_path / "hf-tok")
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(folder)))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 290
    assert tok.eos_id == tok.tok.convert_tokens_to_ids("<|endoftext|>")
    text = "And God said, Let there be light"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.fingerprint().startswith("hf:")

    tok.save(tmp_path / "copy")
    again = load_saved_tokenizer(tmp_path / "copy")
    assert again.encode(text) == ids
    assert again.fingerprint() == tok.fingerprint()


def test_hf_tokenizer_missing_folder_is_a_data_error_offline(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="tokenizer folder not found"):
        load_hf_tokenizer(str(tmp_path / "nope"), local_files_only=True)


def test_hf_tokenizer_folder_that_is_not_a_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "readme.txt").write_text("not a tokenizer")
    with pytest.raises(DataError, match="could not be loaded"):
        load_hf_tokenizer(str(tmp_path / "junk"))


def test_loading_from_a_folder_without_a_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no tokenizer saved"):
        load_saved_tokenizer(tmp_path)


def test_chunks() -> None:
    assert list(chunks(iter("abcde"), 2)) == [["a", "b"], ["c", "d"], ["e"]]
    assert list(chunks([], 3)) == []


def test_tiktoken_offline_never_downloads_and_names_the_cache_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tiktoken")
    import tiktoken.load

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    real = tiktoken.load.read_file
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    expected = tiktoken_cache_file(url)
    assert expected.parent == tmp_path / "tiktoken"
    with pytest.raises(DataError) as err:
        build_tokenizer(TokenizerConfig(kind="tiktoken", path="r50k_base"))
    message = str(err.value)
    assert message.startswith("tiktoken encoding 'r50k_base' is not in the local cache and downloads are off")
    assert f"save {url} as {expected}" in message
    assert "local_files_only: false" in message
    assert tiktoken.load.read_file is real  # the refusal is undone after the call
    assert not (tmp_path / "tiktoken").exists()  # nothing was fetched or written


def test_tiktoken_offline_still_reads_its_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tiktoken")
    import tiktoken.load

    from kubetrain.data.tokenizers import _tiktoken_downloads

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    url = "https://example.invalid/enc.tiktoken"
    tiktoken_cache_file(url).write_bytes(b"cached")
    with _tiktoken_downloads(allowed=False):
        assert tiktoken.load.read_file_cached(url) == b"cached"  # the cache lookup is tiktoken's own
        with pytest.raises(Exception, match=r"example\.invalid/other"):
            tiktoken.load.read_file_cached("https://example.invalid/other")


def test_prompts_start_with_bos_when_the_tokenizer_adds_one(hf_tokenizer_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer

    from kubetrain.data.tokenizers import prompt_ids

    text = "reverse: red cat"
    with_bos = load_hf_tokenizer(str(hf_tokenizer_dir))
    assert isinstance(with_bos, HFTokenizer)
    bos = with_bos.tok.bos_token_id
    assert prompt_ids(with_bos, text) == [bos, *with_bos.encode(text)]
    assert prompt_ids(with_bos, text) == with_bos.tok(text)["input_ids"]  # what transformers feeds the model
    # The same tokenizer.json read without transformers follows the same rule (its post-processor).
    fast = FastTokenizer(RawTokenizer.from_file(str(hf_tokenizer_dir / "tokenizer.json")), kind="hf", eos_token=None)
    assert prompt_ids(fast, text) == [bos, *fast.encode(text)]
    # Tokenizers that add nothing get nothing.
    no_bos = build_tokenizer(TokenizerConfig(kind="hf", path=str(make_hf_tokenizer_folder(tmp_path / "plain"))))
    assert prompt_ids(no_bos, text) == no_bos.encode(text)
    assert prompt_ids(ByteTokenizer(), text) == list(text.encode())


def test_batch_encode_gives_the_ids_of_encode(tmp_path: Path) -> None:
    from kubetrain.data.tokenizers import ByteTokenizer, encode_texts, load_hf_tokenizer, train_bpe

    texts = ["Hello world.\nAnd God said", "", "Ça va très bien, 日本語 123456 it's"]
    toks: list[Any] = [ByteTokenizer(), train_bpe(texts * 20, 300)]
    if importlib.util.find_spec("transformers"):
        toks.append(load_hf_tokenizer(str(make_hf_tokenizer_folder(tmp_path / "hf"))))
    for tok in toks:
        assert [ids.tolist() for ids in encode_texts(tok, texts)] == [tok.encode(t) for t in texts]
