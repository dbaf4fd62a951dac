"""`config explain`: every config key with its type, default and description, read from the schema itself."""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kubetrain.config.schema import Config
from kubetrain.errors import ConfigError


@dataclass(frozen=True)
class FieldDoc:
    """One key of the config, as `config explain` prints it."""

    key: str  # dotted, as --set takes it; list items are written `[]` (`data.sources[].kind`)
    type: str
    default: str  # JSON text of the default, "section" for a nested section, "required" when there is none
    description: str
    constraints: str = ""

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def field_docs(model: type[BaseModel] = Config, prefix: str = "") -> list[FieldDoc]:
    """Every key of `model` and of the sections inside it, in schema order."""
    docs: list[FieldDoc] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = _section_in(field.annotation)
        docs.append(FieldDoc(key, type_name(field.annotation), _default(field), field.description or "",
                             _constraints(field)))
        if inner is not None:
            docs += field_docs(inner, f"{key}[]." if _is_list(field.annotation) else f"{key}.")
    return docs


def explain(key: str | None = None) -> list[FieldDoc]:
    """The docs of `key` and of every key under it (all keys when None); an unknown key is a ConfigError."""
    docs = field_docs()
    if not key:
        return docs
    wanted = normalize_key(key)
    found = [d for d in docs if d.key == wanted or d.key.startswith(wanted + ".") or
             d.key.startswith(wanted + "[].")]
    if not found:
        close = difflib.get_close_matches(wanted, [d.key for d in docs], n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown key '{key}'{hint}")
    return found


def normalize_key(key: str) -> str:
    """`data.sources.0.kind`, `data.sources.kind` and `data.sources[].kind` all name `data.sources[].kind`."""
    parts = [p.removesuffix("[]") for p in key.strip().split(".") if p and not p.isdigit()]
    keys = [d.key for d in field_docs()]
    out = ""
    for i, part in enumerate(parts):
        out = f"{out}.{part}" if out else part
        if i < len(parts) - 1 and any(k.startswith(out + "[].") for k in keys):
            out += "[]"
    return out


def render(docs: list[FieldDoc]) -> str:
    """Text for a terminal: `key  type = default`, then the description and constraints indented."""
    lines: list[str] = []
    for d in docs:
        lines.append(f"{d.key}  {d.type}" + ("" if d.default == "section" else f" = {d.default}"))
        detail = " ".join(x for x in (d.description, f"({d.constraints})" if d.constraints else "") if x)
        if detail:
            lines.append(f"    {detail}")
    return "\n".join(lines)


def to_json(docs: list[FieldDoc]) -> str:
    return json.dumps([d.to_json() for d in docs])


def type_name(annotation: Any) -> str:
    """A short, user-facing name of a field's type: `int | null`, `auto | cpu | cuda`, `list[str]`."""
    if annotation is None or annotation is type(None):
        return "null"
    origin = get_origin(annotation)
    if origin is Annotated:  # a constrained type inside a union (PositiveInt | auto): its base type
        return type_name(get_args(annotation)[0])
    if origin is Literal:
        return " | ".join(str(a) for a in get_args(annotation))
    if origin in (Union, UnionType):
        return " | ".join(type_name(a) for a in get_args(annotation))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in get_args(annotation))}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "section"
    if isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    return json.dumps(value)


def _constraints(field: FieldInfo) -> str:
    """Bounds of a number field: `>= 1`, `> 0, < 1`."""
    parts = []
    for m in field.metadata:
        for cls, attr, op in ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"),
                              (annotated_types.Le, "le", "<="), (annotated_types.Lt, "lt", "<")):
            if isinstance(m, cls):
                parts.append(f"{op} {getattr(m, attr)}")
    return ", ".join(parts)


def _section_in(annotation: Any) -> type[BaseModel] | None:
    """The section model inside `X`, `X | None` or `list[X]` (not inside dicts: their keys are the user's)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, UnionType, list):
        for arg in get_args(annotation):
            found = _section_in(arg)
            if found is not None:
                return found
    return None


def _is_list(annotation: Any) -> bool:
    if get_origin(annotation) is list:
        return True
    return get_origin(annotation) in (Union, UnionType) and any(_is_list(a) for a in get_args(annotation))
