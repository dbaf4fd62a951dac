"""`k8s render --format helm`: the real helm lints, templates and packages the job's chart, and what it templates
is what `k8s render` renders: under the default values exactly, and with changed values what the changed config
renders."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.config.k8s import WORKLOADS
from kubetrain.config.loading import validate as validate_config
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.context import RenderError
from kubetrain.k8s.render.job_chart import job_chart
from kubetrain.k8s.render.manifest import pod_templates, render
from kubetrain.k8s.render.podsecurity import level
from kubetrain.k8s.workloads import SPEC_HASH
from tests.k8s.helm_run import as_helm_installs, by_name, helm, serve_discovery, template
from tests.k8s.render.test_render import EXAMPLES, UNSUPPORTED

REGULATED = next(p for p in EXAMPLES if p.stem == "regulated")
# every shipped config with a k8s section: examples/k8s/ and the LoRA PyTorchJob beside it
SHIPPED = [*EXAMPLES, EXAMPLES[0].parents[1] / "lora-llama-pytorchjob.yaml"]


def chart_of(example: Path | None, workload: str, folder: Path, *overrides: str) -> tuple[Any, list[dict], list[str]]:
    cfg = load_config(example, None if example else "tiny", [*UNSUPPORTED.get(workload, []), *overrides])
    objects = render(cfg, workload)
    return cfg, objects, job_chart(cfg, objects, folder, workload)[1]


def test_every_example_and_workload_templates_exactly_what_render_renders(tmp_path: Path, helm_binary: str,
                                                                          crd_schemas: Any) -> None:
    # every example with its own workload, and every workload with the regulated example: each renderer and each
    # example's settings once (the renderers share one pod template, tests/k8s/render/test_render.py)
    pairs = [(e, load_config(e, None, []).k8s.workload) for e in SHIPPED]
    pairs += [(REGULATED, w) for w in WORKLOADS if (REGULATED, w) not in pairs]
    assert {w for _, w in pairs} == set(WORKLOADS)
    charts = []
    for example, workload in pairs:
        folder = tmp_path / f"{example.stem}-{workload}"
        cfg, objects, _ = chart_of(example, workload, folder)
        templated = template(helm_binary, folder)
        assert by_name(templated) == by_name(objects), (example.name, workload)
        # what helm gives passes the same strict validation as the render, restricted Pod Security included
        assert validate.problems(templated, crd_schemas) == [], (example.name, workload)
        opted_out = cfg.k8s.ipc_lock or cfg.k8s.host_network
        for _, pod in (t for o in templated for t in pod_templates(o)):
            assert level(pod["spec"]) == ("privileged" if opted_out else "restricted"), (example.name, workload)
        charts.append(str(folder))
    lint = helm(helm_binary, "lint", "--strict", *charts)  # one call for all charts
    assert lint.returncode == 0 and f"{len(charts)} chart(s) linted, 0 chart(s) failed" in lint.stdout, lint.stdout


def _normalized(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects with the config text parsed (a changed value is written as JSON there) and no spec hash."""
    out = copy.deepcopy(by_name(objects))
    for obj in out:
        if obj["kind"] == "ConfigMap" and "config.yaml" in obj.get("data", {}):
            obj["data"]["config.yaml"] = yaml.safe_load(obj["data"]["config.yaml"])
        for meta in [obj["metadata"], *(t.get("metadata") or {} for _, t in pod_templates(obj))]:
            (meta.get("annotations") or {}).pop(SPEC_HASH, None)
    return out


