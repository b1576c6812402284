"""From text to a config: the YAML dialect every config and run's config.yaml is read with
(`YamlLoader`, `read_yaml`), `key=value` overrides (`parse_overrides`), files with their `base:`
(`load_yaml`), each value coerced to its field's type (`_coerce`) and set on the schema (`_apply`); then
`load_config` / `build_config` (validated: `mpp.config.checks`), `settings` (a saved run's, unvalidated)
and `load_compare_config` (a comparison's own config, with its checks).
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml

from mpp.config.checks import UNREAD, validate
from mpp.config.schema import RESULT_NEUTRAL, WHOLE, CompareConfig, Config, ConfigError, flatten, to_dict, valid_keys


class YamlLoader(yaml.SafeLoader):
    """YAML with YAML 1.2's core schema for plain scalars: true and false are the only booleans and
    numbers are written in decimal, so that no, off, 010, 12:30, 1_000 or 2026-12-04 stay the text
    written, where YAML 1.1 reads false, false, 8, 750, 1000 and a date (an output_dir=010 went to
    '8'), and 1e-3 is a number. An integer is read as one only where its text is the number's own
    (0x10, 0o10 and +7 stay text, which an integer key reads as a number), so a text key never
    gets another spelling than the one written. Configs, overrides and the config.yaml of
    every run are read with it. An alias (*name) may stand for a scalar, not for a list or mapping:
    nested ones grow tenfold a level (a file of a few hundred bytes becomes a report of hundreds of
    megabytes), and a config needs none. A key given twice in one mapping is refused: the second
    replaced the first without a word (a second `optim:` section dropped the first's settings)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":  # `<<:` merges, later
                value = self.construct_object(key)  # the key's value: 0.1 and 0.10, 1 and 1.0 are one key
                if value in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"'{key.value}' is given twice in one mapping; "
                                                            "give each key once", key.start_mark)
                seen.add(value)
        return super().construct_mapping(node, deep)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if not isinstance(self.anchors.get(event.anchor), (yaml.ScalarNode, type(None))):
                raise yaml.composer.ComposerError(None, None, f"*{event.anchor} stands for a list or mapping; write "
                                                  "it out (aliases may stand for single values only)",
                                                  event.start_mark)
        return super().compose_node(parent, index)


_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float", "timestamp")}  # no timestamps in YAML 1.2
YamlLoader.yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers if tag not in _TAGS]
                                      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in (
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("int", r"^(?:0|-?[1-9][0-9]*)$", "-0123456789"),
        ("float", r"^[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?$|^[-+]?[0-9]+[eE][-+]?[0-9]+$"
                  r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$", "-+0123456789.")):
    YamlLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_rx), list(_first))


def read_yaml(text) -> Any:
    """`text` (a string or an open file) parsed with `YamlLoader`; nesting deeper than Python's
    recursion allows (PyYAML's RecursionError, no YAMLError) is a yaml.YAMLError too."""
    try:
        return yaml.load(text, Loader=YamlLoader)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply (hundreds of levels of lists or mappings)") from None


