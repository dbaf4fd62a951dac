"""`k8s status`'s preflight line read from the pods' logs: every line the preflight ends or warns with is found."""

from __future__ import annotations

import pytest

from kubetrain.k8s.cluster.preflight_lines import preflight_from_logs


@pytest.mark.parametrize("line", [
    "preflight: rank 2 (pod job-2, node gpu-c): device cuda:2: matmul off by 0.3 (tolerance 0.01)",
    "preflight: link rank 7 (pod job-0, node gpu-a) <-> rank 8 (pod job-1, node gpu-b): send/recv 4.1 GB/s, "
    "median across nodes 44.8 GB/s",
    "preflight: job: all-reduce bus bandwidth 20 GB/s, under the floor 40 GB/s",
    "preflight: not finished within 25 s (dist.preflight.budget_seconds plus its margin): rank 2 (pod job-2, node "
    "gpu-c) does not answer (stopped, or its host is gone), last seen in its all-reduce",
])
def test_the_line_that_stopped_the_job_or_warned_is_the_problem(line: str) -> None:
    stopped = preflight_from_logs({"job-0": [f"error: {line}"]})
    assert stopped is not None and stopped["ok"] is False and stopped["problem"] == line
    warned = preflight_from_logs({"job-0": [f"[rank 0] {line} (dist.preflight.on_failure auto: not certain, "
                                            "training goes on)"]})
    assert warned is not None and warned["problem"] == line
