"""Tokenizers behind one small interface: byte-level, BPE trained on the corpus, Hugging Face, tiktoken."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kubetrain.config.schema import TokenizerConfig
from kubetrain.errors import DataError

TOKENIZER_FILE = "kubetrain_tokenizer.json"  # records which kind of tokenizer a folder holds


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def save(self, folder: Path) -> None: ...
    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: no files, no training, every text round-trips.

    Bytes 0xFE and 0xFF never occur in UTF-8, so their ids serve as BOS and EOS: the byte tokenizer has real
    special tokens (llama.cpp and transformers read them from an export) without a larger vocabulary, and
    every model trained before they existed keeps its shape. Text never encodes to them; decoding drops them.
    """

    kind = "byte"
    vocab_size = 256
    bos_id = 0xFE
    eos_id: int | None = 0xFF

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < self.bos_id).decode("utf-8", errors="replace")

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / TOKENIZER_FILE).write_text(json.dumps({"kind": "byte"}))

    def fingerprint(self) -> str:
        return "byte"


class FastTokenizer:
    """A `tokenizers` tokenizer.json (our trained BPE, or the fast file of a Hugging Face folder)."""

    def __init__(self, tok: Any, kind: str = "bpe", eos_token: str | None = "<|endoftext|>") -> None:
        self.tok = tok
        self.kind = kind
        self.vocab_size = int(tok.get_vocab_size())
        self.eos_id = tok.token_to_id(eos_token) if eos_token else None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(folder / "tokenizer.json"))
        (folder / TOKENIZER_FILE).write_text(json.dumps({"kind": self.kind}))

    def fingerprint(self) -> str:
        return f"{self.kind}:" + hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]


class HFTokenizer:
    """Any Hugging Face tokenizer folder (or hub id when the config allows it), chat template included."""

    kind = "hf"

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size = len(tok)
        self.eos_id = tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.tok.save_pretrained(str(folder))
        (folder / TOKENIZER_FILE).write_text(json.dumps({"kind": "hf"}))

    def fingerprint(self) -> str:
        vocab = json.dumps(sorted(self.tok.get_vocab().items())).encode()
        return "hf:" + hashlib.sha256(vocab).hexdigest()[:16]


class TiktokenTokenizer:
    """A tiktoken encoding, read from tiktoken's cache; fetched only when the config allows downloads."""

    kind = "tiktoken"

    def __init__(self, name: str, local_files_only: bool = True) -> None:
        try:
            import tiktoken
        except ImportError:
            raise DataError(
                "tokenizer kind 'tiktoken' needs the tiktoken package: pip install 'kubetrain[tiktoken]'"
            ) from None
        try:
            with _tiktoken_downloads(allowed=not is_offline(local_files_only)):
                self.enc = tiktoken.get_encoding(name)
        except _DownloadRefused as e:
            raise DataError(
                f"tiktoken encoding '{name}' is not in the local cache and downloads are off "
                f"(data.tokenizer.local_files_only / HF_HUB_OFFLINE): save {e.url} as "
                f"{tiktoken_cache_file(e.url)} (TIKTOKEN_CACHE_DIR chooses the folder), "
                "or set data.tokenizer.local_files_only: false"
            ) from None
        except Exception as e:
            raise DataError(f"tiktoken encoding '{name}' could not be loaded: {e}") from None
        self.name = name
        self.vocab_size = int(self.enc.n_vocab)
        self.eos_id: int | None = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        return list(self.enc.encode_ordinary(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.enc.decode(ids))

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / TOKENIZER_FILE).write_text(json.dumps({"kind": "tiktoken", "name": self.name}))

    def fingerprint(self) -> str:
        return f"tiktoken:{self.name}"


def is_offline(local_files_only: bool) -> bool:
    """The one offline rule for every hub access: the config's local_files_only, or HF_HUB_OFFLINE=1."""
    return local_files_only or os.environ.get("HF_HUB_OFFLINE") == "1"


def tiktoken_cache_file(url: str) -> Path:
    """Where tiktoken looks for the file it would download from `url` (tiktoken.load.read_file_cached)."""
    folder = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    root = Path(folder) if folder else Path(tempfile.gettempdir()) / "data-gym-cache"
    return root / hashlib.sha1(url.encode()).hexdigest()


class _DownloadRefused(Exception):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url


@contextmanager
def _tiktoken_downloads(allowed: bool) -> Iterator[None]:
    """Offline, turn tiktoken's one fetch point (tiktoken.load.read_file, called on a cache miss) into a refusal.

    read_file_cached reads the cache itself and calls the module-level read_file only for what is missing
    (tiktoken 0.7-0.14), so replacing that name refuses exactly the downloads and nothing else.
    """
    import tiktoken.load

    real = tiktoken.load.read_file
    if allowed:
        yield
        return

    def local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise _DownloadRefused(blobpath)
        return real(blobpath)

    with _TIKTOKEN_LOCK:
        tiktoken.load.read_file = local_only
        try:
            yield
        finally:
            tiktoken.load.read_file = real


