"""One config schema for every tool: dataclasses, loaded from YAML plus `key=value` overrides.

`load_config(path, overrides)` returns a validated `Config`; any unknown key or bad value raises
`ConfigError` with a one-line message before any work starts. A comparison's own schema
(`CompareConfig`, `load_compare_config`) names these configs, one for each of its stages.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mpp.specs import DATA_KEYS, data_key


MAX_BITS = 5  # mpp.bits: 32768 colour classes; 8 bits would ask for a 16.7M-class head


class ConfigError(ValueError):
    """A bad config key or value; the message names it and says what is allowed."""


@dataclass
class DataConfig:
    """Where batches come from and how they are augmented (see mpp.data)."""
    train: Any = ""            # manifest.json, a shard list, or a brace pattern
    val: Any = ""              # held-out labeled shards: fine-tune evaluation, probe test set
    num_samples: int = 0       # samples in `train` when it is not a manifest (brace pattern / list)
    val_num_samples: int = 0   # the same for `val`
    num_workers: int = 2       # DataLoader workers per rank
    shuffle_buffer: int = 2000  # per-worker sample shuffle buffer (0: no sample shuffle)
    shuffle_mb: int = 1024     # per worker: the shuffle buffer holds at most this many MiB of raw samples (large images: fewer)
    resampled: bool = False    # draw shards with replacement, forever; epoch length = epoch_samples
    epoch_samples: int = 0     # samples per epoch (all ranks) in resampled mode
    crop_scale: tuple = (0.08, 1.0)  # inception crop area range (paper: 0.08-1)
    hflip: float = 0.5
    randaugment: tuple = (0, 9)      # training images: RandAugment's (ops, magnitude) after crop and flip; 0 ops: off
    eval_crop_pct: float = 0.875     # evaluation: resize to img_size / crop_pct, centre crop
    mean: tuple = (0.5, 0.5, 0.5)    # ViT normalisation to [-1, 1]
    std: tuple = (0.5, 0.5, 0.5)
    max_pixels: int = 64_000_000     # larger images are rejected as corrupt (decompression bombs)
    cache_mb: int = 512        # per worker: keep a train set's raw samples in memory after the
                               # first epoch when they fit (small sets read many times); 0: off
    timeout: int = 600         # seconds the data workers may read nothing while the run waits for a batch: a
                               # shard read that stalls (a hung mount or stream) ends in an error, not forever;
                               # 0: none (nor with num_workers=0: no worker to watch)
    withhold: tuple = ()       # pre-training: [[label_fraction, split_seed, dev_fraction], ...], the development
                               # splits that fine-tunes on `train` draw (finetune.*), left out of this run so that
                               # their recipes are chosen on images it never saw; tools/compare.py sets it


@dataclass
class MPPConfig:
    """Masked patch prediction (paper section 4.6 / B.1.2)."""
    ratio: float = 0.5         # fraction of patches chosen per image
    mask: float = 0.8          # of the chosen: replaced by the [mask] embedding
    random: float = 0.1        # ... by the embedding of a random other patch of the same image
    keep: float = 0.1          # ... left unchanged
    target: str = "mean_color"  # an entry of mpp.targets.TARGETS (a wrong name's error lists them)
    bits: int = 3              # colour quantisation per channel (512 classes at 3)


@dataclass
class SupervisedConfig:
    """Supervised pre-training head: one hidden layer (tanh), as the paper."""
    hidden_dim: int = 0        # 0: the encoder width
    label_smoothing: float = 0.0


@dataclass
class FinetuneConfig:
    """Fine-tuning (objective: classify): a new linear head on the encoder (zeros, or the linear
    probe's with head_init=probe)."""
    init: str = "none"         # none (from scratch) | path to encoder.safetensors or a run dir
    pool: str = "token"        # token ([class] token) | avg (mean of patch tokens) | auto (the better one for a
                               # linear probe of this run's own training labels, scored on its dev split if any)
    label_fraction: float = 1.0  # class-balanced, seeded subset of the labeled train shards
    dev_fraction: float = 0.0  # > 0: hold out this class-balanced share of that subset, train on the rest
                               # and evaluate on it instead of data.val (to choose a recipe, never on test)
    split_seed: int = 0        # draws the subset and the dev split (kept across `seed`, which varies the run)
    drop_path: float = 0.0
    label_smoothing: float = 0.0
    head_init: str = "zero"    # zero (the paper) | probe: the linear probe of the frozen encoder on the
                               # same training labels (LP-FT), so fine-tuning starts at the probe's accuracy
    head_l2: float = 0.0       # > 0: that probe head's L2, not chosen by the run (tools/compare.py gives its
                               # finals the L2 their best sweep stage chose on its development split)


@dataclass
class OptimConfig:
    """Optimiser and schedule (timm factory and schedulers)."""
    name: str = "adamw"        # adamw | sgd (momentum) | adam
    lr: float = 2e-4
    weight_decay: float = 0.1  # not applied to norms, biases, position embeddings, tokens
    beta1: float = 0.9
    beta2: float = 0.999
    momentum: float = 0.9      # sgd only
    warmup_steps: int = 0
    schedule: str = "cosine"   # cosine | linear | constant
    min_lr: float = 0.0
    clip_grad: float = 1.0     # max global gradient norm; 0 turns clipping off
    layer_decay: float = 0.0   # layer-wise lr decay (e.g. 0.75); 0 turns it off


@dataclass
class TrainConfig:
    """Loop machinery shared by pre-training and fine-tuning."""
    precision: str = "auto"    # auto (bf16 where the device has it, else fp16 on GPUs, fp32 on CPUs) | bf16 | fp16 | no
    grad_accum: int = 1
    log_every: int = 10
    ckpt_every: int = 500      # steps between checkpoints (0: only at the end)
    keep_ckpts: int = 2
    resume: str = "auto"       # auto (newest complete checkpoint in output_dir) | none | a path
    max_bad_steps: int = 20    # consecutive non-finite steps before training stops
    dist_timeout: int = 1800   # seconds a rank waits at a collective for the others (torch's NCCL default, 600,
                               # is shorter than the main process's probe-head fit on a large set)
    attn: str = "auto"         # auto (fused on CUDA, math elsewhere) | fused | math (mpp.runtime.ATTENTION)
    compile: str = "auto"      # torch.compile the step: auto (CUDA, runs of mpp.compiled.AUTO_MIN_STEPS+) | always | never
    compile_mode: str = "default"  # torch.compile's mode; reduce-overhead adds CUDA graphs (mpp.compiled)
    image_every: int = 0       # MPP: log a prediction grid to TensorBoard every N steps (0: off)
    profile: tuple = (0, 0)    # [first, count]: torch.profiler over steps first+1..first+count into
                               # OUTPUT_DIR/profile (mpp.profiling); count 0: off
    deterministic: bool = False  # torch's deterministic kernels only (mpp.runtime.deterministic), for GPU
                               # runs that repeat bit for bit; slower, and an op that has none stops the run


@dataclass
class FewshotConfig:
    """Few-shot linear evaluation (closed-form least squares onto {-1, 1})."""
    train: Any = ""            # labeled shards to draw the shots from
    test: Any = ""             # labeled shards to evaluate on
    train_num_samples: int = 0
    test_num_samples: int = 0
    shots: tuple = (1, 5, 10, 25)
    seeds: int = 3
    l2: float = 1024.0         # ridge regulariser on standardised features (big_vision: 2**10)
    every: int = 0             # during pre-training: evaluate every N steps (0: off)
    max_test: int = 2000       # test images used during pre-training


@dataclass
class ProbeConfig:
    """Linear probe on frozen features."""
    pool: str = "auto"         # auto (chosen per encoder on held-out train features or dev_split) | token | avg
    val_fraction: float = 0.1  # of the training features, to choose the regulariser and representation (no dev_split)
    dev_split: tuple = ()      # [split_seed, dev_fraction]: choose the L2 and representation on this development split
                               # of all the labels instead (a fine-tune's at label_fraction 1, which a pre-training
                               # can withhold), fitted on the rest, then refitted on all; tools/compare.py sets it
    l2_grid: tuple = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # L2 strengths tried (on mean
                               # cross-entropy, standardised features); widen it when the choice lands on an edge
    cache_dir: str = ""        # feature cache ('' -> OUTPUT_DIR/../feature_cache)
    encoder: str = ""          # the encoder to probe: a pre-training run dir or its encoder.safetensors;
                               # none: a randomly initialised `model` (the from-scratch baseline)


@dataclass
class Config:
    output_dir: str = "runs/default"
    objective: str = "mpp"     # mpp | supervised | classify
    model: str = "vit_ti4_32"  # a preset from mpp.models.PRESETS
    img_size: int = 0          # 0: the preset's resolution
    batch_size: int = 256      # global, across all ranks and accumulation steps
    steps: int = 0             # total optimiser steps (0: from `epochs`)
    epochs: float = 0.0        # run length in epochs of data.train when steps is 0
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    mpp: MPPConfig = field(default_factory=MPPConfig)
    supervised: SupervisedConfig = field(default_factory=SupervisedConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fewshot: FewshotConfig = field(default_factory=FewshotConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)


@dataclass
class PrepareConfig:
    """Data a comparison makes before it starts (skipped when the manifests exist)."""
    synthetic: str = ""        # generate the embedded synthetic data set here (train/, test/)
    synthetic_train: int = 5000
    synthetic_test: int = 1000
    shards_src: Any = ""       # image folders or tars to shard (tools/make_shards.py) ...
    shards_out: Any = ""       # ... and their output directories, in the same order


@dataclass
class CompareConfig:
    """The whole self-supervised vs supervised experiment (tools/compare.py)."""
    output_dir: str = "runs/compare"
    mpp: str = ""              # pre-training config (objective mpp)
    supervised: str = ""       # pre-training config (objective supervised)
    finetune: str = ""         # fine-tuning config (objective classify); init set per run
    probe: str = ""            # linear-probe config; probe.encoder set per run
    label_fractions: tuple = (0.1, 1.0)
    sweep: dict = field(default_factory=dict)  # fine-tune config key -> values tried on the dev split,
                               # e.g. {optim.lr: [0.01, 0.03]}; several keys: every combination; a file's
                               # sweep replaces its base's grid, an override sweep={...} the file's, and
                               # sweep.KEY=[...] sets one key's values
    dev_fraction: float = 0.1  # class-balanced share of each fine-tune's labels held out to choose the sweep value
    seeds: int = 1             # final fine-tunes per arm and label fraction (seed 0..seeds-1): mean ± std
    pretrain_seeds: int = 1    # pre-trainings per pre-trained arm (seed 0..N-1, for N > 1 in place of the configs'
                               # own seed): seed s > 0 repeats the MPP and supervised stages in
                               # OUTPUT_DIR_pretrain_seed{s} (scratch is shared), and the report
                               # adds each gap over them, its ± counting the pre-training's own seed
    runner_up: bool = True     # after a toss-up on the dev split, also retrain the next value (same seeds):
                               # the report gives the figures it touches their range
    finetune_pool: str = "auto"  # auto: each arm's finetune.pool chosen by a probe of its sweep's training labels,
                               # scored on its dev split (finetune.pool=auto); config: the stage config's;
                               # neither applies where the sweep has finetune.pool (the fine-tune chooses)
    overrides: Any = ""        # key=value overrides applied to every run (e.g. [train.precision=no])
    pretrain_overrides: Any = ""  # ... and to both pre-trainings only, after those (e.g. [steps=4800])
    fraction_overrides: dict = field(default_factory=dict)  # label fraction -> overrides of its fine-tunes
                               # (sweep and final, every arm alike), after `overrides`, e.g. {1.0: [steps=2400]}
    launcher: str = ""         # command that runs a tool ('' -> this python; e.g. 'torchrun --nproc_per_node 2')
    prepare: PrepareConfig = field(default_factory=PrepareConfig)


# compare config keys whose mapping is one value (a grid), not settings: a file's replaces its base's
# and `KEY=...` the file's (`KEY.SUB=...` sets one entry); sections merge key by key, lists replace
WHOLE = tuple(f.name for f in dataclasses.fields(CompareConfig) if f.type == "dict")

MAX_TOKENS = 2 ** 16  # patches per image: 256 x 256 (ViT-H/14 at 896 px has 4,096); more is a typo, not a run

# Keys that change how fast a run goes or what it logs, never what it computes: a finished run of
# other values is the run of these (compare resumes it, a resumed run does not warn about them).
# Not data.num_workers: the workers' shard split orders the batches and the test images; nor
# train.compile (compiled code draws its own random numbers) or train.compile_mode, train.attn and
# train.precision (other kernels, other rounding). metrics.json's `loss` is the mean of the last
# log window (train.log_every steps, fewer where a checkpoint closed it: train.ckpt_every not a
# multiple of it), recorded beside those values in the run's config.yaml.
RESULT_NEUTRAL = ("data.cache_mb", "data.timeout", "train.log_every", "train.ckpt_every", "train.keep_ckpts",
                  "train.resume", "train.image_every", "train.profile", "train.dist_timeout", "probe.cache_dir")


def choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of each key that names an entry of a table, read off the tables
    themselves (imported here, not with this module, so that reading a config stays cheap)."""
    from mpp.compiled import COMPILE, COMPILE_MODES
    from mpp.models import POOLS, PRESETS
    from mpp.objectives import HEAD_INITS, OBJECTIVES
    from mpp.targets import TARGETS
    from mpp.optim import OPTIMIZERS, SCHEDULES
    from mpp.runtime import ATTENTION, PRECISIONS
    return {"objective": tuple(OBJECTIVES), "model": tuple(PRESETS), "mpp.target": tuple(TARGETS),
            "finetune.pool": ("auto", *POOLS), "finetune.head_init": HEAD_INITS, "probe.pool": ("auto", *POOLS),
            "optim.name": tuple(OPTIMIZERS), "optim.schedule": tuple(SCHEDULES), "train.precision": PRECISIONS,
            "train.attn": tuple(ATTENTION), "train.compile": tuple(COMPILE),
            "train.compile_mode": tuple(COMPILE_MODES)}


def _suggest(key: str, valid: list[str]) -> str:
    """'did you mean X?' for a near miss (`resume` -> `train.resume`), else the valid keys."""
    near = [k for k in valid if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]] or \
        difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
    return f"did you mean '{near[0]}'?" if near else f"valid keys: {', '.join(valid)}"


# the settings a tool takes where its config file and overrides give none (mpp.compare resolves its
# stages with them too): beneath the file, so that a pre-training's file given to the fine-tune tool
# is refused, not run as a fine-tune of its recipe
TOOL_DEFAULTS = {"finetune": ["objective=classify"]}
# the objectives a training tool runs; and the sections each objective (or the probe) never reads
TOOL_OBJECTIVES = {"pretrain": ("mpp", "supervised"), "finetune": ("classify",)}
UNREAD = {"mpp": ("supervised", "finetune"), "supervised": ("mpp", "finetune"), "classify": ("mpp", "supervised"),
          "probe": ("mpp", "supervised", "finetune", "optim")}
# a setting -> the keys of its section that it leaves unread (optim.momentum is SGD's, hog's head
# has no colour classes, a constant schedule no floor, a loader that shuffles no samples no buffer)
UNREAD_WITH = {("optim.name", "adamw"): ("optim.momentum",), ("optim.name", "adam"): ("optim.momentum",),
               ("optim.name", "sgd"): ("optim.beta1", "optim.beta2"), ("optim.schedule", "constant"): ("optim.min_lr",),
               ("mpp.target", "hog"): ("mpp.bits",), ("train.compile", "never"): ("train.compile_mode",),
               ("data.resampled", False): ("data.epoch_samples",), ("data.shuffle_buffer", 0): ("data.shuffle_mb",)}


def check_tool(cfg: Config, tool: str, source: str = "") -> list[str]:
    """Refuse a config of another tool's objective (the pre-training tool ran a fine-tune's config
    as a fine-tune), naming the `source` it came from (a config file) where given; return what
    `tool` never reads but differs from its default (a misplaced key, such as finetune.init given
    to a pre-training, or optim.momentum given with optim.name=adamw, does nothing), as phrases
    'WHAT never reads KEY=VALUE, ...': the sections its objective never reads (UNREAD), then in
    the others the keys that a setting leaves unread (UNREAD_WITH)."""
    allowed = TOOL_OBJECTIVES.get(tool)
    if allowed and cfg.objective not in allowed:
        other = next(t for t, objectives in TOOL_OBJECTIVES.items() if cfg.objective in objectives)
        raise ConfigError(f"objective={cfg.objective}{f' (from {source})' if source else ''} is not what this tool "
                          f"trains ({' or '.join(allowed)}); run tools/{other}.py for it, or give this tool a config "
                          "of its own objective")
    sections = UNREAD["probe" if tool == "linear_probe" else cfg.objective]
    now, default = flatten(to_dict(cfg)), flatten(to_dict(Config()))
    readers = {"this tool" if tool == "linear_probe" else f"objective={cfg.objective}":
               [k for k in sorted(now) if k.split(".")[0] in sections]}
    for (key, value), keys in UNREAD_WITH.items():
        if now[key] == value and key.split(".")[0] not in sections:
            readers[f"{key}={str(value).lower() if isinstance(value, bool) else value}"] = keys
    phrases = []
    for who, keys in readers.items():
        given = [f"{k}={now[k]}" for k in keys if now[k] != default[k]]
        if given:
            phrases.append(f"{who} never reads {', '.join(given[:4])}{', ...' if len(given) > 4 else ''}")
    return phrases


def valid_keys(cls=Config, prefix: str = "") -> list[str]:
    """All dotted keys of the schema, for error messages and --help."""
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            keys += valid_keys(f.default_factory, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


class YamlLoader(yaml.SafeLoader):
    """YAML with YAML 1.2's core schema for plain scalars: true and false are the only booleans and
    numbers are written in decimal (or 0x / 0o), so that no, off, 010, 12:30, 1_000 or 2026-12-04
    stay the text written, where YAML 1.1 reads false, false, 8, 750, 1000 and a date (an
    output_dir=010 went to '8'), and 1e-3 is a number. Configs, overrides and the config.yaml of
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
        ("int", r"^[-+]?(?:0|[1-9][0-9]*)$|^0o[0-7]+$|^0x[0-9a-fA-F]+$", "-+0123456789"),
        ("float", r"^[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?$|^[-+]?[0-9]+[eE][-+]?[0-9]+$"
                  r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$", "-+0123456789.")):
    YamlLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_rx), list(_first))


