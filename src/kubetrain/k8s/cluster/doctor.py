"""`kubetrain k8s doctor CONFIG`: can this cluster run this job? Each check says ok, warn or fail, and why.

Checks: the API server answers; the namespace exists; the workload's CRD (and TrainJob runtime) is installed;
this user may create the workload (SelfSubjectAccessReview); nodes have room for nnodes pods (pod slots: what
one pod requests, beside what running pods request) and their taints are tolerated; one process's memory (the
estimate, kubetrain.memory) fits the nodes' GPUs (gpu_memory.py); storage classes exist and
claims fit several nodes (ReadWriteMany); the Secrets and keys the pods read exist (their values are never
shown); the bucket of checkpoint.uri can be listed from this machine, when it has credentials; the grace period
a stopped pod gets to save, and where it came from (a measured save, or the default rule).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kubetrain.config.schema import Config
from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.cluster.api_errors import ClusterError, Forbidden, NotFound
from kubetrain.k8s.cluster.resources import CUSTOM_KINDS, RESOURCES
from kubetrain.k8s.quantities import quantity
from kubetrain.k8s.render.context import RenderContext, context
from kubetrain.k8s.render.grace import MeasuredSave

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


def _requests(ctx: RenderContext) -> dict[str, str]:
    r = ctx.k.resources
    wanted = {"cpu": r.cpu, "memory": r.memory, r.gpu_resource: str(r.gpu) if r.gpu else None}
    return {k: v for k, v in wanted.items() if v}


def pod_requests(pod: dict[str, Any]) -> dict[str, float]:
    """What a pod asks the scheduler for: its containers' requests summed, or its largest init container's when
    that is more, plus the pod overhead (pkg/api/v1/resource/helpers.go, PodRequests)."""
    spec = pod.get("spec") or {}
    out: dict[str, float] = {}
    for container in spec.get("containers") or []:
        for key, value in ((container.get("resources") or {}).get("requests") or {}).items():
            out[key] = out.get(key, 0.0) + quantity(value)
    for container in spec.get("initContainers") or []:
        for key, value in ((container.get("resources") or {}).get("requests") or {}).items():
            out[key] = max(out.get(key, 0.0), quantity(value))
    for key, value in (spec.get("overhead") or {}).items():
        out[key] = out.get(key, 0.0) + quantity(value)
    return out


def _in_use(cluster: Cluster) -> dict[str, tuple[int, dict[str, float]]] | None:
    """Per node: (pods, what they request) of the pods bound there that have not finished; None when the pods
    of every namespace may not be listed."""
    try:
        pods = cluster.list("Pod", all_namespaces=True)
    except Forbidden:
        return None
    used: dict[str, tuple[int, dict[str, float]]] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        count, requests = used.get(node, (0, {}))
        for key, value in pod_requests(pod).items():
            requests[key] = requests.get(key, 0.0) + value
        used[node] = (count + 1, requests)
    return used


def _slots(allocatable: dict[str, Any], wanted: dict[str, str], count: int, requests: dict[str, float]) -> int:
    """How many more pods of `wanted` fit beside what the node already runs (the scheduler's NodeResourcesFit)."""
    slots = int(quantity(allocatable.get("pods", 110))) - count
    for key, value in wanted.items():
        slots = min(slots, int((quantity(allocatable.get(key, 0)) - requests.get(key, 0.0)) // quantity(value)))
    return max(slots, 0)


def _nodes(cluster: Cluster, ctx: RenderContext, tolerations: list[dict[str, Any]]) -> Check:
    """Pod slots: on nodes that match the selector and whose taints are tolerated, how many pods of what one pod
    requests still fit beside the pods running there. One node may hold several pods of the job."""
    k = ctx.k
    nodes = cluster.list("Node")
    wanted = _requests(ctx)
    used = _in_use(cluster)
    fit: list[tuple[str, int]] = []
    blocked, small, full = [], [], []
    for node in nodes:
        name = node["metadata"]["name"]
        labels = node["metadata"].get("labels") or {}
        if any(labels.get(key) != value for key, value in k.node_selector.items()):
            continue
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        short = [f"{key} {allocatable.get(key, 0)} < {value}" for key, value in wanted.items()
                 if quantity(allocatable.get(key, 0)) < quantity(value)]
        taints = [t for t in (node.get("spec") or {}).get("taints") or [] if not _tolerated(t, tolerations)]
        if short:
            small.append(f"{name} ({', '.join(short)})")
        elif taints:
            blocked.append(f"{name} ({', '.join(_taint(t) for t in taints)})")
        else:
            count, requests = (used or {}).get(name, (0, {}))
            slots = _slots(allocatable, wanted, count, requests)
            if slots:
                fit.append((name, slots))
            else:
                full.append(f"{name} ({count} running pod(s) hold what a pod needs)")
    what = ", ".join(f"{v} {key}" for key, v in wanted.items())
    if k.node_selector:
        what += " on nodes labelled " + ",".join(f"{key}={v}" for key, v in k.node_selector.items())
    why = "".join(f"; {label}: {'; '.join(names)}" for label, names in (
        ("full", full), ("too small", small), ("tainted and not tolerated", blocked)) if names)
    if not fit:
        return Check("nodes", "fail", f"no node can run a pod of {what}{' now' if full else ''}{why}")
    total = sum(slots for _, slots in fit)
    status = "ok" if total >= k.nnodes else "warn"
    more = f" (the job needs {k.nnodes})" if status == "warn" else ""
    unseen = "" if used is not None else "; running pods not subtracted (cannot list the pods of every namespace)"
    where = ", ".join(f"{name} {slots}" for name, slots in fit[:8])
    return Check("nodes", status, f"room for {total} pod(s) of {what}: {where}{more}{unseen}")


def may(cluster: Cluster, verb: str, kind: str, namespace: str) -> tuple[bool, str]:
    """Whether this user may `verb` a kind in a namespace, and the authorizer's reason: a SelfSubjectAccessReview
    (authorization.k8s.io/v1), which every authenticated user may create."""
    res = RESOURCES[kind]
    group = "" if res.group_version == "v1" else res.group_version.split("/")[0]
    attributes = {"verb": verb, "group": group, "resource": res.plural, "namespace": namespace}
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
              "spec": {"resourceAttributes": attributes}}
    answer = cluster.request("POST", RESOURCES["SelfSubjectAccessReview"].path(), body=review,
                             what=f"ask whether this user may {verb} {res.plural}")
    status = answer.get("status") or {}
    return bool(status.get("allowed")), str(status.get("reason") or status.get("evaluationError") or "")


def _access(cluster: Cluster, ctx: RenderContext) -> Check:
    """launch applies the workload with server-side apply: creating it needs `create` and `patch` on its kind."""
    res = RESOURCES[ctx.kind.kind]
    what = f"{res.plural}.{res.group_version.split('/')[0]}" if "/" in res.group_version else res.plural
    refused = [verb for verb in ("create", "patch") if not may(cluster, verb, ctx.kind.kind, ctx.namespace)[0]]
    if refused:
        return Check("access", "fail", f"this user may not {' or '.join(refused)} {what} in namespace "
                                       f"{ctx.namespace}: launch would be forbidden (403); ask for a Role that "
                                       "grants it, or choose another --workload")
    return Check("access", "ok", f"this user may create {what} in namespace {ctx.namespace}")


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
        try:
            classes = cluster.list("StorageClass")
        except Forbidden:
            out.append(Check(name, "warn", f"cannot check storage classes for the {v.spec.size} claim: forbidden"))
            continue
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
        if cls is None and not v.spec.storage_class:
            try:
                volume = _free_volume(cluster, v.spec.size or "0", v.access_mode or "ReadWriteOnce")
            except Forbidden:
                volume = None
            if volume is not None:
                out.append(Check(name, "ok", f"{v.spec.size} {v.access_mode}: no default storage class, but the "
                                             f"free PersistentVolume {volume} matches; the claim binds to it"))
                continue
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


def _free_volume(cluster: Cluster, size: str, mode: str) -> str | None:
    """A static PersistentVolume a claim without a class binds to: Available, class "", mode and size fit."""
    for pv in cluster.list("PersistentVolume"):
        spec = pv.get("spec") or {}
        if ((pv.get("status") or {}).get("phase") == "Available" and not spec.get("storageClassName")
                and mode in (spec.get("accessModes") or [])
                and quantity((spec.get("capacity") or {}).get("storage", 0)) >= quantity(size)):
            return str(pv["metadata"]["name"])
    return None


def _secrets(cluster: Cluster, ctx: RenderContext) -> list[Check]:
    """Every Secret key the pods read: a missing required key fails, a missing optional one is not shown.

    A Secret that is missing or may not be read is said once, at the first variable that reads it.
    """
    from kubetrain.checkpoint.store import credential_keys

    refs = [(env, ref.name, ref.key, False) for env, ref in ctx.k.secrets.env.items()]
    if ctx.k.secrets.hf_token is not None:
        refs.append(("HF_TOKEN", ctx.k.secrets.hf_token.name, ctx.k.secrets.hf_token.key, False))
    ckpt = ctx.cfg.checkpoint
    if ckpt.uri and ckpt.secret_name:
        refs += [(env, ckpt.secret_name, env, not required) for env, required in credential_keys(ckpt.uri)
                 if env not in ctx.k.secrets.env]
    out = []
    found: dict[str, dict[str, Any] | None] = {}
    for env, name, key, optional in refs:
        if name not in found:
            try:
                found[name] = cluster.get("Secret", name, ctx.namespace)
            except NotFound:
                found[name] = None
                out.append(Check(f"secret {env}", "fail", f"Secret {name} does not exist in {ctx.namespace}"))
            except Forbidden:
                found[name] = None
                out.append(Check(f"secret {env}", "warn", f"cannot read Secret {name} (forbidden)"))
        secret = found[name]
        if secret is None:
            continue
        keys = set(secret.get("data") or {}) | set(secret.get("stringData") or {})
        if key in keys:
            out.append(Check(f"secret {env}", "ok", f"Secret {name} has key {key}"))
        elif not optional:
            out.append(Check(f"secret {env}", "fail", f"Secret {name} has no key {key}"))
    return out


def store_check(cfg: Config) -> Check | None:
    """The bucket of checkpoint.uri, listed from this machine when credentials are here (the pods use theirs)."""
    from kubetrain.checkpoint.store import check_reachable, credentials_here, describe, is_remote, open_store

    uri = cfg.checkpoint.uri
    if not uri or not is_remote(uri):
        return None  # a path is the pods' path, not this machine's
    source = credentials_here(uri)
    if source is None:
        return Check("store", "warn", f"{uri}: no credentials in this environment; not checked from here")
    try:
        found = check_reachable(open_store(uri, cfg.checkpoint.endpoint_url))
    except Exception as e:  # network, credentials, a missing bucket or library: a verdict, not a crash
        return Check("store", "fail", f"{uri} cannot be listed from here (credentials from {source}): {describe(e)}")
    return Check("store", "ok", f"{uri} reachable from here (credentials from {source}): {found}")


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


def _guarded(name: str, what: str, check: Callable[[], Check | list[Check]]) -> list[Check]:
    """Run one check; a user without the rights to it (403) gets 'cannot check' instead of an abort."""
    try:
        found = check()
    except Forbidden:
        return [Check(name, "warn", f"cannot check {what}: forbidden")]
    return found if isinstance(found, list) else [found]


def _gpu_memory(cluster: Cluster, cfg: Config) -> list[Check]:
    from kubetrain.k8s.cluster.gpu_memory import gpu_memory_verdict

    verdict = gpu_memory_verdict(cfg, cluster.list("Node"))
    return [Check("gpu memory", *verdict)] if verdict else []


def _grace(cluster: Cluster, ctx: RenderContext) -> Check:
    from kubetrain.k8s.cluster.grace import grace_verdict

    return Check("grace", *grace_verdict(cluster, ctx))


def run_checks(cluster: Cluster, cfg: Config, workload: str | None = None,
               measured: MeasuredSave | None = None) -> Iterator[Check]:
    """Each check as soon as it is known (a slow or forbidden one does not hold back the others).

    `measured`: the save time of a local copy of the run (render/grace.py), as launch would render it.
    """
    from kubetrain.k8s.render.podspec import tolerations

    ctx = context(cfg, workload, measured)
    version = cluster.request("GET", "/version", what="get the server version")
    yield Check("cluster", "ok", f"Kubernetes {version.get('gitVersion', '?')} at {cluster.where}")
    try:
        cluster.get("Namespace", ctx.namespace)
        yield Check("namespace", "ok", ctx.namespace)
    except NotFound:
        yield Check("namespace", "fail", f"namespace {ctx.namespace} does not exist")
        return
    except Forbidden:
        yield Check("namespace", "warn", f"cannot check namespace {ctx.namespace}: forbidden")
    yield from _guarded("workload", "the workload's CRD", lambda: _crd(cluster, ctx, ctx.kind.kind))
    try:
        yield _access(cluster, ctx)
    except ClusterError as e:  # a server without SelfSubjectAccessReview, or one that refuses the question
        yield Check("access", "warn", f"cannot ask whether this user may create the workload: {e}")
    yield from _guarded("nodes", "nodes", lambda: _nodes(cluster, ctx, tolerations(ctx)))
    yield from _guarded("gpu memory", "the nodes' GPUs", lambda: _gpu_memory(cluster, cfg))
    yield from _guarded("storage", "storage classes and volumes", lambda: _storage(cluster, ctx))
    yield from _secrets(cluster, ctx)
    yield from _guarded("grace", "the job's logs", lambda: _grace(cluster, ctx))
    store = store_check(cfg)
    if store is not None:
        yield store
