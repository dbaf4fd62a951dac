"""launch (server-side apply, idempotent, owner references, dry run) and stop (claims kept), over HTTP."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.config import load_config
from kubetrain.k8s.render.manifest import render

Cli = Callable[..., tuple[int, str, str]]
JOB = "/apis/batch/v1/namespaces/ml/jobs/tiny"


def launch(cli: Cli, kubeconfig: Path, *args: str) -> tuple[int, str, str]:
    return cli("k8s", "launch", "--set", "k8s.namespace=ml", "--kubeconfig", str(kubeconfig), *args)


def test_launch_applies_every_object_then_owns_them(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    code, out, err = launch(cli, apiserver.kubeconfig(tmp_path))
    assert code == 0, err
    patches = [r for r in apiserver.requests if r["method"] == "PATCH"]
    expected = render(load_config(None, "tiny", ["k8s.namespace=ml"]))
    assert [p["body"] for p in patches[: len(expected)]] == expected  # the rendered objects, in order
    for p in patches:
        assert p["content_type"] == "application/apply-patch+yaml"
        assert p["query"] == {"fieldManager": ["kubetrain"], "force": ["true"]}
    assert patches[len(expected) - 1]["path"] == JOB
    owned = patches[len(expected) :]
    assert sorted(p["body"]["kind"] for p in owned) == ["ConfigMap", "NetworkPolicy", "Service"]
    job_uid = apiserver.objects[JOB]["metadata"]["uid"]
    for p in owned:
        (ref,) = p["body"]["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "batch/v1", "kind": "Job", "name": "tiny", "uid": job_uid}
    assert "persistentvolumeclaim/tiny-checkpoints created" in out and "job/tiny created" in out
    assert "kubetrain k8s logs tiny -f" in out
    # launching again changes nothing and says so
    before = json.dumps(apiserver.objects, sort_keys=True)
    code, out, _ = launch(cli, apiserver.kubeconfig(tmp_path))
    assert code == 0 and "job/tiny applied" in out and "created" not in out
    assert json.dumps(apiserver.objects, sort_keys=True) == before


def test_dry_run_asks_the_server_and_stores_nothing(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    code, out, err = launch(cli, apiserver.kubeconfig(tmp_path), "--dry-run")
    assert code == 0, err
    patches = [r for r in apiserver.requests if r["method"] == "PATCH"]
    assert len(patches) == 5 and all(p["query"]["dryRun"] == ["All"] for p in patches)
    assert apiserver.objects == {}
    assert "dry run" in out


def test_missing_crd_is_refused_before_anything_is_applied(
    tmp_path: Path, apiserver: Any, cli: Cli
) -> None:
    apiserver.answer("GET", "/apis/kubeflow.org/v1", 404, b"404 page not found\n", "text/plain")
    code, _, err = launch(cli, apiserver.kubeconfig(tmp_path), "--workload", "pytorchjob")
    assert code == 2
    assert "does not serve PyTorchJob (kubeflow.org/v1): its CRD is not installed" in err
    assert "Kubeflow training-operator" in err
    assert not [r for r in apiserver.requests if r["method"] == "PATCH"]


def test_forbidden_conflict_and_immutable(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    apiserver.answer("PATCH", JOB, 403, apiserver.recorded("forbidden_patch_job"))
    code, _, err = launch(cli, kubeconfig)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: apply Job tiny in namespace ml: forbidden (403) by http://127.0.0.1:")
    assert 'User "alice" cannot patch resource "jobs"' in err

    apiserver.answer("PATCH", JOB, 409, apiserver.recorded("conflict_job_being_deleted"))
    code, _, err = launch(cli, kubeconfig)
    assert code == 2 and "conflict (409)" in err and "object is being deleted" in err

    apiserver.answer("PATCH", JOB, 422, apiserver.recorded("invalid_job_immutable"))
    code, _, err = launch(cli, kubeconfig)
    assert code == 2 and "field is immutable" in err and "`kubetrain k8s stop tiny` first" in err


def test_stop_deletes_the_job_and_keeps_the_claims(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    assert launch(cli, kubeconfig)[0] == 0
    code, out, err = cli("k8s", "stop", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    deletes = [r for r in apiserver.requests if r["method"] == "DELETE"]
    assert sorted(r["path"].rsplit("/", 2)[-2] for r in deletes) == [
        "configmaps",
        "jobs",
        "networkpolicies",
        "services",
    ]
    assert all(r["body"]["propagationPolicy"] == "Background" for r in deletes)
    assert list(apiserver.objects) == ["/api/v1/namespaces/ml/persistentvolumeclaims/tiny-checkpoints"]
    assert "kept claims (checkpoints; the next launch resumes from them): tiny-checkpoints" in out
    code, _, err = cli("k8s", "stop", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 2 and "no kubetrain job 'tiny' in namespace ml" in err
