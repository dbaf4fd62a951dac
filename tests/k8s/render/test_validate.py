"""Offline validation: unknown fields and wrong types are errors, for core kinds and custom resources."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from kubetrain.config import load_config
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.manifest import pod_templates, render


def workload(name: str) -> dict[str, Any]:
    cfg = load_config(None, "tiny", ["k8s.nnodes=2"])
    return copy.deepcopy(render(cfg, name)[-1])


KINDS = ["indexed-job", "jobset", "trainjob", "pytorchjob", "statefulset"]


@pytest.mark.parametrize("name", KINDS)
def test_unknown_field_in_the_pod_is_an_error(name: str, crd_folder: Path) -> None:
    obj = workload(name)
    assert validate.problems([obj], crd_folder) == []
    pod_templates(obj)[0][1]["spec"]["containers"][0]["securityContext"]["runAsNonRot"] = True
    (problem,) = validate.problems([obj], crd_folder)
    assert "runAsNonRot" in problem and "securityContext" in problem and obj["kind"] in problem


@pytest.mark.parametrize("name", KINDS)
def test_unknown_metadata_field_is_an_error(name: str, crd_folder: Path) -> None:
    obj = workload(name)
    obj["metadata"]["lables"] = {}
    (problem,) = validate.problems([obj], crd_folder)
    assert "lables" in problem and "metadata" in problem


@pytest.mark.parametrize("name", ["jobset", "trainjob", "pytorchjob"])
def test_custom_resource_types_and_map_lists(name: str, crd_folder: Path) -> None:
    obj = workload(name)
    template = pod_templates(obj)[0][1]
    template["spec"]["terminationGracePeriodSeconds"] = "ninety"
    assert "ninety" in validate.problems([obj], crd_folder)[0]
    obj = workload(name)
    containers = pod_templates(obj)[0][1]["spec"]["containers"]
    containers.append(copy.deepcopy(containers[0]))
    assert "duplicate entry" in validate.problems([obj], crd_folder)[0]


def test_unknown_top_level_spec_field_of_a_custom_resource(crd_folder: Path) -> None:
    obj = workload("pytorchjob")
    obj["spec"]["elasticPolicyy"] = {}
    assert "elasticPolicyy" in validate.problems([obj], crd_folder)[0]


def test_unknown_kind_and_version() -> None:
    obj = {"apiVersion": "batch/v9", "kind": "Job", "metadata": {"name": "x"}}
    assert "no schema" in validate.validate_core(obj)[0]
    cr = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "x"}}
    assert "no CRD schema" in validate.problems([cr])[0]


def test_check_raises_a_user_error_listing_every_problem() -> None:
    objects = render(load_config(None, "tiny", []))
    objects[0]["data"] = {"config.yaml": 5}
    objects[-1]["spec"]["bogus"] = 1
    with pytest.raises(validate.ValidationFailed) as e:
        validate.check(objects)
    assert e.value.exit_code == 2
    assert "(and 1 more)" in str(e.value) and "bogus" in str(e.value)


def test_structural_schema_rules() -> None:
    schema = validate.structural({
        "type": "object",
        "properties": {
            "port": {"x-kubernetes-int-or-string": True},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "maybe": {"type": "string", "nullable": True},
            "tags": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
        },
    })
    v = validate._validator_class()(schema)

    def errors(doc: dict[str, Any]) -> list[str]:
        return [e.message for e in v.iter_errors(doc)]

    assert errors({"port": 80, "free": {"any": {"thing": 1}}, "labels": {"a": "b"}, "maybe": None}) == []
    assert errors({"port": "http"}) == []
    assert errors({"port": 1.5}) != []
    assert errors({"other": 1}) != []  # closed object
    assert errors({"labels": {"a": 1}}) != []
    assert errors({"tags": ["a", "a"]}) != []


def test_missing_crd_folder_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(validate.CRD_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(validate.CrdSchemasMissing, match="nowhere"):
        validate.crd_dir()


def test_crd_folder_is_found_beside_the_repository(crd_folder: Path) -> None:
    names = {p.name for p in crd_folder.glob("*.yaml")}
    assert {"jobset.x-k8s.io_jobsets.yaml", "kubeflow.org_pytorchjobs.yaml",
            "trainer.kubeflow.org_trainjobs.yaml"} <= names
    kinds = {kind for _, kind in validate.crd_schemas(crd_folder)}
    assert {"JobSet", "PyTorchJob", "TrainJob"} <= kinds
