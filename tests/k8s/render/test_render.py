"""Rendering: every workload x every example config renders and validates strictly; the pod is as designed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.config.k8s import WORKLOADS
from kubetrain.config.schema import Config
from kubetrain.errors import EXIT_PREFLIGHT, ConfigError
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.context import RenderError
from kubetrain.k8s.render.manifest import pod_templates, render, to_yaml, write_files
from kubetrain.k8s.render.podsecurity import level

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "k8s").glob("*.yaml"))

# Settings a workload cannot express are refused (test_trainjob_refuses_priority_class); drop them there.
UNSUPPORTED = {"trainjob": ["k8s.priority_class_name=null"]}


def tiny(*overrides: str) -> Config:
    return load_config(None, "tiny", list(overrides))


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind)


def main_container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 5, EXAMPLES


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_workload_of_every_example_validates(example: Path, crd_schemas: Any) -> None:
    for workload in WORKLOADS:
        cfg = load_config(example, None, UNSUPPORTED.get(workload, []))
        objects = render(cfg, workload)
        assert validate.problems(objects, crd_schemas) == [], (example.name, workload)
        templates = [t for o in objects for _, t in pod_templates(o)]
        assert templates, workload
        # restricted, unless the example opts in to RDMA's IPC_LOCK or host networking (then: privileged)
        opted_out = cfg.k8s.ipc_lock or cfg.k8s.host_network
        for template in templates:
            assert level(template["spec"]) == ("privileged" if opted_out else "restricted"), (example.name, workload)
        # the config travels as a ConfigMap, and trains into the checkpoint volume
        pod_cfg = yaml.safe_load(by_kind(objects, "ConfigMap")["data"]["config.yaml"])
        mount = cfg.k8s.volumes.checkpoints.mount_path or "/checkpoints"
        assert pod_cfg["run"]["output_dir"] == mount
        mounts = {m["mountPath"] for m in main_container(templates[0])["volumeMounts"]}
        assert {mount, "/etc/kubetrain", "/tmp", "/cache", "/dev/shm"} <= mounts


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_fails_its_job_on_the_preflight_exit_code_and_names_pod_and_node(example: Path) -> None:
    for workload in ("indexed-job", "jobset"):  # the workloads with a Job, hence a podFailurePolicy
        objects = render(load_config(example, None, []), workload)
        jobs = [o for o in objects if o["kind"] == "Job"] or [
            r["template"] for r in by_kind(objects, "JobSet")["spec"]["replicatedJobs"]]
        for job in jobs:
            rules = job["spec"]["podFailurePolicy"]["rules"]
            assert {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                         "values": [EXIT_PREFLIGHT]}} in rules, (example, workload)
        if workload == "jobset":  # a Job failed by that rule fails the set: restarting it would fail the same way
            [rule] = by_kind(objects, "JobSet")["spec"]["failurePolicy"]["rules"]
            assert rule["action"] == "FailJobSet" and rule["onJobFailureReasons"] == ["PodFailurePolicy"], example
    cfg = load_config(example, None, [])
    for template in (t for o in render(cfg) for _, t in pod_templates(o)):  # the example's own workload
        env = env_of(main_container(template))
        assert env["KUBETRAIN_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["KUBETRAIN_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_indexed_job_has_a_headless_service_and_stable_rank0_address() -> None:
    objects = render(tiny("k8s.nnodes=3", "k8s.volumes.checkpoints.access_mode=ReadWriteMany"))
    kinds = [o["kind"] for o in objects]
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "NetworkPolicy", "Service", "Job"]
    svc, job = by_kind(objects, "Service"), by_kind(objects, "Job")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 3
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "tiny"
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    env = env_of(pod["containers"][0])
    assert env["MASTER_ADDR"] == "tiny-0.tiny" and env["MASTER_PORT"] == "29500"
    assert env["KUBETRAIN_NNODES"] == "3"
    assert env["KUBETRAIN_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_job_policies_protect_preempted_and_stopping_pods() -> None:
    cfg = tiny("checkpoint.grace_seconds=100", "k8s.ttl_seconds_after_finished=600", "k8s.backoff_limit=5")
    spec = by_kind(render(cfg), "Job")["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "Ignore"
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    # a pod that saved a checkpoint on SIGTERM (exit 75) is replaced, not counted; bad input fails the Job
    assert rules[1]["action"] == "Ignore" and rules[1]["onExitCodes"]["values"] == [75]
    assert rules[2]["action"] == "FailJob" and rules[2]["onExitCodes"]["values"] == [2]
    # a pod whose rendezvous host was lost (the entrypoint exits 69) is replaced, not counted: the host's pod is
    assert rules[3] == {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                            "values": [69]}}
    # a preflight that named this pod's device or links fails the Job before training (a retry lands on the node)
    assert rules[4] == {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                             "values": [71]}}
    assert validate.problems(render(cfg)) == []  # strictly, against the Job's schema
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["ttlSecondsAfterFinished"] == 600 and spec["backoffLimit"] == 5
    grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= 100
    args = main_container(spec["template"])["args"]
    shutdown = int(args[args.index("--shutdown-timeout") + 1])
    assert 100 <= shutdown < grace  # torchrun waits for the save, and exits before the kubelet kills it


def test_pod_shape_security_shm_and_probe() -> None:
    cfg = tiny("k8s.resources.gpu=2", "k8s.nproc_per_node=2", "k8s.resources.gpu_resource=amd.com/gpu",
               'k8s.node_selector={"gpu": "mi300"}', "k8s.priority_class_name=high",
               'k8s.tolerations=[{"key": "dedicated", "value": "arcanine", "effect": "NoSchedule"}]')
    template = pod_templates(by_kind(render(cfg), "Job"))[0][1]
    pod, c = template["spec"], main_container(template)
    assert c["command"] == ["kubetrain", "k8s", "entrypoint"]
    assert c["resources"]["limits"]["amd.com/gpu"] == c["resources"]["requests"]["amd.com/gpu"] == 2
    assert pod["nodeSelector"] == {"gpu": "mi300"} and pod["priorityClassName"] == "high"
    assert pod["tolerations"] == [{"operator": "Equal", "key": "dedicated", "value": "arcanine",
                                   "effect": "NoSchedule"}]
    assert pod["automountServiceAccountToken"] is False
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert env_of(c)["HOME"] == "/tmp"
    # the kubelet GETs the launcher's /healthz (it answers for a stopped worker), after the rendezvous wait
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "launcher"}
    assert {"name": "launcher", "containerPort": 9401, "protocol": "TCP"} in c["ports"]
    startup = c["startupProbe"]
    assert startup["httpGet"] == c["livenessProbe"]["httpGet"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900 + 60  # k8s.wait_timeout_seconds
    assert "livenessProbe" not in main_container(
        pod_templates(by_kind(render(tiny("k8s.metrics.liveness=false")), "Job"))[0][1])


def test_pytorchjob_master_and_workers() -> None:
    cfg = tiny("k8s.nnodes=3", "k8s.volumes.checkpoints.access_mode=ReadWriteMany")
    job = by_kind(render(cfg, "pytorchjob"), "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    c = main_container(replicas["Master"]["template"])
    assert c["name"] == "pytorch" and c["ports"][0]["name"] == "pytorchjob-port"
    single = by_kind(render(tiny(), "pytorchjob"), "PyTorchJob")
    assert list(single["spec"]["pytorchReplicaSpecs"]) == ["Master"]


def test_trainjob_patches_the_runtime_pod() -> None:
    job = by_kind(render(tiny("k8s.queue=team-a"), "trainjob"), "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["spec"]["trainer"]["numNodes"] == 1
    (role, template), = pod_templates(job)
    assert role == "node" and template["spec"]["containers"][0]["name"] == "node"


def test_trainjob_refuses_priority_class() -> None:
    with pytest.raises(RenderError, match="priority_class_name cannot be set on a TrainJob"):
        render(tiny("k8s.priority_class_name=high"), "trainjob")


def test_jobset_rank_from_job_index() -> None:
    js = by_kind(render(tiny("k8s.nnodes=2", "k8s.volumes.checkpoints.access_mode=ReadWriteMany"), "jobset"),
                 "JobSet")
    assert js["spec"]["network"]["publishNotReadyAddresses"] is True
    env = env_of(main_container(pod_templates(js)[0][1]))
    assert env["MASTER_ADDR"] == "tiny-node-0-0.tiny" and env["KUBETRAIN_PODS_PER_JOB"] == "2"
    assert "jobset.sigs.k8s.io/job-index" in env["JOBSET_JOB_INDEX"]["fieldRef"]["fieldPath"]


def test_statefulset_idles_after_finishing() -> None:
    sts = by_kind(render(tiny(), "statefulset"), "StatefulSet")
    assert sts["spec"]["podManagementPolicy"] == "Parallel" and sts["spec"]["serviceName"] == "tiny"
    c = main_container(sts["spec"]["template"])
    assert "--idle-after-finish" in c["args"] and env_of(c)["KUBETRAIN_STATEFULSET"] == "1"


def test_no_secret_value_in_rendered_yaml() -> None:
    cfg = tiny('k8s.secrets.hf_token={"name": "hf-token", "key": "token"}',
               'k8s.secrets.env={"MLFLOW_TRACKING_PASSWORD": {"name": "mlflow", "key": "password"}}')
    for workload in WORKLOADS:
        objects = render(cfg, workload)
        text = to_yaml(objects)
        workload_obj = objects[-1]
        containers = [main_container(t) for _, t in pod_templates(workload_obj)]
        if workload_obj["kind"] == "TrainJob":  # the trainer's env, not the pod patch, carries it there
            containers = [workload_obj["spec"]["trainer"]]
        for container in containers:
            env = env_of(container)
            assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
            assert env["MLFLOW_TRACKING_PASSWORD"] == {"secretKeyRef": {"name": "mlflow", "key": "password"}}
        assert not re.search(r"hf_[A-Za-z0-9]{16,}", text)


def test_the_wandb_key_reaches_every_pod_as_a_secret_ref_only(monkeypatch: pytest.MonkeyPatch) -> None:
    key = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"
    monkeypatch.setenv("WANDB_API_KEY", key)  # set where render runs: it must not be copied into any object
    cfg = tiny("track.wandb.enabled=true",
               'k8s.secrets.env={"WANDB_API_KEY": {"name": "wandb", "key": "api-key"}}')
    for workload in WORKLOADS:
        objects = render(cfg, workload)
        workload_obj = objects[-1]
        containers = [main_container(t) for _, t in pod_templates(workload_obj)]
        if workload_obj["kind"] == "TrainJob":
            containers = [workload_obj["spec"]["trainer"]]
        for container in containers:
            [entry] = [e for e in container["env"] if e["name"] == "WANDB_API_KEY"]
            assert entry["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}} and "value" not in entry
        assert key not in to_yaml(objects)
    with pytest.raises(ConfigError, match="looks like a secret"):
        tiny(f"k8s.env.WANDB_API_KEY={key}")


@pytest.mark.parametrize(
    "override",
    ['k8s.env={"EXTRA": "hf_abcdefghijklmnopqrstuvwxyz"}', "data.sources.0.path=https://me:hunter2@host/x"],
)
def test_secret_values_in_the_config_are_refused(override: str) -> None:
    with pytest.raises(RenderError, match="looks like a secret"):
        render(tiny(override))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["k8s.nnodes=2", "k8s.volumes.checkpoints.access_mode=ReadWriteOnce"], "needs ReadWriteMany"),
        (["k8s.grace_period_seconds=10"], "shorter than checkpoint.grace_seconds"),
        (["k8s.resources.gpu=1", "k8s.nproc_per_node=2"], "more than the GPUs per pod"),
        (["k8s.metrics.port=29500"], "free of k8s.rdzv_port"),
        (["k8s.metrics.port=29499"], "free of k8s.rdzv_port"),  # the launcher serves on the next port
        (["run.name=" + "x" * 50], "set k8s.name"),
        (['k8s.volumes.data={"claim": "d", "mount_path": "/checkpoints"}'], "share a mount path"),
    ],
)
def test_inconsistent_configs_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        render(tiny(*overrides))


def test_job_name_from_run_name() -> None:
    assert by_kind(render(tiny("run.name=My_Run.v2")), "Job")["metadata"]["name"] == "my-run-v2"


def test_write_files_one_per_object(tmp_path: Path) -> None:
    objects = render(tiny())
    paths = write_files(objects, tmp_path / "out")
    assert paths[0].name == "00-configmap-tiny-config.yaml"
    assert [yaml.safe_load(p.read_text()) for p in paths] == objects


def test_created_claims_default_to_read_write_many_for_several_nodes() -> None:
    one = by_kind(render(tiny()), "PersistentVolumeClaim")["spec"]
    two = by_kind(render(tiny("k8s.nnodes=2")), "PersistentVolumeClaim")["spec"]
    assert one["accessModes"] == ["ReadWriteOnce"] and two["accessModes"] == ["ReadWriteMany"]
    existing = render(tiny('k8s.volumes.checkpoints={"claim": "mine"}'))
    assert "PersistentVolumeClaim" not in [o["kind"] for o in existing]
    template = pod_templates(by_kind(existing, "Job"))[0][1]
    claim = next(v for v in template["spec"]["volumes"] if v["name"] == "checkpoints")
    assert claim["persistentVolumeClaim"] == {"claimName": "mine"}


def test_pods_serve_metrics_on_the_port_the_probe_and_policy_use() -> None:
    from kubetrain.config.track import TrackConfig

    objects = render(tiny("k8s.metrics.port=9555"))
    pod_cfg = yaml.safe_load(by_kind(objects, "ConfigMap")["data"]["config.yaml"])
    if "prometheus" in TrackConfig.model_fields:  # rank 0's exporter is turned on, on the probed port
        assert pod_cfg["track"]["prometheus"]["enabled"] is True
        assert pod_cfg["track"]["prometheus"]["port"] == 9555
    else:  # a kubetrain without an exporter: nothing to turn on
        assert "prometheus" not in pod_cfg["track"]
    c = main_container(pod_templates(by_kind(objects, "Job"))[0][1])
    assert {"name": "metrics", "containerPort": 9555, "protocol": "TCP"} in c["ports"]
    assert {"name": "launcher", "containerPort": 9556, "protocol": "TCP"} in c["ports"]
    assert c["livenessProbe"]["httpGet"]["port"] == "launcher"

    off = render(tiny("k8s.metrics.enabled=false"))
    template = pod_templates(by_kind(off, "Job"))[0][1]
    c = main_container(template)
    assert "livenessProbe" not in c and "startupProbe" not in c and [p["name"] for p in c["ports"]] == ["rdzv"]
    assert "prometheus.io/scrape" not in template["metadata"]["annotations"]
    assert len(by_kind(off, "NetworkPolicy")["spec"]["ingress"]) == 1


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_pass_config_validate(example: Path, cli: Any) -> None:
    code, out, err = cli("config", "validate", str(example))
    assert code == 0 and out.startswith("ok: "), err


def test_render_command(tmp_path: Path, cli: Any) -> None:
    code, out, err = cli("k8s", "render", "--workload", "jobset", "-n", "team-b")
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    assert docs[-1]["kind"] == "JobSet" and {d["metadata"]["namespace"] for d in docs} == {"team-b"}
    code, out, _ = cli("k8s", "render", "-o", str(tmp_path / "out"))
    assert code == 0 and len(out.splitlines()) == 6 and (tmp_path / "out" / "04-job-tiny.yaml").is_file()
    assert out.splitlines()[-1].endswith("kustomization.yaml")
    code, _, err = cli("k8s", "render", "--workload", "deployment")
    assert code == 2 and "unknown workload 'deployment'" in err
    code, _, err = cli("k8s", "render", "--set", "k8s.nnodes=2",
                       "--set", "k8s.volumes.checkpoints.access_mode=ReadWriteOnce")
    assert code == 2 and err.startswith("error: k8s.volumes.checkpoints: 2 nodes share this claim")
    code, _, err = cli("k8s", "render", "--set", 'k8s.tolerations=[{"key": "a", "effect": "Sometimes"}]')
    assert code == 2 and "k8s.tolerations.0.effect" in err


STORE = ["checkpoint.uri=s3://ckpts/team", "checkpoint.endpoint_url=http://10.0.9.4:9000",
         "checkpoint.secret_name=s3-credentials"]


def test_store_credentials_come_from_their_secret(crd_schemas: Any) -> None:
    cfg = tiny(*STORE, 'k8s.secrets.env={"AWS_SESSION_TOKEN": {"name": "sts", "key": "session"}}')
    for workload in WORKLOADS:
        objects = render(cfg, workload)
        assert validate.problems(objects, crd_schemas) == [], workload
        workload_obj = objects[-1]
        containers = [main_container(t) for _, t in pod_templates(workload_obj)]
        if workload_obj["kind"] == "TrainJob":
            containers = [workload_obj["spec"]["trainer"]]
        for container in containers:
            env = env_of(container)
            assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3-credentials", "key": "AWS_ACCESS_KEY_ID"}}
            assert env["AWS_SECRET_ACCESS_KEY"] == {
                "secretKeyRef": {"name": "s3-credentials", "key": "AWS_SECRET_ACCESS_KEY"}}
            # k8s.secrets.env names it too: that one wins, and the name appears once
            assert env["AWS_SESSION_TOKEN"] == {"secretKeyRef": {"name": "sts", "key": "session"}}
            assert [e["name"] for e in container["env"]].count("AWS_SESSION_TOKEN") == 1
    # the endpoint reaches the pods through their config, and no value of a credential is anywhere
    pod_cfg = yaml.safe_load(by_kind(objects, "ConfigMap")["data"]["config.yaml"])
    assert pod_cfg["checkpoint"] == {**pod_cfg["checkpoint"], "uri": "s3://ckpts/team",
                                     "endpoint_url": "http://10.0.9.4:9000", "secret_name": "s3-credentials"}
    session = env_of(main_container(pod_templates(render(tiny(*STORE))[-1])[0][1]))["AWS_SESSION_TOKEN"]
    assert session == {"secretKeyRef": {"name": "s3-credentials", "key": "AWS_SESSION_TOKEN", "optional": True}}


def test_no_store_credentials_without_a_secret_and_none_where_a_secret_cannot_serve() -> None:
    env = env_of(main_container(pod_templates(render(tiny("checkpoint.uri=s3://ckpts/team"))[-1])[0][1]))
    assert not any(name.startswith("AWS_") for name in env)  # IRSA, a node role: the pod's own identity
    azure = env_of(main_container(pod_templates(render(tiny("checkpoint.uri=az://ckpts/team",
                                                             "checkpoint.secret_name=azure"))[-1])[0][1]))
    assert azure["AZURE_STORAGE_ACCOUNT_KEY"]["secretKeyRef"]["optional"] is True
    with pytest.raises(RenderError, match="Workload Identity"):
        render(tiny("checkpoint.uri=gs://ckpts/team", "checkpoint.secret_name=gcs"))
    with pytest.raises(RenderError, match=r"checkpoint\.uri is not"):
        render(tiny("checkpoint.secret_name=s3-credentials"))