@pytest.mark.parametrize("workload", ["indexed-job", "pytorchjob", "trainjob"])
def test_changed_values_template_what_the_changed_config_renders(workload: str, tmp_path: Path,
                                                                  helm_binary: str) -> None:
    cfg, objects, notes = chart_of(REGULATED, workload, tmp_path)
    assert notes == []  # every value of the regulated example is lifted
    values = yaml.safe_load((tmp_path / "values.yaml").read_text())
    assert set(values) == {"namespace", "image", "nodes", "resources", "secrets", "nodeSelector", "tolerations",
                           "annotations"}
    raw = cfg.model_dump(mode="json")
    k = raw["k8s"]
    k.update(namespace="ml-prod", image="registry.internal/ml/kubetrain:2.0", nnodes=4)
    k["resources"].update(cpu="16", memory="64Gi", gpu=2, ephemeral_storage="40Gi")
    k["secrets"]["env"]["MLFLOW_TRACKING_PASSWORD"]["name"] = "mlflow-prod"
    changed = render(validate_config(raw), workload)
    templated = template(helm_binary, tmp_path, "--set", "namespace=ml-prod,image=registry.internal/ml/kubetrain:2.0,"
                         "nodes=4,resources.gpu=2,secrets.MLFLOW_TRACKING_PASSWORD=mlflow-prod", "--set-string",
                         "resources.cpu=16,resources.memory=64Gi,resources.ephemeralStorage=40Gi")
    assert _normalized(templated) == _normalized(changed)
    # the spec hash (an unchanged relaunch is a no-op) changes with the values
    hashes = {o["metadata"].get("annotations", {}).get(SPEC_HASH) for o in templated} - {None}
    assert hashes and hashes.isdisjoint({o["metadata"].get("annotations", {}).get(SPEC_HASH) for o in objects})


def test_the_tracking_uri_is_a_value_and_the_config_text_keeps_its_bytes(tmp_path: Path, helm_binary: str) -> None:
    _, objects, _ = chart_of(None, "indexed-job", tmp_path, "track.mlflow.enabled=true",
                             "track.mlflow.tracking_uri=http://kubetrain-mlflow.ml:5000")
    assert yaml.safe_load((tmp_path / "values.yaml").read_text())["trackingUri"] == "http://kubetrain-mlflow.ml:5000"
    assert by_name(template(helm_binary, tmp_path)) == by_name(objects)  # the ConfigMap's text byte for byte
    moved = template(helm_binary, tmp_path, "--set", "trackingUri=http://mlflow.tracking:80")
    pod_cfg = yaml.safe_load(next(o for o in moved if o["kind"] == "ConfigMap")["data"]["config.yaml"])
    assert pod_cfg["track"]["mlflow"]["tracking_uri"] == "http://mlflow.tracking:80"


def test_a_value_the_config_derives_more_from_stays_fixed_and_is_named(tmp_path: Path, helm_binary: str) -> None:
    # one node: the created claim is ReadWriteOnce, which more nodes could not share
    _, objects, notes = chart_of(None, "indexed-job", tmp_path)
    assert any(n.startswith("nodes stays fixed in the chart: k8s.nnodes also decides PersistentVolumeClaim")
               for n in notes), notes
    assert "nodes" not in yaml.safe_load((tmp_path / "values.yaml").read_text())
    assert by_name(template(helm_binary, tmp_path)) == by_name(objects)


@pytest.mark.parametrize(("setting", "message"), [
    (["--set", "nodes=-1"], "at '/nodes': minimum: got -1, want 1"),
    (["--set", "nodez=3"], "additional properties 'nodez' not allowed"),
    (["--set", "resources.cpu=8"], "at '/resources/cpu': got number, want string"),
    (["--set", "namespace=Bad_Name"], "at '/namespace'"),
])
def test_bad_values_are_refused_with_the_schemas_message(setting: list[str], message: str, tmp_path: Path,
                                                         helm_binary: str) -> None:
    chart_of(REGULATED, "indexed-job", tmp_path)
    out = helm(helm_binary, "template", "rel", str(tmp_path), *setting)
    assert out.returncode != 0 and "values don't meet the specifications of the schema" in out.stderr, out.stderr
    assert message in out.stderr, out.stderr


