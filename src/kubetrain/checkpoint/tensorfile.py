"""Write tensors in the safetensors format straight from their memory, checksumming the bytes on the way.

safetensors' own `save_file` copies every tensor into a bytes object first; writing the tensor's buffer and
hashing it as it goes out keeps a checkpoint save at the disk's speed. Files are read back with the
safetensors library (`load_file`), which also proves the format.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import xxhash

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TENSOR = "__tensor__"


def write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write `tensors` to a .safetensors file, fsync it, and return the xxh3-128 digest of its bytes."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    flat: list[torch.Tensor] = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot store {name} of dtype {t.dtype}")
        t = t.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        flat.append(t)
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    digest = xxhash.xxh3_128()
    with open(path, "wb", buffering=0) as f:
        for chunk in (len(blob).to_bytes(8, "little"), blob):
            f.write(chunk)
            digest.update(chunk)
        for t in flat:
            if t.numel() == 0:
                continue
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy().data)
            written = 0
            while written < len(view):  # an unbuffered write may be partial
                written += f.write(view[written:])
            digest.update(view)
        os.fsync(f.fileno())
    return digest.hexdigest()


def split(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """`obj` with every tensor moved into `tensors` (named by its path) and replaced by a reference."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {_TENSOR: prefix}
    if isinstance(obj, dict):
        return {k: split(v, tensors, f"{prefix}.{k}" if prefix else str(k)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(split(v, tensors, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(obj))
    return obj


def join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `split`."""
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        return {k: join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(join(v, tensors) for v in obj)
    return obj
