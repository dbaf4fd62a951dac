"""`--format helm`: a Helm chart generated from the renderer, so that the chart and `render` never drift.

The templates are the rendered objects with `{{ ... }}` at the fields a value of values.yaml decides. Where
those fields are is not written down here: each value is rendered once more with a sentinel in its place, and
every field that changes is matched to it (the sentinel itself, its text, one less, or inside a longer string;
a field holding YAML, such as the config in the ConfigMap, is compared key by key). A value that changes a field
in any other way (a claim's access mode that follows the node count, an egress rule built from the tracking
URI's host) cannot be lifted for that config: it stays as rendered, and a note says so. A choice that adds or
removes objects (the platform's own database or an external one) is rendered both ways (`Variant`), and the
documents that differ are wrapped in `{{ if }}`. Under its default values the chart renders exactly the objects
of the render (tests/k8s/render/test_job_chart.py and tests/k8s/platform/test_chart.py run the real helm).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kubetrain import __version__
from kubetrain.errors import UserInputError
from kubetrain.k8s.render.context import CONFIG_FILE
from kubetrain.k8s.render.manifest import to_yaml
from kubetrain.k8s.render.spec_hash import LENGTH as HASH_LENGTH
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
            notes.append(f"{value.key} stays fixed in the chart: {value.source} = {value.sentinel!r} is refused ({e})")
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
        for meta in _hashed(obj):
            meta["annotations"][SPEC_HASH] = mark("{{ toJson .specHash }}")  # see _hashed_objects
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
        for name, (value_mark, expr) in optional.items():
            text = re.sub(rf"^( *){name}: {value_mark}\n",
                          lambda m, e=expr: (f"{{{{- with {e.expr} }}}}\n{m[1]}{e.key}: {{{{ toJson . }}}}\n"
                                             "{{- end }}\n"), text, flags=re.M)
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


def _hashed(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
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
            # the placeholder, from the line the key lands on and the key's own indentation here
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


def merge(variants: list[Variant]) -> list[tuple[str, str]]:
    """(file stem, template) of every object of every variant: one template per object, its lines that differ
    between variants wrapped in their variants' condition, and an object some variants lack in theirs."""
    keys: list[tuple[str, str]] = []
    for v in variants:
        keys += [k for k in v.templated if k not in keys]
    out = []
    for kind, name in keys:
        having = [i for i, v in enumerate(variants) if (kind, name) in v.templated]
        lines: list[tuple[str, frozenset[int]]] = []
        for i in having:
            lines = _merge_lines(lines, variants[i].templated[(kind, name)].splitlines(keepends=True), i)
        text = "".join(_conditional(block, _condition(variants, among)) if among != frozenset(having) else block
                       for block, among in _blocks(lines))
        if len(having) < len(variants):
            text = _conditional(text, _condition(variants, frozenset(having)))
        out.append((f"{kind.lower()}-{name}", text))
    return out


def _merge_lines(merged: list[tuple[str, frozenset[int]]], lines: list[str],
                 variant: int) -> list[tuple[str, frozenset[int]]]:
    """The lines of the variants so far (each with the variants that have it) and one more variant's lines."""
    import difflib

    matcher = difflib.SequenceMatcher(a=[line for line, _ in merged], b=lines, autojunk=False)
    out: list[tuple[str, frozenset[int]]] = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            out += [(line, among | {variant}) for line, among in merged[a0:a1]]
            continue
        out += merged[a0:a1]
        out += [(line, frozenset({variant})) for line in lines[b0:b1]]
    return out


def _blocks(lines: list[tuple[str, frozenset[int]]]) -> Iterator[tuple[str, frozenset[int]]]:
    """Runs of lines that the same variants have."""
    start = 0
    for end in range(1, len(lines) + 1):
        if end == len(lines) or lines[end][1] != lines[start][1]:
            yield "".join(line for line, _ in lines[start:end]), lines[start][1]
            start = end


def _condition(variants: list[Variant], among: frozenset[int]) -> str:
    """The test that holds in exactly these variants: one part of their conditions when one does, else `or`."""
    for test in dict.fromkeys(t for i in sorted(among) for t in variants[i].tests):
        if {i for i, v in enumerate(variants) if test in v.tests} == among:
            return test
    tests = [variants[i].condition for i in sorted(among)]
    return tests[0] if len(tests) == 1 else "or " + " ".join(f"({t})" for t in tests)


def _conditional(text: str, condition: str) -> str:
    return f"{{{{- if {condition} }}}}\n{text}{{{{- end }}}}\n"


def _schema_of(values: list[Value]) -> dict[str, Any]:
    root: dict[str, Any] = {"$schema": "https://json-schema.org/draft-07/schema#", "type": "object",
                            "additionalProperties": False, "properties": {}, "required": []}
    for value in values:
        node = root
        *parents, last = value.key.split(".")
        for part in parents:
            if part not in node["properties"]:
                node["properties"][part] = {"type": "object", "additionalProperties": False, "properties": {},
                                            "required": []}
                node["required"].append(part)
            node = node["properties"][part]
        node["properties"][last] = value.schema
        node["required"].append(last)
    return root


