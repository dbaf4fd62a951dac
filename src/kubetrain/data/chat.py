"""Chat / instruction JSONL -> (token ids, loss mask): rendered with a chat template, prompt tokens masked.

A row is {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "response": ...} (with an
optional "system"). The mask is 1 on the tokens the model learns to produce (assistant turns, their
end-of-turn token included) and 0 elsewhere.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from kubetrain.config.schema import ChatConfig, SourceConfig
from kubetrain.data import sources
from kubetrain.data.tokenizers import Tokenizer, added_special_ids
from kubetrain.errors import DataError

ROLES = ("system", "user", "assistant", "tool")

NAMED_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
}

Messages = list[dict[str, str]]
Render = Callable[[Messages, bool], str]


class BadRow(ValueError):
    """One row cannot be used; the caller adds the file and line."""


def pad_id(tok: Tokenizer) -> int:
    """The id that fills unpacked windows (never in the loss, never attended to by real tokens)."""
    pad = getattr(getattr(tok, "tok", None), "pad_token_id", None)
    return int(pad if pad is not None else tok.eos_id if tok.eos_id is not None else 0)


def encode_conversations(
    src: SourceConfig, tok: Tokenizer, chat_cfg: ChatConfig, block_size: int | None = None
) -> Iterator[tuple[list[int], list[int]]]:
    """(ids, mask) per conversation of a chat source, `src.weight` copies of it.

    With block_size each conversation is cut to block_size tokens, its first token out of the loss (it is only
    ever the label of another conversation's last token) and one with no assistant token left is dropped; unpacked
    (chat_cfg.packing false) it is padded up to exactly one window. Packed, data/packing.py bins them.
    """
    render = renderer(tok, chat_cfg)
    wrap = special_tokens(tok) if chat_cfg.add_special_tokens else ([], [])
    cut = block_size is not None
    unpacked = cut and not chat_cfg.packing
    whole, frac = divmod(src.weight, 1.0)
    n_rows: int | None = None
    truncated = dropped = 0
    for copy in range(int(whole) + (1 if frac else 0)):
        limit = None
        if copy == int(whole):
            if n_rows is None:
                n_rows = sum(1 for _ in _conversations(src, chat_cfg, quiet=whole > 0))
            limit = int(n_rows * frac)
        count = 0
        for where, messages in _conversations(src, chat_cfg, quiet=copy > 0 or limit is not None):
            if limit is not None and count >= limit:
                break
            count += 1
            ids, mask = encode_messages(messages, render, tok, chat_cfg.mask_prompt, wrap, where)
            if cut:
                assert block_size is not None
                truncated += copy == 0 and len(ids) > block_size
                ids, mask = ids[:block_size], mask[:block_size]
                mask[:1] = [0]  # only ever a label of the previous window's last token: another conversation
                if not any(mask):  # the answer was cut off: a window with nothing to learn
                    dropped += copy == 0
                    continue
            if unpacked:
                assert block_size is not None
                fill = block_size - len(ids)
                ids, mask = ids + [pad_id(tok)] * fill, mask + [0] * fill
            yield ids, mask
        n_rows = count if copy == 0 and limit is None else n_rows
    if truncated:
        _warn(f"{truncated} conversations of {src.path} were cut to block_size ({block_size}) tokens; "
              f"{dropped} of them kept no assistant token and were left out")


def _conversations(src: SourceConfig, chat_cfg: ChatConfig, quiet: bool) -> Iterator[tuple[str, Messages]]:
    """('file:line', messages) per good row; bad rows raise, or are skipped and counted."""
    skipped, first_bad = 0, ""
    for f in sources.source_files(src):
        for lineno, line in sources.iter_lines(f):
            if not line.strip():
                continue
            where = f"{f}:{lineno}"
            try:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadRow(f"not valid JSON ({e.msg})") from None
                messages = to_messages(row)
            except BadRow as e:
                if not chat_cfg.skip_bad_rows:
                    raise DataError(f"{where}: {e}") from None
                skipped += 1
                first_bad = first_bad or f"{where}: {e}"
                continue
            yield where, messages
    if skipped and not quiet:
        _warn(f"skipped {skipped} malformed rows of {src.path} (data.chat.skip_bad_rows); first: {first_bad}")


def conversation_texts(src: SourceConfig) -> Iterator[str]:
    """The message contents of every good row: what a BPE tokenizer is trained on (bad rows fail later)."""
    for _, messages in _conversations(src, ChatConfig.model_validate({"skip_bad_rows": True}), quiet=True):
        yield "\n".join(m["content"] for m in messages)


def to_messages(row: Any) -> Messages:
    """A row as a list of {role, content}; BadRow says what is wrong with it."""
    if not isinstance(row, dict):
        raise BadRow(f"expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise BadRow("'messages' must be a non-empty list")
        out: Messages = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not all(isinstance(m.get(k), str) for k in ("role", "content")):
                raise BadRow(f"messages[{i}] needs string 'role' and 'content' fields")
            if m["role"] not in ROLES:
                raise BadRow(f"messages[{i}] has unknown role '{m['role']}' (expected {', '.join(ROLES)})")
            out.append({"role": m["role"], "content": m["content"]})
        if not any(m["role"] == "assistant" for m in out):
            raise BadRow("no assistant message: nothing to learn")
        return out
    if "prompt" in row or "response" in row:
        for key in ("prompt", "response"):
            if not isinstance(row.get(key), str):
                raise BadRow(f"'{key}' must be a string")
        out = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
        system = row.get("system")
        if system is not None:
            if not isinstance(system, str):
                raise BadRow("'system' must be a string")
            out.insert(0, {"role": "system", "content": system})
        return out
    raise BadRow("needs a 'messages' list or 'prompt' and 'response' fields")


def encode_messages(
    messages: Messages, render: Render, tok: Tokenizer, mask_prompt: bool, wrap: tuple[list[int], list[int]],
    where: str = "",
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one conversation.

    The text is cut into prompt and assistant segments by rendering growing prefixes of the conversation;
    each segment is encoded on its own, so the mask lines up with the tokens exactly for every tokenizer.
    """
    try:
        full = render(messages, False)
        segments: list[tuple[str, bool]] = []
        pos = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt, turn = render(messages[:i], True), render(messages[: i + 1], False)
            if len(prompt) < pos or not turn.startswith(prompt) or not full.startswith(turn):
                raise DataError(
                    f"{where}: the chat template does not render conversations prefix by prefix, so the "
                    "prompt cannot be masked; set data.chat.template or data.chat.mask_prompt: false"
                )
            segments += [(full[pos : len(prompt)], False), (full[len(prompt) : len(turn)], True)]
            pos = len(turn)
        segments.append((full[pos:], False))
    except _template_errors() as e:
        raise DataError(f"{where}: the chat template failed on this row: {e}") from None
    ids, mask = list(wrap[0]), [0] * len(wrap[0])
    for text, learn in segments:
        if text:
            piece = tok.encode(text)
            ids += piece
            mask += [1 if (learn or not mask_prompt) else 0] * len(piece)
    ids += wrap[1]
    mask += [1] * len(wrap[1])
    return ids, mask


def encode_prompt(tok: Tokenizer, chat_cfg: ChatConfig, text: str) -> list[int]:
    """A user message rendered with the chat template and the assistant header, ready to generate from."""
    wrap = special_tokens(tok) if chat_cfg.add_special_tokens else ([], [])
    return wrap[0] + tok.encode(renderer(tok, chat_cfg)([{"role": "user", "content": text}], True))


def renderer(tok: Tokenizer, chat_cfg: ChatConfig) -> Render:
    """messages, add_generation_prompt -> text, with the configured template or else the tokenizer's own."""
    template = chat_cfg.template
    if template is not None and template in NAMED_TEMPLATES:
        template = NAMED_TEMPLATES[template]
    elif template is not None and "{" not in template:
        raise DataError(
            f"unknown chat template '{template}': give a Jinja template or one of "
            f"{', '.join(NAMED_TEMPLATES)}"
        )
    hf = getattr(tok, "tok", None)
    if hf is not None and hasattr(hf, "apply_chat_template"):
        if template is None and not getattr(hf, "chat_template", None):
            raise DataError("the tokenizer has no chat template: set data.chat.template (e.g. chatml)")

        def render_hf(messages: Messages, add_generation_prompt: bool) -> str:
            text = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template
            )
            return str(text)

        return render_hf
    if template is None:
        raise DataError(f"the {tok.kind} tokenizer has no chat template: set data.chat.template to chatml")
    return _jinja(template, eos=tok.decode([tok.eos_id]) if tok.eos_id is not None else "")


def _jinja(template: str, eos: str) -> Render:
    """Render like transformers does (sandboxed, trim_blocks, lstrip_blocks) for tokenizers without it."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("chat templates need jinja2: pip install 'kubetrain[hf]'") from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except TemplateError as e:
        raise DataError(f"data.chat.template is not a valid Jinja template: {e}") from None

    def render(messages: Messages, add_generation_prompt: bool) -> str:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token="",
                               eos_token=eos)

    return render


def special_tokens(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids that wrap a conversation: the tokenizer's own BOS / EOS (transformers), else just EOS."""
    hf = getattr(tok, "tok", None)
    if hf is None or not hasattr(hf, "apply_chat_template"):
        return [], ([tok.eos_id] if tok.eos_id is not None else [])
    return added_special_ids(tok)


def _template_errors() -> tuple[type[BaseException], ...]:
    from jinja2.exceptions import TemplateError

    return (TemplateError, TypeError, KeyError, IndexError)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)

