"""Training objectives on top of the encoder: MPP (masked patch prediction), supervised, classify.

A `Task` (from `build_task`) holds the encoder and the objective's head; `forward(images_uint8,
labels=None) -> (loss, metrics)` with metrics as tensors (nothing here forces a host sync): 0-d means
over the batch, or 1-d class counts, which the trainer sums over its log window and all ranks.
Inputs are normalised for the encoder inside the Task (mean/std from the data config). MPP
corrupts the patch embeddings (mpp.corruption), and its head predicts a target (mpp.targets) from
the true pixels in [0, 1] for the chosen tokens alone; the encoder's last block computes its
row-wise parts for them alone too (`MaskedEncoder.forward(rows=)`).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from mpp.config import ConfigError
from mpp.corruption import Corruption, sample_corruption
from mpp.data.transforms import normalize, to_float01
from mpp.models import POOLS, create_encoder, encoder_digest, encoder_from
from mpp.targets import HOG_BINS, HOG_CELLS, TARGETS, exact, patches

def _linear(dim_in: int, dim_out: int, zero: bool = False) -> nn.Linear:
    """A head layer: zeros (fine-tuning head, as the paper) or timm's trunc-normal(.02) init."""
    layer = nn.Linear(dim_in, dim_out)
    if zero:
        nn.init.zeros_(layer.weight)
    else:
        trunc_normal_(layer.weight, std=0.02)
    nn.init.zeros_(layer.bias)
    return layer


def _class_counts(classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """How many of `classes` fall in each class, (num_classes,) float (bincount without a sync)."""
    flat = classes.reshape(-1)
    return torch.zeros(num_classes, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float))


class Task(nn.Module):
    """The encoder plus an objective; turns uint8 images into the encoder's normalised input.

    A Task class also says what its run needs, so the trainer asks it instead of testing the
    objective's name: `labeled` (whether forward needs labels), `encoder_for(cfg)` (the encoder it
    starts from), `origin(cfg)` (what it starts from beyond its settings, checked on resume),
    `subset(cfg)` (the training samples it reads), `begin(cfg, device, precision)` and `restore`
    (work and choices before the first step of a fresh run), `final_eval` (the evaluator of
    mpp.evaluators run on it at the end), `export(out)` and `settings(cfg)` (what it adds to the
    run directory and to metrics.json)."""
    labeled = False
    final_eval: str | None = None

    def __init__(self, encoder: nn.Module, data_cfg):
        super().__init__()
        self.encoder = encoder
        # data.mean and data.std on the model's device, as it moves: numbers copied to a GPU at every step
        # would wait there for all the work queued on it. Not in checkpoints, nor broadcast by DDP.
        self.register_buffer("norm_mean", torch.tensor(tuple(data_cfg.mean)), persistent=False)
        self.register_buffer("norm_std", torch.tensor(tuple(data_cfg.std)), persistent=False)
        self._ddp_params_and_buffers_to_ignore = ["norm_mean", "norm_std"]

    @classmethod
    def encoder_for(cls, cfg) -> nn.Module:
        """A fresh encoder of preset `cfg.model`."""
        return create_encoder(cfg.model, img_size=cfg.img_size, attn=cfg.train.attn)

    @classmethod
    def subset(cls, cfg) -> tuple | None:
        """The loader's `subset` of data.train (None: all of it)."""
        return None

    def begin(self, cfg, device: torch.device, precision: str) -> tuple[dict, bool] | None:
        """Work before the first step of a fresh run (not on resume), on the device, in the main
        process only. Returns None when it did nothing; else the figures to record in metrics.json
        (handed to every rank's `restore`, which takes up the choices among them) and whether it
        changed weights (then the trainer copies them to every rank and records the start's score)."""
        return None

    def restore(self, begun: dict) -> None:
        """Take up the choices `begin` recorded among its figures (on every rank, and again when
        the run resumes, where `begin` does not run; none)."""

    def export(self, out_dir: Path) -> None:
        """Files beyond the encoder that the finished run leaves in its directory (none)."""

    def settings(self, cfg) -> dict:
        """Settings recorded in metrics.json beside the figures (none)."""
        return {}

    def origin(self, cfg) -> dict:
        """What the run starts from beyond the settings a resume may change: recorded at the fresh
        start, and a resume from other inputs is refused (its checkpoints continue a run of the old
        ones). A pre-training's: the development splits withheld from its images, which a resume
        with others would have trained on before it withheld them, and its inputs' normalisation."""
        return {"withheld_splits": [list(w) for w in cfg.data.withhold], **normalisation(cfg)}

    def inputs(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 (B, 3, H, W) -> (pixels in [0, 1], normalised encoder input)."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be uint8 (B, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        images01 = to_float01(images)
        return images01, normalize(images01, self.norm_mean, self.norm_std)

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()}


