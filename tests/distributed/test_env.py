"""Rank and world from the exact variables each launcher sets."""

from __future__ import annotations

import pytest

from kubetrain.distributed.env import process_env


def test_single_process_defaults() -> None:
    p = process_env({})
    assert (p.rank, p.world_size, p.local_rank, p.distributed, p.is_main) == (0, 1, 0, False, True)


def test_torchrun_worker() -> None:
    env = {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3",
    }
    p = process_env(env)
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size) == (5, 8, 1, 4)
    assert (p.master_addr, p.master_port, p.elastic, p.restart_count) == ("10.0.0.7", 29400, True, 2)
    assert p.distributed and not p.is_main


def test_bad_values_are_clear() -> None:
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        process_env({"WORLD_SIZE": "two"})
