"""fetch through the test API server: exec into a running pod of the job, or a short-lived pod on its claim when
none runs; the pod program really runs (as a local process) on a folder that stands for the claim."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kubetrain import checkpoint
from kubetrain.config import load_config
from kubetrain.k8s.fetch.pods import helper_pod
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.context import context
from kubetrain.k8s.render.podsecurity import restricted_violations
from tests.checkpoint.conftest import save_step

Cli = Callable[..., tuple[int, str, str]]
NS = ["--set", "k8s.namespace=ml"]


@pytest.fixture
def launched(tmp_path: Path, apiserver: Any, cli: Cli) -> tuple[Path, Path]:
    """Job `tiny` launched, its claim a folder holding the run directory `tiny` with two checkpoints."""
    kubeconfig = apiserver.kubeconfig(tmp_path)
    code, _, err = cli("k8s", "launch", *NS, "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    claim = tmp_path / "claim"
    run = claim / "tiny"
    save_step(run / "checkpoints", 3, best=True)
    save_step(run / "checkpoints", 6)
    (run / "metrics.jsonl").write_text('{"step": 6}\n')
    (run / "config.yaml").write_text("run:\n  name: tiny\n")
    apiserver.claims["tiny-checkpoints"] = claim
    return kubeconfig, run


def fetch(cli: Cli, kubeconfig: Path, out: Path, *args: str) -> tuple[int, str, str]:
    return cli("k8s", "fetch", "tiny", "-o", str(out), "--kubeconfig", str(kubeconfig), *args)


def execs(apiserver: Any) -> list[str]:
    return [r["path"].split("/")[-2] for r in apiserver.requests if r["path"].endswith("/exec")]


def test_through_the_running_pod(tmp_path: Path, apiserver: Any, cli: Cli, launched: tuple[Path, Path]) -> None:
    kubeconfig, _ = launched
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod)
    out = tmp_path / "local"
    code, stdout, err = fetch(cli, kubeconfig, out)
    assert code == 0, stdout + err
    assert f"reading /checkpoints/tiny through the running pod {pod}" in stdout
    assert "checkpoints verified: step-000006" in stdout.splitlines()[-1]
    assert execs(apiserver) == [pod, pod]  # list, then tar
    exec_request = next(r for r in apiserver.requests if r["path"].endswith("/exec"))
    assert exec_request["query"]["container"] == ["trainer"] and exec_request["query"]["command"][0] == "python"
    checkpoint.verify(out / "checkpoints" / "step-000006")
    assert (out / "metrics.jsonl").read_text() == '{"step": 6}\n'
    assert not any(p["kind"] == "Pod" and "fetch" in p["metadata"]["name"] for p in apiserver.objects.values())

    code, stdout, _ = fetch(cli, kubeconfig, out)
    assert code == 0 and stdout.splitlines()[-1] == f"{out}: 0 files (0.0 MiB) copied, 6 unchanged"


def test_through_a_short_lived_pod_when_none_runs(
    tmp_path: Path, apiserver: Any, cli: Cli, launched: tuple[Path, Path]
) -> None:
    kubeconfig, _ = launched
    apiserver.start(apiserver.pod("tiny", 0))
    apiserver.exit(apiserver.pod("tiny", 0), 0)  # the job finished
    apiserver.start_bare_pods = True
    out = tmp_path / "local"
    code, stdout, err = fetch(cli, kubeconfig, out, "--checkpoints", "all")
    assert code == 0, stdout + err
    applied = [r["body"] for r in apiserver.requests if r["method"] == "PATCH" and r["body"]["kind"] == "Pod"]
    assert len(applied) == 1
    helper = applied[0]
    name = helper["metadata"]["name"]
    assert name.startswith("tiny-fetch-") and f"through the pod {name} (deleted afterwards)" in stdout
    assert "kubetrain.dev/job" not in helper["metadata"]["labels"]  # not a rank of the job for status or logs
    assert execs(apiserver) == [name, name]
    assert ("DELETE", f"/api/v1/namespaces/ml/pods/{name}") in [(r["method"], r["path"]) for r in apiserver.requests]
    assert not any(o["kind"] == "Pod" and o["metadata"]["name"] == name for o in apiserver.objects.values())
    mount = next(m for m in helper["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/checkpoints")
    assert mount["readOnly"] is True
    assert sorted(p.name for p in checkpoint.complete_checkpoints(out / "checkpoints")) == ["step-000003",
                                                                                           "step-000006"]
    assert checkpoint.pointer(out / "checkpoints", "best") == "step-000003"


def test_the_short_lived_pod_is_restricted_and_valid() -> None:
    cfg = load_config(None, "tiny", ["k8s.namespace=ml", 'k8s.node_selector={"gpu": "3090"}',
                                     'k8s.tolerations=[{"key": "dedicated", "operator": "Exists"}]'])
    pod = helper_pod(context(cfg), "tiny-fetch-abc123")
    assert validate.problems([pod]) == []
    assert restricted_violations(pod["spec"]) == []
    assert pod["spec"]["nodeSelector"] == {"gpu": "3090"} and pod["spec"]["activeDeadlineSeconds"] > 0
    claim = next(v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v)
    assert claim["persistentVolumeClaim"] == {"claimName": "tiny-checkpoints", "readOnly": True}


def test_a_job_that_is_gone_needs_its_config(tmp_path: Path, apiserver: Any, cli: Cli,
                                             launched: tuple[Path, Path]) -> None:
    kubeconfig, _ = launched
    assert cli("k8s", "stop", "tiny", "-n", "ml", "--kubeconfig", str(kubeconfig))[0] == 0
    apiserver.start_bare_pods = True
    out = tmp_path / "local"
    code, _, err = fetch(cli, kubeconfig, out)
    assert code == 2 and err.strip().splitlines() == [
        "error: job 'tiny' has no ConfigMap tiny-config in namespace ml (a stopped or removed job takes it along; "
        "its claims stay): give the config it was launched with, kubetrain k8s fetch tiny CONFIG"]
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({"run": {"name": "tiny"}, "k8s": {"namespace": "ml"}}))
    code, stdout, err = fetch(cli, kubeconfig, out, str(config))
    assert code == 0, stdout + err
    assert (out / "checkpoints" / "step-000006").is_dir()
    other = tmp_path / "other.yaml"
    other.write_text(json.dumps({"run": {"name": "other"}}))
    code, _, err = fetch(cli, kubeconfig, out, str(other))
    assert code == 2 and "the config is for job 'other', not 'tiny'" in err


def test_a_claim_without_the_run_says_so(tmp_path: Path, apiserver: Any, cli: Cli,
                                         launched: tuple[Path, Path]) -> None:
    kubeconfig, run = launched
    run.rename(run.with_name("elsewhere"))
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod)
    code, _, err = fetch(cli, kubeconfig, tmp_path / "local")
    assert code == 2 and len(err.strip().splitlines()) == 1  # the program's exit 3 and its line, through exec
    assert err.startswith(f"error: exec in pod {pod} (trainer) on ") and "no run directory at " in err
    assert err.rstrip().endswith("(run directories there: none)")
    assert not (tmp_path / "local" / "checkpoints").exists()


def test_the_mlflow_store_comes_through_the_running_pod(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """Job `tiny` with MLflow on its default store: its claim holds what real training wrote there."""
    from mlflow.tracking import MlflowClient

    from kubetrain.train.trainer import train
    from tests.track.conftest import TINY

    claim = tmp_path / "claim"
    sets = [*TINY, "run.name=tiny", f"run.output_dir={claim}", f"data.cache_dir={tmp_path / 'cache'}",
            "train.max_steps=5", "track.mlflow.enabled=true"]
    train(load_config(None, None, sets), argv=[], log=lambda _: None)
    apiserver.claims["tiny-checkpoints"] = claim
    kubeconfig = apiserver.kubeconfig(tmp_path)
    code, _, err = cli("k8s", "launch", *NS, "--set", "track.mlflow.enabled=true", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod)
    out = tmp_path / "local"
    code, stdout, err = fetch(cli, kubeconfig, out)
    assert code == 0, stdout + err
    assert execs(apiserver) == [pod] * 4  # list, tar; the store's list, its tar
    store = out / "mlflow" / "mlflow.db"
    client = MlflowClient(f"sqlite:///{store}")
    [run] = client.search_runs([client.get_experiment_by_name("kubetrain").experiment_id])
    assert f"MLflow runs {run.info.run_id}: mlflow ui --backend-store-uri sqlite:///{store.resolve()}" in stdout
    assert run.info.artifact_uri.startswith((out / "mlflow" / "mlartifacts").resolve().as_uri())
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "meta.json"}

    code, stdout, _ = fetch(cli, kubeconfig, out)
    assert code == 0 and " 0 files (0.0 MiB) copied" in stdout.splitlines()[-1]


def test_a_store_on_a_tracking_server_stays_there(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    (tmp_path / "claim" / "tiny").mkdir(parents=True)
    (tmp_path / "claim" / "tiny" / "meta.json").write_text("{}")
    apiserver.claims["tiny-checkpoints"] = tmp_path / "claim"
    kubeconfig = apiserver.kubeconfig(tmp_path)
    code, _, err = cli("k8s", "launch", *NS, "--set", "track.mlflow.enabled=true", "--set",
                       "track.mlflow.tracking_uri=http://mlflow.ml:5000", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod)
    code, stdout, err = fetch(cli, kubeconfig, tmp_path / "local")
    assert code == 0, stdout + err
    assert "MLflow: the job tracks to http://mlflow.ml:5000: its data stays on that server" in stdout.splitlines()
    assert execs(apiserver) == [pod, pod] and not (tmp_path / "local" / "mlflow").exists()


def test_a_short_lived_pod_that_cannot_be_scheduled_says_why_at_once(
    tmp_path: Path, apiserver: Any, cli: Cli, launched: tuple[Path, Path]
) -> None:
    import threading
    import time

    kubeconfig, _ = launched
    apiserver.start(apiserver.pod("tiny", 0))
    apiserver.exit(apiserver.pod("tiny", 0), 0)  # the job finished
    verdict = ("0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector. preemption: 0/2 nodes "
               "are available: 2 Preemption is not helpful for scheduling.")
    apiserver.no_node_for_bare_pods = verdict

    def scheduler_finds_room() -> None:  # once fetch asked twice after the verdict, a node frees up
        deadline = time.monotonic() + 60  # a safety net against a hang, not a timing assertion
        while sum(r["method"] == "GET" and "/pods/tiny-fetch-" in r["path"] for r in apiserver.requests) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        apiserver.start(next(p["metadata"]["name"] for p in apiserver.objects.values()
                             if p["kind"] == "Pod" and p["metadata"]["name"].startswith("tiny-fetch-")))

    thread = threading.Thread(target=scheduler_finds_room, daemon=True)
    thread.start()
    code, stdout, err = fetch(cli, kubeconfig, tmp_path / "local")
    thread.join(timeout=60)
    assert code == 0, stdout + err
    lines = stdout.splitlines()
    said = next(i for i, line in enumerate(lines) if line.endswith(f"waits: {verdict}"))
    assert lines[said].startswith("the fetch pod tiny-fetch-") and said < len(lines) - 1  # before the copy
    assert sum("waits:" in line for line in lines) == 1  # said once, not at every poll
