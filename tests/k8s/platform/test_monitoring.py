"""Alerts, PodMonitor and dashboard: the rules pass the real promtool, and each alert fires on a synthetic series."""

from __future__ import annotations

import io
import json
import math
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.k8s.platform.config import AlertsConfig, PlatformConfig
from kubetrain.k8s.platform.monitoring import (
    DASHBOARD_FILE,
    monitoring_objects,
    rule_groups,
)
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.podspec import LAUNCHER_PORT_NAME
from kubetrain.track.prometheus_launcher import LauncherExporter, RankBeat
from tests.track.test_grafana_dashboard import exported, metric_names  # noqa: F401  (a fixture, and its reader)

RUN = {"namespace": "ml", "pod": "gpt-0-abcde", "run": "gpt", "phase": "none"}


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    selector = ",".join(f'{k}="{v}"' for k, v in {**RUN, **labels}.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


def alert(summary: str, description: str, **labels: str) -> dict[str, Any]:
    """An expected alert; promtool compares its annotations too, so the texts are checked as rendered."""
    return {"exp_labels": {"severity": "warning", **labels},
            "exp_annotations": {"summary": summary, "description": description}}


def hung(rank: str, age: str, run: str = "gpt") -> tuple[str, str]:
    return ("No training step for longer than the job's hang alert threshold",
            f"Rank {rank} of ml/{run} (phase none) finished no step for {age}: a hung collective, data loader or a "
            "frozen process. The launcher's hang watch dumps every rank's stacks into <run>/incidents/ and names "
            "the stuck rank next (`kubetrain k8s status`, `kubetrain k8s logs`).")


HUNG = hung("0", "17m 0s", "solo")
def straggler(value: str, run: str = "gpt") -> tuple[str, str]:
    return ("A rank is 1.5x slower than the others or more",
            f"Rank 1 of ml/{run} (phase none) spends {value}x the data wait + forward time of the median of the "
            "other ranks (with two ranks: of the other one), the geometric mean over 10 minutes, at least 1.5x: a "
            "slow node, a throttled GPU or a noisy neighbour holds every rank back.")


STRAGGLER = straggler("1.6")
FLAP = [0.6, 2.2, 2.4, 2.0, 2.2] * 8  # a steady straggler's ratio, one log window a minute


def flap_mean(minute: int) -> float:
    """The rule's value at `minute`: the geometric mean of the samples in [t - 10m, t] (a subquery at the 1m
    evaluation interval; both ends included up to Prometheus 2, the one Debian ships)."""
    window = FLAP[max(0, minute - 10):minute + 1]
    return math.exp(sum(math.log(v) for v in window) / len(window))
FAILED = ("A training job failed with no restarts left",
          "ml/gpt's launcher gave up within the last 60 minutes (no restarts left): the job is not training. Its "
          "last incident is in `kubetrain k8s status` and <run>/incidents/.")


def restarted(run: str) -> tuple[str, str]:
    return ("Training restarted within 60 minutes",
            f"ml/{run} (phase none) restarted its workers or was resumed by a new pod (a failure, preemption or "
            "relaunch); it continued from its newest checkpoint.")


def gone(run: str, pod: str) -> tuple[str, str]:
    return ("A training pod's launcher vanished without ending its job",
            f"The launcher of ml/{run} in pod {pod} stopped answering scrapes without saying it finished, gave up or "
            "was stopped: killed from outside (OOM killer, kill -9) or its node lost. Runbook: `kubectl describe pod "
            f"{pod}` (OOMKilled, node NotReady), `kubetrain k8s status {run}`; a replaced pod resumes from the newest "
            "checkpoint (KubetrainRestarted).")


STALE = ("Newest checkpoint is more than 2000 steps old",
         "ml/gpt (phase none) is 3000 steps past its newest checkpoint: a failure now loses that much work (check "
         "checkpoint.every and the checkpoint volume).")
UPLOAD = ("A checkpoint upload to object storage failed",
          "ml/gpt (phase none) could not upload a checkpoint to checkpoint.uri within the last 60 minutes "
          "(credentials, endpoint, a full bucket); training goes on with the local checkpoints, which a lost claim "
          "would take along.")


def promtool_test(promtool: str, tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups(AlertsConfig())}, sort_keys=False))
    unit = tmp_path / "tests.yml"
    unit.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run([promtool, "test", "rules", str(unit)], capture_output=True, text=True, timeout=120)




