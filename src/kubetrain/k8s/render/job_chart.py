"""`kubetrain k8s render CONFIG --format helm -o DIR`: the job as a Helm chart (helm.py says how it is made).

values.yaml lifts what a GitOps user changes per environment: namespace, image, node count, resources, the
Secrets' names and the tracking URI. The config the pods read stays kubetrain's own ConfigMap, with the same
names and labels, so `kubetrain k8s status/logs/stop/fetch NAME` work on a release that Helm (or Argo CD, Flux)
installed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.config.loading import validate as validate_config
from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError
from kubetrain.k8s.render.context import job_name
from kubetrain.k8s.render.grace import MeasuredSave
from kubetrain.k8s.render.helm import Value, Variant, lift
from kubetrain.k8s.render.helm_chart import write_chart
from kubetrain.k8s.render.manifest import render
from kubetrain.k8s.render.podspec import TOLERATION_FIELDS, image, pod_toleration
from kubetrain.k8s.workloads import SPEC_HASH

QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_NAME = {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253}
# k8s.tolerations, in the config's own form (toleration_seconds; the pods get tolerationSeconds)
TOLERATIONS = {"type": "array", "items": {
    "type": "object", "additionalProperties": False,
    "properties": {"key": {"type": ["string", "null"]}, "operator": {"enum": ["Equal", "Exists"]},
                   "value": {"type": ["string", "null"]},
                   "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute", None]},
                   "toleration_seconds": {"type": ["integer", "null"], "minimum": 0}}}}
# The value as the config holds it (every field, unset ones null), and the pods' tolerations from that, as
# podspec.pod_toleration writes them (an unset field is left out).
TOLERATIONS_HELPER = (
    '{{- define "kubetrain.configTolerations" -}}\n'
    "{{- $out := list -}}\n"
    "{{- range $t := . -}}\n"
    '{{- $item := dict "key" nil "operator" "Equal" "value" nil "effect" nil "toleration_seconds" nil -}}\n'
    "{{- range $k, $v := $t }}{{ $_ := set $item $k $v }}{{ end -}}\n"
    "{{- $out = append $out $item -}}\n"
    "{{- end -}}\n"
    "{{- toJson $out -}}\n"
    "{{- end }}\n"
    '{{- define "kubetrain.tolerations" -}}\n'
    "{{- $out := list -}}\n"
    "{{- range $t := . -}}\n"
    '{{- $item := dict "operator" (get $t "operator" | default "Equal") -}}\n'
    "{{- range $ours, $theirs := dict " + " ".join(f'"{a}" "{b}"' for a, b in TOLERATION_FIELDS.items()) + " -}}\n"
    '{{- if and (hasKey $t $ours) (not (kindIs "invalid" (index $t $ours))) }}'
    "{{ $_ := set $item $theirs (index $t $ours) }}{{ end -}}\n"
    "{{- end -}}\n"
    "{{- $out = append $out $item -}}\n"
    "{{- end -}}\n"
    "{{- toJson $out -}}\n"
    "{{- end }}\n"
)


def _values(cfg: Config, workload: str | None, measured: MeasuredSave | None) -> list[Value]:
    raw = cfg.model_dump(mode="json")
    k = cfg.k8s

    def setting(*path: str) -> Callable[[Any], list[dict[str, Any]]]:
        def render_with(value: Any) -> list[dict[str, Any]]:
            changed = copy.deepcopy(raw)
            node = changed
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            return render(validate_config(changed, "chart value"), workload, measured, memory_check=False)
        return render_with

    def value(key: str, path: str, default: Any, sentinel: Any, schema: dict[str, Any], expr: str = "",
              **how: Any) -> Value:
        keys = path.split("/")
        return Value(key, default, sentinel, schema, setting(*keys), ".".join(keys), expr, **how)

    nodes_min = 2 if (workload or k.workload) == "pytorchjob" else 1  # a Master and at least one Worker
    out = [
        value("namespace", "k8s/namespace", k.namespace, "kthelm-namespace",
              {"type": "string", "pattern": f"^$|{DNS_LABEL}", "maxLength": 63},
              "(.Values.namespace | default .Release.Namespace)"),
        # what the pods run: a default image with GPUs is its -cuda (-rocm) build (podspec.image)
        value("image", "k8s/image", image(k), "kthelm.invalid/image:sentinel", {"type": "string", "minLength": 1}),
        value("nodes", "k8s/nnodes", k.nnodes, 61 if k.nnodes != 61 else 59,
              {"type": "integer", "minimum": nodes_min}),
    ]
    r = k.resources
    quantities = (("cpu", "cpu", r.cpu, "7331m"), ("memory", "memory", r.memory, "7331Gi"),
                  ("ephemeralStorage", "ephemeral_storage", r.ephemeral_storage, "7331Gi"))
    for key, field, setting_value, sentinel in quantities:
        if setting_value:
            out.append(value(f"resources.{key}", f"k8s/resources/{field}", setting_value, sentinel,
                             {"type": "string", "pattern": QUANTITY}))
    if r.gpu:
        out.append(value("resources.gpu", "k8s/resources/gpu", r.gpu, 61 if r.gpu != 61 else 59,
                         {"type": "integer", "minimum": max(1, k.nproc_per_node)}))
    secrets = {env: ("k8s/secrets/env/" + env + "/name", ref.name) for env, ref in k.secrets.env.items()}
    if k.secrets.hf_token is not None:
        secrets["HF_TOKEN"] = ("k8s/secrets/hf_token/name", k.secrets.hf_token.name)
    for i, (env, (path, name)) in enumerate(sorted(secrets.items())):
        out.append(value(f"secrets.{env}", path, name, f"kthelm-secret-{i}", SECRET_NAME))
    if cfg.checkpoint.secret_name:
        out.append(value("checkpointSecret", "checkpoint/secret_name", cfg.checkpoint.secret_name,
                         "kthelm-store-secret", SECRET_NAME))
    # where the pods run and what they carry: mappings and lists, set whole (Helm merges a mapping given with
    # --set into the default; `key: null` in a values file removes one)
    out += [
        value("nodeSelector", "k8s/node_selector", dict(k.node_selector), {**k.node_selector, "kthelm.dev/n": "kt"},
              {"type": "object", "additionalProperties": {"type": "string"}}),
        value("tolerations", "k8s/tolerations", raw["k8s"]["tolerations"],
              [*raw["k8s"]["tolerations"], {"key": "kthelm.dev/taint", "operator": "Equal", "value": "kt",
                                            "effect": "NoSchedule", "toleration_seconds": None}],
              TOLERATIONS, '(include "kubetrain.configTolerations" .Values.tolerations | fromJsonArray)',
              transform=lambda v: [pod_toleration(t) for t in v],
              go_transform='(include "kubetrain.tolerations" %s | fromJsonArray)'),
        value("annotations", "k8s/annotations", dict(k.annotations), {**k.annotations, "kthelm.dev/a": "kt"},
              {"type": "object", "additionalProperties": {"type": "string"}}),
    ]
    mlflow = cfg.track.mlflow
    if mlflow.enabled and mlflow.tracking_uri:
        out.append(value("trackingUri", "track/mlflow/tracking_uri", mlflow.tracking_uri,
                         "http://kthelm-tracking.kthelm-tracking:5999",
                         {"type": "string", "pattern": "^[a-z][a-z0-9+.-]*:", "minLength": 1}))
    return out


def job_chart(cfg: Config, objects: list[dict[str, Any]], folder: Path, workload: str | None = None,
              measured: MeasuredSave | None = None) -> tuple[list[Path], list[str]]:
    """Write the job's chart; the objects are `render(cfg, workload, measured)`. Returns (files, notes)."""
    variant = Variant("", objects, _values(cfg, workload, measured))
    notes: list[str] = []
    lift(variant, notes)
    name = job_name(cfg)
    namespace = objects[0]["metadata"]["namespace"]
    where = "{{ .Values.namespace | default .Release.Namespace }}"
    notes_txt = (f"kubetrain job {name} ({objects[-1]['kind']}) in {where}:\n"
                 f"  kubetrain k8s status {name} -n {where}\n"
                 f"  kubetrain k8s logs {name} -f -n {where}\n")
    lifted = {v.key for v in variant.lifted}
    namespace_expr = "(.Values.namespace | default .Release.Namespace)" if "namespace" in lifted else json.dumps(
        namespace)
    checks = render_checks(cfg, lifted)
    files = write_chart(folder, name=name, description=f"kubetrain training job {name} (namespace {namespace} by "
                        "default), rendered by `kubetrain k8s render --format helm`", variants=[variant],
                        notes_txt=notes_txt + not_checked(bool(checks)),
                        checks=checks + upgrade_check(objects[-1], namespace_expr),
                        helpers=(TOLERATIONS_HELPER if "tolerations" in lifted else "") + BYTES_HELPER)
    return files, notes


