"""The images (deploy/docker; no Docker engine here to build them): non-root, the uid the pods run as,
and every path they write under the writable mounts the pod template provides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kubetrain.config import load_config
from kubetrain.k8s.render.manifest import pod_templates, render

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"


def final_stage(path: Path) -> str:
    return re.split(r"^FROM ", path.read_text(), flags=re.MULTILINE)[-1]


def env_of(stage: str) -> dict[str, str]:
    block = re.search(r"^ENV (.*?)(?=^\S)", stage, flags=re.MULTILINE | re.DOTALL)
    assert block is not None
    return dict(re.findall(r"(\w+)=(\S+)", block.group(1)))


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_image_runs_as_the_pods_non_root_user_on_a_read_only_root(name: str) -> None:
    stage = final_stage(DOCKER / name)
    users = re.findall(r"^USER (\d+):(\d+)$", stage, flags=re.MULTILINE)
    cfg = load_config(None, "tiny", [])
    assert users == [(str(cfg.k8s.run_as_user), str(cfg.k8s.run_as_user))]
    assert re.search(r'^ENTRYPOINT \["kubetrain"\]$', stage, flags=re.MULTILINE)
    template = pod_templates(render(cfg)[-1])[0][1]
    volume_mounts = template["spec"]["containers"][0]["volumeMounts"]
    mounts = [m["mountPath"] for m in volume_mounts if not m.get("readOnly")]
    for key, value in env_of(stage).items():
        if value.startswith("/") and key != "PATH":
            assert any(value == m or value.startswith(m + "/") for m in mounts), (name, key, value)
    assert (DOCKER / f"{name}.dockerignore").read_text().count("!src/") == 1


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_image_installs_object_storage_trackers_and_leaves_gpu_visibility_to_the_device_plugin(name: str) -> None:
    text = (DOCKER / name).read_text()
    extras = re.search(r'pip install "\.\[([a-z0-9,]+)\]"', text)
    assert extras is not None
    # checkpoint.uri needs s3fs; track.mlflow/tensorboard and track.wandb each stop a pod with exit 2 without theirs
    assert {"storage", "track", "wandb"} <= set(extras.group(1).split(","))
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(final_stage(DOCKER / name))
