"""`--format helm`: a Helm chart generated from the renderer, so that the chart and `render` never drift.

The templates are the rendered objects with `{{ ... }}` at the fields a value of values.yaml decides. Where
those fields are is not written down here: each value is rendered once more with a sentinel in its place, and
every field that changes is matched to it (the sentinel itself, its text, one less, inside a longer string, a key
written only for a value that is not empty, a mapping merged with the renderer's own entries, or the value as the
renderer rewrites it; a field holding YAML, such as the config in the ConfigMap, is compared key by key). A value
that changes a field in any other way (a claim's access mode that follows the node count, an egress rule built
from the tracking URI's host) cannot be lifted for that config: it stays as rendered, and a note says so. A choice
that adds or removes objects (the platform's own database or an external one) is rendered both ways (`Variant`);
helm_chart.py writes one template per object, the lines that differ under `{{ if }}`. Under its default values
the chart renders exactly the objects of the render (tests/k8s/render/test_job_chart.py and
tests/k8s/platform/test_chart.py run the real helm)."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from kubetrain.errors import UserInputError
from kubetrain.k8s.render.manifest import to_yaml
from kubetrain.k8s.workloads import SPEC_HASH

Objects = list[dict[str, Any]]
FieldPath = tuple[Any, ...]
HEADER = "# Written by kubetrain (--format helm); rendered again, it is replaced. Change values, not templates.\n"
_MARK = "KTHELMVALUE{:04d}X"  # plain YAML scalars that no rendered field holds
_INDENT = "KTHELMINDENT"  # in a template action: the indentation of the block scalar it writes into
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's when present: a config text per probe


@dataclass(frozen=True)
class Value:
    """One entry of values.yaml: its key, what this config gives it, and how to render with another one."""

    key: str  # dotted: "resources.cpu"
    default: Any
    sentinel: Any  # a stand-in that no rendered field holds by chance (same type as the default)
    schema: dict[str, Any]
    render: Callable[[Any], Objects]  # the objects with this value set to the one given
    source: str  # the config key it comes from, for notes
    expr: str = ""  # Go expression of the value; default `.Values.<key>`
    # how the renderer writes the value into an object, in Python and as a Go expression of `%s` (the value)
    transform: Callable[[Any], Any] | None = None
    go_transform: str = ""

    @property
    def go(self) -> str:
        return self.expr or f".Values.{self.key}"


@dataclass
class Variant:
    """One way a structural choice can go: the Go condition that picks it, its objects and its values."""

    condition: str  # "" for a chart without choices
    objects: Objects
    values: list[Value]
    tests: tuple[str, ...] = ()  # the condition's parts (it is `and` of them): a shorter test for lines they share
    lifted: list[Value] = field(default_factory=list)
    templated: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, name) -> template text


def _differences(a: Any, b: Any, path: FieldPath = ()) -> Iterator[tuple[FieldPath, Any, Any]]:
    """Every field where two renders differ; a different shape is one difference at the level it starts."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for key in a:
            yield from _differences(a[key], b[key], (*path, key))
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _differences(x, y, (*path, i))
    elif a != b or type(a) is not type(b):
        yield path, a, b


def _yaml_mapping(text: Any) -> dict[str, Any] | None:
    """The mapping a field's text holds, if it holds YAML (the config in the ConfigMap)."""
    if not isinstance(text, str) or "\n" not in text:
        return None
    try:
        parsed = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError:
        return None
    return parsed if isinstance(parsed, dict) else None


@functools.lru_cache(maxsize=16)
def _rendered_yaml(text: str) -> dict[str, Any] | None:
    """The mapping of a rendered field's YAML text when PyYAML writes it back the same: only then can its keys be
    templated with the rest kept byte for byte. Callers do not change it (it is cached)."""
    parsed = _yaml_mapping(text)
    return parsed if parsed is not None and yaml.safe_dump(parsed, sort_keys=False) == text else None


@dataclass(frozen=True)
class OptionalKey:
    """A key the renderer writes only for a value that is not empty (nodeSelector, tolerations)."""

    key: str
    expr: str


@dataclass(frozen=True)
class Merged:
    """A mapping of the value's entries and the renderer's own (a pod's annotations); the renderer's win."""

    fixed: tuple[tuple[str, Any], ...]
    expr: str

    def go(self) -> str:
        pairs = " ".join(f"{json.dumps(k)} {'.specHash' if k == SPEC_HASH else json.dumps(v)}" for k, v in self.fixed)
        return f"(merge (dict {pairs}) ({self.expr} | default dict))"


# A field's template: a Go expression (the field's value), a key present with a value that is not empty, a mapping
# merged with the renderer's own entries, or for a field holding YAML, the expressions of the fields inside it.
Expr = str | OptionalKey | Merged | dict[FieldPath, Any]


