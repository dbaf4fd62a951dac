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
from kubetrain.errors import DataError

BUILTIN_CORPUS = "kjv.txt"


def builtin_corpus_path() -> Path:
    return Path(str(resources.files("kubetrain") / "data" / "corpus" / BUILTIN_CORPUS))


def source_files(src: SourceConfig) -> list[Path]:
    """The local files a source reads, sorted; a missing path or an empty glob is an error."""
    if src.kind == "builtin":
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
        raise DataError(f"data path not found: {src.path}")
    return [p]


def fingerprint(src: SourceConfig) -> str:
    """A digest of the source's settings and the bytes of every file it reads."""
    h = hashlib.sha256(json.dumps(src.model_dump(mode="json"), sort_keys=True).encode())
    for f in source_files(src):
        h.update(str(f.name).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line; bad JSON names its line."""
    for lineno, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def iter_documents(src: SourceConfig) -> Iterator[str]:
    """Every document of a plain-text source (builtin, text, jsonl, hf)."""
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
        if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
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