def test_helm_package_makes_the_archive_that_templates_the_same(tmp_path: Path, helm_binary: str) -> None:
    _, objects, _ = chart_of(REGULATED, "jobset", tmp_path / "chart")
    out = helm(helm_binary, "package", str(tmp_path / "chart"), "-d", str(tmp_path))
    assert out.returncode == 0, out.stderr
    archive = tmp_path / "audited-gpt-0.1.0.tgz"
    assert archive.is_file() and str(archive) in out.stdout
    assert by_name(template(helm_binary, archive)) == by_name(objects)


Cli = Any


def test_cli_writes_the_chart_and_says_what_stays_fixed(tmp_path: Path, cli: Cli) -> None:
    code, out, err = cli("k8s", "render", "--format", "helm", "-o", str(tmp_path / "chart"))
    assert code == 0, err
    assert str(tmp_path / "chart" / "Chart.yaml") in out and "note: nodes stays fixed in the chart" in err
    code, out, err = cli("k8s", "render", "--format", "helm", "-o", str(tmp_path / "chart"))  # again: replaced
    assert code == 0, err
    code, _, err = cli("k8s", "render", "--format", "helm")
    assert code == 2 and err.startswith("error:") and "give -o DIR" in err and len(err.splitlines()) == 1, err
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "Chart.yaml").write_text("apiVersion: v2\nname: theirs\nversion: 1.0.0\n")
    code, _, err = cli("k8s", "render", "--format", "helm", "-o", str(tmp_path / "theirs"))
    assert code == 2 and "was not written by kubetrain" in err, err
    assert (tmp_path / "theirs" / "Chart.yaml").read_text().startswith("apiVersion: v2\nname: theirs")


def test_a_chart_is_never_written_among_files_kubetrain_did_not_write(tmp_path: Path, cli: Cli) -> None:
    """`-o ''` wrote into the current folder; a folder holding someone's templates had them merged into the chart
    (installed with it), or, beside kubetrain's Chart.yaml, deleted."""
    code, _, err = cli("k8s", "render", "--format", "helm", "-o", "")
    assert code == 2 and err == "error: -o/--output: an empty path; name the folder to write into (`-o .` for " \
        "this one)\n", err
    assert not (tmp_path / "Chart.yaml").exists() and not (tmp_path / "templates").exists()
    theirs = tmp_path / "charts" / "templates" / "ingress.yaml"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("apiVersion: networking.k8s.io/v1\nkind: Ingress\n")
    code, _, err = cli("k8s", "render", "--format", "helm", "-o", str(tmp_path / "charts"))
    assert code == 2 and f"{theirs} was not written by kubetrain" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "charts" / "Chart.yaml").exists()
    code, _, err = cli("k8s", "render", "--format", "helm", "-o", str(tmp_path / "ours"))
    assert code == 0, err
    added = tmp_path / "ours" / "templates" / "extra.yaml"  # a file added by hand to kubetrain's chart
    added.write_text("kind: ConfigMap\n")
    code, _, err = cli("k8s", "render", "--format", "helm", "-o", str(tmp_path / "ours"))
    assert code == 2 and f"{added} was not written by kubetrain" in err, err
    assert added.read_text() == "kind: ConfigMap\n"  # refused, not deleted


def _spec_hashes(objects: list[dict[str, Any]]) -> set[str]:
    return {m["annotations"][SPEC_HASH] for o in objects
            for m in [o["metadata"], *(t.get("metadata") or {} for _, t in pod_templates(o))]
            if SPEC_HASH in (m.get("annotations") or {})}


