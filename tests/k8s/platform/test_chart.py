"""`k8s platform render --format helm`: the real helm lints, templates and packages the platform's chart, and each
environment (default, values-dev.yaml, values-prod.yaml) templates what `platform render` renders for it."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.k8s.platform.chart import ENVIRONMENTS, EXTERNAL_DB, platform_chart, with_settings
from kubetrain.k8s.platform.config import PlatformConfig, load_platform
from kubetrain.k8s.platform.render import render_platform
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.podsecurity import level
from tests.k8s.helm_run import by_name, helm, serve_discovery, template
from tests.k8s.platform.conftest import CRDS

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


DOCS = ROOT / "docs" / "kubernetes-helm.md"


def _documented(command: str) -> str:
    """The one documented shell block of the platform's install steps that holds `command`."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), flags=re.S)
    (block,) = [textwrap.dedent(b) for b in blocks if (command in b and "deploy/helm/kubetrain-platform" in b)
                or (command in b and "create namespace" in command)]
    return block


def test_the_documented_install_works_on_a_fresh_cluster(tmp_path: Path, helm_binary: str, kubectl: str,
                                                         apiserver: Any) -> None:
    """Every namespace the committed chart writes to exists after the documented steps, and the API server takes
    every object, as `helm template | kubectl apply --dry-run=server` shows (`helm install --dry-run=server` creates
    nothing, so it misses a namespace nobody made)."""
    for path in sorted(CRDS.glob("*.yaml")):
        apiserver.install_crd(yaml.safe_load(path.read_text()))
    serve_discovery(apiserver)
    env = {**os.environ, "KUBECONFIG": str(apiserver.kubeconfig(tmp_path, namespace="default")),
           "PATH": f"{Path(kubectl).parent}{os.pathsep}{Path(helm_binary).parent}{os.pathsep}{os.environ['PATH']}"}
    install = re.search(r"^helm install kubetrain (.*)$", _documented("helm install kubetrain"), flags=re.M)
    assert install is not None
    check = f"helm template kubetrain {install[1]} | kubectl apply --server-side --dry-run=server -f -"
    # kubectl apply's own schema check downloads the server's OpenAPI document, which the test server does not serve
    # (the objects' schemas are checked against the official ones above): --validate=false, and the rest as written
    unvalidated = ('kubectl() { if [ "$1" = apply ]; then command kubectl "$@" --validate=false; '
                   'else command kubectl "$@"; fi; }\n')

    def run(script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", unvalidated + script], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    fresh = run(check)  # before step 1: the API server names the namespace nobody made
    assert fresh.returncode != 0 and 'namespaces "ml" not found' in fresh.stderr, fresh.stderr
    assert 'namespaces "monitoring" not found' in fresh.stderr, fresh.stderr
    made = run(_documented("create namespace"))
    assert made.returncode == 0, made.stderr
    again = run(_documented("create namespace"))  # a namespace that exists is kept
    assert again.returncode == 0, again.stderr
    installed = run(check)
    assert installed.returncode == 0, installed.stderr
    applied = [line for line in installed.stdout.splitlines() if "(server dry run)" in line]
    assert len(applied) == len(template(helm_binary, COMMITTED, "-f", str(COMMITTED / "values-prod.yaml"))), \
        installed.stdout
    assert not [o for o in apiserver.objects.values() if o["kind"] not in ("Namespace",)]  # a dry run stores nothing


def test_each_object_is_written_once_with_its_choices_inside(tmp_path: Path, helm_binary: str) -> None:
    """A choice that changes a few lines of an object (the database's URI, basic auth's app and Secret) keeps one
    copy of the object, those lines under `{{ if }}`: a change to the object is made in one place."""
    for path in sorted((COMMITTED / "templates").glob("*.yaml")):
        heads = re.findall(r"^kind: (\w+)$", path.read_text(), flags=re.M)
        assert len(heads) <= 1, (path.name, heads)
    deployment = (COMMITTED / "templates" / "06-deployment-kubetrain-mlflow.yaml").read_text()
    assert "{{- if .Values.mlflow.auth.enabled }}" in deployment
    # and each side of each choice still templates what the platform renders for it
    cfg = load_platform(PLATFORM)
    for settings in ({}, {"mlflow.auth.enabled": True}, {"mlflow.postgres.uri": EXTERNAL_DB},
                     {"mlflow.auth.enabled": True, "mlflow.postgres.uri": EXTERNAL_DB}):
        args = [a for k, v in settings.items() for a in ("--set", f"{k}={str(v).lower()}")]
        assert by_name(template(helm_binary, COMMITTED, *args)) == by_name(
            render_platform(with_settings(cfg, settings))), settings
