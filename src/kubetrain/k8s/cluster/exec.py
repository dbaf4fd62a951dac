"""Run a command in a pod's container through the API server and read its stdout as a stream (`kubectl exec`).

The API server speaks WebSocket with the `v5.channel.k8s.io` / `v4.channel.k8s.io` subprotocols: each binary
message starts with one byte that names the channel (1 stdout, 2 stderr, 3 the final metav1.Status: Success, or
Failure with reason NonZeroExitCode and the exit code as its cause). The official client's `stream()` keeps a
copy of everything stdout sent in memory; a multi-gigabyte checkpoint must not be, so the frames are read here,
over the client's own WebSocket connection (its TLS, proxy and credential handling).
"""

from __future__ import annotations

import io
import json
from typing import Any

from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.cluster.api_errors import ClusterError
from kubetrain.k8s.cluster.resources import RESOURCES

STDOUT, STDERR, STATUS = 1, 2, 3
IDLE_SECONDS = 300.0  # a connection that sends nothing for this long is given up


class ExecError(ClusterError):
    """The command ran and failed (its exit code and the end of its stderr), or could not be started."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.command_exit = exit_code


class ExecStream(io.RawIOBase):
    """The command's stdout as a readable binary stream; `finish()` waits for its exit and raises on failure."""

    def __init__(self, socket: Any, what: str) -> None:
        super().__init__()
        self.socket, self.what = socket, what
        self.pending = memoryview(b"")
        self.stderr = bytearray()
        self.status: dict[str, Any] | None = None
        self.ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending and not self.ended:
            self._receive()
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n

    def _receive(self) -> None:
        from websocket import ABNF, WebSocketConnectionClosedException, WebSocketTimeoutException

        try:
            opcode, frame = self.socket.recv_data_frame(True)
        except WebSocketConnectionClosedException:
            opcode, frame = ABNF.OPCODE_CLOSE, None
        except WebSocketTimeoutException:
            raise ClusterError(f"{self.what}: nothing received for {IDLE_SECONDS:g} seconds") from None
        if opcode == ABNF.OPCODE_CLOSE:
            self.ended = True
            return
        data = bytes(frame.data) if opcode in (ABNF.OPCODE_BINARY, ABNF.OPCODE_TEXT) else b""
        if not data:
            return
        channel, payload = data[0], data[1:]
        if channel == STDOUT:
            self.pending = memoryview(payload)
        elif channel == STDERR:
            self.stderr += payload[-4096:]
            del self.stderr[:-4096]
        elif channel == STATUS and payload:
            self.status = json.loads(payload)

    def finish(self) -> None:
        """Drain what is left, then raise ExecError unless the command exited 0."""
        while not self.ended:
            self.pending = memoryview(b"")
            self._receive()
        self.close()
        status = self.status or {}
        if status.get("status") == "Success":
            return
        causes = (status.get("details") or {}).get("causes") or []
        code = next((int(c["message"]) for c in causes if c.get("reason") == "ExitCode"), None)
        tail = self.stderr.decode(errors="replace").strip().splitlines()
        why = tail[-1] if tail else status.get("message") or "the connection closed before the command ended"
        raise ExecError(f"{self.what}: {why}", code)

    def close(self) -> None:
        if not self.closed:
            self.socket.close()
        super().close()


def exec_stream(cluster: Cluster, pod: str, namespace: str, container: str, command: list[str]) -> ExecStream:
    """Start `command` in the container (no stdin, no tty) and return its stdout as a stream."""
    from kubernetes.stream.ws_client import create_websocket, get_websocket_url
    from websocket import WebSocketException

    query = [("container", container), ("stdout", "true"), ("stderr", "true"), ("stdin", "false"),
             ("tty", "false"), *(("command", c) for c in command)]
    url, headers, _ = cluster.prepare("GET", RESOURCES["Pod"].path(namespace, pod, "exec"), query, {})
    what = f"exec in pod {pod} ({container}) on {cluster.where}"
    try:
        socket = create_websocket(cluster.client.configuration, get_websocket_url(url), headers)
    except WebSocketException as e:  # the upgrade was refused: the API server's answer says why
        status = getattr(e, "status_code", None)
        if not status:
            raise ClusterError(f"{what}: {e}") from None
        body = getattr(e, "resp_body", None) or b""
        raise cluster.error(int(status), body if isinstance(body, bytes) else str(body).encode(), what) from None
    except OSError as e:
        raise ClusterError(f"cannot reach the API server at {cluster.where}: {e}") from None
    socket.settimeout(IDLE_SECONDS)
    return ExecStream(socket, what)