# (helm arguments, the same change in config keys)
CHANGES = [
    ([], {}),
    (["--set", "nodes=4"], {"nnodes": 4}),
    (["--set-string", "resources.cpu=16,resources.memory=64Gi"], {"resources": {"cpu": "16", "memory": "64Gi"}}),
    (["--set", "namespace=ml-prod"], {"namespace": "ml-prod"}),
    (["--set", "namespace=", "--namespace", "team-a"], {"namespace": "team-a"}),
    (["--set", "image=registry.internal/ml/kubetrain:2.0,resources.gpu=2"],
     {"image": "registry.internal/ml/kubetrain:2.0", "resources": {"gpu": 2}}),
    (["--set", "secrets.MLFLOW_TRACKING_PASSWORD=mlflow-prod"],
     {"secrets": {"env": {"MLFLOW_TRACKING_PASSWORD": {"name": "mlflow-prod"}}}}),
    # Helm merges a mapping given with --set into the default (as _merged does), and replaces a list
    (["--set", "nodeSelector.nvidia\\.com/gpu\\.product=A100"], {"node_selector": {"nvidia.com/gpu.product": "A100"}}),
    (["--set-json", 'tolerations=[{"key":"gpu","operator":"Exists","effect":"NoSchedule"},'
                    '{"key":"spot","operator":"Equal","value":"yes","effect":"NoExecute","toleration_seconds":300}]'],
     {"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                      {"key": "spot", "operator": "Equal", "value": "yes", "effect": "NoExecute",
                       "toleration_seconds": 300}]}),
    (["--set", "annotations.team=vision"], {"annotations": {"team": "vision"}}),
]


