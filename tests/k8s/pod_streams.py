"""The test API server's streams from a pod: `pods/NAME/exec` over WebSocket, and `pods/NAME/log` (whole or
followed, current or previous instance, tailLines, sinceTime, timestamps), each as the kubelet serves it."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from tests.k8s.api_answers import Answer, json_answer, status
from tests.k8s.controllers import _path_of


class ConnectionDropped(Exception):
    """A streamed answer's connection drops before its last chunk."""


class PodStreams:
    """Exec and logs of the stored pods; mixed into ApiServer, whose state (and Controllers' pods) it uses."""

    objects: dict[str, dict[str, Any]]
    logs: dict[str, str]
    previous_logs: dict[str, str]
    log_stamps: dict[str, list[int]]
    previous_stamps: dict[str, list[int]]
    break_streams: dict[str, str]
    stopped: set[str]
    instances: dict[str, int]
    claims: dict[str, Path]
    changed: threading.Condition
    generation: int
    pods: Callable[..., list[dict[str, Any]]]
    stamp_lines: Callable[[list[int], str], list[int]]

    def _exec(self, handler: BaseHTTPRequestHandler, name: str, query: dict[str, list[str]]) -> None:
        """`pods/NAME/exec` over WebSocket, as kube-apiserver passes it to the kubelet (pkg/kubelet/cri/streaming/
        remotecommand/websocket.go, exec.go; apimachinery's util/httpstream/wsstream/conn.go):

        - the subprotocol is the first one the client offers that the server speaks (v5 since Kubernetes 1.30,
          then v4.channel.k8s.io); each binary message starts with its channel byte: 1 stdout, 2 stderr, 3 status;
        - an empty message on stdout first says the stream is open; at the end a metav1.Status on channel 3:
          Success, or Failure/NonZeroExitCode with the exit code as an ExitCode cause; then the socket closes;
        - a pod with no node is refused before the upgrade (ExecLocation: "does not have a host assigned").

        The container runtime's part is played by a local process: `python` is this interpreter, and a path under
        one of the container's volume mounts is the folder of that claim in `claims`.
        """
        pod = next((p for p in self.pods() if p["metadata"]["name"] == name), None)
        if pod is None or not pod["spec"].get("nodeName"):
            reason = f'pods "{name}" not found' if pod is None else f"pod {name} does not have a host assigned"
            code, raw, ctype = json_answer(404 if pod is None else 400, status(404 if pod is None else 400,
                                                                           "NotFound" if pod is None else "BadRequest",
                                                                           reason))
            handler.send_response(code)
            handler.send_header("Content-Type", ctype)
            handler.send_header("Content-Length", str(len(raw)))
            handler.end_headers()
            handler.wfile.write(raw)
            return
        offered = [p.strip() for p in handler.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        protocol = next(p for p in offered if p in ("v5.channel.k8s.io", "v4.channel.k8s.io"))
        accept = base64.b64encode(hashlib.sha1(handler.headers["Sec-WebSocket-Key"].encode()
                                               + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()).decode()
        handler.send_response(101)
        for key, value in (("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Accept", accept),
                           ("Sec-WebSocket-Protocol", protocol)):
            handler.send_header(key, value)
        handler.end_headers()
        container = next(c for c in pod["spec"]["containers"] if c["name"] == query["container"][0])
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["mountPath"]: self.claims[volumes[m["name"]]["persistentVolumeClaim"]["claimName"]]
                  for m in container["volumeMounts"] if "persistentVolumeClaim" in volumes[m["name"]]}
        argv = [_in_container(a, mounts) for a in query["command"]]
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        err: list[bytes] = []
        reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        send = handler.wfile.write
        send(_frame(b"\x01"))
        while chunk := proc.stdout.read1(1 << 16):  # type: ignore[union-attr]
            send(_frame(b"\x01" + chunk))
        reader.join()
        code = proc.wait()
        if err[0]:
            send(_frame(b"\x02" + err[0]))
        result: dict[str, Any] = {"metadata": {}, "status": "Success"}
        if code:
            result = {"metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
                      "message": f"command terminated with non-zero exit code: exit status {code}",
                      "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}
        send(_frame(b"\x03" + json.dumps(result).encode()))
        send(_frame(struct.pack("!H", 1000), opcode=8))
        handler.wfile.flush()
        handler.connection.settimeout(10)
        try:  # the client answers the close; then its end of the socket closes
            while handler.connection.recv(4096):
                pass
        except OSError:
            pass

    def _log(self, name: str, query: dict[str, list[str]]) -> Answer | Iterator[bytes]:
        pod = next((p for p in self.pods() if p["metadata"]["name"] == name), None)
        if pod is None:
            return json_answer(404, status(404, "NotFound", f'pods "{name}" not found'))
        if not pod["spec"].get("nodeName"):
            return 200, b"", "text/plain"  # LogLocation (pkg/registry/core/pod/strategy.go): no node, no location
        state = ((pod["status"].get("containerStatuses") or [{}])[0].get("state")) or {}
        if "waiting" in state:  # the kubelet's validateContainerLogStatus (pkg/kubelet/kubelet_pods.go)
            message = (f'container "{pod["spec"]["containers"][0]["name"]}" in pod "{name}" is waiting to start: '
                       f'{state["waiting"]["reason"]}')
            return json_answer(400, status(400, "BadRequest", message))
        previous = query.get("previous") == ["true"]  # the last ended instance, or 400 (validateContainerLogStatus)
        if previous and not (pod["status"]["containerStatuses"][0].get("lastState") or {}).get("terminated"):
            message = (f'previous terminated container "{pod["spec"]["containers"][0]["name"]}" in pod '
                       f'"{name}" not found')
            return json_answer(400, status(400, "BadRequest", message))
        with self.changed:
            text, stamps = self._log_of(name, previous)
        lines = text.splitlines(keepends=True)
        # ReadLogs (pkg/kubelet/kuberuntime/logs/logs.go): tailLines finds where to start, then every line older
        # than sinceTime is skipped; `timestamps` puts the runtime's stamp (RFC3339Nano) and a space before each
        first = max(0, len(lines) - int(query["tailLines"][0])) if "tailLines" in query else 0
        since = _since_ns(query["sinceTime"][0]) if "sinceTime" in query else None
        stamped = query.get("timestamps") == ["true"]

        def shown(line: str, stamp: int) -> bytes:
            if since is not None and stamp < since:
                return b""
            return ((_rfc3339_nano(stamp) + " ") if stamped else "").encode() + line.encode()

        if query.get("follow") != ["true"] or previous:
            return 200, b"".join(shown(lines[i], stamps[i]) for i in range(first, len(lines))), "text/plain"
        return self._follow(pod, name, first, shown)

    def _log_of(self, name: str, previous: bool) -> tuple[str, list[int]]:
        """The log of the container's current (or previous) instance, with the stamps of its lines."""
        text = (self.previous_logs if previous else self.logs).get(name, "")
        stamps = (self.previous_stamps if previous else self.log_stamps).setdefault(name, [])
        return text, self.stamp_lines(stamps, text)  # a test that set `logs` itself: stamped when first read

    def _follow(self, pod: dict[str, Any], name: str, first: int,
                shown: Callable[[str, int], bytes]) -> Iterator[bytes]:
        """A followed log streams the container instance that runs now, until the container runtime says it is not
        running (pkg/kubelet/kuberuntime/logs/logs.go, waitLogs): the pod's status may still say `Running` then.
        Line by line, a last line without its newline only at the end."""
        sent, instance, generation = first, self.instances.get(name, 0), self.generation
        while True:
            with self.changed:
                if self.generation != generation:  # the server went down: this connection is gone
                    raise ConnectionDropped
                restarted = self.instances.get(name, 0) != instance  # its log is now the previous one
                text, stamps = self._log_of(name, restarted)
                ended = (restarted or name in self.stopped or _path_of(pod) not in self.objects
                         or pod["status"].get("phase") in ("Succeeded", "Failed"))
                how = self.break_streams.pop(name, None)
                lines = text.splitlines(keepends=True)
                whole = len(lines) if ended else len([x for x in lines if x.endswith("\n")])
                if whole == sent and not ended and how is None:
                    self.changed.wait(1.0)
                    continue
            if how == "reset":  # at once: what it had not sent is lost to this stream
                raise ConnectionDropped
            if how == "end":
                return
            if how == "stall":  # open and silent until the server goes down (or the client gives up on it)
                with self.changed:
                    self.changed.wait_for(lambda: self.generation != generation, timeout=60)
                raise ConnectionDropped
            if how == "kubelet-error":
                # pkg/kubelet/server/server.go, getContainerLogs: the answer (200, chunked) has begun when ReadLogs
                # fails (pkg/kubelet/kuberuntime/logs/logs.go: waitLogs asks the runtime isContainerRunning, and a
                # runtime that does not answer in time is a gRPC DeadlineExceeded); response.WriteError then writes
                # the error's text into the same body, without a newline or a stamp, and the answer ends.
                yield b"rpc error: code = DeadlineExceeded desc = context deadline exceeded"
                return
            if whole > sent:
                yield b"".join(shown(lines[i], stamps[i]) for i in range(sent, whole))
                sent = whole
            if ended:
                return


def _rfc3339_nano(ns: int) -> str:
    """Go's time.RFC3339Nano in UTC: nanoseconds with trailing zeros dropped (no fraction when it is zero)."""
    seconds, fraction = divmod(ns, 10**9)
    whole = datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return whole + (f".{fraction:09d}".rstrip("0") if fraction else "") + "Z"


def _since_ns(text: str) -> int:
    """sinceTime (metav1.Time, RFC 3339 in whole seconds) in nanoseconds."""
    return int(datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()) * 10**9


def _frame(payload: bytes, opcode: int = 2) -> bytes:
    """One unmasked WebSocket frame from the server (RFC 6455 5.2): FIN, the opcode, the length, the payload."""
    n = len(payload)
    if n < 126:
        length = bytes([n])
    elif n < 1 << 16:
        length = bytes([126]) + struct.pack("!H", n)
    else:
        length = bytes([127]) + struct.pack("!Q", n)
    return bytes([0x80 | opcode]) + length + payload


def _in_container(arg: str, mounts: dict[str, Path]) -> str:
    for mount, folder in mounts.items():
        if arg == mount or arg.startswith(mount + "/"):
            return str(folder) + arg[len(mount):]
    return arg
