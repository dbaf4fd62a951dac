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


def test_lines_that_are_not_records_are_kept_with_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [b'{"kind": "train", "step": 1}\n', b"caf\xe9 not UTF-8\n", b"[1, 2]\n", b'"text"\n',
             b'{"kind": "note", "step": "x"}\n', b'{"kind": "train", "step": 2}\n', b'{"kind": "train", "step": 3}\n']
    path.write_bytes(b"".join(lines))
    warnings: list[str] = []
    truncate_after(path, 2, warnings.append)
    assert path.read_bytes() == b"".join(lines[:6])  # record 3 dropped; the others kept as they were, in order
    assert len(warnings) == 1 and "4 line(s) are not records" in warnings[0] and "line 2, 3, 4, 5" in warnings[0]
    assert [r["step"] for r in read_metrics(path)] == [1, "x", 2]  # readers skip them too
