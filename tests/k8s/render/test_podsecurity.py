"""The Pod Security "restricted" check: rendered pods pass; each broken rule is reported."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from kubetrain.config import load_config
from kubetrain.k8s.render.manifest import pod_templates, render
from kubetrain.k8s.render.podsecurity import restricted_violations


def rendered_pod() -> dict[str, Any]:
    job = render(load_config(None, "tiny", []))[-1]
    return copy.deepcopy(pod_templates(job)[0][1]["spec"])


def test_rendered_pod_is_restricted() -> None:
    assert restricted_violations(rendered_pod()) == []


def _c(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["containers"][0]["securityContext"]


BREAKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "hostNetwork": lambda p: p.update(hostNetwork=True),
    "privileged": lambda p: _c(p).update(privileged=True),
    "allowPrivilegeEscalation": lambda p: _c(p).pop("allowPrivilegeEscalation"),
    "drop ALL": lambda p: _c(p).update(capabilities={"drop": ["NET_RAW"]}),
    "adds capability SYS_ADMIN": lambda p: _c(p)["capabilities"].update(add=["SYS_ADMIN"]),
    "runAsNonRoot": lambda p: (_c(p).pop("runAsNonRoot"), p["securityContext"].pop("runAsNonRoot")),
    "runAsUser is 0": lambda p: _c(p).update(runAsUser=0),
    "seccompProfile is unset": lambda p: (_c(p).pop("seccompProfile"),
                                          p["securityContext"].pop("seccompProfile")),
    "Unconfined": lambda p: _c(p).update(seccompProfile={"type": "Unconfined"}),
    "hostPath": lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "hostPort": lambda p: p["containers"][0]["ports"][0].update(hostPort=29500),
    "procMount": lambda p: _c(p).update(procMount="Unmasked"),
    "sysctl": lambda p: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "seLinuxOptions": lambda p: _c(p).update(seLinuxOptions={"type": "spc_t"}),
    "appArmorProfile": lambda p: _c(p).update(appArmorProfile={"type": "Unconfined"}),
}


@pytest.mark.parametrize("rule", list(BREAKS))
def test_each_broken_rule_is_reported(rule: str) -> None:
    pod = rendered_pod()
    BREAKS[rule](pod)
    found = restricted_violations(pod)
    assert any(rule in v for v in found), found


def test_container_may_not_undo_pod_level_non_root() -> None:
    pod = rendered_pod()
    _c(pod)["runAsNonRoot"] = False
    assert any("runAsNonRoot" in v for v in restricted_violations(pod))