def _as_number(value: Any) -> Any:
    """`value` as a float when it is a string that reads as one (e.g. a leading zero: 010)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _whole(seed: Any) -> Any:
    """A split seed that is a whole number as an int (the development split's RNG is seeded with its
    text, so 0.0 and 0 would draw different splits); anything else as it is, for `validate`."""
    return int(seed) if isinstance(seed, float) and seed.is_integer() else seed


# what each mapping key of the compare config holds, for the error that names its shape
DICT_SHAPES = {"sweep": "a mapping of config keys to non-empty lists of values, e.g. {optim.lr: [0.01, 0.03]}",
               "fraction_overrides": "a mapping of label fractions to non-empty lists of key=value overrides, "
                                     "e.g. {1.0: [steps=2400]}",
               "fraction_sweep": "a mapping of label fractions to grids of the sweep's keys, e.g. {1.0: {optim.lr: "
                                 "[0.0003, 0.001, 0.002]}}"}


def _coerce(key: str, value: Any, kind: str) -> Any:
    """Convert a YAML value to the field's declared type `kind`, or raise ConfigError."""
    if kind in ("int", "float"):
        value = _as_number(value)
    if kind == "tuple" and key == "data.withhold" and isinstance(value, (list, tuple)):
        if all(isinstance(v, (list, tuple)) and len(v) == 3 for v in value):
            value = [[_as_number(x) for x in v] for v in value]
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) for v in value for x in v):
                return tuple((f, _whole(s), d) for f, s, d in value)
        raise ConfigError(f"config key '{key}' must be a list of [label_fraction, split_seed, dev_fraction] "
                          f"triples, e.g. [[0.1, 0, 0.1]], got {value!r}")
    if kind == "tuple" and isinstance(value, (list, tuple)):
        value = [_as_number(v) for v in value]
        if key == "probe.dev_split" and value:
            value[0] = _whole(value[0])
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "str" and isinstance(value, bool):
        if key == "train.precision" and not value:  # train.precision=false: off, as train.precision=no
            return "no"
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}; to mean the word, quote it: "
                          f"{key.rsplit('.', 1)[-1]}: '{str(value).lower()}'")
    # its text is gone: 1.10, 1e3 and .5 read 1.1, 1000.0, 0.5, and a: b or - a a mapping or a list (in a
    # file: an override keeps the text of a text key, `parse_overrides`)
    if kind == "str" and isinstance(value, (float, dict, list)):
        got = f"the number {value!r}" if isinstance(value, float) else repr(value)
        raise ConfigError(f"config key '{key}' must be a string, got {got}; to mean the text, "
                          f"quote it: {key.rsplit('.', 1)[-1]}: 'TEXT' (on the command line \"{key}='TEXT'\")")
    if not isinstance(value, bool):
        if kind == "int" and isinstance(value, (int, float)) and float(value).is_integer():
            return int(value)
        if kind == "float" and isinstance(value, (int, float)):
            return float(value)
        if kind == "str" and isinstance(value, (str, int, float)):
            return str(value)
        if kind == "tuple" and isinstance(value, (list, tuple)) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return tuple(value)
        if kind == "dict" and key == "fraction_sweep" and isinstance(value, dict):  # a grid per label fraction,
            with contextlib.suppress(ConfigError):  # each read as `sweep` is (else named below as a fraction_sweep)
                return {k: _coerce("sweep", v, kind) for k, v in value.items()}
        elif kind == "dict" and isinstance(value, dict):
            flat = flatten(value)
            if all(isinstance(v, list) and v and all(isinstance(x, (str, int, float, bool, list)) for x in v)
                   for v in flat.values()):
                return flat
        if kind == "Any" and (isinstance(value, str) or (
                isinstance(value, list) and all(isinstance(v, str) for v in value))):
            return value
    wanted = DICT_SHAPES[key] if kind == "dict" else {
        "bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string",
        "tuple": "a list of numbers", "Any": "a string or a list of strings"}[kind]
    raise ConfigError(f"config key '{key}' must be {wanted}, got {value!r}")


def _suggest(key: str, valid: list[str]) -> str:
    """'did you mean X?' for a near miss (`resume` -> `train.resume`), else the valid keys."""
    near = [k for k in valid if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]] or \
        difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
    return f"did you mean '{near[0]}'?" if near else f"valid keys: {', '.join(valid)}"


def _apply(obj: Any, data: dict, prefix: str = "", root: type = Config) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in fields:
            if "." in str(k) and key in valid_keys(root):  # 'optim.lr: 0.1' in a YAML file
                head, rest = str(k).split(".", 1)
                raise ConfigError(f"config key '{key}' is written with a dot in a file; nest it there "
                                  f"({head}: {{{rest}: ...}}), or give it as an override {key}=...")
            raise ConfigError(f"unknown config key '{key}'; {_suggest(key, valid_keys(root))}")
        cur = getattr(obj, k)
        if dataclasses.is_dataclass(cur):
            v = {} if v is None else v  # a section whose entries are all commented out
            if not isinstance(v, dict):
                raise ConfigError(f"config key '{key}' is a section; give it a mapping, "
                                  f"e.g. {key}.{dataclasses.fields(cur)[0].name}=...")
            _apply(cur, v, key + ".", root)
        else:
            setattr(obj, k, _coerce(key, v, str(fields[k].type)))


def _kind(key: str, root: type = Config) -> str:
    """The declared type of the dotted `key` in the schema `root` ('' where it names no field)."""
    cls, kind = root, ""
    for part in key.split("."):
        fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
        f = next((f for f in fields if f.name == part), None)
        if f is None:
            return ""
        cls, kind = f.default_factory, str(f.type)
    return kind


