"""Config loading: presets, YAML files, --set overrides typed by the schema, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kubetrain.config import (
    Config,
    apply_override,
    config_hash,
    load_config,
    phase_config,
    preset_names,
    to_yaml,
)
from kubetrain.config.loading import DEFAULT_PRESET, _says_config_warnings, flatten, read_preset, validate
from kubetrain.errors import ConfigError, UserInputError


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m"])
def test_every_shipped_preset_loads_and_validates(name: str) -> None:
    assert name in preset_names()
    cfg = load_config(preset=name)
    assert cfg.run.name == name
    # What the preset file says is what the config holds (nothing silently dropped).
    assert_subset(read_preset(name), cfg.model_dump(mode="json"))


def assert_subset(part: object, whole: object, where: str = "") -> None:
    if isinstance(part, dict):
        assert isinstance(whole, dict), where
        for key, value in part.items():
            assert_subset(value, whole[key], f"{where}.{key}")
    elif isinstance(part, list):
        assert isinstance(whole, list) and len(part) == len(whole), where
        for i, (a, b) in enumerate(zip(part, whole, strict=True)):
            assert_subset(a, b, f"{where}.{i}")
    else:
        assert part == whole, where


def test_presets_listed_are_exactly_the_shipped_files() -> None:
    assert set(preset_names()) >= {"tiny", "gpt2-124m"}
    for name in preset_names():
        load_config(preset=name)


def test_default_is_the_tiny_preset() -> None:
    assert DEFAULT_PRESET == "tiny"
    assert load_config() == load_config(preset="tiny")


def test_gpt2_preset_has_the_gpt2_small_shape() -> None:
    m = load_config(preset="gpt2-124m").model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size) == (12, 12, 768, 1024)


def test_required_key_names_exist() -> None:
    cfg = load_config()
    keys = ["run.seed", "run.output_dir", "train.max_steps", "train.micro_batch_size",
            "train.grad_accum_steps", "train.lr", "eval.every_steps", "checkpoint.every_steps",
            "data.sources", "model.n_layer"]
    for key in keys:
        section, field = key.split(".")
        assert hasattr(getattr(cfg, section), field), key


def test_yaml_file_fills_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "train:\n  max_steps: 7\n"))
    assert cfg.train.max_steps == 7
    assert cfg.train.lr == Config().train.lr
    assert cfg.model == Config().model


def test_empty_yaml_file_is_all_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()


def test_float_in_yaml_without_a_dot(tmp_path: Path) -> None:
    # YAML 1.1 reads 3e-4 as a string; the schema still types it as a float.
    assert load_config(write(tmp_path, "train:\n  lr: 3e-4\n")).train.lr == pytest.approx(3e-4)


def test_file_and_preset_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        load_config(write(tmp_path, ""), preset="tiny")


def test_unknown_preset_suggests_a_name() -> None:
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        load_config(preset="tinny")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("trian:\n  lr: 1\n", "unknown key 'trian'; did you mean 'train'?"),
        ("train:\n  lerning_rate: 1\n", "unknown key 'train.lerning_rate'"),
        ("train:\n  max_step: 1\n", "unknown key 'train.max_step'; did you mean 'max_steps'?"),
        ("data:\n  tokenizer:\n    vocab_sise: 300\n",
         "unknown key 'data.tokenizer.vocab_sise'; did you mean 'vocab_size'?"),
        ("data:\n  sources:\n    - kind: text\n      pth: a.txt\n",
         "unknown key 'data.sources.0.pth'; did you mean 'path'?"),
        ("model:\n  lora:\n    rr: 4\n", "unknown key 'model.lora.rr'"),
        ("k8s:\n  namespac: x\n", "unknown key 'k8s.namespac'; did you mean 'namespace'?"),
    ],
)
def test_unknown_keys_at_any_depth_say_did_you_mean(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_with_nothing_close_has_no_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "train:\n  zzzzzz: 1\n"))
    assert "unknown key 'train.zzzzzz'" in str(e.value)
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  max_steps: many\n", "train.max_steps: Input should be a valid integer"),
        ("train:\n  lr: fast\n", "train.lr: Input should be a valid number"),
        ("train:\n  max_steps: 0\n", "train.max_steps: Input should be greater than or equal to 1"),
        ("run:\n  device: gpu\n", "run.device: Input should be"),
        ("model: 5\n", "model: takes a section of keys (kubetrain config explain model) (got 5)"),
        ("model:\n  n_embd: 100\n  n_head: 3\n", "must be divisible by model.n_head"),
        ("data:\n  sources:\n    - kind: text\n",
         "data.sources.0: a data source of kind 'text' needs a path"),
        ("train:\n  compile: maybe\n", "train.compile: Input should be 'auto', True or False"),
        ("eval:\n  sample_prompt: ''\n", "eval.sample_prompt: String should have at least 1 character"),
    ],
)
def test_wrong_types_and_values_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert message in str(e.value)
    assert str(tmp_path / "c.yaml") in str(e.value)  # the message names the file
    assert "\n" not in str(e.value)
    assert "pydantic" not in str(e.value)  # no link to pydantic's docs


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not valid YAML \(line 3, column 7\): mapping values are not"):
        load_config(write(tmp_path, "train:\n  lr: 1\n  a: b: c\n"))


def test_yaml_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_missing_and_non_utf8_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"run:\n  name: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_config_errors_are_user_input_errors() -> None:
    assert issubclass(ConfigError, UserInputError)
    assert ConfigError.exit_code == 2


# --set overrides


def over(*items: str) -> Config:
    return load_config(preset="tiny", overrides=list(items))


def test_set_parses_to_the_field_type() -> None:
    cfg = over("train.max_steps=12", "train.lr=3e-4", "train.compile=true", "eval.sample_prompt=Hello world",
               "model.dropout=0.1", "run.threads=1", "train.min_lr=1e-5")
    assert cfg.train.max_steps == 12 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.compile is True
    assert cfg.eval.sample_prompt == "Hello world"
    assert cfg.model.dropout == pytest.approx(0.1)
    assert cfg.run.threads == 1
    assert cfg.train.min_lr == pytest.approx(1e-5)


@pytest.mark.parametrize("text", ["false", "False", "no", "off", "0"])
def test_set_false_booleans(text: str) -> None:
    assert over(f"train.compile={text}").train.compile is False


@pytest.mark.parametrize("value", ["123", "1e3", "true", "yes", "null-ish", "3.5"])
def test_set_string_fields_keep_the_text(value: str) -> None:
    # A string field gets the text as typed, even when YAML would read a number or a boolean.
    assert over(f"run.name={value}").run.name == value
    assert over(f"eval.sample_prompt={value}").eval.sample_prompt == value


def test_set_null_clears_an_optional_field() -> None:
    assert over("eval.sample_prompt=null").eval.sample_prompt is None
    assert over("run.threads=null").run.threads is None


def test_set_value_may_contain_equals_signs() -> None:
    assert over("eval.sample_prompt=a=b").eval.sample_prompt == "a=b"


def test_set_lists_and_nested_mappings() -> None:
    cfg = over("model.lora={r: 4, alpha: 8}", "model.lora.target_modules=[q_proj, k_proj, v_proj]")
    assert cfg.model.lora is not None
    assert (cfg.model.lora.r, cfg.model.lora.alpha) == (4, 8)
    assert cfg.model.lora.target_modules == ["q_proj", "k_proj", "v_proj"]
    cfg = over("data.sources=[{kind: text, path: a.txt}, {kind: jsonl, path: b.jsonl, weight: 2}]")
    got = [(s.kind, s.path, s.weight) for s in cfg.data.sources]
    assert got == [("text", "a.txt", 1.0), ("jsonl", "b.jsonl", 2.0)]


def test_set_a_section_that_the_preset_does_not_mention() -> None:
    cfg = over("model.lora.r=4", "dist.strategy=fsdp", "k8s.nnodes=2")
    assert cfg.model.lora is not None and cfg.model.lora.r == 4
    assert cfg.dist.strategy == "fsdp"
    assert cfg.k8s.nnodes == 2


def test_set_list_index() -> None:
    cfg = over("data.sources.0.kind=text", "data.sources.0.path=corpus/*.txt")
    assert cfg.data.sources[0].kind == "text"
    assert cfg.data.sources[0].path == "corpus/*.txt"


def test_set_list_index_on_a_file_without_the_section(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "train:\n  lr: 0.01\n"), overrides=["data.sources.0.kind=text",
                                                                         "data.sources.0.path=x.txt"])
    assert (cfg.data.sources[0].kind, cfg.data.sources[0].path) == ("text", "x.txt")
    assert cfg.train.lr == 0.01


def test_set_is_applied_in_order() -> None:
    assert over("train.max_steps=3", "train.max_steps=4").train.max_steps == 4


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("train.lrr=1", "--set: unknown key 'train.lrr'; did you mean 'lr'?"),
        ("trainn.lr=1", "--set: unknown key 'trainn'; did you mean 'train'?"),
        ("data.sources.0.pth=x", "--set: unknown key 'data.sources.0.pth'; did you mean 'path'?"),
        ("data.sources.3.path=x", "'3' is not an index of a list of 1"),
        ("data.sources.first.path=x", "'first' is not an index"),
        ("train.lr.x=1", "'train.lr' is not a section"),
        ("train.lr", "--set needs KEY=VALUE"),
        ("=3", "--set needs KEY=VALUE"),
        ("...=3", "--set needs KEY=VALUE"),
    ],
)
def test_bad_set_is_one_clear_line(item: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        over(item)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("train.max_steps=lots", "train.max_steps: Input should be a valid integer"),
        ("train.lr=", "train.lr: Input should be a valid number"),
        ("train.lr=[1, 2", "train.lr: Input should be a valid number"),
        ("run.device=tpu", "run.device: Input should be"),
        ("model.n_head=3", "must be divisible"),
    ],
)
def test_set_with_a_wrong_type_names_the_key(item: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        over(item)
    assert message.removeprefix(item.split("=")[0] + ": ") in str(e.value)
    # the argument the user typed is blamed, not a preset that never said it
    assert str(e.value).startswith(f"--set {item.split('=')[0]}: "), e.value
    assert "preset 'tiny'" not in str(e.value)


def test_a_bad_value_in_the_file_is_still_blamed_on_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: abc\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides=["train.lr=1e-3"])
    assert str(e.value).startswith(f"{path}: train.max_steps: "), e.value


@pytest.mark.parametrize("item", ["train.max_steps=true", "train.lr=false", "model.dropout=yes", "run.threads=on"])
def test_a_boolean_is_not_a_number(item: str, tmp_path: Path) -> None:
    """YAML reads `true` as a boolean; pydantic's lax mode would make it 1 (one training step)."""
    with pytest.raises(ConfigError, match=r"a number, not (true|false)"):
        over(item)
    path = tmp_path / "c.yaml"
    section, key = item.split("=")[0].split(".")
    path.write_text(f"{section}:\n  {key}: true\n")
    with pytest.raises(ConfigError, match=f"{section}.{key}: a number, not true"):
        load_config(path)


