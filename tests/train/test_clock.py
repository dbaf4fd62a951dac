"""The run's clocks: a slow first step (compilation) is kept out of tokens/s and of the ETA's rate."""

from __future__ import annotations

import time

from kubetrain.train.clock import RunClock


def test_a_slow_first_step_is_out_of_the_window_and_the_eta() -> None:
    clock = RunClock(start_step=0, tokens=0)
    time.sleep(1.0)  # the first step: compiling
    first = clock.first_step_done(tokens=100, window_goes_on=True)
    assert first >= 1.0
    assert clock.meter.tokens0 == 100 and clock.meter.t0 >= clock.t_start + first  # the window starts after it
    time.sleep(0.02)  # two fast steps
    total = time.perf_counter() - clock.t_start
    eta = clock.eta(3, 13)
    assert eta is not None and eta < total / 3 * 10  # 10 steps at the fast steps' rate, not the first step's too
    with clock.side_work():
        time.sleep(0.02)
    clock.stop()
    assert clock.side_seconds >= 0.02
    assert clock.training_seconds() == clock.t_end - clock.t_start - clock.side_seconds  # type: ignore[operator]
    assert RunClock(5, 0).eta(5, 10) is None  # nothing done yet
