"""track.console: the training log and progress lines on stdout, rank-prefixed and with secrets redacted."""

from __future__ import annotations

import io

from kubetrain.track.console import ConsoleSink, console_log, count, format_record, parse_progress

SECRET = "hf_" + "Kp4" * 8


def test_log_lines_are_prefixed_and_redacted() -> None:
    out = io.StringIO()
    say = console_log("[rank 1] ", stream=out)
    say(f"resuming with prompt {SECRET}")
    say("config changed since the last start: data.tokenizer.path: 'a' -> 'b'")
    assert out.getvalue().splitlines() == [
        "[rank 1] resuming with prompt ***",
        "[rank 1] config changed since the last start: data.tokenizer.path: 'a' -> 'b'",
    ]


def test_plain_progress_lines() -> None:
    out = io.StringIO()
    sink = ConsoleSink(10, stream=out, rich_progress=False, prefix="[rank 0] ")
    sink.start({"start_step": 0})
    sink.log({"kind": "train", "step": 5, "loss": 2.5, "lr": 1e-3, "tokens_per_second": 1234.0, "memory_gib": 0.5})
    sink.log({"kind": "eval", "step": 5, "val_loss": 2.25, "val_ppl": 9.49})
    sink.log({"kind": "checkpoint", "step": 5, "path": f"/runs/{SECRET}"})  # not a progress line
    sink.finish("finished")
    assert out.getvalue().splitlines() == [
        "[rank 0] step 5/10 | loss 2.5000 | lr 1.00e-03 | tok/s 1,234 | mem 0.50GiB",
        "[rank 0] eval step 5: val_loss 2.2500 ppl 9.49",
    ]


def test_parameter_counts_read_at_a_glance() -> None:
    assert [count(n) for n in (512, 15_360, 905_000, 124_439_808, 1_235_814_400)] == [
        "512", "15.4K", "0.91M", "124.44M", "1.24B"]


def test_distributed_lines_name_the_slowest_rank_and_read_back_as_progress() -> None:
    record = {"kind": "train", "step": 340, "loss": 2.5, "lr": 1e-3, "tokens_per_second": 12345.4, "mfu": 0.41,
              "memory_gib": 7.5, "slowest_rank": 2, "straggler_ratio": 1.8312, "eta_seconds": 3723.9}
    line = format_record(record, 1000)
    assert line == ("step 340/1000 | loss 2.5000 | lr 1.00e-03 | tok/s 12,345 | mfu 41.0% | mem 7.50GiB | "
                    "slowest rank 2 (1.8x) | eta 1:02:03")
    assert parse_progress("[rank 0] " + line) == {"step": 340, "max_steps": 1000, "tokens_per_second": 12345.0,
                                                  "eta_seconds": 3723, "slowest_rank": 2, "straggler_ratio": 1.8}
    single = format_record({**record, "slowest_rank": None, "eta_seconds": 125}, 1000)  # one process: no ranks
    assert "slowest" not in single and single.endswith("| eta 2:05")
    assert parse_progress(single) == {"step": 340, "max_steps": 1000, "tokens_per_second": 12345.0,
                                      "eta_seconds": 125, "slowest_rank": None, "straggler_ratio": None}


def test_lines_that_are_not_progress_parse_to_nothing() -> None:
    for line in ("eval step 20: val_loss 2.2500 ppl 9.49", "resuming from step 14", "[entrypoint] node 1/2"):
        assert parse_progress(line) is None
    assert parse_progress("step 10/20 | loss 3.1") == {"step": 10, "max_steps": 20, "tokens_per_second": None,
                                                       "eta_seconds": None, "slowest_rank": None,
                                                       "straggler_ratio": None}
