"""The `track:` section: defaults, and the bad inputs it turns away with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.errors import ConfigError


def test_defaults_leave_trackers_off() -> None:
    track = load_config(None, None, []).track
    assert track.console and not track.mlflow.enabled and not track.tensorboard.enabled
    assert not track.prometheus.enabled
    assert (track.prometheus.port, track.prometheus.host) == (9400, "0.0.0.0")
    assert track.mlflow.tracking_uri is None and track.mlflow.experiment == "kubetrain"
    assert not track.wandb.enabled and track.wandb.mode == "auto" and not track.wandb.log_checkpoints


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


@pytest.mark.parametrize("name", ["api_key", "key", "apiKey", "token", "WANDB_API_KEY"])
def test_a_wandb_key_in_the_config_is_refused_and_never_echoed(name: str, tmp_path: Path) -> None:
    key = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"track": {"wandb": {"enabled": True, name: key}}}))
    with pytest.raises(ConfigError, match="set WANDB_API_KEY in the environment") as info:
        load_config(path, None, [])
    assert key not in str(info.value) and "\n" not in str(info.value)
    assert "k8s.secrets.env" in str(info.value)  # where the key goes on Kubernetes
    with pytest.raises(ConfigError, match="unknown key") as info:  # --set refuses it before it is read
        load_config(None, None, [f"track.wandb.{name}={key}"])
    assert key not in str(info.value)


def test_wandb_tags_are_what_wandb_accepts() -> None:
    cfg = load_config(None, None, ["track.wandb.enabled=true", "track.wandb.tags=[lora, a100]"])
    assert cfg.track.wandb.tags == ["lora", "a100"]
    for bad in ("x" * 65, ""):  # W&B refuses a run whose tag is empty or over 64 characters
        with pytest.raises(ConfigError, match="1 to 64 characters"):
            load_config(None, None, [f"track.wandb.tags=[{bad!r}]"])
    with pytest.raises(ConfigError, match=r"track\.wandb\.mode"):
        load_config(None, None, ["track.wandb.mode=sometimes"])


@pytest.mark.parametrize("project", ["team/proj", "a\\b", "run#1", "what?", "100%", "c:d", "my-project_2", "ünï cödé"])
def test_a_wandb_project_is_refused_at_load_exactly_when_wandb_refuses_it(project: str) -> None:
    """W&B's own settings decide (its validator); kubetrain says so when the config is read, not at the run's start."""
    wandb_settings = pytest.importorskip("wandb.sdk.wandb_settings")
    try:
        wandb_settings.Settings(project=project)
        wandb_accepts = True
    except Exception:  # wandb raises its UsageError inside pydantic's ValidationError
        wandb_accepts = False
    try:
        load_config(None, None, [f"track.wandb.project={project}"])
        ours = True
    except ConfigError as e:
        ours = False
        assert str(e).startswith("--set track.wandb.project: ") and "entity" in str(e) and "\n" not in str(e)
    assert ours == wandb_accepts