class MPPTask(Task):
    """Masked patch prediction with one of TARGETS; a linear head on the chosen tokens. Exports
    its head and [mask] embedding (mpp_head.safetensors, for mpp.figures)."""

    def __init__(self, encoder: nn.Module, mpp_cfg, data_cfg):
        super().__init__(encoder, data_cfg)
        if mpp_cfg.target not in TARGETS:
            raise ValueError(f"mpp.target={mpp_cfg.target!r}; choose one of {', '.join(TARGETS)}")
        self.cfg, self.target = mpp_cfg, TARGETS[mpp_cfg.target]
        self.num_colors = 2 ** (3 * mpp_cfg.bits)
        self.head = _linear(encoder.embed_dim, self.target.outputs(mpp_cfg.bits, encoder.patch_size))

    @classmethod
    def from_config(cls, cfg, encoder: nn.Module, num_classes: int | None) -> MPPTask:
        return cls(encoder, cfg.mpp, cfg.data)

    def export(self, out_dir: Path) -> None:
        from mpp.figures.predictions import save_mpp_head  # only a finished MPP run pays for its import
        save_mpp_head(self, out_dir)

    def corrupt(self, batch: int, device: torch.device, generator: torch.Generator | None = None) -> Corruption:
        """Which patches of each image the head predicts and how each is corrupted (mpp.ratio, the
        80/10/10 split of mpp.mask / random / keep)."""
        c = self.cfg
        return sample_corruption(batch, self.encoder.num_patches, c.ratio, c.mask, c.random, c.keep,
                                 device=device, generator=generator)

    def predict(self, x: torch.Tensor, corruption: Corruption) -> torch.Tensor:
        """The head's outputs (B, K, out) for the chosen patches of normalised images `x`, in fp32:
        with bf16 logits the colour task learns less (docs/results.md)."""
        chosen = self.encoder(x, corruption, rows=corruption.index + self.encoder.vit.num_prefix_tokens)  # (B, K, D)
        with torch.autocast(x.device.type, enabled=False):
            return self.head(chosen.float())

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        images01, x = self.inputs(images)
        c, B = self.cfg, images.shape[0]
        corruption = self.corrupt(B, images.device)
        pred, index = self.predict(x, corruption), corruption.index
        with torch.autocast(images.device.type, enabled=False):  # the loss in fp32, as the head
            pix = patches(images01, self.encoder.patch_size)
            pix = exact(torch.gather(pix, 1, index.view(B, -1, 1, 1, 1).expand(-1, -1, *pix.shape[2:])))
            loss, guess, classes = self.target.loss(pred, pix, c.bits)
        with torch.no_grad():
            # baseline: the counts of the classes `acc` scores (hog's are its 36 bins, more than the colours at
            # mpp.bits=1); logged as the accuracy of always predicting the log window's most frequent one on all
            # ranks, which a micro-batch's own mode would overstate (the more so the smaller it is)
            metrics = {"loss": loss.detach(), "acc": (guess == classes).float().mean(),
                       "baseline": _class_counts(classes, max(self.num_colors, HOG_CELLS ** 2 * HOG_BINS))}
        return loss, metrics