def test_rules_pass_promtool_check(promtool: str, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups(AlertsConfig())}, sort_keys=False))
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 7 rules found" in out.stdout


def test_a_broken_rule_fails_promtool(promtool: str, tmp_path: Path) -> None:
    """The check can fail: an expression with a typo is refused."""
    groups = rule_groups(AlertsConfig())
    groups[0]["rules"][0]["expr"] = "time() - kubetrain_heartbeat_timestamp_seconds >"
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0


# One promtool unit test per alert: a series that must fire it (with the labels it must carry), a healthy one
# beside it that must not, and times before it fires and after it resolves.
ALERT_TESTS: dict[str, dict[str, Any]] = {
    # a launcher's two ranks beat a minute a minute; rank 1 stops at 10m, rank 0 (blocked on it) at 11m; the job's
    # threshold is 5m: rank 1 is 5m old at 15m, older at 16m. One process without a launcher (run solo): rank 0's
    # heartbeat against hang_minutes (15) + 1m. Run ok keeps beating.
    "KubetrainTrainingHung": {
        "input_series": [series("kubetrain_rank_heartbeat_timestamp_seconds", "0+60x10 600x30", rank="1"),
                         series("kubetrain_rank_heartbeat_timestamp_seconds", "0+60x11 660x30", rank="0"),
                         series("kubetrain_hang_alert_seconds", "300x40"),
                         series("kubetrain_heartbeat_timestamp_seconds", "0+60x10 600x30", run="solo"),
                         series("kubetrain_rank_heartbeat_timestamp_seconds", "0+60x40", run="ok", rank="0"),
                         series("kubetrain_hang_alert_seconds", "300x40", run="ok"),
                         series("kubetrain_heartbeat_timestamp_seconds", "0+60x10 600x30", run="ok")],
        "alert_rule_test": [{"eval_time": "15m", "alertname": "KubetrainTrainingHung", "exp_alerts": []},
                            {"eval_time": "16m", "alertname": "KubetrainTrainingHung",
                             "exp_alerts": [alert(*hung("1", "6m 0s"), **RUN, rank="1")]},
                            {"eval_time": "27m", "alertname": "KubetrainTrainingHung",
                             "exp_alerts": [alert(*hung("1", "17m 0s"), **RUN, rank="1"),
                                            alert(*hung("0", "16m 0s"), **RUN, rank="0"),
                                            alert(*HUNG, **{**RUN, "run": "solo"})]}],
    },
    # the launcher gave up at 10m and is gone a minute later: firing for the window (60m), not after; run ok was
    # relaunched after failing, and its new launcher says 0
    "KubetrainJobFailed": {
        "input_series": [series("kubetrain_job_failed", "0x9 1"),
                         series("kubetrain_job_failed", "0x9 1 _x5 0x60", run="ok")],
        "alert_rule_test": [{"eval_time": "5m", "alertname": "KubetrainJobFailed", "exp_alerts": []},
                            {"eval_time": "30m", "alertname": "KubetrainJobFailed",
                             "exp_alerts": [alert(*FAILED, **RUN)]},
                            {"eval_time": "80m", "alertname": "KubetrainJobFailed", "exp_alerts": []}],
    },
    # two ranks: rank 1 at 1.6x the other for 30m (the old rule, over the median of both, needed 3x); run flap: a
    # steady straggler whose log windows wander (0.6x, 2.2x, 2.4x, 2.0x, 2.2x, ...: the raw gauge dips below 1.5x
    # every 5 minutes, so a `for:` on it never held, and the healthy rank 0, at the inverse, touched 1.67x): its
    # geometric mean over 10 minutes stays above 1.5x, it fires 5 minutes on and stays firing
    "KubetrainStraggler": {
        "input_series": [series("kubetrain_rank_straggler_ratio", "0.625x30", rank="0"),
                         series("kubetrain_rank_straggler_ratio", "1.6x30", rank="1"),
                         series("kubetrain_rank_straggler_ratio", "1.4x30", run="ok", rank="1"),
                         series("kubetrain_rank_straggler_ratio", " ".join(f"{v:g}" for v in FLAP), run="flap",
                                rank="1"),
                         series("kubetrain_rank_straggler_ratio", " ".join(f"{1 / v:.6g}" for v in FLAP), run="flap",
                                rank="0")],
        "alert_rule_test": [{"eval_time": "4m", "alertname": "KubetrainStraggler", "exp_alerts": []},
                            *({"eval_time": f"{t}m", "alertname": "KubetrainStraggler",
                               "exp_alerts": [alert(*STRAGGLER, **RUN, rank="1"),
                                              alert(*straggler(f"{flap_mean(t):.4g}", "flap"),
                                                    **{**RUN, "run": "flap"}, rank="1")]}
                              for t in range(15, 30))],
    },
    # run gpt: its pod is replaced at 21m, the new one resumes (starts 1 -> 2); run el: an elastic restart of
    # the workers in the same pod (restarts 0 -> 1 at 31m). Both resolve once the window has passed. Run new: first
    # scraped at 61m already restarted (the restart came before the first scrape); run re: first scraped at 71m as
    # a resumed run (starts 2).
    "KubetrainRestarted": {
        "input_series": [series("kubetrain_starts", "1x20"), series("kubetrain_restarts", "0x20"),
                         series("kubetrain_starts", "_x21 2x80", pod="gpt-0-fghij"),
                         series("kubetrain_restarts", "_x21 0x80", pod="gpt-0-fghij"),
                         series("kubetrain_starts", "1x100", run="el", pod="el-0-abcde"),
                         series("kubetrain_restarts", "0x30 1x70", run="el", pod="el-0-abcde"),
                         series("kubetrain_starts", "_x60 1x140", run="new", pod="new-0-abcde"),
                         series("kubetrain_restarts", "_x60 1x140", run="new", pod="new-0-abcde"),
                         series("kubetrain_starts", "_x70 2x130", run="re", pod="re-0-abcde"),
                         series("kubetrain_restarts", "_x70 0x130", run="re", pod="re-0-abcde")],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "KubetrainRestarted", "exp_alerts": []},
            {"eval_time": "25m", "alertname": "KubetrainRestarted",
             "exp_alerts": [alert(*restarted("gpt"), namespace="ml", run="gpt", phase="none")]},
            {"eval_time": "40m", "alertname": "KubetrainRestarted",
             "exp_alerts": [alert(*restarted("gpt"), namespace="ml", run="gpt", phase="none"),
                            alert(*restarted("el"), namespace="ml", run="el", phase="none")]},
            {"eval_time": "100m", "alertname": "KubetrainRestarted",
             "exp_alerts": [alert(*restarted("new"), namespace="ml", run="new", phase="none"),
                            alert(*restarted("re"), namespace="ml", run="re", phase="none")]},
            {"eval_time": "140m", "alertname": "KubetrainRestarted", "exp_alerts": []},
        ],
    },
    # each pod's launcher is scraped from 0m; at 11m the launcher of run gpt vanishes (its series go stale: killed,
    # or its node lost); run done's launcher said its workers finished, run failed's that it gave up, run stopped's
    # that a SIGTERM stopped it (`k8s stop`, a preemption), before they exited; run ok's stays; run blip's misses
    # one scrape at 11m and answers again (neither it nor a planned stop is a launcher gone). Pending 2m (`for`),
    # then firing for the window (60m), not after.
    "KubetrainLauncherGone": {
        "input_series": [series("kubetrain_worker_restarts", "0x10 stale"),
                         series("kubetrain_worker_restarts", "0x10 stale", run="done", pod="done-0"),
                         series("kubetrain_job_finished", "0x9 1 stale", run="done", pod="done-0"),
                         series("kubetrain_worker_restarts", "0x10 stale", run="failed", pod="failed-0"),
                         series("kubetrain_job_failed", "0x9 1 stale", run="failed", pod="failed-0"),
                         series("kubetrain_worker_restarts", "0x10 stale", run="stopped", pod="stopped-0"),
                         series("kubetrain_job_stopped", "0x9 1 stale", run="stopped", pod="stopped-0"),
                         series("kubetrain_worker_restarts", "0x10 stale 0x100", run="blip", pod="blip-0"),
                         series("kubetrain_worker_restarts", "0x100", run="ok", pod="ok-0")],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "KubetrainLauncherGone", "exp_alerts": []},
            *({"eval_time": f"{t}m", "alertname": "KubetrainLauncherGone", "exp_alerts": []} for t in (11, 12)),
            *({"eval_time": f"{t}m", "alertname": "KubetrainLauncherGone",
               "exp_alerts": [alert(*gone("gpt", RUN["pod"]), namespace="ml", run="gpt", pod=RUN["pod"])]}
              for t in (13, 14, 30)),
            {"eval_time": "80m", "alertname": "KubetrainLauncherGone", "exp_alerts": []},
        ],
    },
    # 100 steps a minute, no checkpoint since step 0: past 2000 steps at 21m, + for: 5m; run ok saves each 1000
    "KubetrainCheckpointStale": {
        "input_series": [series("kubetrain_step", "0+100x40"), series("kubetrain_last_checkpoint_step", "0x40"),
                         series("kubetrain_step", "0+100x40", run="ok"),
                         series("kubetrain_last_checkpoint_step", "0x9 1000x9 2000x9 3000x10", run="ok")],
        "alert_rule_test": [{"eval_time": "24m", "alertname": "KubetrainCheckpointStale", "exp_alerts": []},
                            {"eval_time": "30m", "alertname": "KubetrainCheckpointStale",
                             "exp_alerts": [alert(*STALE, **RUN)]}],
    },
    # an upload fails at 11m: firing until an hour has passed without another failure; run ok never fails
    "KubetrainCheckpointUploadFailed": {
        "input_series": [series("kubetrain_checkpoint_upload_failures", "0x10 1x100"),
                         series("kubetrain_checkpoint_upload_failures", "0x110", run="ok")],
        "alert_rule_test": [{"eval_time": "5m", "alertname": "KubetrainCheckpointUploadFailed", "exp_alerts": []},
                            {"eval_time": "30m", "alertname": "KubetrainCheckpointUploadFailed",
                             "exp_alerts": [alert(*UPLOAD, **RUN)]},
                            {"eval_time": "75m", "alertname": "KubetrainCheckpointUploadFailed", "exp_alerts": []}],
    },
}




