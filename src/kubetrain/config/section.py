"""The base of every config section, the training config's and the platform's: one place for what a section refuses."""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated, NaN and infinity are refused, and a
    number is a number (pydantic's lax mode reads `true` as 1: `max_steps: true` would train one step)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if _takes_a_number(annotation) and not _takes(annotation, bool):
                raise ValueError(f"a number, not {str(value).lower()}")
        return value


def _takes(annotation: Any, kind: type) -> bool:
    if annotation is kind:
        return True
    if get_origin(annotation) in (Union, UnionType, Annotated):
        return any(_takes(a, kind) for a in get_args(annotation))
    return False


def _takes_a_number(annotation: Any) -> bool:
    return _takes(annotation, int) or _takes(annotation, float)
