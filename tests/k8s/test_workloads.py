"""The workloads table: every workload of the config has a row; each controller's pods say their rank."""

from __future__ import annotations

import pytest

from kubetrain.config.k8s import WORKLOADS as CONFIG_WORKLOADS
from kubetrain.k8s.workloads import BY_KIND, WORKLOADS, finished, node_rank


def test_every_workload_of_the_config_has_one_row() -> None:
    assert set(WORKLOADS) == set(CONFIG_WORKLOADS)
    assert len(BY_KIND) == len(WORKLOADS)


def test_finished_reads_each_kinds_conditions() -> None:
    def obj(kind: str, *conditions: str) -> dict[str, object]:
        return {"kind": kind, "status": {"conditions": [{"type": c, "status": "True"} for c in conditions]}}

    assert finished(obj("Job", "SuccessCriteriaMet")) is None  # not over until Complete
    assert finished(obj("Job", "SuccessCriteriaMet", "Complete")) == "succeeded"
    assert finished(obj("Job", "FailureTarget", "Failed")) == "failed"
    assert finished(obj("JobSet", "Completed")) == "succeeded"
    assert finished(obj("PyTorchJob", "Created", "Running")) is None
    assert finished(obj("StatefulSet")) is None


@pytest.mark.parametrize(
    ("labels", "annotations", "name", "rank"),
    [
        (
            {"training.kubeflow.org/replica-type": "master", "training.kubeflow.org/replica-index": "0"},
            {},
            "j-master-0",
            0,
        ),
        (
            {"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "2"},
            {},
            "j-worker-2",
            3,
        ),
        ({}, {"batch.kubernetes.io/job-completion-index": "5"}, "j-5-abcde", 5),
        ({"apps.kubernetes.io/pod-index": "3"}, {}, "j-3", 3),
        ({}, {}, "j-7", 7),
        ({}, {}, "no-ordinal-here", None),
    ],
)
def test_node_rank_of_each_controllers_pods(
    labels: dict[str, str], annotations: dict[str, str], name: str, rank: int | None
) -> None:
    assert node_rank({"metadata": {"name": name, "labels": labels, "annotations": annotations}}) == rank


