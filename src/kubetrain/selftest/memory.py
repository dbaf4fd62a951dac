"""Memory: doctor's estimate against what the device shows (on a GPU the allocator's peak, on the CPU the peak
resident memory of every process of a run), and on a GPU the one-line out-of-memory error."""

from __future__ import annotations

from collections.abc import Callable

from kubetrain.selftest import Outcome, judged, skipped
from kubetrain.selftest.context import Context, config, kubetrain, last_line, sets, train
from kubetrain.selftest.context import overrides as run_overrides
from kubetrain.selftest.speed import precision, shape

LOW, HIGH = 0.9, 1.15  # estimate / measured: under the peak lets a run start that cannot fit; over it refuses runs
# that fit and makes micro_batch_size: auto choose less than the device holds
CPU_LOW = 0.85  # on the CPU the resident set also holds what the allocator keeps after a free: the 15%
OOM_MICRO_BATCH = 512  # gpt2-124m at 512 x 1024 tokens: hundreds of GiB of activations, on any GPU made so far
NO_OOM_ON_CPU = "on the CPU the kernel may overcommit, so no out-of-memory error is certain to come"
# The CPU run: a GPT of 4 x 256 at 8 x 256 tokens, 3 steps with a background checkpoint overlapping the third
CPU_SHAPE = ("data.tokenizer.kind=byte", "model.n_layer=4", "model.n_embd=256", "model.n_head=4",
             "model.block_size=256", "train.micro_batch_size=8", "train.grad_accum_steps=1", "train.max_steps=3",
             "checkpoint.every_steps=2")


def skip_group(ctx: Context) -> str | None:
    """Why no item of this group can run here (the runner then starts no process for it)."""
    if ctx.device == "mps":
        return ("CUDA and CPU only: MPS shares memory with the host, and neither the allocator's peak nor the "
                "resident set is the run's alone")
    return None


def _shape_sets(ctx: Context, micro_batch: int | None = None) -> list[str]:
    s = shape(ctx)
    return ["data.tokenizer.kind=byte", f"model.vocab_size={s['vocab_size']}", f"model.n_layer={s['n_layer']}",
            f"model.n_head={s['n_head']}", f"model.n_embd={s['n_embd']}", f"model.block_size={s['block_size']}",
            f"train.micro_batch_size={micro_batch or s['batch']}", "train.grad_accum_steps=1",
            f"train.precision={precision(ctx)}"]


def estimate(ctx: Context) -> Outcome:
    name = "memory.estimate"
    if not ctx.on_gpu:
        return _estimate_on_cpu(ctx, name)
    import torch

    from kubetrain.doctor import doctor

    figures: dict[str, dict[str, object]] = {}
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        cfg = config(ctx, f"memory-estimate-{mode}", *_shape_sets(ctx), f"train.compile={compiled}",
                     "train.max_steps=6", "train.log_every_steps=2", preset="gpt2-124m", tiny=False)
        predicted = doctor(cfg)["fit"]
        predicted["estimate"] -= predicted["parts"].get("cuda_context", 0)  # the allocator does not see it
        torch.cuda.reset_peak_memory_stats()
        _, rows = train(cfg)
        # the trainer reads and resets the allocator's peak at every logged step: its largest window is the peak
        measured = max([int(r["memory_gib"] * 2**30) for r in rows] + [torch.cuda.max_memory_allocated()])
        figures[mode] = {"estimate_bytes": predicted["estimate"], "measured_bytes": measured,
                         "estimate_over_measured": predicted["estimate"] / measured, "parts": predicted["parts"]}
    ratios = [float(str(f["estimate_over_measured"])) for f in figures.values()]
    return judged(name, all(LOW <= r <= HIGH for r in ratios),
                  "doctor's estimate for the speed check's shape, eager and compiled, against "
                  "torch.cuda.max_memory_allocated", figures, f"{LOW} <= estimate / measured <= {HIGH}, both")


def _estimate_on_cpu(ctx: Context, name: str) -> Outcome:
    """`kubetrain doctor`'s estimate against the peak resident memory of a real `kubetrain train` of the same
    config (kubetrain/selftest/resident.py: every process reports its own peak)."""
    from kubetrain.selftest.resident import estimate_against_peak

    items = run_overrides(ctx, "memory-estimate-cpu", *CPU_SHAPE, tiny=False)
    figures = estimate_against_peak(["--preset", "tiny", *sets(items)], timeout=600)
    ratio = float(figures["estimate_over_measured"])
    return judged(name, CPU_LOW <= ratio <= HIGH, "doctor's estimate of a 4 x 256 GPT's run (runtime, training "
                  "state, loader, checkpoint copy, eval) against the peak resident memory of its process",
                  figures, f"{CPU_LOW} <= estimate / measured <= {HIGH}")


def out_of_memory(ctx: Context) -> Outcome:
    name = "memory.oom"
    if not ctx.on_gpu:
        return skipped(name, f"GPU only: {NO_OOM_ON_CPU}; on the CPU a run that cannot fit is refused before it "
                       "starts")
    items = run_overrides(ctx, "memory-oom", *_shape_sets(ctx, OOM_MICRO_BATCH), "train.max_steps=2",
                          "run.check_memory=false", tiny=False)
    proc = kubetrain("train", "--preset", "gpt2-124m", *sets(items), timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    one_line = len(errors) == 1 and "out of memory" in errors[0] and "Traceback" not in proc.stderr
    return judged(name, proc.returncode == 1 and one_line,
                  f"gpt2-124m at micro-batch {OOM_MICRO_BATCH} with the memory check off",
                  {"exit_code": proc.returncode, "error": errors[0] if errors else last_line(proc.stderr)},
                  "exit 1 and one `error: ... out of memory ...` line, no traceback")


CHECKS: dict[str, Callable[[Context], Outcome]] = {"memory.estimate": estimate, "memory.oom": out_of_memory}
