"""Load a config: preset or YAML file, then --set overrides, validated into one `Config`."""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from kubetrain.config import clocks
from kubetrain.config.schema import Config
from kubetrain.errors import ConfigError
from kubetrain.files import special_kind

DEFAULT_PRESET = "tiny"
# eval.windows's old name: it counted micro-batches of train.micro_batch_size windows, so a config that says it is
# read as that many windows (old_eval_batches), and `best` compares the same eval set across the upgrade
OLD_EVAL_SIZE, EVAL_SIZE = "batches", "windows"


def preset_names() -> list[str]:
    """Names of the presets shipped inside the package."""
    folder = resources.files("kubetrain") / "presets"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def read_preset(name: str) -> dict[str, Any]:
    names = preset_names()
    if name not in names:
        raise ConfigError(f"unknown preset '{name}'{_suggest(name, names)}; presets: {', '.join(names)}")
    text = (resources.files("kubetrain") / "presets" / f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text) or {}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (YAML 1.2 forbids it; PyYAML keeps the last
    value silently, so a config could say one thing twice and mean the second)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges keys that a mapping may override
            key = self.construct_object(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first on line {first[key].start_mark.line + 1})",
                    key_node.start_mark)
            first[key] = key_node
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        hint = (f"; to continue the run in it, pass its config: {p / 'config.yaml'}" if (p / "config.yaml").is_file()
                else "")
        raise ConfigError(f"{p} is a directory, not a config file{hint}")
    if not p.is_file():
        if p.exists():  # /dev/null, a FIFO: not a config that can be read (and written into the run) as a file
            raise ConfigError(f"{p} is not a regular file (a {special_kind(p)}); name a YAML config file")
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(
    path: str | Path | None = None, preset: str | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Build the config from a file or a preset (the embedded default when neither), then apply --set."""
    if path is not None and preset is not None:
        raise ConfigError("give either a CONFIG file or --preset, not both")
    raw = read_yaml(path) if path is not None else read_preset(preset or DEFAULT_PRESET)
    for item in overrides:
        apply_override(raw, item)
    source = str(path) if path else f"preset '{preset or DEFAULT_PRESET}'"
    try:
        cfg = Config.model_validate(old_eval_batches(raw, source))
    except ValidationError as e:
        blamed = _set_that_made(e, overrides)
        problem = describe_error(e)
        if blamed is None:
            raise ConfigError(f"{source}: {problem}") from None
        loc = ".".join(_key_path(e.errors()[0]["loc"]))
        raise ConfigError(f"{blamed}: {problem.removeprefix(f'{loc}: ')}") from None
    try:  # here, where a user's settings come in (not in the model: a stored run's config stays readable)
        clocks.check(cfg)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    for i in range(len(cfg.phases)):
        phase_config(cfg, i)  # a bad phase is refused now, not after the phases before it have trained
    return cfg


def phase_config(cfg: Config, index: int) -> Config:
    """The config of phase `index`: its data/train/eval sections merged over the top-level ones."""
    ph = cfg.phases[index]
    raw = cfg.model_dump(mode="json")
    raw["phases"] = []
    for name, patch in (("data", ph.data), ("train", ph.train), ("eval", ph.eval)):
        if patch:
            if name == "eval" and OLD_EVAL_SIZE in patch:  # the phase sizes its own eval set, under the old name
                raw[name].pop(EVAL_SIZE, None)
            raw[name] = _deep_merge(raw.get(name) or {}, patch)
    return validate(raw, source=f"phase '{ph.name}'")


def validate(raw: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(old_eval_batches(raw, source))
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_error(e)}") from None


def _set_that_made(e: ValidationError, overrides: list[str] | tuple[str, ...]) -> str | None:
    """`--set KEY` when the first problem is at a key the command line set (or in the section a rule over it
    judges), so the user is sent to the argument they typed, not to a file or preset that never said it."""
    loc = _key_path(e.errors()[0]["loc"])
    for item in reversed(overrides):
        key = item.split("=", 1)[0].strip()
        parts = [p for p in key.split(".") if p]
        if loc and parts[: len(loc)] == loc:
            return f"--set {'.'.join(parts)}"  # the key only: a value may hold a secret
    return None


_warned: set[str] = set()


def _says_config_warnings(environ: Mapping[str, str]) -> bool:
    """One line per job: a worker other than rank 0 stays quiet, and so does rank 0 under kubetrain's launcher
    (KUBETRAIN_LAUNCHER_PID, train/heartbeat.py), which read the same config and said it already."""
    rank = environ.get("RANK")
    return rank is None or (rank == "0" and not environ.get("KUBETRAIN_LAUNCHER_PID"))


def old_eval_batches(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """`eval.batches: N` read as what it meant: eval.windows N x train.micro_batch_size, said once per process.

    Refused (one line) where that number is unknown: with micro_batch_size auto, or with eval.windows given too."""
    section = raw.get("eval")
    if not isinstance(section, dict) or OLD_EVAL_SIZE not in section:
        return raw
    if EVAL_SIZE in section:
        raise ConfigError(f"{source}: eval.batches and eval.windows are both given; eval.windows replaces "
                          "eval.batches (which counted micro-batches): keep eval.windows only")
    batches = section[OLD_EVAL_SIZE]
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    micro = (train or {}).get("micro_batch_size", Config().train.micro_batch_size)
    if isinstance(micro, str) and micro.strip().isdigit():  # --set keeps text where the field also takes `auto`
        micro = int(micro)
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ConfigError(f"{source}: eval.batches is now eval.windows (windows per evaluation); "
                          f"write eval.windows instead (got eval.batches: {batches!r})")
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise ConfigError(f"{source}: eval.batches counted micro-batches of train.micro_batch_size, which is "
                          f"{micro!r} here, so the windows it evaluated are not known: write eval.windows (windows "
                          "per evaluation) instead")
    windows = batches * micro
    message = (f"warning: {source}: eval.batches is now eval.windows and counts windows, not micro-batches: "
               f"eval.batches: {batches} x train.micro_batch_size {micro} is read as eval.windows: {windows}, "
               "the windows it evaluated before")
    if message not in _warned and _says_config_warnings(os.environ):
        _warned.add(message)
        print(message, file=sys.stderr, flush=True)
    eval_section = {k: v for k, v in section.items() if k != OLD_EVAL_SIZE}
    eval_section[EVAL_SIZE] = windows
    return {**raw, "eval": eval_section}


def describe_error(e: ValidationError) -> str:
    """The first validation problem as one line, in the config's words: its key (never a union member's inner
    name such as `constrained-int`, nor a section's class name), what it takes, and what it got."""
    err = e.errors()[0]
    parts = _key_path(err["loc"])
    loc = ".".join(parts)
    if err["type"] == "extra_forbidden":
        parent, key = err["loc"][:-1], str(err["loc"][-1])
        fields = _fields_at(Config, parent)
        return f"unknown key '{'.'.join([*_key_path(parent), key])}'{_suggest(key, fields)}"
    msg = err["msg"]
    if err["type"] in ("value_error", "assertion_error"):
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        return f"{loc}: {msg}" if loc else msg
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    same_key = [x for x in e.errors() if _key_path(x["loc"]) == parts]
    if len(same_key) > 1 or err["type"] in ("model_type", "dict_type", "model_attributes_type"):
        # a union's members each reject the value, or a section was given a scalar: say what the key takes
        return f"{loc}: takes {_what_it_takes(loc)}{shown}"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"{loc}: {msg}{shown}{more}"


def _key_path(loc: tuple[Any, ...]) -> list[str]:
    """The config key of an error's location: pydantic adds a union member's tag (`constrained-int`,
    `literal['auto']`) between a field and its value; those are no key a user can type."""
    out: list[str] = []
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            out.append(str(part))
            continue
        field = model.model_fields.get(str(part)) if _is_model(model) else None
        if field is None:
            if model is None:
                out.append(str(part))  # inside a free-form mapping (labels, env): the user's own key
            continue
        out.append(str(part))
        model = _model_in(field.annotation)
        if model is None and get_origin(field.annotation) is not dict and not _maps_in(field.annotation):
            model = False  # a leaf: anything after it is pydantic's, not a key
    return out


def _maps_in(annotation: Any) -> bool:
    return any(get_origin(a) is dict for a in get_args(annotation))


def _what_it_takes(key: str) -> str:
    from kubetrain.config.explain import explain  # the schema's own words, as `config explain` prints them

    doc = explain(key)[0]
    if "section" in doc.type.split(" | "):
        optional = " or null" if "null" in doc.type.split(" | ") else ""
        return f"a section of keys{optional} (kubetrain config explain {doc.key})"
    return doc.type + (f" ({doc.constraints})" if doc.constraints else "")


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = current.model_fields.get(str(part)) if _is_model(current) else None
        if field is None:
            return []
        current = _model_in(field.annotation)
    return list(current.model_fields) if _is_model(current) else []


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _model_in(annotation: Any) -> Any:
    """The BaseModel inside `X`, `X | None` or `list[X]`, if any."""
    if _is_model(annotation):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `a.b.c=VALUE` to the raw mapping; VALUE is parsed as YAML, then typed by the model."""
    if "=" not in item:
        raise ConfigError(f"--set needs KEY=VALUE, got '{item}'")
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 reach Python as lone surrogates
        raise ConfigError(f"--set {item.split('=', 1)[0]}: the value is not UTF-8 text") from None
    key, text = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set needs KEY=VALUE, got '{item}'")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    if parts[0] == "eval" and parts[1:] in ([OLD_EVAL_SIZE], [EVAL_SIZE]):
        # a size given here replaces the file's under either name; the old one is read by old_eval_batches
        section = raw.get("eval") if isinstance(raw.get("eval"), dict) else None
        if section is not None:
            section.pop(EVAL_SIZE if parts[1] == OLD_EVAL_SIZE else OLD_EVAL_SIZE, None)
        if parts[1] == OLD_EVAL_SIZE:
            raw["eval"] = {**(section or {}), OLD_EVAL_SIZE: value}
            return
    node: Any = raw
    model: Any = Config
    annotation: Any = None  # the type of the key being set, when the schema knows it
    defaults: Any = Config().model_dump(mode="json")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {key}: '{part}' is not an index of a list of {len(node)}")
            child_key: Any = int(part)
            annotation = None
            defaults = None
        else:
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: '{'.'.join(parts[:i])}' is not a section")
            annotation = None
            if model is not None:
                fields = list(model.model_fields)
                if part not in fields:
                    where = ".".join(parts[: i + 1])
                    raise ConfigError(f"--set: unknown key '{where}'{_suggest(part, fields)}")
                annotation = model.model_fields[part].annotation
                model = _model_in(annotation)
            child_key = part
            defaults = defaults.get(part) if isinstance(defaults, dict) else None
        if last:
            node[child_key] = text if _keeps_text(annotation, value) else value
        else:
            if isinstance(node, dict) and node.get(child_key) is None:
                node[child_key] = copy.deepcopy(defaults) if defaults is not None else {}
            node = node[child_key]


def _keeps_text(annotation: Any, value: Any) -> bool:
    """True when YAML read a number or boolean where the field wants a string (`run.name=123`, `=yes`)."""
    if annotation is None or isinstance(value, str) or not isinstance(value, bool | int | float):
        return False
    return _accepts_str(annotation)


def _accepts_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType):
        return any(_accepts_str(a) for a in get_args(annotation))
    return False


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys, the form --set takes: {"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}.

    Lists of mappings (data.sources, phases) go by index ("data.sources.0.path"); lists of plain values stay
    whole ("train.betas": [0.9, 0.95]), and so do empty ones.
    """
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value and any(isinstance(v, dict | list) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return {prefix: value} if prefix else {}


def config_hash(cfg: Config) -> str:
    """A short digest of the resolved config (which checkpoints record)."""
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
