"""Every section of both configs (training and platform) refuses unknown keys, NaN and infinity, and validates
assignments: one base class, so a new section cannot forget one of them."""

from __future__ import annotations

import math
import types
import typing

import pytest
from pydantic import BaseModel, ValidationError

from kubetrain.config import Config
from kubetrain.config.section import Section
from kubetrain.k8s.platform.config import PlatformConfig


def _sections(model: type[BaseModel], seen: set[type[BaseModel]] | None = None) -> set[type[BaseModel]]:
    """`model` and every model reachable through its fields' annotations (X, X | None, list[X], dict[str, X])."""
    seen = set() if seen is None else seen
    if model in seen:
        return seen
    seen.add(model)
    stack = [f.annotation for f in model.model_fields.values()]
    while stack:
        annotation = stack.pop()
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _sections(annotation, seen)
        elif typing.get_origin(annotation) is not None or isinstance(annotation, types.UnionType):
            stack.extend(typing.get_args(annotation))
    return seen


@pytest.mark.parametrize("root", [Config, PlatformConfig], ids=["training", "platform"])
def test_every_section_is_a_section(root: type[BaseModel]) -> None:
    found = _sections(root)
    assert len(found) > 5  # the walk reached the nested sections
    assert [m.__name__ for m in found if not issubclass(m, Section)] == []


def test_a_section_refuses_unknown_keys_nan_and_a_bad_assignment() -> None:
    class Example(Section):
        rate: float = 1.0

    with pytest.raises(ValidationError, match="extra"):
        Example.model_validate({"rate": 1.0, "rte": 2.0})
    for bad in (math.nan, math.inf):
        with pytest.raises(ValidationError, match="finite"):
            Example(rate=bad)
    example = Example()
    with pytest.raises(ValidationError):
        example.rate = "fast"  # type: ignore[assignment]
