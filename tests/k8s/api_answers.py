"""The answers of the test API server: kube-apiserver's metav1.Status error body, and (code, body, content type)."""

from __future__ import annotations

import json
from typing import Any

JSON = "application/json"
Answer = tuple[int, bytes, str]


def status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    """A metav1.Status, the body of every error answer of kube-apiserver."""
    out = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
           "reason": reason, "code": code}
    return out | ({"details": details} if details else {})


def json_answer(code: int, body: Any) -> Answer:
    return code, json.dumps(body).encode(), JSON
