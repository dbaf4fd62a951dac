"""`prepare`: turn the configured sources into token shards (memmaps) + meta.json, cached by content.

Every process that needs the data (each rank of a job, each `prepare --nproc` worker) calls `prepare`; they
share the work through the cache folder (claims.py): one builds the tokenizer, all tokenize parts of the
sources (parts.py), one writes the index (index.py) and renames the folder into place. Nobody waits in a
collective, so the work is bounded by the data, never by `dist.timeout_seconds`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kubetrain.config.schema import Config
from kubetrain.data import sources
from kubetrain.data.claims import Claims, process_tag, share
from kubetrain.data.fingerprints import DigestCache
from kubetrain.data.index import Segment, TokenSequence, join, length
from kubetrain.data.parts import PARTS_DIR, Part, plan, write_part
from kubetrain.data.pieces import PIECE_BYTES, text_pieces
from kubetrain.data.tokenizers import Tokenizer, build_tokenizer, load_saved_tokenizer
from kubetrain.errors import DataError

# 2: files known by xxh3-128 digests, every shard file checksummed; 3: parts joined by an index, long texts
# encoded in pieces (pieces.py)
FORMAT_VERSION = 3
INDEX_DIR = ".index"  # in the cache root: the digests of known data files
TOKENIZER_INFO = "kubetrain_prepared.json"  # what the tokenizer that prepared the data is (its fingerprint)

Log = Callable[[str], None]


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

    @property
    def segments(self) -> list[Segment]:
        return list(self.meta["parts"])

    def tokens(self) -> TokenSequence:
        """All tokens, train then validation, read through memory maps of the parts."""
        return TokenSequence(self.folder, self.segments, self.dtype)

    def mask(self) -> TokenSequence | None:
        """1 where a token counts in the loss (chat data); None when all count."""
        return TokenSequence(self.folder, self.segments, np.dtype(np.uint8), ".mask") if self.has_mask else None

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
    tok = cfg.data.tokenizer
    trained_before = tok.kind == "bpe" and tok.path is not None  # its files decide the tokens, not where they are
    h.update(json.dumps(tok.model_dump(mode="json", exclude={"path"} if trained_before else None),
                        sort_keys=True).encode())
    h.update(json.dumps(cfg.data.chat.model_dump(mode="json"), sort_keys=True).encode())
    h.update(f"{cfg.data.val_fraction}".encode())
    h.update(f"part{cfg.data.part_mb}:piece{PIECE_BYTES}".encode())  # where long texts are cut
    if _windowed_chat(cfg):  # conversations are laid out in windows: one per window, or packed
        h.update(f"block{cfg.model.block_size}".encode())
    if cfg.data.attention != "causal":  # document starts are flagged
        h.update(f"attention:{cfg.data.attention}".encode())
    if tok.kind in ("hf", "bpe") and tok.path and Path(tok.path).expanduser().exists():
        for f in sorted(Path(tok.path).expanduser().glob("*")):
            if f.is_file() and f.suffix not in _WEIGHT_SUFFIXES:  # a model folder: hash the tokenizer, not GBs
                h.update(f.name.encode() + f.read_bytes())
    digests = DigestCache(cache_root(cfg) / INDEX_DIR)
    for src in cfg.data.sources:
        h.update(sources.fingerprint(src, digests).encode())
    return h.hexdigest()[:20]


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def _windowed_chat(cfg: Config) -> bool:
    return any(src.kind == "chat" for src in cfg.data.sources)


def documents(cfg: Config) -> bool:
    """Whether windows can hold several sequences that must not see each other: packed chat, document attention."""
    return cfg.data.attention == "document" or (cfg.data.chat.packing and _windowed_chat(cfg))


def prepare(cfg: Config, min_tokens: int | None = None, log: Log | None = None, first: int = 0) -> Prepared:
    """Tokenize the sources once; later calls with the same content return the cached shard at once.

    Several processes calling it together split the work; `first` (a rank, say) spreads where they start.
    """
    cfg = with_resolved_sources(cfg)
    key = data_key(cfg)
    folder = cache_root(cfg) / key
    prepared = _cached(folder) or _build(cfg, key, folder, log, first)
    _check_size(prepared, min_tokens)
    packing = prepared.meta.get("packing")
    if log and packing:
        log(f"packing: {100 * packing['tokens'] / max(1, packing['positions']):.1f}% of positions are tokens "
            f"({packing['tokens']:,} tokens in {packing['windows']:,} windows)")
    return prepared


def prepare_in_processes(cfg: Config, nproc: int, min_tokens: int | None = None, log: Log | None = None) -> Prepared:
    """`prepare` by nproc local processes together: this one and nproc - 1 started for it (the same path as the
    ranks of a job take)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # fork would copy this process's threads and tokenizer state
    if nproc > 1:  # the tokenizers' Rust threads: the cores shared out, not every process using all of them
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    workers = [ctx.Process(target=_prepare_worker, args=(cfg.model_dump(mode="json"), i), daemon=True)
               for i in range(1, nproc)]
    for w in workers:
        w.start()
    try:
        return prepare(cfg, min_tokens, log, first=0)
    finally:
        for w in workers:
            w.join()


