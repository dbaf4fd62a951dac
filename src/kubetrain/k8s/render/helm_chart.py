"""The files of a chart from lifted variants (helm.py): one template per object, values.yaml and its schema, the
helpers, and in a job's chart the spec hash computed from its own objects (spec_hash.py)."""

from __future__ import annotations

import difflib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kubetrain import __version__
from kubetrain.errors import UserInputError
from kubetrain.k8s.render.context import CONFIG_FILE
from kubetrain.k8s.render.helm import HEADER, Objects, Value, Variant, hashed_metadata
from kubetrain.k8s.render.spec_hash import LENGTH as HASH_LENGTH


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


_OWN_UNMARKED = {"_helpers.tpl", "NOTES.txt", "values.schema.json"}  # written without the header (no comments)


def _not_ours(folder: Path) -> Path | None:
    """A file in the chart folder that kubetrain did not write (the header marks its own), or None. A folder
    without kubetrain's Chart.yaml is the user's: anything in it is theirs."""
    if not folder.is_dir():
        return None
    chart_file = folder / "Chart.yaml"
    ours = chart_file.is_file() and chart_file.read_text(encoding="utf-8").startswith(HEADER)
    for path in sorted(folder.rglob("*")):
        if path.is_dir():
            continue
        if not ours:
            return path
        if path.name in _OWN_UNMARKED and path.parent in (folder, folder / "templates"):
            continue
        try:
            if not path.read_text(encoding="utf-8").startswith(HEADER):
                return path
        except (OSError, UnicodeDecodeError):
            return path
    return None


def write_chart(folder: Path, *, name: str, description: str, variants: list[Variant], notes_txt: str,
                environments: dict[str, dict[str, Any]] | None = None, checks: str = "",
                helpers: str = "") -> list[Path]:
    """Write Chart.yaml, values.yaml, values.schema.json, the templates (and values-ENV.yaml files).

    `checks`: template text that renders nothing, or fails the install with its message (templates/checks.yaml).
    """
    if folder.exists() and not folder.is_dir():
        raise UserInputError(f"-o {folder}: that is a file; name a folder for the chart")
    chart_file = folder / "Chart.yaml"
    foreign = _not_ours(folder)
    if foreign:  # merged into the chart they would install with it; replaced, they would be lost
        raise UserInputError(f"-o {folder}: {foreign} was not written by kubetrain; write the chart into an empty "
                             "folder (or one kubetrain wrote before)")
    if chart_file.exists():
        shutil.rmtree(folder / "templates", ignore_errors=True)
    (folder / "templates").mkdir(parents=True, exist_ok=True)
    values = [v for variant in variants for v in variant.lifted]
    values = [v for i, v in enumerate(values) if v.key not in {w.key for w in values[:i]}]
    tree = _values_tree(values)
    hashed = any(True for v in variants for o in v.objects for _ in hashed_metadata(o))
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