def test_apply_override_on_a_raw_mapping() -> None:
    raw: dict[str, object] = {}
    apply_override(raw, "train.lr=0.5")
    apply_override(raw, "run.name=abc")
    assert raw["train"]["lr"] == 0.5  # type: ignore[index]
    assert raw["run"]["name"] == "abc"  # type: ignore[index]


# Resolved config, hashing, phase merges


def test_to_yaml_round_trips() -> None:
    cfg = over("train.lr=3e-4", "model.lora.r=2")
    assert Config.model_validate(yaml.safe_load(to_yaml(cfg))) == cfg


def test_config_hash_follows_content() -> None:
    a, b = over("train.lr=0.1"), over("train.lr=0.2")
    assert config_hash(a) == config_hash(over("train.lr=0.1"))
    assert config_hash(a) != config_hash(b)
    assert len(config_hash(a)) == 16


def test_phase_config_deep_merges_and_validates(tmp_path: Path) -> None:
    path = write(tmp_path, "train: {lr: 0.1}\nphases:\n  - {name: a, train: {max_steps: 5}}\n"
                 "  - {name: b, data: {val_fraction: 0.2}}\n")
    cfg = load_config(path)
    first, second = phase_config(cfg, 0), phase_config(cfg, 1)
    assert (first.train.max_steps, first.train.lr, first.phases) == (5, 0.1, [])
    assert second.data.val_fraction == 0.2 and second.train.max_steps == cfg.train.max_steps
    bad = write(tmp_path, "phases:\n  - {name: a, train: {max_step: 5}}\n", "bad.yaml")
    with pytest.raises(ConfigError, match=r"phase 'a'.*did you mean 'max_steps'"):
        load_config(bad)


