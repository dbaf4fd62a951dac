"""`kubetrain k8s doctor CONFIG`: can this cluster run this job? Each check says ok, warn or fail, and why.

Checks: the API server answers; the namespace exists; the workload's CRD (and TrainJob runtime) is installed;
nodes have the GPU resource and their taints are tolerated; storage classes exist and claims fit several
nodes (ReadWriteMany); the Secrets and keys the pods read exist (their values are never shown).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubetrain.config.schema import Config
from kubetrain.k8s.cluster.api import CUSTOM_KINDS, Cluster, Forbidden, NotFound
from kubetrain.k8s.render.context import RenderContext, context

# Provisioners of block storage: their volumes attach to one node at a time (ReadWriteOnce).
BLOCK_PROVISIONERS = (
    "ebs.csi.aws.com",
    "kubernetes.io/aws-ebs",
    "pd.csi.storage.gke.io",
    "kubernetes.io/gce-pd",
    "disk.csi.azure.com",
    "kubernetes.io/azure-disk",
    "rancher.io/local-path",
    "openebs.io/local",
    "kubernetes.io/cinder",
    "cinder.csi.openstack.org",
)
DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str


def _tolerated(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> bool:
    if taint.get("effect") == "PreferNoSchedule":
        return True
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value") == taint.get("value"):
            return True
    return False


def _nodes(cluster: Cluster, ctx: RenderContext, tolerations: list[dict[str, Any]]) -> Check:
    r, k = ctx.k.resources, ctx.k
    try:
        nodes = cluster.list("Node")
    except Forbidden:
        return Check("nodes", "warn", "cannot list nodes (forbidden); the scheduler will decide")
    fit, blocked = [], []
    for node in nodes:
        name = node["metadata"]["name"]
        labels = node["metadata"].get("labels") or {}
        if any(labels.get(key) != value for key, value in k.node_selector.items()):
            continue
        if (
            r.gpu
            and int(str((node.get("status") or {}).get("allocatable", {}).get(r.gpu_resource, 0))) < r.gpu
        ):
            continue
        taints = [t for t in (node.get("spec") or {}).get("taints") or [] if not _tolerated(t, tolerations)]
        if taints:
            blocked.append(f"{name} ({', '.join(_taint(t) for t in taints)})")
        else:
            fit.append(name)
    what = f"{r.gpu} x {r.gpu_resource}" if r.gpu else "the node selector"
    if not fit:
        why = f"; tainted and not tolerated: {'; '.join(blocked)}" if blocked else ""
        return Check("nodes", "fail", f"no node offers {what}{why}")
    status = "ok" if len(fit) >= k.nnodes or not r.gpu else "warn"
    more = f" (the job needs {k.nnodes})" if status == "warn" else ""
    return Check("nodes", status, f"{len(fit)} node(s) with {what}: {', '.join(fit[:8])}{more}")


def _taint(t: dict[str, Any]) -> str:
    value = f"={t['value']}" if t.get("value") else ""
    return f"{t.get('key')}{value}:{t.get('effect')}"


def _storage(cluster: Cluster, ctx: RenderContext) -> list[Check]:
    out = []
    many = ctx.k.nnodes > 1
    for v in ctx.volumes:
        name = f"volume {v.role}"
        if not v.created:
            claim = cluster.find("PersistentVolumeClaim", v.claim, ctx.namespace)
            if claim is None:
                out.append(
                    Check(name, "fail", f"claim {v.claim} does not exist in namespace {ctx.namespace}")
                )
                continue
            modes = set(claim["spec"].get("accessModes") or [])
            shared = "ReadWriteMany" in modes or (v.spec.read_only and "ReadOnlyMany" in modes)
            if many and not shared:
                out.append(
                    Check(
                        name,
                        "fail",
                        f"claim {v.claim} is {', '.join(sorted(modes))}; "
                        f"{ctx.k.nnodes} nodes need ReadWriteMany",
                    )
                )
            else:
                out.append(Check(name, "ok", f"claim {v.claim} ({', '.join(sorted(modes))})"))
            continue
        classes = cluster.list("StorageClass")
        if v.spec.storage_class:
            cls = next((c for c in classes if c["metadata"]["name"] == v.spec.storage_class), None)
        else:
            cls = next(
                (
                    c
                    for c in classes
                    if (c["metadata"].get("annotations") or {}).get(DEFAULT_CLASS) == "true"
                ),
                None,
            )
        if cls is None:
            wanted = (
                f"storage class {v.spec.storage_class}"
                if v.spec.storage_class
                else "a default storage class"
            )
            out.append(Check(name, "fail", f"{wanted} does not exist; the claim would stay Pending"))
            continue
        provisioner = cls.get("provisioner", "?")
        if v.access_mode in ("ReadWriteMany", "ReadOnlyMany") and provisioner in BLOCK_PROVISIONERS:
            out.append(
                Check(
                    name,
                    "fail",
                    f"storage class {cls['metadata']['name']} ({provisioner}) is block "
                    f"storage: it cannot give {v.access_mode}",
                )
            )
        else:
            out.append(
                Check(
                    name,
                    "ok",
                    f"{v.spec.size} {v.access_mode} from storage class "
                    f"{cls['metadata']['name']} ({provisioner})",
                )
            )
    return out


def _secrets(cluster: Cluster, ctx: RenderContext) -> list[Check]:
    refs = dict(ctx.k.secrets.env)
    if ctx.k.secrets.hf_token is not None:
        refs["HF_TOKEN"] = ctx.k.secrets.hf_token
    out = []
    for env, ref in refs.items():
        try:
            secret = cluster.get("Secret", ref.name, ctx.namespace)
        except NotFound:
            out.append(
                Check(f"secret {env}", "fail", f"Secret {ref.name} does not exist in {ctx.namespace}")
            )
            continue
        except Forbidden:
            out.append(Check(f"secret {env}", "warn", f"cannot read Secret {ref.name} (forbidden)"))
            continue
        keys = set(secret.get("data") or {}) | set(secret.get("stringData") or {})
        ok = ref.key in keys
        detail = f"Secret {ref.name} has key {ref.key}" if ok else f"Secret {ref.name} has no key {ref.key}"
        out.append(Check(f"secret {env}", "ok" if ok else "fail", detail))
    return out


def _crd(cluster: Cluster, ctx: RenderContext, kind: str) -> list[Check]:
    if kind not in CUSTOM_KINDS:
        return []
    if not cluster.served(kind):
        return [Check("workload", "fail", f"{kind} is not served: install {CUSTOM_KINDS[kind]}")]
    out = [Check("workload", "ok", f"{kind} CRD installed")]
    if kind == "TrainJob":
        runtime = cluster.find("ClusterTrainingRuntime", ctx.k.trainjob_runtime)
        status = "ok" if runtime else "fail"
        out.append(
            Check(
                "runtime",
                status,
                f"ClusterTrainingRuntime {ctx.k.trainjob_runtime} "
                f"{'exists' if runtime else 'does not exist'}",
            )
        )
    return out


def run_checks(cluster: Cluster, cfg: Config, workload: str | None = None) -> list[Check]:
    from kubetrain.k8s.render.manifest import render
    from kubetrain.k8s.render.podspec import tolerations

    ctx = context(cfg, workload)
    version = cluster.request("GET", "/version", what="get the server version")
    checks = [Check("cluster", "ok", f"Kubernetes {version.get('gitVersion', '?')} at {cluster.where}")]
    try:
        cluster.get("Namespace", ctx.namespace)
        checks.append(Check("namespace", "ok", ctx.namespace))
    except NotFound:
        checks.append(Check("namespace", "fail", f"namespace {ctx.namespace} does not exist"))
        return checks
    except Forbidden:
        checks.append(Check("namespace", "warn", f"cannot read namespace {ctx.namespace} (forbidden)"))
    checks.extend(_crd(cluster, ctx, render(cfg, workload)[-1]["kind"]))
    checks.append(_nodes(cluster, ctx, tolerations(ctx)))
    checks.extend(_storage(cluster, ctx))
    checks.extend(_secrets(cluster, ctx))
    return checks
