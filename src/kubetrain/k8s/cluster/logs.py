"""The logs of every rank of a job, interleaved as they arrive, each line prefixed with its rank."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from kubetrain.k8s.cluster.api import Cluster, ClusterError
from kubetrain.k8s.cluster.status import main_container, pods_by_rank

Emit = Callable[[str], None]
_DONE = object()


def stream_logs(
    cluster: Cluster,
    name: str,
    namespace: str,
    *,
    follow: bool = False,
    rank: int | None = None,
    tail: int | None = None,
    emit: Emit = print,
) -> int:
    """Print the pods' logs line by line (one reader per pod); returns how many pods were read."""
    pods = [(r, p) for r, p in pods_by_rank(cluster, name, namespace) if rank is None or r == rank]
    if not pods:
        which = f" with rank {rank}" if rank is not None else ""
        raise ClusterError(f"no pods{which} of job '{name}' in namespace {namespace} on {cluster.where}")
    lines: queue.Queue[Any] = queue.Queue(maxsize=1000)

    def read(node: int | None, pod: dict[str, Any]) -> None:
        prefix = f"[rank {'?' if node is None else node}] "
        try:
            for line in cluster.log_lines(
                pod["metadata"]["name"], namespace, main_container(pod), follow=follow, tail=tail
            ):
                lines.put(prefix + line)
        except ClusterError as e:
            lines.put(e)
        finally:
            lines.put(_DONE)

    for node, pod in pods:
        threading.Thread(target=read, args=(node, pod), daemon=True).start()
    open_streams, error = len(pods), None
    while open_streams:
        item = lines.get()
        if item is _DONE:
            open_streams -= 1
        elif isinstance(item, ClusterError):
            error = error or item
        else:
            emit(item)
    if error is not None:
        raise error
    return len(pods)
