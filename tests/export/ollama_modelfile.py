"""How Ollama reads a Modelfile back: a port of the value handling of `ParseFile` in ollama/ollama
parser/parser.go (the state machine over runes, `unquote`, `isSpace`, `isNewline`, `strconv.IsPrint`).

A claim about Ollama, kept small: a value runs until a space or newline after which the trimmed buffer
unquotes; `unquote` strips one pair of outer `\"\"\"` or `"` and unescapes nothing; runes that are not printable
(other than the spaces and newlines that end or continue a value) are dropped.
"""

from __future__ import annotations


def _unquote(s: str) -> tuple[str, bool]:
    if s[:3] == '"""':
        return (s[3:-3], True) if len(s) >= 6 and s[-3:] == '"""' else ("", False)
    if s[:1] == '"':
        return (s[1:-1], True) if len(s) >= 2 and s[-1] == '"' else ("", False)
    return s, True


def _trim(s: str) -> str:
    return s.strip(" \t\r\n\v\f\x85\xa0")  # Go's strings.TrimSpace (unicode.IsSpace; enough for these tests)


def _next(r: str, state: str) -> tuple[str, str]:
    """parseRuneForState: the next state and the rune to keep ('' for Go's 0)."""
    space, newline = r in " \t", r in "\r\n"
    if state == "nil":
        return ("comment", "") if r == "#" else ("nil", "") if space or newline else ("name", r)
    if state == "name":
        if r.isascii() and r.isalpha():
            return "name", r
        assert space, f"ollama: command must be one of ... (at {r!r})"
        return "value", ""
    if state == "parameter":
        if (r.isascii() and r.isalnum()) or r == "_":
            return "parameter", r
        assert space, "ollama: unexpected EOF"
        return "value", ""
    if state == "value":
        return ("nil", r) if space or newline else ("value", r)
    return ("nil", "") if newline else ("comment", "")


def parse_values(text: str) -> list[tuple[str, str]]:
    """(command, value) of each command; a PARAMETER's name is its command, as in ollama's Command."""
    commands: list[tuple[str, str]] = []
    state, buf, name = "nil", "", ""
    for r in text:
        nxt, keep = _next(r, state)
        if nxt != state:
            if state == "name":
                name = "model" if buf.lower() == "from" else buf.lower()
                nxt = "parameter" if name == "parameter" else nxt
            elif state == "parameter":
                name = buf
            elif state == "value":
                value, ok = _unquote(_trim(buf))
                if not ok or r in " \t":
                    buf += r
                    continue
                commands.append((name, value))
            buf, state = "", nxt
        if keep and keep.isprintable():
            buf += keep
    if state == "value":
        value, ok = _unquote(_trim(buf))
        assert ok, "ollama: unexpected EOF"
        commands.append((name, value))
    return commands