def parse_overrides(overrides: list[str], whole: tuple = (), root: type = Config) -> dict:
    """['a.b=1', 'c=x'] -> {'a': {'b': 1}, 'c': 'x'}; values are parsed as YAML (typed), but a text
    key of the schema `root` keeps the text given. A section given as a mapping after some of its
    keys is merged with them (a later key wins), but for the top-level keys in `whole` (a
    comparison's sweep grid), which a later mapping replaces."""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (e.g. steps=100 or mpp.ratio=0.4)")
        key, raw = item.split("=", 1)
        try:
            value = read_yaml(raw) if raw != "" else ""
            if isinstance(value, str) and not raw.lstrip().startswith(("'", '"')):
                value = raw.strip()  # all of it: a '#' in an override's value begins no comment
            elif (isinstance(value, (dict, list)) or value is None and raw.strip()[:1] == "#") \
                    and _kind(key.strip(), root) == "str":
                value = raw.strip()  # runs/a: b, - a or #a, which YAML reads as a mapping, a list or a comment
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{p}'")
        last = parts[-1]
        if isinstance(node.get(last), dict) and not (node is out and last in whole):  # merged, never dropped
            if not isinstance(value, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of a key in '{key.strip()}'; "
                                  "give the section's keys one by one, or once as a mapping")
            _merge(node[last], value)
        else:
            node[last] = value
    return out


def _merge(base: dict, extra: dict, whole: tuple = ()) -> dict:
    """`extra` over `base`: mappings merge key by key, except the top-level keys in `whole`, which
    (like lists and scalars) `extra` replaces."""
    for k, v in extra.items():
        if v is None and isinstance(base.get(k), dict) and k not in whole:  # a section's entries commented out
            continue
        if isinstance(v, dict) and isinstance(base.get(k), dict) and k not in whole:
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def load_yaml(path: str | Path, whole: tuple = (), _seen: tuple = ()) -> dict:
    """Read a YAML mapping; `base: other.yaml` (relative to the file) is merged in first (`whole`:
    the keys whose mapping the file replaces, see `_merge`)."""
    path = Path(path)
    if path.resolve() in _seen:
        raise ConfigError(f"config file '{path}' includes itself through 'base:' ({' -> '.join(p.name for p in _seen)} "
                          f"-> {path.name}); remove the cycle")
    if path.is_dir():
        raise ConfigError(f"config file '{path}' is a folder; give a YAML file (e.g. one of configs/)")
    if not path.is_file():
        if _seen:  # a base: line's file, relative to the file that names it
            raise ConfigError(f"config file '{path}' does not exist: '{_seen[-1]}' names it as its base: (relative to "
                              "its own folder); fix that line")
        where = "" if path.is_absolute() else f" (relative to the current directory, {Path.cwd()})"
        raise ConfigError(f"config file '{path}' does not exist{where}; see configs/ for the shipped ones")
    try:
        with open(path, encoding="utf-8") as f:
            data = read_yaml(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text ({e.reason} at byte {e.start}); "
                          "give a YAML file") from None
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read ({e.strerror}); check its permissions") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys to values")
    base = data.pop("base", None)
    if base:
        if not isinstance(base, str):
            raise ConfigError(f"config file '{path}': 'base' must be the path of another config file")
        data = _merge(load_yaml(path.parent / base, whole, _seen + (path.resolve(),)), data, whole)
    return data


def build_config(data: dict) -> Config:
    """A validated Config from a plain mapping (as read from YAML)."""
    cfg = Config()
    _apply(cfg, data)
    validate(cfg)
    return cfg


def settings(data: dict) -> dict:
    """The flattened settings of a run's config.yaml (`data`) as the schema reads them, unvalidated:
    a key it leaves out, or written by an older mpp, takes its default, as it did then; a config
    the schema cannot read is taken as written over the defaults."""
    cfg = Config()
    try:
        _apply(cfg, data)
    except ConfigError:
        return {**flatten(to_dict(Config())), **flatten(data)}
    return flatten(to_dict(cfg))


