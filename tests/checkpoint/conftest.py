"""Helpers of the checkpoint tests: a tiny model state with tied weights and one call that saves it; and a real
S3-compatible HTTP server for the object-storage tests (moto's standalone server, in its own process: s3fs talks
to it over HTTP exactly as it talks to AWS or MinIO; nothing in the process under test is patched).
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
from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain import checkpoint


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(16, 8, generator=g)
    return {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(8)}


def save_step(root: Path, step: int, keep_last: int = 2, best: bool = False) -> checkpoint.Checkpoint:
    trainer = {"optimizer": {"state": {}, "param_groups": []}, "step": step, "rng": [torch.get_rng_state()]}
    return checkpoint.save(root, step, tiny_state(step), trainer, {"tokens": step * 10}, keep_last=keep_last,
                           is_best=best)


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


def start_moto(**env: str) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m moto.server` on a free port; returns once it answers HTTP."""
    port = free_port()
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
