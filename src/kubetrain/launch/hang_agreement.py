"""The nodes' hang watches agree on one stuck rank, through the rendezvous host's c10d store (launch/watch.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from kubetrain.launch.watch import STACKS_WAIT_SECONDS

# How long a node with no silent rank waits for the other nodes' verdicts (a loaded node's watch may see the same
# hang seconds later); with the stacks' wait it stays within config.clocks.WATCH_ACTS_WITHIN (15 s).
HEALTHY_NODE_WAIT_SECONDS = 9.0


def hang_agreement(endpoint: str, rdzv_id: str, nodes: int, wait: float = STACKS_WAIT_SECONDS
                   ) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    """The nodes' watches agree on one stuck rank through the rendezvous host's c10d store (not a collective).

    Each node's watch sees only its own ranks: a healthy node whose rank waits in a collective would name it
    ("advanced least") while the stuck rank's node names the stuck one. Every watch that declares a hang
    publishes its verdict under the round's identity (the same on every node, unlike a node's restart count),
    waits up to `wait` for the other nodes' (they see the same hang within a poll of each other: every rank's last
    step ended in the same collective), and the job's suspect is the strongest: a rank that did not answer
    (stopped) before one that advanced least, then the lowest step, then the lowest rank. Only the node that holds
    it records the incident. (A round's identity is its workers' store address, a port picked for each round:
    should a later round draw the same port, its verdicts would meet the earlier hang's, an unlikely draw.)
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    client: list[Any] = []

    def agree(round_key: str, verdict: dict[str, Any]) -> dict[str, Any]:
        if not client:
            client.append(TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5),
                                   wait_for_workers=False))
        store = client[0]
        prefix = f"kubetrain/hang/{rdzv_id}/{round_key}"
        index = store.add(f"{prefix}/count", 1)
        store.set(f"{prefix}/{index}", json.dumps(verdict))
        # a node whose ranks all answered (healthy, blocked in a collective) holds no suspect of its own: it waits
        # longer for the node that has one (still within the clocks' WATCH_ACTS_WITHIN), which decides quickly
        deadline = time.monotonic() + (wait if verdict["silent"] else max(wait, HEALTHY_NODE_WAIT_SECONDS))
        while store.add(f"{prefix}/count", 0) < nodes and time.monotonic() < deadline:
            time.sleep(0.1)
        found = []
        for i in range(1, store.add(f"{prefix}/count", 0) + 1):
            if store.check([f"{prefix}/{i}"]):
                found.append(json.loads(store.get(f"{prefix}/{i}")))
        return min(found or [verdict], key=lambda v: (not v["silent"], v["step"], v["rank"]))

    return agree
