"""Export a trained run: a Hugging Face folder (our GPT as Llama, HF runs, merged LoRA, an adapter) or GGUF.

Each output is written beside its final path and renamed into place: a failed export leaves nothing half-done.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError
from kubetrain.files import usual_modes
from kubetrain.models.gpt import GPT
from kubetrain.models.hf import HFCausalLM

FORMATS = ("hf", "gguf")
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class Exported:
    path: str
    format: str
    kind: str  # "model", "merged" or "adapter"
    step: int
    checkpoint: str
    modelfile: str | None = None  # the Ollama Modelfile written beside a GGUF

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def export(
    target: Path, fmt: str, out: Path, *, merge: bool = False, which: str = "best", dtype: str = "auto"
) -> Exported:
    """Write the model of a run directory or checkpoint to `out` in `fmt` (hf or gguf)."""
    from kubetrain.models.load import load_trained
    from kubetrain.models.lora import is_lora, merge_lora

    if fmt not in FORMATS:
        raise UserInputError(f"--format must be one of {', '.join(FORMATS)}, not '{fmt}'")
    if dtype not in DTYPES:
        raise UserInputError(f"--dtype must be one of {', '.join(DTYPES)}, not '{dtype}'")
    if fmt == "gguf" and dtype == "bfloat16":
        raise UserInputError("GGUF export writes float32 or float16 (quantize afterwards with llama.cpp)")
    if out.exists() and (out.is_file() or any(out.iterdir())):
        raise UserInputError(f"{out} already exists; choose another -o or remove it")
    model, tokenizer, cfg, ckpt = load_trained(target, which)
    lora = is_lora(model)
    if merge and not lora:
        raise UserInputError(f"--merge folds LoRA adapters into the base model; {ckpt.path} has none")
    if lora and not merge and (fmt == "gguf" or not isinstance(model, HFCausalLM)):
        what = "GGUF holds whole models" if fmt == "gguf" else "an adapter alone needs a Hugging Face base"
        raise UserInputError(f"{ckpt.path} is a LoRA run and {what}: add --merge")
    if lora and merge:
        model = merge_lora(model)
    kind = "merged" if merge else "adapter" if lora else "model"
    modelfile = None
    try:
        if fmt == "gguf":
            modelfile = str(_write_gguf(model, tokenizer, out, dtype, cfg))
        else:
            _write_hf_folder(model, tokenizer, out, _hf_dtype(dtype, model, cfg), adapter=kind == "adapter")
    except Exception as e:
        if not _out_of_space(e):
            raise
        raise UserInputError(f"no space left on the device of {out.parent.resolve()}: nothing was exported; free "
                             f"some space there or choose another -o") from None
    return Exported(str(out), fmt, kind, ckpt.step, str(ckpt.path), modelfile)


def _out_of_space(e: BaseException) -> bool:
    """A full disk or quota, as an OSError, as numpy's short write (the GGUF writer's tensors: an OSError with no errno,
    "N requested and M written") or as the safetensors writer's own error (a Rust io::Error's text)."""
    if isinstance(e, OSError) and (e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                                   or (e.errno is None and " requested and " in str(e))):
        return True
    return type(e).__name__ == "SafetensorError" and any(
        s in str(e) for s in ("No space left", "StorageFull", "QuotaExceeded", "FileTooLarge"))


def _write_gguf(model: nn.Module, tokenizer: Any, out: Path, dtype: str, cfg: Config) -> Path:
    """The .gguf, then an Ollama Modelfile beside it (whose path is returned)."""
    from kubetrain.data.chat import NAMED_TEMPLATES
    from kubetrain.export.gguf import write_gguf

    if not isinstance(model, GPT | HFCausalLM):
        raise UserInputError(f"GGUF export does not know models of type {type(model).__name__}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir():
        out.rmdir()  # an empty folder named as the output file
    template = cfg.data.chat.template
    write_gguf(model, tokenizer, out, "f32" if dtype == "float32" else "f16", name=cfg.run.name,
               chat_template=NAMED_TEMPLATES.get(template, template) if template else None)
    usual_modes(out)
    try:
        return _write_modelfile(out, tokenizer, cfg)
    except BaseException:  # a GGUF without its Modelfile is half an export
        out.unlink(missing_ok=True)
        raise


def _write_modelfile(gguf: Path, tokenizer: Any, cfg: Config) -> Path:
    from kubetrain.data.chat import renderer
    from kubetrain.data.tokenizers import added_special_ids
    from kubetrain.errors import DataError
    from kubetrain.export.hf import to_hf_tokenizer
    from kubetrain.export.modelfile import chat_layout, modelfile_path, modelfile_text

    hf_tok = to_hf_tokenizer(tokenizer)
    try:
        render = renderer(tokenizer, cfg.data.chat)
    except DataError:  # no chat template: a plain completion model
        render = None
    layout = chat_layout(render, hf_tok.bos_token or "") if render else None
    stops = [hf_tok.eos_token or "", layout.around["assistant"][1].strip() if layout else ""]
    text = modelfile_text(gguf.name, layout, chat=render is not None, stops=stops,
                          context_length=cfg.model.block_size,
                          tokenizer_adds_bos=bool(added_special_ids(tokenizer)[0]))
    path = modelfile_path(gguf)
    try:
        path.write_text(text, encoding="utf-8")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _write_hf_folder(model: nn.Module, tokenizer: Any, out: Path, dtype: str | None, adapter: bool) -> None:
    from kubetrain.export.hf import save_adapter, save_gpt, save_hf

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if isinstance(model, GPT):
            save_gpt(model, tokenizer, tmp, dtype or "float32")
        elif isinstance(model, HFCausalLM) and adapter:
            save_adapter(model, tokenizer, tmp)
        elif isinstance(model, HFCausalLM):
            save_hf(model, tokenizer, tmp, dtype)
        else:
            raise UserInputError(f"export does not know models of type {type(model).__name__}")
        usual_modes(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _hf_dtype(dtype: str, model: nn.Module, cfg: Config) -> str | None:
    """auto: our GPT in float32, an HF model in the dtype its base folder declares (None: as trained)."""
    if dtype != "auto":
        return dtype
    if isinstance(model, GPT):
        return "float32"
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    folder = Path(cfg.model.name_or_path or "").expanduser()
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    declared = raw.get("dtype") or raw.get("torch_dtype")
    return declared if declared in DTYPES else None
