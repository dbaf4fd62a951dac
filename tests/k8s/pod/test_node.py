"""Which node a pod is, from the exact variables each workload's controller sets."""

from __future__ import annotations

import pytest

from kubetrain.distributed.env import DEFAULT_MASTER_PORT
from kubetrain.k8s.pod.node import node_env


def test_a_single_process_is_node_0_of_1() -> None:
    n = node_env({})
    assert (n.node_rank, n.nnodes, n.nproc_per_node, n.source) == (0, 1, 1, "single")


def test_kubeflow_pytorchjob_with_pet_variables() -> None:
    # training-operator v1 on a worker pod: RANK/WORLD_SIZE count pods; PET_* are torchrun's settings
    env = {
        "MASTER_ADDR": "llama-lora-master-0", "MASTER_PORT": "23456", "RANK": "1", "WORLD_SIZE": "2",
        "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "llama-lora-master-0", "PET_MASTER_PORT": "23456",
    }
    n = node_env(env)
    assert (n.node_rank, n.nnodes, n.nproc_per_node, n.source) == (1, 2, 1, "pytorchjob")
    assert (n.master_addr, n.master_port) == ("llama-lora-master-0", 23456)


def test_kubeflow_pytorchjob_without_pet_variables() -> None:
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "RANK": "0", "WORLD_SIZE": "3"}
    n = node_env(env)
    assert (n.node_rank, n.nnodes, n.master_addr, n.source) == (0, 3, "job-master-0", "pytorchjob")


def test_kubeflow_trainer_v2() -> None:
    env = {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "3",
           "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29400"}
    n = node_env(env)
    assert (n.node_rank, n.nnodes, n.nproc_per_node, n.source) == (3, 4, 8, "trainjob")
    assert (n.master_addr, n.master_port) == ("tj-node-0-0.tj", 29400)


def test_indexed_job() -> None:
    env = {"JOB_COMPLETION_INDEX": "2", "KUBETRAIN_NNODES": "4", "KUBETRAIN_NPROC_PER_NODE": "2",
           "KUBETRAIN_MASTER_ADDR": "train-0.train"}
    n = node_env(env)
    assert (n.node_rank, n.nnodes, n.nproc_per_node, n.master_addr, n.source) == (2, 4, 2, "train-0.train",
                                                                                   "indexed-job")
    assert n.master_port == DEFAULT_MASTER_PORT


def test_statefulset_ordinal_from_hostname() -> None:
    env = {"HOSTNAME": "trainer-63", "KUBETRAIN_STATEFULSET": "1", "KUBETRAIN_NNODES": "64",
           "KUBETRAIN_MASTER_ADDR": "trainer-0.trainer"}
    n = node_env(env)
    assert (n.node_rank, n.nnodes, n.source) == (63, 64, "statefulset")
    with pytest.raises(ValueError, match="ordinal"):
        node_env({"HOSTNAME": "trainer", "KUBETRAIN_STATEFULSET": "1"})


def test_jobset_job_index_from_downward_api() -> None:
    # one replicated job of 2 Jobs x 2 pods: job index 1, completion index 1 -> node 3
    env = {"JOBSET_JOB_INDEX": "1", "JOB_COMPLETION_INDEX": "1", "KUBETRAIN_PODS_PER_JOB": "2",
           "KUBETRAIN_NNODES": "4", "KUBETRAIN_MASTER_ADDR": "js-workers-0-0.js"}
    n = node_env(env)
    assert (n.node_rank, n.nnodes, n.source) == (3, 4, "jobset")


def test_a_rank_outside_the_job_is_clear() -> None:
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        node_env({"JOB_COMPLETION_INDEX": "5", "KUBETRAIN_NNODES": "2"})
