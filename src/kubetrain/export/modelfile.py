"""An Ollama Modelfile for an exported GGUF: FROM, the chat template as a Go TEMPLATE, stop tokens, context.

Ollama's TEMPLATE is a Go template, the run's chat template a Jinja one. The Go template is derived by
rendering the run's own template with marker contents and reading off what it puts around each role's message;
it is written only when re-rendering a conversation that way gives exactly what the Jinja template gives.
Otherwise the Modelfile leaves TEMPLATE out, and Ollama picks one from the GGUF's tokenizer.chat_template.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Messages = list[dict[str, str]]
Render = Callable[[Messages, bool], str]

_MARK = {"system": "SYSTEMqz7Mark", "user": "USERqz7Mark", "assistant": "ASSISTANTqz7Mark"}


@dataclass(frozen=True)
class ChatLayout:
    """What a chat template writes around each message: text before and after the content, per role."""

    prefix: str  # once at the start (a BOS written by the template)
    around: dict[str, tuple[str, str]]
    generation_prompt: str

    def render(self, messages: Messages) -> str:
        body = "".join(self.around[m["role"]][0] + m["content"] + self.around[m["role"]][1] for m in messages)
        return self.prefix + body

    def go_template(self, with_prefix: bool) -> str:
        """The same layout as an Ollama (Go text/template) TEMPLATE over .Messages."""
        branches = "{{ else if ".join(
            f'eq .Role "{role}" }}}}{before}{{{{ .Content }}}}{after}' for role, (before, after) in self.around.items()
        )
        head = self.prefix if with_prefix else ""
        return f"{head}{{{{- range .Messages }}}}{{{{ if {branches}{{{{ end }}}}{{{{ end }}}}{self.generation_prompt}"


def chat_layout(render: Render, bos_text: str = "") -> ChatLayout | None:
    """The layout of a chat template, or None when its output is not one wrapper per message."""
    s, u1, a1, u2, a2 = ({"role": r, "content": _MARK[r] + str(i)} for r, i in
                         (("system", 0), ("user", 1), ("assistant", 1), ("user", 2), ("assistant", 2)))
    conversation = [s, u1, a1, u2, a2]
    try:
        texts = [render(conversation[:k], False) for k in range(1, 6)]
        gen_base, gen = render(conversation[:2], False), render(conversation[:2], True)
        no_system = render([u1, a1], False)
    except Exception:  # a template that refuses these conversations has no simple layout
        return None
    prefix = bos_text if bos_text and texts[0].startswith(bos_text) else ""
    pieces = [texts[0][len(prefix):]] + [texts[k][len(texts[k - 1]):] for k in range(1, 5)]
    if any(not texts[k].startswith(texts[k - 1]) for k in range(1, 5)) or not gen.startswith(gen_base):
        return None
    around: dict[str, tuple[str, str]] = {}
    for message, piece in zip(conversation, pieces, strict=True):
        if piece.count(message["content"]) != 1:
            return None
        before, after = piece.split(message["content"])
        if around.setdefault(message["role"], (before, after)) != (before, after):
            return None  # the second turn is wrapped unlike the first
    layout = ChatLayout(prefix, around, gen[len(gen_base):])
    checks = ((conversation, texts[-1]), ([u1, a1], no_system))
    if any(layout.render(msgs) != text for msgs, text in checks):
        return None  # e.g. a default system prompt when the conversation has none
    if any("{{" in part or '"""' in part for part in (prefix, layout.generation_prompt, *sum(around.values(), ()))):
        return None
    return layout


def modelfile_text(
    gguf_name: str,
    layout: ChatLayout | None,
    chat: bool,
    stops: list[str],
    context_length: int,
    tokenizer_adds_bos: bool,
) -> str:
    """The Modelfile: FROM ./<gguf>, TEMPLATE (when it can be written), one stop per stop token, num_ctx."""
    lines = ["# written by kubetrain export; load it with: ollama create NAME -f <this file>", f"FROM ./{gguf_name}"]
    if layout is not None:
        lines.append(f'TEMPLATE """{layout.go_template(with_prefix=not tokenizer_adds_bos)}"""')
    elif chat:
        lines.append("# the chat template is not one wrapper per message: Ollama reads it from the GGUF")
    else:
        lines.append('TEMPLATE """{{ .Prompt }}"""')  # no chat template: plain text completion
    for stop in dict.fromkeys(s for s in stops if s):
        value = ollama_value(stop)
        lines.append(f"PARAMETER stop {value}" if value is not None else
                     f"# stop {stop!r} left out: no quoting makes Ollama's parser read it back as it is")
    lines.append(f"PARAMETER num_ctx {context_length}")
    return "\n".join(lines) + "\n"


def modelfile_path(gguf: Path) -> Path:
    """`Modelfile` beside the GGUF, or `<stem>.Modelfile` when another export already wrote one there."""
    plain = gguf.with_name("Modelfile")
    return plain if not plain.exists() else gguf.with_name(f"{gguf.stem}.Modelfile")


def ollama_value(text: str) -> str | None:
    """`text` quoted so that Ollama reads it back unchanged; None when no quoting can.

    Ollama's parser (parser/parser.go: ParseFile, unquote) unescapes nothing: it strips one pair of outer
    \"\"\" or " and keeps what is between, and a value ends at the first newline after which what it has read
    so far unquotes. So `a"b` is written "a"b" (an escaped "a\\"b" would come back with its backslash).
    """
    for quote in ('"', '"""'):
        written = quote + text + quote
        if _read_back(written) == text:
            return written
    return None


def _read_back(value: str) -> str | None:
    """The value Ollama's parser takes from `value` (what follows `PARAMETER stop `), or None if it fails."""
    read = ""
    for r in value:
        if r in "\r\n":
            unquoted = _unquote(read.strip())
            if unquoted is not None:
                return unquoted  # the value ends here; the rest would be read as the next command
            read += r
        elif r in " \t" or r.isprintable():
            read += r  # other control characters are dropped
    return _unquote(read.strip())


def _unquote(s: str) -> str | None:
    if s.startswith('"""'):
        return s[3:-3] if len(s) >= 6 and s.endswith('"""') else None
    if s.startswith('"'):
        return s[1:-1] if len(s) >= 2 and s.endswith('"') else None
    return s
