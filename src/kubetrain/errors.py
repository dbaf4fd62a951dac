"""User-facing errors: one message, an exit code, no traceback unless --debug."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
# The run was asked to stop (SIGTERM/SIGINT), saved a checkpoint, and can be resumed.
EXIT_STOPPED_RESUMABLE = 75  # EX_TEMPFAIL from sysexits.h: "try again later"
# A pod's elastic agent lost its rendezvous host (node rank 0 is gone): resumable once the peer is back, so the
# Job's podFailurePolicy ignores it (the lost host's own failure is the one counted).
EXIT_PEER_LOST = 69  # EX_UNAVAILABLE from sysexits.h: "a service is unavailable"
# How a run stopped with 75 is resumed, where the command that ran it is not what resumes it: a pod's manifest sets
# it (its controller starts the pod again). Unset: the same command.
RESUME_HINT_ENV = "KUBETRAIN_RESUME_HINT"


def resume_hint() -> str:
    import os

    return os.environ.get(RESUME_HINT_ENV) or "resume with the same command"
# A worker's failure that a restart from the last checkpoint would only repeat (a loss that went NaN): its elastic
# launcher restarts nobody and exits EXIT_FAILURE with the worker's line. Only between a worker and its launcher.
EXIT_FINAL_FAILURE = 65  # EX_DATAERR from sysexits.h
# The preflight (distributed/preflight.py) found a bad device or a slow link before step 1: the launcher restarts
# nobody, and a rendered Job's podFailurePolicy fails the Job (the same node would fail again).
EXIT_PREFLIGHT = 71  # EX_OSERR from sysexits.h: "an operating system error has been detected"


class KubetrainError(Exception):
    """Base of every error meant for the user; `exit_code` says what kind it is."""

    exit_code = EXIT_FAILURE


class UserInputError(KubetrainError):
    """Bad input: a config, a path, a flag, data that cannot be used. Exit code 2."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(UserInputError):
    """The config cannot be loaded or does not validate."""


class DataError(UserInputError):
    """A data source is missing, empty, undecodable or too small."""


class CheckpointError(KubetrainError):
    """A checkpoint cannot be written or does not fit the config."""


class BadCheckpointError(UserInputError):
    """A checkpoint the user named does not verify (torn, corrupt, files missing): bad input, exit 2."""


class NoCheckpointVerifies(BadCheckpointError):
    """A run's checkpoints exist and none verifies: resuming would start from step 0 over them. Exit 2."""


class IncompatibleCheckpointError(UserInputError):
    """A checkpoint whose model shape or tokenizer differs from the config."""


class TrainingFailed(KubetrainError):
    """Training started and then failed on something outside the config (a disk gone, permission lost). Exit 1."""

    exit_code = EXIT_FAILURE


class RepeatableFailure(TrainingFailed):
    """A failure while running that a restart from the last checkpoint would only repeat (the same data, the same
    RNG, the same step): exit 1, and under the launcher no restart (EXIT_FINAL_FAILURE)."""


class TrainingStopped(KubetrainError):
    """Training stopped on a signal after saving a checkpoint; resumable."""

    exit_code = EXIT_STOPPED_RESUMABLE


class PreflightFailed(KubetrainError):
    """The preflight named a rank whose device or links fail, before the model was built. Exit 71."""

    exit_code = EXIT_PREFLIGHT