def _prepare_worker(raw: dict[str, Any], first: int) -> None:
    with contextlib.suppress(DataError):  # the process that started it meets the same error and reports it
        prepare(Config.model_validate(raw), first=first)


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


def _build(cfg: Config, key: str, folder: Path, log: Log | None, first: int) -> Prepared:
    """Prepare the data together with whichever other processes are preparing it, into folder."""
    work = folder.with_name(f".{key}.partial")  # one name for every process and pod: they share it
    meta_file = folder / "meta.json"
    if meta_file.is_file():  # finished by another process since this one looked
        return Prepared(folder, json.loads(meta_file.read_text()))
    try:
        claims = Claims(work / "claims")
    except OSError:  # the work was finished and moved into place while this process made its claims folder
        if not meta_file.is_file():
            raise
        return Prepared(folder, json.loads(meta_file.read_text()))
    try:
        tok, info = _shared_tokenizer(cfg, work, meta_file, claims, log)
        parts = plan(cfg)
        tasks = {f"part-{p.index:05d}": p for p in parts}
        dtype = np.dtype(np.uint16 if info["vocab_size"] <= 65535 else np.uint32)
        masked = any(src.kind == "chat" for src in cfg.data.sources) or cfg.data.attention == "document"
        if log:
            log(f"preparing data into {folder}: {len(parts)} parts of up to {cfg.data.part_mb:g} MiB, shared by "
                "every process that prepares it")

        def parts_done() -> set[str]:
            if meta_file.is_file():
                return set(tasks)
            try:
                names = set(os.listdir(work / PARTS_DIR))
            except FileNotFoundError:
                names = set()
            return {t for t, p in tasks.items() if f"{Path(p.name).name}.json" in names}

        share(list(tasks), parts_done, lambda t: (work / f"{tasks[t].name}.json").is_file() or meta_file.is_file(),
              lambda t: write_part(cfg, tok, tasks[t], work, dtype, masked), claims, log, "parts", first)
        share(["index"], lambda: {"index"} if meta_file.is_file() else set(), lambda _: meta_file.is_file(),
              lambda _: _publish(cfg, key, work, folder, parts, tok, info, dtype, masked), claims, log, "index")
    except (OSError, DataError):
        if not meta_file.is_file():  # else: another process finished and moved the work while this one helped
            raise
    finally:
        claims.close()
    return Prepared(folder, json.loads(meta_file.read_text()))


