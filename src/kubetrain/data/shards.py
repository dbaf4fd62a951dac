"""`prepare`: turn the configured sources into one token shard (memmap) + meta.json, cached by content."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kubetrain.config.schema import Config, SourceConfig
from kubetrain.data import sources
from kubetrain.data.fingerprints import DigestCache, file_digest, locked
from kubetrain.data.tokenizers import ByteTokenizer, Tokenizer, build_tokenizer, load_saved_tokenizer
from kubetrain.errors import DataError

FORMAT_VERSION = 2  # 2: files known by xxh3-128 digests, every shard file checksummed
TOKENS_FILE = "tokens.bin"
INDEX_DIR = ".index"  # in the cache root: the digests of known data files, and the locks of preparing processes
MASK_FILE = "mask.bin"  # uint8, 1 where the token counts in the loss (chat data); absent means all count


@dataclass(frozen=True)
class Prepared:
    """A prepared dataset: where its shard lives and what its meta.json says."""

    folder: Path
    meta: dict[str, Any]

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self.meta["dtype"])

    @property
    def n_train(self) -> int:
        return int(self.meta["train_tokens"])

    @property
    def n_val(self) -> int:
        return int(self.meta["val_tokens"])

    @property
    def has_mask(self) -> bool:
        return bool(self.meta.get("masked"))

    def tokenizer(self) -> Tokenizer:
        return load_saved_tokenizer(self.folder / "tokenizer")


def cache_root(cfg: Config) -> Path:
    return Path(cfg.data.cache_dir or Path(cfg.run.output_dir) / ".data").expanduser()


def with_resolved_sources(cfg: Config) -> Config:
    """The config with every source of kind 'auto' given the kind its files hold."""
    if all(src.kind != "auto" for src in cfg.data.sources):
        return cfg
    resolved = [sources.resolve_kind(src) for src in cfg.data.sources]
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"sources": resolved})})


def data_key(cfg: Config) -> str:
    """Content hash of everything that decides the tokens: sources' bytes, tokenizer, split."""
    cfg = with_resolved_sources(cfg)
    h = hashlib.sha256(f"v{FORMAT_VERSION}".encode())
    h.update(json.dumps(cfg.data.tokenizer.model_dump(mode="json"), sort_keys=True).encode())
    h.update(json.dumps(cfg.data.chat.model_dump(mode="json"), sort_keys=True).encode())
    h.update(f"{cfg.data.val_fraction}".encode())
    if _unpacked_chat(cfg):  # conversations are laid out one per window
        h.update(f"block{cfg.model.block_size}".encode())
    if cfg.data.tokenizer.kind == "hf" and cfg.data.tokenizer.path and Path(cfg.data.tokenizer.path).exists():
        for f in sorted(Path(cfg.data.tokenizer.path).glob("*")):
            if f.is_file() and f.suffix not in _WEIGHT_SUFFIXES:  # a model folder: hash the tokenizer, not GBs
                h.update(f.name.encode() + f.read_bytes())
    digests = DigestCache(cache_root(cfg) / INDEX_DIR)
    for src in cfg.data.sources:
        h.update(sources.fingerprint(src, digests).encode())
    return h.hexdigest()[:20]


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def _unpacked_chat(cfg: Config) -> bool:
    return not cfg.data.chat.packing and any(src.kind == "chat" for src in cfg.data.sources)


def prepare(cfg: Config, min_tokens: int | None = None, log: Any = None) -> Prepared:
    """Tokenize the sources once; later calls with the same content return the cached shard at once."""
    cfg = with_resolved_sources(cfg)
    key = data_key(cfg)
    folder = cache_root(cfg) / key
    prepared = _cached(folder)
    if prepared is None:
        # One process tokenizes while the others on this machine (ranks, a second `prepare`) wait, then find
        # the shard; processes on other machines sharing the volume race, and the first rename wins.
        with locked(folder.parent / INDEX_DIR / f"{key}.lock"):
            prepared = _cached(folder) or _build(cfg, key, folder, log)
    _check_size(prepared, min_tokens)
    return prepared


