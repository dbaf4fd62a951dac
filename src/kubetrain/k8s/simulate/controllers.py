"""What each workload's controller gives its pods: their names, the container they run, the environment it sets
(an Indexed Job's completion index, a PyTorchJob's RANK/WORLD_SIZE, a TrainJob's PET_*), and which exits its
podFailurePolicy ignores."""

from __future__ import annotations

import os
import re
import socket
from typing import Any

from kubetrain.config.k8s import RESERVED_ENV, K8sConfig
from kubetrain.k8s.render.manifest import pod_templates
from kubetrain.k8s.render.trainjob import RUNTIME_PORT
from kubetrain.k8s.simulate.network import LOOPBACK

# Variables of this machine that would confuse a simulated pod: those kubetrain, the launcher or the controller
# set (config.k8s.RESERVED_ENV), and the few more a controller gives a pod.
FOREIGN_ENV = re.compile(rf"{RESERVED_ENV.pattern}|^(HOSTNAME|JOBSET_.*)$")


def main_container(workload_obj: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """The pod's training container as it runs: a TrainJob's runtime takes command, args and env from spec.trainer."""
    main = dict(template["spec"]["containers"][0])
    if workload_obj["kind"] == "TrainJob":
        trainer = workload_obj["spec"]["trainer"]
        main.update(command=trainer["command"], args=trainer["args"], env=trainer["env"])
    return main


def pod_names(workload_obj: dict[str, Any], nnodes: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(pod name, DNS name, template) per node rank, named as the controller names them."""
    kind, name = workload_obj["kind"], workload_obj["metadata"]["name"]
    templates = dict(pod_templates(workload_obj))
    if kind == "PyTorchJob":
        return [(f"{name}-master-0", f"{name}-master-0", templates["master"])] + [
            (f"{name}-worker-{i}", f"{name}-worker-{i}", templates["worker"]) for i in range(nnodes - 1)
        ]
    if kind in ("JobSet", "TrainJob"):
        return [(f"{name}-node-0-{i}", f"{name}-node-0-{i}.{name}", templates["node"]) for i in range(nnodes)]
    return [(f"{name}-{i}", f"{name}-{i}.{name}", templates["node"]) for i in range(nnodes)]


def controller_env(kind: str, name: str, k: K8sConfig, rank: int, pod_name: str) -> dict[str, str]:
    """The variables the controller of `kind` sets in the pod of node rank `rank`."""
    env = {"HOSTNAME": pod_name}
    if kind in ("Job", "JobSet", "TrainJob"):
        env["JOB_COMPLETION_INDEX"] = str(rank)
    if kind == "PyTorchJob":
        # training-operator v1.9: WORLD_SIZE counts processes, RANK is the node's (master 0, worker i+1)
        env.update(MASTER_ADDR=f"{name}-master-0", MASTER_PORT=str(k.rdzv_port),
                   WORLD_SIZE=str(k.nnodes * k.nproc_per_node), RANK=str(rank),
                   PET_NODE_RANK=str(rank), PET_NNODES=str(k.nnodes),
                   PET_NPROC_PER_NODE=str(k.nproc_per_node), PYTHONUNBUFFERED="0")
    if kind == "TrainJob":
        env.update(PET_NNODES=str(k.nnodes), PET_NPROC_PER_NODE=str(k.nproc_per_node),
                   PET_NODE_RANK=str(rank), PET_MASTER_ADDR=f"{name}-node-0-0.{name}",
                   PET_MASTER_PORT=str(RUNTIME_PORT))
    return env


def env_value(item: dict[str, Any], pod_name: str) -> str | None:
    """The value of one `env` item of the container on this host (None: the cluster would set nothing here)."""
    if "value" in item:
        return str(item["value"])
    source = item.get("valueFrom", {})
    field_path = source.get("fieldRef", {}).get("fieldPath", "")
    if field_path == "status.podIP":
        return LOOPBACK
    if field_path in ("metadata.name", "spec.nodeName"):  # every simulated pod runs on this one node
        return pod_name if field_path == "metadata.name" else socket.gethostname()
    if "jobset.sigs.k8s.io/job-index" in field_path:
        return "0"  # one replicated job
    if "secretKeyRef" in source:  # a Secret of the cluster: this machine's variable of that name, if any
        return os.environ.get(item["name"])
    return None


def ignored_exit_codes(workload_obj: dict[str, Any]) -> set[int]:
    """The exit codes of the rendered Job's podFailurePolicy `Ignore` rules (a JobSet's Jobs have it too)."""
    jobs = [workload_obj] if workload_obj["kind"] == "Job" else [
        j.get("template", {}) for j in workload_obj["spec"].get("replicatedJobs", [])]
    policies = [(j.get("spec") or {}).get("podFailurePolicy") or {} for j in jobs]
    return {code for policy in policies for rule in policy.get("rules", [])
            if rule["action"] == "Ignore" and (rule.get("onExitCodes") or {}).get("operator") == "In"
            for code in rule["onExitCodes"]["values"]}
