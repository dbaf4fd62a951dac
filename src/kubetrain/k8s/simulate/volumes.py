"""The pods' volumes as local folders: each claim one folder shared by the pods (a folder of the user's with
`--volume NAME=PATH`, else an empty one of the simulation), and the paths of the config mapped onto them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError
from kubetrain.k8s.render.context import CONFIG_FILE
from kubetrain.k8s.render.manifest import pod_templates


def map_path(value: str, mounts: dict[str, Path]) -> str:
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount + "/"):
            return str(mounts[mount]) + value[len(mount):]
    return value


def _map_tree(value: Any, mounts: dict[str, Path]) -> Any:
    if isinstance(value, dict):
        return {k: _map_tree(v, mounts) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tree(v, mounts) for v in value]
    return map_path(value, mounts) if isinstance(value, str) else value


_INPUT_KEYS = ("path", "name_or_path")  # config keys whose value the training reads (data, tokenizer, model)


def _inputs(value: Any, key: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) of every input path in a config (data.sources.0.path, model.name_or_path, ...)."""
    if isinstance(value, dict):
        return [found for k, v in value.items() for found in _inputs(v, f"{key}.{k}" if key else str(k))]
    if isinstance(value, list):
        return [found for i, v in enumerate(value) for found in _inputs(v, f"{key}.{i}")]
    if isinstance(value, str) and key.rsplit(".", 1)[-1] in _INPUT_KEYS and value.startswith("/"):
        return [(key, value)]
    return []


def claims(workload_obj: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(volume name, claim name, mount path) of each claim the pods mount."""
    template = pod_templates(workload_obj)[0][1]
    claim_of = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]
                if "persistentVolumeClaim" in v}
    return [(m["name"], claim_of[m["name"]], m["mountPath"])
            for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] in claim_of]


def shared_mounts(workload_obj: dict[str, Any], bound: dict[str, Path], root: Path) -> dict[str, Path]:
    """The claims, one local folder each, shared by all pods: the folder bound with --volume, else an empty
    one of the simulation (one per claim: a claim mounted twice is one folder)."""
    found = claims(workload_obj)
    known = {n for volume, claim, _ in found for n in (volume, claim)}
    unknown = sorted(set(bound) - known)
    if unknown:
        raise UserInputError(f"--volume {unknown[0]}=...: the pods mount no claim or volume of that name "
                             f"(they mount: {', '.join(sorted(known)) or 'none'})")
    mounts: dict[str, Path] = {}
    folders: dict[str, Path] = {}
    for volume, claim, mount_path in found:
        given = bound.get(volume) or bound.get(claim)
        if given is not None and not given.is_dir():
            raise UserInputError(f"--volume {volume}={given}: not a folder")
        folder = folders.setdefault(claim, given or root / "volumes" / volume)
        folder.mkdir(parents=True, exist_ok=True)
        mounts[mount_path] = folder
    return mounts


def _config_map_data(objects: list[dict[str, Any]]) -> Any:
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    return yaml.safe_load(config_map["data"][CONFIG_FILE])


def check_inputs(objects: list[dict[str, Any]], bound: dict[str, Path], shared: dict[str, Path]) -> None:
    """Refuse, naming the claim and the flag, an input of the config that lies on a claim where nothing is
    (an unbound claim is an empty folder): the pods would fail one by one with "not found"."""
    for key, value in _inputs(_config_map_data(objects)):
        for volume, claim, mount_path in claims(objects[-1]):
            if not (value == mount_path or value.startswith(mount_path + "/")):
                continue
            local = map_path(value, shared)
            if not any(Path("/").glob(local.lstrip("/"))) and not Path(local).exists():
                where = ("the folder bound to it" if volume in bound or claim in bound
                         else "an empty folder of the simulation")
                raise UserInputError(
                    f"{key} ({value}) is on the claim '{claim}' (volume {volume}, mounted at {mount_path}), "
                    f"which the simulation maps to {where} ({shared[mount_path]}), where it is not found: "
                    f"bind a local folder holding it with --volume {volume}=PATH")


def write_config(objects: list[dict[str, Any]], cfg: Config, folder: Path, mounts: dict[str, Path],
                 ports: dict[str | int, int]) -> Path:
    """A pod's copy of the ConfigMap: paths mapped to the pod's folders, its own metrics port."""
    raw = _map_tree(_config_map_data(objects), mounts)
    prometheus = (raw.get("track") or {}).get("prometheus")
    if prometheus and cfg.k8s.metrics.port in ports:
        prometheus["port"] = ports[cfg.k8s.metrics.port]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CONFIG_FILE
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return path
