"""What a built config may be: `validate` checks every value that can be checked without touching
data or devices (a run refuses a bad one before any work starts), and `check_tool` checks a config
against the tool that runs it (another tool's objective is refused; a key its objective or a setting
never reads is named), with the tables it reads (`TOOL_DEFAULTS`, `TOOL_OBJECTIVES`, `UNREAD`,
`UNREAD_WITH`).
"""
from __future__ import annotations

import math

from mpp.config.schema import MAX_BITS, MAX_TOKENS, Config, ConfigError, choices, flatten, to_dict


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
    'WHAT never reads KEY=VALUE, ...' (`unread`)."""
    allowed = TOOL_OBJECTIVES.get(tool)
    if allowed and cfg.objective not in allowed:
        other = next(t for t, objectives in TOOL_OBJECTIVES.items() if cfg.objective in objectives)
        raise ConfigError(f"objective={cfg.objective}{f' (from {source})' if source else ''} is not what this tool "
                          f"trains ({' or '.join(allowed)}); run tools/{other}.py for it, or give this tool a config "
                          "of its own objective")
    now, default = flatten(to_dict(cfg)), flatten(to_dict(Config()))
    phrases = []
    for who, keys in unread(cfg, tool).items():
        given = [f"{k}={now[k]}" for k in keys if now[k] != default[k]]
        if given:
            phrases.append(f"{who} never reads {', '.join(given[:4])}{', ...' if len(given) > 4 else ''}")
    return phrases


def unread(cfg: Config, tool: str) -> dict[str, list[str]]:
    """The keys that `tool` running `cfg` never reads, by what leaves them unread ('objective=mpp',
    'this tool', 'optim.name=adamw'): the sections its objective never reads (UNREAD), then in the
    others the keys that a setting leaves unread (UNREAD_WITH)."""
    sections = UNREAD["probe" if tool == "linear_probe" else cfg.objective]
    now = flatten(to_dict(cfg))
    readers = {"this tool" if tool == "linear_probe" else f"objective={cfg.objective}":
               [k for k in sorted(now) if k.split(".")[0] in sections]}
    for (key, value), keys in UNREAD_WITH.items():
        if now[key] == value and key.split(".")[0] not in sections:
            readers[f"{key}={str(value).lower() if isinstance(value, bool) else value}"] = list(keys)
    return readers


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
    check(isinstance(d.shift, int) and 0 <= d.shift < img,  # a reflection reaches one image width at most
          f"config key 'data.shift' must be a whole number of pixels in 0..{img - 1} (below the {img}-pixel "
          f"images; CIFAR's is 4), got {d.shift!r}")
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
          "config keys finetune.drop_path, finetune.label_smoothing and supervised.label_smoothing must be in [0, 1), "
          f"got {f.drop_path}, {f.label_smoothing} and {cfg.supervised.label_smoothing}")
    check(f.pool_folds == 0 or 2 <= f.pool_folds <= 20,
          f"config key 'finetune.pool_folds' must be 0 (one split) or a number of folds in 2..20, got {f.pool_folds}")
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
