"""A local HTTPS server that answers like Kubeflow Trainer's TrainJob status server, for the sink's tests.

Written from kubeflow/trainer (commit 008666ed and the versions before it that the index holds):
- pkg/statusserver/server.go: one route, `POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/
  trainjobs/{name}/status`; anything else is 404 "Not found". Bodies over 64 KiB are 413 "Payload too large"
  (bodySizeLimitMiddleware). A body that does not decode into UpdateTrainJobStatusRequest is 422 "Invalid
  payload" (Go's decoder: a wrong JSON type, 45.0 for an int32, a time that is not RFC 3339, trailing data per
  server_test.go); unknown fields are ignored, as encoding/json does. No trainerStatus: 200, nothing applied.
  Otherwise the status is applied to the TrainJob, whose CRD validation failures come back as 422 with the API
  server's message; 200 answers with the parsed payload re-encoded. Errors are metav1.Status JSON.
- pkg/statusserver/auth.go: `Authorization: Bearer <token>`, where the token must be a projected service-account
  token whose audience names this TrainJob (`trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs/{name}/
  status`); anything else is 403 "Forbidden". Here a token is a random string issued for one TrainJob.
- pkg/apis/trainer/v1alpha1/trainjob_types.go: the TrainerStatus fields and their limits.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import secrets
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ROUTE = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs/([^/]+)/status$")
MAX_BODY = 1 << 16
MAX_PROGRESS, MAX_METRICS, MAX_TEXT = 100, 256, 64  # checked against the CRD copy by test_kubeflow_trainer.py
NO_TIME = "lastUpdatedTime is required when trainerStatus is present"  # the CRD's CEL rule's message
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
INT32_MAX = 2**31 - 1


class InvalidPayload(Exception):
    """The body does not decode into the Go request type (422 "Invalid payload")."""


class Invalid(Exception):
    """The API server's CRD validation refused the status (422 with its message)."""


def _int32(value: Any) -> int:
    if type(value) is not int or not -(2**31) <= value <= INT32_MAX:  # Go refuses 45.0, "45", true
        raise InvalidPayload
    return value


def decode(body: bytes) -> dict[str, Any] | None:
    """UpdateTrainJobStatusRequest as Go's encoding/json reads it: the trainerStatus, or None."""
    try:
        request = json.loads(body)  # one JSON value; trailing data raises, as the server's decoder does
    except (ValueError, UnicodeDecodeError):
        raise InvalidPayload from None
    if not isinstance(request, dict):
        raise InvalidPayload
    status = request.get("trainerStatus")
    if status is None:
        return None
    if not isinstance(status, dict):
        raise InvalidPayload
    out: dict[str, Any] = {}
    for key in ("progressPercentage", "estimatedRemainingSeconds"):
        if status.get(key) is not None:
            out[key] = _int32(status[key])
    metrics = status.get("metrics")
    if metrics is not None:
        if not isinstance(metrics, list):
            raise InvalidPayload
        out["metrics"] = []
        for m in metrics:
            if not isinstance(m, dict) or not all(isinstance(m.get(k, ""), str) for k in ("name", "value")):
                raise InvalidPayload
            out["metrics"].append({"name": m.get("name", ""), "value": m.get("value", "")})
    when = status.get("lastUpdatedTime")
    if when is not None:
        if not isinstance(when, str) or not RFC3339.match(when):
            raise InvalidPayload
        out["lastUpdatedTime"] = when
    return out


def validate(status: dict[str, Any]) -> None:
    """The CRD's rules for status.trainerStatus, which the API server applies when the server writes it."""
    if "lastUpdatedTime" not in status:
        raise Invalid(NO_TIME)
    if not 0 <= status.get("progressPercentage", 0) <= MAX_PROGRESS:
        raise Invalid(f"status.trainerStatus.progressPercentage: must be between 0 and {MAX_PROGRESS}")
    if status.get("estimatedRemainingSeconds", 0) < 0:
        raise Invalid("status.trainerStatus.estimatedRemainingSeconds: must be >= 0")
    metrics = status.get("metrics", [])
    if len(metrics) > MAX_METRICS:
        raise Invalid(f"status.trainerStatus.metrics: must have at most {MAX_METRICS} items")
    for m in metrics:
        for key in ("name", "value"):
            if not 1 <= len(m[key]) <= MAX_TEXT:
                raise Invalid(f"status.trainerStatus.metrics.{key}: length must be between 1 and {MAX_TEXT}")


@dataclass
class StatusServer:
    """The server, its CA file, the token it issued for one TrainJob, and what it accepted (in order)."""

    url: str
    ca_file: Path
    token: str
    accepted: list[dict[str, Any]] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)  # every request's status code

    def env(self, token_file: Path) -> dict[str, str]:
        """The variables the controller's TrainJobStatus plugin injects."""
        token_file.write_text(self.token, encoding="utf-8")
        return {"KUBEFLOW_TRAINER_SERVER_URL": self.url, "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(self.ca_file),
                "KUBEFLOW_TRAINER_SERVER_TOKEN": str(token_file)}


def make_ca(folder: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path]:
    """A self-signed CA (key, certificate, PEM file), as the controller's cert rotator makes one."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    path = folder / f"{name}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def _server_cert(folder: Path, ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubeflow-trainer-controller-manager")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_file, key_file = folder / "server.crt", folder / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def _handler(server: StatusServer, namespace: str, name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def answer(self, code: int, body: dict[str, Any]) -> None:
            server.answers.append(code)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def fail(self, code: int, message: str, reason: str) -> None:
            self.answer(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                               "message": message, "reason": reason, "code": code})

        def do_GET(self) -> None:
            self.fail(404, "Not found", "NotFound")

        def do_POST(self) -> None:
            route = ROUTE.match(self.path)
            if route is None:
                return self.fail(404, "Not found", "NotFound")
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                return self.fail(413, "Payload too large", "RequestEntityTooLarge")
            body = self.rfile.read(length)
            auth = (self.headers.get("Authorization") or "").split(" ")
            # the token's audience names one TrainJob: a request for another one is forbidden too
            if auth != ["Bearer", server.token] or route.groups() != (namespace, name):
                return self.fail(403, "Forbidden", "Forbidden")
            try:
                status = decode(body)
                if status is not None:
                    validate(status)
            except InvalidPayload:
                return self.fail(422, "Invalid payload", "Invalid")
            except Invalid as e:
                return self.fail(422, str(e), "Invalid")
            if status is not None:
                server.accepted.append(status)
            self.answer(200, {"trainerStatus": status} if status is not None else {})

        def log_message(self, format: str, *args: Any) -> None:  # quiet, like the real one at V(0)
            pass

    return Handler


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that refuses our certificate ends the handshake: that is a test case, not an error


def serve(folder: Path, namespace: str = "default", name: str = "tiny") -> tuple[StatusServer, ThreadingHTTPServer]:
    """Start the server on a free loopback port; stop it with .shutdown() and .server_close()."""
    ca_key, ca, ca_file = make_ca(folder, "kubeflow-trainer-ca")
    cert_file, key_file = _server_cert(folder, ca_key, ca)
    httpd = _Quiet(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = httpd.server_address[1]
    state = StatusServer(f"https://localhost:{port}/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/"
                         f"trainjobs/{name}/status", ca_file, secrets.token_urlsafe(24))
    httpd.RequestHandlerClass = _handler(state, namespace, name)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return state, httpd
