"""`kubetrain doctor [CONFIG]`: can this machine run this config, and what would a run here pick?

No cluster needed: the device and its memory, bf16, the attention kernels usable for the config's head size
and dtype, versions, free disk where the run writes, the optional extras installed; with a config, an
estimate of the training memory against the memory free, and the settings a run here would use.
"""

from __future__ import annotations

import json
import re
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from kubetrain import hardware
from kubetrain.config.schema import Config
from kubetrain.memory import DTYPES, Layout, estimate, first_usable, model_shape


def doctor(cfg: Config | None, layout: Layout | None = None) -> dict[str, Any]:
    """The whole report as plain data (what --json prints); the memory estimate is for the processes of
    `layout` (default: one process)."""
    from kubetrain.train.device import select_device
    from kubetrain.train.micro_batch import resolve_batch

    device = select_device(cfg.run.device if cfg else "auto")
    auto = None
    if cfg is not None:  # what a run here would train with: micro_batch_size auto chosen, grad accumulation derived
        cfg, auto = resolve_batch(cfg, layout or Layout.of(cfg), device)
    # the same function the loop asks, so "bf16: no" never stands beside "precision bf16" unexplained
    choice = hardware.choose_precision(cfg.train.precision if cfg else "auto", hardware.accelerator(device))
    precision = choice.name
    shape = model_shape(cfg) if cfg else None
    head_dim, n_head = (shape["head_dim"], shape["n_head"]) if shape and "head_dim" in shape else (64, 2)
    info = hardware.device_info(device)
    backends = hardware.sdpa_backends(device, DTYPES[precision], head_dim, n_head)
    report: dict[str, Any] = {
        "device": info.to_json(),
        "bf16": hardware.bf16_supported(device),
        "precision": {"name": choice.name, "reason": choice.reason, "warning": choice.warning},
        "sdpa": {"dtype": precision, "head_dim": head_dim, "backends": backends},
        "versions": hardware.versions(),
        "disk": disk_free(Path(cfg.run.output_dir) if cfg else Path.cwd()),
        "extras": installed_extras(),
    }
    if cfg is not None:
        attention = first_usable(backends)
        report["settings"] = settings(cfg, device, precision, attention, (layout or Layout.of(cfg)).world_size)
        report["micro_batch"] = auto.to_json() | {"line": auto.describe()} if auto else None
        report["fit"] = fit_estimate(cfg, shape, precision, attention, info.memory_free, layout, device.type)
    return report


def disk_free(where: Path) -> dict[str, Any]:
    """Free bytes on the file system that holds `where` (its nearest existing folder)."""
    path = where.expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return {"path": str(where), "free": shutil.disk_usage(path).free}


def installed_extras() -> dict[str, list[str]]:
    """Each optional extra of kubetrain -> its packages that are missing (empty: installed)."""
    try:
        requirements = metadata.requires("kubetrain") or []
    except metadata.PackageNotFoundError:
        return {}
    extras: dict[str, list[str]] = {}
    for req in requirements:
        extra = re.search(r'extra\s*==\s*"([^"]+)"', req)
        name = re.match(r"[A-Za-z0-9_.-]+", req)
        if extra is None or name is None or extra.group(1) in ("all", "dev"):
            continue  # required packages, and the extras made of other extras
        missing = extras.setdefault(extra.group(1), [])
        try:
            metadata.version(name.group(0))
        except metadata.PackageNotFoundError:
            missing.append(name.group(0))
    return extras


def fit_estimate(
    cfg: Config, shape: dict[str, Any] | None, precision: str, attention: str | None, free: int | None,
    layout: Layout | None = None, device: str = "cpu",
) -> dict[str, Any]:
    """The memory estimate (`memory.estimate`) against `free`, or why it cannot be estimated.

    It fits when what the device must hold (`device_need`: one process's share on a GPU, all the node's
    processes on the CPU, whose RAM they share) is at most what is free.
    """
    if not shape or "error" in shape:
        return {"estimate": None, "reason": (shape or {}).get("error", "unknown model")}
    est = estimate(cfg, shape, layout or Layout.of(cfg), device, precision=precision, attention=attention)
    return est.to_json() | {"free": free, "fits": None if free is None else est.device_need <= free}


