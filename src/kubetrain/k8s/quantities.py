"""Kubernetes resource quantities ('500m', '16Gi', '4') as numbers, for render's checks and the doctor's."""

from __future__ import annotations

_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "m": 1e-3, "k": 1e3, "K": 1e3,
           "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def quantity(text: object) -> float:
    """A Kubernetes quantity ('500m', '16Gi', '4') as a number."""
    value = str(text)
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * _SUFFIX[suffix]
    return float(value)
