"""A collective that failed because its peer went away is told apart from any other error."""

from __future__ import annotations

import pytest

from kubetrain.distributed.peers import lost_peer

# As gloo 2.x says it on the surviving rank when its peer was SIGKILLed (seen in a `--nproc 2` run).
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:30619: Connection reset by peer. This is typically caused by a remote worker hanging")


def test_a_peer_that_went_away_is_one_line_naming_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    line = lost_peer(RuntimeError(GLOO_RESET))
    assert line is not None and "\n" not in line
    assert line.startswith("rank 0 stopped: a peer process went away during a collective (reset by peer)")


def test_other_runtime_errors_are_not_a_lost_peer() -> None:
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x32 and 16x8)")) is None
