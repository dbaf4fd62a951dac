"""The `k8s:` section: how the job is rendered for Kubernetes (pods, volumes, scheduling, secrets).

Field names are snake_case like the rest of the config; `affinity` alone is taken as-is in Kubernetes'
own shape (it is deeply nested, and is validated strictly against the Kubernetes schema at render time).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kubetrain.config.section import Section

Workload = Literal["indexed-job", "jobset", "trainjob", "pytorchjob", "statefulset"]
WORKLOADS: tuple[str, ...] = ("indexed-job", "jobset", "trainjob", "pytorchjob", "statefulset")
AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod", "ReadOnlyMany"]

_QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
# an extended resource: vendor-domain/name (rdma/ib, nvidia.com/mig-1g.10gb) or hugepages-<size>
_RESOURCE_NAME = r"^(([a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)|hugepages-[0-9]+[KMG]i)$"
DEFAULT_IMAGE = "ghcr.io/kubetrain/kubetrain:0.1.0"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_SECRET_NAME = re.compile(r"(TOKEN|PASSWORD|PASSWD|SECRET|API_?KEY|CREDENTIAL)", re.IGNORECASE)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
# Set by the entrypoint, torchrun or the workload's controller: a user value would silently be overwritten.
RESERVED_ENV = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT|JOB_COMPLETION_INDEX"
    r"|PET_.*|TORCHELASTIC_.*|KUBETRAIN_.*|HF_TOKEN)$"
)


class ResourcesConfig(Section):
    cpu: str | None = Field(
        default="4",
        pattern=_QUANTITY,
        description="CPU request per pod (also the limit when cpu_limit is set).",
    )
    cpu_limit: bool = Field(
        default=False, description="Also limit CPU to the request (off: limits throttle dataloaders)."
    )
    memory: str | None = Field(
        default="16Gi", pattern=_QUANTITY, description="Memory request and limit per pod."
    )
    gpu: int = Field(default=0, ge=0, description="Accelerators per pod (requested and limited).")
    gpu_resource: str = Field(
        default="nvidia.com/gpu",
        pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$",
        description="Extended resource name: nvidia.com/gpu, amd.com/gpu, ...",
    )
    ephemeral_storage: str | None = Field(
        default=None, pattern=_QUANTITY, description="Ephemeral storage request."
    )
    extra: dict[str, int | str] = Field(
        default_factory=dict,
        description="Other extended resources per pod, requested and limited alike: rdma/ib: 1 (InfiniBand), "
        "nvidia.com/mig-1g.10gb: 1 (a MIG slice), hugepages-2Mi: 1Gi, ...",
    )

    @field_validator("extra")
    @classmethod
    def _extra(cls, value: dict[str, int | str]) -> dict[str, int | str]:
        for name, amount in value.items():
            if not re.match(_RESOURCE_NAME, name) or name in ("cpu", "memory", "ephemeral-storage"):
                raise ValueError(f"k8s.resources.extra: '{name}' is not an extended resource name (vendor/name)")
            if isinstance(amount, bool) or not re.match(_QUANTITY, str(amount)):
                raise ValueError(f"k8s.resources.extra: {name}: '{amount}' is not a quantity")
        return value


class VolumeConfig(Section):
    """A volume: an existing PersistentVolumeClaim (`claim`), or one kubetrain creates (`size`)."""

    claim: str | None = Field(
        default=None,
        pattern=_DNS_SUBDOMAIN,
        max_length=253,
        description="Name of an existing PersistentVolumeClaim.",
    )
    size: str | None = Field(
        default=None, pattern=_QUANTITY, description="Create a claim of this size, e.g. 100Gi."
    )
    storage_class: str | None = Field(
        default=None, description="StorageClass of a created claim (default: the cluster's)."
    )
    access_mode: AccessMode | None = Field(
        default=None,
        description="Access mode of a created claim (default: ReadWriteOnce for one node, "
        "ReadWriteMany for several, since every node reads the checkpoints on resume).",
    )
    mount_path: str | None = Field(
        default=None, pattern=r"^/", description="Where the pod mounts it (default per role)."
    )
    read_only: bool = Field(default=False, description="Mount it read-only.")

    @model_validator(mode="after")
    def _one_source(self) -> VolumeConfig:
        if (self.claim is None) == (self.size is None):
            raise ValueError(
                "a volume needs exactly one of 'claim' (an existing claim) or 'size' (create one)"
            )
        if self.claim is not None and (self.storage_class or self.access_mode):
            raise ValueError(
                "storage_class and access_mode apply to a created claim ('size'), not to 'claim'"
            )
        return self


class VolumesConfig(Section):
    checkpoints: VolumeConfig = Field(
        default_factory=lambda: VolumeConfig(size="20Gi"),
        description="Run directories and checkpoints (mounted at /checkpoints; run.output_dir points there).",
    )
    data: VolumeConfig | None = Field(default=None, description="Datasets (mounted at /data).")
    models: VolumeConfig | None = Field(
        default=None, description="Base models, e.g. an offline HF snapshot (at /models)."
    )
    hf_cache: VolumeConfig | None = Field(
        default=None, description="Hugging Face cache (at /cache/huggingface)."
    )
    shm_size: str = Field(default="2Gi", pattern=_QUANTITY, description="Size of the memory-backed /dev/shm.")
    tmp_size: str = Field(
        default="8Gi", pattern=_QUANTITY, description="Size limit of the /tmp emptyDir (the pod is evicted past it)."
    )
    cache_size: str = Field(
        default="50Gi", pattern=_QUANTITY,
        description="Size limit of the /cache emptyDir (the Hugging Face cache without an hf_cache volume).",
    )


class SecretRef(Section):
    name: str = Field(pattern=_DNS_SUBDOMAIN, max_length=253, description="Secret name.")
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", description="Key inside the Secret.")


class SecretsConfig(Section):
    hf_token: SecretRef | None = Field(
        default=None, description="HF_TOKEN from this Secret key (never inline)."
    )
    env: dict[str, SecretRef] = Field(
        default_factory=dict, description="More environment variables from Secrets, e.g. a tracking password."
    )

    @field_validator("env")
    @classmethod
    def _names(cls, value: dict[str, SecretRef]) -> dict[str, SecretRef]:
        for name in value:
            _check_env_name(name)
        return value


class Toleration(Section):
    key: str | None = Field(default=None, description="Taint key (none with Exists: every taint).")
    operator: Literal["Equal", "Exists"] = Field(default="Equal", description="Equal: key and value match.")
    value: str | None = Field(default=None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate (none: every effect)."
    )
    toleration_seconds: int | None = Field(default=None, ge=0, description="Only with effect NoExecute.")


class MetricsConfig(Section):
    enabled: bool = Field(
        default=True,
        description="Serve rank 0's /metrics and /healthz in the pods (turns on track.prometheus there).",
    )
    port: int = Field(default=9400, ge=1024, le=65535, description="Port of rank 0's /metrics and /healthz.")
    scrape_namespace: str | None = Field(
        default="monitoring",
        description="Namespace whose pods may scrape the metrics port (the NetworkPolicy).",
    )
    liveness: bool = Field(
        default=True, description="Restart a pod whose rank-0 heartbeat on /healthz went stale."
    )


class NetworkPolicyConfig(Section):
    """The job's NetworkPolicy (`k8s.network_policy: true|false` is the same as `enabled`)."""

    enabled: bool = Field(default=True, description="Admit traffic only from the job's own pods (+ metrics).")
    egress: bool = Field(
        default=False,
        description="Also restrict egress: pods reach only the job's pods, cluster DNS, the MLflow tracking "
        "server the config names, and egress_cidrs.",
    )
    egress_cidrs: list[str] = Field(
        default_factory=list,
        description="More destinations pods may reach (object storage, a tracking server outside the cluster, "
        "a model hub), as CIDRs such as 10.0.5.0/24.",
    )
    dns_namespace: str = Field(default="kube-system", pattern=_DNS_LABEL, description="Where cluster DNS runs.")
    dns_labels: dict[str, str] = Field(
        default_factory=lambda: {"k8s-app": "kube-dns"}, description="Labels of the cluster DNS pods."
    )

    @field_validator("egress_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        import ipaddress

        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"'{cidr}' is not a CIDR such as 10.0.5.0/24") from None
        return value


