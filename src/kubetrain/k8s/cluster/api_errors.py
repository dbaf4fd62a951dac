"""The API server's refusals as one-line errors (exit 2): unreachable, 401/403/404/409/422, a broken stream."""

from __future__ import annotations

import json

from kubetrain.errors import UserInputError


class ClusterError(UserInputError):
    """The API server cannot be reached, or refused a request. Exit code 2."""

    status: int | None = None  # the HTTP status it answered with; None: no answer (unreachable, timed out)


class NotFound(ClusterError):
    pass


class StreamBroken(ClusterError):
    """A streamed answer (a followed log) broke off mid-way: the connection was reset or timed out."""

    def __init__(self, message: str, idle: bool = False) -> None:
        super().__init__(message)
        self.idle = idle  # nothing arrived for the read timeout: a quiet container, or a stalled stream


class Conflict(ClusterError):
    pass


class Forbidden(ClusterError):
    pass


class Invalid(ClusterError):
    """422: the server refused the object; `causes` are (field, reason) pairs from the Status details."""

    def __init__(self, message: str, causes: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.causes = causes


def status_error(status: int, data: bytes, what: str, where: str) -> ClusterError:
    """The one-line error of an HTTP status and the Status body the API server (`where`) sent with it."""
    message, body = "", {}
    try:
        body = json.loads(data)
        message = str(body.get("message", ""))
    except (ValueError, AttributeError):
        message = data.decode(errors="replace").strip()[:200]
    detail = f": {message}" if message else ""
    causes = [(str(c.get("field", "")), _reason(str(c.get("message", ""))))
              for c in ((body.get("details") or {}).get("causes") or []) if isinstance(body, dict)]
    if status == 422 and causes:  # the message repeats the whole rejected value; the causes name fields
        found = "; ".join(f"{f}: {r}" if f else r for f, r in causes)
        return Invalid(f"{what}: rejected as invalid (422) by {where}: {found}", causes)
    if status == 401:
        return ClusterError(
            f"{what}: unauthorized (401): the credentials of {where} were refused{detail}"
        )
    if status == 403:
        return Forbidden(f"{what}: forbidden (403) by {where}{detail}")
    if status == 404:
        return NotFound(f"{what}: not found (404) on {where}{detail}")
    if status == 409:
        return Conflict(f"{what}: conflict (409) on {where}{detail}")
    if status == 422:
        return ClusterError(f"{what}: rejected as invalid (422) by {where}{detail}")
    return ClusterError(f"{what}: HTTP {status} from {where}{detail}")


def _reason(message: str) -> str:
    """'Invalid value: core.PodTemplateSpec{...kilobytes...}: field is immutable' -> 'field is immutable'."""
    return message.rsplit(": ", 1)[-1][:200]


def short_reason(error: object) -> str:
    """Why a connection failed, in a few words ('connection refused'), else the error's first line."""
    text = str(error)
    for marker in (
        "Connection refused",
        "Name or service not known",
        "timed out",
        "certificate verify failed",
        "No route to host",
        "Temporary failure in name resolution",
    ):
        if marker in text:
            return marker.lower()
    return text.splitlines()[0][:200] if text else type(error).__name__