def test_flatten() -> None:
    nested = {"train": {"lr": 0.1, "betas": [0.9, 0.95]}, "phases": [], "model": {"lora": None},
              "data": {"sources": [{"kind": "text", "path": "a"}]}}
    assert flatten(nested) == {"train.lr": 0.1, "train.betas": [0.9, 0.95], "data.sources.0.kind": "text",
                               "data.sources.0.path": "a", "phases": [], "model.lora": None}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("train.micro_batch_size=abc", "--set train.micro_batch_size: takes int | auto (got 'abc')"),
        ("dist.preflight=5", "--set dist.preflight: takes a section of keys (kubetrain config explain dist.preflight)"),
        ("track.wandb=3", "--set track.wandb: takes a section of keys (kubetrain config explain track.wandb)"),
        ("model.lora=3", "--set model.lora: takes a section of keys or null (kubetrain config explain model.lora)"),
    ],
)
def test_a_refusal_speaks_the_configs_words_not_the_librarys(item: str, message: str) -> None:
    """The key a user can type and what it takes; never pydantic's union tags or the schema's class names."""
    with pytest.raises(ConfigError) as e:
        over(item)
    assert str(e.value).startswith(message), e.value
    for internal in ("constrained-int", "literal[", "Config", "instance of"):
        assert internal not in str(e.value)


