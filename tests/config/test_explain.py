"""`config explain`: every key's type, default and description, read from the schema."""

from __future__ import annotations

import pytest

from kubetrain.config import Config
from kubetrain.config.explain import explain, field_docs, normalize_key, render, type_name
from kubetrain.errors import ConfigError


def test_every_key_of_every_section_is_described() -> None:
    missing = [d.key for d in field_docs() if not d.description]
    assert missing == []


def test_every_key_is_listed_once_with_every_section() -> None:
    keys = [d.key for d in field_docs()]
    assert len(keys) == len(set(keys))
    assert [k for k in keys if "." not in k] == list(Config.model_fields)
    assert "k8s.secrets.hf_token.key" in keys and "data.sources[].weight" in keys


def test_a_field_shows_its_type_default_description_and_bounds() -> None:
    [lr] = explain("train.lr")
    assert (lr.key, lr.type, lr.default, lr.constraints) == ("train.lr", "float", "0.003", "> 0")
    assert lr.description
    [prec] = explain("train.precision")
    assert prec.type == "auto | fp32 | bf16 | fp16" and prec.default == '"auto"'
    [vocab] = explain("model.vocab_size")
    assert (vocab.type, vocab.default) == ("int | null", "null")
    [name] = explain("phases[].name")
    assert name.default == "required"
    [micro] = explain("train.micro_batch_size")  # a constrained int beside a literal
    assert (micro.type, micro.default) == ("int | auto", "16") and "train.global_batch_size" in micro.description


def test_a_section_lists_itself_and_every_key_under_it() -> None:
    keys = [d.key for d in explain("eval")]
    assert keys == ["eval", "eval.every_steps", "eval.windows", "eval.sample_prompt", "eval.sample_tokens"]
    assert "k8s.volumes.data.claim" in [d.key for d in explain("k8s.volumes")]


@pytest.mark.parametrize("key", ["data.sources.0.kind", "data.sources.kind", "data.sources[].kind"])
def test_list_items_are_named_like_set_names_them(key: str) -> None:
    assert normalize_key(key) == "data.sources[].kind"
    assert [d.key for d in explain(key)] == ["data.sources[].kind"]


def test_unknown_key_says_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"^unknown key 'train.lrr'; did you mean 'train.lr'\?$"):
        explain("train.lrr")
    with pytest.raises(ConfigError, match=r"^unknown key 'zzz'$"):
        explain("zzz")


def test_render_is_one_line_per_key_and_its_description_indented() -> None:
    text = render(explain("checkpoint.keep_last"))
    assert text.splitlines()[0] == "checkpoint.keep_last  int = 3"
    assert text.splitlines()[1].startswith("    Periodic checkpoints kept") and text.endswith("(>= 1)")


def test_type_names() -> None:
    assert type_name(list[str] | str) == "list[str] | str"
    assert type_name(dict[str, int]) == "dict[str, int]"


def test_data_attention_says_what_each_choice_trains_and_who_did_so() -> None:
    [doc] = explain("data.attention")
    assert doc.default == '"causal"' and "document" in doc.type
    assert "Llama 3" in doc.description and "nanoGPT" in doc.description and "GPT-2" in doc.description