MAX_CHECKED_NODES = 64  # the node counts the chart knows render's verdict for


def not_checked(render_checked: bool) -> str:
    """The NOTES' line on what Helm checked of the values, and what is left to `render`."""
    also = (f", and the node count and the memory request as `kubetrain k8s render` does (up to {MAX_CHECKED_NODES} "
            "nodes)") if render_checked else ""
    return (f"Helm checked the values' types (values.schema.json){also}; the rest of the config's validation is "
            "render's: `kubetrain k8s render CONFIG --set k8s.KEY=VALUE` for the values you changed.\n")


def render_checks(cfg: Config, lifted: set[str]) -> str:
    """Template text that refuses, as `render` refuses, a node count the config does not validate with, and a memory
    request that cannot hold a pod's processes (render/memory.py) for the node count given.

    Render's verdict for every node count the chart may be given (up to MAX_CHECKED_NODES; more are not checked
    here) is written into the chart: the estimate needs torch, which a template cannot run.
    """
    from kubetrain.k8s.render.memory import host_need, size

    checked_memory = "resources.memory" in lifted and cfg.run.check_memory
    if "nodes" not in lifted and not checked_memory:
        return ""
    shape: dict[str, Any] = {"error": "not checked"}
    if checked_memory:
        from kubetrain.memory import model_shape

        shape = model_shape(cfg)
    verdicts: dict[str, Any] = {}
    counts = range(1, MAX_CHECKED_NODES + 1) if "nodes" in lifted else [cfg.k8s.nnodes]
    for n in counts:
        raw = cfg.model_dump(mode="json")
        raw["k8s"]["nnodes"] = n
        try:
            changed = validate_config(raw, "chart value")
        except UserInputError as e:
            verdicts[str(n)] = str(e).splitlines()[0]
            continue
        if "error" not in shape:
            need = host_need(changed, shape)[0]
            verdicts[str(n)] = [float(need), size(need)]
    if not verdicts:
        return ""
    table = " ".join(f"{json.dumps(n)} {_go_literal(v)}" for n, v in verdicts.items())
    nodes = '(toString (int .Values.nodes))' if "nodes" in lifted else json.dumps(str(cfg.k8s.nnodes))
    out = (
        "{{- /* What `kubetrain k8s render` refuses for these values: a node count the config refuses, a memory "
        "request below what a pod's processes need (render/memory.py), by node count. */ -}}\n"
        f"{{{{- $verdict := index (dict {table}) {nodes} }}}}\n"
        '{{- if kindIs "string" $verdict }}\n'
        f'{{{{- fail (printf "nodes=%s: %s" {nodes} $verdict) }}}}\n'
        "{{- end }}\n"
    )
    if checked_memory:
        out += (
            '{{- if and (kindIs "slice" $verdict) (lt (include "kubetrain.bytes" .Values.resources.memory | float64) '
            "(index $verdict 0)) }}\n"
            '{{- fail (printf "resources.memory (%s) cannot hold what a pod\'s processes need: about %s; raise '
            "resources.memory (`kubetrain k8s render CONFIG --set k8s.resources.memory=...` says what takes the "
            'space)" .Values.resources.memory (index $verdict 1)) }}\n'
            "{{- end }}\n"
        )
    return out


