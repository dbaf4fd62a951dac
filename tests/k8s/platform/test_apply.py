"""`kubetrain k8s platform apply` against the local API server of tests/k8s/apiserver.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import yaml

from ..apiserver import ApiServer
from .conftest import CRDS

Cli = Callable[..., tuple[int, str, str]]


def test_refused_without_the_prometheus_operator(apiserver: ApiServer, cli: Cli, tmp_path: Path) -> None:
    code, _, err = cli("k8s", "platform", "apply", "--kubeconfig", str(apiserver.kubeconfig(tmp_path)))
    assert code == 2 and err.startswith("error:") and "does not serve PodMonitor" in err
    assert "monitoring.enabled: false" in err
    assert not [r for r in apiserver.requests if r.get("method") == "PATCH"]  # nothing was sent


def test_dry_run_then_apply(apiserver: ApiServer, cli: Cli, tmp_path: Path) -> None:
    for path in sorted(CRDS.glob("*.yaml")):
        apiserver.install_crd(yaml.safe_load(path.read_text()))
    kubeconfig = str(apiserver.kubeconfig(tmp_path))
    code, out, err = cli("k8s", "platform", "apply", "--kubeconfig", kubeconfig, "-n", "ml", "--dry-run")
    assert code == 0, err
    assert "accepted all 10 objects" in out and not apiserver.objects
    code, out, err = cli("k8s", "platform", "apply", "--kubeconfig", kubeconfig, "-n", "ml")
    assert code == 0, err
    assert "deployment/kubetrain-mlflow created" in out and "prometheusrule/kubetrain-alerts created" in out
    assert "tracking_uri: http://kubetrain-mlflow.ml:5000" in out
    stored = {(o["kind"], o["metadata"]["name"]) for o in apiserver.objects.values()}
    assert {("Deployment", "kubetrain-mlflow"), ("StatefulSet", "kubetrain-postgres"),
            ("PodMonitor", "kubetrain-trainers"), ("ConfigMap", "kubetrain-dashboard")} <= stored
    code, out, _ = cli("k8s", "platform", "apply", "--kubeconfig", kubeconfig, "-n", "ml")
    assert code == 0 and "created" not in out  # a second apply changes nothing
