"""The clocks of "no progress": one setting moves them all, in an order that names the problem before it kills."""

from __future__ import annotations

import pytest

from kubetrain.config import clocks, load_config
from kubetrain.errors import ConfigError


def _clocks(*overrides: str) -> clocks.Clocks:
    return clocks.derive(load_config(None, "tiny", list(overrides)))


def _in_order(c: clocks.Clocks) -> None:
    when = [t for t, _ in c.timeline()]
    assert when == sorted(when) and len(set(when)) == len(when), c.timeline()
    assert c.hang_watch is None or c.collective_step >= c.hang_watch + clocks.WATCH_ACTS_WITHIN
    assert c.collective_startup >= c.collective_step


def test_the_defaults_alert_then_name_the_rank_then_time_out_then_kill() -> None:
    c = _clocks()
    assert (c.alert, c.hang_watch, c.collective_step, c.collective_startup) == (300, 600, 900, 1800)
    assert c.liveness == 900 + clocks.WATCH_ACTS_WITHIN + 60  # + checkpoint.grace_seconds: a saving pod lives
    _in_order(c)


@pytest.mark.parametrize("hang", [1, 8, 30, 600, 3600, 7200])
def test_one_setting_scales_a_consistent_set(hang: float) -> None:
    c = _clocks(f"dist.hang_timeout_seconds={hang}")
    assert c.hang_watch == hang and c.alert == hang / 2
    _in_order(c)


def test_without_the_watch_the_collective_timeout_comes_first_after_the_alert() -> None:
    c = _clocks("dist.hang_timeout_seconds=null")
    assert c.hang_watch is None and c.collective_step == clocks.NO_WATCH_COLLECTIVE
    assert c.alert < c.collective_step
    _in_order(_clocks("dist.hang_timeout_seconds=null", "dist.timeout_seconds=20"))


def test_settings_that_agree_are_kept() -> None:
    c = _clocks("dist.hang_timeout_seconds=30", "dist.timeout_seconds=60", "dist.init_timeout_seconds=40",
                "track.prometheus.health_timeout_seconds=100")
    assert (c.collective_step, c.collective_startup, c.liveness) == (60, 60, 100)  # start-up never below the step


@pytest.mark.parametrize(("timeout", "watch"), [(600, 400), (20, 5), (45, 30)])
def test_a_collective_timeout_set_alone_moves_the_watch_before_it(timeout: int, watch: float) -> None:
    """One setting, a consistent set: also a config of an earlier version, whose timeout_seconds is the old 600."""
    c = _clocks(f"dist.timeout_seconds={timeout}")
    assert (c.hang_watch, c.collective_step) == (watch, timeout)
    _in_order(c)
    assert _clocks("dist.timeout_seconds=600", "dist.hang_timeout_seconds=300").hang_watch == 300  # both set: kept
    with pytest.raises(ConfigError, match=r"dist\.timeout_seconds"):  # a watch set after the timeout: refused
        load_config(None, "tiny", ["dist.timeout_seconds=600", "dist.hang_timeout_seconds=700"])


@pytest.mark.parametrize(("overrides", "names"), [
    (["dist.timeout_seconds=20", "dist.hang_timeout_seconds=30"], "dist.timeout_seconds (20) must be at least"),
    (["dist.hang_timeout_seconds=8", "track.prometheus.health_timeout_seconds=10"],
     "track.prometheus.health_timeout_seconds (10) must be at least the collective timeout (23)"),
])
def test_a_set_in_the_wrong_order_is_refused_in_one_line(overrides: list[str], names: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, "tiny", overrides)
    assert names in str(e.value) and "\n" not in str(e.value)
