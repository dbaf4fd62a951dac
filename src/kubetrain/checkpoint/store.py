"""One folder in object storage, or on a filesystem, through fsspec.

s3:// goes through s3fs (any S3-compatible endpoint: AWS, MinIO, Ceph), gs:// through gcsfs, az:// through
adlfs; file:// and a plain path through fsspec's local filesystem. Credentials come from the environment
(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*),
never from the config.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
from pathlib import Path
from typing import Any

from kubetrain.config.names import local_file_path, store_uri_problem
from kubetrain.errors import UserInputError

LOCAL_PROTOCOLS = (None, "file", "local")
S3_PROTOCOLS = ("s3", "s3a")
EXTRA = "pip install 'kubetrain[storage]'"
# Fail over in seconds, not minutes: a store that is down must not hold a run's end for long.
S3_CLIENT = {"connect_timeout": 10, "read_timeout": 120, "retries": {"max_attempts": 3, "mode": "standard"}}
# The environment variables each store's library reads its credentials from, and whether a Kubernetes Secret
# that holds them (checkpoint.secret_name) must have that key. Azure takes one of several combinations.
# gs:// reads a key *file* (GOOGLE_APPLICATION_CREDENTIALS): on GKE, Workload Identity instead of a Secret.
CREDENTIAL_KEYS: dict[str, tuple[tuple[str, bool], ...]] = {
    "s3": (("AWS_ACCESS_KEY_ID", True), ("AWS_SECRET_ACCESS_KEY", True), ("AWS_SESSION_TOKEN", False)),
    "az": tuple((f"AZURE_STORAGE_{k}", False) for k in (
        "ACCOUNT_NAME", "ACCOUNT_KEY", "SAS_TOKEN", "CONNECTION_STRING", "CLIENT_ID", "CLIENT_SECRET", "TENANT_ID")),
}
CREDENTIAL_KEYS["s3a"] = CREDENTIAL_KEYS["s3"]
CREDENTIAL_KEYS["abfs"] = CREDENTIAL_KEYS["az"]


def protocol_of(uri: str) -> str | None:
    head, sep, _ = uri.partition("://")
    return head.lower() if sep and head.isidentifier() else None


def is_remote(uri: str) -> bool:
    """True for a URI with a scheme other than file://."""
    return protocol_of(uri) not in LOCAL_PROTOCOLS


def credential_keys(uri: str) -> tuple[tuple[str, bool], ...]:
    """(environment variable, required) pairs a Secret with this store's credentials gives the pods."""
    return CREDENTIAL_KEYS.get(protocol_of(uri) or "", ())


# Where each store's library finds credentials on this machine: variables, then files.
_CREDENTIAL_SOURCES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "s3": (("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"), ("~/.aws/credentials", "~/.aws/config")),
    "gs": (("GOOGLE_APPLICATION_CREDENTIALS",), ("~/.config/gcloud/application_default_credentials.json",)),
    "az": (tuple(k for k, _ in CREDENTIAL_KEYS["az"]), ()),
}
_CREDENTIAL_SOURCES.update(s3a=_CREDENTIAL_SOURCES["s3"], gcs=_CREDENTIAL_SOURCES["gs"],
                           abfs=_CREDENTIAL_SOURCES["az"])


def credentials_here(uri: str) -> str | None:
    """What the store's library would log in with on this machine (a variable or a file), None if nothing.

    Only where it looks: an instance role or a metadata server is not asked, so None can mean "try anyway".
    """
    variables, files = _CREDENTIAL_SOURCES.get(protocol_of(uri) or "", ((), ()))
    for name in variables:
        if os.environ.get(name):
            return f"${name}"
    override = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") if variables and variables[0].startswith("AWS") else None
    for path in ([override] if override else []) + list(files):
        if Path(path).expanduser().is_file():
            return path
    return None


def check_reachable(store: Store) -> str:
    """List the store's root once; what is there, in words. Raises what the store raises (a missing bucket:
    FileNotFoundError naming it)."""
    try:
        entries = store.fs.ls(store.root, detail=False)
    except FileNotFoundError:
        bucket = store.root.split("/", 1)[0]
        if protocol_of(store.uri) in LOCAL_PROTOCOLS or store.fs.exists(bucket):
            return "nothing stored under it yet"
        raise FileNotFoundError(f"bucket {bucket} does not exist") from None
    return f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} under it"


def describe(e: BaseException) -> str:
    """An exception from a store as one short line (botocore messages run over several)."""
    text = str(e).strip().splitlines()
    line = text[0][:300] if text else type(e).__name__
    if isinstance(e, PermissionError) and "denied" not in line.lower():  # a 403 to a HEAD has no body: "Forbidden"
        line += " (access denied to these credentials)"
    return line


