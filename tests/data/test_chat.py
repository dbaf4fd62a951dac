"""Chat JSONL -> (ids, mask): templates, prompt masking, special tokens, packing, bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kubetrain.config.loading import validate
from kubetrain.config.schema import ChatConfig, Config, SourceConfig
from kubetrain.data.chat import encode_conversations
from kubetrain.data.shards import prepare
from kubetrain.data.tokenizers import ByteTokenizer, HFTokenizer, load_hf_tokenizer
from kubetrain.errors import DataError

TWO_TURNS = {"messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "reverse: red cat"},
    {"role": "assistant", "content": "cat red"},
    {"role": "user", "content": "reverse: sun moon"},
    {"role": "assistant", "content": "moon sun"},
]}


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def encode(path: Path, tok: object, **chat: object) -> list[tuple[list[int], list[int]]]:
    src = SourceConfig(kind="chat", path=str(path))
    return list(encode_conversations(src, tok, ChatConfig(**chat)))


@pytest.fixture(scope="module")
def tok(hf_tokenizer_dir: Path) -> HFTokenizer:
    tok = load_hf_tokenizer(str(hf_tokenizer_dir))
    assert isinstance(tok, HFTokenizer)
    return tok


def test_only_assistant_turns_count_and_the_text_is_the_template(tok: HFTokenizer, tmp_path: Path) -> None:
    [(ids, mask)] = encode(write_jsonl(tmp_path / "c.jsonl", [TWO_TURNS]), tok)
    assert tok.decode(ids) == tok.tok.apply_chat_template(TWO_TURNS["messages"], tokenize=False)
    learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert learned == "cat red<|eot_id|>moon sun<|eot_id|>"
    assert len(ids) == len(mask) and mask[0] == 0


def test_prompt_response_rows_with_system(tok: HFTokenizer, tmp_path: Path) -> None:
    rows = [{"prompt": "reverse: a b", "response": "b a"},
            {"system": "be brief", "prompt": "hi", "response": "yo"}]
    (ids1, mask1), (ids2, mask2) = encode(write_jsonl(tmp_path / "c.jsonl", rows), tok)
    assert tok.decode([i for i, m in zip(ids1, mask1, strict=True) if m]) == "b a<|eot_id|>"
    text = tok.decode(ids2)
    assert "<|start_header_id|>system<|end_header_id|>\n\nbe brief" in text
    assert tok.decode([i for i, m in zip(ids2, mask2, strict=True) if m]) == "yo<|eot_id|>"


def test_mask_prompt_false_learns_everything(tok: HFTokenizer, tmp_path: Path) -> None:
    [(_, mask)] = encode(write_jsonl(tmp_path / "c.jsonl", [TWO_TURNS]), tok, mask_prompt=False)
    assert set(mask) == {1}


def test_add_special_tokens_lets_the_tokenizer_add_bos(tok: HFTokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [TWO_TURNS])
    bos = tok.tok.bos_token_id
    [(plain, _)] = encode(path, tok)
    [(wrapped, mask)] = encode(path, tok, add_special_tokens=True)
    assert plain[0] == bos and plain[1] != bos  # the template's own BOS only
    assert wrapped[:2] == [bos, bos] and wrapped[1:] == plain and mask[0] == 0


def test_named_template_with_a_byte_tokenizer(tmp_path: Path) -> None:
    row = {"prompt": "2+2?", "response": "4"}
    [(ids, mask)] = encode(write_jsonl(tmp_path / "c.jsonl", [row]), ByteTokenizer(), template="chatml")
    tok = ByteTokenizer()
    assert tok.decode(ids) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "4<|im_end|>\n"


def test_a_jinja_template_overrides_the_tokenizers(tok: HFTokenizer, tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant] {% endif %}"
    [(ids, mask)] = encode(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "response": "b"}]), tok,
                           template=template)
    assert tok.decode(ids) == "[user] a\n[assistant] b\n"
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "b\n"


@pytest.mark.parametrize(("template", "message"), [
    (None, "has no chat template"),
    ("chatmll", "unknown chat template 'chatmll'"),
    ("{% for m in messages %}", "not a valid Jinja template"),
])
def test_template_problems_are_data_errors(tmp_path: Path, template: str | None, message: str) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(DataError, match=message):
        encode(path, ByteTokenizer(), template=template)


def test_a_template_that_is_not_prefix_stable_cannot_mask(tmp_path: Path) -> None:
    # Marks the last message differently, so a prefix of the conversation renders differently.
    template = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: the chat template does not render conversations pre"):
        encode(path, ByteTokenizer(), template=template)


BAD_ROWS = [
    ('{"messages": [', "not valid JSON"),
    ('["a", "b"]', "expected a JSON object, got list"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, r"messages\[0\] has unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\] needs string 'role' and 'content'"),
    ({"prompt": "hi", "response": None}, "'response' must be a string"),
    ({"prompt": "hi", "response": "yo", "system": 1}, "'system' must be a string"),
    ({"text": "hi"}, "needs a 'messages' list or 'prompt' and 'response' fields"),
]


@pytest.mark.parametrize(("row", "reason"), BAD_ROWS)
def test_a_bad_row_names_its_file_and_line(
    tok: HFTokenizer, tmp_path: Path, row: object, reason: str
) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [TWO_TURNS, "", row])  # line 2 is blank, the bad row is line 3
    with pytest.raises(DataError, match=rf"c\.jsonl:3: {reason}"):
        encode(path, tok)


def test_bad_rows_are_skipped_and_counted(
    tok: HFTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [TWO_TURNS, *[r for r, _ in BAD_ROWS], {"prompt": "a", "response": "b"}]
    out = encode(write_jsonl(tmp_path / "c.jsonl", rows), tok, skip_bad_rows=True)
    assert len(out) == 2
    err = capsys.readouterr().err
    assert f"skipped {len(BAD_ROWS)} malformed rows" in err and "c.jsonl:2: not valid JSON" in err


def chat_config(tmp_path: Path, chat: Path, tokenizer: Path, **chat_cfg: object) -> Config:
    return validate({
        "run": {"output_dir": str(tmp_path)},
        "data": {"sources": [{"kind": "chat", "path": str(chat)}], "chat": chat_cfg, "val_fraction": 0.25,
                 "tokenizer": {"kind": "hf", "path": str(tokenizer)}},
        "model": {"block_size": 64},
    })


def test_unpacked_conversations_fill_one_window_each(
    tmp_path: Path, chat_file: Path, hf_tokenizer_dir: Path
) -> None:
    prepared = prepare(chat_config(tmp_path, chat_file, hf_tokenizer_dir))
    tokens = np.asarray(prepared.tokens()[:])
    mask = np.asarray(prepared.mask()[:])  # type: ignore[index]
    n_rows = len(chat_file.read_text().splitlines())
    assert len(tokens) == n_rows * 64 and prepared.n_val % 64 == 0 and prepared.n_val > 0
    windows, masks = tokens.reshape(n_rows, 64), mask.reshape(n_rows, 64)
    assert (windows[:, 0] == 0).all()  # every window starts a conversation: BOS
    assert (masks[:, 0] == 0).all() and masks.sum() > 0
    pad = 4
    assert ((windows == pad) <= (masks == 0)).all()  # padding never counts


def test_weight_repeats_whole_conversations(tok: HFTokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": str(i), "response": "x"} for i in range(4)])
    src = SourceConfig(kind="chat", path=str(path), weight=1.5)
    out = list(encode_conversations(src, tok, ChatConfig()))
    assert len(out) == 6 and out[4] == out[0] and out[5] == out[1]


def test_a_bpe_tokenizer_learns_from_the_conversations(tmp_path: Path, chat_file: Path) -> None:
    cfg = validate({
        "run": {"output_dir": str(tmp_path)},
        "data": {"sources": [{"kind": "chat", "path": str(chat_file)}],
                 "tokenizer": {"kind": "bpe", "vocab_size": 400},
                 "chat": {"template": "chatml", "packing": True}},
        "model": {"block_size": 64},
    })
    tok = prepare(cfg).tokenizer()
    pieces = ("reverse", ":", "Ġred", "Ġcat")
    assert tok.encode("reverse: red cat") == [tok.tok.token_to_id(t) for t in pieces]


def test_unpacked_conversations_are_cut_and_empty_ones_left_out(
    tok: HFTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "reverse: " + "red " * 40, "response": "der"}]
    src = SourceConfig(kind="chat", path=str(write_jsonl(tmp_path / "c.jsonl", rows)))
    [(ids, mask)] = list(encode_conversations(src, tok, ChatConfig(), block_size=32))
    assert len(ids) == len(mask) == 32 and ids[-1] == tok.tok.pad_token_id and sum(mask) == 2  # "b<|eot_id|>"
    assert "1 conversations of" in capsys.readouterr().err