_TIKTOKEN_LOCK = threading.Lock()


def added_special_ids(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer itself adds before and after a text (its BOS/EOS rule, e.g. add_bos_token).

    Found by encoding a probe with and without special tokens, so every tokenizer's own setting decides.
    """
    if isinstance(tok, HFTokenizer):
        bare = list(tok.tok("a", add_special_tokens=False)["input_ids"])
        full = list(tok.tok("a", add_special_tokens=True)["input_ids"])
    elif isinstance(tok, FastTokenizer):
        bare = list(tok.tok.encode("a", add_special_tokens=False).ids)
        full = list(tok.tok.encode("a", add_special_tokens=True).ids)
    else:
        return [], []
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return [], []


def prompt_ids(tok: Tokenizer, text: str) -> list[int]:
    """A prompt as the model's tokenizer feeds it (BOS first when it adds one), as transformers and llama.cpp do."""
    return added_special_ids(tok)[0] + tok.encode(text)


def train_bpe(texts: Iterable[str], vocab_size: int) -> FastTokenizer:
    """Train a byte-level BPE on the corpus (GPT-2 style pre-tokenizer, one <|endoftext|> special)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return FastTokenizer(tok, kind="bpe")


def load_hf_tokenizer(path: str, local_files_only: bool = True) -> HFTokenizer | FastTokenizer:
    """A Hugging Face tokenizer: via transformers when installed (chat templates), else its tokenizer.json."""
    offline = is_offline(local_files_only)
    local = Path(path).expanduser()
    if offline and not local.exists():
        raise DataError(f"tokenizer folder not found: {path} (offline: no hub download)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        file = local / "tokenizer.json"
        if not file.is_file():
            raise DataError(
                f"{path}: no tokenizer.json (install kubetrain[hf] for other tokenizer formats)"
            ) from None
        from tokenizers import Tokenizer as RawTokenizer

        return FastTokenizer(RawTokenizer.from_file(str(file)), kind="hf", eos_token=None)
    try:
        tok = AutoTokenizer.from_pretrained(str(local) if local.exists() else path, local_files_only=offline)
    except Exception as e:
        raise DataError(f"tokenizer '{path}' could not be loaded: {str(e).splitlines()[0]}") from None
    return HFTokenizer(tok)


def build_tokenizer(cfg: TokenizerConfig, corpus: Iterable[str] | None = None) -> Tokenizer:
    """The tokenizer a config asks for; BPE is trained on `corpus`, unless `path` names one trained before."""
    if cfg.kind == "byte":
        return ByteTokenizer()
    if cfg.kind == "bpe":
        if cfg.path:
            return load_trained_bpe(Path(cfg.path).expanduser())
        if corpus is None:
            raise DataError("a BPE tokenizer is trained during prepare; no corpus was given")
        return train_bpe(corpus, cfg.vocab_size)
    if cfg.kind == "tiktoken":
        return TiktokenTokenizer(cfg.path or "gpt2", cfg.local_files_only)
    if not cfg.path:
        raise DataError("data.tokenizer.kind 'hf' needs data.tokenizer.path (a folder or hub id)")
    return load_hf_tokenizer(cfg.path, cfg.local_files_only)


def load_trained_bpe(folder: Path) -> FastTokenizer:
    """A BPE trained before (the `tokenizer/` folder of a run with a bpe tokenizer), to tokenize new data with."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise DataError(f"no trained BPE tokenizer in {folder} (no tokenizer.json)")
    from tokenizers import Tokenizer as RawTokenizer

    return FastTokenizer(RawTokenizer.from_file(str(file)), kind="bpe")


def load_saved_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer that `save` wrote into a folder (a run directory or a shard cache)."""
    marker = folder / TOKENIZER_FILE
    if not marker.is_file():
        raise DataError(f"no tokenizer saved in {folder}")
    info = json.loads(marker.read_text())
    kind = info.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "tiktoken":
        return TiktokenTokenizer(info["name"])
    if kind == "bpe":
        return load_trained_bpe(folder)
    return load_hf_tokenizer(str(folder), local_files_only=True)


def encode_texts(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """The ids of each text, as `tok.encode` gives them, in one batch call where the tokenizer has one.

    Fast tokenizers encode a batch on all cores (Rust threads) and without offsets; the byte tokenizer is a
    view of the UTF-8 bytes. The ids come back as arrays, never lists of Python ints (a 100 MB text would be
    25 million of them).
    """
    if isinstance(tok, ByteTokenizer):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    backend = None
    if isinstance(tok, FastTokenizer):
        backend = tok.tok
    elif isinstance(tok, HFTokenizer) and getattr(tok.tok, "is_fast", False):
        backend = tok.tok.backend_tokenizer
    if backend is not None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets (tokenizers 0.20+)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]
    if isinstance(tok, TiktokenTokenizer):
        return [np.asarray(ids, dtype=np.uint32) for ids in tok.enc.encode_ordinary_batch(texts)]
    return [np.asarray(tok.encode(t), dtype=np.uint32) for t in texts]


def chunks(it: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
