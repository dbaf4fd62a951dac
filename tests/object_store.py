"""A real S3-compatible HTTP server for the object-storage tests (fixtures `s3_endpoint`, `bucket`).

moto's standalone server runs in its own process: s3fs talks to it over HTTP exactly as it talks to AWS or
MinIO; nothing in the process under test is patched.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True  # it answered, with an error status
    except OSError:
        return False
    return True


def start_moto(port: int | None = None, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m moto.server` on `port` (default: a free one); returns once it answers HTTP."""
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    while not _answers(url):  # no deadline of its own: pytest-timeout bounds the test
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}")
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("moto.server")
    proc, url = start_moto()
    yield url
    stop(proc)


@dataclass
class Bucket:
    endpoint: str
    uri: str  # s3://bucket/prefix
    fs: Any  # an s3fs filesystem to look into the bucket from the test

    def path(self, rel: str = "") -> str:
        return f"{self.uri.removeprefix('s3://')}/{rel}".rstrip("/")


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket on the moto server; credentials in this process's environment (and its children's)."""
    import s3fs

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True, use_listings_cache=False)
    name = f"kt-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return Bucket(s3_endpoint, f"s3://{name}/store", fs)
