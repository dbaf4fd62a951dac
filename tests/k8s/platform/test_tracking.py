"""The MLflow tracking server: its objects validate and are restricted; its command runs a real MLflow server on a
real PostgreSQL, and a training run logs params, metrics and artifacts through it that MlflowClient reads back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.k8s.platform.config import PlatformConfig
from kubetrain.k8s.platform.render import render_platform
from kubetrain.k8s.platform.tracking import ARTIFACTS_MOUNT, TRAINER_PODS, server_args, tracking_uri
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.manifest import pod_templates, render
from kubetrain.k8s.render.podsecurity import restricted_violations
from tests.track.conftest import TrainTiny, data_cache, train_tiny  # noqa: F401  (fixtures)
from tests.track.test_mlflow_sink import check_tracked_run, free_port, only_run, postgres_uri  # noqa: F401

Cli = Callable[..., tuple[int, str, str]]
VARIANTS = {
    "statefulset-and-claim": {},
    "existing-database-and-store": {"mlflow": {
        "postgres": {"uri": "postgresql://mlflow@db.data.svc:5432/mlflow", "secret_name": "db"},
        "artifacts": {"uri": "s3://ml-artifacts/mlflow", "endpoint_url": "http://seaweedfs.storage:8333",
                      "secret_name": "store"}}},
}


def templates(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [t for o in objects for _, t in pod_templates(o)]
    return out + [o["spec"]["template"] for o in objects if o["kind"] == "Deployment"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_objects_validate_strictly_and_pods_are_restricted(variant: str, monitoring_schemas: Any) -> None:
    objects = render_platform(PlatformConfig.model_validate({"namespace": "ml", **VARIANTS[variant]}))
    assert validate.problems(objects, monitoring_schemas) == []
    pods = templates(objects)
    assert len(pods) == (2 if variant == "statefulset-and-claim" else 1)
    for template in pods:
        assert restricted_violations(template["spec"]) == []
        for container in template["spec"]["containers"]:
            for var in container["env"]:  # credentials only ever by reference
                if "PASSWORD" in var["name"] or "SECRET" in var["name"]:
                    assert set(var) == {"name", "valueFrom"} and "secretKeyRef" in var["valueFrom"]


def test_existing_database_renders_no_statefulset_and_no_claim() -> None:
    cfg = PlatformConfig.model_validate({"namespace": "ml", **VARIANTS["existing-database-and-store"]})
    kinds = [o["kind"] for o in render_platform(cfg)]
    assert "StatefulSet" not in kinds and "PersistentVolumeClaim" not in kinds
    args = server_args(cfg)
    assert args[args.index("--backend-store-uri") + 1] == "postgresql://mlflow@db.data.svc:5432/mlflow"
    assert args[args.index("--artifacts-destination") + 1] == "s3://ml-artifacts/mlflow"


def test_network_policy_admits_the_namespaces_training_pods_only() -> None:
    objects = render_platform(PlatformConfig(namespace="ml"))
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "kubetrain-mlflow")
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": TRAINER_PODS}}]  # no namespaceSelector: this one only
    job = render(load_config(None, "tiny", ["k8s.namespace=ml"]))
    for _, template in pod_templates(job[-1]):
        labels = template["metadata"]["labels"]
        assert TRAINER_PODS.items() <= labels.items()  # a training pod is admitted
    db = next(o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "kubetrain-postgres")
    mlflow = next(o for o in objects if o["kind"] == "Deployment")
    assert db["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].items() <= \
        mlflow["spec"]["template"]["metadata"]["labels"].items()  # the database admits MLflow


def test_a_password_in_the_uri_is_refused(tmp_path: Path, cli: Cli) -> None:
    config = tmp_path / "platform.yaml"
    config.write_text(yaml.safe_dump({"mlflow": {"postgres": {"uri": "postgresql://mlflow:hunter2@db/mlflow"}}}))
    code, out, err = cli("k8s", "platform", "render", str(config))
    assert code == 2 and err.startswith("error:") and "password" in err and "hunter2" not in out
    config.write_text(yaml.safe_dump({"mlfow": {}}))
    code, _, err = cli("k8s", "platform", "render", str(config))
    assert code == 2 and "mlfow" in err


def test_cli_render_names_the_tracking_uri(cli: Cli, tmp_path: Path) -> None:
    code, out, err = cli("k8s", "platform", "render", "-n", "ml", "--crds", str(Path(__file__).parent / "crds"))
    assert code == 0, err
    assert [d["kind"] for d in yaml.safe_load_all(out)][-3:] == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    assert "track.mlflow.tracking_uri: http://kubetrain-mlflow.ml:5000" in err


def _get(url: str, host: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except urllib.error.URLError:
        return 0  # not listening yet


@pytest.fixture
def mlflow_server(postgres_uri: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:  # noqa: F811
    """The rendered container's `mlflow server` command, run here on the real PostgreSQL (http URL, artifacts)."""
    port = free_port()
    cfg = PlatformConfig.model_validate({"namespace": "ml", "mlflow": {"port": port, "workers": 1,
                                                                       "postgres": {"uri": postgres_uri}}})
    args = server_args(cfg)
    artifacts = tmp_path / "artifacts"
    args[args.index(ARTIFACTS_MOUNT)] = str(artifacts)  # the claim's mount point, here
    args[args.index("0.0.0.0")] = "127.0.0.1"
    env = {**os.environ, "HOME": str(tmp_path), "PGPASSWORD": "from-the-secret"}  # trust auth ignores it
    mlflow = [str(Path(sys.executable).parent / "mlflow"), *args[1:]]
    log = (tmp_path / "mlflow.log").open("wb")
    # its own process group: `mlflow server` runs uvicorn as a child, which must go with it
    server = subprocess.Popen(mlflow, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # the first start creates the schema in PostgreSQL
        while _get(f"{url}/health") != 200:  # what the readiness probe asks
            assert server.poll() is None, (tmp_path / "mlflow.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not become ready"
            time.sleep(0.5)
        yield url, artifacts
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.mark.slow
def test_training_logs_through_the_rendered_server(mlflow_server: tuple[str, Path], train_tiny: TrainTiny,  # noqa: F811
                                                   tmp_path: Path) -> None:
    url, artifacts = mlflow_server
    search = f"{url}/api/2.0/mlflow/experiments/search?max_results=1"
    service = tracking_uri(PlatformConfig(namespace="ml")).removeprefix("http://")
    assert _get(search, host=f"{service}") == 200  # how jobs name it (the Host header MLflow checks)
    assert _get(search, host="kubetrain-mlflow.ml.svc.cluster.local:5000") == 200
    assert _get(search, host="attacker.example:5000") == 403  # the DNS-rebinding guard stays on

    result = train_tiny("track.mlflow.enabled=true", f"track.mlflow.tracking_uri={url}")
    assert result.status == "finished"
    client, run_id = only_run(url)
    check_tracked_run(client, run_id, Path(result.run_dir), tmp_path / "downloaded")
    stored = {p.name for p in artifacts.rglob("*") if p.is_file()}
    assert {"config.yaml", "meta.json"} <= stored  # proxied by the server onto its artifact store


def test_the_shipped_platform_config_renders(cli: Cli) -> None:
    shipped = Path(__file__).resolve().parents[3] / "deploy" / "platform" / "platform.yaml"
    code, out, err = cli("k8s", "platform", "render", str(shipped), "--crds", str(Path(__file__).parent / "crds"))
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    assert {d["metadata"]["namespace"] for d in docs} == {"ml", "monitoring"}


def test_every_platform_key_is_explained(cli: Cli) -> None:
    code, out, err = cli("k8s", "platform", "explain")
    assert code == 0, err
    keys = [line.split()[0] for line in out.splitlines() if not line.startswith(" ")]
    assert "mlflow.postgres.secret_name" in keys and "monitoring.alerts.hang_minutes" in keys
    described = [line for line in out.splitlines() if line.startswith("    ")]
    assert len(described) == len(keys)  # every key has a description
    code, _, err = cli("k8s", "platform", "explain", "mlflow.nope")
    assert code == 2 and "unknown platform config key" in err