def _cached(folder: Path) -> Prepared | None:
    """The shard in `folder` if there is one and its files match their checksums; a damaged one is removed."""
    if not (folder / "meta.json").is_file():
        return None
    prepared = Prepared(folder, json.loads((folder / "meta.json").read_text()))
    problem = verify(prepared)
    if problem is None:
        return prepared
    print(f"warning: the prepared data in {folder} is damaged ({problem}); preparing it again",
          file=sys.stderr, flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return None


def verify(prepared: Prepared) -> str | None:
    """None when every file of the shard has the checksum its meta.json records, else what is wrong.

    Not re-hashed on every start by every rank: a file whose path, size, mtime and inode match the digest the
    cache recorded when a process last hashed it (<cache>/.index/fingerprints.json, the DigestCache of the
    sources) is not read again; one process hashes a new or changed file while the others wait on its lock.
    """
    checksums: dict[str, str] = prepared.meta.get("checksums", {})
    paths = [prepared.folder / name for name in checksums]
    missing = next((name for name, path in zip(checksums, paths, strict=True) if not path.is_file()), None)
    if missing:
        return f"{missing} is missing"
    found = DigestCache(prepared.folder.parent / INDEX_DIR).digests(paths)
    for (name, digest), got in zip(checksums.items(), found, strict=True):
        if got != digest:
            return f"{name} does not match its checksum"
    return None


def _build(cfg: Config, key: str, folder: Path, log: Any) -> Prepared:
    if log:
        log(f"preparing data into {folder}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Written into a temporary folder and renamed into place: a reader never sees half a shard.
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=folder.parent))
    try:
        meta = _write_shard(cfg, tmp)
        meta["key"] = key
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _fsync_tree(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "meta.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return Prepared(folder, json.loads((folder / "meta.json").read_text()))


def _check_size(prepared: Prepared, min_tokens: int | None) -> None:
    if min_tokens is None:
        return
    if prepared.n_train < min_tokens:
        raise DataError(
            f"the training data has {prepared.n_train} tokens, fewer than one window of block_size + 1 "
            f"({min_tokens}); lower model.block_size or add data"
        )
    if prepared.meta["val_fraction"] > 0 and prepared.n_val < min_tokens:
        raise DataError(
            f"the validation split has {prepared.n_val} tokens, fewer than block_size + 1 ({min_tokens}); "
            "raise data.val_fraction, lower model.block_size or add data"
        )


def encoded(cfg: Config, tok: Tokenizer, src: SourceConfig) -> Iterator[tuple[list[int], list[int] | None]]:
    """(token ids, loss mask or None) for each document or conversation of a source."""
    if src.kind == "chat":
        from kubetrain.data.chat import encode_conversations

        yield from encode_conversations(src, tok, cfg.data.chat, block_size=cfg.model.block_size)
        return
    sep = _document_separator(tok)
    whole, frac = divmod(src.weight, 1.0)
    for copy in range(int(whole) + (1 if frac else 0)):
        docs: Iterable[str] = sources.iter_documents(src)
        if copy == int(whole):  # the fractional copy: the first share of the documents
            listed = list(docs)
            docs = listed[: int(len(listed) * frac)]
        for doc in docs:
            if doc:
                yield tok.encode(doc) + sep, None


def _document_separator(tok: Tokenizer) -> list[int]:
    """EOS after each document; a blank line for the byte tokenizer, as its shards always had (its EOS came
    later): the same corpus keeps giving the same tokens, so runs trained on them still resume."""
    if tok.eos_id is None or isinstance(tok, ByteTokenizer):
        return tok.encode("\n\n")
    return [tok.eos_id]


def _write_shard(cfg: Config, out: Path) -> dict[str, Any]:
    from kubetrain.data.chat import conversation_texts

    corpus = (doc for src in cfg.data.sources
              for doc in (conversation_texts(src) if src.kind == "chat" else sources.iter_documents(src)))
    tok = build_tokenizer(cfg.data.tokenizer, corpus if cfg.data.tokenizer.kind == "bpe" else None)
    tok.save(out / "tokenizer")
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    n_tokens = 0
    masked = any(src.kind == "chat" for src in cfg.data.sources)
    with open(out / TOKENS_FILE, "wb") as ft, open(out / MASK_FILE, "wb") as fm:
        for src in cfg.data.sources:
            if src.kind == "chat" and _unpacked_chat(cfg) and n_tokens % cfg.model.block_size:
                from kubetrain.data.chat import pad_id

                fill = cfg.model.block_size - n_tokens % cfg.model.block_size  # start on a window boundary
                ft.write(np.full(fill, pad_id(tok), dtype=dtype).tobytes())
                fm.write(np.zeros(fill, dtype=np.uint8).tobytes())
                n_tokens += fill
            for ids, mask in encoded(cfg, tok, src):
                ft.write(np.asarray(ids, dtype=dtype).tobytes())
                if masked:
                    fm.write(np.asarray(mask if mask is not None else [1] * len(ids), dtype=np.uint8).tobytes())
                n_tokens += len(ids)
    if not masked:
        (out / MASK_FILE).unlink()
    if n_tokens == 0:
        names = ", ".join(s.path or "builtin corpus" for s in cfg.data.sources)
        raise DataError(f"the corpus is empty: no tokens in {names}")
    n_val = int(n_tokens * cfg.data.val_fraction)
    if _unpacked_chat(cfg):
        n_val -= n_val % cfg.model.block_size  # the validation windows start on a conversation too
    return {
        "format": FORMAT_VERSION,
        "tokenizer": tok.fingerprint(),
        "tokenizer_kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": np.dtype(dtype).name,
        "tokens": n_tokens,
        "train_tokens": n_tokens - n_val,
        "val_tokens": n_val,
        "val_fraction": cfg.data.val_fraction,
        "masked": masked,
        "sources": [s.model_dump(mode="json") for s in cfg.data.sources],
        "checksums": {f.name: file_digest(f) for f in (out / TOKENS_FILE, out / MASK_FILE) if f.is_file()},
    }


def _fsync_tree(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
