"""Where a job's run directory is read from: a running pod of the job, or a short-lived pod on its claim.

A running pod is exec'd into (its trainer container has the claim mounted); with none running (the job
finished, failed or was stopped: the claim stays), a pod named <job>-fetch-<suffix> mounts the claim read-only
under the job's own restricted security context, sleeps while the files are read through exec, and is
deleted afterwards (it also ends by itself after HELPER_SECONDS, should this process die first).
"""

from __future__ import annotations

import io
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import yaml

from kubetrain.config.loading import validate as validate_config
from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError
from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.cluster.exec import exec_stream
from kubetrain.k8s.cluster.status import job_ranks, main_container, waiting_reason
from kubetrain.k8s.fetch.mlflow_store import pod_store
from kubetrain.k8s.fetch.program import command
from kubetrain.k8s.fetch.transfer import FetchError, FetchResult, fetch_run
from kubetrain.k8s.render.context import CONFIG_FILE, RenderContext, context, job_name
from kubetrain.k8s.render.podspec import container_security, pod_security, tolerations
from kubetrain.k8s.workloads import MANAGED_BY

FETCH_LABEL = "kubetrain.dev/fetch"  # on the short-lived pod: the job it reads (not JOB_LABEL: it is no rank)
HELPER_SECONDS = 4 * 3600
Log = Callable[[str], None]


class ExecTransport:
    """Runs the fetch program in a pod's container through the API server (`kubectl exec`)."""

    def __init__(self, cluster: Cluster, pod: str, namespace: str, container: str) -> None:
        self.cluster, self.pod, self.namespace, self.container = cluster, pod, namespace, container

    @contextmanager
    def run(self, args: list[str]) -> Iterator[IO[bytes]]:
        stream = exec_stream(self.cluster, self.pod, self.namespace, self.container, command("python", args))
        try:
            yield io.BufferedReader(stream, 1 << 20)
        except BaseException:
            stream.close()
            raise
        stream.finish()


def job_config(cluster: Cluster, name: str, namespace: str, given: Config | None) -> Config:
    """The config the job's pods run: its ConfigMap while the job exists, else the config it was launched with."""
    found = cluster.find("ConfigMap", f"{name}-config", namespace)
    if found is not None:
        cfg = validate_config(yaml.safe_load(found["data"][CONFIG_FILE]), source=f"ConfigMap {name}-config")
    elif given is not None:
        cfg = given
    else:
        raise UserInputError(
            f"job '{name}' has no ConfigMap {name}-config in namespace {namespace} (a stopped or removed job takes "
            f"it along; its claims stay): give the config it was launched with, kubetrain k8s fetch {name} CONFIG"
        )
    if job_name(cfg) != name:
        raise UserInputError(f"the config is for job '{job_name(cfg)}', not '{name}'")
    return cfg


def helper_pod(ctx: RenderContext, pod_name: str) -> dict[str, Any]:
    """A pod that mounts the job's checkpoint claim read-only and does nothing else; Pod Security restricted."""
    vol = next(v for v in ctx.volumes if v.role == "checkpoints")
    sleep = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
             f"time.sleep({HELPER_SECONDS})")  # PID 1 ignores SIGTERM unless it handles it
    container = {
        "name": "fetch",
        "image": ctx.k.image,
        "imagePullPolicy": ctx.k.image_pull_policy,
        "command": ["python", "-c", sleep],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": vol.volume_name, "mountPath": vol.mount_path, "readOnly": True}],
        "securityContext": container_security(ctx),
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 5,
        "activeDeadlineSeconds": HELPER_SECONDS,
        "securityContext": pod_security(ctx),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}},
                    {"name": vol.volume_name, "persistentVolumeClaim": {"claimName": vol.claim, "readOnly": True}}],
    }
    # the job's placement: a claim on node-local storage, or a pool only the job's nodes can reach
    if ctx.k.node_selector:
        spec["nodeSelector"] = dict(ctx.k.node_selector)
    if ctx.k.tolerations:
        spec["tolerations"] = tolerations(ctx)
    if ctx.k.affinity:
        spec["affinity"] = ctx.k.affinity
    if ctx.k.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in ctx.k.image_pull_secrets]
    labels = {**ctx.k.labels, "app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/instance": ctx.name,
              "app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/component": "fetch",
              FETCH_LABEL: ctx.name}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": ctx.namespace, "labels": labels}, "spec": spec}


def _running_pod(cluster: Cluster, name: str, namespace: str) -> dict[str, Any] | None:
    """A pod of the job whose trainer container runs (rank 0's first)."""
    for rank in job_ranks(cluster, name, namespace):
        statuses = (rank.pod.get("status") or {}).get("containerStatuses") or []
        main = main_container(rank.pod)
        if rank.phase == "Running" and any(s.get("name") == main and "running" in (s.get("state") or {})
                                           for s in statuses):
            return rank.pod
    return None


def _wait_running(cluster: Cluster, pod: str, namespace: str, timeout: float, say: Log,
                  poll: float = 1.0) -> None:
    """Until the pod runs; each new reason it waits for (the scheduler's verdict, an image pull) is said at once."""
    deadline = time.monotonic() + timeout
    said = None
    while True:
        found = cluster.get("Pod", pod, namespace)
        status = found.get("status") or {}
        if status.get("phase") == "Running":
            return
        why = waiting_reason(found)
        if why is not None and why != said:
            say(f"the fetch pod {pod} waits: {why}")
            said = why
        if status.get("phase") in ("Succeeded", "Failed"):
            raise FetchError(f"the fetch pod {pod} ended ({status.get('reason') or status['phase']}) before the "
                             "claim was read")
        if time.monotonic() > deadline:
            raise FetchError(f"the fetch pod {pod} did not start within {timeout:g} seconds: "
                             f"{waiting_reason(found) or 'pending'}")
        time.sleep(poll)


def fetch_job(cluster: Cluster, name: str, namespace: str, output: Path | None, which: str,
              given: Config | None = None, start_timeout: float = 300, log: Log | None = None) -> tuple[
                  Path, FetchResult]:
    """Copy job `name`'s run directory to `output` (default runs/<run.name>); (where it went, what was copied)."""
    say = log or (lambda _line: None)
    cfg = job_config(cluster, name, namespace, given)
    ctx = context(cfg)
    remote_root = f"{ctx.checkpoint_mount}/{cfg.run.name}"
    local = output or Path("runs") / cfg.run.name
    store, elsewhere = pod_store(cfg, ctx.checkpoint_mount)
    if elsewhere:
        say(elsewhere)
    pod = _running_pod(cluster, name, namespace)
    if pod is not None:
        say(f"reading {remote_root} through the running pod {pod['metadata']['name']}")
        transport = ExecTransport(cluster, pod["metadata"]["name"], namespace, main_container(pod))
        return local, fetch_run(transport, remote_root, local, which, say, store)
    helper = f"{name}-fetch-{secrets.token_hex(3)}"
    say(f"no pod of {name} runs: reading its claim through the pod {helper} (deleted afterwards)")
    cluster.apply(helper_pod(ctx, helper))
    try:
        _wait_running(cluster, helper, namespace, start_timeout, say)
        transport = ExecTransport(cluster, helper, namespace, "fetch")
        return local, fetch_run(transport, remote_root, local, which, say, store)
    finally:
        cluster.delete("Pod", helper, namespace)