def _explain(value: Value, a: Any, b: Any) -> Expr | None:
    """The expression that gives field `a` from the value (and `b` from the sentinel), or None."""
    d, s = value.default, value.sentinel
    if a == d and b == s and type(a) is type(d):
        return f"(int {value.go})" if isinstance(d, int) and not isinstance(d, bool) else value.go
    if value.transform is not None and a == value.transform(d) and b == value.transform(s):
        return value.go_transform % value.go
    if isinstance(a, dict) and isinstance(b, dict) and isinstance(s, dict | list) and not d:
        extra = b.keys() - a.keys()
        if len(extra) == 1 and a.keys() <= b.keys() and all(a[k] == b[k] for k in a):
            (key,) = extra
            inner = _explain(value, value.transform(d) if value.transform else d, b[key])
            if isinstance(inner, str):
                return OptionalKey(key, inner)
    if isinstance(a, dict) and isinstance(b, dict) and isinstance(d, dict) and isinstance(s, dict):
        fixed_a = {k: v for k, v in a.items() if k not in d}
        fixed_b = {k: v for k, v in b.items() if k not in s}
        if (all(a.get(k) == v for k, v in d.items()) and all(b.get(k) == v for k, v in s.items())
                and fixed_a.keys() == fixed_b.keys() and fixed_a
                and all(fixed_a[k] == fixed_b[k] for k in fixed_a if k != SPEC_HASH)):
            return Merged(tuple(fixed_a.items()), value.go)
    inner_a = _rendered_yaml(a) if isinstance(a, str) else None
    inner_b = _yaml_mapping(b) if inner_a is not None else None
    if inner_a is not None and inner_b is not None:  # the config in the ConfigMap: key by key
        out: dict[FieldPath, Any] = {}
        for path, x, y in _differences(inner_a, inner_b):
            expr = _explain(value, x, y)
            if not isinstance(expr, str):
                return None
            out[path] = expr
        return out
    if isinstance(d, int) and not isinstance(d, bool):
        if a == str(d) and b == str(s):
            return f"({value.go} | int | toString)"
        if a == d - 1 and b == s - 1:
            return f"(sub ({value.go} | int) 1)"
    if isinstance(s, str) and s and isinstance(b, str) and s in b and a == b.replace(s, str(d)):
        parts = b.split(s)
        return "(print " + f" {value.go} ".join(json.dumps(p) for p in parts) + ")"
    return None


def lift(variant: Variant, notes: list[str]) -> None:
    """Find where each value lands in the variant's objects (variant.lifted); the rest stay as rendered."""
    substitutions: dict[FieldPath, Any] = {}
    for value in variant.values:
        try:
            probe = value.render(value.sentinel)
        except UserInputError as e:
            # the probe's value is ours, not the user's: say why other values cannot be taken, in words about theirs
            why = str(e).replace(f"{value.sentinel} ", "other ").replace(repr(value.sentinel), "another value")
            notes.append(f"{value.key} stays fixed in the chart: the config refuses other values of {value.source} "
                         f"({why}); change it with --set {value.source}=... when rendering")
            continue
        found: dict[FieldPath, Any] = {}
        unexplained = None
        for path, a, b in _differences(variant.objects, probe):
            if path[-2:] == ("annotations", SPEC_HASH):
                continue
            expr = _explain(value, a, b)
            if expr is None:
                unexplained = path
                break
            found[(*path, expr.key) if isinstance(expr, OptionalKey) else path] = expr
        if unexplained is not None:
            whole = not unexplained or unexplained[0] >= len(variant.objects)
            what = "which objects there are" if whole else (
                f"{variant.objects[unexplained[0]]['kind']} {'.'.join(str(p) for p in unexplained[1:]) or 'itself'}")
            notes.append(f"{value.key} stays fixed in the chart: {value.source} also decides {what}")
            continue
        if not found:
            notes.append(f"{value.key} stays fixed in the chart: {value.source} is not rendered into any object")
            continue
        # two values in one string field (no renderer writes one today) would need both in one expression
        shared = [p for p, e in found.items() if isinstance(e, str) and p in substitutions]
        if shared:
            notes.append(f"{value.key} stays fixed in the chart: another value shares its field {shared[0][1:]}")
            continue
        for path, expr in found.items():
            if isinstance(expr, dict):
                substitutions.setdefault(path, {}).update(expr)
            else:
                substitutions[path] = expr
        variant.lifted.append(value)
    variant.templated = _templates(variant.objects, substitutions)