def _values_tree(values: list[Value]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for value in values:
        *parents, last = value.key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value.default
    return out


def _helpers(values: dict[str, Any]) -> str:
    defaults = yaml.safe_dump(values, sort_keys=False) if values else "{}\n"
    return HEADER + (
        '{{- /* The chart\'s default values (values.yaml): fields keep the render\'s exact text under them. */ -}}\n'
        '{{- define "kubetrain.defaults" }}\n' + defaults + "{{- end }}\n"
        '{{- /* A scalar in the config text: as rendered under the default, else as JSON (which YAML reads). */ -}}\n'
        '{{- define "kubetrain.scalar" -}}\n'
        "{{- if eq (toJson (index . 0)) (toJson (index . 1)) }}{{ index . 2 }}{{ else }}{{ toJson (index . 0) }}"
        "{{ end }}\n{{- end }}\n"
        '{{- /* A mapping or list in the config text: its block under the default, else JSON after the key. */ -}}\n'
        '{{- define "kubetrain.block" -}}\n'
        "{{- if eq (toJson (index . 0)) (toJson (index . 1)) }}"
        '{{ index . 2 | replace "\\n" (print "\\n" (index . 3)) }}'
        "{{ else }} {{ toJson (index . 0) }}{{ end }}\n{{- end }}\n"
    )


def _hashed_objects(templates: list[tuple[str, str]], objects: Objects) -> tuple[str, list[tuple[str, str]]]:
    """The spec hash of spec_hash.py computed in the chart, and the templates that write it.

    Each object becomes a named template of the values, the release and the hash; the hash renders them all with
    it empty, reads the config text of the ConfigMap as data, and hashes Go's JSON of the list (toJson), as
    spec_hash.spec_hash does in Python. So an install writes the hash `k8s render` gives for the same values.
    """
    names = [f"kubetrain.object.{i:02d}" for i in range(len(templates))]
    configs = [i for i, o in enumerate(objects) if o["kind"] == "ConfigMap" and CONFIG_FILE in (o.get("data") or {})]
    helper = (
        "{{- /* kubetrain.dev/spec-hash: src/kubetrain/k8s/render/spec_hash.py, in the chart's terms. */ -}}\n"
        '{{- define "kubetrain.specHash" -}}\n'
        '{{- $context := dict "Values" .Values "Release" .Release "specHash" "" -}}\n'
        "{{- $objects := list -}}\n"
        "{{- range $name := list " + " ".join(json.dumps(n) for n in names) + " -}}\n"
        "{{- $objects = append $objects (include $name $context | fromYaml) -}}\n"
        "{{- end -}}\n"
        + "".join(f"{{{{- $config := index $objects {i} -}}}}\n"
                  f"{{{{- $_ := set $config.data {json.dumps(CONFIG_FILE)} "
                  f"(index $config.data {json.dumps(CONFIG_FILE)} | fromYaml) -}}}}\n" for i in configs)
        + f"{{{{- toJson $objects | sha256sum | trunc {HASH_LENGTH} -}}}}\n"
        "{{- end }}\n"
    )
    out = []
    for name, (stem, text) in zip(names, templates, strict=True):
        out.append((stem, f'{{{{- define "{name}" }}}}\n{text}{{{{- end }}}}\n'
                          f'{{{{- include "{name}" (dict "Values" .Values "Release" .Release '
                          '"specHash" (include "kubetrain.specHash" .)) }}\n'))
    return helper, out


def write_chart(folder: Path, *, name: str, description: str, variants: list[Variant], notes_txt: str,
                environments: dict[str, dict[str, Any]] | None = None, checks: str = "",
                helpers: str = "") -> list[Path]:
    """Write Chart.yaml, values.yaml, values.schema.json, the templates (and values-ENV.yaml files).

    `checks`: template text that renders nothing, or fails the install with its message (templates/checks.yaml).
    """
    if folder.exists() and not folder.is_dir():
        raise UserInputError(f"-o {folder}: that is a file; name a folder for the chart")
    chart_file = folder / "Chart.yaml"
    if chart_file.exists():
        if not chart_file.read_text(encoding="utf-8").startswith(HEADER):
            raise UserInputError(f"{chart_file} was not written by kubetrain; write the chart into an empty folder "
                                 "(or one kubetrain wrote before)")
        shutil.rmtree(folder / "templates", ignore_errors=True)
    (folder / "templates").mkdir(parents=True, exist_ok=True)
    values = [v for variant in variants for v in variant.lifted]
    values = [v for i, v in enumerate(values) if v.key not in {w.key for w in values[:i]}]
    tree = _values_tree(values)
    hashed = any(True for v in variants for o in v.objects for _ in _hashed(o))
    templates = merge(variants)
    helpers = _helpers(tree) + helpers
    if hashed:  # a job's chart: one variant, no choices
        helper, templates = _hashed_objects(templates, variants[0].objects)
        helpers += helper
    chart = {"apiVersion": "v2", "name": name, "description": description, "type": "application",
             "version": __version__, "appVersion": __version__}
    files = {
        chart_file: HEADER + yaml.safe_dump(chart, sort_keys=False),
        folder / "values.yaml": HEADER + (yaml.safe_dump(tree, sort_keys=False) if tree else "{}\n"),
        folder / "values.schema.json": json.dumps(_schema_of(values), indent=2) + "\n",
        folder / "templates" / "_helpers.tpl": helpers,
        folder / "templates" / "NOTES.txt": notes_txt,
    }
    if checks:
        files[folder / "templates" / "checks.yaml"] = HEADER + checks
    for env, overrides in (environments or {}).items():
        files[folder / f"values-{env}.yaml"] = HEADER + yaml.safe_dump(overrides, sort_keys=False)
    for i, (stem, text) in enumerate(templates):
        files[folder / "templates" / f"{i:02d}-{stem}.yaml"] = HEADER + text
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    return list(files)
