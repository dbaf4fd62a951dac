"""kubetrain.secrets: secrets are redacted by key name and by value shape; harmless words stay readable."""

from __future__ import annotations

import pytest

from kubetrain.secrets import REDACTED, is_secret_key, redact, redact_text

SECRET_KEYS = ["token", "hf_token", "HF_TOKEN", "access_token", "accessToken", "bearer-token", "password",
               "db_password", "MLFLOW_TRACKING_PASSWORD", "passwd", "secret", "client_secret", "api_key", "apiKey",
               "API-KEY", "aws_secret_access_key", "credentials", "auth", "k8s.env.hf_token"]
HARMLESS_KEYS = ["tokenizer", "data.tokenizer.path", "data.tokenizer.kind", "eval.sample_tokens", "max_tokens",
                 "train.max_tokens", "tokens_per_second", "secret_name", "hf_token_env", "token_field", "author",
                 "k8s.secrets.hf_token.name", "key", "monkey"]


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_secret_key_names(key: str) -> None:
    assert is_secret_key(key)
    assert redact({key: "value"}) == {key: REDACTED}
    assert redact_text(f"--set {key}=value") == f"--set {key}={REDACTED}"


@pytest.mark.parametrize("key", HARMLESS_KEYS)
def test_harmless_key_names_stay_readable(key: str) -> None:
    assert not is_secret_key(key)
    assert redact({key: "value"}) == {key: "value"}
    assert redact_text(f"--set {key}=value") == f"--set {key}=value"


def test_secret_shaped_values_are_hidden_wherever_they_are() -> None:
    hf, gh = "hf_" + "a1B2" * 5, "ghp_" + "Z" * 24
    assert redact({"eval": {"sample_prompt": f"say {hf} now"}}) == {"eval": {"sample_prompt": "say *** now"}}
    assert redact(["train", "--set", f"model.revision={gh}"]) == ["train", "--set", "model.revision=***"]
    assert redact_text("postgresql://me:s3cr3t@db:5432/mlflow") == "postgresql://me:***@db:5432/mlflow"
    assert redact({"steps": 5, "token": None, "password": ""}) == {"steps": 5, "token": None, "password": ""}


def test_a_secret_from_the_environment_is_hidden_whatever_its_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    key = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"  # a W&B key: 40 hex digits, the shape of a git SHA
    sha = "5c1a8c3d2b0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a"
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("PWD", "/home/me/project")  # the shell's working directory: no password
    monkeypatch.setenv("WANDB_MODE", "offline-but-long")  # a long value of a variable that is no secret
    assert redact_text(f"login with {key} at {sha}") == f"login with {REDACTED} at {sha}"
    assert redact({"git_sha": sha, "argv": [f"--key={key}"], "note": f"k {key}"}) == \
        {"git_sha": sha, "argv": [f"--key={REDACTED}"], "note": f"k {REDACTED}"}
    assert redact_text("in /home/me/project, offline-but-long") == "in /home/me/project, offline-but-long"
    assert is_secret_key("WANDB_API_KEY")
