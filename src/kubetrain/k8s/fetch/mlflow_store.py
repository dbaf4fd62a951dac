"""The job's MLflow SQLite store on the claim, brought back beside the run it tracked.

On the claim the store sits beside the run directories: `<output_dir>/mlflow.db`, artifacts under
`<output_dir>/mlartifacts/<run_id>/artifacts/`. Fetched, the same shape lands in the run folder's `mlflow/`
(`<DIR>/mlflow/mlflow.db`, `<DIR>/mlflow/mlartifacts/...`): inside the fetched run, never on the laptop's own
`runs/mlflow.db` (which local training writes) nor on the store of another fetched job. The whole database
comes back (it is one file), the artifacts of this run and its phases only; the artifact locations the database
holds (absolute paths in the pod) are rewritten to this folder in the fetched copy, so
`mlflow ui --backend-store-uri sqlite:///<DIR>/mlflow/mlflow.db` shows the run with its artifacts.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError
from kubetrain.outside_names import OutsideName, join_inside
from kubetrain.secrets import redact_text

LOCAL_DIR = "mlflow"  # in the fetched run folder
STORE_FILE = "mlflow.db"
STORE_KEY = f"{LOCAL_DIR}/{STORE_FILE}"  # its entry in the fetch manifest


def pod_store(cfg: Config, output_dir: str) -> tuple[str | None, str | None]:
    """(the path in the pod of the job's SQLite store when it is on the claim, else None; a line saying why not).

    `output_dir` is where the pods keep their run directories (the checkpoint claim's mount).
    """
    mlflow = cfg.track.mlflow
    if not mlflow.enabled:
        return None, None
    uri = mlflow.tracking_uri or cfg.k8s.env.get("MLFLOW_TRACKING_URI")
    if uri is None and "MLFLOW_TRACKING_URI" in cfg.k8s.secrets.env:
        return None, ("MLflow: the job's tracking URI comes from a Secret (k8s.secrets.env MLFLOW_TRACKING_URI): "
                      "its data stays where that URI points")
    root = output_dir.rstrip("/")
    if uri is None:
        return f"{root}/{STORE_FILE}", None
    scheme, _, rest = uri.partition(":")
    if scheme.lower() == "sqlite" and rest.startswith("///"):
        path = rest[3:].split("?", 1)[0]  # sqlite:////abs/x.db -> /abs/x.db
        if path.startswith(f"{root}/"):
            return path, None
        return None, f"MLflow: the job's store {path} is not on the checkpoint claim ({root}/): not fetched"
    return None, f"MLflow: the job tracks to {redact_text(uri)}: its data stays on that server"


@dataclass
class StorePlan:
    """What to copy of the store: the database (when it changed), the artifact files (those that changed)."""

    db: bool
    files: list[str]  # relative to the pod's output dir, and to <DIR>/mlflow/ here
    unchanged: int
    runs: list[str] = field(default_factory=list)  # MLflow run ids of this run (and its phases)
    warnings: list[str] = field(default_factory=list)


def plan_store(listing: dict[str, Any], local: Path, manifest: dict[str, list[int]]) -> StorePlan:
    """From the pod's `mlflow-list` answer: copy the database when its size or time changed (or it is not here),
    and each artifact file likewise."""
    here = local / LOCAL_DIR
    warnings = [f"MLflow store not read: {listing['error']}"] if listing.get("error") else []
    runs = []
    for _experiment, run_id, uri, rel in listing.get("runs", []):
        runs.append(str(run_id))
        if rel is None:
            warnings.append(f"MLflow run {run_id}: its artifacts are at {uri}, not on the claim: not fetched")
    db = listing["db"] is not None and "error" not in listing and (
        manifest.get(STORE_KEY) != listing["db"] or not (here / STORE_FILE).is_file())
    files, unchanged = [], 0
    for rel, size, mtime in listing.get("files", []):
        try:
            join_inside(here, rel)
        except OutsideName as e:
            raise UserInputError(f"the pod listed the MLflow artifact {rel!r}, which would land outside {here} "
                                 f"({e.why}); the fetch stopped there") from None
        if manifest.get(f"{LOCAL_DIR}/{rel}") == [size, mtime] and (here / rel).is_file():
            unchanged += 1
        else:
            files.append(str(rel))
    return StorePlan(db, files, unchanged, runs, warnings)


def _path_of(location: str) -> tuple[str, bool] | None:
    """(the local path a file: URI or a bare absolute path names, whether it was a URI); None for other stores."""
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme == "file":
        return urllib.request.url2pathname(parsed.path), True
    if parsed.scheme == "" and location.startswith("/"):
        return location, False
    return None


def relocate(location: str, pod_bases: list[str], here: Path) -> str | None:
    """`location` moved from under one of the pod's output dirs to under `here`, in the same form (URI or path);
    None where it is not under them."""
    found = _path_of(location)
    if found is None:
        return None
    path, as_uri = found
    for base in pod_bases:
        base = base.rstrip("/")
        if path == base or path.startswith(f"{base}/"):
            rel = path[len(base):].strip("/")
            try:  # a location the store holds: under `here` or left as it was
                moved = join_inside(here.resolve(), rel) if rel else here.resolve()
            except OutsideName:
                return None
            return moved.as_uri() if as_uri else str(moved)
    return None


def rewrite_locations(db: Path, pod_bases: list[str], here: Path) -> int:
    """Point the experiments' and runs' artifact locations of a fetched copy of the store at `here`; how many
    changed. Only the copy is written: the claim's store is only ever read."""
    con = sqlite3.connect(db)
    try:
        changed = 0
        with con:
            for table, column, key in (("experiments", "artifact_location", "experiment_id"),
                                       ("runs", "artifact_uri", "run_uuid")):
                for row_key, location in con.execute(f"SELECT {key}, {column} FROM {table}").fetchall():
                    moved = relocate(location or "", pod_bases, here)
                    if moved is not None and moved != location:
                        con.execute(f"UPDATE {table} SET {column} = ? WHERE {key} = ?", (moved, row_key))
                        changed += 1
        return changed
    finally:
        con.close()


def integrity_problem(db: Path) -> str | None:
    """What `PRAGMA integrity_check` finds wrong with a copied store, or None."""
    try:
        con = sqlite3.connect(f"file:{urllib.parse.quote(str(db.resolve()))}?mode=ro", uri=True)
        try:
            found = str(con.execute("PRAGMA integrity_check").fetchone()[0])
        finally:
            con.close()
    except sqlite3.Error as e:
        return str(e)
    return None if found == "ok" else found
