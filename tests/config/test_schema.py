"""The config models: rules that hold between the fields of one section; object storage settings never hold
credentials."""

from __future__ import annotations

import pytest

from kubetrain.config import SourceConfig, load_config, validate
from kubetrain.config.names import local_file_path
from kubetrain.errors import ConfigError
from tests.conftest import RunMain


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


@pytest.mark.parametrize("key, value", [
    ("uri", "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI@bucket/prefix"),
    ("uri", "s3://bucket/prefix?secret_access_key=abc"),
    ("uri", "az://container/prefix?sig=abcdef"),
    ("endpoint_url", "http://minio:minio123@minio:9000"),
    ("endpoint_url", "https://AKIAIOSFODNN7EXAMPLE.example.com"),
])
def test_checkpoint_store_settings_refuse_credentials(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate({"checkpoint": {key: value}})
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"config: checkpoint.{key}: holds credentials; name a Secret in checkpoint.secret_name")
    assert "wJalrXUtnFEMI" not in message and "minio123" not in message


def test_checkpoint_store_settings_without_credentials_are_fine() -> None:
    cfg = validate({"checkpoint": {"uri": "s3://bucket/prefix", "endpoint_url": "http://minio:9000",
                                   "secret_name": "s3-credentials"}})
    assert cfg.checkpoint.uri == "s3://bucket/prefix"


def test_credentials_in_the_config_are_one_error_line_and_exit_2(run_main: RunMain) -> None:
    code, out, err = run_main("train", "--dry-run", "--set", "checkpoint.uri=s3://u:p4ss@bucket/x")
    assert code == 2
    assert err.strip().startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "p4ss" not in out + err


@pytest.mark.parametrize("uri", ["file:///srv/checkpoints", "file://localhost/srv/checkpoints", "file:/srv/ckpt"])
def test_a_file_uri_that_names_a_local_path_is_a_store(uri: str) -> None:
    """The refusal of a bad store offers file:///PATH: that form, and RFC 8089's others for this machine, load."""
    assert validate({"checkpoint": {"uri": uri}}).checkpoint.uri == uri
    assert local_file_path(uri) == "/srv/" + uri.rsplit("/srv/", 1)[1]


def test_a_file_uri_with_a_host_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="names the host 'tmp'"):
        validate({"checkpoint": {"uri": "file://tmp/x"}})
