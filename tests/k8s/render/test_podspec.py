"""The pod template's GPU-cluster parts: image, extended resources, RDMA opt-ins and the Pod Security level they
leave, NCCL's flight recorder, the compile cache on the claim, emptyDir limits."""

from __future__ import annotations

from typing import Any

import pytest

from kubetrain.config import load_config
from kubetrain.config.schema import Config
from kubetrain.errors import ConfigError
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.manifest import pod_security_note, pod_templates, render
from kubetrain.k8s.render.podsecurity import baseline_violations, level


def tiny(*overrides: str) -> Config:
    return load_config(None, "tiny", list(overrides))


def pod(cfg: Config, workload: str | None = None) -> dict[str, Any]:
    return pod_templates(render(cfg, workload)[-1])[0][1]["spec"]


def env_of(spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}


def test_a_gpu_request_with_the_default_image_gets_the_gpu_build() -> None:
    assert pod(tiny())["containers"][0]["image"] == "ghcr.io/kubetrain/kubetrain:0.1.0"
    gpu = pod(tiny("k8s.resources.gpu=1"))["containers"][0]["image"]
    assert gpu == "ghcr.io/kubetrain/kubetrain:0.1.0-cuda"  # the CPU image would train on the CPU, silently
    amd = pod(tiny("k8s.resources.gpu=1", "k8s.resources.gpu_resource=amd.com/gpu"))["containers"][0]["image"]
    assert amd.endswith(":0.1.0-rocm")
    own = pod(tiny("k8s.resources.gpu=1", "k8s.image=registry.local/kt:1"))["containers"][0]["image"]
    assert own == "registry.local/kt:1"


def test_extended_resources_are_requested_and_limited(crd_schemas: Any) -> None:
    cfg = tiny("k8s.resources.gpu=8", "k8s.nproc_per_node=8",
               'k8s.resources.extra={"rdma/ib": 1, "hugepages-2Mi": "1Gi"}')
    objects = render(cfg, "jobset")
    assert validate.problems(objects, crd_schemas) == []
    res = pod_templates(objects[-1])[0][1]["spec"]["containers"][0]["resources"]
    for part in ("requests", "limits"):
        assert res[part]["rdma/ib"] == 1 and res[part]["hugepages-2Mi"] == "1Gi" and res[part]["nvidia.com/gpu"] == 8


@pytest.mark.parametrize("extra, message", [
    ('{"cpu": 2}', "not an extended resource name"),
    ('{"rdma": 1}', "not an extended resource name"),
    ('{"rdma/ib": "lots"}', "not a quantity"),
    ('{"nvidia.com/gpu": 1}', "already requests"),
])
def test_bad_extended_resources_are_refused(extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny("k8s.resources.gpu=1", f"k8s.resources.extra={extra}")


def test_rdma_opt_ins_and_the_pod_security_level_they_leave(crd_schemas: Any) -> None:
    plain = render(tiny())
    assert level(pod_templates(plain[-1])[0][1]["spec"]) == "restricted" and pod_security_note(plain) is None

    locked = render(tiny("k8s.ipc_lock=true"))
    spec = pod_templates(locked[-1])[0][1]["spec"]
    caps = spec["containers"][0]["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert level(spec) == "privileged" and baseline_violations(spec) == ["container trainer: adds capability IPC_LOCK"]
    note = pod_security_note(locked)
    assert note is not None and "\n" not in note
    assert note.startswith("note: the pods meet Pod Security 'privileged', not 'restricted' (")
    assert "adds capability IPC_LOCK" in note

    for workload in ("indexed-job", "jobset", "statefulset", "pytorchjob"):
        objects = render(tiny("k8s.host_network=true"), workload)
        assert validate.problems(objects, crd_schemas) == [], workload
        spec = pod_templates(objects[-1])[0][1]["spec"]
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert level(spec) == "privileged" and "hostNetwork is true" in (pod_security_note(objects) or "")


def test_a_baseline_level_is_told_apart_from_privileged() -> None:
    spec = pod(tiny())
    spec["containers"][0]["securityContext"]["capabilities"]["add"] = ["NET_BIND_SERVICE", "CHOWN"]
    assert level(spec) == "baseline"  # CHOWN is allowed by baseline, not by restricted


def test_the_flight_recorder_dumps_into_the_run_directory_on_the_claim() -> None:
    env = env_of(pod(tiny("run.name=fr")))
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/checkpoints/fr/incidents/nccl-flight-recorder-rank-"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # torchtitan: mode 1 aborts before the dump
    off = env_of(pod(tiny("k8s.flight_recorder=false")))
    assert not any(name.startswith("TORCH_NCCL_") for name in off)
    mine = env_of(pod(tiny('k8s.env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000"}')))
    assert mine["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "20000"  # k8s.env wins


def test_compiled_kernels_live_on_the_claim_and_empty_dirs_have_limits() -> None:
    spec = pod(tiny("k8s.volumes.checkpoints.mount_path=/ckpt"))
    env = env_of(spec)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/ckpt/.cache/torchinductor"
    assert env["TRITON_CACHE_DIR"] == "/ckpt/.cache/triton"
    sizes = {v["name"]: v["emptyDir"].get("sizeLimit") for v in spec["volumes"] if "emptyDir" in v}
    assert sizes == {"tmp": "8Gi", "cache": "50Gi", "shm": "2Gi"}
    spec = pod(tiny("k8s.volumes.tmp_size=1Gi", "k8s.volumes.cache_size=200Gi"))
    sizes = {v["name"]: v["emptyDir"].get("sizeLimit") for v in spec["volumes"] if "emptyDir" in v}
    assert (sizes["tmp"], sizes["cache"]) == ("1Gi", "200Gi")
