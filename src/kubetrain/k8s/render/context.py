"""What every renderer needs to know about one job: its name, labels, volumes and limits, checked once."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kubetrain.config.k8s import K8sConfig, VolumeConfig
from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError
from kubetrain.k8s.render.grace import MeasuredSave, checkpoint_grace, grace_origin, pod_grace
from kubetrain.k8s.workloads import JOB_LABEL, MANAGED_BY, WORKLOAD_LABEL, WORKLOADS, Workload

CONFIG_MOUNT = "/etc/kubetrain"
CONFIG_FILE = "config.yaml"
CACHE_MOUNT = "/cache"
MAX_NAME = 40  # leaves room for "-worker-63", "-node-0-63" and the like within a 63-character hostname

ROLE_MOUNTS = {
    "checkpoints": "/checkpoints",
    "data": "/data",
    "models": "/models",
    "hf_cache": "/cache/huggingface",
}

class RenderError(UserInputError):
    """The config cannot be turned into Kubernetes objects as asked."""


@dataclass(frozen=True)
class Volume:
    role: str  # checkpoints, data, models, hf_cache
    spec: VolumeConfig
    claim: str  # the PersistentVolumeClaim the pod mounts
    mount_path: str
    created: bool  # kubetrain renders the claim (and keeps it on stop)
    access_mode: str | None

    @property
    def volume_name(self) -> str:
        return self.role.replace("_", "-")


@dataclass(frozen=True)
class RenderContext:
    cfg: Config
    name: str
    workload: str
    volumes: list[Volume] = field(default_factory=list)
    measured: MeasuredSave | None = None  # the save an earlier run of this config measured (grace.py)

    @property
    def kind(self) -> Workload:
        return WORKLOADS[self.workload]

    def workload_meta(self) -> dict[str, Any]:
        """apiVersion, kind and metadata of the workload object (the Kueue queue label goes there)."""
        return {"apiVersion": self.kind.api_version, "kind": self.kind.kind,
                "metadata": self.meta(self.name, self.workload_labels)}

    @property
    def k(self) -> K8sConfig:
        return self.cfg.k8s

    @property
    def namespace(self) -> str:
        return self.k.namespace

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"

    @property
    def selector(self) -> dict[str, str]:
        """Labels that pick exactly this job's pods."""
        return {JOB_LABEL: self.name}

    @property
    def labels(self) -> dict[str, str]:
        return {
            **self.k.labels,
            "app.kubernetes.io/name": "kubetrain",
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/managed-by": MANAGED_BY,
            JOB_LABEL: self.name,
            WORKLOAD_LABEL: self.workload,
        }

    @property
    def workload_labels(self) -> dict[str, str]:
        """Labels of the workload object itself: the Kueue queue goes there (not on pods, which Kueue's pod
        integration would otherwise gate one by one)."""
        if self.k.queue:
            return {**self.labels, "kueue.x-k8s.io/queue-name": self.k.queue}
        return self.labels

    @property
    def grace_seconds(self) -> int:
        """terminationGracePeriodSeconds: long enough for the loop to save a checkpoint after SIGTERM."""
        return pod_grace(self.cfg, self.measured)

    @property
    def checkpoint_grace(self) -> float:
        """checkpoint.grace_seconds inside the pods: the configured one, or longer for a measured slow save."""
        return checkpoint_grace(self.cfg, self.measured)

    @property
    def grace_origin(self) -> str:
        return grace_origin(self.cfg, self.measured)

    @property
    def checkpoint_mount(self) -> str:
        return next(v.mount_path for v in self.volumes if v.role == "checkpoints")

    def meta(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        return {"name": name, "namespace": self.namespace, "labels": dict(labels or self.labels)}


def job_name(cfg: Config) -> str:
    """k8s.name, or run.name made into a DNS label (lower case, '-' for anything else)."""
    if cfg.k8s.name:
        return cfg.k8s.name
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.run.name.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"kt-{name}".rstrip("-")
    if len(name) > MAX_NAME:
        raise RenderError(
            f"run.name '{cfg.run.name}' makes a job name longer than {MAX_NAME} characters; set k8s.name"
        )
    return name


def _check_store_secret(cfg: Config) -> None:
    """checkpoint.secret_name only where the store's library reads its credentials from variables."""
    from kubetrain.checkpoint.store import credential_keys, protocol_of

    ckpt = cfg.checkpoint
    if not ckpt.secret_name:
        return
    if not ckpt.uri:
        raise RenderError("checkpoint.secret_name is set but checkpoint.uri is not: there is no store to log into")
    if not credential_keys(ckpt.uri):
        protocol = protocol_of(ckpt.uri)
        hint = ("gs:// reads a key file: give the pods a Google service account through Workload Identity "
                "(k8s.service_account) instead" if protocol in ("gs", "gcs") else "a path needs no credentials")
        raise RenderError(f"checkpoint.secret_name: {ckpt.uri} takes no credentials from a Secret; {hint}")


def context(cfg: Config, workload: str | None = None, measured: MeasuredSave | None = None) -> RenderContext:
    """Check the parts of the config that span sections, and resolve names, volumes and modes.

    `measured`: the save time an earlier run of this config recorded (grace.measured_locally); it lengthens
    the grace period, so the same config renders differently once a run has measured a slow save.
    """
    k = cfg.k8s
    wl = workload or k.workload
    name = job_name(cfg)
    if k.grace_period_seconds is not None and k.grace_period_seconds < cfg.checkpoint.grace_seconds:
        raise RenderError(
            f"k8s.grace_period_seconds ({k.grace_period_seconds}) is shorter than checkpoint.grace_seconds "
            f"({cfg.checkpoint.grace_seconds:g}): a stopped pod would be killed before saving its checkpoint"
        )
    if k.resources.gpu and k.nproc_per_node > k.resources.gpu:
        raise RenderError(
            f"k8s.nproc_per_node ({k.nproc_per_node}) is more than the GPUs per pod (k8s.resources.gpu = "
            f"{k.resources.gpu})"
        )
    if k.rdzv_port in (k.metrics.port, k.metrics.port + 1) or k.metrics.port == 65535:
        raise RenderError(f"k8s.metrics.port ({k.metrics.port}) and the next port (the launcher's /metrics) must "
                          f"be free of k8s.rdzv_port ({k.rdzv_port}) and below 65536")
    volumes = []
    for role, default_mount in ROLE_MOUNTS.items():
        spec: VolumeConfig | None = getattr(k.volumes, role)
        if spec is None:
            continue
        created = spec.size is not None
        mode = spec.access_mode or ("ReadWriteOnce" if k.nnodes == 1 else "ReadWriteMany")
        if created and k.nnodes > 1 and mode in ("ReadWriteOnce", "ReadWriteOncePod") and not spec.read_only:
            raise RenderError(
                f"k8s.volumes.{role}: {k.nnodes} nodes share this claim, so it needs ReadWriteMany "
                f"(or ReadOnlyMany when read_only), not {mode}"
            )
        claim = spec.claim or f"{name}-{role.replace('_', '-')}"
        volumes.append(
            Volume(role, spec, claim, spec.mount_path or default_mount, created, mode if created else None)
        )
    mounts = [v.mount_path for v in volumes]
    if len(set(mounts)) != len(mounts):
        raise RenderError(f"k8s.volumes: two volumes share a mount path ({', '.join(mounts)})")
    _check_store_secret(cfg)
    if wl == "trainjob" and k.priority_class_name:
        raise RenderError(
            "k8s.priority_class_name cannot be set on a TrainJob: the training runtime's pod template owns it"
        )
    return RenderContext(cfg, name, wl, volumes, measured)
