"""`kubetrain k8s backup NAME URI`: a job's run directory from its claim to object storage, verified on the way.

Two legs, each the tested path that already exists: `k8s fetch` copies the run directory from the claim to a
local folder (only what changed; checkpoints whole and verified against their checksums, or not kept), then
`runs sync` pushes that folder to URI/<run.name> (only files the store lacks or holds with another checksum;
checkpoint meta.json after its files, `latest`/`best` last; nothing at the destination is ever deleted).
The local folder is kept, so the next backup copies only what changed on both legs; `kubetrain runs sync
URI/<run.name> DIR` brings the run back anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kubetrain.checkpoint.store import open_store
from kubetrain.checkpoint.sync import SyncResult, push
from kubetrain.config.schema import Config
from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.fetch.pods import fetch_job, job_config
from kubetrain.k8s.fetch.transfer import FetchResult

Log = Callable[[str], None]


@dataclass
class BackupResult:
    local: Path  # the verified local copy the push read from
    destination: str
    fetched: FetchResult
    pushed: SyncResult


def backup_job(cluster: Cluster, name: str, namespace: str, uri: str, *, via: Path | None = None,
               checkpoints: str = "all", endpoint_url: str | None = None, given: Config | None = None,
               log: Log | None = None) -> BackupResult:
    """Fetch job `name`'s run directory (verified) into `via`, then push it to URI/<run.name>.

    Checkpoints that failed their checksums were not kept by the fetch, so they are never pushed; the caller
    says so (exit 1) after everything that verified is in the store.
    """
    say = log or (lambda _line: None)
    cfg = job_config(cluster, name, namespace, given)
    destination = f"{uri.rstrip('/')}/{cfg.run.name}"
    store = open_store(destination, endpoint_url or cfg.checkpoint.endpoint_url)  # a bad URI stops us here
    local, fetched = fetch_job(cluster, name, namespace, via, checkpoints, given, log=say)
    say(f"{local}: {len(fetched.copied)} files fetched, {fetched.unchanged} unchanged; pushing to {destination}")
    pushed = push(local, store)
    return BackupResult(local, destination, fetched, pushed)
