"""doctor against recorded cluster answers: each check's verdict, and exit 1 when one fails."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.object_store import free_port

Cli = Callable[..., tuple[int, str, str]]
HOMELAB = [
    "k8s.namespace=homelab",
    "k8s.resources.gpu=1",
    'k8s.tolerations=[{"key": "dedicated", "value": "arcanine", "effect": "NoSchedule"}]',
    'k8s.volumes.checkpoints={"size": "100Gi", "storage_class": "local-path"}',
    'k8s.secrets.hf_token={"name": "hf-token", "key": "token"}',
]


def cluster(tmp_path: Path, apiserver: Any) -> str:
    for path, name in [
        ("/version", "version"),
        ("/api/v1/namespaces/homelab", "namespace_homelab"),
        ("/api/v1/nodes", "nodes_homelab"),
        ("/apis/storage.k8s.io/v1/storageclasses", "storageclasses"),
        ("/api/v1/namespaces/homelab/secrets/hf-token", "secret_hf_token"),
    ]:
        apiserver.answer("GET", path, 200, apiserver.recorded(name))
    apiserver.namespaces.add("homelab")  # as the answer above says: it exists
    return str(apiserver.kubeconfig(tmp_path))


def doctor(
    cli: Cli, kubeconfig: str, *overrides: str, workload: str = "indexed-job"
) -> tuple[int, str, str]:
    sets = [a for o in (*HOMELAB, *overrides) for a in ("--set", o)]
    return cli("k8s", "doctor", *sets, "--workload", workload, "--kubeconfig", kubeconfig)


def test_a_cluster_that_fits(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    code, out, err = doctor(cli, cluster(tmp_path, apiserver))
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("ok    cluster: Kubernetes v1.35.0 at http://127.0.0.1:")
    assert "ok    namespace: homelab" in lines
    # the control-plane node has a GPU too, but its taint is not tolerated
    assert "ok    nodes: room for 1 pod(s) of 4 cpu, 16Gi memory, 1 nvidia.com/gpu: arcanine 1" in lines
    assert "ok    access: this user may create jobs.batch in namespace homelab" in lines
    assert (
        "ok    volume checkpoints: 100Gi ReadWriteOnce from storage class local-path (rancher.io/local-path)"
        in lines
    )
    assert "ok    secret HF_TOKEN: Secret hf-token has key token" in lines
    assert "hf_Recorded" not in out and "aGZf" not in out  # the Secret's value is never shown


def test_each_problem_fails_with_its_reason(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = cluster(tmp_path, apiserver)
    code, out, _ = doctor(cli, kubeconfig, "k8s.tolerations=[]")
    assert code == 1
    assert (
        "fail  nodes: no node can run a pod of 4 cpu, 16Gi memory, 1 nvidia.com/gpu; too small: pi-01 (memory "
        "7869180Ki < 16Gi, nvidia.com/gpu 0 < 1); control (memory 7869180Ki < 16Gi); tainted and not tolerated: "
        "arcanine (dedicated=arcanine:NoSchedule)"
    ) in out.splitlines()

    code, out, _ = doctor(
        cli, kubeconfig, "k8s.nnodes=2", "k8s.volumes.checkpoints.access_mode=ReadWriteMany"
    )
    assert (
        code == 1
        and (
            "fail  volume checkpoints: storage class local-path (rancher.io/local-path) is block "
            "storage: it cannot give ReadWriteMany"
        )
        in out
    )
    assert "warn  nodes: room for 1 pod(s) of 4 cpu, 16Gi memory, 1 nvidia.com/gpu: arcanine 1 (the job needs 2)" in out

    code, out, _ = doctor(cli, kubeconfig, 'k8s.secrets.hf_token={"name": "hf-token", "key": "hf_token"}')
    assert code == 1 and "fail  secret HF_TOKEN: Secret hf-token has no key hf_token" in out

    code, out, _ = doctor(cli, kubeconfig, 'k8s.volumes.data={"claim": "corpus"}')
    assert code == 1 and "fail  volume data: claim corpus does not exist in namespace homelab" in out

    apiserver.answer("GET", "/apis/kubeflow.org/v1", 404, b"404 page not found\n", "text/plain")
    code, out, _ = doctor(cli, kubeconfig, workload="pytorchjob")
    assert (
        code == 1 and "fail  workload: PyTorchJob is not served: install Kubeflow training-operator" in out
    )


def test_unknown_namespace_and_forbidden_nodes(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = cluster(tmp_path, apiserver)
    code, out, _ = doctor(cli, kubeconfig, "k8s.namespace=elsewhere")
    assert code == 1 and out.splitlines()[-1] == "fail  namespace: namespace elsewhere does not exist"
    forbidden = apiserver.recorded("forbidden_patch_job") | {
        "message": 'nodes is forbidden: User "alice" cannot list resource "nodes" at the cluster scope'
    }
    apiserver.answer("GET", "/api/v1/nodes", 403, forbidden)
    code, out, _ = doctor(cli, kubeconfig)
    assert code == 0 and "warn  nodes: cannot check nodes: forbidden" in out


def test_a_namespace_editor_gets_every_check_it_can_have(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = cluster(tmp_path, apiserver)
    for path in ("/api/v1/nodes", "/apis/storage.k8s.io/v1/storageclasses"):
        del apiserver.answers[("GET", path)]
    apiserver.editor_of = "homelab"
    code, out, err = doctor(cli, kubeconfig)
    assert code == 0, err
    assert out.splitlines()[1:] == [
        "ok    namespace: homelab",
        "ok    access: this user may create jobs.batch in namespace homelab",
        "warn  nodes: cannot check nodes: forbidden",
        "warn  gpu memory: cannot check the nodes' GPUs: forbidden",
        "warn  volume checkpoints: cannot check storage classes for the 100Gi claim: forbidden",
        "ok    secret HF_TOKEN: Secret hf-token has key token",
        "ok    grace: terminationGracePeriodSeconds 90 s from the default rule: checkpoint.grace_seconds 60 + 30",
    ]


def test_requests_larger_than_any_node_fail(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    code, out, _ = doctor(cli, cluster(tmp_path, apiserver), "k8s.resources.memory=100Gi")
    assert code == 1 and "fail  nodes: no node can run a pod of 4 cpu, 100Gi memory, 1 nvidia.com/gpu; too small: " \
        "arcanine (memory 65736220Ki < 100Gi)" in out


def test_no_word_on_a_node_selector_that_is_not_set(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    code, out, _ = doctor(cli, cluster(tmp_path, apiserver), "k8s.resources.gpu=0", "k8s.resources.memory=1Gi")
    assert code == 0 and "selector" not in out and "labelled" not in out
    code, out, _ = doctor(cli, cluster(tmp_path, apiserver), 'k8s.node_selector={"gpu": "a100"}')
    assert code == 1 and "on nodes labelled gpu=a100" in out


def test_a_free_static_volume_counts_as_storage(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = cluster(tmp_path, apiserver)
    apiserver.answer("GET", "/apis/storage.k8s.io/v1/storageclasses", 200, {"kind": "List", "items": []})
    volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "nas-100"},
              "spec": {"capacity": {"storage": "200Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                       "nfs": {"server": "nas", "path": "/export"}}, "status": {"phase": "Available"}}
    apiserver.put(volume)
    code, out, _ = doctor(cli, kubeconfig, 'k8s.volumes.checkpoints={"size": "100Gi"}')
    assert code == 0, out
    assert ("ok    volume checkpoints: 100Gi ReadWriteOnce: no default storage class, but the free "
            "PersistentVolume nas-100 matches; the claim binds to it") in out
    code, out, _ = doctor(cli, kubeconfig, 'k8s.volumes.checkpoints={"size": "300Gi"}')
    assert code == 1 and "fail  volume checkpoints: a default storage class does not exist" in out


def test_the_store_secret_has_the_keys_the_pods_read(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = cluster(tmp_path, apiserver)
    store = ["checkpoint.uri=s3://ckpts/team", "checkpoint.secret_name=s3-credentials"]
    code, out, _ = doctor(cli, kubeconfig, *store)
    assert code == 1 and "fail  secret AWS_ACCESS_KEY_ID: Secret s3-credentials does not exist in homelab" in out
    assert "AWS_SECRET_ACCESS_KEY" not in out  # the missing Secret is said once
    apiserver.answer("GET", "/api/v1/namespaces/homelab/secrets/s3-credentials", 200, {
        "kind": "Secret", "apiVersion": "v1", "metadata": {"name": "s3-credentials", "namespace": "homelab"},
        "data": {"AWS_ACCESS_KEY_ID": "a2V5", "AWS_SECRET_ACCESS_KEY": "c2VjcmV0"}, "type": "Opaque"})
    code, out, _ = doctor(cli, kubeconfig, *store)
    assert code == 0, out
    assert "ok    secret AWS_ACCESS_KEY_ID: Secret s3-credentials has key AWS_ACCESS_KEY_ID" in out
    assert "ok    secret AWS_SECRET_ACCESS_KEY: Secret s3-credentials has key AWS_SECRET_ACCESS_KEY" in out
    assert "AWS_SESSION_TOKEN" not in out and "c2VjcmV0" not in out  # optional and absent; values never shown


def test_the_bucket_is_listed_from_here_when_credentials_are(
    tmp_path: Path, apiserver: Any, cli: Cli, bucket: Any, monkeypatch: Any
) -> None:
    kubeconfig = cluster(tmp_path, apiserver)
    at = [f"checkpoint.uri={bucket.uri}", f"checkpoint.endpoint_url={bucket.endpoint}"]
    code, out, _ = doctor(cli, kubeconfig, *at)
    assert code == 0, out
    assert (f"ok    store: {bucket.uri} reachable from here (credentials from $AWS_ACCESS_KEY_ID): nothing stored "
            "under it yet") in out.splitlines()
    bucket.fs.pipe_file(bucket.path("run1/checkpoints/latest"), b"step-000003\n")
    assert "credentials from $AWS_ACCESS_KEY_ID): 1 entry under it" in doctor(cli, kubeconfig, *at)[1]

    code, out, _ = doctor(cli, kubeconfig, "checkpoint.uri=s3://kt-no-such-bucket/p",
                          f"checkpoint.endpoint_url={bucket.endpoint}")
    assert code == 1 and out.splitlines()[-1] == ("fail  store: s3://kt-no-such-bucket/p cannot be listed from here "
                                                  "(credentials from $AWS_ACCESS_KEY_ID): bucket kt-no-such-bucket "
                                                  "does not exist")
    code, out, _ = doctor(cli, kubeconfig, at[0], f"checkpoint.endpoint_url=http://127.0.0.1:{free_port()}")
    assert code == 1 and out.splitlines()[-1].startswith(f"fail  store: {bucket.uri} cannot be listed from here")

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws either
    code, out, _ = doctor(cli, kubeconfig, *at)
    assert code == 0 and out.splitlines()[-1] == (f"warn  store: {bucket.uri}: no credentials in this environment; "
                                                  "not checked from here")
    assert "store" not in doctor(cli, kubeconfig, "checkpoint.uri=/mnt/nas/ckpts")[1]  # the pods' path


def running_pod(name: str, node: str, cpu: str, phase: str = "Running") -> dict[str, Any]:
    """A pod of another team, bound to a node: what it requests is not free for the job."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "other"},
            "spec": {"nodeName": node, "containers": [{"name": "main", "resources": {"requests": {"cpu": cpu}}}]},
            "status": {"phase": phase}}


