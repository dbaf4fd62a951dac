"""The `track:` section: defaults, and the bad inputs it turns away with one line."""

from __future__ import annotations

import pytest

from kubetrain.config import load_config
from kubetrain.errors import ConfigError


def test_defaults_leave_trackers_off() -> None:
    track = load_config(None, None, []).track
    assert track.console and not track.mlflow.enabled and not track.tensorboard.enabled
    assert not track.prometheus.enabled
    assert (track.prometheus.port, track.prometheus.host) == (9400, "0.0.0.0")
    assert track.mlflow.tracking_uri is None and track.mlflow.experiment == "kubetrain"


def test_uri_without_password_is_accepted() -> None:
    cfg = load_config(None, None, ["track.mlflow.tracking_uri=postgresql://mlflow@db:5432/mlflow"])
    assert cfg.track.mlflow.tracking_uri == "postgresql://mlflow@db:5432/mlflow"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("track.mlflow.tracking_uri=postgresql://mlflow:s3cret@db/mlflow", "must not contain a password"),
        ("track.prometheus.prot=9000", "port"),
        ("track.prometheus.port=70000", "track.prometheus.port"),
        ("track.prometheus.health_timeout_seconds=0", "track.prometheus.health_timeout_seconds"),
        ("track.mlflow.experiment=", "track.mlflow.experiment"),
    ],
)
def test_bad_values(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, None, [override])
    assert "\n" not in str(info.value)
    assert "s3cret" not in str(info.value)
