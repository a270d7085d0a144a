"""Config loading: YAML + dotted overrides -> validated dataclasses."""

from stapo_megatron.config.core import (
    MAX_BATCH,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_VOCAB,
    ConfigError,
    apply_overrides,
    build,
    describe,
    field_doc,
    load_config,
    option,
    read_yaml,
    to_dict,
)

__all__ = [
    "MAX_BATCH",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_TOKENS",
    "MAX_VOCAB",
    "ConfigError",
    "apply_overrides",
    "build",
    "describe",
    "field_doc",
    "load_config",
    "option",
    "read_yaml",
    "to_dict",
]
