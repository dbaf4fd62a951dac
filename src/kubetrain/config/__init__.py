"""The config: pydantic models of every section, YAML loading, --set overrides, presets."""

from kubetrain.config.loading import (
    DEFAULT_PRESET,
    apply_override,
    config_hash,
    flatten,
    load_config,
    phase_config,
    preset_names,
    to_yaml,
    validate,
)
from kubetrain.config.schema import (
    Config,
    DataConfig,
    ModelConfig,
    PhaseConfig,
    SourceConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "DEFAULT_PRESET",
    "Config",
    "DataConfig",
    "ModelConfig",
    "PhaseConfig",
    "SourceConfig",
    "TokenizerConfig",
    "TrainConfig",
    "apply_override",
    "config_hash",
    "flatten",
    "load_config",
    "phase_config",
    "preset_names",
    "to_yaml",
    "validate",
]
