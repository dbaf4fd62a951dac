"""Fixtures of the Kubernetes tests: the CRD schema folder, and a recorded API server on 127.0.0.1."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from kubetrain.k8s.api import RESOURCES

RESPONSES = Path(__file__).parent / "responses"
PLURALS = {r.plural for r in RESOURCES.values()}


@pytest.fixture(scope="session")
def crd_folder() -> Path:
    """The CRD schemas (../shared/k8s/crds); a missing folder fails the test with the places looked at."""
    from kubetrain.k8s.validate import crd_dir

    return crd_dir()


class RecordedApiServer:
    """A local HTTP server that answers like the Kubernetes API server, for the client's real round-trips.

    Objects applied (PATCH) are kept and served back (GET, list with label selectors, DELETE), the way the API
    server does; `answer` pins a recorded response (from tests/k8s/responses/) to one request.
    """

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.answers: dict[tuple[str, str], tuple[int, bytes, str]] = {}
        self.requests: list[dict[str, Any]] = []
        self.uids = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(
        self, method: str, path: str, status: int, body: Any, content_type: str = "application/json"
    ) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.answers[(method, path)] = (status, raw, content_type)

    def recorded(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((RESPONSES / f"{name}.json").read_text())
        return data

    def kubeconfig(self, folder: Path, namespace: str = "ml") -> Path:
        path = folder / "kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "test",
                    "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                    "users": [{"name": "alice", "user": {"token": "test-token"}}],
                    "contexts": [
                        {
                            "name": "test",
                            "context": {"cluster": "test", "user": "alice", "namespace": namespace},
                        }
                    ],
                }
            )
        )
        return path

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _serve(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                server.requests.append(
                    {
                        "method": self.command,
                        "path": url.path,
                        "query": parse_qs(url.query),
                        "content_type": self.headers.get("Content-Type"),
                        "authorization": self.headers.get("Authorization"),
                        "body": json.loads(body) if body else None,
                    }
                )
                status, raw, ctype = server._respond(self.command, url.path, parse_qs(url.query), body)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_PATCH = do_DELETE = do_POST = _serve

        return Handler

    def _respond(
        self, method: str, path: str, query: dict[str, list[str]], body: bytes
    ) -> tuple[int, bytes, str]:
        if (method, path) in self.answers:
            return self.answers[(method, path)]
        if method == "PATCH":
            obj = json.loads(body)
            created = path not in self.objects
            self.uids += created
            old_uid = self.objects.get(path, {}).get("metadata", {}).get("uid")
            obj["metadata"]["uid"] = old_uid or f"uid-{self.uids}"
            if "dryRun" not in query:
                self.objects[path] = obj
            return (201 if created else 200), json.dumps(obj).encode(), "application/json"
        if method == "GET" and path in self.objects:
            return 200, json.dumps(self.objects[path]).encode(), "application/json"
        if method == "GET" and path.rsplit("/", 1)[-1] in PLURALS:  # a collection, in one or all namespaces
            every_namespace = "/namespaces/" not in path
            items = [
                o
                for p, o in self.objects.items()
                if (re.sub(r"/namespaces/[^/]+", "", p) if every_namespace else p).rsplit("/", 1)[0] == path
            ]
            selector = query.get("labelSelector", [""])[0]
            items = [o for o in items if _selects(selector, o["metadata"].get("labels") or {})]
            return 200, json.dumps({"kind": "List", "items": items}).encode(), "application/json"
        if method == "DELETE" and path in self.objects:
            del self.objects[path]
            return 200, json.dumps({"kind": "Status", "status": "Success"}).encode(), "application/json"
        name = path.rsplit("/", 1)[-1]
        return (
            404,
            json.dumps(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "code": 404,
                    "reason": "NotFound",
                    "message": f'"{name}" not found',
                }
            ).encode(),
            "application/json",
        )

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _selects(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if key not in labels or (value and labels[key] != value):
            return False
    return True


@pytest.fixture
def apiserver() -> Iterator[RecordedApiServer]:
    server = RecordedApiServer()
    yield server
    server.close()


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `kubetrain ...` in this process: (exit code, stdout, stderr)."""
    from kubetrain.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run