def _shared_tokenizer(cfg: Config, work: Path, meta_file: Path, claims: Claims,
                      log: Log | None) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer, built (a BPE trained) by one process and saved for the others; what it is."""
    saved = work / "tokenizer"

    def build(_: str) -> None:
        tok_cfg = cfg.data.tokenizer
        corpus = training_texts(cfg) if tok_cfg.kind == "bpe" and not tok_cfg.path else None
        if log and corpus is not None:
            log("training the BPE tokenizer on the corpus")
        elif log and tok_cfg.kind == "bpe":
            log(f"tokenizing with the BPE tokenizer trained before, in {tok_cfg.path}")
        tok = build_tokenizer(cfg.data.tokenizer, corpus)
        tmp = work / f"tokenizer.tmp-{process_tag()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save(tmp)
        info = {"fingerprint": tok.fingerprint(), "kind": tok.kind, "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id}
        (tmp / TOKENIZER_INFO).write_text(json.dumps(info))
        try:
            os.rename(tmp, saved)
        except OSError:  # another process saved it first (a taken-over claim)
            shutil.rmtree(tmp, ignore_errors=True)
            if not (saved / TOKENIZER_INFO).is_file():
                raise

    def done() -> set[str]:  # saved here, or everything finished and moved into place meanwhile
        return {"tokenizer"} if (saved / TOKENIZER_INFO).is_file() or meta_file.is_file() else set()

    share(["tokenizer"], done, lambda _: bool(done()), build, claims, log, "tokenizer")
    if not (saved / TOKENIZER_INFO).is_file():
        saved = meta_file.parent / "tokenizer"
    return load_saved_tokenizer(saved), json.loads((saved / TOKENIZER_INFO).read_text())


def training_texts(cfg: Config) -> Iterator[str]:
    """What a BPE tokenizer learns from: every document (text files in pieces cut where the pre-tokenizer
    splits, so the word counts, and the tokenizer, are those of whole files)."""
    from kubetrain.data.chat import conversation_texts

    for src in cfg.data.sources:
        if src.kind == "chat":
            yield from conversation_texts(src)
        elif src.kind in ("text", "builtin"):
            for f in sources.source_files(src):
                with open(f, "rb") as fh:
                    yield from text_pieces(fh, 0, f.stat().st_size)
        else:
            yield from sources.iter_documents(src)


def _publish(cfg: Config, key: str, work: Path, folder: Path, parts: list[Part], tok: Tokenizer,
             info: dict[str, Any], dtype: np.dtype[Any], masked: bool) -> None:
    """Join the parts into the index, write meta.json and move the folder into place."""
    from kubetrain.data.chat import pad_id

    infos = {p.index: json.loads((work / f"{p.name}.json").read_text()) for p in parts}
    segments = join(cfg, parts, infos, pad_id(tok))
    n_tokens = sum(length(segment) for segment in segments)
    if n_tokens == 0:
        names = ", ".join(s.path or "builtin corpus" for s in cfg.data.sources)
        raise DataError(f"the corpus is empty: no tokens in {names}")
    n_val = int(n_tokens * cfg.data.val_fraction)
    if _windowed_chat(cfg):
        n_val -= n_val % cfg.model.block_size  # the validation windows start on a conversation too
    last = parts[-1] if parts else None
    if last is not None and last.kind == "chat" and infos[last.index].get("val_from") is not None:
        n_val = infos[last.index]["tokens"] - infos[last.index]["val_from"]  # its last conversations, packed apart
    packed = [infos[p.index]["packing"] for p in parts if "packing" in infos[p.index]]
    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "tokenizer": info["fingerprint"],
        "tokenizer_kind": info["kind"],
        "vocab_size": info["vocab_size"],
        "eos_id": info["eos_id"],
        "dtype": dtype.name,
        "tokens": n_tokens,
        "train_tokens": n_tokens - n_val,
        "val_tokens": n_val,
        "val_fraction": cfg.data.val_fraction,
        "masked": masked,
        "documents": documents(cfg),
        "packing": {k: sum(p[k] for p in packed) for k in ("tokens", "positions", "windows")} if packed else None,
        "part_mb": cfg.data.part_mb,
        "sources": [s.model_dump(mode="json") for s in cfg.data.sources],
        "parts": segments,
        "checksums": {name: digest for i in sorted(infos) for name, digest in infos[i]["checksums"].items()},
    }
    tmp = work / f"meta.json.tmp-{process_tag()}"
    tmp.write_text(json.dumps(meta, indent=1))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, work / "meta.json")
    shutil.rmtree(work / "claims", ignore_errors=True)
    os.rename(work, folder)


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