def test_nodes_are_counted_in_pod_slots_beside_running_pods(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = cluster(tmp_path, apiserver)
    cpu_only = ["k8s.resources.gpu=0", "k8s.nnodes=2"]  # 4 cpu, 16Gi: arcanine (16 cpu, 62.7Gi) holds 3 of them
    code, out, err = doctor(cli, kubeconfig, *cpu_only)  # (local-path cannot give 2 nodes a claim: a fail of its own)
    assert "ok    nodes: room for 3 pod(s) of 4 cpu, 16Gi memory: arcanine 3" in out.splitlines(), out + err
    apiserver.put(running_pod("inference", "arcanine", "10"))
    apiserver.put(running_pod("done", "arcanine", "16", phase="Succeeded"))  # finished: holds nothing
    code, out, err = doctor(cli, kubeconfig, *cpu_only)
    assert "warn  nodes: room for 1 pod(s) of 4 cpu, 16Gi memory: arcanine 1 (the job needs 2)" in out.splitlines()
    apiserver.put(running_pod("inference", "arcanine", "14"))
    code, out, err = doctor(cli, kubeconfig, *cpu_only)
    assert code == 1
    nodes = next(line for line in out.splitlines() if "nodes:" in line)
    assert nodes.startswith("fail  nodes: no node can run a pod of 4 cpu, 16Gi memory now; full: arcanine (1 running "
                            "pod(s) hold what a pod needs); too small: pi-01"), out + err


def test_access_to_the_workload_kind_is_asked_before_launch(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = cluster(tmp_path, apiserver)
    for path in ("/api/v1/nodes", "/apis/storage.k8s.io/v1/storageclasses"):
        del apiserver.answers[("GET", path)]
    apiserver.install_crd({"metadata": {"name": "jobsets.jobset.x-k8s.io"},
                           "spec": {"group": "jobset.x-k8s.io", "versions": [{"name": "v1alpha2"}]}})
    apiserver.editor_of, apiserver.forbidden = "homelab", {"jobsets"}  # an `edit` RoleBinding; JobSets not in it
    code, out, err = doctor(cli, kubeconfig, workload="jobset")
    assert code == 1, out + err
    assert ("fail  access: this user may not create or patch jobsets.jobset.x-k8s.io in namespace homelab: launch "
            "would be forbidden (403); ask for a Role that grants it, or choose another --workload") in out.splitlines()
    asked = [r["body"]["spec"]["resourceAttributes"] for r in apiserver.requests
             if r["path"] == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"]
    assert asked[0] == {"verb": "create", "group": "jobset.x-k8s.io", "resource": "jobsets", "namespace": "homelab"}
    sets = [a for o in HOMELAB for a in ("--set", o)]
    code, _, err = cli("k8s", "launch", *sets, "--workload", "jobset", "--kubeconfig", kubeconfig)
    assert code == 2 and "forbidden (403)" in err  # what doctor foretold
    code, out, err = doctor(cli, kubeconfig)  # an Indexed Job is in the `edit` role
    assert "ok    access: this user may create jobs.batch in namespace homelab" in out.splitlines()