class Store:
    """Files under one root of an fsspec filesystem, named by paths relative to that root."""

    def __init__(self, fs: Any, root: str, uri: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.uri = uri.rstrip("/")

    def child(self, rel: str) -> Store:
        return Store(self.fs, self.path(rel), f"{self.uri}/{rel}")

    def path(self, rel: str = "") -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def read_text(self, rel: str) -> str | None:
        """The file's text, or None when there is no such file."""
        try:
            data: bytes = self.fs.cat_file(self.path(rel))
        except FileNotFoundError:
            return None
        return data.decode()

    def write_text(self, rel: str, text: str) -> None:
        self.fs.pipe_file(self.path(rel), text.encode())

    def put(self, pairs: list[tuple[Path, str]]) -> None:
        """Upload local files to relative paths, concurrently where the filesystem can."""
        if pairs:
            self.fs.put([str(local) for local, _ in pairs], [self.path(rel) for _, rel in pairs])

    def get(self, pairs: list[tuple[str, Path]]) -> None:
        """Download relative paths to local files (their folders are made)."""
        for _, local in pairs:
            local.parent.mkdir(parents=True, exist_ok=True)
        if pairs:
            self.fs.get([self.path(rel) for rel, _ in pairs], [str(local) for _, local in pairs])

    def sizes(self) -> dict[str, int]:
        """Every file under the root (recursively), by relative path, with its size in bytes."""
        try:
            found = self.fs.find(self.root, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        prefix = self.root + "/"
        return {name[len(prefix):]: int(info["size"]) for name, info in found.items() if name.startswith(prefix)}

    def subdirs(self) -> list[str]:
        """Names of the folders directly under the root."""
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return [posixpath.basename(e["name"].rstrip("/")) for e in entries if e["type"] == "directory"]

    def remove(self, rel: str) -> None:
        self.fs.rm(self.path(rel), recursive=True)


def open_store(uri: str, endpoint_url: str | None = None) -> Store:
    """The store at `uri`; a missing fsspec implementation or an unknown scheme is a user error."""
    problem = store_uri_problem(uri, schemes=None)
    if problem:
        raise UserInputError(problem)
    try:
        import fsspec
    except ModuleNotFoundError:
        raise UserInputError(f"{uri}: object storage needs fsspec: {EXTRA}") from None
    given = uri
    if uri.lower().startswith("file:"):  # fsspec reads file://localhost/x as the folder localhost/x
        uri = local_file_path(uri) or uri
    protocol = protocol_of(uri)
    options: dict[str, Any] = {"skip_instance_cache": True}
    if protocol in S3_PROTOCOLS:
        # listings are read to decide what is complete: never from a cache
        options.update(use_listings_cache=False, config_kwargs=S3_CLIENT)
        if endpoint_url:
            options["endpoint_url"] = endpoint_url
    elif endpoint_url:
        raise UserInputError(f"checkpoint.endpoint_url is for s3:// stores, not {uri}")
    elif protocol in LOCAL_PROTOCOLS:
        options["auto_mkdir"] = True
    try:
        fs, root = fsspec.core.url_to_fs(uri, **options)
    except ImportError as e:
        raise UserInputError(f"{uri}: {describe(e)} ({EXTRA}, or the fsspec package for {protocol}://)") from None
    except ValueError as e:
        raise UserInputError(f"{uri}: {describe(e)}") from None
    if getattr(fs, "async_impl", False):
        quiet_dropped_connections()
    return Store(fs, str(root), given)


def quiet_dropped_connections() -> None:
    """No asyncio traceback for a request task whose connection the endpoint dropped.

    aiohttp leaves the body-writing task of such a request unretrieved, and asyncio prints "Task exception was
    never retrieved" with a traceback for each when it is collected: hundreds of them for an endpoint that
    accepts and then closes connections (a proxy whose backend is down). The request itself fails with the
    same error, which the store's caller reports once; anything else still reaches asyncio's handler.
    """
    from fsspec.asyn import get_loop

    loop = get_loop()  # fsspec's IO loop, in its own thread: the one s3fs, gcsfs and adlfs run on

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if str(context.get("message", "")).startswith("Task exception was never retrieved") and _dropped(error):
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _dropped(error: object) -> bool:
    if isinstance(error, ConnectionError):
        return True
    try:
        from aiohttp import ClientConnectionError
    except ImportError:
        return False
    return isinstance(error, ClientConnectionError)