def read_yaml(text) -> Any:
    """`text` (a string or an open file) parsed with `YamlLoader`."""
    return yaml.load(text, Loader=YamlLoader)


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
                                     "e.g. {1.0: [steps=2400]}"}


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
        if kind == "dict" and isinstance(value, dict):
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


def flatten(d: dict, prefix: str = "") -> dict:
    """{'optim': {'lr': v}} and {'optim.lr': v} -> {'optim.lr': v}."""
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


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
            elif isinstance(value, (dict, list)) and _kind(key.strip(), root) == "str":
                value = raw.strip()  # runs/a: b or - a, which YAML reads as a mapping or a list
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
    taken = {o.split("=", 1)[0].strip() for o in as_list(cfg.overrides)} & set(OVERRIDDEN_BY_COMPARE)
    if taken:
        raise ConfigError(f"compare config key 'overrides' sets {', '.join(sorted(taken))}, which the comparison sets "
                          "itself for its stages (seeds: 'seeds' and 'pretrain_seeds'); override other keys")
    if cfg.pretrain_seeds > 1 and "seed" in {o.split("=", 1)[0].strip() for o in as_list(cfg.pretrain_overrides)}:
        raise ConfigError("compare config key 'pretrain_overrides' sets seed, which the repeats would ignore: with "
                          "pretrain_seeds > 1 they take seeds 0..N-1 themselves")
    chosen = set(cfg.sweep) | ({"finetune.pool"} if cfg.finetune_pool == "auto" else set())
    lost = sorted(k for k in {o.split("=", 1)[0].strip() for o in as_list(cfg.overrides)} & chosen
                  if k.startswith("finetune."))  # read by the fine-tunes alone, each of which sets it after
    if lost:
        raise ConfigError(f"compare config key 'overrides' sets {', '.join(lost)}, which the sweep or finetune_pool: "
                          "auto sets for every fine-tune after it (it would reach no stage); leave it out, or set "
                          "finetune_pool: config to take finetune.pool from the overrides")
    if "auto" in cfg.sweep.get("finetune.pool", ()):
        raise ConfigError("compare config key 'sweep' gives finetune.pool the value auto, with which a final fine-tune "
                          "would choose its representation on its own training labels; sweep token and avg (or "
                          "leave finetune.pool out of the sweep: finetune_pool: auto chooses it on the dev split)")
    by_fraction: dict = {}
    for k, v in cfg.fraction_overrides.items():
        frac = _fraction(k, cfg.label_fractions)
        if frac in by_fraction:  # 0.1 and '0.10': one would be dropped
            raise ConfigError(f"compare config key 'fraction_overrides' names label fraction {frac:g} twice "
                              f"({by_fraction[frac][0]!r} and {k!r}); give each fraction once")
        by_fraction[frac] = (k, v)
    cfg.fraction_overrides = {frac: v for frac, (_, v) in by_fraction.items()}
    for frac, extra in cfg.fraction_overrides.items():
        if not all(isinstance(o, str) for o in extra):
            raise ConfigError(f"compare config key 'fraction_overrides' gives label fraction {frac} {extra!r}; give "
                              f"key=value overrides, e.g. {{{frac}: [steps=2400]}}")
        taken = {o.split("=", 1)[0].strip() for o in extra} & (set(SET_BY_COMPARE) | chosen)
        if taken:
            raise ConfigError(f"compare config key 'fraction_overrides' sets {', '.join(sorted(taken))} for label "
                              f"fraction {frac}, which the comparison, its sweep or finetune_pool: auto sets; "
                              "override other keys")
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


