"""The config models: rules that hold between the fields of one section."""

from __future__ import annotations

import pytest

from kubetrain.config import SourceConfig, load_config, validate
from kubetrain.errors import ConfigError


def test_a_source_with_a_path_and_no_kind_is_told_from_its_files_later() -> None:
    assert SourceConfig.model_validate({"path": "my.txt"}).kind == "auto"
    # The presets leave the kind open too, so `--set data.sources.0.path=...` reads that path.
    for preset in ("tiny", "gpt2-124m"):
        cfg = load_config(preset=preset, overrides=["data.sources.0.path=my.txt"])
        assert (cfg.data.sources[0].kind, cfg.data.sources[0].path) == ("auto", "my.txt")


def test_builtin_with_a_path_is_one_clear_error() -> None:
    raw = {"data": {"sources": [{"kind": "builtin", "path": "my.txt"}]}}
    with pytest.raises(ConfigError, match=r"data\.sources\.0: a source of kind 'builtin' .* takes no path "
                                          r"\(got 'my\.txt'\): set kind to text, jsonl, chat, hf or auto"):
        validate(raw)


def test_kinds_that_read_files_need_a_path() -> None:
    assert SourceConfig.model_validate({}).kind == "auto"  # no path: the builtin corpus, resolved at prepare
    with pytest.raises(ConfigError, match="kind 'text' needs a path"):
        validate({"data": {"sources": [{"kind": "text"}]}})
