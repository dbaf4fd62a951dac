"""kube-apiserver's NamespaceLifecycle admission, as the test API server (tests/k8s/apiserver.py) answers it.

plugin/pkg/admission/namespace/lifecycle/admission.go: an object is created only in a namespace that exists; the
request, dry runs included (admission runs for them too), is refused with NotFound, `namespaces "NAME" not found`.
That is what `helm install` of a chart whose objects name a namespace nobody created meets on a real cluster, while
`helm install --dry-run=server` (which renders, looks up and validates, but creates nothing) passes.
"""

from __future__ import annotations

from typing import Any

# Created by kube-apiserver itself (pkg/controlplane/controller/systemnamespaces); a cluster always has them.
SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


def missing_namespace(objects: dict[str, dict[str, Any]], namespaces: set[str], obj: dict[str, Any],
                      namespaced: bool) -> str | None:
    """The namespace a create needs and lacks (neither applied nor among `namespaces`), else None."""
    ns = obj["metadata"].get("namespace")
    if not namespaced or not ns or ns in namespaces or f"/api/v1/namespaces/{ns}" in objects:
        return None
    return str(ns)
