"""The schema: one dataclass per section of a run's config (`Config`, `DataConfig` ... `ProbeConfig`) and
a comparison's (`CompareConfig`, `PrepareConfig`), with what reads straight off them: the dotted keys
(`valid_keys`, `flatten`), a config as plain data (`to_dict`), the allowed values of the keys that name
a table's entry (`choices`) and the limits and key lists the other parts share (`MAX_BITS`,
`MAX_TOKENS`, `WHOLE`, `RESULT_NEUTRAL`). Nothing here reads a file or checks a value.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


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
    shift: int = 0                   # training images: moved by up to this many pixels each way after crop and flip,
                                     # the border reflected (CIFAR's pad-and-crop); 0: off
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
    pool_folds: int = 0        # >= 2: pool=auto (and a probe head's L2) scored by k-fold cross-validation over all
                               # the run's labels, dev split included, for an encoder that never trained on labels
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
    fraction_sweep: dict = field(default_factory=dict)  # label fraction -> its own values of the sweep's keys, in
                               # place of `sweep` there, e.g. {1.0: {optim.lr: [0.0003, 0.001, 0.002]}}
    launcher: str = ""         # command that runs a tool ('' -> this python; e.g. 'torchrun --nproc_per_node 2')
    prepare: PrepareConfig = field(default_factory=PrepareConfig)

    def sweep_at(self, fraction: float) -> dict:
        """The grid the fine-tunes of one label fraction sweep: its `fraction_sweep`, else `sweep`."""
        return self.fraction_sweep.get(fraction, self.sweep)


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


def valid_keys(cls=Config, prefix: str = "") -> list[str]:
    """All dotted keys of the schema, for error messages and --help."""
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            keys += valid_keys(f.default_factory, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def flatten(d: dict, prefix: str = "") -> dict:
    """{'optim': {'lr': v}} and {'optim.lr': v} -> {'optim.lr': v}."""
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def to_dict(cfg: Config) -> dict:
    """Plain data (tuples as lists) for config.yaml and metrics.json."""
    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(dataclasses.asdict(cfg))
