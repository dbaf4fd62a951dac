"""The one pod template every workload shares: entrypoint, env, volumes, resources, security, probes.

The pod is Pod Security "restricted": non-root, read-only root filesystem (with writable mounts for /tmp,
caches, /dev/shm and outputs), seccomp RuntimeDefault, every capability dropped, no privilege escalation,
and no service-account token (training never talks to the API server). Only the opt-in RDMA settings
(k8s.ipc_lock, k8s.host_network) leave "restricted"; render then says which level the pods meet.
"""

from __future__ import annotations

import math
from typing import Any

from kubetrain.checkpoint.store import credential_keys
from kubetrain.config.clocks import PROBE_FAILURES, PROBE_PERIOD
from kubetrain.config.k8s import DEFAULT_IMAGE, K8sConfig
from kubetrain.distributed.env import NODE_NAME_ENV, POD_NAME_ENV
from kubetrain.errors import RESUME_HINT_ENV
from kubetrain.k8s.render.context import CACHE_MOUNT, CONFIG_FILE, CONFIG_MOUNT, RenderContext

METRICS_PORT_NAME = "metrics"
LAUNCHER_PORT_NAME = "launcher"  # every pod's launcher: its ranks' heartbeats, incidents (metrics port + 1)
COMPILE_CACHE = ".cache"  # on the checkpoint claim; a hidden folder, which `kubetrain runs` passes over
INCIDENTS = "incidents"
FLIGHT_RECORDER_PREFIX = "nccl-flight-recorder-rank-"
ENTRYPOINT = ["kubetrain", "k8s", "entrypoint"]
HEALTH_PATH = "/healthz"  # served by the launcher (track/prometheus_launcher.py) on LAUNCHER_PORT_NAME
STARTUP_PERIOD = 10
STARTUP_SLACK_PERIODS = 6  # a minute beyond the rendezvous wait: start-up, config check, imports


def image(k: K8sConfig) -> str:
    """k8s.image; left at its default, the CUDA (or ROCm) build when the pods request GPUs.

    The default image is the CPU build: a GPU pod running it would train on the CPU without a word.
    """
    if k.image != DEFAULT_IMAGE or not k.resources.gpu:
        return k.image
    if k.resources.gpu_resource == "amd.com/gpu":
        return f"{k.image}-rocm"
    return f"{k.image}-cuda"


def entrypoint_args(ctx: RenderContext, *extra: str) -> list[str]:
    """Arguments of `kubetrain k8s entrypoint` in the pod."""
    # torchrun waits this long for its workers after SIGTERM before killing them: >= the pods' checkpoint grace
    shutdown = max(math.ceil(ctx.checkpoint_grace), ctx.grace_seconds - 10)
    return [
        "--config",
        f"{CONFIG_MOUNT}/{CONFIG_FILE}",
        "--rdzv-id",
        ctx.name,
        "--max-restarts",
        str(ctx.k.max_restarts),
        "--wait-timeout",
        str(ctx.k.wait_timeout_seconds),
        "--shutdown-timeout",
        str(shutdown),
        *extra,
    ]


