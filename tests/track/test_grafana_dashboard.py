"""deploy/grafana/kubetrain.json: every panel queries metrics that a live exporter really emits."""

from __future__ import annotations

import io
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.track.prometheus import PrometheusSink

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kubetrain.json"
# PromQL words that look like identifiers but name no metric
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
            "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric identifiers in a PromQL expression: not functions, keywords, labels or strings."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings ("$run", regexes)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors and subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group().lower() in KEYWORDS:
            continue  # a function call, or a keyword
        names.add(m.group())
    return names


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels inside
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Sample names a live exporter serves once it has seen every kind of record."""
    sink = PrometheusSink(0, "127.0.0.1", stream=io.StringIO())
    sink.start({"run": "dash", "phase": None, "run_dir": str(tmp_path_factory.mktemp("dash")),
                "start_step": 0, "max_steps": 10, "restarts": 0, "world_size": 1})
    try:
        sink.heartbeat(1)
        sink.log({"kind": "train", "step": 1, "loss": 3.0, "lr": 1e-3, "tokens": 64,
                  "tokens_per_second": 10.0, "mfu": 0.2, "memory_gib": 0.5, "eta_seconds": 9.0,
                  "rank_compute_seconds": [0.5, 0.75], "rank_straggler_ratios": [0.6667, 1.5], "upload_failures": 0})
        sink.log({"kind": "eval", "step": 1, "val_loss": 3.1, "val_ppl": 22.0, "tokens": 64})
        sink.log({"kind": "checkpoint", "step": 1, "path": "c/step-000001", "best": True})
        with urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        sink.finish("finished")
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_metric_names_parser() -> None:
    assert metric_names('time() - kubetrain_heartbeat_timestamp_seconds{run=~"$run", phase=~"$phase"}') == \
        {"kubetrain_heartbeat_timestamp_seconds"}
    assert metric_names('max by (run, phase) (kubetrain_starts{run=~"$run"}) - 1') == {"kubetrain_starts"}
    assert metric_names("rate(kubetrain_tokens_seen[$__rate_interval]) / on (run) kubetrain_max_steps") == \
        {"kubetrain_tokens_seen", "kubetrain_max_steps"}
    assert metric_names('kubetrian_loss{run="a"} * 1e3') == {"kubetrian_loss"}  # a typo is caught


def test_every_panel_queries_exported_metrics(exported: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for panel in panels(dashboard):
        if panel.get("type") == "row":
            continue
        exprs = [t["expr"] for t in panel.get("targets", [])]
        assert exprs, f"panel '{panel['title']}' has no query"
        for expr in exprs:
            names = metric_names(expr)
            assert names, f"panel '{panel['title']}': no metric in {expr!r}"
            assert names <= exported, f"panel '{panel['title']}': {sorted(names - exported)} are not exported"
            used |= names
    # the panels the issue asks for: loss, val loss, tokens/s, MFU, memory, restarts
    assert {"kubetrain_train_loss", "kubetrain_val_loss", "kubetrain_tokens_per_second", "kubetrain_mfu",
            "kubetrain_memory_bytes", "kubetrain_restarts"} <= used
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(SELECTOR, label)
            selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["query"]["query"])
            assert selector and metric_names(selector.group(1)) <= exported, variable["name"]


def test_panel_ids_are_unique_and_panels_fit_the_grid() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for p in panels(dashboard):
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
