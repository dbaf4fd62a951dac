"""A job's own MLflow user, allowed to write to its experiment: `kubetrain k8s platform grant`.

With `mlflow.auth`, MLflow's basic-auth app gives every signed-in user `default_permission` (READ by default) on
experiments it was not given, and the creator of an experiment MANAGE on it. A job's user made with
`users/create` alone therefore gets `403 Permission denied` at `runs/create` in an experiment someone else (the
admin, another job) created, and the job trains on without tracking. What works: an EDIT grant on that
experiment for that user. This does it as the admin, through MLflow's own clients (mlflow/server/auth/client.py:
create_user; grant_user_permission, `POST /api/3.0/mlflow/users/permissions/grant` with resource_type
`experiment`; MlflowClient for the experiment), with the admin's credentials in MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD as every MLflow client reads them. Each step is idempotent, so it can run again. A grant
the user already has is kept when it lets the user write (EDIT, MANAGE), and raised to EDIT when it does not (READ,
USE): MLflow refuses a second grant on the same experiment (RESOURCE_ALREADY_EXISTS), so it is revoked and granted.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from kubetrain.errors import KubetrainError, UserInputError

EDIT = "EDIT"  # create runs, log to them, read (mlflow/server/auth/permissions.py: can_update)


class GrantFailed(KubetrainError):
    """The tracking server refused (or could not be reached): exit 1."""


def grant_edit(tracking_uri: str, user: str, experiment: str, password: str | None = None,
               say: Callable[[str], None] = print) -> str:
    """Make `user` (created first when `password` is given) able to write to `experiment` (created when missing);
    returns the experiment's id."""
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        with warnings.catch_warnings():  # the client imports MLflow's server app, whose starlette import warns
            warnings.filterwarnings("ignore", message=r"starlette\.middleware\.wsgi is deprecated")
            from mlflow.server.auth.client import AuthServiceClient
        from mlflow.server.auth.permissions import get_permission
    except ImportError:
        raise UserInputError("granting needs the mlflow package: pip install 'kubetrain[mlflow]'") from None

    auth, tracking = AuthServiceClient(tracking_uri), MlflowClient(tracking_uri)
    try:
        if password is not None:
            try:
                auth.create_user(user, password)
                say(f"created MLflow user {user}")
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                say(f"MLflow user {user} exists (its password is unchanged)")
        found = tracking.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else tracking.create_experiment(experiment)
        say(f"experiment {experiment} ({'existing' if found else 'created'}, id {experiment_id})")
        try:
            auth.grant_user_permission(user, "experiment", experiment_id, EDIT)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            had = auth.get_user_permission(user, "experiment", experiment_id).permission
            if get_permission(had).can_update:
                say(f"{user} had {had} on it already: kept as it is")
                return str(experiment_id)
            auth.revoke_user_permission(user, "experiment", experiment_id)
            auth.grant_user_permission(user, "experiment", experiment_id, EDIT)
            say(f"raised {user}'s {had} on experiment {experiment} to {EDIT}: its jobs can create runs there")
            return str(experiment_id)
        say(f"granted {EDIT} on experiment {experiment} to {user}: its jobs can create runs there")
    except MlflowException as e:
        raise GrantFailed(f"the tracking server at {tracking_uri} refused: {e.message} (the credentials in "
                          "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD must be the admin's)") from None
    except OSError as e:
        raise GrantFailed(f"cannot reach the tracking server at {tracking_uri}: {e}") from None
    return str(experiment_id)
