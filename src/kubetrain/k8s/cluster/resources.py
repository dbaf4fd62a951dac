"""The kinds kubetrain reads and writes: where each is served (group/version, plural, namespaced), and which
custom kinds need an operator installed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kubetrain.k8s.workloads import WORKLOADS


@dataclass(frozen=True)
class Resource:
    kind: str
    group_version: str  # "v1", "batch/v1", "kubeflow.org/v1"
    plural: str
    namespaced: bool = True

    @property
    def base(self) -> str:
        return "/api/v1" if self.group_version == "v1" else f"/apis/{self.group_version}"

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        out = self.base
        if self.namespaced and namespace:
            out += f"/namespaces/{quote(namespace)}"
        out += f"/{self.plural}"
        if name:
            out += f"/{quote(name)}"
        if sub:
            out += f"/{sub}"
        return out


_KINDS = [
    Resource("ConfigMap", "v1", "configmaps"),
    Resource("PersistentVolumeClaim", "v1", "persistentvolumeclaims"),
    Resource("Service", "v1", "services"),
    Resource("Pod", "v1", "pods"),
    Resource("Secret", "v1", "secrets"),
    Resource("Event", "v1", "events"),
    Resource("Namespace", "v1", "namespaces", namespaced=False),
    Resource("Node", "v1", "nodes", namespaced=False),
    Resource("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies"),
    Resource("StorageClass", "storage.k8s.io/v1", "storageclasses", namespaced=False),
    Resource("PersistentVolume", "v1", "persistentvolumes", namespaced=False),
    Resource("Workload", "kueue.x-k8s.io/v1beta1", "workloads"),  # Kueue's unit of admission, one per Job
    Resource("SelfSubjectAccessReview", "authorization.k8s.io/v1", "selfsubjectaccessreviews", namespaced=False),
    Resource("CustomResourceDefinition", "apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False),
    Resource(
        "ClusterTrainingRuntime", "trainer.kubeflow.org/v1alpha1", "clustertrainingruntimes", namespaced=False
    ),
    # the platform around the jobs (k8s/platform): the tracking server and the Prometheus Operator's kinds
    Resource("Deployment", "apps/v1", "deployments"),
    Resource("PodMonitor", "monitoring.coreos.com/v1", "podmonitors"),
    Resource("PrometheusRule", "monitoring.coreos.com/v1", "prometheusrules"),
]
RESOURCES = {r.kind: r for r in _KINDS} | {
    w.kind: Resource(w.kind, w.api_version, w.plural) for w in WORKLOADS.values()
}
# Custom kinds, and what to install when the cluster does not serve them.
CUSTOM_KINDS = {w.kind: w.operator for w in WORKLOADS.values() if w.operator} | {
    "ClusterTrainingRuntime": WORKLOADS["trainjob"].operator
} | {kind: "the Prometheus Operator (monitoring.coreos.com)" for kind in ("PodMonitor", "PrometheusRule")}


def resource_of(obj: dict[str, Any]) -> Resource:
    return RESOURCES[obj["kind"]]