def override_keys(overrides) -> set[str]:
    """The dotted keys that key=value `overrides` set, a section given as a mapping
    (finetune={pool: avg}) by its keys."""
    return set(flatten(parse_overrides(as_list(overrides))))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: list[str] | None = None) -> Config:
    """The config of the file at `path` with `overrides` over it; `defaults` (a tool's own,
    TOOL_DEFAULTS) lie beneath the file, so that a file's own objective reaches `check_tool`."""
    data = _merge(parse_overrides(defaults or []), load_yaml(path) if path else {})
    return build_config(_merge(data, parse_overrides(overrides or [])))


# the stage config keys the comparison sets itself, per stage
SET_BY_COMPARE = ("output_dir", "seed", "finetune.init", "finetune.label_fraction", "finetune.dev_fraction",
                  "finetune.split_seed")
# those it sets after the comparison's `overrides` (which would set them for some stages only)
OVERRIDDEN_BY_COMPARE = ("output_dir", "seed", "finetune.init", "finetune.label_fraction", "finetune.dev_fraction",
                         "probe.encoder")


def load_compare_config(path: str | Path, overrides: list[str] | None = None) -> CompareConfig:
    """The comparison's own config (its stage configs are validated by mpp.compare)."""
    cfg, data = CompareConfig(), load_yaml(path, WHOLE)
    for key in {o.split("=", 1)[0].strip() for o in overrides or []} & set(WHOLE):
        data.pop(key, None)  # sweep=GRID is the whole grid, not keys to add to the file's (sweep={}: none)
    _apply(cfg, _merge(data, parse_overrides(overrides or [], WHOLE, CompareConfig)), root=CompareConfig)
    for key in ("mpp", "supervised", "finetune", "probe"):
        if not getattr(cfg, key):
            raise ConfigError(f"compare config key '{key}' is empty; give the path of its stage config")
    if not cfg.label_fractions or not all(0 < f <= 1 for f in cfg.label_fractions):
        raise ConfigError("compare config key 'label_fractions' must list fractions in (0, 1]")
    decided = set(SET_BY_COMPARE) & set(cfg.sweep)
    if decided:
        raise ConfigError(f"compare config key 'sweep' names {', '.join(sorted(decided))}, which the comparison "
                          "sets itself; sweep recipe keys such as optim.lr")
    unread = sorted(k for k in cfg.sweep if k.split(".")[0] in UNREAD["classify"] or k in RESULT_NEUTRAL)
    if unread:
        raise ConfigError(f"compare config key 'sweep' names {', '.join(unread)}, which no fine-tune's result depends "
                          "on (a pre-training key, or one of speed or logging alone): its stages would differ in "
                          "nothing; sweep recipe keys such as optim.lr")
    overridden = override_keys(cfg.overrides)
    taken = overridden & set(OVERRIDDEN_BY_COMPARE)
    if taken:
        raise ConfigError(f"compare config key 'overrides' sets {', '.join(sorted(taken))}, which the comparison sets "
                          "itself for its stages (seeds: 'seeds' and 'pretrain_seeds'); override other keys")
    if cfg.pretrain_seeds > 1 and "seed" in override_keys(cfg.pretrain_overrides):
        raise ConfigError("compare config key 'pretrain_overrides' sets seed, which the repeats would ignore: with "
                          "pretrain_seeds > 1 they take seeds 0..N-1 themselves")
    chosen = set(cfg.sweep) | ({"finetune.pool"} if cfg.finetune_pool == "auto" else set())
    lost = sorted(k for k in overridden & chosen
                  if k.startswith("finetune."))  # read by the fine-tunes alone, each of which sets it after
    if lost:
        raise ConfigError(f"compare config key 'overrides' sets {', '.join(lost)}, which the sweep or finetune_pool: "
                          "auto sets for every fine-tune after it (it would reach no stage); leave it out, or set "
                          "finetune_pool: config to take finetune.pool from the overrides")
    if "auto" in cfg.sweep.get("finetune.pool", ()):
        raise ConfigError("compare config key 'sweep' gives finetune.pool the value auto, with which a final fine-tune "
                          "would choose its representation on its own training labels; sweep token and avg (or "
                          "leave finetune.pool out of the sweep: finetune_pool: auto chooses it on the dev split)")
    cfg.fraction_overrides = _by_fraction(cfg, "fraction_overrides")
    for frac, extra in cfg.fraction_overrides.items():
        if not all(isinstance(o, str) for o in extra):
            raise ConfigError(f"compare config key 'fraction_overrides' gives label fraction {frac} {extra!r}; give "
                              f"key=value overrides, e.g. {{{frac}: [steps=2400]}}")
        taken = override_keys(extra) & (set(SET_BY_COMPARE) | chosen)
        if taken:
            raise ConfigError(f"compare config key 'fraction_overrides' sets {', '.join(sorted(taken))} for label "
                              f"fraction {frac}, which the comparison, its sweep or finetune_pool: auto sets; "
                              "override other keys")
    _check_fraction_sweep(cfg)
    if cfg.seeds < 1 or cfg.pretrain_seeds < 1 or not 0 < cfg.dev_fraction < 1:
        raise ConfigError(f"compare config keys 'seeds' and 'pretrain_seeds' must be >= 1 and 'dev_fraction' in "
                          f"(0, 1), got {cfg.seeds}, {cfg.pretrain_seeds} and {cfg.dev_fraction}")
    if not str(cfg.output_dir).strip():
        raise ConfigError("compare config key 'output_dir' is empty, which would write the comparison into this "
                          "folder; give one, e.g. runs/compare")
    if cfg.pretrain_seeds > 1 and Path(os.path.normpath(cfg.output_dir)).name in ("", ".."):
        raise ConfigError(f"compare config key 'output_dir' is {cfg.output_dir!r}, which names no folder for the "
                          f"repeats of pretrain_seeds={cfg.pretrain_seeds} to sit beside (output_dir_pretrain_seed1, "
                          "...); give a folder name, e.g. runs/compare")
    if cfg.finetune_pool not in ("auto", "config"):
        raise ConfigError(f"compare config key 'finetune_pool' is {cfg.finetune_pool!r}; choose auto (chosen on each "
                          "fine-tune's own training labels; it replaced probe, the all-label probe's choice) or config")
    p = cfg.prepare
    src, out = as_list(p.shards_src), as_list(p.shards_out)
    if len(src) != len(out):
        raise ConfigError("compare config keys prepare.shards_src and prepare.shards_out must have the same length")
    if p.synthetic and (p.synthetic_train < 0 or p.synthetic_test < 0 or p.synthetic_train + p.synthetic_test == 0):
        raise ConfigError(f"compare config keys prepare.synthetic_train and prepare.synthetic_test must be >= 0, not "
                          f"both 0, got {p.synthetic_train} and {p.synthetic_test}")
    return cfg


