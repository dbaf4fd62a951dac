"""Weights & Biases: the resolved config (redacted), every train/eval line, the final sample, checkpoints as
artifacts when asked, and how the run ended.

One kubetrain run (or phase) is one W&B run: its id is kept in meta.json (`trackers.wandb`), so pod restarts do
not scatter one training run over many W&B runs. A resumed run rewinds that W&B run to the checkpoint it resumes
from (`resume_from`), so the steps logged between that checkpoint and the crash are replaced, not shown twice; where
rewinding is not possible it reopens the run (`resume="allow"`) and skips the steps W&B already holds. The API key is
read by wandb itself from WANDB_API_KEY (or a `wandb login`); kubetrain never holds it.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from kubetrain import runs
from kubetrain.secrets import redact, redact_text
from kubetrain.track import Sink
from kubetrain.track.failures import TrackerUnavailable, one_line

TRACKER = "wandb"  # its key in meta.json's `trackers`
NOT_METRICS = {"kind", "step", "time", "phase", "path", "best"}
# W&B's row number (`_step`) is kubetrain's step, so that a rewind to a checkpoint's step cuts the history exactly
# there; the charts plot against kubetrain's step as a metric of its own too (define_metric), as they always have.
STEP = "step"
EXIT_CODES = {"finished": 0, "stopped": 75, "failed": 1}  # 75: stopped after a checkpoint, resumable (errors.py)


def resolve_mode(configured: str, environ: os._Environ[str] | dict[str, str] = os.environ) -> tuple[str, str]:
    """The mode a run uses and why: `auto` is $WANDB_MODE when set, else online with a key, else offline."""
    if configured != "auto":
        return configured, "track.wandb.mode"
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"], "$WANDB_MODE"
    if environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    return "offline", "no WANDB_API_KEY"


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, project: str, entity: str | None = None, mode: str = "auto", tags: list[str] | None = None,
                 log_checkpoints: bool = False, stream: Any = None) -> None:
        self.project, self.entity, self.tags = project, entity, list(tags or [])
        self.mode, self.why = resolve_mode(mode)
        self.log_checkpoints = log_checkpoints
        self.stream = stream
        self.run: Any = None
        self.run_dir: Path | None = None
        self.first_step = 0  # records of an earlier step are in the W&B run already
        self.last_step = 0  # the newest row: W&B takes rows in step order only

    def start(self, info: dict[str, Any]) -> None:
        import wandb  # build_sinks checked that it is installed

        self.run_dir = run_dir = Path(info["run_dir"])
        run_id = self.run_id(run_dir)
        # under the run by default, so that `k8s fetch` brings an offline run home; wandb itself would fall back to
        # a temporary folder when it cannot write there, and the run would be lost with the pod
        root = Path(os.environ.get("WANDB_DIR") or run_dir).expanduser()
        try:
            (root / "wandb").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackerUnavailable(f"cannot write W&B's files under {root}: {one_line(e)}") from None
        run, phase = str(info.get("run") or "run"), info.get("phase")
        mode: Any = self.mode  # wandb's own Literal; $WANDB_MODE may hold any mode it knows
        start_step = int(info.get("start_step") or 0)
        opened = {"project": self.project, "entity": self.entity, "mode": mode, "tags": self.tags,
                  "dir": None if os.environ.get("WANDB_DIR") else str(root),
                  "name": redact_text(f"{run}/{phase}" if phase else run),
                  "group": redact_text(run) if phase else None, "job_type": phase or "train",
                  # kubetrain prints its own lines (redacted); W&B's copy of stdout would only repeat them
                  "settings": wandb.Settings(console="off", quiet=True)}
        try:
            self.run = self.open(wandb, opened, run_id, start_step)
            self.run.config.update(self.config(info), allow_val_change=True)  # a resume may change the config
            for prefix in ("train", "eval", "checkpoint"):
                self.run.define_metric(f"{prefix}/*", step_metric=STEP)
        except Exception as e:
            # wandb-core says what it waited for on one line and why (the server's address) on the next
            raise TrackerUnavailable(f"cannot use W&B ({self.mode}): {one_line(e, joined=True)}") from None
        where = f": wandb sync {Path(self.run.dir).parent}" if self.mode == "offline" else \
            f": {self.run.url}" if getattr(self.run, "url", None) else ""
        print(f"wandb: run {run_id} of project '{self.project}', {self.mode} ({self.why}){where}",
              file=self.stream or sys.stdout, flush=True)
        # after a rewind W&B continues at the step after the checkpoint; after a plain reopen, after its newest row
        self.first_step = self.last_step = max(int(getattr(self.run, "starting_step", 0) or 0), start_step)

    def open(self, wandb: Any, opened: dict[str, Any], run_id: str, start_step: int) -> Any:
        """The W&B run, rewound to `start_step` when this run resumes from a checkpoint and wandb can rewind. A server
        that refuses the rewind (a run it has never seen, rewinding not enabled there) gets the run reopened as it
        is instead; a server that cannot be reached is not asked twice."""
        if start_step > 0 and rewinds(wandb):
            try:
                return wandb.init(resume_from=f"{run_id}?_step={start_step}", **opened)
            except Exception as e:
                if "deadline exceeded" in str(e):  # wandb-core's word for a server that did not answer in time
                    raise
        return wandb.init(id=run_id, resume="allow", **opened)

    def run_id(self, run_dir: Path) -> str:
        """The W&B run of this run directory: the one meta.json names, else a new id recorded there first (so a
        run that cannot reach W&B now still continues one run once it can)."""
        known = (runs.read_meta(run_dir).get("trackers") or {}).get(TRACKER) or {}
        if known.get("id"):
            return str(known["id"])
        run_id = uuid.uuid4().hex[:16]  # W&B ids: letters, digits, - and _; unique in the project
        runs.record_tracker(run_dir, TRACKER, {"id": run_id, "project": self.project, "entity": self.entity})
        return run_id

    @staticmethod
    def config(info: dict[str, Any]) -> dict[str, Any]:
        """The resolved config (secrets redacted), plus what the run resolved at start."""
        cfg = info.get("config")
        out: dict[str, Any] = redact(cfg.model_dump(mode="json")) if cfg is not None else {}
        out["kubetrain"] = {"n_params": info.get("params"), "world_size": info.get("world_size", 1),
                            "max_steps_resolved": info.get("max_steps"), "start_step": info.get("start_step", 0),
                            "restarts": info.get("restarts", 0)}
        return out

    def log(self, record: dict[str, Any]) -> None:
        kind, step = record.get("kind"), int(record["step"])
        if step < self.first_step:  # W&B holds this step from before the crash, and could not be rewound
            return
        values = {f"{kind}/{k}": float(v) for k, v in record.items()
                  if k not in NOT_METRICS and isinstance(v, int | float) and not isinstance(v, bool)}
        if step < self.last_step:
            # a checkpoint's line comes when its background write ends, after later steps were logged; W&B would
            # drop a row older than its newest, so the line joins the newest row and says its own step
            values[f"{kind}/step"] = float(step)
        row = self.last_step = max(step, self.last_step)
        self.run.log({STEP: row, **values}, step=row)
        if kind == "checkpoint" and self.log_checkpoints:
            self.log_checkpoint(record)

    def log_checkpoint(self, record: dict[str, Any]) -> None:
        """The checkpoint folder as a `model` artifact; W&B copies its files to staging, so the retention that
        deletes old checkpoints cannot pull them from under the upload."""
        import wandb

        path = Path(record["path"])
        artifact = wandb.Artifact(f"model-{self.run.id}", type="model",
                                  metadata={"step": int(record["step"]), "checkpoint": path.name,
                                            "best": bool(record.get("best")), "phase": record.get("phase")})
        artifact.add_dir(str(path))
        aliases = ["latest", path.name, *(["best"] if record.get("best") else [])]
        self.run.log_artifact(artifact, aliases=aliases)

    def finish(self, status: str) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            sample = last_sample(self.run_dir / runs.SAMPLES_FILE) if self.run_dir else None
            if sample is not None:
                run.summary.update({"sample": redact_text(sample["sample"]), "sample_step": sample["step"]})
            run.summary.update({"status": status})
            if status == "stopped":
                run.mark_preempting()  # W&B shows it as preempted, to be resumed
        finally:
            run.finish(exit_code=EXIT_CODES.get(status, 1))


def rewinds(wandb: Any) -> bool:
    """Whether the installed wandb can rewind a run to a step (`wandb.init(resume_from=...)`): the one place that
    asks, by the argument itself rather than a version number."""
    return "resume_from" in inspect.signature(wandb.init).parameters


def last_sample(path: Path) -> dict[str, Any] | None:
    """The last sample of samples.txt ({"step", "sample"}), None when there is none."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a crash mid-write
            continue
        if isinstance(record, dict) and "sample" in record:
            return record
    return None
