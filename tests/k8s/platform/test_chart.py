"""`k8s platform render --format helm`: the real helm lints, templates and packages the platform's chart, and each
environment (default, values-dev.yaml, values-prod.yaml) templates what `platform render` renders for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kubetrain.k8s.platform.chart import ENVIRONMENTS, platform_chart, with_settings
from kubetrain.k8s.platform.config import PlatformConfig, load_platform
from kubetrain.k8s.platform.render import render_platform
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.podsecurity import level
from tests.k8s.helm_run import by_name, helm, template

ROOT = Path(__file__).resolve().parents[3]
PLATFORM = ROOT / "deploy" / "platform" / "platform.yaml"
COMMITTED = ROOT / "deploy" / "helm" / "kubetrain-platform"


@pytest.mark.parametrize("config", [PLATFORM, None], ids=["platform.yaml", "defaults"])
def test_each_environment_templates_what_platform_render_renders(config: Path | None, tmp_path: Path,
                                                                 helm_binary: str, monitoring_schemas: Any) -> None:
    cfg = load_platform(config)
    _, notes = platform_chart(cfg, tmp_path)
    assert notes == []  # every value is lifted
    lint = helm(helm_binary, "lint", "--strict", str(tmp_path))
    assert lint.returncode == 0, lint.stdout
    for env in [None, *ENVIRONMENTS]:
        expected = render_platform(cfg if env is None else with_settings(cfg, ENVIRONMENTS[env]))
        values = [] if env is None else ["-f", str(tmp_path / f"values-{env}.yaml")]
        if env is not None:
            lint = helm(helm_binary, "lint", "--strict", str(tmp_path), *values)
            assert lint.returncode == 0, (env, lint.stdout)
        templated = template(helm_binary, tmp_path, *values)
        assert by_name(templated) == by_name(expected), env
        assert validate.problems(templated, monitoring_schemas) == [], env
        for obj in templated:
            if obj["kind"] in ("Deployment", "StatefulSet"):
                assert level(obj["spec"]["template"]["spec"]) == "restricted", (env, obj["metadata"]["name"])
    prod = template(helm_binary, tmp_path, "-f", str(tmp_path / "values-prod.yaml"))
    assert not any(o["kind"] == "StatefulSet" for o in prod)  # prod: the team's database, by reference


def test_both_choices_and_the_release_namespace_are_values(tmp_path: Path, helm_binary: str) -> None:
    cfg = PlatformConfig(namespace="ml")
    platform_chart(cfg, tmp_path)
    uri = "postgresql://mlflow@db.example.internal:5432/tracking"
    for settings, args in (({"mlflow.auth.enabled": True}, ["--set", "mlflow.auth.enabled=true"]),
                           ({"mlflow.postgres.uri": uri}, ["--set", f"mlflow.postgres.uri={uri}"]),
                           ({"namespace": "team-a"}, ["--set", "namespace=", "--namespace", "team-a"])):
        assert by_name(template(helm_binary, tmp_path, *args)) == by_name(render_platform(with_settings(cfg, settings)))


@pytest.mark.parametrize(("setting", "message"), [
    ("mlflow.postgres.uri=postgresql://mlflow:hunter2@db:5432/mlflow", "at '/mlflow/postgres/uri'"),
    ("mlflow.workers=4", "at '/mlflow': additional properties 'workers' not allowed"),
    ("mlflow.auth.enabled=yes", "at '/mlflow/auth/enabled': got string, want boolean"),
])
def test_bad_values_are_refused_with_the_schemas_message(setting: str, message: str, tmp_path: Path,
                                                         helm_binary: str) -> None:
    platform_chart(PlatformConfig(), tmp_path)
    out = helm(helm_binary, "template", "rel", str(tmp_path), "--set", setting)
    assert out.returncode != 0 and "values don't meet the specifications of the schema" in out.stderr, out.stderr
    assert message in out.stderr, out.stderr


def test_the_committed_chart_is_the_one_platform_yaml_renders_and_it_packages(tmp_path: Path,
                                                                            helm_binary: str) -> None:
    platform_chart(load_platform(PLATFORM), tmp_path / "kubetrain-platform")
    fresh = {p.relative_to(tmp_path / "kubetrain-platform"): p.read_text() for p in
             (tmp_path / "kubetrain-platform").rglob("*") if p.is_file()}
    committed = {p.relative_to(COMMITTED): p.read_text() for p in COMMITTED.rglob("*") if p.is_file()}
    assert committed == fresh, "deploy/helm/kubetrain-platform is stale: kubetrain k8s platform render " \
        "deploy/platform/platform.yaml --format helm -o deploy/helm/kubetrain-platform"
    out = helm(helm_binary, "package", str(COMMITTED), "-d", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "kubetrain-platform-0.1.0.tgz").is_file()


Cli = Callable[..., tuple[int, str, str]]


def test_cli_writes_the_chart(tmp_path: Path, cli: Cli) -> None:
    code, out, err = cli("k8s", "platform", "render", "--format", "helm", "-o", str(tmp_path), "-n", "ml")
    assert code == 0, err
    assert {str(tmp_path / f) for f in ("Chart.yaml", "values.yaml", "values.schema.json", "values-dev.yaml",
                                         "values-prod.yaml")} <= set(out.splitlines())
    code, _, err = cli("k8s", "platform", "render", "--format", "helm")
    assert code == 2 and "give -o DIR" in err, err
