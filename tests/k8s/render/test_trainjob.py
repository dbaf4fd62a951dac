"""The TrainJob's restarts are its runtime's (docs/kubernetes.md, how each operator restarts a failed pod)."""

from __future__ import annotations

from typing import Any

from kubetrain.config import load_config
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.manifest import render


def test_a_trainjob_cannot_say_how_its_pods_restart(crd_schemas: Any) -> None:
    """What docs/kubernetes.md says of TrainJob: its runtimePatches reach the pod's scheduling, security context,
    volumes and containers only, so the runtime decides restarts; a patch with a restart policy is refused."""
    objects = render(load_config(None, "tiny", []), "trainjob")
    assert validate.problems(objects, crd_schemas) == []
    pod = objects[-1]["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod["template"]["spec"]["template"]["spec"]["restartPolicy"] = "Never"
    assert validate.problems(objects, crd_schemas)
