"""The distributed path on one device: the launcher (a save, a resume), background checkpoints, DDP and FSDP.

With one device there is one process: under `kubetrain train --nproc 1` the world size is 1 and the trainer,
rightly, makes no process group and wraps nothing. So DDP and FSDP (kubetrain's FSDP2 sharding) are checked
here on a world-1 process group of the device's backend (NCCL on a GPU, gloo on the CPU): their collectives
run for real, and their loss curve must match the unwrapped model's.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.selftest import Outcome, judged
from kubetrain.selftest.context import Context, kubetrain, last_line, max_abs_diff, records, sets
from kubetrain.selftest.context import overrides as run_overrides
from kubetrain.selftest.speed import precision, shape

WRAPPED_TOLERANCE = 1e-4  # one rank: the all-reduce and the shard are identities, only kernel order may differ
ASYNC_RATIO = 0.5  # a background save may block training for at most half of what writing it takes


def _launch_sets(ctx: Context, steps: int, strategy: str) -> list[str]:
    extra = [f"train.max_steps={steps}", f"dist.strategy={strategy}", f"checkpoint.every_steps={2 if ctx.quick else 4}",
             "checkpoint.keep_last=10", "checkpoint.async_save=true"]
    if not ctx.quick:  # the gpt2-124m shape, so a save takes seconds while the GPU is busy with the next steps
        s = shape(ctx)
        extra += ["data.tokenizer.kind=byte", f"model.vocab_size={s['vocab_size']}", f"model.n_layer={s['n_layer']}",
                  f"model.n_head={s['n_head']}", f"model.n_embd={s['n_embd']}", f"model.block_size={s['block_size']}",
                  "train.micro_batch_size=8", f"train.precision={precision(ctx)}"]
    return run_overrides(ctx, "launcher", *extra, tiny=ctx.quick)


_launches: list[dict[str, Any]] = []


def launcher(ctx: Context) -> Outcome:
    name = "distributed.launcher"
    first, second = (6, 8) if ctx.quick else (12, 16)
    backend = "nccl" if ctx.on_gpu else "gloo"
    for steps, strategy in ((first, "ddp"), (second, "fsdp")):
        args = ["train", "--preset", "tiny" if ctx.quick else "gpt2-124m", *sets(_launch_sets(ctx, steps, strategy)),
                "--nproc", "1", "--json"]
        proc = kubetrain(*args, timeout=600)
        if proc.returncode != 0:
            return Outcome(name, "failed", f"`kubetrain train --nproc 1` ({strategy}, {steps} steps) exited "
                           f"{proc.returncode}: {last_line(proc.stderr)}")
        _launches.append(json.loads(last_line(proc.stdout)))
    done, resumed = _launches
    figures = {"steps": [done["steps"], resumed["steps"]], "resumed_from": resumed["resumed_from"],
               "backend_if_several_processes": backend, "final_loss": resumed["final_train_loss"]}
    return judged(name, done["steps"] == first and resumed["resumed_from"] == first and resumed["steps"] == second,
                  f"`kubetrain train --nproc 1` under torch's elastic agent: {first} steps (dist.strategy ddp) saved, "
                  f"then a second launch (fsdp) resumed them to {second}; one process has no process group to "
                  "make, see distributed.ddp/fsdp for the collectives", figures,
                  f"the second launch resumes at step {first} and finishes at {second}")


def async_checkpoint(ctx: Context) -> Outcome:
    name = "distributed.async_checkpoint"
    if not _launches:
        return Outcome(name, "failed", "no launcher run to read (distributed.launcher failed)")
    finals = {launch["steps"] for launch in _launches}  # a run's final save waits for itself: not in the background
    run = Path(_launches[-1]["run_dir"])  # both launches trained one run directory
    saves = [r for r in records(run, "checkpoint") if r["step"] not in finals]
    blocked = sum(r["blocked_seconds"] for r in saves)
    written = sum(r["write_seconds"] for r in saves)
    ratio = blocked / written if written else float("inf")
    return judged(name, bool(saves) and ratio <= ASYNC_RATIO,
                  f"{len(saves)} background checkpoint(s) of the launcher runs, taken while training went on",
                  {"saves": len(saves), "blocked_seconds": blocked, "write_seconds": written,
                   "blocked_over_write": ratio}, f"training blocked <= {ASYNC_RATIO} x the time the save took")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join_world_of_one(ctx: Context) -> str:
    import torch
    import torch.distributed as td

    if not td.is_initialized():
        device = torch.device(ctx.device, 0) if ctx.on_gpu else None
        if device is not None:
            torch.cuda.set_device(device)
        td.init_process_group("nccl" if ctx.on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                              rank=0, world_size=1, device_id=device)
    return str(td.get_backend())


def _curve(ctx: Context, wrap: Callable[[Any], Any] | None) -> list[float]:
    """Losses of 8 AdamW steps of a 2-layer kubetrain GPT on fixed batches, wrapped by `wrap` (None: as it is)."""
    import torch

    from kubetrain.models.gpt import GPT, GPTConfig
    from kubetrain.models.loss import lm_loss

    device = torch.device(ctx.device, 0) if ctx.on_gpu else torch.device(ctx.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)).to(device)
    trained = wrap(model) if wrap else model
    opt = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (8, 4, 65), generator=torch.Generator().manual_seed(1)).to(device)
    out = []
    for batch in data:
        loss = lm_loss(trained(batch[:, :-1]), batch[:, 1:].contiguous())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


def wrapped(strategy: str) -> Callable[[Context], Outcome]:
    name = f"distributed.{strategy}"

    def check(ctx: Context) -> Outcome:
        import torch

        backend = _join_world_of_one(ctx)
        plain = _curve(ctx, None)
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [0] if ctx.on_gpu else None
            curve = _curve(ctx, lambda m: DDP(m, device_ids=ids))
        else:
            from torch.distributed.device_mesh import init_device_mesh

            from kubetrain.distributed.parallelize import precision_plan, shard

            mesh = init_device_mesh("cuda" if ctx.on_gpu else "cpu", (1,), mesh_dim_names=("dp_shard",))
            curve = _curve(ctx, lambda m: shard(m, mesh, precision_plan("fp32", sharded=True)))
        diff = max_abs_diff(plain, curve)
        if ctx.on_gpu:
            torch.cuda.synchronize()
        what = "DDP" if strategy == "ddp" else "FSDP2 (kubetrain's parallelize.shard, fp32)"
        return judged(name, diff <= WRAPPED_TOLERANCE,
                      f"{what} on a world-1 {backend} process group: 8 steps against the unwrapped model",
                      {"backend": backend, "max_abs_loss_diff": diff, "final_loss": curve[-1]},
                      f"max |loss difference| <= {WRAPPED_TOLERANCE}")

    return check


def links(ctx: Context) -> Outcome:
    """`--nproc N` processes run the job's preflight (distributed/preflight.py) as `kubetrain train --nproc N`
    does before step 1: every device, the all-reduce and send/recv bandwidth, the clocks; failed when it names one."""
    name = "distributed.links"
    if ctx.nproc < 2:
        return Outcome(name, "skipped", "one process has no links: `kubetrain doctor --check --nproc N` measures "
                       "those of N processes")
    items = run_overrides(ctx, "links", "train.max_steps=1", "dist.preflight.on_failure=warn")
    proc = kubetrain("train", "--preset", "tiny", *sets(items), "--nproc", str(ctx.nproc), "--resume", "never",
                     timeout=600)
    if proc.returncode != 0:
        return Outcome(name, "failed", f"`kubetrain train --nproc {ctx.nproc}` exited {proc.returncode}: "
                       f"{last_line(proc.stderr)}")
    report = json.loads((ctx.work / "runs" / "links" / "preflight.json").read_text())
    verdict, per_rank = report["verdict"], {e["rank"]: e for e in report["ranks"]}
    figures = {"seconds": report["seconds"], "backend": report["backend"], "world_size": report["world_size"],
               "all_reduce_bytes": report["all_reduce_bytes"], "median_all_reduce_busbw_gb_per_s":
               report["median_all_reduce_busbw"] / 1e9, "median_link_gb_per_s":
               report.get("median_link_bandwidth", 0.0) / 1e9, "problems": verdict["problems"],
               "latency_ms": {r: e["all_reduce"]["latency_seconds"] * 1e3 for r, e in per_rank.items()}}
    return judged(name, verdict["ok"], f"the preflight of {ctx.nproc} processes over {report['backend']}: "
                  + ("; ".join(verdict["problems"]) or "no rank named"), figures,
                  "every device passes; every ring link's send/recv at least half the median of the other links "
                  "of its class, within a node or across nodes (dist.preflight.min_bandwidth_fraction)")


def finish() -> None:
    import torch.distributed as td

    if td.is_initialized():
        td.destroy_process_group()


CHECKS: dict[str, Callable[[Context], Outcome]] = {
    "distributed.launcher": launcher,
    "distributed.async_checkpoint": async_checkpoint,
    "distributed.ddp": wrapped("ddp"),
    "distributed.fsdp": wrapped("fsdp"),
    "distributed.links": links,
}
