"""Redaction of secrets from everything kubetrain writes or shows: run files, trackers, logs, rendered objects.

A leaf module (it imports nothing of kubetrain): run files, trackers, the Kubernetes renderer and model
loading all redact, and none of them should have to depend on another just for this.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

REDACTED = "***"

# A key names a secret when its last word is a secret word: `token`, `hf_token`, `HF_TOKEN`, `accessToken`,
# `db_password`, `api_key`; not `tokenizer`, `sample_tokens`, `max_tokens`, `secret_name`, `hf_token_env`.
# Words are separated by `.`, `_`, `-` or a camelCase hump; only the last word of the last segment counts.
_SECRET_WORDS = r"token|password|passwd|pwd|passphrase|secret|credentials?|auth|authorization"
_SECRET_KEY = re.compile(rf"(?:^|[._-])(?:{_SECRET_WORDS}|(?:api|access|private|secret)[_-]?key)$", re.IGNORECASE)
_SECRET_CAMEL = re.compile(r"[a-z0-9](?:Token|Password|Passwd|Passphrase|Secret|Credentials?|Auth|Authorization"
                           r"|(?:Api|Access|Private|Secret)Key)$")
_SECRET_VALUE = [
    re.compile(r"hf_[A-Za-z0-9]{16,}"),  # Hugging Face tokens
    re.compile(r"gh[pousr]_[A-Za-z0-9]{20,}"),  # GitHub tokens
    re.compile(r"sk-[A-Za-z0-9_-]{16,}"),  # OpenAI-style keys
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key ids
    re.compile(r"eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"),  # JWTs (service account tokens)
]
# A secret's own value from the environment is hidden wherever it shows up, whatever its shape: a W&B API key is
# 40 hex digits, the shape of a git SHA, which no value pattern could tell apart. Shorter values (a flag, a port)
# would redact ordinary words.
_MIN_ENV_SECRET = 8
_NOT_SECRET_ENV = {"PWD", "OLDPWD"}  # the shell's working directories, not passwords
_KEY_VALUE = re.compile(r"(?P<k>[\w.-]+)=(?P<v>[^\s,]+)")
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<pw>[^@/\s]+)@", re.IGNORECASE)


def redact_text(text: str) -> str:
    """The text with anything that looks like a token, key or URL password replaced (and any secret's value from
    the environment)."""
    return _redact_text(text, env_secret_values())


def _redact_text(text: str, env_values: list[str]) -> str:
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    for value in env_values:
        text = text.replace(value, REDACTED)
    for pattern in _SECRET_VALUE:
        text = pattern.sub(REDACTED, text)
    # KEY=VALUE pairs (argv overrides, env) whose key names a secret
    return _KEY_VALUE.sub(lambda m: f"{m['k']}={REDACTED}" if is_secret_key(m["k"]) else m[0], text)


def env_secret_values() -> list[str]:
    """The values of this process's environment variables that name a secret (WANDB_API_KEY, HF_TOKEN, ...),
    longest first so that one value inside another is hidden whole."""
    values = {v for k, v in os.environ.items() if len(v) >= _MIN_ENV_SECRET and is_secret_key(k)
              and k not in _NOT_SECRET_ENV}
    return sorted(values, key=len, reverse=True)


@functools.lru_cache(maxsize=4096)  # the same few hundred names (env, config keys) are asked again and again
def is_secret_key(key: str) -> bool:
    """Whether a field, variable or dotted config key names a secret (by its last word, not a substring)."""
    return bool(_SECRET_KEY.search(key) or _SECRET_CAMEL.search(key))


def redact(value: Any, key: str = "") -> Any:
    """A copy of a JSON-like value with secrets redacted, by key name and by value shape."""
    return _redact(value, key, env_secret_values())  # the environment read once, not at every string


def _redact(value: Any, key: str, env_values: list[str]) -> Any:
    if isinstance(value, dict):
        return {k: _redact(v, str(k), env_values) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, key, env_values) for v in value]
    if isinstance(value, str):
        if key and is_secret_key(key):
            return REDACTED if value else value
        return _redact_text(value, env_values)
    return value
