"""Data sources: each yields documents (strings) and names the files it read, for the content hash."""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from kubetrain.config.schema import SourceConfig
from kubetrain.data.fingerprints import DigestCache
from kubetrain.errors import DataError
from kubetrain.files import special_kind, why_missing

BUILTIN_CORPUS = "kjv.txt"


def builtin_corpus_path() -> Path:
    return Path(str(resources.files("kubetrain") / "data" / "corpus" / BUILTIN_CORPUS))


def source_files(src: SourceConfig) -> list[Path]:
    """The local files a source reads, sorted; a missing path or an empty glob is an error."""
    if src.kind == "builtin" or not src.path:
        return [builtin_corpus_path()]
    assert src.path is not None
    if src.kind == "hf":
        # A local data file or dataset folder is hashed like any file; a hub id has no local bytes.
        p = Path(src.path).expanduser()
        if p.is_file():
            return [p]
        return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
    pattern = str(Path(src.path).expanduser())
    if any(c in pattern for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(pattern, recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"no files match data path '{src.path}'")
        return files
    p = Path(pattern)
    if p.is_dir():
        # Hidden files and folders (.git, .cache, editor swap files) are not part of a corpus.
        files = sorted(f for f in p.rglob("*")
                       if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise DataError(f"data folder is empty: {src.path}")
        return files
    if not p.is_file():
        if p.exists():  # a FIFO, a device (/dev/null), a socket: nothing that can be read twice and hashed
            raise DataError(f"data path is not a regular file or folder: {src.path} (a "
                            f"{special_kind(p)}); name a file, a folder or a glob")
        raise DataError(f"data path {why_missing(p)}: {src.path}")
    return [p]


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `datasets`' `save_to_disk` (a Dataset or a DatasetDict)."""
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


_DATASET_SUFFIXES = (".parquet", ".csv", ".arrow")


def resolve_kind(src: SourceConfig) -> SourceConfig:
    """The source with kind 'auto' replaced by the kind its files hold; unclear or mixed files are refused."""
    if src.kind != "auto":
        return src
    if not src.path:
        return src.model_copy(update={"kind": "builtin"})
    p = Path(src.path).expanduser()
    if p.is_dir() and is_saved_dataset(p):
        return src.model_copy(update={"kind": "hf"})
    try:
        files = source_files(src.model_copy(update={"kind": "text"}))
    except DataError as e:
        hint = "" if p.exists() or p.is_symlink() else " (a Hugging Face dataset id needs kind: hf)"
        raise DataError(f"{e}{hint}") from None
    kinds = {f: _kind_of_file(f, src.text_field) for f in files}
    found = sorted(set(kinds.values()))
    if len(found) > 1:
        examples = ", ".join(f"{k}: {next(f.name for f, v in kinds.items() if v == k)}" for k in found)
        raise DataError(f"data path '{src.path}' mixes kinds of data ({examples}): give each its own "
                        "source, or set kind")
    return src.model_copy(update={"kind": found[0]})


def _kind_of_file(f: Path, text_field: str) -> str:
    """text, jsonl, chat or hf, told from the suffix and the first bytes; anything else is refused."""
    if f.suffix in _DATASET_SUFFIXES:
        return "hf"
    with open(f, "rb") as fh:
        head = fh.read(1 << 16)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not merely a character cut at the end of the block
            raise DataError(f"cannot tell what data {f} holds: not UTF-8 text, JSONL or a dataset folder; "
                            "set the source's kind") from None
    if f.suffix not in (".jsonl", ".json"):
        return "text"
    with open(f, "rb") as fh:  # the whole first line, however long
        first = next((line for line in fh if line.strip()), b"")
    try:
        row = json.loads(first)
    except ValueError:  # not JSON, or not UTF-8
        row = None
    if isinstance(row, dict) and ("messages" in row or "prompt" in row):
        return "chat"
    if isinstance(row, dict) and text_field in row:
        return "jsonl"
    raise DataError(f"cannot tell what data {f} holds: its first line is not a JSON object with "
                    f"'messages', 'prompt'/'response' or '{text_field}'; set the source's kind")


def fingerprint(src: SourceConfig, digests: DigestCache | None = None) -> str:
    """A digest of the source's settings and the bytes of every file it reads (known files are not re-read)."""
    h = hashlib.sha256(json.dumps(src.model_dump(mode="json"), sort_keys=True).encode())
    files = source_files(src)
    for f, digest in zip(files, (digests or DigestCache(None)).digests(files), strict=True):
        h.update(f"{f.name}\0{digest}\0".encode())
    return h.hexdigest()


def read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line, read as a stream: memory holds one line, not the file."""
    pos = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text (invalid byte at offset {pos + e.start})") from None
            pos += len(raw)


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line; bad JSON names its line."""
    for lineno, line in iter_lines(path):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def iter_documents(src: SourceConfig) -> Iterator[str]:
    """Every document of a plain-text source (builtin, text, jsonl, hf)."""
    src = resolve_kind(src)
    if src.kind in ("builtin", "text"):
        for f in source_files(src):
            yield read_text(f)
    elif src.kind == "jsonl":
        for f in source_files(src):
            for lineno, row in iter_jsonl(f):
                if not isinstance(row, dict) or src.text_field not in row:
                    raise DataError(f"{f}:{lineno}: no '{src.text_field}' field")
                text = row[src.text_field]
                if not isinstance(text, str):
                    raise DataError(f"{f}:{lineno}: field '{src.text_field}' is not a string")
                yield text
    elif src.kind == "hf":
        for row in load_hf_dataset(src):
            text = row.get(src.text_field)
            if not isinstance(text, str):
                raise DataError(f"dataset '{src.path}': rows need a string field '{src.text_field}'")
            yield text
    else:
        raise DataError(f"source kind '{src.kind}' holds conversations, not plain documents")


def load_hf_dataset(src: SourceConfig) -> Any:
    """A Hugging Face dataset: a `save_to_disk` folder, local data files, or a hub id (when not offline)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "data sources of kind 'hf' need the datasets package: pip install 'kubetrain[hf]'"
        ) from None
    assert src.path is not None
    p = Path(src.path).expanduser()
    try:
        if is_saved_dataset(p):
            ds = datasets.load_from_disk(str(p))
            return ds[src.split] if isinstance(ds, datasets.DatasetDict) else ds
        if p.is_file():
            builder = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet",
                       ".csv": "csv"}
            kind = builder.get(p.suffix)
            if kind is None:
                raise DataError(f"{p}: cannot tell the dataset format from the suffix '{p.suffix}'")
            return datasets.load_dataset(kind, data_files=str(p), split=src.split)
        return datasets.load_dataset(src.path, src.name, split=src.split)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"dataset '{src.path}' could not be loaded: {str(e).splitlines()[0]}") from None

