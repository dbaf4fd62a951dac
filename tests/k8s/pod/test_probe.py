"""The liveness probe against a real HTTP /healthz endpoint."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from kubetrain.k8s.pod import probe


class Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = 200 if self.path == "/healthz" and Health.status == 200 else Health.status
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"ok" if code == 200 else b"heartbeat stale for 600s")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    httpd = HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_healthy_and_stale(server: int) -> None:
    Health.status = 200
    assert probe.check(server)[0] is True
    Health.status = 503
    alive, why = probe.check(server)
    assert alive is False and "503" in why and "heartbeat stale" in why


def test_not_served_in_this_pod_passes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert probe.check(port) == (True, f"http://127.0.0.1:{port}/healthz: not served in this pod")


def test_exit_codes_as_the_kubelet_sees_them(server: int) -> None:
    Health.status = 503
    done = subprocess.run([sys.executable, "-m", "kubetrain.k8s.pod.probe", "--port", str(server)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "503" in done.stderr
    Health.status = 200
    assert probe.main(["--port", str(server)]) == 0