def env(ctx: RenderContext, extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The container's environment; secrets only as secretKeyRef, never as values."""
    k = ctx.k
    hf_home = next((v.mount_path for v in ctx.volumes if v.role == "hf_cache"), f"{CACHE_MOUNT}/huggingface")
    # torch.compile's kernels on the claim: a replaced pod finds them instead of compiling from scratch
    compiled = f"{ctx.checkpoint_mount}/{COMPILE_CACHE}"
    plain = {
        "PYTHONUNBUFFERED": "1",
        "HOME": "/tmp",  # the root filesystem is read-only
        "XDG_CACHE_HOME": CACHE_MOUNT,
        "HF_HOME": hf_home,
        "TORCHINDUCTOR_CACHE_DIR": f"{compiled}/torchinductor",
        "TRITON_CACHE_DIR": f"{compiled}/triton",
        "MPLCONFIGDIR": f"{CACHE_MOUNT}/matplotlib",
        "KUBETRAIN_NNODES": str(k.nnodes),
        "KUBETRAIN_NPROC_PER_NODE": str(k.nproc_per_node),
        # c10d's C++ warnings carry a whole C++ backtrace: a survivor that lost the rendezvous host printed ~120
        # lines of frames before its one-line exit-69 message. It is read once, when torch is imported, so it is
        # set here (k8s.env may set WARNING back); errors and the Python-side one-liners still show.
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        # what a stopped run says about resuming: in a pod, the controller starts it again, not the same command
        RESUME_HINT_ENV: f"the {ctx.kind.kind} starts the pod again and it resumes from there; after kubetrain k8s "
                         "stop, kubetrain k8s launch resumes it",
        **flight_recorder_env(ctx),
        **(extra or {}),
        **k.env,
    }
    out: list[dict[str, Any]] = [{"name": n, "value": v} for n, v in plain.items()]
    # torchrun advertises this address to the other nodes: a pod IP always routes, a hostname may not.
    out.append({"name": "KUBETRAIN_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    # the preflight names a bad rank by its pod and node, and stops the job in a pod (dist.preflight.on_failure auto)
    for name, field_path in ((POD_NAME_ENV, "metadata.name"), (NODE_NAME_ENV, "spec.nodeName")):
        out.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}})
    secrets = dict(k.secrets.env)
    if k.secrets.hf_token is not None:
        secrets["HF_TOKEN"] = k.secrets.hf_token
    for name, ref in secrets.items():
        out.append({"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return out + store_credentials(ctx, skip=set(secrets))


def flight_recorder_env(ctx: RenderContext) -> dict[str, str]:
    """NCCL's flight recorder, dumping each rank's last collectives into <run>/incidents/ on a timeout.

    As torchtitan's init_distributed: a trace buffer, dump on timeout, and TORCH_NCCL_ASYNC_ERROR_HANDLING=3
    (tear down without the clean-up that mode 1 does, which would abort the work before it is dumped).
    torch's `torchfrtrace <run>/incidents -p nccl-flight-recorder-rank-` names the rank that did not join.
    """
    if not ctx.k.flight_recorder:
        return {}
    run_dir = f"{ctx.checkpoint_mount}/{ctx.cfg.run.name}"
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{run_dir}/{INCIDENTS}/{FLIGHT_RECORDER_PREFIX}",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }


def store_credentials(ctx: RenderContext, skip: frozenset[str] | set[str] = frozenset()) -> list[dict[str, Any]]:
    """The object store's credentials from checkpoint.secret_name, one secretKeyRef per variable its library
    reads (a key the library can do without is optional: the pod starts without it)."""
    ckpt = ctx.cfg.checkpoint
    if not (ckpt.uri and ckpt.secret_name):
        return []
    out = []
    for name, required in credential_keys(ckpt.uri):
        ref: dict[str, Any] = {"name": ckpt.secret_name, "key": name}
        if not required:
            ref["optional"] = True
        if name not in skip:  # k8s.secrets.env names it already: that one wins
            out.append({"name": name, "valueFrom": {"secretKeyRef": ref}})
    return out


def resources(ctx: RenderContext) -> dict[str, Any]:
    r = ctx.k.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if r.cpu:
        requests["cpu"] = r.cpu
        if r.cpu_limit:
            limits["cpu"] = r.cpu
    if r.memory:
        requests["memory"] = limits["memory"] = r.memory
    if r.ephemeral_storage:
        requests["ephemeral-storage"] = r.ephemeral_storage
    if r.gpu:
        requests[r.gpu_resource] = limits[r.gpu_resource] = r.gpu
    for name, amount in r.extra.items():  # extended resources cannot be overcommitted: request = limit
        requests[name] = limits[name] = amount
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def volume_mounts(ctx: RenderContext) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_MOUNT},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    for v in ctx.volumes:
        mount: dict[str, Any] = {"name": v.volume_name, "mountPath": v.mount_path}
        if v.spec.read_only:
            mount["readOnly"] = True
        mounts.append(mount)
    return mounts


def volumes(ctx: RenderContext) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": ctx.config_map}},
        # size limits: past them the kubelet evicts the pod instead of letting it fill the node's disk
        {"name": "tmp", "emptyDir": {"sizeLimit": ctx.k.volumes.tmp_size}},
        {"name": "cache", "emptyDir": {"sizeLimit": ctx.k.volumes.cache_size}},
        # NCCL and dataloader workers need more shared memory than the runtime's 64 MiB default.
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": ctx.k.volumes.shm_size}},
    ]
    for v in ctx.volumes:
        claim: dict[str, Any] = {"claimName": v.claim}
        if v.spec.read_only:
            claim["readOnly"] = True
        out.append({"name": v.volume_name, "persistentVolumeClaim": claim})
    return out


def container_security(ctx: RenderContext) -> dict[str, Any]:
    uid = ctx.k.run_as_user
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        # IPC_LOCK: RDMA registers (pins) memory for the NIC; opt-in, it leaves Pod Security "restricted"
        "capabilities": {"drop": ["ALL"], **({"add": ["IPC_LOCK"]} if ctx.k.ipc_lock else {})},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security(ctx: RenderContext) -> dict[str, Any]:
    uid = ctx.k.run_as_user
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,  # makes the volumes writable for the non-root user
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def liveness_probe(ctx: RenderContext) -> dict[str, Any] | None:
    """The kubelet's GET of the launcher's /healthz: every pod's launcher judges its workers' heartbeats by the
    liveness clock (config/clocks.py), and answers while a worker is stopped, which cannot answer for itself."""
    m = ctx.k.metrics
    if not (m.enabled and m.liveness):
        return None
    return {
        "httpGet": {"path": HEALTH_PATH, "port": LAUNCHER_PORT_NAME},
        "periodSeconds": PROBE_PERIOD,  # /healthz goes stale after config/clocks.py's liveness clock
        "timeoutSeconds": 10,
        "failureThreshold": PROBE_FAILURES,
    }


