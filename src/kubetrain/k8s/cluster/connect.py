"""Connect to a cluster: the official client's configuration from a kubeconfig (--kubeconfig, $KUBECONFIG,
~/.kube/config) or, in a pod, its service account; whatever is wrong with them becomes one line (exit 2)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from kubetrain.errors import UserInputError
from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.cluster.api_errors import ClusterError


def _check_kubeconfig(path: Path) -> None:
    """One line for a kubeconfig file the client would die on: not UTF-8 text, or YAML that is not a mapping."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError:
        return  # a path of KUBECONFIG that is not there: the client skips it
    except UnicodeDecodeError as e:
        raise ClusterError(f"kubeconfig {path} is not UTF-8 text (invalid byte at offset {e.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return  # reported by the client's own parse, with its line and column
    if data is not None and not isinstance(data, dict):
        raise ClusterError(f"kubeconfig {path} must be a mapping (apiVersion, clusters, contexts, users), "
                           f"not a YAML {type(data).__name__}")


def connect(kubeconfig: Path | None = None, context: str | None = None) -> Cluster:
    """The cluster of a kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config) or, in a pod, its own."""
    try:
        from kubernetes import config as kconfig
        from kubernetes.client import ApiClient, Configuration
    except ImportError:
        raise UserInputError(
            "the Kubernetes commands need the kubernetes package: pip install 'kubetrain[k8s]'"
        ) from None
    source = str(kubeconfig) if kubeconfig else os.environ.get("KUBECONFIG") or "~/.kube/config"
    paths = [Path(p).expanduser() for p in source.split(os.pathsep) if p]
    if (
        kubeconfig is None
        and not any(p.is_file() for p in paths)
        and os.environ.get("KUBERNETES_SERVICE_HOST")
    ):
        configuration = Configuration()
        try:
            kconfig.load_incluster_config(client_configuration=configuration)
        except kconfig.ConfigException as e:
            raise ClusterError(f"cannot use the in-cluster service account: {e}") from None
        namespace_file = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        ns = namespace_file.read_text().strip() if namespace_file.is_file() else "default"
        return Cluster(ApiClient(configuration), f"{configuration.host} (in-cluster service account)", ns)
    if not any(p.is_file() for p in paths):
        raise ClusterError(f"no kubeconfig at {source} (give --kubeconfig, or set KUBECONFIG)")
    for path in paths:
        _check_kubeconfig(path)
    try:
        contexts, active = kconfig.list_kube_config_contexts(config_file=source)
        chosen = next((c for c in contexts if c["name"] == context), None) if context else active
        if context and chosen is None:
            names = ", ".join(c["name"] for c in contexts)
            raise ClusterError(f"kubeconfig {source} has no context '{context}' (it has: {names})")
        configuration = Configuration()
        kconfig.load_kube_config(
            config_file=source, context=context, client_configuration=configuration, persist_config=False
        )
    except kconfig.ConfigException as e:
        raise ClusterError(
            f"cannot load kubeconfig {source}" + (f" (context {context})" if context else "") + f": {e}"
        ) from None
    except yaml.YAMLError as e:  # the client hands the parser's error through
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ClusterError(f"kubeconfig {source} is not valid YAML{at}: {problem}") from None
    name = (chosen or {}).get("name", "?")
    namespace = (chosen or {}).get("context", {}).get("namespace") or "default"
    where = f"{configuration.host} (kubeconfig {source}, context {name})"
    return Cluster(ApiClient(configuration), where, namespace)
