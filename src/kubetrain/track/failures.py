"""Why a tracker is unavailable, as one line: the fan-out prints it once and training goes on without it."""

from __future__ import annotations

import re

from kubetrain.secrets import redact_text

# "[Errno 111] Connection refused" buried in a page of urllib3/requests wrapping is the part a user needs
_ERRNO = re.compile(r"\[Errno -?\d+\] [^'\")\]\n]+")


class TrackerUnavailable(Exception):
    """A tracker cannot be used (server down, port taken, package missing); its sink gets switched off."""


def one_line(error: BaseException, limit: int = 240, joined: bool = False) -> str:
    """The first line of an error (`joined`: all its lines as one, for errors whose cause is on the second),
    secrets redacted and cut short: library errors can span pages."""
    full = " ".join(str(error).split()) if joined else str(error).strip()
    cause = _ERRNO.search(full)
    text = cause.group(0).strip() if cause else full.splitlines()[0] if full else type(error).__name__
    text = redact_text(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def missing_package(package: str) -> TrackerUnavailable:
    return TrackerUnavailable(f"the '{package}' package is not installed (pip install 'kubetrain[track]')")
