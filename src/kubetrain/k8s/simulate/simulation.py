"""The simulation: a rendered job's pods built as local processes, and supervised as their controller does (a failed
pod replaced until backoffLimit, an exit its podFailurePolicy ignores replaced without counting)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubetrain
from kubetrain.config.loading import validate as validate_config
from kubetrain.config.schema import Config
from kubetrain.distributed.env import POD_NAME_ENV
from kubetrain.errors import EXIT_BAD_INPUT, EXIT_STOPPED_RESUMABLE
from kubetrain.k8s.render.context import CACHE_MOUNT, CONFIG_MOUNT
from kubetrain.k8s.render.manifest import render
from kubetrain.k8s.simulate import controllers
from kubetrain.k8s.simulate.kubelet import http_probe, watch_container
from kubetrain.k8s.simulate.network import LOOPBACK, free_port, pod_ports
from kubetrain.k8s.simulate.volumes import check_inputs, map_path, shared_mounts, write_config

Log = Callable[[str], None]


@dataclass
class SimPod:
    name: str
    env: dict[str, str]
    argv: list[str]
    folder: Path
    # the container's ports, by name and by number -> this host's port
    ports: dict[str | int, int] = field(default_factory=dict)
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)  # livenessProbe, startupProbe as rendered
    grace_seconds: float = 30.0  # the pod's terminationGracePeriodSeconds
    process: subprocess.Popen[bytes] | None = None
    exit_codes: list[int] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.folder / "log.txt"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class SimResult:
    succeeded: bool
    message: str
    exit_codes: dict[str, list[int]]


def _descendants(pid: int) -> list[int] | None:
    """Every process below pid, from Linux's /proc (None where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    if not children:
        return None
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Simulation:
    """The pods of one rendered job, as local processes under `root`."""

    def __init__(self, cfg: Config, root: Path, workload: str | None = None, log: Log | None = None,
                 echo: bool = True, volumes: dict[str, Path] | None = None) -> None:
        raw = cfg.model_dump(mode="json")
        self.port = free_port()
        raw["k8s"]["rdzv_port"] = self.port
        self.cfg = validate_config(raw, source="simulated config")
        self.root = root.resolve()
        self.log: Log = log or (lambda m: print(m, flush=True))
        self.echo = echo
        self.objects = render(self.cfg, workload)
        self.workload_obj = self.objects[-1]
        self.kind = self.workload_obj["kind"]
        self.name = self.workload_obj["metadata"]["name"]
        self.bound = {name: Path(path).resolve() for name, path in (volumes or {}).items()}
        self.shared = shared_mounts(self.workload_obj, self.bound, self.root)
        check_inputs(self.objects, self.bound, self.shared)
        self.pods = self._pods()
        self._threads: list[threading.Thread] = []

    # -- the pods, as the cluster would make them ------------------------------------------------

    def _pods(self) -> list[SimPod]:
        names = controllers.pod_names(self.workload_obj, self.cfg.k8s.nnodes)
        dns = {d: LOOPBACK for _, d, _ in names} | {p: LOOPBACK for p, _, _ in names}
        base = {k: v for k, v in os.environ.items() if not controllers.FOREIGN_ENV.match(k)}
        src = str(Path(kubetrain.__file__).resolve().parents[1])  # this kubetrain, also in the pods
        base["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
        pods = []
        taken = {self.port}
        for rank, (pod_name, _, template) in enumerate(names):
            folder = self.root / "pods" / pod_name
            own = {"/tmp": folder / "tmp", CACHE_MOUNT: folder / "cache", "/dev/shm": folder / "shm"}
            for path in own.values():
                path.mkdir(parents=True, exist_ok=True)
            main = controllers.main_container(self.workload_obj, template)
            ports = pod_ports(self.cfg.k8s, self.port, main, taken)
            mounts = {**self.shared, **own, CONFIG_MOUNT: folder / "configmap"}
            write_config(self.objects, self.cfg, folder / "configmap", mounts, ports)
            env = dict(base)
            for item in main["env"]:
                value = controllers.env_value(item, pod_name)
                if value is not None:
                    env[item["name"]] = value
            env.update(controllers.controller_env(self.kind, self.name, self.cfg.k8s, rank, pod_name))
            if self.kind == "TrainJob":
                env["PET_MASTER_PORT"] = str(self.port)  # the runtime's fixed port, mapped to a free one
            # names that must resolve become loopback; the pod's own name (HOSTNAME, the downward API's) stays
            env = {k: v if k in ("HOSTNAME", POD_NAME_ENV) else dns.get(v, map_path(v, mounts))
                   for k, v in env.items()}
            args = [map_path(a, mounts) for a in main["args"] if a != "--idle-after-finish"]
            argv = [sys.executable, "-m", "kubetrain", *main["command"][1:], *args]
            probes: dict[str, dict[str, Any]] = {k: main[k] for k in ("startupProbe", "livenessProbe") if k in main}
            grace = float(template["spec"].get("terminationGracePeriodSeconds", 30))
            pods.append(SimPod(pod_name, env, argv, folder, ports, probes, grace))
        return pods

    def probe(self, which: int | str, kind: str = "livenessProbe") -> tuple[bool, str]:
        """The kubelet's HTTP probe of a pod (its rendered `kind` probe, named port mapped to this host's)."""
        pod = self.pod(which)
        spec = pod.probes[kind]
        get = spec["httpGet"]
        port = pod.ports.get(get["port"], get["port"])  # a named port is the container's port of that name
        return http_probe(LOOPBACK, port, get.get("path", "/"), float(spec.get("timeoutSeconds", 1)))

    # -- the pods' lifecycle ---------------------------------------------------------------------

    def pod(self, which: int | str) -> SimPod:
        return self.pods[which] if isinstance(which, int) else next(p for p in self.pods if p.name == which)

    def start_pod(self, which: int | str) -> SimPod:
        pod = self.pod(which)
        log = open(pod.log_path, "ab")  # noqa: SIM115 - kept open by the reader thread
        pod.process = subprocess.Popen(pod.argv, env=pod.env, cwd=pod.folder, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        thread = threading.Thread(target=self._pump, args=(pod, pod.process, log), daemon=True)
        thread.start()
        self._threads.append(thread)
        threading.Thread(target=self._kubelet, args=(pod, pod.process), daemon=True).start()
        return pod

    def _kubelet(self, pod: SimPod, process: subprocess.Popen[bytes]) -> None:
        watch_container(pod.name, pod.probes, pod.grace_seconds, process, lambda kind: self.probe(pod.name, kind),
                        lambda: self.kill(pod.name, signal.SIGKILL), self.log)

    def _pump(self, pod: SimPod, process: subprocess.Popen[bytes], log: Any) -> None:
        assert process.stdout is not None
        with log:
            for line in process.stdout:
                log.write(line)
                log.flush()
                if self.echo:
                    self.log(f"[{pod.name}] {line.decode(errors='replace').rstrip()}")

    def start(self) -> None:
        for pod in self.pods:
            self.start_pod(pod.name)

    def kill(self, which: int | str, sig: int = signal.SIGKILL) -> None:
        """Signal every process of the pod, like a lost node (or a container whose PID 1 is gone).

        torchrun starts each worker in a session of its own, so the pod's process group is not enough.
        """
        pod = self.pod(which)
        if pod.process is None or pod.process.poll() is not None:
            return
        below = _descendants(pod.process.pid)
        if below is None:  # no /proc: the process group, which torchrun's workers have left
            os.killpg(pod.process.pid, sig)
            return
        for pid in [pod.process.pid, *below]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self) -> None:
        for pod in self.pods:
            self.kill(pod.name, signal.SIGKILL)
        for pod in self.pods:
            if pod.process is not None:
                pod.process.wait()

    def run(self, timeout: float | None = None, poll: float = 0.5) -> SimResult:
        """Supervise the pods like their controller until the job succeeds or fails."""
        if not any(p.process for p in self.pods):
            self.start()
        k = self.cfg.k8s
        failures = 0
        ignored = controllers.ignored_exit_codes(self.workload_obj)
        deadline = None if timeout is None else time.monotonic() + timeout
        done: set[str] = set()
        while len(done) < len(self.pods):
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                return self._result(False, f"timed out after {timeout:g}s")
            for pod in self.pods:
                if pod.name in done or pod.process is None or pod.process.poll() is None:
                    continue
                code = pod.process.wait()
                pod.exit_codes.append(code)
                if code == 0:
                    done.add(pod.name)
                    continue
                if code == EXIT_BAD_INPUT and self.kind in ("Job", "JobSet"):
                    self.stop()
                    return self._result(False, f"{pod.name} exited {code} (bad input): the job fails at once")
                if code in ignored:  # podFailurePolicy Ignore: replaced, not counted
                    why = "stopped after a checkpoint" if code == EXIT_STOPPED_RESUMABLE else f"exited {code}"
                    self.log(f"[simulate] {pod.name} {why}, which the podFailurePolicy ignores; starting its "
                             "replacement")
                    self.start_pod(pod.name)
                    continue
                failures += 1
                if failures > k.backoff_limit:
                    self.stop()
                    why = f"{pod.name} exited {code}: backoffLimit {k.backoff_limit} reached"
                    return self._result(False, why)
                self.log(f"[simulate] {pod.name} exited {code}; starting its replacement "
                         f"(failure {failures} of backoffLimit {k.backoff_limit})")
                self.start_pod(pod.name)
            time.sleep(poll)
        for thread in self._threads:
            thread.join(timeout=10)
        return self._result(True, f"all {len(self.pods)} pods succeeded")

    def _result(self, ok: bool, message: str) -> SimResult:
        return SimResult(ok, message, {p.name: list(p.exit_codes) for p in self.pods})
