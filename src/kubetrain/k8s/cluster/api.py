"""A thin REST layer over the official `kubernetes` client: get/list/apply/delete, discovery, stream logs.

The client does the TLS and authentication (connect.py builds it from a kubeconfig); requests go by resource path
(resources.py), so every kind, core or custom, takes the same few calls. Whatever goes wrong becomes one line that
names the server, the kubeconfig and context, and what was tried (exit 2, api_errors.py): an unreachable server, a
missing CRD, 401/403/404/409.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

from kubetrain.k8s.cluster.api_errors import (
    ClusterError,
    Forbidden,
    NotFound,
    StreamBroken,
    short_reason,
    status_error,
)
from kubetrain.k8s.cluster.resources import CUSTOM_KINDS, RESOURCES, resource_of
from kubetrain.k8s.workloads import FIELD_MANAGER

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # server-side apply (a JSON body is valid YAML)


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
            raise ClusterError(f"cannot reach the API server at {self.where}: {short_reason(reason)}") from None
        except ApiException as e:  # the client's wrapping of TLS failures (status 0)
            raise ClusterError(f"cannot reach the API server at {self.where}: {short_reason(e.reason)}") from None
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
        error = status_error(status, data, what, self.where)
        error.status = status
        return error

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
            raise StreamBroken(f"the log stream of pod {pod} broke off: {short_reason(e)}") from None
        finally:
            response.release_conn()