@pytest.mark.parametrize("name", list(ALERT_TESTS))
def test_each_alert_fires_on_its_series(name: str, promtool: str, tmp_path: Path) -> None:
    result = promtool_test(promtool, tmp_path, [{"interval": "1m", **ALERT_TESTS[name]}])
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_healthy_rank_of_two_is_never_pending(promtool: str, tmp_path: Path) -> None:
    """Pending is the expression being true: at every minute only the straggler's median crosses (run flap above)."""
    [rule] = [r for g in rule_groups(AlertsConfig()) for r in g["rules"] if r["alert"] == "KubetrainStraggler"]
    straggler_labels = "{" + ",".join(f'{k}="{v}"' for k, v in {**RUN, "run": "flap", "rank": "1"}.items()) + "}"
    test = {"interval": "1m", "input_series": [s for s in ALERT_TESTS["KubetrainStraggler"]["input_series"]
                                               if 'run="flap"' in s["series"]],
            # rounded as PromQL's round() does: the mean of logs may differ in its last bit from Go's
            "promql_expr_test": [{"expr": f"round({rule['expr']}, 0.001)", "eval_time": f"{t}m",
                                  "exp_samples": [{"labels": straggler_labels,
                                                   "value": math.floor(flap_mean(t) * 1000 + 0.5) / 1000}]
                                  if flap_mean(t) >= 1.5 and t >= 2 else []}
                                 for t in range(40)]}
    result = promtool_test(promtool, tmp_path, [test])
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_restart_in_the_first_minute_of_scraping_alerts(promtool: str, tmp_path: Path) -> None:
    """Scraped every 15 s: the first scrape at 0:30 says 0 restarts, the workers restart at 0:45, all within the
    minute the 1m subquery sees as one point (the old rule saw no change)."""
    test = {"interval": "15s",
            "input_series": [series("kubetrain_restarts", "_ _ 0 1x200"), series("kubetrain_starts", "_ _ 1x200")],
            "alert_rule_test": [{"eval_time": "3m", "alertname": "KubetrainRestarted",
                                 "exp_alerts": [alert(*restarted("gpt"), namespace="ml", run="gpt",
                                                      phase="none")]}]}
    result = promtool_test(promtool, tmp_path, [test])
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test() -> None:
    names = [r["alert"] for g in rule_groups(AlertsConfig()) for r in g["rules"]]
    assert sorted(names) == sorted(ALERT_TESTS)


