"""A small API server on 127.0.0.1 for the Kubernetes tests.

It is a claim about kube-apiserver and its controllers. Each behaviour below names where the real one does the
same (kubernetes/kubernetes paths), so that a test passing here means something on a cluster. The controllers, the
scheduler and the kubelet are in controllers.py; exec and logs in pod_streams.py; quotas, events, Kueue and access
reviews in waiting_fakes.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from kubetrain.k8s.cluster.resources import RESOURCES
from tests.k8s import waiting_fakes
from tests.k8s.api_answers import JSON, Answer, json_answer, status
from tests.k8s.controllers import KINDS, Controllers, _path_of
from tests.k8s.pod_streams import ConnectionDropped, PodStreams

RESPONSES = Path(__file__).parent / "responses"
# Served by kube-apiserver itself; any other group only once its CRD is installed.
BUILT_IN = {"v1", "batch/v1", "apps/v1", "networking.k8s.io/v1", "storage.k8s.io/v1", "apiextensions.k8s.io/v1",
            "authorization.k8s.io/v1"}


class ApiServer(Controllers, PodStreams):
    """A local HTTP server that answers like kube-apiserver (with the Job and StatefulSet controllers).

    Objects applied (server-side apply) are stored and served back (get, list by label and field, delete with
    garbage collection); a Job or StatefulSet gets its pods, which tests move through their life with `schedule`,
    `start` and `exit`. `answer` pins a recorded response (tests/k8s/responses/) to one request.
    """

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, str] = {}  # pod name -> what its container wrote
        self.previous_logs: dict[str, str] = {}  # pod name -> what its container's previous instance wrote
        self.log_stamps: dict[str, list[int]] = {}  # pod name -> when each line of its log was taken (ns)
        self.previous_stamps: dict[str, list[int]] = {}
        self.break_streams: dict[str, str] = {}  # pod name -> how its followed log breaks off next (break_stream)
        # the container runtime's view, ahead of the pods' status (see Controllers.exit):
        self.stopped: set[str] = set()  # pods whose container ended
        self.instances: dict[str, int] = {}  # pod name -> restarts of its container so far
        self.unreported: dict[str, int] = {}  # pod name -> exit code the kubelet has not reported yet
        self.exit_reasons: dict[str, str] = {}  # pod name -> the runtime's reason for that exit (OOMKilled, Error)
        self.answers: dict[tuple[str, str], Answer] = {}
        self.requests: list[dict[str, Any]] = []
        self.crds: dict[str, dict[str, Any]] = {}
        self.editor_of: str | None = None  # act as a user with the `edit` role in this namespace only
        self.forbidden: set[str] = set()  # plurals that user may not touch even there (e.g. jobsets)
        self.claims: dict[str, Path] = {}  # claim name -> the folder that stands for its volume (exec sees it)
        self.start_bare_pods = False  # a Pod applied on its own is scheduled and started at once
        self.no_node_for_bare_pods: str | None = None  # the scheduler's verdict on a Pod applied on its own
        self.job_controller = True  # False: a slow Job controller that has not synced the Jobs yet (see `sync`)
        self.kueue = False  # Kueue installed: its CRDs served, its webhook suspends a Job with a queue label
        self.changed = threading.Condition()
        self.serial = 0
        # the control plane's troubles (restart, refuse, time_out, and break_stream's "stall" and "kubelet-error"):
        self.generation = 0  # one more each time the server goes down: the streams it served drop
        self.refusing = 0  # requests still to answer 429 (the API server shutting down)
        self.refused = 0  # requests answered so
        self.holding = 0  # requests still to hold unanswered (an API server whose storage does not answer)
        self.connections: set[Any] = set()  # the client connections open now (down() closes them)
        self._serve_on(0)

    # -- what tests set up -------------------------------------------------------------------------

    def answer(self, method: str, path: str, code: int, body: Any, content_type: str = JSON) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.answers[(method, path)] = (code, raw, content_type)

    def recorded(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((RESPONSES / f"{name}.json").read_text())
        return data

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as another client would have created it (a node, a PersistentVolume, ...)."""
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", self._next("uid"))
        obj["metadata"].setdefault("creationTimestamp", self._now())
        with self.changed:
            self.objects[_path_of(obj)] = obj
            self.changed.notify_all()
        return obj

    def kubeconfig(self, folder: Path, namespace: str = "ml") -> Path:
        path = folder / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "alice", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "alice", "namespace": namespace}}],
        }))
        return path

    # -- the control plane's troubles --------------------------------------------------------------

    def down(self) -> None:
        """kube-apiserver stops (a restart, an upgrade): its port refuses connections, and the connections it had
        close. A followed log is a long-running request (the apiserver's LongRunningFunc): the graceful shutdown does
        not wait for it, so its client reads a broken answer, not the end of a log."""
        with self.changed:
            self.generation += 1
            self.changed.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
        for connection in list(self.connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        """kube-apiserver is back on the same address (its state is etcd's: every object is still there)."""
        self._serve_on(int(self.url.rsplit(":", 1)[1]))

    def refuse(self, count: int) -> None:
        """The next `count` requests get what kube-apiserver answers once its shutdown delay has passed
        (staging/src/k8s.io/apiserver/pkg/server/filters/with_retry_after.go, `--shutdown-send-retry-after`): 429,
        `Retry-After: 5`, `Connection: close`, and http.Error's plain text body."""
        self.refusing = count

    def time_out(self, count: int) -> None:
        """The next `count` requests are taken and never answered (an API server waiting on etcd): the client's
        own timeout ends them."""
        self.holding = count

    def _serve_on(self, port: int) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())  # allow_reuse_address: same port
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    # -- HTTP --------------------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                server.connections.add(self.connection)

            def finish(self) -> None:
                server.connections.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def _trouble(self) -> bool:
                """Answered (or not) as a troubled control plane does; False when the request goes on."""
                if server.holding > 0:
                    server.holding -= 1
                    generation = server.generation
                    with server.changed:  # until the server goes down or the test ends; the client gives up first
                        server.changed.wait_for(lambda: server.generation != generation, timeout=30)
                    self.close_connection = True
                    return True
                if server.refusing > 0:
                    server.refusing -= 1
                    server.refused += 1
                    raw = b"The apiserver is shutting down, please try again later.\n"
                    self.send_response(429)
                    for key, value in (("Content-Type", "text/plain; charset=utf-8"), ("Retry-After", "5"),
                                       ("Connection", "close"), ("Content-Length", str(len(raw)))):
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(raw)
                    self.close_connection = True
                    return True
                return False

            def _serve(self) -> None:
                url = urlsplit(self.path)
                if url.path.endswith("/exec") and self.headers.get("Upgrade", "").lower() == "websocket":
                    server.requests.append({"method": self.command, "path": url.path, "query": parse_qs(url.query),
                                            "content_type": None, "authorization": self.headers.get("Authorization"),
                                            "body": None})
                    server._exec(self, url.path.rsplit("/", 2)[-2], parse_qs(url.query))
                    self.close_connection = True
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self._trouble():
                    return
                query = parse_qs(url.query)
                server.requests.append({
                    "method": self.command, "path": url.path, "query": query,
                    "content_type": self.headers.get("Content-Type"),
                    "authorization": self.headers.get("Authorization"),
                    "body": json.loads(body) if body else None,
                })
                answer = server._respond(self.command, url.path, query, body)
                if isinstance(answer, tuple):
                    code, raw, ctype = answer
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                    return
                self.send_response(200)  # a followed log: chunks as the container writes them
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for chunk in answer:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                except (ConnectionDropped, OSError):  # no last chunk: the client reads a broken answer
                    self.close_connection = True
                    return
                self.wfile.write(b"0\r\n\r\n")

            do_GET = do_PATCH = do_DELETE = do_POST = _serve

        return Handler

    def _respond(self, method: str, path: str, query: dict[str, list[str]],
                 body: bytes) -> Answer | Iterator[bytes]:
        if (method, path) in self.answers:
            return self.answers[(method, path)]
        if method == "POST" and path == RESOURCES["SelfSubjectAccessReview"].path():
            # every authenticated user may ask (the system:basic-user ClusterRole, rbac/bootstrappolicy/policy.go)
            return json_answer(201, waiting_fakes.access_review(json.loads(body), self.editor_of, self.forbidden))
        denied = self._rbac(method, path)
        if denied:
            return json_answer(403, denied)
        if path.endswith("/log"):
            return self._log(path.rsplit("/", 2)[-2], query)
        discovered = self._discovery(method, path)
        if discovered:
            return discovered
        if not self._served(path):  # a custom group without its CRD: no handler is installed for it at all
            return json_answer(404, status(404, "NotFound", "the server could not find the requested resource"))
        with self.changed:
            if method == "PATCH":
                return self._apply(path, json.loads(body), "dryRun" in query)
            if method == "GET" and path in self.objects:
                return json_answer(200, self.objects[path])
            if method == "GET" and path.rsplit("/", 1)[-1] in _PLURALS:
                unsupported = waiting_fakes.unsupported_field(path, query.get("fieldSelector", [""])[0])
                if unsupported:
                    return json_answer(400, status(400, "BadRequest", f'field label not supported: {unsupported}'))
                return json_answer(200, {"kind": "List", "items": self._list(path, query)})
            if method == "DELETE" and path in self.objects:
                self._delete(self.objects[path])
                return json_answer(200, {"kind": "Status", "status": "Success"})
        name = path.rsplit("/", 1)[-1]
        return json_answer(404, status(404, "NotFound", f'"{name}" not found'))

    def _rbac(self, method: str, path: str) -> dict[str, Any] | None:
        """plugin/pkg/auth/authorizer/rbac: a RoleBinding grants its namespace only; cluster-scoped kinds
        (Node, StorageClass, PersistentVolume, CRD) and other namespaces are 403 with this message.
        Discovery and /version stay open (the system:discovery role); a namespace may read itself."""
        if self.editor_of is None or path in ("/version", "/api", "/apis"):
            return None
        match = re.fullmatch(r"/apis?/(?:(?P<group>[^/]+)/)?v[^/]*(?P<rest>/.*)?", path)
        if match is None or not match["rest"] or path == f"/api/v1/namespaces/{self.editor_of}":
            return None
        scoped = re.match(r"/namespaces/([^/]+)/([^/]+)", match["rest"])
        plural = scoped[2] if scoped else match["rest"].split("/")[1]
        group = "" if path.startswith("/api/") else match["group"]
        if scoped and scoped[1] == self.editor_of and plural not in self.forbidden:
            return None
        verb = {"PATCH": "patch", "DELETE": "delete"}.get(method, "list" if match["rest"].endswith(plural) else "get")
        where = f'in the namespace "{scoped[1]}"' if scoped else "at the cluster scope"
        what = f"{plural}.{group}" if group else plural
        return status(403, "Forbidden", f'{what} is forbidden: User "alice" cannot {verb} resource "{plural}" in '
                      f'API group "{group}" {where}')

    def _served(self, path: str) -> bool:
        """kube-apiserver serves a custom group/version only once a CRD defines it (apiextensions-apiserver's
        crdHandler): before that, any request under it is 404 'the server could not find the requested resource'."""
        match = re.match(r"/apis/([^/]+/[^/]+)/", path)
        if match is None or match[1] in BUILT_IN:
            return True
        return any(f"{c['spec']['group']}/{v['name']}" == match[1]
                   for c in self.crds.values() for v in c["spec"]["versions"])

    def _discovery(self, method: str, path: str) -> Answer | None:
        """/apis/GROUP/VERSION lists the kinds served; a custom group is served once its CRD is installed."""
        custom = {f"/apis/{c['spec']['group']}/{v['name']}" for c in self.crds.values() for v in c["spec"]["versions"]}
        if method != "GET":
            return None
        if path in custom or any(r.base == path and r.group_version in BUILT_IN for r in KINDS.values()):
            served = [r for r in KINDS.values() if r.base == path]
            return json_answer(200, {"kind": "APIResourceList", "groupVersion": path.split("/", 2)[-1],
                               "resources": [{"name": r.plural, "kind": r.kind, "namespaced": r.namespaced}
                                             for r in served]})
        crd = re.fullmatch(r"/apis/apiextensions\.k8s\.io/v1/customresourcedefinitions/([^/]+)", path)
        if crd:
            if crd[1] in self.crds:
                return json_answer(200, self.crds[crd[1]])
            what = f'customresourcedefinitions.apiextensions.k8s.io "{crd[1]}"'
            return json_answer(404, status(404, "NotFound", f"{what} not found"))
        return None

    def _apply(self, path: str, obj: dict[str, Any], dry_run: bool) -> Answer:
        """Server-side apply by our one field manager (k8s.io/apimachinery/pkg/util/managedfields): the object
        becomes what was applied, so a field the manager set before and leaves out now (ownerReferences
        included) is removed. A no-op apply keeps the resourceVersion. dryRun=All validates, stores nothing."""
        old = self.objects.get(path)
        kind, name = obj["kind"], obj["metadata"]["name"]
        if old is not None and kind == "Job" and old["spec"]["template"] != obj["spec"]["template"]:
            # pkg/apis/batch/validation/validation.go, ValidateJobSpecUpdate
            message = "Invalid value: core.PodTemplateSpec{...}: field is immutable"
            return json_answer(422, status(422, "Invalid", f'Job.batch "{name}" is invalid: spec.template: {message}',
                                     name=name, group="batch", kind="Job",
                                     causes=[{"reason": "FieldValueInvalid", "message": message,
                                              "field": "spec.template"}]))
        new = copy.deepcopy(obj)
        meta = new["metadata"]
        queued = self.kueue and kind == "Job" and waiting_fakes.QUEUE_LABEL in (meta.get("labels") or {})
        if old is None and queued:  # Kueue's Job webhook (jobframework ApplyDefaultForSuspend)
            new["spec"]["suspend"] = True
        if old is None:
            meta.update(uid="" if dry_run else self._next("uid"), creationTimestamp=self._now(),
                        resourceVersion=self._next(""))
        else:
            meta.update({k: old["metadata"][k] for k in ("uid", "creationTimestamp", "resourceVersion")})
            if "status" in old:
                new["status"] = old["status"]
            if _spec_of(old) != _spec_of(new):
                meta["resourceVersion"] = self._next("")
        if not dry_run:
            self.objects[path] = new
            if old is None and kind in ("Job", "StatefulSet"):
                self._reconcile(new)
            if old is None and queued:
                workload = waiting_fakes.kueue_workload(new)
                self.objects[_path_of(workload)] = workload
            if old is None and kind == "Pod":
                self._bare_pod(new)
            self.changed.notify_all()
        return json_answer(201 if old is None else 200, new)

    def _list(self, path: str, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        every_namespace = "/namespaces/" not in path
        selector, fields = query.get("labelSelector", [""])[0], query.get("fieldSelector", [""])[0]
        return [o for p, o in sorted(self.objects.items())
                if (re.sub(r"/namespaces/[^/]+", "", p) if every_namespace else p).rsplit("/", 1)[0] == path
                and _selects(selector, o["metadata"].get("labels") or {}) and waiting_fakes.fields_match(fields, o)]

    def _delete(self, obj: dict[str, Any]) -> None:
        """Background propagation: the garbage collector deletes what the object owns (here at once)."""
        del self.objects[_path_of(obj)]
        uid = obj["metadata"]["uid"]
        for other in list(self.objects.values()):
            if any(r["uid"] == uid for r in other["metadata"].get("ownerReferences") or []):
                self._delete(other)

    def close(self) -> None:
        with self.changed:
            self.generation += 1  # held requests and stalled streams end
            self.changed.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()


_PLURALS = {r.plural for r in KINDS.values()}


def _spec_of(obj: dict[str, Any]) -> Any:
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("resourceVersion", "uid", "creationTimestamp")}
    return {**obj, "metadata": meta, "status": None}


def _selects(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if key not in labels or (value and labels[key] != value):
            return False
    return True
