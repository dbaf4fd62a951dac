"""track.jsonl: metrics.jsonl gets one redacted JSON object per record; a resume truncates it to its step."""

from __future__ import annotations

import json
from pathlib import Path

from kubetrain.runs import read_metrics
from kubetrain.track.jsonl import JsonlSink, truncate_after

SECRET = "hf_" + "Wd2" * 8


def test_records_are_written_redacted_and_truncated_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (1, 2, 3):
        sink.log({"kind": "train", "step": step, "loss": 1.0 / step, "tokens": 10 * step, "phase": None})
    sink.log({"kind": "checkpoint", "step": 3, "path": f"/ckpt/{SECRET}/step-000003"})
    sink.finish("finished")
    assert SECRET not in path.read_text()
    records = read_metrics(path)
    assert records[-1]["path"] == "/ckpt/***/step-000003" and records[0]["tokens"] == 10
    with open(path, "a") as f:
        f.write('{"kind": "train", "st')  # a line cut short by a kill
    truncate_after(path, 2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert all(json.loads(line) for line in path.read_text().splitlines())
