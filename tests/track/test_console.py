"""track.console: the training log and progress lines on stdout, rank-prefixed and with secrets redacted."""

from __future__ import annotations

import io

from kubetrain.track.console import ConsoleSink, console_log, count

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
