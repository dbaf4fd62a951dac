"""Why a tracker is unavailable, as one line: the fan-out prints it once and training goes on without it."""

from __future__ import annotations

from kubetrain.runs import redact_text


class TrackerUnavailable(Exception):
    """A tracker cannot be used (server down, port taken, package missing); its sink gets switched off."""


def one_line(error: BaseException, limit: int = 240) -> str:
    """The first line of an error, secrets redacted and cut short: library errors can span pages."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = redact_text(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def missing_package(package: str) -> TrackerUnavailable:
    return TrackerUnavailable(f"the '{package}' package is not installed (pip install 'kubetrain[track]')")
