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
