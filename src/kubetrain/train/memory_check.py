"""Before a model is built: will training it fit in the memory free here? Refuse at once if it will not.

Without this a model too big for RAM is OOM-killed minutes later (exit 137, no message). The estimate is
`kubetrain doctor`'s (weights, gradients, AdamW, activations, logits), made on the meta device.
"""

from __future__ import annotations

from pathlib import Path

from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError

GIB = 2**30


def check_memory(cfg: Config, local_processes: int = 1, launcher: bool = False) -> None:
    """Raise UserInputError (one line: the estimate and what to change) when training `cfg` cannot fit here.

    `local_processes`: the processes of this run on this machine; on the CPU they share its RAM.
    `launcher`: the check of `--nproc`'s launcher, for CPU runs only (each GPU worker checks its own device;
    the launcher must not take a GPU context for the whole job). Off with run.check_memory=false; silent when
    the size or the free memory is not known.
    """
    if not cfg.run.check_memory:
        return
    if launcher:
        from kubetrain.distributed.setup import local_device

        if local_device(cfg.run.device).type != "cpu":  # no CUDA context: is_available() does not make one
            return
    from kubetrain.doctor import doctor

    report = doctor(cfg)
    fit, device = report["fit"], report["device"]
    if fit["estimate"] is None or fit["free"] is None:
        return
    on_cpu = device["kind"] == "cpu"
    shared = local_processes if on_cpu else 1
    need = fit["estimate"] * shared
    free = min(fit["free"], container_memory_free() or fit["free"]) if on_cpu else fit["free"]
    if need <= free:
        return
    parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in fit["parts"].items())
    each = f" per process, x{shared} processes" if shared > 1 else ""
    raise UserInputError(
        f"this run needs about {need / GIB:.1f} GiB ({parts} GiB{each}; {fit['params']:,} parameters, "
        f"`kubetrain doctor CONFIG` shows the estimate) but {free / GIB:.1f} GiB is free on {device['kind']}; "
        f"{what_to_change(fit['parts'])}, or set run.check_memory=false to start anyway")


def what_to_change(parts: dict[str, int]) -> str:
    """The settings that shrink the largest part of the estimate."""
    largest = max(parts, key=lambda name: parts[name])
    if largest in ("activations", "logits"):
        return ("lower train.micro_batch_size (raise train.grad_accum_steps to keep the batch) or "
                "model.block_size, or set model.gradient_checkpointing=true")
    return "use a smaller model, train LoRA adapters (model.lora), or shard it over GPUs with dist.strategy=fsdp"


def container_memory_free() -> int | None:
    """Bytes this container's cgroup may still allocate (v2, then v1); None without a limit.

    /proc/meminfo shows the host's memory, so a pod limited to 8 GiB on a 512 GiB node would pass without this.
    """
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 2**62:  # no limit (v1 writes a huge number)
            return None
        return max(0, int(limit_text) - usage)
    return None
