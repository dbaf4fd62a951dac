"""`k8s doctor`'s GPU memory line: the one estimate per process against the GPUs the nodes say they have."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.config import load_config
from kubetrain.k8s.cluster.gpu_memory import GPU_MEMORY_LABEL, gpu_memory_verdict
from tests.k8s.cluster.test_doctor import cluster, doctor

Cli = Callable[..., tuple[int, str, str]]
EXAMPLE = Path(__file__).parents[3] / "examples" / "k8s" / "c10d-64x8gpu.yaml"


def _node(name: str, mib: int | None) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name, **({GPU_MEMORY_LABEL: str(mib)} if mib else {})}
    return {"metadata": {"name": name, "labels": labels}}


def test_the_64_node_example_fits_80_gb_gpus_and_not_32_gb_ones() -> None:
    cfg = load_config(EXAMPLE)  # 8B parameters, FSDP over 64 x 8 ranks: about 39 GiB per GPU, its CUDA context too
    status, detail = gpu_memory_verdict(cfg, [_node("h100-a", 81559), _node("h100-b", 81559)]) or ("", "")
    assert status == "ok" and detail.startswith("39.9 GiB per process of 512 (fsdp) fits the 79.6 GiB")
    status, detail = gpu_memory_verdict(cfg, [_node("v100-32", 32768)]) or ("", "")
    assert status == "fail" and "more than the 32.0 GiB of the nodes' GPUs" in detail
    status, detail = gpu_memory_verdict(cfg, [_node("v100-32", 32768), _node("h100", 81559)]) or ("", "")
    assert status == "warn" and "GPUs of v100-32 hold" in detail
    assert gpu_memory_verdict(cfg, [_node("unlabelled", None)]) == (
        "ok", "39.9 GiB per process of 512 (fsdp); the nodes do not say their GPUs' memory (label "
        f"{GPU_MEMORY_LABEL})")


def test_cpu_pods_and_the_opt_out_have_no_gpu_line() -> None:
    assert gpu_memory_verdict(load_config(None, "tiny", []), [_node("a", 81559)]) is None
    assert gpu_memory_verdict(load_config(EXAMPLE, None, ["run.check_memory=false"]), [_node("a", 1)]) is None


def test_k8s_doctor_prints_it(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = cluster(tmp_path, apiserver)
    nodes = copy.deepcopy(apiserver.recorded("nodes_homelab"))
    for node in nodes["items"]:
        node["metadata"].setdefault("labels", {})[GPU_MEMORY_LABEL] = "24576"  # an RTX 3090
    apiserver.answer("GET", "/api/v1/nodes", 200, nodes)
    code, out, _ = doctor(cli, kubeconfig)
    assert code == 0, out
    assert any(line.startswith("ok    gpu memory: ") and "fits the 24.0 GiB" in line for line in out.splitlines())
    code, out, _ = doctor(cli, kubeconfig, "model.n_layer=24", "model.n_embd=4096", "model.n_head=32")
    assert code == 1 and "fail  gpu memory: " in out
