"""Config sections that check their own values: object storage settings never hold credentials."""

from __future__ import annotations

import pytest

from kubetrain.config.loading import validate
from kubetrain.errors import ConfigError
from tests.conftest import RunMain


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
