"""The `kubetrain.dev/spec-hash` of a job: one definition that `k8s render` and a Helm chart (helm.py) both compute.

The hash is over the rendered objects in apply order, the spec-hash annotations left empty, and the config text of
the ConfigMap taken as the data it holds (a chart writes a changed value as JSON where the renderer writes PyYAML's
quoting: the same config, other text). The objects are written as Go's encoding/json writes them, which is what a
chart's `toJson` gives: keys sorted, no spaces, every number a float64 (Helm's `fromYaml` reads numbers so), `<`,
`>` and `&` escaped. So `launch` and `status` find a Helm-installed job with the hash the same values render.
"""

from __future__ import annotations

import copy
import decimal
import hashlib
import json
from typing import Any

import yaml

from kubetrain.k8s.render.context import CONFIG_FILE
from kubetrain.k8s.workloads import SPEC_HASH

LENGTH = 16  # hex digits kept
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def spec_hash(objects: list[dict[str, Any]]) -> str:
    """The hash of objects whose spec-hash annotations are there and empty (stamp puts them)."""
    data = copy.deepcopy(objects)
    for obj in data:
        if obj["kind"] == "ConfigMap" and isinstance((obj.get("data") or {}).get(CONFIG_FILE), str):
            obj["data"][CONFIG_FILE] = yaml.load(obj["data"][CONFIG_FILE], Loader=_LOADER)
    return hashlib.sha256(go_json(data).encode()).hexdigest()[:LENGTH]


def stamp(objects: list[dict[str, Any]]) -> None:
    """Put the hash on the workload (the last object) and on its pod templates."""

    workload = objects[-1]
    metas = [workload["metadata"], *(t.setdefault("metadata", {}) for _, t in pod_templates(workload))]
    for meta in metas:
        meta["annotations"] = {**(meta.get("annotations") or {}), SPEC_HASH: ""}
    digest = spec_hash(objects)
    for meta in metas:
        meta["annotations"][SPEC_HASH] = digest


def go_json(value: Any) -> str:
    """`value` as Go's json.Marshal writes the same data read from YAML (map[string]interface{}, float64)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return _go_float(float(value))
    if isinstance(value, str):
        return _go_string(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(go_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_go_string(str(k))}:{go_json(value[k])}" for k in sorted(value, key=str)) + "}"
    raise TypeError(f"no JSON for {type(value).__name__}")


def _go_string(text: str) -> str:
    """encoding/json's appendString with HTML escaping (json.Marshal's default); \\b and \\f short since Go 1.22."""
    out = json.dumps(text, ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                          ("\u2029", "\\u2029")):
        out = out.replace(char, escaped)
    return out


def _go_float(number: float) -> str:
    """encoding/json's floatEncoder: shortest digits, positional for 1e-6 <= |x| < 1e21, else e-notation with
    the exponent's leading zero dropped (e-07 -> e-7)."""
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"no JSON for {number}")
    magnitude = abs(number)
    if magnitude != 0 and (magnitude < 1e-6 or magnitude >= 1e21):
        text = repr(number)  # Python's repr is the shortest round-trip too, in e-notation in this range
        mantissa, exponent = text.split("e")
        sign, digits = exponent[0], exponent[1:].lstrip("0") or "0"
        return f"{mantissa}e{sign}{digits.zfill(2) if sign == '+' else digits}"
    shortest = decimal.Decimal(repr(number)).normalize()
    return format(shortest, "f")


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(role, PodTemplateSpec) of a rendered workload; the TrainJob's is the patch kubetrain applies."""
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind in ("Job", "StatefulSet"):
        return [("node", spec["template"])]
    if kind == "JobSet":
        return [(rj["name"], rj["template"]["spec"]["template"]) for rj in spec["replicatedJobs"]]
    if kind == "PyTorchJob":
        return [(role.lower(), r["template"]) for role, r in spec["pytorchReplicaSpecs"].items()]
    if kind == "TrainJob":
        return [
            (rj["name"], rj["template"]["spec"]["template"])
            for patch in spec.get("runtimePatches", [])
            for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        ]
    return []
