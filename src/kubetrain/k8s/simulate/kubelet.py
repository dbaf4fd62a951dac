"""The kubelet's prober (pkg/kubelet/prober) for a simulated container: its HTTP probe, and the startup and liveness
probes that end a container after failureThreshold failures in a row."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

KUBELET_USER_AGENT = "kube-probe/1.33"


def http_probe(host: str, port: int, path: str, timeout: float) -> tuple[bool, str]:
    """(success, detail) of one HTTP probe as the kubelet's prober does it (pkg/probe/http): a GET with
    `User-Agent: kube-probe/<version>` and `Accept: */*`, success for a status from 200 to 399, failure for any
    other status, a refused connection or no answer within timeoutSeconds."""
    request = urllib.request.Request(f"http://{host}:{port}{path}",
                                     headers={"User-Agent": KUBELET_USER_AGENT, "Accept": "*/*"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # redirects are followed, as there
            code, body = response.status, response.read(10 * 1024)
    except urllib.error.HTTPError as e:
        code, body = e.code, e.read(10 * 1024)
    except (OSError, ValueError) as e:  # refused, reset, timed out
        return False, f"Get \"http://{host}:{port}{path}\": {getattr(e, 'reason', e)}"
    detail = f"HTTP probe {'succeeded' if 200 <= code < 400 else 'failed'} with statuscode: {code}: " + \
        body.decode(errors="replace").strip()
    return 200 <= code < 400, detail


def watch_container(name: str, probes: dict[str, dict[str, Any]], grace_seconds: float,
                    process: subprocess.Popen[bytes], probe: Callable[[str], tuple[bool, str]],
                    kill: Callable[[], None], log: Callable[[str], None]) -> None:
    """The kubelet's prober for one container: the startup probe every periodSeconds until it succeeds, then the
    liveness probe; failureThreshold failures in a row (of either) end the container as the kubelet does, SIGTERM
    and SIGKILL (`kill`) after terminationGracePeriodSeconds, and its controller sees it exit. `probe(kind)`: one
    probe of the container, (success, detail)."""
    for kind in ("startupProbe", "livenessProbe"):
        spec = probes.get(kind)
        if spec is None:
            continue
        period, threshold = float(spec.get("periodSeconds", 10)), int(spec.get("failureThreshold", 3))
        failures = 0
        time.sleep(float(spec.get("initialDelaySeconds", 0)))
        while process.poll() is None:
            alive, detail = probe(kind)
            if process.poll() is not None:
                return
            failures = 0 if alive else failures + 1
            if alive and kind == "startupProbe":
                break
            if failures >= threshold:
                log(f"[simulate] {name}: {kind} failed {failures} times ({detail}); the kubelet ends the container")
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=grace_seconds)
                except subprocess.TimeoutExpired:
                    kill()
                return
            time.sleep(period)