class LabelTask(Task):
    """Classification from a pooled token (`pool`: token | avg, see mpp.models.POOLS). Nothing is
    corrupted, so the [mask] embedding is frozen (DDP needs every trained parameter used)."""
    labeled = True

    def __init__(self, encoder: nn.Module, data_cfg, head: nn.Module, pool: str, label_smoothing: float):
        super().__init__(encoder, data_cfg)
        if pool not in (*POOLS, "auto"):  # auto: chosen by `begin` before the first step
            raise ValueError(f"pool={pool!r}; choose one of {', '.join(POOLS)} or auto")
        self.head, self.pool, self.label_smoothing = head, pool, label_smoothing
        encoder.mask_token.requires_grad_(False)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float32 class logits (B, num_classes)."""
        return self.classify(self.inputs(images)[1])

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised images -> float32 class logits. The head runs in fp32 outside autocast: bf16
        logits tie often (docs/results.md), and a tie's winner is then the lowest class index, not
        the model's choice."""
        pooled = self.encoder.pool(self.encoder(x), self.pool)
        with torch.autocast(x.device.type, enabled=False):
            return self.head(pooled.float())

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        if labels is None:
            raise ValueError("this objective needs labels: use labeled shards (with 'cls') for data.train")
        logits = self.logits(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        with torch.no_grad():
            metrics = {"loss": loss.detach(), "acc": (logits.argmax(-1) == labels).float().mean()}
        return loss, metrics


class SupervisedTask(LabelTask):
    """Supervised pre-training: one tanh hidden layer on the [class] token, as the paper."""

    @classmethod
    def from_config(cls, cfg, encoder: nn.Module, num_classes: int) -> SupervisedTask:
        D = encoder.embed_dim
        hidden = cfg.supervised.hidden_dim or D
        head = nn.Sequential(_linear(D, hidden), nn.Tanh(), _linear(hidden, num_classes))
        return cls(encoder, cfg.data, head, "token", cfg.supervised.label_smoothing)


class ClassifyTask(LabelTask):
    """Fine-tuning: a linear head on an encoder loaded from `finetune.init` (or fresh), trained on a
    label fraction of data.train and evaluated at the end (top-1/5). The head starts at zero (the
    paper) or, with finetune.head_init=probe, at the encoder's linear probe on the same training
    labels (LP-FT, Kumar et al. 2022: fine-tuning then starts where the probe ends instead of
    first distorting the features to fit a blank head). finetune.pool=auto chooses the
    representation the way the linear probe does, but on this run's own labels only (a 10%-label
    fine-tune must not lean on a probe of all the labels): a probe of its training part, scored on
    its development split where it has one (which a comparison's pre-trainings never saw), else on
    a held-out part of its training labels, or with finetune.pool_folds on all its labels in folds
    (for an encoder that never trained on labels). The probe head's L2 is chosen on the same images."""
    final_eval = "classify"

    @classmethod
    def from_config(cls, cfg, encoder: nn.Module, num_classes: int) -> ClassifyTask:
        f = cfg.finetune
        return cls(encoder, cfg.data, _linear(encoder.embed_dim, num_classes, zero=True), f.pool, f.label_smoothing)

    def begin(self, cfg, device: torch.device, precision: str) -> tuple[dict, bool] | None:
        f = cfg.finetune
        if f.head_init != "probe" and f.pool != "auto":
            return None
        from mpp.evaluators.linear_probe import probe_head  # only a run that probes pays for its import
        dev = (*self.subset(cfg)[:3], True) if f.dev_fraction > 0 else None  # its development split
        fit = probe_head(self.encoder, cfg, pool=f.pool, subset=self.subset(cfg), num_classes=self.head.out_features,
                         device=device, precision=precision, dev_subset=dev)
        weight, bias, chosen = fit.pop("weight"), fit.pop("bias"), fit.pop("pool")
        choice = {"pool": chosen, **{k: fit.pop(k) for k in [k for k in fit if k.startswith("pool_")]}}
        figures = choice if f.pool == "auto" else {}
        if f.head_init == "probe":
            with torch.no_grad():
                self.head.weight.copy_(weight)
                self.head.bias.copy_(bias)
            figures.update({f"head_probe_{k}": v for k, v in fit.items()})  # its L2, its top-1 and loss where chosen
        return figures, f.head_init == "probe"

    def restore(self, begun: dict) -> None:
        if self.pool == "auto":
            if "pool" not in begun:
                raise ConfigError("finetune.pool=auto, but the checkpoint to resume was trained through the pool its "
                                  "run's config.yaml names (finetune.pool); resume with that, or start afresh in "
                                  "another output_dir")
            if begun["pool"] not in POOLS:  # a checkpoint is untrusted input
                raise ConfigError(f"the checkpoint to resume names pool {begun['pool']!r}, not one of "
                                  f"{', '.join(POOLS)}: it is damaged; start afresh in another output_dir")
            self.pool = begun["pool"]

    @classmethod
    def encoder_for(cls, cfg) -> nn.Module:
        return encoder_from(cfg.finetune.init, "finetune.init", cfg, drop_path=cfg.finetune.drop_path)

    @classmethod
    def subset(cls, cfg) -> tuple:
        f = cfg.finetune
        return f.label_fraction, f.split_seed, f.dev_fraction, False

    def settings(self, cfg) -> dict:
        f = cfg.finetune
        return dict(init=f.init, label_fraction=f.label_fraction, dev_fraction=f.dev_fraction,
                    split_seed=f.split_seed, seed=cfg.seed, pool=self.pool, optimizer=cfg.optim.name, lr=cfg.optim.lr,
                    head_init=f.head_init)

    def origin(self, cfg) -> dict:
        """The encoder file's digest (null from scratch), and the label subset and development split
        ([label_fraction, split_seed, dev_fraction]): a resume on another split would score on
        images it had trained on; and its inputs' normalisation."""
        f = cfg.finetune
        return {"init_sha256": encoder_digest(f.init), "label_split": [f.label_fraction, f.split_seed, f.dev_fraction],
                **normalisation(cfg)}


def normalisation(cfg) -> dict:
    """The statistics a run's inputs are normalised by (data.mean, data.std), part of every run's
    origin: weights trained on inputs of one scale would go on with another, and the encoder's
    model.json would record only the last."""
    return {"normalisation": [list(cfg.data.mean), list(cfg.data.std)]}


HEAD_INITS = ("zero", "probe")  # finetune.head_init: the paper's zero head | the linear probe's (LP-FT)


# objective -> its Task: config's `objective` choices come from this table
OBJECTIVES: dict[str, type[Task]] = {"mpp": MPPTask, "supervised": SupervisedTask, "classify": ClassifyTask}


def build_task(cfg, encoder: nn.Module, num_classes: int | None) -> Task:
    """The Task for `cfg.objective` around `encoder` (`num_classes`: of the labels, when it needs them)."""
    cls = OBJECTIVES[cfg.objective]
    if cls.labeled and (not num_classes or num_classes < 2):
        raise ValueError(f"objective '{cfg.objective}' needs labeled data with >= 2 classes, "
                         f"got num_classes={num_classes}")
    return cls.from_config(cfg, encoder, num_classes)