def test_a_wrong_expectation_fails(promtool: str, tmp_path: Path) -> None:
    """promtool really evaluates: the hung alert expected where the heartbeat is fresh fails the test."""
    test = {"interval": "1m", "input_series": [series("kubetrain_rank_heartbeat_timestamp_seconds", "0+60x40",
                                                      rank="0"), series("kubetrain_hang_alert_seconds", "300x40")],
            "alert_rule_test": [{"eval_time": "30m", "alertname": "KubetrainTrainingHung",
                                 "exp_alerts": [alert(*hung("0", "30m 0s"), **RUN, rank="0")]}]}
    assert promtool_test(promtool, tmp_path, [test]).returncode != 0


def _launcher_serves() -> set[str]:
    """Sample names a live launcher exporter serves, with a rank's beat and an incident."""
    exporter = LauncherExporter(0, "127.0.0.1", "gpt", 4.0, lambda: [RankBeat(0, 3, 1.0)], lambda: 0)
    exporter.start(stream=io.StringIO())
    exporter.incident({"kind": "hang", "rank": 1})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        exporter.close(failed=False)
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_rules_use_what_the_exporters_serve(exported: set[str]) -> None:  # noqa: F811
    used = {m for g in rule_groups(AlertsConfig()) for r in g["rules"] for m in metric_names(r["expr"])}
    served = exported | _launcher_serves()
    assert used <= served, f"a rule names a metric nobody serves: {used - served}"


