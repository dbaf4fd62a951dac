"""Liveness probe of a training pod: `python -m kubetrain.k8s.pod.probe --port 9400`.

Only global rank 0 serves /healthz (the training loop's heartbeat), and which pod holds global rank 0 is
decided by the c10d rendezvous, not by the pod's index. So the probe runs in every pod and asks its own
port: 200 is alive, any other status (503: the heartbeat is stale, e.g. a hung collective) is dead, and
a refused connection means this pod does not serve the endpoint (another rank, or training not yet
started) and passes. Standard library only, so that it starts in a few milliseconds.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def check(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> tuple[bool, str]:
    """(alive, why) for the /healthz endpoint on host:port."""
    url = f"http://{host}:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return True, f"{url}: {response.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: {e.code} {e.read(200).decode(errors='replace').strip()}"
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            return True, f"{url}: not served in this pod"
        return False, f"{url}: {e.reason}"
    except TimeoutError:
        return False, f"{url}: no answer within {timeout:g}s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetrain.k8s.pod.probe", description="Liveness probe.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    alive, why = check(args.port, args.host, args.timeout)
    print(why, file=sys.stdout if alive else sys.stderr)
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