def _merged(raw: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    for key, value in change.items():
        if isinstance(value, dict):
            _merged(raw[key], value)
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize("workload", ["indexed-job", "pytorchjob", "trainjob"])
def test_the_spec_hash_helm_writes_is_the_one_render_gives_for_the_same_values(workload: str, tmp_path: Path,
                                                                             helm_binary: str) -> None:
    """`launch` and `status` read the hash to tell an unchanged job: a Helm install must write what `render` of the
    same values writes, or a relaunch of the same values is taken for another spec (and one of other values not).
    The objects are the same too: nodeSelector, tolerations and annotations included."""
    cfg, _, _ = chart_of(REGULATED, workload, tmp_path)
    seen = set()
    for args, change in CHANGES:
        expected = render(validate_config(_merged(cfg.model_dump(mode="json"), {"k8s": copy.deepcopy(change)})),
                          workload)
        templated = template(helm_binary, tmp_path, *args)
        assert _normalized(templated) == _normalized(expected), args
        assert _spec_hashes(templated) == _spec_hashes(expected) and len(_spec_hashes(expected)) == 1, args
        seen |= _spec_hashes(expected)
    assert len(seen) == len(CHANGES)  # every change is another spec


def test_the_notes_name_the_namespace_and_the_commands(tmp_path: Path, helm_binary: str) -> None:
    chart_of(REGULATED, "indexed-job", tmp_path)
    out = helm(helm_binary, "install", "rel", str(tmp_path), "--dry-run=client", "--set", "namespace=ml-prod")
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:\n", 1)[1]
    assert notes.splitlines()[:3] == ["kubetrain job audited-gpt (Job) in ml-prod:",
                                      "  kubetrain k8s status audited-gpt -n ml-prod",
                                      "  kubetrain k8s logs audited-gpt -f -n ml-prod"]
    assert "kubetrain k8s render CONFIG --set k8s.KEY=VALUE" in notes  # what Helm did not check


def _install(helm_binary: str, chart: Path, apiserver: Any, tmp_path: Path, *args: str) -> Path:
    """`helm install rel CHART` on the test API server: what helm templates, applied as Helm applies it."""
    from kubetrain.k8s.cluster.connect import connect

    kubeconfig = apiserver.kubeconfig(tmp_path)
    cluster = connect(kubeconfig)
    for obj in as_helm_installs(template(helm_binary, chart, *args), "rel", "ml"):
        cluster.apply(obj)
    return kubeconfig


def test_k8s_list_shows_a_job_that_helm_installed(tmp_path: Path, helm_binary: str, apiserver: Any, cli: Cli) -> None:
    chart_of(None, "indexed-job", tmp_path / "chart", "k8s.namespace=ml")
    kubeconfig = _install(helm_binary, tmp_path / "chart", apiserver, tmp_path)
    code, out, err = cli("k8s", "list", "--kubeconfig", str(kubeconfig), "--json")
    assert code == 0, err
    assert [(j["name"], j["namespace"], j["workload"]) for j in json.loads(out)] == [("tiny", "ml", "indexed-job")]


def test_an_upgrade_the_api_server_would_refuse_fails_before_it_changes_anything(
        tmp_path: Path, helm_binary: str, apiserver: Any) -> None:
    """Helm applies the ConfigMap before the Job: the Job's immutable pod template is refused after the config
    changed. The chart looks the running job up first (`lookup`, which helm answers from the cluster under
    --dry-run=server, as in `helm upgrade`) and fails while nothing has changed; the same values pass."""
    chart = tmp_path / "chart"
    chart_of(REGULATED, "indexed-job", chart, "k8s.namespace=ml")
    kubeconfig = _install(helm_binary, chart, apiserver, tmp_path)
    serve_discovery(apiserver)
    config_before = json.dumps(apiserver.objects["/api/v1/namespaces/ml/configmaps/audited-gpt-config"])
    upgrade = ["template", "rel", str(chart), "--is-upgrade", "--dry-run=server", "--disable-openapi-validation",
               "--kubeconfig", str(kubeconfig)]
    refused = helm(helm_binary, *upgrade, "--set-string", "resources.cpu=12")
    assert refused.returncode != 0, refused.stdout
    assert "job/audited-gpt exists with another spec" in refused.stderr and "nothing was changed" in refused.stderr
    assert "kubetrain k8s stop audited-gpt -n ml" in refused.stderr, refused.stderr
    same = helm(helm_binary, *upgrade)
    assert same.returncode == 0, same.stderr
    assert json.dumps(apiserver.objects["/api/v1/namespaces/ml/configmaps/audited-gpt-config"]) == config_before


def test_a_memory_request_render_refuses_is_refused_at_install(tmp_path: Path, helm_binary: str) -> None:
    """Helm does not run kubetrain's checks: the chart carries render's verdict. Under FSDP a pod's need falls with
    the node count, so the memory and the node count are judged together, and helm refuses exactly what render
    refuses (one line naming the request), before anything reaches the cluster."""
    example = next(p for p in EXAMPLES if p.stem == "c10d-64x8gpu")
    cfg, _, _ = chart_of(example, "jobset", tmp_path)
    values = yaml.safe_load((tmp_path / "values.yaml").read_text())
    assert {"nodes", "resources"} <= set(values) and "memory" in values["resources"]
    verdicts = []
    for nodes, memory in (("2", "40Gi"), ("64", "40Gi"), ("64", "16Gi"), ("2", "80Gi")):
        raw = cfg.model_dump(mode="json")
        raw["k8s"]["nnodes"], raw["k8s"]["resources"]["memory"] = int(nodes), memory
        try:
            render(validate_config(raw), "jobset")
            refused = False
        except RenderError as e:
            assert "cannot hold" in str(e)
            refused = True
        out = helm(helm_binary, "template", "rel", str(tmp_path), "--set", f"nodes={nodes}",
                   "--set-string", f"resources.memory={memory}")
        assert (out.returncode != 0) == refused, (nodes, memory, out.stderr)
        if refused:
            assert f"resources.memory ({memory}) cannot hold what a pod's processes need" in out.stderr
        verdicts.append(refused)
    assert verdicts == [True, False, True, False]  # 40Gi holds 64 nodes' shards, not 2 nodes'; both sides tried


def test_a_value_that_stays_fixed_is_explained_in_the_users_terms(tmp_path: Path, cli: Cli) -> None:
    """The homelab example's chart said `k8s.nnodes = 61 is refused`: 61 is the probe's value, never the user's."""
    example = Path(__file__).parents[3] / "examples" / "k8s" / "homelab-3090.yaml"
    code, _, err = cli("k8s", "render", str(example), "--format", "helm", "-o", str(tmp_path / "chart"))
    assert code == 0, err
    [note] = [line for line in err.splitlines() if line.startswith("note: nodes stays fixed")]
    assert "61" not in note and "ReadWriteOnce" in note and "--set k8s.nnodes=" in note, note
