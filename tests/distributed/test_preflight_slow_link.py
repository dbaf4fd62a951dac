"""A slow link made real: rank 3 runs in a network namespace of its own, joined to the others by a veth pair whose
rate `tc` (a token bucket) limits, as a pod on a node with a bad NIC would be. The preflight must name rank 3 (its
pod and node) and stop the job before the model is built, with the one line and exit code 71 on every rank.

Needs root (network namespaces, tc); the namespace and the veth pair are the test's own and removed in a finally.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubetrain.distributed.preflight import NODE_NAME_ENV, POD_NAME_ENV, PREFLIGHT_FILE
from kubetrain.errors import EXIT_PREFLIGHT
from tests.conftest import TINY, cli_env

RATE = "100mbit"  # 12.5 MB/s: loopback between the other ranks carries ~1 GB/s, far beyond the 0.5 median cut
HOST_IP, SLOW_IP = "10.213.0.1", "10.213.0.2"


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = f"kt-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _can_make_namespaces(), reason="needs root: ip netns and tc")]


def _ip(*args: str, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, *args], check=True, capture_output=True)


@contextlib.contextmanager
def throttled_namespace(rate: str) -> Iterator[tuple[str, str, str]]:
    """A namespace joined to this one by a veth pair limited to `rate` both ways: (namespace, host end, its end)."""
    tag = f"{os.getpid() % 100000}"
    netns, host_end, slow_end = f"kt-slow-{tag}", f"kt-a{tag}", f"kt-b{tag}"
    try:
        _ip("ip", "netns", "add", netns)
        _ip("ip", "link", "add", host_end, "type", "veth", "peer", "name", slow_end)
        _ip("ip", "link", "set", slow_end, "netns", netns)
        _ip("ip", "addr", "add", f"{HOST_IP}/30", "dev", host_end)
        _ip("ip", "link", "set", host_end, "up")
        _ip("ip", "addr", "add", f"{SLOW_IP}/30", "dev", slow_end, netns=netns)
        _ip("ip", "link", "set", slow_end, "up", netns=netns)
        _ip("ip", "link", "set", "lo", "up", netns=netns)
        shape = ["root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms"]  # netem's rate: not in every kernel
        _ip("tc", "qdisc", "add", "dev", host_end, *shape)
        _ip("tc", "qdisc", "add", "dev", slow_end, *shape, netns=netns)
        yield netns, host_end, slow_end
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)  # takes its peer with it
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST_IP, 0))
        return int(s.getsockname()[1])


@pytest.mark.ci  # minutes of processes together with its peers: .ci/run runs it, not the README's test command
def test_a_throttled_link_names_its_rank_and_node_and_stops_before_training(tmp_path: Path) -> None:
    world = 4
    with throttled_namespace(RATE) as (netns, host_end, slow_end):
        port = _free_port()
        procs = []
        for rank in range(world):
            slow = rank == world - 1
            env = cli_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=HOST_IP, MASTER_PORT=str(port),
                          GLOO_SOCKET_IFNAME=slow_end if slow else host_end,
                          # what a rendered pod's downward API gives it (k8s/render/podspec.py)
                          **{POD_NAME_ENV: f"job-{rank}", NODE_NAME_ENV: "node-slow" if slow else "node-a"})
            sets = [*TINY, f"run.output_dir={tmp_path}", "dist.preflight.budget_seconds=8"]
            command = [sys.executable, "-m", "kubetrain", "train", *(a for s in sets for a in ("--set", s))]
            if slow:
                command = ["ip", "netns", "exec", netns, *command]
            procs.append(subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        try:
            outputs = [p.communicate(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [EXIT_PREFLIGHT] * world, (codes, outputs[0][1][-3000:], outputs[-1][1][-2000:])
    rank0 = outputs[0][1]
    line = next(x for x in rank0.splitlines() if x.startswith("error: preflight:"))
    assert "rank 3 (pod job-3, node node-slow): send/recv" in line, line
    assert "rank 0 (" not in line and "rank 1 (" not in line and "rank 2 (" not in line, line
    assert "step 1" not in rank0 and "model:" not in rank0  # stopped before the model was built
    run = next(tmp_path.rglob(PREFLIGHT_FILE)).parent
    report = json.loads((run / PREFLIGHT_FILE).read_text())
    assert report["verdict"]["named_ranks"] == [3]
    assert report["seconds"] <= 8 * 1.5  # the budget bounds it (the gather and the verdict come on top)
    slow_links = [row for row in report["links"] if 3 in row["ranks"]]
    fast_links = [row for row in report["links"] if 3 not in row["ranks"]]
    assert max(r["bandwidth"] for r in slow_links) <= 100e6 / 8 * 1.1  # the shaped rate, in bytes/s
    assert min(r["bandwidth"] for r in fast_links) > 4 * max(r["bandwidth"] for r in slow_links)
    incidents = [json.loads(f.read_text()) for f in (run / "incidents").glob("*.json")]
    assert [(i["kind"], i["rank"]) for i in incidents] == [("preflight", 3)]
