"""deploy/compose: the local stack passes the compose tool's own `config` check and promtool's, and mirrors the
cluster's platform (the same alert rules, the same MLflow server command, the shipped dashboard)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.k8s.platform.config import AlertsConfig, PlatformConfig
from kubetrain.k8s.platform.monitoring import DASHBOARD_FILE, rule_groups
from kubetrain.k8s.platform.tracking import server_args

COMPOSE = Path(__file__).resolve().parents[3] / "deploy" / "compose"
REGENERATE = ("python -c \"import yaml; from kubetrain.k8s.platform.config import AlertsConfig; from "
              "kubetrain.k8s.platform.monitoring import rule_groups; print(yaml.safe_dump({'groups': "
              "rule_groups(AlertsConfig())}, sort_keys=False, width=1000))\"")


def compose_config(docker_compose: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "POSTGRES_PASSWORD"}
    return subprocess.run([docker_compose, "-f", str(COMPOSE / "compose.yaml"), "config"], capture_output=True,
                          text=True, timeout=120, env={**clean, **env}, cwd=COMPOSE)


@pytest.fixture(scope="module")
def stack(docker_compose: str) -> dict[str, Any]:
    out = compose_config(docker_compose, POSTGRES_PASSWORD="only-from-the-environment")
    assert out.returncode == 0, out.stderr
    resolved: dict[str, Any] = yaml.safe_load(out.stdout)
    return resolved


def test_the_stack_passes_compose_config(stack: dict[str, Any]) -> None:
    assert set(stack["services"]) == {"trainer", "mlflow", "postgres", "prometheus", "grafana"}
    for name, service in stack["services"].items():  # as restricted as the pods kubetrain renders
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert not str(service.get("user", "1000")).startswith("0"), name
    assert stack["services"]["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_the_password_comes_only_from_the_environment(docker_compose: str) -> None:
    out = compose_config(docker_compose)
    assert out.returncode != 0 and "POSTGRES_PASSWORD" in out.stderr
    assert "only-from-the-environment" not in (COMPOSE / "compose.yaml").read_text()


def test_prometheus_config_passes_promtool(promtool: str) -> None:
    out = subprocess.run([promtool, "check", "config", str(COMPOSE / "prometheus" / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 7 rules found" in out.stdout  # the rules file it names was checked too


def test_the_rules_are_the_clusters() -> None:
    shipped = yaml.safe_load((COMPOSE / "prometheus" / "rules.yml").read_text())
    assert shipped == {"groups": rule_groups(AlertsConfig())}, f"regenerate it: {REGENERATE}"


def test_prometheus_scrapes_the_trainer_where_it_serves(stack: dict[str, Any]) -> None:
    prometheus = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    (target,) = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    trainer = stack["services"]["trainer"]
    cfg = load_config(COMPOSE / "train.yaml")  # the trainer's config validates
    assert target == f"trainer:{cfg.track.prometheus.port}" and cfg.track.prometheus.enabled
    assert f"127.0.0.1:{cfg.track.prometheus.port}:{cfg.track.prometheus.port}/tcp" in trainer["ports"]
    assert cfg.track.mlflow.enabled and cfg.track.mlflow.tracking_uri == "http://mlflow:5000"


def test_mlflow_runs_the_clusters_server_command(stack: dict[str, Any]) -> None:
    local = stack["services"]["mlflow"]["entrypoint"]
    cluster = server_args(PlatformConfig.model_validate(
        {"mlflow": {"workers": 1, "postgres": {"uri": "postgresql://mlflow@postgres:5432/mlflow"}}}))
    at = cluster.index("--allowed-hosts")
    assert local[:at] == cluster[:at]  # the same server; only the host names it answers to differ
    hosts = local[at + 1].split(",")
    assert "mlflow:*" in hosts  # the name the trainer's tracking_uri uses


def test_grafana_gets_the_shipped_dashboard(stack: dict[str, Any]) -> None:
    mounts = [v.split(":") for v in stack["services"]["grafana"]["volumes"]]
    provider = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "dashboards" / "kubetrain.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    (source,) = [Path(m[0]) for m in mounts if m[1] == path]
    assert (source / DASHBOARD_FILE).is_file()
    datasource = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")
                                .read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in stack["services"]


def test_the_named_volumes_of_the_image_are_its_users(stack: dict[str, Any]) -> None:
    """Docker fills an empty named volume from the image's folder at its mount point, ownership included; a
    folder the image lacks becomes a root-owned volume the image's user (1000) cannot write."""
    dockerfile = (COMPOSE.parents[0] / "docker" / "Dockerfile").read_text()
    created = re.search(r"install -d -o 1000 -g 1000 ([^\n\\]+)", dockerfile)
    assert created is not None
    owned = set(created.group(1).split())
    # docker-compose 1.x prints short syntax, SOURCE:TARGET[:MODE]; a named volume's source is in `volumes`
    mounts = {v.split(":")[1] for svc in stack["services"].values()
              if str(svc.get("image", "")).startswith("kubetrain") and svc.get("user") is None
              for v in svc.get("volumes", []) if v.split(":")[0] in stack["volumes"]}
    assert mounts and mounts <= owned, (mounts, owned)