def _check_fraction_sweep(cfg: CompareConfig) -> None:
    """`fraction_sweep` keyed by label fractions the comparison runs, each once, each grid giving the
    sweep's keys and no others: a cell's choice is then the same kind of choice at every fraction,
    over values that suit it (a rate rising to the top of one grid at 100% labels, say)."""
    grids = _by_fraction(cfg, "fraction_sweep")
    for frac, grid in grids.items():
        if set(grid) != set(cfg.sweep):
            raise ConfigError(f"compare config key 'fraction_sweep' gives label fraction {frac:g} a grid of "
                              f"{', '.join(sorted(grid))} where the sweep has {', '.join(sorted(cfg.sweep)) or 'none'}; "
                              "give each fraction values of the sweep's keys alone")
        if "auto" in grid.get("finetune.pool", ()):
            raise ConfigError(f"compare config key 'fraction_sweep' gives finetune.pool the value auto for label "
                              f"fraction {frac:g}; sweep token and avg")
    cfg.fraction_sweep = {frac: {key: grid[key] for key in cfg.sweep} for frac, grid in grids.items()}


def _by_fraction(cfg: CompareConfig, name: str) -> dict:
    """The compare config's mapping `name` keyed by the label fractions its keys name (a number, or
    its text from a key=value override), each a fraction the comparison runs, each once (0.1 and
    '0.10' would otherwise drop one)."""
    out: dict = {}
    for key, value in getattr(cfg, name).items():
        try:
            frac = float(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            frac = None
        if frac not in cfg.label_fractions:
            raise ConfigError(f"compare config key '{name}' names label fraction {key!r}, which "
                              f"label_fractions {list(cfg.label_fractions)} lacks; key it by one of those")
        if frac in out:
            raise ConfigError(f"compare config key '{name}' names label fraction {frac:g} twice "
                              f"({out[frac][0]!r} and {key!r}); give each fraction once")
        out[frac] = (key, value)
    return {frac: value for frac, (_, value) in out.items()}


def as_list(v: Any) -> list[str]:
    return [v] if isinstance(v, str) and v else list(v or [])