def _set(tree: Any, path: FieldPath, leaf: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = leaf


def _get(tree: Any, path: FieldPath) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _templates(objects: Objects, substitutions: dict[FieldPath, Any]) -> dict[tuple[str, str], str]:
    """Each object as template text: the marked fields become `{{ ... }}`."""
    marked = copy.deepcopy(objects)
    actions: dict[str, str] = {}

    def mark(action: str) -> str:
        name = _MARK.format(len(actions))
        actions[name] = action
        return name

    for obj in marked:
        for meta in hashed_metadata(obj):
            meta["annotations"][SPEC_HASH] = mark("{{ toJson .specHash }}")  # helm_chart._hashed_objects
    optional: dict[str, tuple[str, OptionalKey]] = {}  # marker key -> (its marker value, the key)
    for path, expr in substitutions.items():
        if isinstance(expr, dict):
            _set(marked, path, _marked_text(_get(objects, path), expr, mark))
        elif isinstance(expr, OptionalKey):  # a marker entry where the key goes; its line becomes a `with`
            name = _MARK.format(len(actions))
            actions[name] = ""
            optional[name] = (mark(""), expr)
            _get(marked, path[:-1])[name] = optional[name][0]
        elif isinstance(expr, Merged):
            _set(marked, path, mark(f"{{{{ toJson {expr.go()} }}}}"))
        else:
            _set(marked, path, mark(f"{{{{ toJson {expr} }}}}"))
    out = {}
    for obj in marked:
        # what the renderer writes between braces (alert descriptions, dashboard legends) stays text for helm
        text = to_yaml([obj]).replace("{{", '{{ "{{" }}')
        for name, (value_mark, key) in optional.items():
            text = re.sub(rf"^( *){name}: {value_mark}\n", _with_line(key), text, flags=re.M)
        uses_defaults = False
        for name, action in actions.items():
            if action and name in text:
                text = text.replace(name, action)
                uses_defaults = uses_defaults or "$d" in action
        text = re.sub(rf"^( *)(.*){_INDENT}(\d{{3}})",
                      lambda m: m[1] + m[2] + " " * (len(m[1]) - int(m[3])), text, flags=re.M)
        if uses_defaults:  # the chart's own defaults, for fields kept byte for byte under them
            text = '{{- $d := include "kubetrain.defaults" . | fromYaml }}\n' + text
        out[(obj["kind"], obj["metadata"]["name"])] = text
    return out


def _with_line(key: OptionalKey) -> Callable[[re.Match[str]], str]:
    """The marker entry's line as the key under `with`: written only when the value is not empty."""
    def line(match: re.Match[str]) -> str:
        return f"{{{{- with {key.expr} }}}}\n{match[1]}{key.key}: {{{{ toJson . }}}}\n{{{{- end }}}}\n"
    return line


def hashed_metadata(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The metadata blocks of an object (itself and its pod templates) that carry the spec hash."""
    from kubetrain.k8s.render.manifest import pod_templates

    for meta in [obj["metadata"], *(t.get("metadata") or {} for _, t in pod_templates(obj))]:
        if SPEC_HASH in (meta.get("annotations") or {}):
            yield meta


def _marked_text(text: str, exprs: dict[FieldPath, str], mark: Callable[[str], str]) -> str:
    """A YAML text (the config in the ConfigMap) with the lifted keys as template actions.

    Under the chart's defaults each action writes the text the renderer wrote (PyYAML's quoting included), so
    the ConfigMap is the same byte for byte; another value is written as JSON, which YAML reads alike.
    """
    raw = copy.deepcopy(_rendered_yaml(text))
    names = {}
    for path, expr in exprs.items():
        default = expr.replace(".Values.", "$d.")
        names[path] = (expr, default)
        _set(raw, path, f"{_MARK.format(9999)}{len(names):04d}")
    marked_lines = yaml.safe_dump(raw, sort_keys=False).splitlines(keepends=True)
    lines = text.splitlines(keepends=True)
    markers = {f"{_MARK.format(9999)}{i + 1:04d}": pair for i, pair in enumerate(names.values())}
    out = []
    at = 0  # the line of `text` the next marked line stands for
    for marked_line in marked_lines:
        name = next((n for n in markers if n in marked_line), None)
        if name is None:
            if at >= len(lines) or lines[at] != marked_line:
                raise UserInputError("a lifted config key changes the config's layout; render without --format helm")
            out.append(marked_line)
            at += 1
            continue
        expr, default = markers[name]
        prefix, suffix = marked_line.split(name)
        end = _value_end(lines, at)
        if end == at + 1:  # a scalar, or an empty mapping or list: its text on the key's line
            token = lines[at][len(prefix):len(lines[at]) - len(suffix)]
            action = f'{{{{ include "kubetrain.scalar" (list {expr} {default} {json.dumps(token)}) }}}}'
            out.append(prefix + mark(action) + suffix)
        else:  # a block mapping or list under the key: the key's line and the block, or the key and JSON
            key = prefix.rstrip(" ")
            token = "".join(lines[at:end])[len(key):-1]
            # the block's lines go into the ConfigMap's block scalar: _templates puts the scalar's indentation for
            # the indentation marker, from the line the key lands on and the key's own indentation here
            depth = len(key) - len(key.lstrip(" "))
            action = (f'{{{{ include "kubetrain.block" (list {expr} {default} {json.dumps(token)} '
                      f'"{_INDENT}{depth:03d}") }}}}')
            out.append(key + mark(action) + "\n")
        at = end
    return "".join(out)


def _value_end(lines: list[str], at: int) -> int:
    """The line after the value of the key on line `at`: lines indented deeper, or list items at its indentation
    (PyYAML writes a list under a key without indenting it), are its value's."""
    indent = len(lines[at]) - len(lines[at].lstrip(" "))
    end = at + 1
    while end < len(lines):
        line = lines[end]
        depth = len(line) - len(line.lstrip(" "))
        if depth > indent or (depth == indent and line.lstrip(" ").startswith("- ")):
            end += 1
        else:
            break
    return end
