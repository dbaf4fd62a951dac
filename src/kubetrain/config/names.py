"""What a config may name outside itself, checked where the config comes in: a store (`checkpoint.uri`, `runs
sync`), a local `file:` URI, a folder name (`run.name`, a phase's name)."""

from __future__ import annotations

import re

# The stores checkpoint.uri names (fsspec's s3fs, gcsfs, adlfs and local filesystem), as docs/object-storage.md lists
STORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "file")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)")


def store_uri_problem(uri: str, schemes: tuple[str, ...] | None = STORE_SCHEMES) -> str | None:
    """Why `uri` names no store kubetrain writes to (an unknown scheme, no bucket), or None for a usable one.

    Refused here, where the config comes in: later a run would only fail on its first upload or restore. `schemes`
    None takes any scheme (`runs sync` hands it to fsspec), but still a bucket and the `//`."""
    use = "give s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://CONTAINER/PREFIX, file:///PATH or a path"
    found = _SCHEME.match(uri)
    if found is None or not found.group(2):  # a path ("runs/store", "a:b")
        return None
    scheme = found.group(1).lower()
    if scheme == "file":
        if local_file_path(uri) is None:
            host = uri[found.end():].split("/", 1)[0]
            return (f"{uri!r} names the host {host!r}: a file: URI is a path on this machine, "
                    f"file:///PATH (three slashes) or a plain path")
        return None
    if found.group(2) != "//" or (schemes is not None and scheme not in schemes):
        return f"{uri!r} is not a store kubetrain can use ({scheme}:{found.group(2)}): {use}"
    bucket = uri[found.end():].split("/", 1)[0]
    if scheme not in ("file", "local") and not bucket:
        return f"{uri!r} names no bucket: {use}"
    return None


def local_file_path(uri: str) -> str | None:
    """The path on this machine a `file:` URI names (RFC 8089: `file:///PATH`, `file://localhost/PATH`,
    `file:/PATH`); None for one with another host (`file://tmp/x` is the host `tmp`, not the folder `./tmp/x`)."""
    rest = uri[len("file:"):]
    if not rest.startswith("//"):
        return rest or None
    host, sep, path = rest[2:].partition("/")
    if host.lower() not in ("", "localhost") or not sep:
        return None
    return "/" + path


_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def one_folder_name(value: str) -> str:
    """`value` when it is safe as one folder name (no separator, no `..`, not hidden); else ValueError."""
    if not _FOLDER_NAME.fullmatch(value):
        raise ValueError(f"{value!r} must be one folder name: letters, digits, '.', '_' and '-', starting with a "
                         "letter or digit (at most 128)")
    return value
