"""Run a job's pods as local processes: the multi-pod path (entrypoint, rendezvous, resume) without a cluster.

Each pod runs the container's own command and arguments with the environment its controller would give it
(JOB_COMPLETION_INDEX and hostname for an Indexed Job, RANK/WORLD_SIZE/PET_* for a PyTorchJob, ...). What a
cluster provides is mapped onto this machine: the job's DNS names to 127.0.0.1, the rendezvous port to a free
local port, each volume to a local folder (a claim shared by the pods, a folder of the user's with
`--volume NAME=PATH`; emptyDirs per pod), and the controller's restart of failed pods (backoffLimit,
podFailurePolicy) is done here. The pods share one host where a cluster gives each its own network namespace,
so each pod gets its own metrics and launcher ports (its copy of the ConfigMap names them). Each pod is probed as
its kubelet would (`probe`: the HTTP prober's request for the rendered startup and liveness probes), and a
container whose probe failed failureThreshold times in a row is ended as the kubelet ends it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import kubetrain
from kubetrain.config.k8s import RESERVED_ENV
from kubetrain.config.loading import validate as validate_config
from kubetrain.config.schema import Config
from kubetrain.distributed.env import POD_NAME_ENV
from kubetrain.errors import EXIT_BAD_INPUT, EXIT_STOPPED_RESUMABLE, UserInputError
from kubetrain.k8s.render.context import CACHE_MOUNT, CONFIG_FILE, CONFIG_MOUNT
from kubetrain.k8s.render.manifest import pod_templates, render
from kubetrain.k8s.render.podspec import LAUNCHER_PORT_NAME, METRICS_PORT_NAME
from kubetrain.k8s.render.trainjob import RUNTIME_PORT

Log = Callable[[str], None]
LOOPBACK = "127.0.0.1"
# Variables of this machine that would confuse a simulated pod: those kubetrain, the launcher or the controller
# set (config.k8s.RESERVED_ENV), and the few more a controller gives a pod.
_FOREIGN_ENV = re.compile(rf"{RESERVED_ENV.pattern}|^(HOSTNAME|JOBSET_.*)$")


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def free_port_pair(taken: set[int]) -> int:
    """A free port P with P + 1 free too (rank 0's exporter and its launcher's), neither in `taken`."""
    for _ in range(100):
        port = free_port()
        if port >= 65535 or {port, port + 1} & taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports on this machine")


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


def _map_path(value: str, mounts: dict[str, Path]) -> str:
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount + "/"):
            return str(mounts[mount]) + value[len(mount):]
    return value


def _map_tree(value: Any, mounts: dict[str, Path]) -> Any:
    if isinstance(value, dict):
        return {k: _map_tree(v, mounts) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tree(v, mounts) for v in value]
    return _map_path(value, mounts) if isinstance(value, str) else value


_INPUT_KEYS = ("path", "name_or_path")  # config keys whose value the training reads (data, tokenizer, model)


def _inputs(value: Any, key: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) of every input path in a config (data.sources.0.path, model.name_or_path, ...)."""
    if isinstance(value, dict):
        return [found for k, v in value.items() for found in _inputs(v, f"{key}.{k}" if key else str(k))]
    if isinstance(value, list):
        return [found for i, v in enumerate(value) for found in _inputs(v, f"{key}.{i}")]
    if isinstance(value, str) and key.rsplit(".", 1)[-1] in _INPUT_KEYS and value.startswith("/"):
        return [(key, value)]
    return []


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
        self.shared = self._shared_mounts()
        self._check_inputs()
        self.pods = self._pods()
        self._threads: list[threading.Thread] = []

    # -- what the cluster would provide -----------------------------------------------------------

    def _claims(self) -> list[tuple[str, str, str]]:
        """(volume name, claim name, mount path) of each claim the pods mount."""
        template = pod_templates(self.workload_obj)[0][1]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]
                  if "persistentVolumeClaim" in v}
        return [(m["name"], claims[m["name"]], m["mountPath"])
                for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] in claims]

    def _shared_mounts(self) -> dict[str, Path]:
        """The claims, one local folder each, shared by all pods: the folder bound with --volume, else an empty
        one of the simulation (one per claim: a claim mounted twice is one folder)."""
        claims = self._claims()
        known = {n for volume, claim, _ in claims for n in (volume, claim)}
        unknown = sorted(set(self.bound) - known)
        if unknown:
            raise UserInputError(f"--volume {unknown[0]}=...: the pods mount no claim or volume of that name "
                                 f"(they mount: {', '.join(sorted(known)) or 'none'})")
        mounts: dict[str, Path] = {}
        folders: dict[str, Path] = {}
        for volume, claim, mount_path in claims:
            bound = self.bound.get(volume) or self.bound.get(claim)
            if bound is not None and not bound.is_dir():
                raise UserInputError(f"--volume {volume}={bound}: not a folder")
            folder = folders.setdefault(claim, bound or self.root / "volumes" / volume)
            folder.mkdir(parents=True, exist_ok=True)
            mounts[mount_path] = folder
        return mounts

    def _check_inputs(self) -> None:
        """Refuse, naming the claim and the flag, an input of the config that lies on a claim where nothing is
        (an unbound claim is an empty folder): the pods would fail one by one with "not found"."""
        config_map = next(o for o in self.objects if o["kind"] == "ConfigMap")
        raw = yaml.safe_load(config_map["data"][CONFIG_FILE])
        for key, value in _inputs(raw):
            for volume, claim, mount_path in self._claims():
                if not (value == mount_path or value.startswith(mount_path + "/")):
                    continue
                local = _map_path(value, self.shared)
                if not any(Path("/").glob(local.lstrip("/"))) and not Path(local).exists():
                    where = ("the folder bound to it" if volume in self.bound or claim in self.bound
                             else "an empty folder of the simulation")
                    raise UserInputError(
                        f"{key} ({value}) is on the claim '{claim}' (volume {volume}, mounted at {mount_path}), "
                        f"which the simulation maps to {where} ({self.shared[mount_path]}), where it is not found: "
                        f"bind a local folder holding it with --volume {volume}=PATH")

    def _write_config(self, folder: Path, mounts: dict[str, Path], ports: dict[str | int, int]) -> Path:
        """This pod's copy of the ConfigMap: paths mapped to the pod's folders, its own metrics port."""
        config_map = next(o for o in self.objects if o["kind"] == "ConfigMap")
        raw = _map_tree(yaml.safe_load(config_map["data"][CONFIG_FILE]), mounts)
        prometheus = (raw.get("track") or {}).get("prometheus")
        if prometheus and self.cfg.k8s.metrics.port in ports:
            prometheus["port"] = ports[self.cfg.k8s.metrics.port]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / CONFIG_FILE
        path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        return path

    def _container(self, template: dict[str, Any]) -> dict[str, Any]:
        main = dict(template["spec"]["containers"][0])
        if self.kind == "TrainJob":  # the runtime takes command, args and env from spec.trainer
            trainer = self.workload_obj["spec"]["trainer"]
            main.update(command=trainer["command"], args=trainer["args"], env=trainer["env"])
        return main

    def _pod_names(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(pod name, DNS name, template) per node rank, named as the controller names them."""
        n, name = self.cfg.k8s.nnodes, self.name
        templates = dict(pod_templates(self.workload_obj))
        if self.kind == "PyTorchJob":
            return [(f"{name}-master-0", f"{name}-master-0", templates["master"])] + [
                (f"{name}-worker-{i}", f"{name}-worker-{i}", templates["worker"]) for i in range(n - 1)
            ]
        if self.kind in ("JobSet", "TrainJob"):
            return [(f"{name}-node-0-{i}", f"{name}-node-0-{i}.{name}", templates["node"]) for i in range(n)]
        return [(f"{name}-{i}", f"{name}-{i}.{name}", templates["node"]) for i in range(n)]

    def _controller_env(self, rank: int, pod_name: str) -> dict[str, str]:
        k = self.cfg.k8s
        env = {"HOSTNAME": pod_name}
        if self.kind in ("Job", "JobSet", "TrainJob"):
            env["JOB_COMPLETION_INDEX"] = str(rank)
        if self.kind == "PyTorchJob":
            # training-operator v1.9: WORLD_SIZE counts processes, RANK is the node's (master 0, worker i+1)
            env.update(MASTER_ADDR=f"{self.name}-master-0", MASTER_PORT=str(k.rdzv_port),
                       WORLD_SIZE=str(k.nnodes * k.nproc_per_node), RANK=str(rank),
                       PET_NODE_RANK=str(rank), PET_NNODES=str(k.nnodes),
                       PET_NPROC_PER_NODE=str(k.nproc_per_node), PYTHONUNBUFFERED="0")
        if self.kind == "TrainJob":
            env.update(PET_NNODES=str(k.nnodes), PET_NPROC_PER_NODE=str(k.nproc_per_node),
                       PET_NODE_RANK=str(rank), PET_MASTER_ADDR=f"{self.name}-node-0-0.{self.name}",
                       PET_MASTER_PORT=str(RUNTIME_PORT))
        return env

    def _env_value(self, item: dict[str, Any], pod_name: str) -> str | None:
        if "value" in item:
            return str(item["value"])
        source = item.get("valueFrom", {})
        field_path = source.get("fieldRef", {}).get("fieldPath", "")
        if field_path == "status.podIP":
            return LOOPBACK
        if field_path in ("metadata.name", "spec.nodeName"):  # every simulated pod runs on this one node
            return pod_name if field_path == "metadata.name" else socket.gethostname()
        if "jobset.sigs.k8s.io/job-index" in field_path:
            return "0"  # one replicated job
        if "secretKeyRef" in source:  # a Secret of the cluster: this machine's variable of that name, if any
            return os.environ.get(item["name"])
        return None

    def _pods(self) -> list[SimPod]:
        names = self._pod_names()
        dns = {d: LOOPBACK for _, d, _ in names} | {p: LOOPBACK for p, _, _ in names}
        base = {k: v for k, v in os.environ.items() if not _FOREIGN_ENV.match(k)}
        src = str(Path(kubetrain.__file__).resolve().parents[1])  # this kubetrain, also in the pods
        base["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
        pods = []
        taken = {self.port}
        for rank, (pod_name, _, template) in enumerate(names):
            folder = self.root / "pods" / pod_name
            own = {"/tmp": folder / "tmp", CACHE_MOUNT: folder / "cache", "/dev/shm": folder / "shm"}
            for path in own.values():
                path.mkdir(parents=True, exist_ok=True)
            main = self._container(template)
            ports = self._ports(main, taken)
            mounts = {**self.shared, **own, CONFIG_MOUNT: folder / "configmap"}
            self._write_config(folder / "configmap", mounts, ports)
            env = dict(base)
            for item in main["env"]:
                value = self._env_value(item, pod_name)
                if value is not None:
                    env[item["name"]] = value
            env.update(self._controller_env(rank, pod_name))
            if self.kind == "TrainJob":
                env["PET_MASTER_PORT"] = str(self.port)  # the runtime's fixed port, mapped to a free one
            # names that must resolve become loopback; the pod's own name (HOSTNAME, the downward API's) stays
            env = {k: v if k in ("HOSTNAME", POD_NAME_ENV) else dns.get(v, _map_path(v, mounts))
                   for k, v in env.items()}
            args = [_map_path(a, mounts) for a in main["args"] if a != "--idle-after-finish"]
            argv = [sys.executable, "-m", "kubetrain", *main["command"][1:], *args]
            probes: dict[str, dict[str, Any]] = {k: main[k] for k in ("startupProbe", "livenessProbe") if k in main}
            grace = float(template["spec"].get("terminationGracePeriodSeconds", 30))
            pods.append(SimPod(pod_name, env, argv, folder, ports, probes, grace))
        return pods

    def _ports(self, container: dict[str, Any], taken: set[int]) -> dict[str | int, int]:
        """The container's ports on this host: the rendezvous port is the job's; the metrics port and the
        launcher's (the next one) are the pod's own, since the pods share one network namespace here (also where
        the template declares none: a TrainJob's runtime owns its pod template)."""
        k = self.cfg.k8s
        ports: dict[str | int, int] = {k.rdzv_port: self.port}
        names = {int(p["containerPort"]): str(p["name"]) for p in container.get("ports", []) if p.get("name")}
        if k.metrics.enabled:
            base = free_port_pair(taken)
            taken.update({base, base + 1})
            ports.update({k.metrics.port: base, k.metrics.port + 1: base + 1})
            names.setdefault(k.metrics.port, METRICS_PORT_NAME)
            names.setdefault(k.metrics.port + 1, LAUNCHER_PORT_NAME)
        ports.update({name: ports[number] for number, name in names.items() if number in ports})
        return ports

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
        """The kubelet's prober for one container (pkg/kubelet/prober): the startup probe every periodSeconds until
        it succeeds, then the liveness probe; failureThreshold failures in a row (of either) end the container as
        the kubelet does, SIGTERM and SIGKILL after terminationGracePeriodSeconds, and its controller sees it exit."""
        for kind in ("startupProbe", "livenessProbe"):
            spec = pod.probes.get(kind)
            if spec is None:
                continue
            period, threshold = float(spec.get("periodSeconds", 10)), int(spec.get("failureThreshold", 3))
            failures = 0
            time.sleep(float(spec.get("initialDelaySeconds", 0)))
            while process.poll() is None:
                alive, detail = self.probe(pod.name, kind)
                if process.poll() is not None:
                    return
                failures = 0 if alive else failures + 1
                if alive and kind == "startupProbe":
                    break
                if failures >= threshold:
                    self.log(f"[simulate] {pod.name}: {kind} failed {failures} times ({detail}); the kubelet ends "
                             "the container")
                    process.send_signal(signal.SIGTERM)
                    try:
                        process.wait(timeout=pod.grace_seconds)
                    except subprocess.TimeoutExpired:
                        self.kill(pod.name, signal.SIGKILL)
                    return
                time.sleep(period)

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
                if code in self._ignored_exit_codes():  # podFailurePolicy Ignore: replaced, not counted
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

    def _ignored_exit_codes(self) -> set[int]:
        """The exit codes of the rendered Job's podFailurePolicy `Ignore` rules (a JobSet's Jobs have it too)."""
        jobs = [self.workload_obj] if self.kind == "Job" else [
            j.get("template", {}) for j in self.workload_obj["spec"].get("replicatedJobs", [])]
        policies = [(j.get("spec") or {}).get("podFailurePolicy") or {} for j in jobs]
        return {code for policy in policies for rule in policy.get("rules", [])
                if rule["action"] == "Ignore" and (rule.get("onExitCodes") or {}).get("operator") == "In"
                for code in rule["onExitCodes"]["values"]}

    def _result(self, ok: bool, message: str) -> SimResult:
        return SimResult(ok, message, {p.name: list(p.exit_codes) for p in self.pods})
