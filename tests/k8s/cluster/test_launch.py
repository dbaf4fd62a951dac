"""launch (dry run of everything first, owner references from the first apply, relaunch) and stop, over HTTP."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from kubetrain.config import load_config
from kubetrain.k8s.render.manifest import render

Cli = Callable[..., tuple[int, str, str]]
JOB = "/apis/batch/v1/namespaces/ml/jobs/tiny"
CONFIG_MAP = "/api/v1/namespaces/ml/configmaps/tiny-config"


def launch(cli: Cli, kubeconfig: Path, *args: str) -> tuple[int, str, str]:
    return cli("k8s", "launch", "--set", "k8s.namespace=ml", "--kubeconfig", str(kubeconfig), *args)


def patches(apiserver: Any, dry_run: bool | None = None) -> list[dict[str, Any]]:
    return [r for r in apiserver.requests if r["method"] == "PATCH"
            and (dry_run is None or ("dryRun" in r["query"]) == dry_run)]


def test_everything_is_validated_then_applied_with_owners_from_the_first_apply(
    tmp_path: Path, apiserver: Any, cli: Cli
) -> None:
    code, out, err = launch(cli, apiserver.kubeconfig(tmp_path))
    assert code == 0, err
    rendered = render(load_config(None, "tiny", ["k8s.namespace=ml"]))
    dry, real = patches(apiserver, True), patches(apiserver, False)
    assert len(dry) == len(real) == len(rendered)
    assert apiserver.requests.index(dry[-1]) < apiserver.requests.index(real[0])  # all validated, then applied
    for p in real:
        assert p["content_type"] == "application/apply-patch+yaml"
        assert p["query"] == {"fieldManager": ["kubetrain"], "force": ["true"]}
    job_uid = apiserver.objects[JOB]["metadata"]["uid"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "tiny", "uid": job_uid}
    assert [p["body"]["kind"] for p in real] == ["PersistentVolumeClaim", "Job", "ConfigMap", "NetworkPolicy",
                                                 "Service"]
    for p in real[2:]:  # never applied without the reference
        assert p["body"]["metadata"]["ownerReferences"] == [owner]
    assert "persistentvolumeclaim/tiny-checkpoints created" in out and "job/tiny created" in out
    assert "kubetrain k8s logs tiny -f" in out

    before = json.dumps(apiserver.objects, sort_keys=True)
    code, out, _ = launch(cli, apiserver.kubeconfig(tmp_path))
    assert code == 0 and out.splitlines() == ["job/tiny is running and unchanged: nothing to apply"]
    assert json.dumps(apiserver.objects, sort_keys=True) == before  # owner references still there


def test_a_changed_config_on_a_running_job_changes_nothing(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    assert launch(cli, kubeconfig)[0] == 0
    config_before = copy.deepcopy(apiserver.objects[CONFIG_MAP])
    applied = len(patches(apiserver, False))
    code, _, err = launch(cli, kubeconfig, "--set", "train.lr=0.01")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: job/tiny is running with another spec, and its spec.template cannot change")
    assert "`kubetrain k8s stop tiny` first" in err and "another k8s.name" in err
    assert "PodTemplateSpec" not in err  # one line, not the template
    assert apiserver.objects[CONFIG_MAP] == config_before  # the ConfigMap still holds the running config
    assert len(patches(apiserver, False)) == applied


def test_relaunching_a_finished_job_says_so(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    assert launch(cli, kubeconfig)[0] == 0
    apiserver.start(apiserver.pod("tiny", 0), "step 8/8\n")
    apiserver.exit(apiserver.pod("tiny", 0), 0)
    assert apiserver.objects[JOB]["status"]["conditions"][-1]["type"] == "Complete"
    applied = len(patches(apiserver, False))
    for extra in ([], ["--set", "train.lr=0.01"]):
        code, out, err = launch(cli, kubeconfig, *extra)
        assert code == 2 and "follow it" not in out
        assert "job/tiny already finished (succeeded); nothing was applied" in err
        assert "`kubetrain k8s stop tiny` (claims and checkpoints stay), then launch" in err
    assert len(patches(apiserver, False)) == applied


def test_dry_run_asks_the_server_and_stores_nothing(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    code, out, err = launch(cli, apiserver.kubeconfig(tmp_path), "--dry-run")
    assert code == 0, err
    assert len(patches(apiserver)) == 5 and all(p["query"]["dryRun"] == ["All"] for p in patches(apiserver))
    assert apiserver.objects == {}
    assert "dry run: the API server accepted all 5 objects; nothing was stored" in out


def test_missing_crd_is_refused_before_anything_is_applied(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    code, _, err = launch(cli, apiserver.kubeconfig(tmp_path), "--workload", "pytorchjob")
    assert code == 2
    assert "does not serve PyTorchJob (kubeflow.org/v1): its CRD is not installed" in err
    assert "Kubeflow training-operator" in err
    assert not patches(apiserver)


def jobset_crd(crd_folder: Path) -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load((crd_folder / "jobset.x-k8s.io_jobsets.yaml").read_text())
    return crd


def test_custom_resources_are_checked_against_the_clusters_crd(
    tmp_path: Path, apiserver: Any, cli: Cli, crd_folder: Path
) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    older = jobset_crd(crd_folder)  # a cluster whose JobSet does not know spec.network yet
    for version in older["spec"]["versions"]:
        del version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["network"]
    apiserver.install_crd(older)
    code, _, err = launch(cli, kubeconfig, "--workload", "jobset")
    assert code == 2 and "JobSet 'tiny': spec: Additional properties are not allowed ('network'" in err
    assert not patches(apiserver)
    apiserver.install_crd(jobset_crd(crd_folder))
    code, _, err = launch(cli, kubeconfig, "--workload", "jobset", "--dry-run")
    assert code == 0 and "note:" not in err, err


def test_an_editor_who_cannot_read_crds_is_told_the_cr_went_unchecked(
    tmp_path: Path, apiserver: Any, cli: Cli, crd_folder: Path, monkeypatch: Any
) -> None:
    monkeypatch.delenv("KUBETRAIN_CRD_DIR", raising=False)
    apiserver.install_crd(jobset_crd(crd_folder))
    apiserver.editor_of = "ml"
    code, _, err = launch(cli, apiserver.kubeconfig(tmp_path), "--workload", "jobset", "--dry-run")
    assert code == 0, err
    assert err.splitlines() == ["note: JobSet rendered without a CRD schema check (give --crds DIR or "
                                "KUBETRAIN_CRD_DIR; launch checks against the cluster's CRD)"]
    code, _, err = launch(cli, apiserver.kubeconfig(tmp_path), "--workload", "jobset", "--dry-run",
                          "--crds", str(crd_folder))
    assert code == 0 and err == ""


def test_forbidden_and_conflict_are_one_line(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    apiserver.answer("PATCH", JOB, 403, apiserver.recorded("forbidden_patch_job"))
    code, _, err = launch(cli, kubeconfig)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: apply Job tiny in namespace ml: forbidden (403) by http://127.0.0.1:")
    assert 'User "alice" cannot patch resource "jobs"' in err
    assert not patches(apiserver, False)  # refused in the dry run: nothing applied before it
    apiserver.answer("PATCH", JOB, 409, apiserver.recorded("conflict_job_being_deleted"))
    code, _, err = launch(cli, kubeconfig)
    assert code == 2 and "conflict (409)" in err and "object is being deleted" in err


def test_stop_deletes_the_job_and_keeps_the_claims(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    assert launch(cli, kubeconfig)[0] == 0
    code, out, err = cli("k8s", "stop", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    deletes = [r for r in apiserver.requests if r["method"] == "DELETE"]
    assert [r["path"].rsplit("/", 2)[-2] for r in deletes] == ["jobs", "configmaps", "networkpolicies", "services"]
    assert all(r["body"]["propagationPolicy"] == "Background" for r in deletes)
    assert list(apiserver.objects) == ["/api/v1/namespaces/ml/persistentvolumeclaims/tiny-checkpoints"]
    assert "kept claims (checkpoints; the next launch resumes from them): tiny-checkpoints" in out
    code, out, err = cli("k8s", "stop", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 2 and "no kubetrain job 'tiny' in namespace ml" in err


def test_stop_of_a_missing_job_prints_only_its_error(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """No job: every kind is tried, and the custom ones this cluster does not serve were each said before the
    error (`skipped JobSet: not served here`, TrainJob, PyTorchJob). Only the error now."""
    kubeconfig = apiserver.kubeconfig(tmp_path)
    code, out, err = cli("k8s", "stop", "missing", "--kubeconfig", str(kubeconfig))
    assert (code, out) == (2, "")
    assert err.startswith("error: no kubetrain job 'missing' in namespace ml on ") and err.count("\n") == 1


def test_stop_as_a_namespace_editor_with_other_crds_installed(
    tmp_path: Path, apiserver: Any, cli: Cli
) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    assert launch(cli, kubeconfig)[0] == 0
    apiserver.editor_of = "ml"
    apiserver.forbidden = {"jobsets", "pytorchjobs", "trainjobs"}  # installed, but not in the edit role
    code, out, err = cli("k8s", "stop", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert "deleted job/tiny" in out and "tiny-checkpoints" in out
    assert not [r for r in apiserver.requests if "jobsets" in r["path"]]  # acts on the kind it launched
    # without the ConfigMap that records the kind, every kind is tried and the forbidden ones are skipped
    assert launch(cli, kubeconfig)[0] == 0
    del apiserver.objects[CONFIG_MAP]
    code, out, err = cli("k8s", "stop", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert "skipped JobSet: forbidden here" in out and "deleted job/tiny" in out
    assert "kept claims (checkpoints; the next launch resumes from them): tiny-checkpoints" in out
