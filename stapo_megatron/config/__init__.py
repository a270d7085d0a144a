"""Config loading: YAML + dotted overrides -> validated dataclasses."""

from stapo_megatron.config.core import (
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