# eval.batches, the old name of eval.windows, counted micro-batches of train.micro_batch_size windows: an old config
# must evaluate the windows it evaluated before (or `best` would compare two different eval sets), and say so once.
OLD_EVAL = "train:\n  micro_batch_size: 4\neval:\n  batches: 8\n"


def test_old_eval_batches_evaluates_the_windows_it_did_with_one_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(OLD_EVAL)
    cfg = load_config(path)
    assert cfg.eval.windows == 8 * 4
    assert load_config(path).eval.windows == 32  # read again (each phase, the run's config): no second line
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: ")
    assert "eval.batches" in warnings[0] and "eval.windows: 32" in warnings[0] and "micro-batches" in warnings[0]
    assert "batches" not in cfg.model_dump(mode="json")["eval"]  # the run's config.yaml says windows from now on


@pytest.mark.parametrize(("environ", "says"), [
    ({}, True),  # one process, or the launcher of `--nproc N`
    ({"RANK": "0"}, True),  # rank 0 of a bare torchrun: no launcher of ours said it
    ({"RANK": "0", "KUBETRAIN_LAUNCHER_PID": "7"}, False),  # our launcher read the same config and said it
    ({"RANK": "3"}, False),
])
def test_a_job_says_the_old_eval_batches_once_not_once_per_rank(environ: dict[str, str], says: bool) -> None:
    assert _says_config_warnings(environ) is says


def test_old_eval_batches_on_the_command_line_and_in_a_phase(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, None, ["eval.batches=3", "train.micro_batch_size=2"])  # over the preset's eval.windows
    assert cfg.eval.windows == 6
    raw = {"train": {"micro_batch_size": 4}, "eval": {"windows": 40},
           "phases": [{"name": "chat", "train": {"micro_batch_size": 2}, "eval": {"batches": 5}}]}
    assert phase_config(validate(raw), 0).eval.windows == 10
    assert len(capsys.readouterr().err.splitlines()) == 2  # one line for each translation
    assert load_config(None, None, ["eval.windows=7"]).eval.windows == 7


@pytest.mark.parametrize(("text", "message"), [
    ("train:\n  micro_batch_size: auto\n  global_batch_size: 16\neval:\n  batches: 8\n",
     "train.micro_batch_size, which is 'auto' here"),
    ("eval:\n  batches: 8\n  windows: 32\n", "eval.batches and eval.windows are both given"),
])
def test_old_eval_batches_that_cannot_be_read_as_before_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(path)
    assert "\n" not in str(refused.value) and "eval.windows" in str(refused.value)