def _fraction(key: Any, fractions: tuple) -> float:
    """A fraction_overrides key (a number, or its text from a key=value override) as the label
    fraction it names."""
    try:
        frac = float(key) if not isinstance(key, bool) else None
    except (TypeError, ValueError):
        frac = None
    if frac not in fractions:
        raise ConfigError(f"compare config key 'fraction_overrides' names label fraction {key!r}, which "
                          f"label_fractions {list(fractions)} lacks; key it by one of those")
    return frac


def as_list(v: Any) -> list[str]:
    return [v] if isinstance(v, str) and v else list(v or [])


def to_dict(cfg: Config) -> dict:
    """Plain data (tuples as lists) for config.yaml and metrics.json."""
    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(dataclasses.asdict(cfg))


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
    except (OSError, yaml.YAMLError, ConfigError):
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


def validate(cfg: Config) -> None:
    """Check every value that can be checked without touching data or devices."""
    def check(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    for key, value in flatten(to_dict(cfg)).items():  # every number, lists' included, is finite
        for v in value if isinstance(value, list) else [value]:
            check(not isinstance(v, float) or math.isfinite(v), f"config key '{key}' must be a finite number, got {v}")
    for key, allowed in choices().items():
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        check(obj in allowed, f"config key '{key}' is {obj!r}; choose one of {', '.join(allowed)}")
    from mpp.models import grid_fix, preset_geometry  # late import, as in choices()
    check(bool(cfg.output_dir), "config key 'output_dir' is empty; give a run directory")
    check(0 < cfg.batch_size < 2**31, f"config key 'batch_size' must be in 1..{2**31 - 1}, got {cfg.batch_size}")
    for key, seed in (("seed", cfg.seed), ("finetune.split_seed", cfg.finetune.split_seed)):  # numpy's range
        check(0 <= seed < 2**32, f"config key '{key}' must be a whole number in 0..{2**32 - 1}, got {seed}")
    check(cfg.steps >= 0 and cfg.epochs >= 0, "config keys 'steps' and 'epochs' must be >= 0")
    check(cfg.img_size >= 0, "config key 'img_size' must be >= 0 (0: the preset's)")
    img, patch = preset_geometry(cfg.model, cfg.img_size)
    fix = grid_fix(img, patch)
    check(not fix, f"config key 'img_size' is {img}: model {cfg.model}'s patch size is {patch}; give {fix}")
    check((img // patch) ** 2 <= MAX_TOKENS, f"config key 'img_size' is {img}: {(img // patch) ** 2} patches of "
                                             f"{patch} px, past the {MAX_TOKENS} a model here attends over; give an "
                                             f"img_size of at most {patch * math.isqrt(MAX_TOKENS)}")
    chosen = math.floor(cfg.mpp.ratio * (img // patch) ** 2 + 0.5)
    check(cfg.objective != "mpp" or chosen >= 1,
          f"config key 'mpp.ratio' is {cfg.mpp.ratio}: it chooses {chosen} of {(img // patch) ** 2} patches; raise it")
    m = cfg.mpp
    check(0.0 < m.ratio <= 1.0, f"config key 'mpp.ratio' must be in (0, 1], got {m.ratio}")
    for k in ("mask", "random", "keep"):
        check(getattr(m, k) >= 0, f"config key 'mpp.{k}' must be >= 0")
    check(abs(m.mask + m.random + m.keep - 1.0) < 1e-6,
          f"config keys mpp.mask + mpp.random + mpp.keep must sum to 1, got {m.mask + m.random + m.keep:g}")
    check(1 <= m.bits <= MAX_BITS, f"config key 'mpp.bits' must be in 1..{MAX_BITS} (2^(3 bits) colour classes: "
          f"{2 ** (3 * MAX_BITS)} at {MAX_BITS}), got {m.bits}")
    from mpp.targets import TARGETS
    if cfg.objective == "mpp":  # the target and the bits are known good here
        width, most = TARGETS[m.target].outputs, 2 ** (3 * MAX_BITS)  # the widest head mean_color can ask for
        fits = [b for b in range(1, MAX_BITS + 1) if width(b, patch) <= most]
        check(width(m.bits, patch) <= most,
              f"mpp.target={m.target} at mpp.bits={m.bits} asks for a head of {width(m.bits, patch)} outputs a "
              f"chosen patch, above the {most} of the widest colour head; give mpp.bits <= {max(fits, default=1)}")
    d = cfg.data
    check(d.num_workers >= 0 and d.shuffle_buffer >= 0 and d.cache_mb >= 0 and d.timeout >= 0,
          "config keys data.num_workers, data.shuffle_buffer, data.cache_mb and data.timeout must be >= 0")
    check(d.timeout <= 8_640_000, f"config key 'data.timeout' is {d.timeout} seconds; give at most 8640000 (100 days: "
          "longer overflows a timer), or 0 for no limit")
    check(d.shuffle_mb >= 1, f"config key 'data.shuffle_mb' must be >= 1 (MiB a worker's shuffle buffer may hold), "
          f"got {d.shuffle_mb}")
    check(len(d.crop_scale) == 2 and 0 < d.crop_scale[0] <= d.crop_scale[1] <= 1,
          f"config key 'data.crop_scale' must be [lo, hi] with 0 < lo <= hi <= 1, got {list(d.crop_scale)}")
    check(0.25 <= d.eval_crop_pct <= 1.0,  # an image is resized to img_size / eval_crop_pct before its crop
          f"config key 'data.eval_crop_pct' must be in [0.25, 1] (timm's are 0.875-1), got {d.eval_crop_pct}: "
          "evaluation resizes each image to img_size / eval_crop_pct before the centre crop")
    check(0.0 <= d.hflip <= 1.0, "config key 'data.hflip' must be a probability in [0, 1]")
    check(len(d.randaugment) == 2 and all(isinstance(v, int) for v in d.randaugment)
          and 0 <= d.randaugment[0] <= 16 and 0 <= d.randaugment[1] <= 30,  # timm's and the paper's: 1-4 ops
          f"config key 'data.randaugment' must be [ops, magnitude] with ops in 0..16 (0: off) and magnitude in "
          f"0..30, got {list(d.randaugment)}")
    check(len(d.mean) == 3 and len(d.std) == 3 and all(1e-3 <= s <= 1e3 for s in d.std)
          and all(abs(m) <= 1e3 for m in d.mean),  # of pixels in [0, 1]: a std of 1e-300 overflowed every input
          f"config keys data.mean and data.std must be 3 numbers each, std in [0.001, 1000] and mean within "
          f"+-1000 (statistics of pixels in [0, 1]), got {list(d.mean)} and {list(d.std)}")
    for fraction, seed, dev in d.withhold:
        check(0 < fraction <= 1 and 0 < dev < 1 and float(seed).is_integer() and 0 <= seed < 2**32,
              f"config key 'data.withhold' lists [{fraction:g}, {seed:g}, {dev:g}]: each entry must be "
              "[label_fraction in (0, 1], split_seed a whole number >= 0, dev_fraction in (0, 1)]")
    check(not d.withhold or cfg.objective != "classify",
          "config key 'data.withhold' is for pre-training; a fine-tune holds out its own development split "
          "with finetune.dev_fraction")
    check(not d.resampled or d.epoch_samples > 0,
          "data.resampled=true needs data.epoch_samples > 0 (the fixed epoch length)")
    counts = {"data.num_samples": d.num_samples, "data.val_num_samples": d.val_num_samples,
              "data.epoch_samples": d.epoch_samples, "fewshot.train_num_samples": cfg.fewshot.train_num_samples,
              "fewshot.test_num_samples": cfg.fewshot.test_num_samples}
    negative = [f"{k}={v}" for k, v in counts.items() if v < 0]
    check(not negative, f"config keys of sample counts must be >= 0, got {', '.join(negative)}")
    o = cfg.optim
    check(0 < o.lr < math.inf, f"config key 'optim.lr' must be a finite number > 0, got {o.lr}")
    check(o.weight_decay >= 0 and o.min_lr >= 0 and o.warmup_steps >= 0 and o.clip_grad >= 0,
          "config keys optim.weight_decay, optim.min_lr, optim.warmup_steps, optim.clip_grad must be >= 0")
    check(0 <= o.layer_decay <= 1, "config key 'optim.layer_decay' must be in [0, 1] (0: off)")
    check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1 and 0 <= o.momentum < 1,
          f"config keys optim.beta1, optim.beta2 and optim.momentum must be in [0, 1), got {o.beta1}, {o.beta2}, "
          f"{o.momentum}")
    check(o.min_lr <= o.lr, f"config key 'optim.min_lr' ({o.min_lr}) is above optim.lr ({o.lr}): the schedule "
          "would rise; give a smaller one")
    t = cfg.train
    check(t.grad_accum >= 1, "config key 'train.grad_accum' must be >= 1")
    from mpp.compiled import COMPILE_MODES  # late import, as above
    check(t.grad_accum == 1 or t.compile == "never" or not COMPILE_MODES.get(t.compile_mode),
          f"config key 'train.compile_mode' is {t.compile_mode}, whose CUDA graphs overwrite a micro-batch's "
          f"gradients before train.grad_accum={t.grad_accum} adds the next's; give train.grad_accum=1, "
          "train.compile_mode=default or max-autotune-no-cudagraphs, or train.compile=never")
    check(t.log_every >= 1 and t.ckpt_every >= 0 and t.keep_ckpts >= 1 and t.max_bad_steps >= 1 and t.dist_timeout >= 1,
          "config keys train.log_every, train.keep_ckpts, train.max_bad_steps, train.dist_timeout must be >= 1, "
          "train.ckpt_every >= 0")
    check(t.dist_timeout <= 8_640_000, f"config key 'train.dist_timeout' is {t.dist_timeout} seconds; give at most "
          "8640000 (100 days)")
    check(t.image_every >= 0, f"config key 'train.image_every' must be >= 0 (0: off), got {t.image_every}")
    check(len(t.profile) == 2 and all(isinstance(v, int) and v >= 0 for v in t.profile)
          and (t.profile[1] == 0 or t.profile[0] >= 1),
          f"config key 'train.profile' must be [first, count], whole numbers: steps first+1..first+count are "
          f"profiled, count 0 turns it off, and first >= 1 (the step before warms the profiler up), "
          f"got {list(t.profile)}")
    check(not t.image_every or cfg.objective == "mpp",
          f"train.image_every logs MPP predictions; set it to 0 for objective={cfg.objective}")
    if t.image_every and cfg.objective == "mpp":
        from mpp.targets import TARGETS
        check(TARGETS[cfg.mpp.target].colors is not None,  # a known target: the choices checked above
              f"train.image_every paints predicted colours, which mpp.target={cfg.mpp.target} does not predict; "
              f"set it to 0")
    f = cfg.finetune
    check(bool(f.init.strip()), "config key 'finetune.init' is empty; give none (from scratch), a pre-training run "
          "directory or its encoder.safetensors")
    check(0 < f.label_fraction <= 1, f"config key 'finetune.label_fraction' must be in (0, 1], got {f.label_fraction}")
    check(0 <= f.dev_fraction < 1,
          f"config key 'finetune.dev_fraction' must be in [0, 1) (0: off), got {f.dev_fraction}")
    check(0 <= f.drop_path < 1 and 0 <= f.label_smoothing < 1 and 0 <= cfg.supervised.label_smoothing < 1,
          "drop_path and label_smoothing must be in [0, 1)")
    check(f.head_l2 >= 0 and (f.head_l2 == 0 or f.head_init == "probe"),
          f"config key 'finetune.head_l2' must be >= 0 (0: chosen by the run) and is the L2 of a probe head: "
          f"set finetune.head_init=probe or finetune.head_l2=0, got {f.head_l2} with head_init={f.head_init}")
    check(cfg.supervised.hidden_dim >= 0, "config key 'supervised.hidden_dim' must be >= 0 (0: the encoder width)")
    check(d.max_pixels > 0, f"config key 'data.max_pixels' must be > 0, got {d.max_pixels}")
    fs = cfg.fewshot
    check(len(fs.shots) > 0 and all(int(s) == s and s >= 1 for s in fs.shots) and fs.seeds >= 1
          and fs.every >= 0 and fs.max_test >= 1,
          "config keys fewshot.shots (a non-empty list of whole numbers >= 1), fewshot.seeds (>= 1), "
          "fewshot.every (>= 0, 0: off), fewshot.max_test (>= 1)")
    check(not fs.every or (fs.train and fs.test),
          "config key 'fewshot.every' > 0 needs labeled shards in fewshot.train and fewshot.test (e.g. the "
          "synthetic train/ and test/ manifests); set both, or fewshot.every=0")
    check(fs.l2 > 0, f"config key 'fewshot.l2' must be > 0, the ridge term (without it the standardised features' "
                     f"equations are singular; big_vision's is 1024), got {fs.l2}")
    check(0 < cfg.probe.val_fraction < 1, "config key 'probe.val_fraction' must be in (0, 1)")
    split = cfg.probe.dev_split
    check(not split or (len(split) == 2 and float(split[0]).is_integer() and 0 <= split[0] < 2**32
                        and 0 < split[1] < 1),
          f"config key 'probe.dev_split' must be [] or [split_seed (a whole number >= 0), dev_fraction in (0, 1)], "
          f"got {list(split)}")
    check(len(cfg.probe.l2_grid) > 0 and all(v > 0 for v in cfg.probe.l2_grid),
          f"config key 'probe.l2_grid' must be a non-empty list of L2 strengths > 0, e.g. [1e-4, 1e-2, 1], "
          f"got {list(cfg.probe.l2_grid)}")
