"""The MLflow tracking server: its objects validate and are restricted; its command runs a real MLflow server on a
real PostgreSQL, and a training run logs params, metrics and artifacts through it that MlflowClient reads back."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.k8s.platform.config import PlatformConfig
from kubetrain.k8s.platform.render import render_platform
from kubetrain.k8s.platform.tracking import (
    ARTIFACTS_MOUNT,
    REQUEST_HEADROOM,
    TRAINER_PODS,
    auth_ini,
    backend_uri,
    server_args,
    server_memory,
    tracking_uri,
)
from kubetrain.k8s.quantities import quantity
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.manifest import pod_templates, render
from kubetrain.k8s.render.podsecurity import restricted_violations
from tests.conftest import cli_env
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


def _get(url: str, host: str | None = None, auth: tuple[str, str] | None = None) -> int:
    headers = {"Host": host} if host else {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    request = urllib.request.Request(url, headers=headers)
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
        _stop(server, log)


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
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


def test_the_server_runs_without_job_execution_in_memory_sized_from_a_measurement() -> None:
    cfg = PlatformConfig(namespace="ml")
    [container] = deployment(cfg)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"  # no huey job runner: 1.4 GiB less
    assert container["command"][container["command"].index("--workers") + 1] == "2"
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "1024Mi"},
                                      "limits": {"memory": "1536Mi"}}
    assert server_memory(PlatformConfig.model_validate({"mlflow": {"workers": 4}})) == ("1664Mi", "2432Mi")
    assert server_memory(PlatformConfig.model_validate({"mlflow": {"memory": "3Gi"}})) == ("3Gi", "3Gi")
    # the user's environment wins by name: job execution back on, for MLflow's server-side jobs
    cfg = PlatformConfig.model_validate({"mlflow": {"env": {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true"}}})
    [container] = deployment(cfg)["spec"]["template"]["spec"]["containers"]
    assert [e["value"] for e in container["env"] if e["name"] == "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == ["true"]


def test_a_secret_in_the_servers_environment_is_refused(tmp_path: Path, cli: Cli) -> None:
    path = tmp_path / "platform.yaml"
    path.write_text("mlflow:\n  env:\n    AWS_SECRET_ACCESS_KEY: hunter2\n")
    code, out, err = cli("k8s", "platform", "render", str(path))
    assert code == 2 and out == "" and "hunter2" not in err
    assert err.splitlines() == [f"error: {path}: mlflow.env: 'AWS_SECRET_ACCESS_KEY' looks like a secret: the server "
                                "reads secrets only from Secrets"]


def test_basic_auth_reads_its_credentials_from_a_secret() -> None:
    cfg = PlatformConfig.model_validate({"namespace": "ml", "mlflow": {"auth": {"enabled": True}}})
    objects = render_platform(cfg)
    [container] = deployment(cfg)["spec"]["template"]["spec"]["containers"]
    assert container["command"][-2:] == ["--app-name", "basic-auth"]
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": "kubetrain-mlflow-auth", "key": "admin-password"}}
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "kubetrain-mlflow-auth", "key": "flask-secret-key"}}
    [ini] = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kubetrain-mlflow-auth"]
    assert env["MLFLOW_AUTH_CONFIG_PATH"]["value"] == f"/etc/mlflow-auth/{next(iter(ini['data']))}"
    assert "password" not in ini["data"]["basic_auth.ini"].replace("admin_password", "")  # none inline
    assert "database_uri = postgresql://mlflow@kubetrain-postgres:5432/mlflow" in ini["data"]["basic_auth.ini"]
    assert not any(o["kind"] == "Secret" for o in objects)  # the team creates it


def deployment(cfg: PlatformConfig) -> dict[str, Any]:
    return next(o for o in render_platform(cfg) if o["kind"] == "Deployment")


@contextmanager
def rendered_server(tmp_path: Path, platform: dict[str, Any], secrets: dict[str, str]) -> Iterator[tuple[str, int]]:
    """The rendered container's command and environment run here: on loopback, SQLite in tmp_path for the
    backend (and the auth users), `secrets` standing in for the Secret's values. Yields (url, server pid)."""
    port = free_port()
    cfg = PlatformConfig.model_validate({"namespace": "ml", **platform, "mlflow": {**platform.get("mlflow", {}),
                                                                                   "port": port}})
    [container] = deployment(cfg)["spec"]["template"]["spec"]["containers"]
    args, database = list(container["command"]), f"sqlite:///{tmp_path / 'mlflow.db'}"
    args[args.index("0.0.0.0")] = "127.0.0.1"
    args[args.index(backend_uri(cfg))] = database
    args[args.index(ARTIFACTS_MOUNT)] = str(tmp_path / "artifacts")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "HOME": str(tmp_path)}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var["name"] in secrets:
            env[var["name"]] = secrets[var["name"]]
    if "MLFLOW_AUTH_CONFIG_PATH" in env:  # the ConfigMap's file, with the same backend as the server's
        ini = tmp_path / "basic_auth.ini"
        ini.write_text(auth_ini(cfg).replace(backend_uri(cfg), database))
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(ini)
    log = (tmp_path / "mlflow.log").open("wb")
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), *args[1:]], env=env, stdout=log,
                              stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 480  # a safety net: four processes import mlflow on a loaded machine
        while _get(f"{url}/health") != 200:
            assert server.poll() is None, (tmp_path / "mlflow.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not become ready"
            time.sleep(0.5)
        yield url, server.pid
    finally:
        _stop(server, log)


def tree_rss(pid: int) -> int:
    """Bytes resident in the server's process tree (RSS summed: shared pages counted in each, an upper bound)."""
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        with suppress(psutil.Error):  # a process that ended between the listing and the read
            total += process.memory_info().rss
    return total


@pytest.mark.slow
def test_the_rendered_server_fits_its_memory_limit(tmp_path: Path) -> None:
    request, limit = server_memory(PlatformConfig())
    with rendered_server(tmp_path, {}, {}) as (url, pid):
        for _ in range(10):  # what a trainer asks of it
            assert _get(f"{url}/api/2.0/mlflow/experiments/search?max_results=10") == 200
        used = max(tree_rss(pid) for _ in range(3))
    # measured here: about 786 MiB with the 2 default workers (the sizing in tracking.py); with job execution on,
    # 2.6 GiB, which the former 1Gi limit OOM-killed on a real cluster
    assert used * REQUEST_HEADROOM <= quantity(limit), f"{used / 2**20:.0f} MiB used, limit {limit}"
    assert used <= quantity(request), f"{used / 2**20:.0f} MiB used, request {request}"


@pytest.mark.slow
def test_basic_auth_refuses_a_request_without_credentials(tmp_path: Path) -> None:
    secrets = {"MLFLOW_AUTH_ADMIN_PASSWORD": "s3cret-admin-pw", "MLFLOW_FLASK_SERVER_SECRET_KEY": "csrf-key"}
    platform = {"mlflow": {"workers": 1, "auth": {"enabled": True}}}
    with rendered_server(tmp_path, platform, secrets) as (url, _):
        search = f"{url}/api/2.0/mlflow/experiments/search?max_results=1"
        assert _get(search) == 401
        assert _get(search, auth=("admin", "wrong")) == 401
        assert _get(search, auth=("admin", "s3cret-admin-pw")) == 200
        assert _get(f"{url}/health") == 200  # the probes need no user


def _stop(server: subprocess.Popen[bytes], log: Any) -> None:
    """End a server started in its own process group (SIGTERM, then SIGKILL after 30 s) and close its log."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    log.close()


def _post(url: str, body: dict[str, Any], auth: tuple[str, str]) -> int:
    import json

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json",
        "Authorization": "Basic " + base64.b64encode(":".join(auth).encode()).decode()})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_job_with_its_own_credentials_logs_a_run_and_a_reader_cannot_write(
        tmp_path: Path, train_tiny: TrainTiny, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """docs/platform.md's recipe, against the rendered server with auth on: a user made with users/create alone got
    403 at runs/create in the experiment that already existed (default_permission READ), and the job trained on
    untracked. `kubetrain k8s platform grant` (an EDIT grant, made as the admin) is what the docs now say."""
    from mlflow.tracking import MlflowClient

    admin = ("admin", "s3cret-admin-pw")
    secrets = {"MLFLOW_AUTH_ADMIN_PASSWORD": admin[1], "MLFLOW_FLASK_SERVER_SECRET_KEY": "csrf-key"}
    with rendered_server(tmp_path, {"mlflow": {"workers": 1, "auth": {"enabled": True}}}, secrets) as (url, _):
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", admin[0])
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", admin[1])
        existing = MlflowClient(url).create_experiment("kubetrain")  # made before the job's user had any say
        users = f"{url}/api/2.0/mlflow/users/create"
        assert _post(users, {"username": "reader", "password": "reader-password-1"}, admin) == 200
        assert _post(users, {"username": "trainer", "password": "trainer-password-1"}, admin) == 200
        runs = f"{url}/api/2.0/mlflow/runs/create"
        trainer = ("trainer", "trainer-password-1")
        assert _post(runs, {"experiment_id": existing}, trainer) == 403  # where the old recipe ended

        monkeypatch.setenv("TRAINER_PASSWORD", "trainer-password-1")
        code, out, err = cli("k8s", "platform", "grant", "--tracking-uri", url, "--user", "trainer",
                             "--experiment", "kubetrain", "--password-env", "TRAINER_PASSWORD")
        assert code == 0, err
        assert out.splitlines() == ["MLflow user trainer exists (its password is unchanged)",
                                    f"experiment kubetrain (existing, id {existing})",
                                    "granted EDIT on experiment kubetrain to trainer: its jobs can create runs there"]
        code, out, err = cli("k8s", "platform", "grant", "--tracking-uri", url, "--user", "trainer")
        assert code == 0 and out.splitlines()[-1] == "trainer had EDIT on it already: kept as it is", err

        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "trainer")  # the job's own credentials, from its Secret
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "trainer-password-1")
        result = train_tiny("track.mlflow.enabled=true", f"track.mlflow.tracking_uri={url}")
        assert result.status == "finished"
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", admin[0])
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", admin[1])
        [run] = MlflowClient(url).search_runs([existing])
        assert run.info.status == "FINISHED" and run.data.metrics  # the job's run, with its metrics

        reader = ("reader", "reader-password-1")
        assert _post(runs, {"experiment_id": existing}, reader) == 403  # a reader cannot write
        assert _get(f"{url}/api/2.0/mlflow/runs/get?run_id={run.info.run_id}", auth=reader) == 200  # but reads

        # a READ grant (made by hand, as the admin) must be raised, not "kept as it is" (the job would stay
        # untracked), and no grant may print MLflow's StarletteDeprecationWarning. Run as a user runs it: its own
        # process.
        grants = f"{url}/api/3.0/mlflow/users/permissions/grant"
        assert _post(grants, {"username": "reader", "resource_type": "experiment", "resource_id": existing,
                              "permission": "READ"}, admin) == 200
        done = subprocess.run([sys.executable, "-m", "kubetrain", "k8s", "platform", "grant", "--tracking-uri", url,
                               "--user", "reader"], env=cli_env(), capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == ("raised reader's READ on experiment kubetrain to EDIT: its jobs can "
                                                "create runs there")
        assert done.stderr == ""  # quiet when all is well
        assert _post(runs, {"experiment_id": existing}, reader) == 200  # the raised grant lets it write