class K8sConfig(Section):
    name: str | None = Field(
        default=None,
        pattern=_DNS_LABEL,
        max_length=40,
        description="Job name (default: run.name made DNS-safe).",
    )
    namespace: str = Field(default="default", pattern=_DNS_LABEL, max_length=63, description="Namespace of the job.")
    image: str = Field(
        default=DEFAULT_IMAGE, min_length=1,
        description="Container image with kubetrain (left at the default with GPUs requested: its -cuda build, "
        "or -rocm for amd.com/gpu).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="When the kubelet pulls the image."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Secrets with registry credentials for the image."
    )
    workload: Workload = Field(
        default="indexed-job",
        description="indexed-job (needs no operator), jobset, trainjob "
        "(Kubeflow Trainer v2), pytorchjob (Kubeflow v1) or statefulset.",
    )
    nnodes: int = Field(default=1, ge=1, description="Pods (nodes) in the job.")
    nproc_per_node: int = Field(
        default=1, ge=1, description="Training processes per pod (usually its GPU count)."
    )
    resources: ResourcesConfig = Field(
        default_factory=lambda: ResourcesConfig(), description="CPU, memory and GPUs per pod."
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods must match.")
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the pods tolerate (e.g. a dedicated GPU node)."
    )
    affinity: dict[str, Any] | None = Field(
        default=None, description="Pod affinity in Kubernetes' own shape."
    )
    volumes: VolumesConfig = Field(
        default_factory=lambda: VolumesConfig(), description="Checkpoint, data, model and cache volumes."
    )
    secrets: SecretsConfig = Field(
        default_factory=lambda: SecretsConfig(), description="Environment variables from Secrets."
    )
    service_account: str | None = Field(
        default=None, description="An existing ServiceAccount; its token is not mounted."
    )
    priority_class_name: str | None = Field(default=None, description="PriorityClass of the pods.")
    queue: str | None = Field(
        default=None, description="Kueue LocalQueue (the kueue.x-k8s.io/queue-name label)."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=7 * 24 * 3600, ge=0, description="Delete the finished job after this long."
    )
    backoff_limit: int = Field(
        default=3, ge=0, description="Pod failures (not preemptions) before the job fails."
    )
    max_restarts: int = Field(default=3, ge=0, description="torchrun worker-group restarts inside a pod.")
    grace_period_seconds: int | None = Field(
        default=None,
        ge=1,
        description="terminationGracePeriodSeconds (default checkpoint.grace_seconds + 30).",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Fail the job after this long, however far it got."
    )
    rdzv_port: int = Field(
        default=29500, ge=1024, le=65535, description="c10d rendezvous port on node rank 0."
    )
    wait_timeout_seconds: int = Field(
        default=900, ge=1, description="How long a pod waits for the rendezvous endpoint to answer."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment, e.g. NCCL_DEBUG: INFO.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels on every object.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations on every pod.")
    run_as_user: int = Field(default=1000, ge=1, description="Non-root uid (and gid) the container runs as.")
    network_policy: NetworkPolicyConfig = Field(
        default_factory=lambda: NetworkPolicyConfig(),
        description="The job's NetworkPolicy: true/false, or its settings (egress, egress_cidrs, ...).",
    )
    metrics: MetricsConfig = Field(
        default_factory=lambda: MetricsConfig(), description="Prometheus endpoint and liveness probe."
    )
    trainjob_runtime: str = Field(
        default="torch-distributed", description="ClusterTrainingRuntime of a TrainJob."
    )
    ipc_lock: bool = Field(
        default=False,
        description="Add the IPC_LOCK capability (RDMA/InfiniBand pins memory); the pods then meet Pod Security "
        "'privileged' only, not 'restricted' (render says so).",
    )
    host_network: bool = Field(
        default=False,
        description="Pods use the node's network (RoCE/InfiniBand setups without an RDMA device plugin); "
        "Pod Security 'privileged' only, and the NetworkPolicy no longer applies to them.",
    )
    flight_recorder: bool = Field(
        default=True,
        description="NCCL's flight recorder: on a collective timeout each rank dumps its last collectives into "
        "<run>/incidents/ on the checkpoint volume (read them with torchfrtrace).",
    )

    @field_validator("network_policy", mode="before")
    @classmethod
    def _policy_switch(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            _check_env_name(name)
            if _SECRET_NAME.search(name):
                raise ValueError(f"'{name}' looks like a secret: put it in a Secret and use k8s.secrets.env")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> K8sConfig:
        if self.resources.gpu and self.resources.gpu_resource in self.resources.extra:
            raise ValueError(f"k8s.resources.extra names {self.resources.gpu_resource}, which k8s.resources.gpu "
                             "already requests")
        for t in self.tolerations:
            if t.operator == "Exists" and t.value:
                raise ValueError("k8s.tolerations: operator 'Exists' takes no value")
            if t.toleration_seconds is not None and t.effect != "NoExecute":
                raise ValueError("k8s.tolerations: toleration_seconds needs effect 'NoExecute'")
        return self


def _check_env_name(name: str) -> None:
    if not _ENV_NAME.match(name):
        raise ValueError(f"'{name}' is not a valid environment variable name")
    if RESERVED_ENV.match(name):
        raise ValueError(
            f"environment variable '{name}' is set by kubetrain or the launcher; it cannot be overridden"
        )
