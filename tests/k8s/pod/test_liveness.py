"""A frozen rank in a pod: the kubelet's probe of the launcher's /healthz stays alive while the watch names the rank.

The pod runs as `kubetrain k8s simulate` runs it (the rendered container's entrypoint, its environment, its own
ports); the probe is the rendered livenessProbe, sent as the kubelet's HTTP prober sends it; the clocks are the
shipped defaults scaled by one setting (`dist.hang_timeout_seconds=8`, docs/resilience.md's second row).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kubetrain.config import load_config
from kubetrain.config.clocks import PROBE_FAILURES, derive
from kubetrain.k8s.simulate.simulation import Simulation
from kubetrain.runs.incidents import read_all
from tests.train.conftest import children, rank_of

SAFETY = 300.0  # a net against a hang of the test itself, never a timing assertion
TINY = ["run.threads=1", "run.device=cpu", "model.n_layer=1", "model.n_head=2", "model.n_embd=16",
        "model.block_size=16", "train.micro_batch_size=2", "train.warmup_steps=1", "train.log_every_steps=1",
        "train.max_steps=100000", "checkpoint.every_steps=100000", "eval.every_steps=100000",
        "eval.sample_prompt=null", "k8s.nproc_per_node=2", "k8s.max_restarts=2"]


def _wait(condition: object, what: str, sim: Simulation) -> None:
    deadline = time.monotonic() + SAFETY
    while not condition():  # type: ignore[operator]
        pod = sim.pod(0)
        assert pod.running() and time.monotonic() < deadline, f"{what}: {pod.log_path.read_text()[-3000:]}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_frozen_rank_in_a_pod_is_named_with_stacks_while_the_liveness_probe_stays_alive(tmp_path: Path) -> None:
    """Rank 0 SIGSTOPped, then (after the restart) rank 1: one pod, both rounds, every probe answered 200."""
    cfg = load_config(None, "tiny", [*TINY, "dist.hang_timeout_seconds=8"])
    clocks = derive(cfg)
    assert clocks.hang_watch is not None and clocks.hang_watch + 15 < clocks.liveness  # the order the docs show
    s = Simulation(cfg, tmp_path / "sim", "indexed-job", echo=False)
    run = s.root / "volumes" / "checkpoints" / "tiny"
    pod = s.start_pod(0)
    answers: list[tuple[float, bool, str]] = []
    stopped: dict[int, float] = {}
    try:
        _wait(lambda: s.probe(0, "startupProbe")[0], "the launcher never answered the startup probe", s)
        for frozen in (0, 1):
            hangs = len([i for i in read_all(run) if i["kind"] == "hang"])
            _wait(lambda: '"status": "ok"' in s.probe(0)[1], "no steps", s)
            assert pod.process is not None
            workers = [pid for pid in children(pod.process.pid) if rank_of(pid) is not None]  # the agent's
            stopped[frozen] = time.time()
            os.kill(next(pid for pid in workers if rank_of(pid) == frozen), signal.SIGSTOP)

            def probed_until_trained_on(hangs: int = hangs, at: float = stopped[frozen]) -> bool:
                ok, detail = s.probe(0)
                answers.append((time.time() - at, ok, detail))
                # the workers were ended and restarted: the new round's first steps
                return len([i for i in read_all(run) if i["kind"] == "hang"]) > hangs and '"status": "ok"' in detail

            _wait(probed_until_trained_on, "the job did not come back from the hang", s)
    finally:
        s.stop()
    hangs = [i for i in read_all(run) if i["kind"] == "hang"]
    assert [h["rank"] for h in hangs] == [0, 1], hangs
    for hang, frozen in zip(hangs, (0, 1), strict=True):
        assert "did not answer" in hang["message"]
        stacks = (run / hang["stacks"]).read_text()
        assert f"suspect: rank {frozen}" in stacks and "no stacks: it is stopped" in stacks
        assert hang["time"] - stopped[frozen] < clocks.hang_watch + 15, hang  # the watch acts within its clock
    # the kubelet ends a container after PROBE_FAILURES failures in a row: here not a single one
    failed = [(round(t, 1), detail) for t, ok, detail in answers if not ok]
    assert not failed, failed
    assert len(answers) >= 2 * PROBE_FAILURES
    after = ", ".join(f"{h['time'] - stopped[r]:.1f}s" for h, r in zip(hangs, (0, 1), strict=True))
    print(f"ranks 0 then 1 SIGSTOPped in a pod: hang incidents naming them after {after}; "
          f"{len(answers)} probes, all 200 (the probe's 503 would come at {clocks.liveness:g}s, the kill at "
          f"{clocks.liveness_kill:g}s)")
