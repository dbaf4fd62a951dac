"""A thin REST layer over the official `kubernetes` client: connect, get/list/apply/delete, stream logs.

The client does the kubeconfig, TLS and authentication; requests go by resource path, so every kind, core
or custom, takes the same few calls. Whatever goes wrong becomes one line that names the server, the
kubeconfig and context, and what was tried (exit 2): an unreachable server, a missing CRD, 401/403/404/409.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import yaml

from kubetrain.errors import UserInputError
from kubetrain.k8s.workloads import FIELD_MANAGER, WORKLOADS

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # server-side apply (a JSON body is valid YAML)


class ClusterError(UserInputError):
    """The API server cannot be reached, or refused a request. Exit code 2."""

    status: int | None = None  # the HTTP status it answered with; None: no answer (unreachable, timed out)


class NotFound(ClusterError):
    pass


class StreamBroken(ClusterError):
    """A streamed answer (a followed log) broke off mid-way: the connection was reset or timed out."""

    def __init__(self, message: str, idle: bool = False) -> None:
        super().__init__(message)
        self.idle = idle  # nothing arrived for the read timeout: a quiet container, or a stalled stream


class Conflict(ClusterError):
    pass


class Forbidden(ClusterError):
    pass


class Invalid(ClusterError):
    """422: the server refused the object; `causes` are (field, reason) pairs from the Status details."""

    def __init__(self, message: str, causes: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.causes = causes


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


class Cluster:
    """One API server, reached through the official client's ApiClient."""

    def __init__(self, client: Any, where: str, default_namespace: str = "default") -> None:
        self.client = client
        self.where = where  # "https://host:6443 (kubeconfig X, context Y)", for messages
        self.default_namespace = default_namespace
        self.timeout = 30.0  # seconds a request may take (a followed stream: between two reads, when it sets one)

    @property
    def server(self) -> str:
        return str(self.client.configuration.host)

    # -- requests --------------------------------------------------------------------------------

    def request(self, method: str, path: str, **options: Any) -> Any:
        """One HTTP round-trip; JSON back (or the raw streaming response with stream=True).

        Takes the keyword options of `exchange`, which also returns the HTTP status.
        """
        return self.exchange(method, path, **options)[1]

    def exchange(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        what: str = "",
        stream: bool = False,
        timeout: float | None = None,
    ) -> tuple[int, Any]:
        """(HTTP status, JSON body) of one round-trip. A dict body goes as JSON; a str body as it is.

        `timeout`: seconds to wait for the answer (default `self.timeout`); with `stream`, for each read of it
        (default: none, a followed log may stay quiet for hours)."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json", "Content-Type": content_type}
        what = what or f"{method} {path}"
        try:
            wait: Any = timeout if timeout is not None or stream else self.timeout
            if stream and timeout is not None:  # connecting takes the usual time; each read may take `timeout`
                wait = (self.timeout, timeout)
            response = self._send(method, path, query or [], headers, body, wait)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise ClusterError(f"cannot reach the API server at {self.where}: {_short(reason)}") from None
        except ApiException as e:  # the client's wrapping of TLS failures (status 0)
            raise ClusterError(f"cannot reach the API server at {self.where}: {_short(e.reason)}") from None
        if stream and 200 <= response.status < 300:
            return response.status, response
        data = response.read()
        if not 200 <= response.status < 300:
            raise self.error(response.status, data, what)
        return response.status, json.loads(data) if data else {}

    def prepare(
        self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str], body: Any = None
    ) -> tuple[str, dict[str, str], Any]:
        """(URL with the query, headers with the client's credentials, body) of a request to the API server."""
        if hasattr(self.client, "param_serialize"):  # kubernetes >= 37 (the generator's v7 ApiClient)
            _, url, headers, body, _ = self.client.param_serialize(
                method=method, resource_path=path, query_params=query, header_params=headers, body=body,
                auth_settings=["BearerToken"],
            )
            return url, headers, body
        # kubernetes <= 36: pip installs it beside s3fs (botocore needs python-dateutil < 3, kubernetes 37 >= 3)
        headers = {**self.client.default_headers, **headers}
        self.client.update_params_for_auth(headers, [], ["BearerToken"])
        url = self.client.configuration.host + path + (f"?{urlencode(query)}" if query else "")
        if body is not None and not isinstance(body, str | bytes):
            body = json.dumps(self.client.sanitize_for_serialization(body))
        return url, headers, body

    def _send(
        self, method: str, path: str, query: list[tuple[str, str]], headers: dict[str, str], body: Any,
        timeout: Any,
    ) -> Any:
        """The urllib3 response of one request (its body unread), whatever its status; `timeout`: seconds, or
        (connect, read) seconds, or None."""
        url, headers, body = self.prepare(method, path, query, headers, body)
        if hasattr(self.client, "param_serialize"):
            return self.client.call_api(method, url, header_params=headers, body=body,
                                        _request_timeout=timeout).response
        # The older REST layer raises on any status outside 2xx and reads the whole body: use its connection
        # pool (TLS and proxy as the kubeconfig says) directly, as the newer one does.
        import urllib3

        if isinstance(timeout, tuple):
            timeout = urllib3.Timeout(connect=timeout[0], read=timeout[1])
        return self.client.rest_client.pool_manager.request(
            method, url, body=body, headers=headers, preload_content=False, timeout=timeout,
        )

    def error(self, status: int, data: bytes, what: str) -> ClusterError:
        """The one-line error of an HTTP status and the Status body the API server sent with it."""
        error = self._error(status, data, what)
        error.status = status
        return error

    def _error(self, status: int, data: bytes, what: str) -> ClusterError:
        message, body = "", {}
        try:
            body = json.loads(data)
            message = str(body.get("message", ""))
        except (ValueError, AttributeError):
            message = data.decode(errors="replace").strip()[:200]
        detail = f": {message}" if message else ""
        causes = [(str(c.get("field", "")), _reason(str(c.get("message", ""))))
                  for c in ((body.get("details") or {}).get("causes") or []) if isinstance(body, dict)]
        if status == 422 and causes:  # the message repeats the whole rejected value; the causes name fields
            found = "; ".join(f"{f}: {r}" if f else r for f, r in causes)
            return Invalid(f"{what}: rejected as invalid (422) by {self.where}: {found}", causes)
        if status == 401:
            return ClusterError(
                f"{what}: unauthorized (401): the credentials of {self.where} were refused{detail}"
            )
        if status == 403:
            return Forbidden(f"{what}: forbidden (403) by {self.where}{detail}")
        if status == 404:
            return NotFound(f"{what}: not found (404) on {self.where}{detail}")
        if status == 409:
            return Conflict(f"{what}: conflict (409) on {self.where}{detail}")
        if status == 422:
            return ClusterError(f"{what}: rejected as invalid (422) by {self.where}{detail}")
        return ClusterError(f"{what}: HTTP {status} from {self.where}{detail}")

    # -- verbs -----------------------------------------------------------------------------------

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        res = RESOURCES[kind]
        ns = namespace or self.default_namespace
        where = f" in namespace {ns}" if res.namespaced else ""
        return dict(self.request("GET", res.path(ns, name), what=f"get {kind} {name}{where}"))

    def find(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return self.get(kind, name, namespace)
        except NotFound:
            return None

    def list(
        self,
        kind: str,
        namespace: str | None = None,
        selector: str | None = None,
        all_namespaces: bool = False,
        fields: str | None = None,
    ) -> list[dict[str, Any]]:
        """Objects of a kind, by label selector and field selector (`involvedObject.name=x` for events)."""
        res = RESOURCES[kind]
        ns = None if all_namespaces else (namespace or self.default_namespace)
        query = [("labelSelector", selector)] if selector else []
        query += [("fieldSelector", fields)] if fields else []
        where = f" in namespace {ns}" if res.namespaced and ns else ""
        data = self.request("GET", res.path(ns), query=query, what=f"list {res.plural}{where}")
        return list(data.get("items") or [])

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> tuple[dict[str, Any], bool]:
        """Server-side apply with our field manager; (the object as stored, whether it was created)."""
        res = resource_of(obj)
        name, ns = obj["metadata"]["name"], obj["metadata"].get("namespace")
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        where = f" in namespace {ns}" if ns else ""
        status, stored = self.exchange(
            "PATCH",
            res.path(ns, name),
            query=query,
            body=json.dumps(obj),
            content_type=APPLY_CONTENT_TYPE,
            what=f"apply {obj['kind']} {name}{where}",
        )
        return dict(stored), status == 201

    def delete(self, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete, and the objects it owns in the background; False when it was already gone."""
        res = RESOURCES[kind]
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self.request(
                "DELETE",
                res.path(namespace or self.default_namespace, name),
                body=body,
                what=f"delete {kind} {name}",
            )
        except NotFound:
            return False
        return True

    def served(self, kind: str) -> bool:
        """Whether the API server serves this kind (for custom resources: the CRD is installed)."""
        res = RESOURCES[kind]
        try:
            data = self.request("GET", res.base, what=f"discover {res.group_version}")
        except NotFound:
            return False
        return any(r.get("name") == res.plural for r in data.get("resources", []))

    def require(self, kind: str) -> None:
        if not self.served(kind):
            raise self._not_served(kind)

    def _not_served(self, kind: str) -> ClusterError:
        res = RESOURCES[kind]
        return ClusterError(
            f"{self.where} does not serve {kind} ({res.group_version}): its CRD is not installed "
            f"(install {CUSTOM_KINDS.get(kind, 'its operator')}, or use --workload indexed-job)"
        )

    def crd(self, kind: str) -> dict[str, Any] | None:
        """The CustomResourceDefinition this server serves for a custom kind: the schema that matters.

        None when the user may not read CRDs (a namespace editor); a kind whose CRD is missing is refused.
        """
        res = RESOURCES[kind]
        try:
            return self.get("CustomResourceDefinition", f"{res.plural}.{res.group_version.split('/')[0]}")
        except NotFound:
            raise self._not_served(kind) from None
        except Forbidden:
            return None

    def log_lines(
        self,
        pod: str,
        namespace: str | None = None,
        container: str | None = None,
        follow: bool = False,
        tail: int | None = None,
        previous: bool = False,
        timestamps: bool = False,
        since_time: str | None = None,
        read_timeout: float | None = None,
    ) -> Iterator[str]:
        """A pod's log line by line as it arrives, never read whole.

        `previous`: the container's previous instance (the kubelet keeps the last one that terminated; it answers
        400 when there is none, see `lastState.terminated`). `timestamps`: each line starts with the time the
        container runtime took it (RFC 3339, to the nanosecond) and a space; `since_time` (RFC 3339): only the
        lines taken at or after it. A stream that breaks off raises StreamBroken; so does one that sends nothing for
        `read_timeout` seconds (`idle`)."""
        import urllib3

        query = [("follow", "true" if follow else "false")]
        if container:
            query.append(("container", container))
        if previous:
            query.append(("previous", "true"))
        if tail is not None:
            query.append(("tailLines", str(tail)))
        if timestamps:
            query.append(("timestamps", "true"))
        if since_time is not None:
            query.append(("sinceTime", since_time))
        path = RESOURCES["Pod"].path(namespace or self.default_namespace, pod, "log")
        response = self.request("GET", path, query=query, stream=True, what=f"logs of pod {pod}",
                                timeout=read_timeout)
        pending = b""
        try:
            for chunk in response.stream(4096, decode_content=True):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace")
            if pending:
                yield pending.decode(errors="replace")
        except urllib3.exceptions.ReadTimeoutError:
            raise StreamBroken(f"the log stream of pod {pod} sent nothing for {read_timeout:g}s", idle=True) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise StreamBroken(f"the log stream of pod {pod} broke off: {_short(e)}") from None
        finally:
            response.release_conn()


def _reason(message: str) -> str:
    """'Invalid value: core.PodTemplateSpec{...kilobytes...}: field is immutable' -> 'field is immutable'."""
    return message.rsplit(": ", 1)[-1][:200]


def _short(error: object) -> str:
    text = str(error)
    for marker in (
        "Connection refused",
        "Name or service not known",
        "timed out",
        "certificate verify failed",
        "No route to host",
        "Temporary failure in name resolution",
    ):
        if marker in text:
            return marker.lower()
    return text.splitlines()[0][:200] if text else type(error).__name__


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
