"""One config schema for every tool: dataclasses, loaded from YAML plus `key=value` overrides.

`load_config(path, overrides)` returns a validated `Config`; any unknown key or bad value raises
`ConfigError` with a one-line message before any work starts. A comparison's own schema
(`CompareConfig`, `load_compare_config`) names these configs, one for each of its stages.

Four parts, one idea each, and every name the rest of mpp imports is here: `mpp.config.schema`
holds the dataclasses and what reads straight off them (the dotted keys, plain data, the allowed
values); `mpp.config.loading` turns YAML files and overrides into a config; `mpp.config.checks`
says what a config may be (`validate`, and `check_tool` for the tool that runs it);
`mpp.config.saved` writes a run's config.yaml and tells what changed since.
"""
from mpp.config.checks import TOOL_DEFAULTS, TOOL_OBJECTIVES, UNREAD, UNREAD_WITH, check_tool, unread, validate
from mpp.config.loading import (DICT_SHAPES, OVERRIDDEN_BY_COMPARE, SET_BY_COMPARE, YamlLoader, as_list,
                                build_config, load_compare_config, load_config, load_yaml, override_keys,
                                parse_overrides, read_yaml, settings)
from mpp.config.saved import ENCODER_KEYS, SAID_MOST, changed_settings, said, same_setting, save_config
from mpp.config.schema import (MAX_BITS, MAX_TOKENS, RESULT_NEUTRAL, WHOLE, CompareConfig, Config, ConfigError,
                               DataConfig, FewshotConfig, FinetuneConfig, MPPConfig, OptimConfig, PrepareConfig,
                               ProbeConfig, SupervisedConfig, TrainConfig, choices, flatten, to_dict, valid_keys)

__all__ = ["DICT_SHAPES", "ENCODER_KEYS", "MAX_BITS", "MAX_TOKENS", "OVERRIDDEN_BY_COMPARE", "RESULT_NEUTRAL",
           "SAID_MOST", "SET_BY_COMPARE", "TOOL_DEFAULTS", "TOOL_OBJECTIVES", "UNREAD", "UNREAD_WITH", "WHOLE",
           "CompareConfig", "Config", "ConfigError", "DataConfig", "FewshotConfig", "FinetuneConfig", "MPPConfig",
           "OptimConfig", "PrepareConfig", "ProbeConfig", "SupervisedConfig", "TrainConfig", "YamlLoader", "as_list",
           "build_config", "changed_settings", "check_tool", "choices", "flatten", "load_compare_config",
           "load_config", "load_yaml", "override_keys", "parse_overrides", "read_yaml", "said", "same_setting",
           "save_config", "settings", "to_dict", "unread", "valid_keys", "validate"]
