"""A collective that failed because a peer process went away: an effect of another rank's failure, not a cause.

The launcher names the rank that failed first (launch.elastic.root_failure); the surviving ranks say one line
each instead of a gloo/NCCL traceback.
"""

from __future__ import annotations

import os
import re

# What gloo, NCCL and the c10d store say when the process at the other end is gone.
PEER_LOST = re.compile(r"(closed|reset) by peer|remote worker|peer (process )?(died|exited)", re.IGNORECASE)


def lost_peer(error: BaseException) -> str | None:
    """One line for a collective that failed because a peer went away; None for any other error."""
    found = PEER_LOST.search(str(error))
    if found is None:
        return None
    rank = os.environ.get("RANK")
    who = f"rank {rank}" if rank is not None else "this process"
    return (f"{who} stopped: a peer process went away during a collective ({found.group(0)}); "
            f"the error of the rank that failed says why")
