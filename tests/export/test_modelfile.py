"""The Ollama Modelfile: a Go TEMPLATE derived from the run's chat template, stop tokens, context length."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain.config.schema import ChatConfig
from kubetrain.data.chat import renderer
from kubetrain.data.tokenizers import ByteTokenizer, load_hf_tokenizer
from kubetrain.export.modelfile import chat_layout, modelfile_path, modelfile_text
from tests.export.ollama_modelfile import parse_values

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and now?"}]


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_a_named_template_becomes_a_go_template_that_renders_the_same(name: str) -> None:
    render = renderer(ByteTokenizer(), ChatConfig(template=name))
    layout = chat_layout(render)
    assert layout is not None
    assert layout.render(CONVERSATION) + layout.generation_prompt == render(CONVERSATION, True)
    go = layout.go_template(with_prefix=True)
    assert go.startswith("{{- range .Messages }}{{ if eq .Role \"system\" }}")
    assert go.count("{{ .Content }}") == 3 and go.endswith(layout.generation_prompt)


def test_the_tokenizers_own_template_and_its_bos(hf_tokenizer_dir: Path) -> None:
    tok = load_hf_tokenizer(str(hf_tokenizer_dir))
    render = renderer(tok, ChatConfig())
    layout = chat_layout(render, bos_text="<|begin_of_text|>")
    assert layout is not None and layout.prefix == "<|begin_of_text|>"
    assert layout.render(CONVERSATION) + layout.generation_prompt == render(CONVERSATION, True)
    assert layout.around["assistant"][1] == "<|eot_id|>"
    # The tokenizer adds BOS itself, so the Go template does not write it a second time.
    assert not layout.go_template(with_prefix=False).startswith("<|begin_of_text|>")


@pytest.mark.parametrize("template", [
    # a default system prompt when the conversation has none
    "{% if messages[0]['role'] != 'system' %}SYS{% endif %}{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
    # a template that refuses system messages
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    "{{ m['content'] }}{% endfor %}",
    # the last turn written unlike the others
    "{% for m in messages %}{% if loop.last %}<{{ m['content'] }}>{% else %}{{ m['content'] }}|{% endif %}{% endfor %}",
])
def test_templates_that_are_not_one_wrapper_per_message_get_no_go_template(template: str) -> None:
    assert chat_layout(renderer(ByteTokenizer(), ChatConfig(template=template))) is None


def test_modelfile_text() -> None:
    layout = chat_layout(renderer(ByteTokenizer(), ChatConfig(template="chatml")))
    text = modelfile_text("m.gguf", layout, chat=True, stops=["<|endoftext|>", "<|im_end|>", ""],
                          context_length=512, tokenizer_adds_bos=False)
    lines = text.splitlines()
    assert lines[1] == "FROM ./m.gguf" and lines[2].startswith('TEMPLATE """{{- range .Messages }}')
    assert lines[-3:] == ['PARAMETER stop "<|endoftext|>"', 'PARAMETER stop "<|im_end|>"', "PARAMETER num_ctx 512"]
    plain = modelfile_text("m.gguf", None, chat=False, stops=["<|endoftext|>"], context_length=64,
                           tokenizer_adds_bos=False)
    assert 'TEMPLATE """{{ .Prompt }}"""' in plain.splitlines()
    unusual = modelfile_text("m.gguf", None, chat=True, stops=[], context_length=64, tokenizer_adds_bos=False)
    assert "TEMPLATE" not in unusual.replace("template", "")


def test_a_second_gguf_in_the_folder_gets_its_own_modelfile(tmp_path: Path) -> None:
    assert modelfile_path(tmp_path / "a.gguf") == tmp_path / "Modelfile"
    (tmp_path / "Modelfile").write_text("FROM ./a.gguf\n")
    assert modelfile_path(tmp_path / "b.gguf") == tmp_path / "b.Modelfile"


@pytest.mark.parametrize("stop", ["<|im_end|>", "</s>", 'say "hi"', "a\\b", 'ends with "', '"', '""x', "two\nlines",
                                  'quote"\nthen more', "tab\there", " padded "])
def test_stop_strings_read_back_as_ollama_parses_them(stop: str) -> None:
    text = modelfile_text("m.gguf", None, chat=False, stops=[stop], context_length=64, tokenizer_adds_bos=False)
    read = parse_values(text)
    assert ("stop", stop) in read, read
    assert read[-1] == ("num_ctx", "64")  # nothing after the stop was swallowed into it
