"""Validate rendered objects strictly, offline: unknown fields are errors, as the API server would prune them.

Core kinds go through `kubernetes-validate` (the official OpenAPI schemas, strict mode). Custom resources
(JobSet, TrainJob, PyTorchJob) go through the `openAPIV3Schema` of their CRDs, turned into JSON Schema with
Kubernetes' structural rules: an object schema without `x-kubernetes-preserve-unknown-fields` is closed,
`x-kubernetes-int-or-string` takes either, `nullable` admits null, map-lists have unique keys. CEL rules
(`x-kubernetes-validations`) need a CEL interpreter and are left to the API server (`launch --dry-run`).

Which CRD: the one the target cluster serves when connected (`launch` reads it from apiextensions.k8s.io);
offline, a folder named by `--crds DIR` or $KUBETRAIN_CRD_DIR; with neither, custom resources are rendered
without a schema check (the CLI says so). The Python models that kubeflow-trainer-api and kubeflow-training
ship are not used: their `from_dict` drops unknown fields without a word, which is the mistake this module
exists to catch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from kubetrain.errors import UserInputError

KUBERNETES_VERSION = "1.35"  # the oldest minor release still in upstream support when this was written
CRD_DIR_ENV = "KUBETRAIN_CRD_DIR"
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
Schemas = dict[tuple[str, str], dict[str, Any]]  # (apiVersion, kind) -> JSON Schema


class ValidationFailed(UserInputError):
    """A rendered object does not validate against its schema."""


class CrdSchemasMissing(UserInputError):
    """The CRD folder that was named cannot be used."""


def offline_schemas(folder: Path | None = None) -> Schemas | None:
    """CRD schemas from `--crds DIR`, else from $KUBETRAIN_CRD_DIR; None when neither names a folder.

    Nothing is looked up on its own: an installed kubetrain has no repository (or CRD copies) around it.
    """
    if folder is None and not os.environ.get(CRD_DIR_ENV):
        return None
    path, where = (folder, "--crds") if folder is not None else (Path(os.environ[CRD_DIR_ENV]), CRD_DIR_ENV)
    if not path.is_dir():
        raise CrdSchemasMissing(f"{where}: {path} is not a folder")
    schemas = folder_schemas(path.resolve())
    if not schemas:
        raise CrdSchemasMissing(f"{where}: {path} holds no CustomResourceDefinition (*.yaml)")
    return schemas


@cache
def folder_schemas(folder: Path) -> Schemas:
    """The schemas of every CRD in a folder of *.yaml files."""
    # libyaml's loader when present: these files are large (thousands of lines each)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    docs = (d for p in sorted(folder.glob("*.yaml")) for d in yaml.load_all(p.read_text("utf-8"), Loader=loader))
    return schemas_of(d for d in docs if d)


def schemas_of(crds: Iterable[dict[str, Any]]) -> Schemas:
    """(apiVersion, kind) -> JSON Schema, for every served version of every CRD given."""
    out: Schemas = {}
    for doc in crds:
        if doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        for version in spec["versions"]:
            schema = version.get("schema", {}).get("openAPIV3Schema")
            if version.get("served", True) and schema:
                out[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = structural(schema, root=True)
    return out


def unchecked(objects: Iterable[dict[str, Any]], schemas: Schemas | None) -> list[str]:
    """The kinds of custom resources that go without a schema check (no CRD schema was given)."""
    return [] if schemas is not None else sorted({o["kind"] for o in objects if not is_core(o)})


def structural(node: dict[str, Any], root: bool = False) -> dict[str, Any]:
    """A CRD schema node as JSON Schema, with the API server's pruning rules made into errors."""
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in node:
        out["properties"] = {k: structural(v) for k, v in node["properties"].items()}
        if root and "metadata" in out["properties"]:
            out["properties"]["metadata"] = {"type": "object"}  # checked against ObjectMeta separately
    if node.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        for key in ("apiVersion", "kind"):
            props.setdefault(key, {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(node["additionalProperties"])
    elif node.get("type") == "object" and not preserve and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if isinstance(node.get("items"), dict):
        out["items"] = structural(node["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [structural(s) for s in node[key]]
    if node.get("x-kubernetes-list-type") == "map" and node.get("x-kubernetes-list-map-keys"):
        out["kubernetesListMapKeys"] = node["x-kubernetes-list-map-keys"]
    elif node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def _list_map_keys(validator: Any, keys: list[str], instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
    """`x-kubernetes-list-type: map`: no two items may share the same key fields."""
    import jsonschema

    if not isinstance(instance, list):
        return
    seen: set[tuple[Any, ...]] = set()
    for item in instance:
        if isinstance(item, dict):
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate entry with {dict(zip(keys, key, strict=True))}")
            seen.add(key)


@cache
def _validator_class() -> Any:
    import jsonschema

    # CRD schemas are OpenAPI v3.0, which is JSON Schema draft 4 with extensions.
    return jsonschema.validators.extend(jsonschema.Draft4Validator, {"kubernetesListMapKeys": _list_map_keys})


def _where(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind', '?')} '{obj.get('metadata', {}).get('name', '?')}'"


def _path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out.lstrip(".") or "(top level)"


def _best(errors: Iterable[Any]) -> Any:
    import jsonschema

    return jsonschema.exceptions.best_match(errors)


def validate_core(obj: dict[str, Any], version: str = KUBERNETES_VERSION) -> list[str]:
    """Problems of a core object (Job, Service, ...) against the official schema, strict."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_where(obj)}: {_path(e.absolute_path)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        what = f"{obj.get('apiVersion')} {obj.get('kind')}"
        return [f"{_where(obj)}: no schema for {what} in Kubernetes {version}"]
    return []


@cache
def _object_meta_validator(version: str) -> Any:
    """ObjectMeta from the same official schemas, for the metadata of custom resources."""
    from importlib import resources

    import jsonschema
    import kubernetes_validate
    from referencing import Registry, Resource

    folder = resources.files(kubernetes_validate) / "kubernetes-json-schema"
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith(f"v{version}.")
                   and p.name.endswith("strict"))
    defs = json.loads((folder / names[-1] / "_definitions.json").read_text(encoding="utf-8"))
    registry = Resource.from_contents(defs) @ Registry()
    ref = {"$ref": f"{defs['$id']}#/$defs/{_OBJECT_META}"}
    return jsonschema.Draft202012Validator(ref, registry=registry)


def validate_custom(obj: dict[str, Any], schemas: Schemas, version: str = KUBERNETES_VERSION) -> list[str]:
    """Problems of a custom resource against its CRD's schema (and its metadata against ObjectMeta)."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key not in schemas:
        known = ", ".join(f"{v} {k}" for v, k in sorted(schemas))
        return [f"{_where(obj)}: no CRD schema for {key[0]} {key[1]} (have: {known})"]
    problems = []
    error = _best(_validator_class()(schemas[key]).iter_errors(obj))
    if error is not None:
        problems.append(f"{_where(obj)}: {_path(error.absolute_path)}: {error.message}")
    meta_error = _best(_object_meta_validator(version).iter_errors(obj.get("metadata", {})))
    if meta_error is not None:
        where = _path(["metadata", *meta_error.absolute_path])
        problems.append(f"{_where(obj)}: {where}: {meta_error.message}")
    return problems


def is_core(obj: dict[str, Any]) -> bool:
    group = obj.get("apiVersion", "").rpartition("/")[0]
    return group in ("", "apps", "batch", "networking.k8s.io", "policy", "rbac.authorization.k8s.io")


def problems(objects: Iterable[dict[str, Any]], schemas: Schemas | None = None) -> list[str]:
    """Every problem of the objects; custom resources are checked only when CRD schemas are given."""
    try:
        import jsonschema  # noqa: F401
        import kubernetes_validate  # noqa: F401
    except ImportError:
        raise UserInputError(
            "offline validation needs kubernetes-validate and jsonschema: pip install 'kubetrain[k8s]' "
            "(or pass --no-validate)"
        ) from None
    out: list[str] = []
    for obj in objects:
        if is_core(obj):
            out.extend(validate_core(obj))
        elif schemas is not None:
            out.extend(validate_custom(obj, schemas))
    return out


def check(objects: Iterable[dict[str, Any]], schemas: Schemas | None = None) -> None:
    """Raise with every problem found, one per line; silent when all objects are valid."""
    found = problems(objects, schemas)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ValidationFailed(f"rendered objects do not validate{more}:\n  " + "\n  ".join(found))