def settings(cfg: Config, device: torch.device, precision: str, attention: str | None,
             world_size: int = 1) -> dict[str, Any]:
    """What a run of `cfg` started here would use, over `world_size` processes (tokens per step counts them all,
    as the run's own line does)."""
    from kubetrain.train.device import peak_flops, torch_settings

    torch_set = torch_settings(cfg, device.type)
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    return {
        "device": str(device), "precision": precision, "attention": attention or "none usable",
        "dist_backend": backend, "strategy": cfg.dist.strategy,
        "compile": hardware.compile_choice(cfg.train.compile, device).enabled,
        "threads": cfg.run.threads or torch.get_num_threads(), "deterministic": torch_set.deterministic,
        "tf32": torch_set.tf32, "peak_flops": peak_flops(device, precision, torch_set.tf32),
        "micro_batch_size": cfg.train.micro_batch, "grad_accum_steps": cfg.train.grad_accum_steps,
        "tokens_per_step": cfg.train.micro_batch * cfg.train.grad_accum_steps * world_size * cfg.model.block_size,
    }


def render(report: dict[str, Any]) -> str:
    """The report for a terminal, one fact per line."""
    d = report["device"]
    count = f"{d['count']} cores" if d["kind"] == "cpu" else f"x{d['count']}"
    lines = [f"device: {d['kind']} - {d['name']} ({count}), memory {_gib(d['memory_free'])} free of "
             f"{_gib(d['memory_total'])}", f"bf16: {'yes' if report['bf16'] else 'no'}"]
    p = report["precision"]
    lines.append(f"precision: {p['name']} ({p['reason']})" + (f" - warning: {p['warning']}" if p["warning"] else ""))
    sdpa = report["sdpa"]
    lines.append(f"attention kernels (SDPA, {sdpa['dtype']}, head size {sdpa['head_dim']}):")
    lines += [f"  {name}: {why}" for name, why in sdpa["backends"].items()]
    v = report["versions"]
    lines.append("versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) +
                 ("" if v["nccl"] else ", nccl not available"))
    lines.append(f"disk: {_gib(report['disk']['free'])} free at {report['disk']['path']}")
    lines.append("extras: " + ", ".join(f"{name} {'yes' if not missing else 'no (' + ', '.join(missing) + ')'}"
                                        for name, missing in report["extras"].items()))
    if "settings" in report:
        lines.append("a run here would use: " + ", ".join(f"{k} {json.dumps(val)}"
                                                          for k, val in report["settings"].items()))
        if report.get("micro_batch"):
            lines.append(f"micro-batch: {report['micro_batch']['micro_batch_size']} (auto: "
                         f"{report['micro_batch']['line']}; a run confirms it by one training step)")
        lines.append(_fit_line(report["fit"]))
    return "\n".join(lines)


def _fit_line(fit: dict[str, Any]) -> str:
    if fit["estimate"] is None:
        return f"memory: not estimated ({fit['reason']})"
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in fit["parts"].items())
    verdict = "unknown free memory" if fit["fits"] is None else "fits" if fit["fits"] else "does NOT fit"
    per = "one process"
    if fit["world_size"] > 1:
        per = f"each of {fit['world_size']} processes ({fit['strategy']}"
        per += f", sharded {fit['shards']} ways)" if fit["shards"] > 1 else ")"
    node = ""
    if fit["device_need"] != fit["estimate"]:  # on the CPU the node's processes share its RAM
        node = f"; {fit['local_processes']} processes on this node need {_gib(fit['device_need'])} together"
    return (f"memory (an estimate): {_gib(fit['estimate'])} in {per} for {fit['params']:,} parameters and one "
            f"micro-batch ({parts}){node} - {verdict} in {_gib(fit['free'])} free")


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.2f} GiB"
