"""Build the fan-out of metric sinks a config asks for (rank 0 only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError
from kubetrain.runs import METRICS_FILE
from kubetrain.track import Fanout, Sink
from kubetrain.track.console import ConsoleSink
from kubetrain.track.jsonl import JsonlSink


def build_sinks(
    cfg: Config, run_path: Path, total_steps: int, stream: Any = None, warn: Any = None, prefix: str = ""
) -> Fanout:
    """metrics.jsonl always; MLflow, TensorBoard, W&B and Prometheus when switched on; Kubeflow Trainer's status
    server when its controller named one; the console last, so that when a line is printed every other sink
    already holds the record."""
    sinks: list[Sink] = [JsonlSink(run_path / METRICS_FILE)]
    track = cfg.track
    if track.mlflow.enabled:
        from kubetrain.track.mlflow_sink import MlflowSink, default_artifact_location, tracking_uri

        uri = tracking_uri(track.mlflow.tracking_uri, cfg.run.output_dir)
        location = track.mlflow.artifact_location or default_artifact_location(uri, cfg.run.output_dir)
        sinks.append(MlflowSink(uri, track.mlflow.experiment, location, stream=stream))
    if track.tensorboard.enabled:
        from kubetrain.track.tensorboard_sink import TensorboardSink

        root = Path(track.tensorboard.dir).expanduser() if track.tensorboard.dir else None
        sinks.append(TensorboardSink(root, stream=stream))
    if track.wandb.enabled:
        sinks.append(wandb_sink(cfg, stream))
    if track.prometheus.enabled:
        from kubetrain.config.clocks import derive
        from kubetrain.track.prometheus import PrometheusSink

        prom = track.prometheus
        sinks.append(PrometheusSink(prom.port, prom.host, derive(cfg).liveness, stream=stream))
    if track.kubeflow_trainer.enabled:
        from kubetrain.track.kubeflow_trainer import KubeflowTrainerSink, StatusServer

        server = StatusServer.from_env()  # only a TrainJob's controller sets it
        if server is not None:
            sinks.append(KubeflowTrainerSink(server, track.kubeflow_trainer.interval_seconds, warn=warn, stream=stream))
    if track.console:
        sinks.append(ConsoleSink(total_steps, stream=stream, prefix=prefix))
    return Fanout(sinks, warn=warn)


def wandb_sink(cfg: Config, stream: Any = None) -> Sink:
    """The W&B sink; its package missing is bad input (exit 2): the config asks for what this install lacks."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise UserInputError("track.wandb.enabled needs the 'wandb' package: pip install 'kubetrain[wandb]'")
    from kubetrain.track.wandb_sink import WandbSink

    w = cfg.track.wandb
    return WandbSink(w.project, w.entity, w.mode, w.tags, w.log_checkpoints, stream=stream)