def test_objects_validate_strictly(monitoring_schemas: dict[tuple[str, str], dict[str, Any]]) -> None:
    objects = monitoring_objects(PlatformConfig(namespace="ml"))
    assert [o["kind"] for o in objects] == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    assert validate.problems(objects, monitoring_schemas) == []
    broken = json.loads(json.dumps(objects[1]))
    broken["spec"]["podMetricsEndpoints"][0]["scrapeInterval"] = "30s"  # not a field: the server would prune it
    assert validate.problems([broken], monitoring_schemas)


def test_dashboard_config_map_is_picked_up_by_grafanas_sidecar() -> None:
    cfg = PlatformConfig(namespace="ml", monitoring={"dashboard_namespace": "monitoring"})
    cm = monitoring_objects(cfg)[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "monitoring"
    shipped = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "kubetrain.json"
    assert json.loads(cm["data"][DASHBOARD_FILE]) == json.loads(shipped.read_text())


def test_pod_monitor_scrapes_every_pods_launcher() -> None:
    """No pod label says which pod holds global rank 0: every launcher is scraped, and the one on rank 0's node
    passes its gauges on (tests/launch/test_watch.py starts two launchers in reversed order)."""
    [endpoint] = monitoring_objects(PlatformConfig(namespace="ml"))[1]["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == LAUNCHER_PORT_NAME and "relabelings" not in endpoint
