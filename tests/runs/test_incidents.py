"""runs.incidents: the incident files, and the one line per incident the launcher prints for `k8s status`."""

from __future__ import annotations

from pathlib import Path

from kubetrain.runs.incidents import log_line, parse_log_line, read_all, record


def test_an_incident_is_one_line_that_reads_back(tmp_path: Path) -> None:
    stacks = tmp_path / "incidents" / "x-hang-stacks.txt"
    entry = record(tmp_path, "hang", rank=2, step=340, message="no rank advanced for 30s; workers ended",
                   stacks=stacks)
    assert read_all(tmp_path) == [entry]
    line = log_line(entry, tmp_path)
    assert line.startswith("incident: hang on rank 2 at step 340 (")
    assert line.endswith(f"): no rank advanced for 30s; workers ended; stacks in {stacks}")
    back = parse_log_line(line)
    assert back is not None
    assert (back["kind"], back["rank"], back["step"]) == ("hang", 2, 340)
    assert back["time"] == int(entry["time"])  # whole seconds in the line
    assert back["message"] == f"no rank advanced for 30s; workers ended; stacks in {stacks}"


def test_an_incident_without_rank_or_step_and_a_message_of_several_lines(tmp_path: Path) -> None:
    entry = record(tmp_path, "preempted", rank=None, step=None, message="SIGTERM to the launcher\nmore")
    line = log_line(entry)
    assert "\n" not in line and line.endswith("): SIGTERM to the launcher")
    back = parse_log_line(line)
    assert back is not None and (back["kind"], back["rank"], back["step"]) == ("preempted", None, None)
    quiet = parse_log_line(log_line({**entry, "kind": "worker-exit", "rank": 1, "message": ""}))  # said nothing
    assert quiet is not None and (quiet["kind"], quiet["rank"], quiet["message"]) == ("worker-exit", 1, "")


def test_other_lines_are_not_incidents() -> None:
    for line in ("launcher: SIGTERM: workers stopped (run status: stopped)",
                 "incident: meteor at step 3 (2026-11-24T05:12:40Z): not a kind we record",
                 "[rank 0] step 10/20 | loss 3.1", "incident: hang at step 3: no time"):
        assert parse_log_line(line) is None
