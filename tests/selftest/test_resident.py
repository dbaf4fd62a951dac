"""selftest/resident.py: the peak resident memory of a command's processes, what the CPU estimate is checked by."""

from __future__ import annotations

import torch

from kubetrain.selftest.resident import measure

GIB = 2**30


def test_a_command_started_from_a_large_process_reports_its_own_peak_not_its_parents() -> None:
    # Linux carries a process's peak over exec: forked straight from this process, `kubetrain --version` reported
    # this process's size (seen in the suite: every measured run of one xdist worker read 1.15 GiB).
    held = torch.ones(GIB // 4)  # 1 GiB resident here, in the measuring process
    held += 1
    run = measure(["--version"], timeout=120)
    assert run.returncode == 0, run.stderr
    assert len(run.per_process) == 1
    assert run.total < GIB  # importing torch and printing versions: a few hundred MiB
    del held