def startup_probe(ctx: RenderContext) -> dict[str, Any] | None:
    """Holds the liveness probe off until the launcher listens: a pod of node rank > 0 first waits up to
    k8s.wait_timeout_seconds for the rendezvous endpoint, with nothing on its port yet."""
    live = liveness_probe(ctx)
    if live is None:
        return None
    return {"httpGet": live["httpGet"], "periodSeconds": STARTUP_PERIOD,
            "failureThreshold": math.ceil(ctx.k.wait_timeout_seconds / STARTUP_PERIOD) + STARTUP_SLACK_PERIODS}


# k8s.tolerations' fields and the pod's (what is unset is left out)
TOLERATION_FIELDS = {"key": "key", "value": "value", "effect": "effect", "toleration_seconds": "tolerationSeconds"}


def tolerations(ctx: RenderContext) -> list[dict[str, Any]]:
    return [pod_toleration(t.model_dump(mode="json")) for t in ctx.k.tolerations]


def pod_toleration(fields: dict[str, Any]) -> dict[str, Any]:
    """A toleration of k8s.tolerations (its fields as the config writes them) as the pod spec takes it."""
    item: dict[str, Any] = {"operator": fields.get("operator") or "Equal"}
    for ours, theirs in TOLERATION_FIELDS.items():
        if fields.get(ours) is not None:
            item[theirs] = fields[ours]
    return item


def container(
    ctx: RenderContext,
    *,
    name: str = "trainer",
    rdzv_port_name: str = "rdzv",
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    k = ctx.k
    c: dict[str, Any] = {
        "name": name,
        "image": image(k),
        "imagePullPolicy": k.image_pull_policy,
        "command": ENTRYPOINT,
        "args": entrypoint_args(ctx, *extra_args),
        "env": env(ctx, extra_env),
        "ports": [{"name": rdzv_port_name, "containerPort": k.rdzv_port, "protocol": "TCP"}],
        "resources": resources(ctx),
        "volumeMounts": volume_mounts(ctx),
        "securityContext": container_security(ctx),
    }
    if k.metrics.enabled:
        c["ports"].append({"name": METRICS_PORT_NAME, "containerPort": k.metrics.port, "protocol": "TCP"})
        c["ports"].append({"name": LAUNCHER_PORT_NAME, "containerPort": k.metrics.port + 1, "protocol": "TCP"})
    probe = liveness_probe(ctx)
    if probe:
        c["livenessProbe"] = probe
        c["startupProbe"] = startup_probe(ctx)
    return c


def pod_spec(
    ctx: RenderContext, main: dict[str, Any], *, restart_policy: str, subdomain: str | None = None
) -> dict[str, Any]:
    k = ctx.k
    spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,  # no Docker-link variables from every Service in the namespace
        "terminationGracePeriodSeconds": ctx.grace_seconds,
        "securityContext": pod_security(ctx),
        "containers": [main],
        "volumes": volumes(ctx),
    }
    if k.host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # still resolve the job's Service names
    if subdomain:
        spec["subdomain"] = subdomain
    if k.service_account:
        spec["serviceAccountName"] = k.service_account
    if k.priority_class_name:
        spec["priorityClassName"] = k.priority_class_name
    if k.node_selector:
        spec["nodeSelector"] = dict(k.node_selector)
    if k.tolerations:
        spec["tolerations"] = tolerations(ctx)
    if k.affinity:
        spec["affinity"] = k.affinity
    if k.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in k.image_pull_secrets]
    return spec


def pod_metadata(ctx: RenderContext, container_name: str = "trainer") -> dict[str, Any]:
    annotations = {**ctx.k.annotations, "kubectl.kubernetes.io/default-container": container_name}
    if ctx.k.metrics.enabled:
        # every pod's launcher: its ranks' heartbeats, and rank 0's gauges from the pod that holds global rank 0
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(ctx.k.metrics.port + 1)})
    return {"labels": {**ctx.labels, "app.kubernetes.io/component": "trainer"}, "annotations": annotations}


def pod_template(
    ctx: RenderContext,
    *,
    restart_policy: str,
    container_name: str = "trainer",
    rdzv_port_name: str = "rdzv",
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    subdomain: str | None = None,
) -> dict[str, Any]:
    """A PodTemplateSpec: the same pod for every workload, with the workload's few differences passed in."""
    main = container(
        ctx, name=container_name, rdzv_port_name=rdzv_port_name, extra_env=extra_env, extra_args=extra_args
    )
    return {
        "metadata": pod_metadata(ctx, container_name),
        "spec": pod_spec(ctx, main, restart_policy=restart_policy, subdomain=subdomain),
    }