def _go_literal(value: Any) -> str:
    if isinstance(value, list):
        return "(list " + " ".join(_go_literal(v) for v in value) + ")"
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value)


# A quantity (resources.memory) in bytes, as a float: its number times its suffix (k8s.io/apimachinery's resource).
BYTES_HELPER = (
    '{{- define "kubetrain.bytes" -}}\n'
    '{{- $number := regexFind "^[0-9]+(\\\\.[0-9]+)?" . -}}\n'
    "{{- $scale := get (dict \"\" 1.0 \"m\" 0.001 \"k\" 1e3 \"M\" 1e6 \"G\" 1e9 \"T\" 1e12 \"P\" 1e15 "
    '"Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0) '
    "(trimPrefix $number .) -}}\n"
    "{{- mulf ($number | float64) $scale -}}\n"
    "{{- end }}\n"
)


def upgrade_check(workload: dict[str, Any], namespace: str) -> str:
    """Template text that fails `helm upgrade` of a job running with another spec, before anything is applied.

    Helm applies by kind, the ConfigMap before the workload: the API server would refuse the workload (a Job's
    pod template is immutable; JobSet and TrainJob refuse changes to their replicated Jobs too) after the ConfigMap
    took the new config, and the running pods would disagree with it. `launch` asks the server first (a dry run of
    every object); a chart can ask only before it renders: `lookup` of the workload, whose spec hash says whether
    these values are what runs. A StatefulSet takes a new pod template (it replaces its pods), so it is let through.
    """
    kind, name = workload["kind"], workload["metadata"]["name"]
    if kind == "StatefulSet":
        return ""
    message = (f"{kind.lower()}/{name} exists with another spec (spec-hash %s; these values give %s), and its pod "
               "template cannot change (field is immutable); nothing was changed. "
               f"`kubetrain k8s stop {name} -n %s` first (claims and checkpoints stay, the run resumes), then upgrade")
    annotation = f'index ($running.metadata.annotations | default dict) {json.dumps(SPEC_HASH)} | default ""'
    return (
        "{{- /* An upgrade the API server would refuse halfway fails here, before anything changes. */ -}}\n"
        "{{- if .Release.IsUpgrade }}\n"
        f"{{{{- $running := lookup {json.dumps(workload['apiVersion'])} {json.dumps(kind)} {namespace} "
        f"{json.dumps(name)} }}}}\n"
        "{{- if $running }}\n"
        f"{{{{- $hash := {annotation} }}}}\n"
        '{{- $ours := include "kubetrain.specHash" . }}\n'
        "{{- if ne $hash $ours }}\n"
        f"{{{{- fail (printf {json.dumps(message)} $hash $ours {namespace}) }}}}\n"
        "{{- end }}\n{{- end }}\n{{- end }}\n"
    )
