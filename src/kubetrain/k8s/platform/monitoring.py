"""Prometheus Operator and Grafana objects for the jobs of a namespace: PodMonitor, alert rules, dashboard.

The PodMonitor scrapes every trainer pod's launcher, which serves its ranks' heartbeats and incidents and passes
on rank 0's exporter from the pod that holds global rank 0 (track/prometheus_launcher.py). The alerts are written
against what those serve (a test checks that every name a rule reads is served);
`promtool test rules` fires each alert on a synthetic series.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from kubetrain.k8s.platform.config import AlertsConfig, PlatformConfig
from kubetrain.k8s.render.podspec import LAUNCHER_PORT_NAME
from kubetrain.k8s.workloads import JOB_LABEL, MANAGED_BY

MONITORING_API = "monitoring.coreos.com/v1"
DASHBOARD_LABEL = "grafana_dashboard"  # what the Grafana chart's dashboard sidecar watches for (value "1")
DASHBOARD_FILE = "kubetrain.json"
def _meta(cfg: PlatformConfig, name: str, labels: dict[str, str] | None = None,
          namespace: str | None = None) -> dict[str, Any]:
    base = {**cfg.labels, "app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/part-of": "kubetrain-platform",
            "app.kubernetes.io/managed-by": MANAGED_BY}
    return {"name": name, "namespace": namespace or cfg.namespace, "labels": {**base, **(labels or {})}}


def pod_monitor(cfg: PlatformConfig) -> dict[str, Any]:
    """Scrape every trainer pod's launcher (/metrics), labelled with the job's name.

    Each launcher serves its own ranks' heartbeats and incidents, and rank 0's gauges when its node holds global
    rank 0 (track/prometheus_launcher.py): c10d gives rank 0 to whichever node the rendezvous sorts first, so no
    pod label says in advance which pod that is.
    """
    launcher = {"port": LAUNCHER_PORT_NAME, "path": "/metrics", "interval": cfg.monitoring.interval}
    return {
        "apiVersion": MONITORING_API,
        "kind": "PodMonitor",
        "metadata": _meta(cfg, f"{cfg.name}-trainers", cfg.monitoring.labels),
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/managed-by": MANAGED_BY,
                                         "app.kubernetes.io/component": "trainer"}},
            "podTargetLabels": [JOB_LABEL],
            "podMetricsEndpoints": [launcher],
        },
    }


LAUNCHER_GONE_FOR = "2m"  # four scrapes at the PodMonitor's 30 s: a failed scrape or two is not a lost launcher


def _alert(name: str, expr: str, for_: str, summary: str, description: str, severity: str) -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description}}


def _restarted(window: str) -> str:
    """A run that restarted its workers or was resumed by a new launcher within `window`.

    changes() over the run's series (pods come and go) sees a restart between two samples of it; a run first
    scraped within the window already restarted (or resumed) has no earlier sample to change from.
    """
    changed = [f"changes((max by (namespace, run, phase) ({m}))[{window}:1m]) > 0"
               for m in ("kubetrain_restarts", "kubetrain_starts")]
    first_seen = [f"(max by (namespace, run, phase) ({m}) > {first} unless on (namespace, run, phase) "
                  f"max by (namespace, run, phase) ({m} offset {window}))"
                  for m, first in (("kubetrain_restarts", 0), ("kubetrain_starts", 1))]
    return " or ".join(changed + first_seen)


def rule_groups(alerts: AlertsConfig) -> list[dict[str, Any]]:
    """The alert rules, as Prometheus rule groups (the PrometheusRule's spec and a plain rules file alike)."""
    a, sev = alerts, alerts.severity
    run = "{{ $labels.namespace }}/{{ $labels.run }} (phase {{ $labels.phase }})"
    restart_window = f"{a.restart_window_minutes}m"
    rules = [
        # the launcher of every node serves its ranks' heartbeats and the job's own threshold (config/clocks.py:
        # half the hang watch's timeout, so this fires while the stuck processes still live); a frozen rank 0,
        # whose own exporter then cannot answer, still shows as an old heartbeat there. One process without a
        # launcher: rank 0's heartbeat against hang_minutes.
        _alert("KubetrainTrainingHung",
               "time() - kubetrain_rank_heartbeat_timestamp_seconds > ignoring (rank) group_left () "
               "kubetrain_hang_alert_seconds or (time() - kubetrain_heartbeat_timestamp_seconds > "
               f"{a.hang_minutes * 60 + 60} unless on (namespace, run) kubetrain_hang_alert_seconds)", "0m",
               "No training step for longer than the job's hang alert threshold",
               f"{{{{ with $labels.rank }}}}Rank {{{{ . }}}}{{{{ else }}}}Rank 0{{{{ end }}}} of {run} finished no "
               "step for {{ $value | humanizeDuration }}: a hung collective, data loader or a frozen process. "
               "The launcher's hang watch dumps every rank's stacks into <run>/incidents/ and names the stuck "
               "rank next (`kubetrain k8s status`, `kubetrain k8s logs`).", sev),
        _alert("KubetrainJobFailed",
               f"max_over_time(kubetrain_job_failed[{restart_window}]) > 0 unless on (namespace, run) "
               "(kubetrain_job_failed == 0)", "0m",
               "A training job failed with no restarts left",
               f"{{{{ $labels.namespace }}}}/{{{{ $labels.run }}}}'s launcher gave up within the last "
               f"{a.restart_window_minutes} minutes (no restarts left): the job is not training. Its last incident "
               "is in `kubetrain k8s status` and <run>/incidents/.", sev),
        # a launcher that ended on its own said so to its last scrape (job_failed, job_finished, job_stopped: a
        # SIGTERM, `kubetrain k8s stop` or a preemption); one whose series vanished without that was killed from
        # outside (the OOM killer, kill -9) or lost with its node: a pod gone from the PodMonitor's targets marks
        # its series stale. So does one failed scrape, which the next one undoes: `for` outlasts a few of them
        _alert("KubetrainLauncherGone",
               f"max by (namespace, run, pod) (max_over_time(kubetrain_worker_restarts[{restart_window}])) "
               "unless on (namespace, run, pod) kubetrain_worker_restarts "
               f"unless on (namespace, run, pod) (max_over_time(kubetrain_job_failed[{restart_window}]) > 0 or "
               f"max_over_time(kubetrain_job_finished[{restart_window}]) > 0 or "
               f"max_over_time(kubetrain_job_stopped[{restart_window}]) > 0)", LAUNCHER_GONE_FOR,
               "A training pod's launcher vanished without ending its job",
               "The launcher of {{ $labels.namespace }}/{{ $labels.run }} in pod {{ $labels.pod }} stopped answering "
               "scrapes without saying it finished, gave up or was stopped: killed from outside (OOM killer, "
               "kill -9) or its node lost. Runbook: `kubectl describe pod {{ $labels.pod }}` (OOMKilled, node "
               "NotReady), `kubetrain k8s status {{ $labels.run }}`; a replaced pod resumes from the newest "
               "checkpoint (KubetrainRestarted).", sev),
        # the geometric mean over the window: a steady straggler's ratio wanders (1.2x to 2.4x window to window),
        # so the raw gauge crossed the threshold back and forth and `for:` restarted; with two ranks each window's
        # ratios are inverses, and so are their geometric means: only the rank slower over the window can cross.
        # Three samples at least: a mean of one is that window alone (a first window where the straggler was fast)
        _alert("KubetrainStraggler",
               f"exp(avg_over_time(ln(kubetrain_rank_straggler_ratio)[{a.straggler_minutes}m:])) "
               f">= {a.straggler_ratio:g} and count_over_time(kubetrain_rank_straggler_ratio"
               f"[{a.straggler_minutes}m]) >= 3",
               f"{a.straggler_minutes * 30}s",
               f"A rank is {a.straggler_ratio:g}x slower than the others or more",
               f"Rank {{{{ $labels.rank }}}} of {run} spends {{{{ $value | humanize }}}}x the data wait + forward "
               f"time of the median of the other ranks (with two ranks: of the other one), the geometric mean over "
               f"{a.straggler_minutes} minutes, at least {a.straggler_ratio:g}x: a slow node, a throttled GPU or a "
               "noisy neighbour holds every rank back.", sev),
        _alert("KubetrainRestarted", _restarted(restart_window), "0m",
               f"Training restarted within {a.restart_window_minutes} minutes",
               f"{run} restarted its workers or was resumed by a new pod (a failure, preemption or relaunch); it "
               "continued from its newest checkpoint.", sev),
        _alert("KubetrainCheckpointStale",
               f"kubetrain_step - kubetrain_last_checkpoint_step > {a.checkpoint_lag_steps}", "5m",
               f"Newest checkpoint is more than {a.checkpoint_lag_steps} steps old",
               f"{run} is {{{{ $value }}}} steps past its newest checkpoint: a failure now loses that much work "
               "(check checkpoint.every and the checkpoint volume).", sev),
        _alert("KubetrainCheckpointUploadFailed",
               f"kubetrain_checkpoint_upload_failures > (kubetrain_checkpoint_upload_failures offset "
               f"{a.upload_window_minutes}m or kubetrain_checkpoint_upload_failures * 0)", "0m",
               "A checkpoint upload to object storage failed",
               f"{run} could not upload a checkpoint to checkpoint.uri within the last {a.upload_window_minutes} "
               "minutes (credentials, endpoint, a full bucket); training goes on with the local checkpoints, "
               "which a lost claim would take along.", sev),
    ]
    return [{"name": "kubetrain", "rules": rules}]


def prometheus_rule(cfg: PlatformConfig) -> dict[str, Any]:
    return {
        "apiVersion": MONITORING_API,
        "kind": "PrometheusRule",
        "metadata": _meta(cfg, f"{cfg.name}-alerts", cfg.monitoring.labels),
        "spec": {"groups": rule_groups(cfg.monitoring.alerts)},
    }


def dashboard_json() -> str:
    """The Grafana dashboard shipped in the package (deploy/grafana/kubetrain.json links to it)."""
    return (resources.files("kubetrain.k8s.platform") / "grafana" / DASHBOARD_FILE).read_text(encoding="utf-8")


def dashboard_config_map(cfg: PlatformConfig) -> dict[str, Any]:
    """The dashboard where the Grafana chart's sidecar picks it up (label grafana_dashboard: "1")."""
    text = json.dumps(json.loads(dashboard_json()), indent=1) + "\n"
    namespace = cfg.monitoring.dashboard_namespace or cfg.namespace
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cfg, f"{cfg.name}-dashboard", {DASHBOARD_LABEL: "1"}, namespace),
        "data": {DASHBOARD_FILE: text},
    }


def monitoring_objects(cfg: PlatformConfig) -> list[dict[str, Any]]:
    return [dashboard_config_map(cfg), pod_monitor(cfg), prometheus_rule(cfg)]
