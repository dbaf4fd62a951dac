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
def test_unknown_field_in_the_pod_is_an_error(name: str, crd_schemas: Any) -> None:
    obj = workload(name)
    assert validate.problems([obj], crd_schemas) == []
    pod_templates(obj)[0][1]["spec"]["containers"][0]["securityContext"]["runAsNonRot"] = True
    (problem,) = validate.problems([obj], crd_schemas)
    assert "runAsNonRot" in problem and "securityContext" in problem and obj["kind"] in problem


@pytest.mark.parametrize("name", KINDS)
def test_unknown_metadata_field_is_an_error(name: str, crd_schemas: Any) -> None:
    obj = workload(name)
    obj["metadata"]["lables"] = {}
    (problem,) = validate.problems([obj], crd_schemas)
    assert "lables" in problem and "metadata" in problem


@pytest.mark.parametrize("name", ["jobset", "trainjob", "pytorchjob"])
def test_custom_resource_types_and_map_lists(name: str, crd_schemas: Any) -> None:
    obj = workload(name)
    template = pod_templates(obj)[0][1]
    template["spec"]["terminationGracePeriodSeconds"] = "ninety"
    assert "ninety" in validate.problems([obj], crd_schemas)[0]
    obj = workload(name)
    containers = pod_templates(obj)[0][1]["spec"]["containers"]
    containers.append(copy.deepcopy(containers[0]))
    assert "duplicate entry" in validate.problems([obj], crd_schemas)[0]


def test_unknown_top_level_spec_field_of_a_custom_resource(crd_schemas: Any) -> None:
    obj = workload("pytorchjob")
    obj["spec"]["elasticPolicyy"] = {}
    assert "elasticPolicyy" in validate.problems([obj], crd_schemas)[0]


def test_unknown_kind_and_version() -> None:
    obj = {"apiVersion": "batch/v9", "kind": "Job", "metadata": {"name": "x"}}
    assert "no schema" in validate.validate_core(obj)[0]
    cr = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "x"}}
    assert "no CRD schema" in validate.problems([cr], {})[0]
    assert validate.problems([cr]) == [] and validate.unchecked([cr], None) == ["Widget"]


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


def test_a_crd_folder_that_was_named_must_hold_crds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(validate.CRD_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(validate.CrdSchemasMissing, match=r"KUBETRAIN_CRD_DIR: .*nowhere is not a folder"):
        validate.offline_schemas()
    with pytest.raises(validate.CrdSchemasMissing, match=r"--crds: .* holds no CustomResourceDefinition"):
        validate.offline_schemas(tmp_path)
    monkeypatch.delenv(validate.CRD_DIR_ENV)
    assert validate.offline_schemas() is None  # nothing named: nothing looked up beside the checkout


def test_the_crd_copies_hold_every_custom_kind(crd_folder: Path) -> None:
    names = {p.name for p in crd_folder.glob("*.yaml")}
    assert {"jobset.x-k8s.io_jobsets.yaml", "kubeflow.org_pytorchjobs.yaml",
            "trainer.kubeflow.org_trainjobs.yaml"} <= names
    kinds = {kind for _, kind in validate.offline_schemas(crd_folder) or {}}
    assert {"JobSet", "PyTorchJob", "TrainJob"} <= kinds


def test_render_without_crds_checks_core_kinds_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An installed kubetrain (no repository, no CRD copies around it) renders custom resources."""
    from kubetrain.cli import main

    monkeypatch.delenv(validate.CRD_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    for name in ("jobset", "trainjob", "pytorchjob"):
        with pytest.raises(SystemExit) as e:
            main(["k8s", "render", "--workload", name, "-o", str(tmp_path / name)])
        _, err = capsys.readouterr()
        assert e.value.code in (0, None), err
        assert err.startswith("note: ") and "rendered without a CRD schema check (give --crds DIR" in err
        assert err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        main(["k8s", "render", "--workload", "jobset", "--crds", str(tmp_path / "none")])
    assert e.value.code == 2 and "--crds: " in capsys.readouterr().err
