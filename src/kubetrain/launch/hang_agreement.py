"""The nodes' hang watches agree on one stuck rank, through the rendezvous host's c10d store (launch/watch.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from kubetrain.launch.watch import STACKS_WAIT_SECONDS

# How long a node with no silent rank waits for the other nodes' verdicts (a loaded node's watch may see the same
# hang seconds later); with the stacks' wait it stays within config.clocks.WATCH_ACTS_WITHIN (15 s).
HEALTHY_NODE_WAIT_SECONDS = 9.0


def strongest(verdicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's suspect among the nodes' verdicts: a rank that did not answer (stopped) before one that advanced
    least, then the lowest step, then the lowest rank."""
    return min(verdicts, key=lambda v: (not v["silent"], v["step"], v["rank"]))


@dataclass
class HangAgreement:
    """The nodes' watches agree on one stuck rank through the rendezvous host's c10d store (not a collective).

    Each node's watch sees only its own ranks: a healthy node whose rank waits in a collective would name it
    ("advanced least") while the stuck rank's node names the stuck one. Every watch that declares a hang
    publishes its verdict under the round's identity (the same on every node, unlike a node's restart count),
    waits up to `wait` for the other nodes' (they see the same hang within a poll of each other: every rank's last
    step ended in the same collective), and the job's suspect is the `strongest`. Only the node that holds it
    records the incident. A node whose watch is slower (a loaded node) finds its ranks already gone, a peer lost:
    `published` tells it the suspect the others agreed on, so its log names the stuck rank all the same. (A round's
    identity is its workers' store address, a port picked for each round: should a later round draw the same port,
    its verdicts would meet the earlier hang's, an unlikely draw.)
    """

    endpoint: str
    rdzv_id: str
    nodes: int
    wait: float = STACKS_WAIT_SECONDS
    _client: list[Any] = field(default_factory=list)

    def _store(self) -> Any:
        if not self._client:
            from datetime import timedelta

            from torch.distributed import TCPStore

            host, _, port = self.endpoint.rpartition(":")
            self._client.append(TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5),
                                         wait_for_workers=False))
        return self._client[0]

    def _prefix(self, round_key: str) -> str:
        return f"kubetrain/hang/{self.rdzv_id}/{round_key}"

    def _verdicts(self, round_key: str) -> list[dict[str, Any]]:
        store, prefix = self._store(), self._prefix(round_key)
        return [json.loads(store.get(f"{prefix}/{i}")) for i in range(1, store.add(f"{prefix}/count", 0) + 1)
                if store.check([f"{prefix}/{i}"])]

    def agree(self, round_key: str, verdict: dict[str, Any]) -> dict[str, Any]:
        """Publish this node's verdict, wait for the others' (bounded), and return the job's suspect."""
        store, prefix = self._store(), self._prefix(round_key)
        index = store.add(f"{prefix}/count", 1)
        store.set(f"{prefix}/{index}", json.dumps(verdict))
        # a node whose ranks all answered (healthy, blocked in a collective) holds no suspect of its own: it waits
        # longer for the node that has one (still within the clocks' WATCH_ACTS_WITHIN), which decides quickly
        deadline = time.monotonic() + (self.wait if verdict["silent"] else max(self.wait, HEALTHY_NODE_WAIT_SECONDS))
        while store.add(f"{prefix}/count", 0) < self.nodes and time.monotonic() < deadline:
            time.sleep(0.1)
        return strongest(self._verdicts(round_key) or [verdict])

    def published(self, round_key: str) -> dict[str, Any] | None:
        """The suspect the other nodes already agreed on for this round (a hang declared there), or None; no wait."""
        found = self._verdicts(round_key)
        return strongest(found) if found else None
