"""Can one pod's memory hold what its `nproc_per_node` processes keep in host memory? Refused at render.

The pod's memory request is also its limit: a pod that needs more is OOM-killed (exit 137, no message) minutes
after it was scheduled. The estimate is the one train, the launcher and `kubetrain doctor` make (kubetrain.memory),
for the pods' layout (k8s.nnodes x k8s.nproc_per_node processes, dist.strategy), made on the meta device.

- CPU pods train in host memory: each process holds its runtime (interpreter, torch) and its training state
  (weights, gradients, AdamW, activations, logits, the loader's batches, a background checkpoint's copy; sharded
  under FSDP/HSDP), so the pod needs nproc_per_node times that, and its launcher's runtime.
  Counted with a fused attention kernel (torch has one on the CPU): the smaller figure, so a config the pod's
  own check (train/memory_check.py, against its cgroup) would accept is never refused here.
- GPU pods keep the training state in GPU memory; the host still holds a whole copy of the weights per process
  while the model is built (on the CPU, then moved) and rank 0's gathered copy when it saves. The check asks
  for that much only: nproc_per_node copies of the weights, or one under FSDP where the model is built on the
  meta device (only rank 0 gathers the whole model, to save it), each process's runtime and the launcher's, and
  a background checkpoint's copy (rank 0's, or every rank's shards). The GPU side is `kubetrain doctor`'s, in
  the pod; a CUDA torch's runtime is larger than the CPU one counted, so the figure is the least the pod needs.

`run.check_memory: false` turns it off, as it turns off the pod's own check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kubetrain.config.schema import Config
from kubetrain.k8s.render.context import RenderError

if TYPE_CHECKING:  # kubetrain.memory imports torch: loaded when a pod's memory is checked, not by every render
    from kubetrain.memory import Estimate

GIB = 2**30


def size(n: float) -> str:
    """Bytes in GiB, or MiB below a tenth of one (a tiny model is not "0.0 GiB")."""
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def pod_estimate(cfg: Config, shape: dict[str, Any]) -> Estimate:
    """The estimate (kubetrain.memory) for the pods' layout: k8s.nnodes pods of k8s.nproc_per_node processes.

    On CPU pods with the CPU's precision and a fused attention kernel (torch has one on the CPU); on GPU pods
    with the configured precision (auto: bf16) and flash attention, the kernels a current GPU runs.
    """
    from kubetrain.hardware import Accelerator, choose_precision
    from kubetrain.memory import Layout, estimate
    from kubetrain.train.micro_batch import planning_config

    cfg = planning_config(cfg, Layout.of_pods(cfg))  # micro_batch_size auto: the smallest the pods may choose
    gpu = on_gpu(cfg)
    acc = Accelerator("cuda", (9, 0), True) if gpu else Accelerator("cpu")
    precision = choose_precision(cfg.train.precision, acc).name
    return estimate(cfg, shape, Layout.of_pods(cfg), "cuda" if gpu else "cpu", precision=precision,
                    attention="flash")


def host_need(cfg: Config, shape: dict[str, Any]) -> tuple[int, str, dict[str, int] | None]:
    """Bytes of host memory one pod needs, what they are in words, and the per-process parts on the CPU."""
    est = pod_estimate(cfg, shape)
    procs = est.layout.local_processes
    launcher = f"the launcher's {size(est.launcher_runtime)}"
    if est.device == "cpu":
        return est.host_need, (f"{procs} x up to {size(est.per_process)} on the CPU: training state and runtime; "
                               f"{launcher}"), est.parts
    why = ("under FSDP, rank 0 gathers them to save" if est.host_copies == 1 and est.layout.sharded
           else "each process builds the model on the CPU")
    staging = f", a checkpoint's copy {size(est.host_staging)}" if est.host_staging else ""
    return est.host_need, (f"{est.host_copies} x {size(est.host_weights)} of weights in host memory ({why}), "
                           f"{procs} x {size(est.host_runtime)} of runtime, {launcher}{staging}"), None


def on_gpu(cfg: Config) -> bool:
    """Whether the pods train on their GPUs (requested, and not run.device: cpu)."""
    return cfg.k8s.resources.gpu > 0 and cfg.run.device != "cpu"


def check_pod_memory(cfg: Config) -> None:
    """Raise RenderError (one line: the request, the estimate, what to change) when a pod cannot hold its
    processes; silent when the model's size is not known here (a Hugging Face folder only the pods mount)."""
    from kubetrain.k8s.quantities import quantity

    memory = cfg.k8s.resources.memory
    if not cfg.run.check_memory or memory is None:
        return
    from kubetrain.memory import model_shape  # torch: only when there is a request to check

    shape = model_shape(cfg)
    if "error" in shape:
        return
    need, what, parts = host_need(cfg, shape)
    if need <= quantity(memory):
        return
    raise RenderError(
        f"k8s.resources.memory ({memory}) cannot hold what a pod's processes need: about {size(need)} "
        f"({what}; `kubetrain doctor CONFIG` shows the estimate); {pod_advice(cfg, parts)}, or set "
        "run.check_memory=false to render anyway")


def pod_advice(cfg: Config, parts: dict[str, int] | None) -> str:
    """More memory first; then what shrinks the largest part (CPU), or the host copies (GPU)."""
    from kubetrain.memory import Layout, what_to_change

    k = cfg.k8s
    fewer = f"run fewer processes per pod (k8s.nproc_per_node {k.nproc_per_node})" if k.nproc_per_node > 1 else None
    shrink: str | None = what_to_change(parts, Layout.of_pods(cfg)) if parts is not None else (
        "build the model sharded with dist.strategy=fsdp" if cfg.dist.strategy not in ("fsdp", "hsdp") else None)
    return "; ".join(x for x in ("raise k8s.resources.memory", fewer, shrink) if x)
