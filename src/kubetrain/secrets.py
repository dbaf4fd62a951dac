"""Redaction of secrets from everything kubetrain writes or shows: run files, trackers, logs, rendered objects.

A leaf module (it imports nothing of kubetrain): run files, trackers, the Kubernetes renderer and model
loading all redact, and none of them should have to depend on another just for this.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"

_SECRET_KEY = re.compile(r"(token|password|passwd|secret|api[_-]?key|credential|auth)", re.IGNORECASE)
_SECRET_VALUE = [
    re.compile(r"hf_[A-Za-z0-9]{16,}"),  # Hugging Face tokens
    re.compile(r"gh[pousr]_[A-Za-z0-9]{20,}"),  # GitHub tokens
    re.compile(r"sk-[A-Za-z0-9_-]{16,}"),  # OpenAI-style keys
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key ids
    re.compile(r"eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"),  # JWTs (service account tokens)
]
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<pw>[^@/\s]+)@", re.IGNORECASE)


def redact_text(text: str) -> str:
    """The text with anything that looks like a token, key or URL password replaced."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    for pattern in _SECRET_VALUE:
        text = pattern.sub(REDACTED, text)
    # KEY=VALUE pairs (argv overrides, env) whose key names a secret
    return re.sub(
        r"(?P<k>[\w.-]*(?:token|password|passwd|secret|api[_-]?key)[\w.-]*)=(?P<v>[^\s,]+)",
        lambda m: f"{m['k']}={REDACTED}",
        text,
        flags=re.IGNORECASE,
    )


def redact(value: Any, key: str = "") -> Any:
    """A copy of a JSON-like value with secrets redacted, by key name and by value shape."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    if isinstance(value, str):
        if key and _SECRET_KEY.search(key) and not key.endswith(("_env", "_key_name", "secret_name", "_field")):
            return REDACTED if value else value
        return redact_text(value)
    return value
