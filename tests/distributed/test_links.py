"""The link measurements' arithmetic: nccl-tests' bus bandwidth, the ring of neighbours and its rounds.
(Measured for real over gloo in test_preflight.py and test_preflight_slow_link.py.)"""

from __future__ import annotations

import pytest

from kubetrain.distributed.links import SIZES, bus_bandwidth, link_size, neighbour_links, rounds


def test_bus_bandwidth_is_nccl_tests_definition() -> None:
    # nccl-tests (doc/PERFORMANCE.md): all-reduce busbw = algbw * 2(n-1)/n, algbw = bytes / time
    assert bus_bandwidth(10**9, 1.0, 8) == pytest.approx(1.75e9)
    assert bus_bandwidth(10**9, 2.0, 2) == pytest.approx(0.5e9)  # two ranks: each link carries the buffer once
    assert bus_bandwidth(SIZES[-1], 0.5, 4) == pytest.approx(2**28 / 0.5 * 1.5)


def test_sizes_grow_from_1_to_256_mib() -> None:
    assert SIZES[0] == 2**20 and SIZES[-1] == 256 * 2**20


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 9])
def test_every_rank_is_timed_against_both_ring_neighbours_and_never_in_two_pairs_at_once(world: int) -> None:
    links = neighbour_links(world)
    per_rank = {r: sum(r in link for link in links) for r in range(world)}
    assert set(per_rank.values()) == ({1} if world == 2 else {2})  # a slow rank shows on two links
    timed = [link for group in rounds(links) for link in group]
    assert sorted(timed) == sorted(links)  # each link once
    for group in rounds(links):
        ranks = [r for link in group for r in link]
        assert len(ranks) == len(set(ranks))
    assert len(rounds(links)) <= 3  # a ring is coloured in 2 rounds (3 for an odd one): time does not grow with n


def test_the_link_size_shrinks_until_the_rounds_fit_the_budget() -> None:
    rows = [{"bytes": 64 * 2**20}]
    assert link_size(rows, 0.01, 4, 10.0) == 64 * 2**20  # 2 rounds x 6 x 0.013 s fits
    small = link_size(rows, 1.0, 4, 2.0)  # 16 s at 64 MiB: 4x smaller until it fits, never under 1 MiB
    assert small < 64 * 2**20 and small >= SIZES[0]
    assert link_size(rows, 100.0, 4, 1.0) == SIZES[0]
