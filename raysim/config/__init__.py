"""Typed run configuration, one job per module:

- `schema`: the core dataclasses and their defaults;
- `sections`: the plugin sections (each chosen part's typed options) added to the schema;
- `files`: the shipped configs and bounded YAML reading;
- `layers`: default.yaml < config groups < --config files < overrides, merged and resolved;
- `validate`: the checks that need no data;
- `record`: what a checkpoint records of its config, for resume.

Every problem is a `ConfigError` (raysim.errors) whose message is one line naming the key or
file and what is allowed. The names below are the package's public face.
"""
from raysim.config.files import CONFIG_DIR, DEFAULT_YAML, find_config, load_yaml, read_text_file, read_yaml
from raysim.config.layers import (
    GROUPS, OVERRIDES, Layers, describe_layers, load_config, parse_overrides, plugin_names, read_layers, resolve,
)
from raysim.config.record import check_resumable, describe_diff, record_diff, run_record
from raysim.config.schema import AUGMENTATIONS, Config, augmentation_name, clients_per_round, to_yaml
from raysim.config.sections import plugin_sections, schema, section_of, used_sections
from raysim.config.validate import sum_block, validate
from raysim.errors import ConfigError

__all__ = [
    "AUGMENTATIONS", "CONFIG_DIR", "Config", "ConfigError", "DEFAULT_YAML", "GROUPS", "Layers", "OVERRIDES",
    "augmentation_name", "check_resumable", "clients_per_round", "describe_diff", "describe_layers", "find_config",
    "load_config", "load_yaml", "parse_overrides", "plugin_names", "plugin_sections", "read_layers", "read_text_file",
    "read_yaml", "record_diff", "resolve", "run_record", "schema", "section_of", "sum_block", "to_yaml", "used_sections",
    "validate",
]
