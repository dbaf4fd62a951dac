"""`kubetrain doctor --check`: a short, real training self-test of this machine's device.

Each group of checks (correctness, speed, memory, distributed, hf) is one module and runs in its own process
(`python -m kubetrain.selftest.group NAME`), so a crash or a leak in one group cannot take the report down or
skew another's memory. Every item reports passed, failed or skipped, with why, its figures and its tolerance.
The group processes drive kubetrain through its public entry points: the CLI, `train_all`, `export`, `generate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# One table: every group and the items it reports, in order (the runner marks an item the group never
# reported as failed, so a group that dies mid-way still accounts for each of its items).
GROUPS: dict[str, tuple[str, ...]] = {
    "correctness": ("correctness.cpu_match", "correctness.bf16", "correctness.fp16", "correctness.resume"),
    "speed": ("speed.eager", "speed.compiled", "speed.overhead", "speed.reference"),
    "memory": ("memory.estimate", "memory.oom"),
    "distributed": ("distributed.launcher", "distributed.async_checkpoint", "distributed.ddp", "distributed.fsdp",
                    "distributed.links"),
    "hf": ("hf.lora_bf16", "hf.generate", "hf.export_hf", "hf.export_gguf"),
}
STATUSES = ("passed", "failed", "skipped")


@dataclass
class Outcome:
    """What one item found: its status, one line of why, the figures it measured and the tolerance it used."""

    name: str
    status: str  # passed | failed | skipped
    why: str
    figures: dict[str, Any] = field(default_factory=dict)
    tolerance: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def judged(name: str, ok: bool, why: str, figures: dict[str, Any], tolerance: str) -> Outcome:
    """An item that compared figures against a tolerance: passed when `ok`."""
    return Outcome(name, "passed" if ok else "failed", why, figures, tolerance)


def skipped(name: str, why: str) -> Outcome:
    return Outcome(name, "skipped", why)
