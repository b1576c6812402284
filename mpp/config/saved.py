"""A run's config.yaml: writing it (`save_config`) and reading back what changed since (`changed_settings`,
`said` for a one-line message), where two spellings of one path are one setting (`same_setting`). What
lets a resumed run or a comparison's finished stage tell a changed recipe from a moved folder.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from mpp.config.loading import build_config, read_yaml
from mpp.config.schema import RESULT_NEUTRAL, Config, ConfigError, flatten, to_dict
from mpp.specs import DATA_KEYS, data_key


def save_config(cfg: Config, path: str | Path) -> None:
    from mpp.fileio import write_atomic
    write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def changed_settings(path: str | Path, now: Config) -> list[str] | None:
    """The settings of `now` that differ from those a run wrote to its config.yaml at `path`, as
    'key: then -> now', or None where no config.yaml this mpp can read is there. The file is read
    through the schema (a key added since takes its default, as it did then); output_dir (the run's
    folder, however spelled, moved or copied) and the keys of speed and logging alone
    (RESULT_NEUTRAL) may differ, and two spellings of one path are the same setting."""
    try:
        data = read_yaml(Path(path).read_text()) or {}
        saved = flatten(to_dict(build_config(data))) if isinstance(data, dict) else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError):
        saved = None
    if saved is None:
        return None
    current = flatten(to_dict(now))
    return [f"{k}: {saved.get(k, '(unset)')} -> {current.get(k, '(unset)')}" for k in sorted(set(saved) | set(current))
            if k != "output_dir" and k not in RESULT_NEUTRAL
            and not same_setting(k, saved.get(k), current.get(k))]


SAID_MOST = 4  # the changed settings a one-line message names


def said(changed: list[str]) -> str:
    """The first SAID_MOST of `changed_settings`' lines, for a one-line message."""
    return "; ".join(changed[:SAID_MOST]) + ("; ..." if len(changed) > SAID_MOST else "")


ENCODER_KEYS = ("finetune.init", "probe.encoder")  # a run folder or its encoder.safetensors


def same_setting(key: str, a, b) -> bool:
    """Whether `a` and `b` are one setting of config key `key`: equal, or two spellings of one
    existing path (relative and absolute); of a shard spec (DATA_KEYS), also a shard folder and its
    manifest.json (mpp.specs.data_key); of an encoder (ENCODER_KEYS), a run folder and its
    encoder.safetensors."""
    if a == b or (key in DATA_KEYS and data_key(a) == data_key(b)):
        return True
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    if key in ENCODER_KEYS:
        a, b = (os.path.join(p, "encoder.safetensors") if os.path.isdir(p) else p for p in (a, b))
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
