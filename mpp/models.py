"""The encoder: a timm VisionTransformer plus a [mask] embedding, presets by name, export to plain timm.

`MaskedEncoder.forward(x, corruption)` runs timm's own modules in timm's `forward_features` order,
with one step added: the MPP corruption (gather by `src`, then `mask_token` where `masked`) is
applied to the patch embeddings BEFORE the position embeddings are added, so a masked token
carries its position but no content. The clean encoder (`vit`, timm key names, no mask token)
is what `save_encoder` writes; `timm.create_model(name, checkpoint_path=".../encoder.safetensors",
**kwargs)` loads it.

The attention path (`attn`, a mode of mpp.runtime.ATTENTION) sets timm's per-module `fused_attn`
flag for the device of each batch. The math path runs its softmax in fp32, as CUDA autocast does:
CPU autocast would run it in bf16, which destabilised training (docs/benchmarks.md).
"""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed, trunc_normal_
from timm.layers.attention import Attention
from timm.models import checkpoint_seq
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from mpp.config import ConfigError
from mpp.fileio import atomic_path, file_sha256, write_atomic
from mpp.runtime import ATTENTION

# name -> (timm architecture, keyword arguments). The paper's sizes (B/L/H, its Table 1; Ti/S are DeiT's) and
# small-image presets (patch 4 or 8 at 32 px) for CIFAR-scale work on CPU.
PRESETS: dict[str, tuple[str, dict]] = {
    "vit_ti16": ("vit_tiny_patch16_224", dict()),
    "vit_s16": ("vit_small_patch16_224", dict()),
    "vit_s32": ("vit_small_patch32_224", dict()),
    "vit_b16": ("vit_base_patch16_224", dict()),
    "vit_b32": ("vit_base_patch32_224", dict()),
    "vit_l16": ("vit_large_patch16_224", dict()),
    "vit_l32": ("vit_large_patch32_224", dict()),
    "vit_h14": ("vit_huge_patch14_224", dict()),
    "vit_ti4_32": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=4)),
    "vit_s4_32": ("vit_small_patch16_224", dict(img_size=32, patch_size=4)),
    "vit_mini4_32": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4)),
    "vit_mini8_32": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, embed_dim=128, depth=6, num_heads=4)),
    "vit_micro4_32": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=2)),
}


def preset_geometry(preset: str, img_size: int = 0) -> tuple[int, int]:
    """(image size, patch size) of a preset, `img_size` 0 meaning the preset's own (no model built)."""
    name, kwargs = PRESETS[preset]
    patch = kwargs.get("patch_size") or int(re.search(r"patch(\d+)", name).group(1))
    return img_size or kwargs.get("img_size") or int(name.rsplit("_", 1)[1]), patch


def grid_fix(img_size: int, patch: int) -> str:
    """'' where `img_size` cuts into at least 2 x 2 whole patches of `patch` pixels; else the size to
    give instead, for the error that refuses it (the config's, an encoder's, a figure's)."""
    if img_size % patch == 0 and img_size // patch >= 2:
        return ""
    return f"a multiple of {patch} of at least {2 * patch} (e.g. {max(2, round(img_size / patch)) * patch})"


# pooled representations of the tokens, as timm's `VisionTransformer.pool` names them
POOLS = ("token", "avg")  # the [class] token, the mean of the patch tokens (in tie-break order)


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (B, N, ...), rows long (B, K) -> (B, K, ...) with out[b, k] = x[b, rows[b, k]]. The same as
    `torch.gather` along dim 1 but through `index_select` on (B * N) rows, whose backward
    (`index_add_`) is faster on CPU than gather's element-wise scatter_add."""
    B, N = x.shape[:2]
    flat = (rows + torch.arange(B, device=rows.device).unsqueeze(1) * N).flatten()
    return x.flatten(0, 1).index_select(0, flat).view(B, rows.shape[1], *x.shape[2:])


def _attend(a: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of module `a` for (B, H, Nq, hd) queries over (B, H, N, hd) keys and values: fused
    SDPA, or the math path with its softmax in fp32 (then back to the values' dtype)."""
    if a.fused_attn:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=a.attn_drop.p if a.training else 0.0)
    probs = ((q * a.scale) @ k.transpose(-2, -1)).softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    return a.attn_drop(probs) @ v


class _Attention(Attention):
    """timm's Attention with its math path through `_attend`; masks and gates go to timm's own."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False):
        if self.fused_attn or attn_mask is not None or is_causal or self.gate is not None:
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = _attend(self, self.q_norm(q), self.k_norm(k), v)
        return self.proj_drop(self.proj(self.norm(o.transpose(1, 2).reshape(B, N, self.attn_dim))))


def _block_rows(block: nn.Module, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """timm's pre-norm `Block.forward` evaluated only at token positions `rows` (B, K): keys and
    values come from all tokens, everything row-wise (queries, attention output, projection,
    residual, MLP) only for the K rows. Other block types run whole and are then gathered."""
    a = getattr(block, "attn", None)
    if type(block) is not Block or type(a) is not _Attention or a.gate is not None:
        return take_rows(block(x), rows)
    B, N, C = x.shape
    K = rows.shape[1]
    qkv = a.qkv(block.norm1(x))  # (B, N, 3 * attn_dim): queries only at the rows
    q = take_rows(qkv[..., :a.attn_dim], rows).reshape(B, K, a.num_heads, a.head_dim).transpose(1, 2)
    k, v = qkv[..., a.attn_dim:].reshape(B, N, 2, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    o = _attend(a, a.q_norm(q), a.k_norm(k), v)
    o = a.proj_drop(a.proj(a.norm(o.transpose(1, 2).reshape(B, K, a.attn_dim))))
    x = take_rows(x, rows) + block.drop_path1(block.ls1(o))
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


class MaskedEncoder(nn.Module):
    """timm ViT ([class] token, learned 1-D position embeddings, pre-norm) + a [mask] embedding."""

    def __init__(self, name: str, kwargs: dict, drop_path: float = 0.0, attn: str = "auto"):
        super().__init__()
        if attn not in ATTENTION:
            raise ValueError(f"attn={attn!r}; choose one of {', '.join(ATTENTION)}")
        self.spec = {"name": name, "kwargs": {**kwargs, "num_classes": 0}}
        self.vit = timm.create_model(name, pretrained=False, drop_path_rate=drop_path, **self.spec["kwargs"])
        if not isinstance(self.vit, VisionTransformer):
            raise ConfigError(f"{name} is a {type(self.vit).__name__}, not a timm VisionTransformer; mpp's encoders "
                              "are ViTs (a preset of mpp.models.PRESETS, or a timm VisionTransformer such as "
                              "vit_base_patch16_224)")
        if self.vit.cls_token is None or self.vit.pos_embed is None or self.vit.no_embed_class:
            raise ValueError(f"{name} {kwargs}: the encoder needs a [class] token and position embeddings "
                             "that include it (timm defaults: class_token=True, no_embed_class=False)")
        # trunc-normal like BERT/BEiT rather than zeros: a zero mask embedding would equal the
        # embedding of a patch whose projection is zero (e.g. a mid-grey patch with zero bias).
        self.mask_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        trunc_normal_(self.mask_token, std=0.02)
        self.attn = attn
        self._attn_modules = [m for m in self.vit.modules() if isinstance(m, Attention)]
        for m in self._attn_modules:
            if type(m) is Attention:
                m.__class__ = _Attention  # same parameters and keys; only the math path differs
        self._set_fused(ATTENTION[attn]("cpu"))

    @property
    def embed_dim(self) -> int:
        return self.vit.embed_dim

    @property
    def patch_size(self) -> int:
        return self.vit.patch_embed.patch_size[0]

    @property
    def num_patches(self) -> int:
        return self.vit.patch_embed.num_patches

    @property
    def grid_size(self) -> tuple[int, int]:
        return tuple(self.vit.patch_embed.grid_size)

    def _set_fused(self, fused: bool) -> None:
        for m in self._attn_modules:
            m.fused_attn = fused

    def choose_attention(self, device_type: str) -> None:
        """Apply the attention rule (`attn`) for a device type: every eager forward does it for its
        batch, and `mpp.compiled.compile_task` before the first trace (a compiled step keeps the
        path it was traced with; an eager forward that changed it would make it recompile)."""
        self._set_fused(ATTENTION[self.attn](device_type))

    def _choose_attention(self, x: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():
            self.choose_attention(x.device.type)

    def pool(self, tokens: torch.Tensor, pool: str) -> torch.Tensor:
        """Tokens (B, 1 + N, D) -> (B, D): one of POOLS, through timm's `VisionTransformer.pool`."""
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
        return self.vit.pool(tokens, pool_type=pool)

    def forward(self, x: torch.Tensor, corruption=None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised images (B, 3, H, W) -> tokens (B, 1 + N, D) after the final norm; with `rows`
        (long (B, K), token positions, 0 the [class] token) only those K tokens (B, K, D): the last
        block then computes queries, projection, MLP and the final norm for them alone (exact: every
        other output of the last block is discarded anyway), keys and values for all tokens. timm's
        `vit.set_grad_checkpointing()` is honoured: the blocks (with `rows`, all but the last)
        recompute their activations in backward instead of keeping them."""
        v = self.vit
        x = v.patch_embed(x)
        if corruption is not None:
            x = take_rows(x, corruption.src)
            x = torch.where(corruption.masked.unsqueeze(-1), self.mask_token.to(x.dtype), x)
        x = v.norm_pre(v.patch_drop(v._pos_embed(x)))
        self._choose_attention(x)
        if rows is None:
            x = checkpoint_seq(v.blocks, x) if v.grad_checkpointing else v.blocks(x)
            return v.norm(x)
        first = v.blocks[:-1]
        x = checkpoint_seq(first, x) if v.grad_checkpointing else first(x)
        return v.norm(_block_rows(v.blocks[-1], x, rows))

    def no_weight_decay(self) -> set[str]:
        """Position embeddings and special tokens; the optimiser factory also skips 1-D params."""
        names = {n for n, _ in self.named_parameters()}
        return {"mask_token"} | ({f"vit.{n}" for n in self.vit.no_weight_decay()} & names)

    def model_spec(self) -> dict:
        """{"name", "kwargs"} such that `timm.create_model(name, **kwargs)` builds the clean encoder."""
        return json.loads(json.dumps(self.spec))

    def encoder_state_dict(self) -> dict[str, torch.Tensor]:
        """The clean encoder's weights under timm key names (no mask token)."""
        return self.vit.state_dict()


def create_encoder(preset: str, img_size: int = 0, drop_path: float = 0.0, attn: str = "auto") -> MaskedEncoder:
    """A fresh encoder from a preset name; `img_size` 0 keeps the preset's resolution."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    name, kwargs = PRESETS[preset]
    kwargs = dict(kwargs)
    if img_size:
        kwargs["img_size"] = img_size
    kwargs.setdefault("img_size", _default_img_size(name))
    return MaskedEncoder(name, kwargs, drop_path=drop_path, attn=attn)


def encoder_from(source, key: str, cfg, drop_path: float = 0.0) -> MaskedEncoder:
    """The encoder config key `key` names (`source`): `none` a fresh `cfg.model` (the from-scratch
    baseline, seeded by the caller), else a pre-training run directory or an encoder.safetensors
    with its model.json, refused if trained on inputs normalised otherwise than `cfg.data`."""
    if str(source) == "none":
        return create_encoder(cfg.model, img_size=cfg.img_size, drop_path=drop_path, attn=cfg.train.attn)
    if not Path(source).exists():
        raise ConfigError(f"{key}={str(source)!r} does not exist; give a pre-training run directory, its "
                          "encoder.safetensors (with model.json beside it), or none (a randomly initialised model)")
    if held := unfinished_run(source):
        raise ConfigError(f"{key}={str(source)!r} is {_unfinished(held)}")
    return load_encoder(source, img_size=cfg.img_size, drop_path=drop_path, attn=cfg.train.attn, data=cfg.data)


def unfinished_run(path: str | Path) -> str:
    """What a run directory `path` holds when its training has not finished (its newest checkpoint,
    or its config.yaml: no encoder.safetensors, no metrics.json yet); "" for anything else."""
    from mpp.checkpoint import list_checkpoints  # it imports this module
    from mpp.rundir import RUN_FILES  # what a finished run leaves (it imports mpp.checkpoint)
    path = Path(path)
    if not path.is_dir() or any((path / name).exists() for name in RUN_FILES):
        return ""
    if ckpts := list_checkpoints(path / "checkpoints"):
        return f"checkpoints/{ckpts[-1].name}"
    return "config.yaml, no checkpoint" if (path / "config.yaml").is_file() else ""


def _unfinished(held: str) -> str:
    """What to say of a run directory whose training has not finished, holding `held` (`unfinished_run`)."""
    return (f"a run directory without an exported encoder ({held}, no encoder.safetensors): its pre-training "
            "has not finished; run its pretrain command again to resume it, or give a finished run")


def trained_img_size(path: str | Path) -> int:
    """The resolution the encoder of `path` (a run dir or its encoder.safetensors) was exported at:
    its model.json's img_size, else its timm name's (0 when neither says)."""
    name, kwargs, _ = read_model_json(encoder_file(path).parent / "model.json")
    size = kwargs.get("img_size") or _default_img_size(name)
    return int(size[-1] if isinstance(size, (list, tuple)) else size)


def _default_img_size(name: str) -> int:
    """The resolution of timm model `name` (its pretrained config's input size; 0 when it has none)."""
    return getattr(timm.models.get_pretrained_cfg(name), "input_size", [0])[-1]


def save_encoder(encoder: MaskedEncoder, out_dir: str | Path, data=None) -> Path:
    """Write `encoder.safetensors` (timm keys) and `model.json` ({"name", "kwargs"}, and with `data`,
    the run's DataConfig, the input normalisation it trained on: "mean", "std") to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: t.detach().to("cpu", torch.float32).contiguous() for k, t in encoder.encoder_state_dict().items()}
    with atomic_path(out / "encoder.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    norm = _normalisation(data) if data is not None else {}
    write_atomic(out / "model.json", json.dumps({**encoder.model_spec(), **norm}, indent=2) + "\n")
    return out / "encoder.safetensors"


def _normalisation(data) -> dict:
    """A DataConfig's input normalisation as model.json records it."""
    return {"mean": [float(v) for v in data.mean], "std": [float(v) for v in data.std]}


def _check_normalisation(weights: Path, norm: dict, data) -> None:
    """Stop when `norm` (model.json's "mean" and "std"; {} from an older export) is not `data`'s."""
    ours = _normalisation(data)
    if norm and norm != ours:
        def spell(n: dict) -> str:  # as overrides: data.mean=[0.5,0.5,0.5] ...
            return " ".join(f"data.{k}=[{','.join(map(repr, n[k]))}]" for k in ("mean", "std"))
        raise ConfigError(f"encoder {weights} was trained on inputs normalised with {spell(norm)}, but this run "
                          f"normalises with {spell(ours)}; set {spell(norm)} (the encoder's)")


def mismatched(module: nn.Module | dict, shapes: dict) -> list[str]:
    """The tensors of `module` (or of a name -> tensor mapping) missing from `shapes` (name -> shape,
    as saved weights hold them), those extra there and those of another shape: why the weights do
    not load into it."""
    want = module.state_dict() if isinstance(module, nn.Module) else module
    return sorted(set(want) ^ set(shapes)) + [k for k in want if k in shapes and
                                              tuple(want[k].shape) != tuple(shapes[k])]


def nonfinite(state: dict) -> list[str]:
    """The names of the floating-point tensors of `state` that hold NaN or infinite values."""
    return [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]


def encoder_file(path: str | Path) -> Path:
    """The encoder.safetensors that `path` names: a run dir's, or `path` itself."""
    path = Path(path)
    return path / "encoder.safetensors" if path.is_dir() else path


def encoder_digest(path: str | Path) -> str | None:
    """sha256 of the encoder.safetensors of `path` (a run dir or the file; None for `none`, a random
    init): a probe or fine-tune records the encoder it started from, so that a comparison can tell
    a result of an encoder that has since been trained again."""
    return None if str(path) == "none" else file_sha256(encoder_file(path))


def read_model_json(spec_file: Path) -> tuple[str, dict, dict]:
    """The timm name, kwargs and recorded input normalisation ({"mean", "std"}; {} from an older
    export) of a model.json; a malformed one is a one-line ConfigError."""
    try:
        spec = json.loads(spec_file.read_text())
        name, kwargs = spec["name"], dict(spec["kwargs"])
        norm = {k: [float(x) for x in spec[k]] for k in ("mean", "std")} if {"mean", "std"} & set(spec) else {}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{spec_file} is not a model.json ({{\"name\", \"kwargs\"}}): "
                          f"{type(e).__name__}: {' '.join(str(e).split())[:100]}") from None
    # create_model's own options (pretrained, checkpoint_path, cache_dir, ...) load or fetch files:
    # untrusted input, which an exported model.json never holds; kwargs are the architecture's alone
    loaders = sorted(set(kwargs) & (set(inspect.signature(timm.create_model).parameters) - {"kwargs"}))
    if loaders:
        raise ConfigError(f"{spec_file} sets {', '.join(loaders)}, which would make timm load or fetch other files; "
                          "an exported model.json has only the architecture's kwargs: remove them")
    return name, kwargs, norm


def load_encoder(path: str | Path, img_size: int = 0, drop_path: float = 0.0, attn: str = "auto",
                 data=None) -> MaskedEncoder:
    """An encoder from a run dir or an `encoder.safetensors` next to its `model.json` (safetensors only).

    With `img_size` different from the saved one (same patch size), the position embeddings are
    resampled with timm's `resample_abs_pos_embed`. The mask token is freshly initialised. With
    `data` (the DataConfig of the run that will feed it), an encoder whose model.json records
    another input normalisation is refused before anything is built: it would see inputs it never
    saw (a model.json of an older export, which records none, is trusted).
    """
    weights = encoder_file(path)
    spec_file = weights.parent / "model.json"
    if not weights.is_file() or weights.suffix != ".safetensors" or not spec_file.is_file():
        if held := unfinished_run(path):
            raise FileNotFoundError(f"{path}: {_unfinished(held)}")
        raise FileNotFoundError(f"{path}: need a run dir or an encoder.safetensors file with model.json beside it")
    name, kwargs, norm = read_model_json(spec_file)
    if not isinstance(name, str) or not timm.is_model(name):
        raise ConfigError(f"{spec_file} names {name!r}, which is not a timm model; give the model.json its "
                          "encoder was exported with")
    if data is not None:
        _check_normalisation(weights, norm, data)
    try:  # safetensors only: a pickle or a truncated file is refused by the header check, never unpickled
        with safe_open(str(weights), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:
        raise ConfigError(f"{weights} is not a readable safetensors file ({' '.join(str(e).split())[:80]}); "
                          "export it again") from None
    # built first on the meta device (no memory): a model.json timm cannot build, or one of other
    # shapes than its weights (a small file asking for a huge model), stops here
    try:
        with torch.device("meta"):
            meta = MaskedEncoder(name, kwargs, attn=attn)
            odd = mismatched(meta.vit, shapes)
    except ConfigError as e:  # built, but no ViT
        raise ConfigError(f"{spec_file}: {e}") from None
    except Exception as e:  # timm's own errors on odd kwargs: TypeError, AttributeError, ZeroDivisionError, ...
        raise _unbuildable(spec_file, name, kwargs, e) from None
    if meta.grid_size[0] != meta.grid_size[1]:  # every loader here reads square images
        raise ConfigError(f"{spec_file}: a grid of {meta.grid_size[0]}x{meta.grid_size[1]} patches; mpp reads square "
                          "images: give a square img_size")
    if odd:
        raise _unmatched(weights, name, kwargs, odd)
    if img_size:
        if fix := grid_fix(img_size, meta.patch_size):  # as built: model.json may leave it to the timm name
            raise ConfigError(f"img_size={img_size} does not suit the encoder of {spec_file}: its patch size is "
                              f"{meta.patch_size}; give {fix}")
        kwargs["img_size"] = img_size
    try:
        encoder = MaskedEncoder(name, kwargs, drop_path=drop_path, attn=attn)
    except Exception as e:  # at another img_size
        raise _unbuildable(spec_file, name, kwargs, e) from None
    state = load_file(str(weights))
    if bad := nonfinite(state):  # every figure read from it would be NaN or chance, and a probe's solver fails deep inside
        raise ConfigError(f"{weights}: {len(bad)} of its {len(state)} tensors hold NaN or infinite weights (e.g. "
                          f"{bad[0]}): a diverged encoder; give a finite one (a run exports only finite weights)")
    try:
        pos = state.get("pos_embed")
        if pos is not None and pos.shape != encoder.vit.pos_embed.shape:
            state["pos_embed"] = resample_abs_pos_embed(
                pos, new_size=list(encoder.grid_size), old_size=list(meta.grid_size),  # as saved, 224 or not
                num_prefix_tokens=encoder.vit.num_prefix_tokens)
        encoder.vit.load_state_dict(state)
    except (RuntimeError, ValueError, TypeError):
        raise _unmatched(weights, name, kwargs, mismatched(encoder.vit, {k: v.shape for k, v in state.items()})) from None
    return encoder


def _unbuildable(spec_file: Path, name: str, kwargs: dict, e: Exception) -> ConfigError:
    return ConfigError(f"{spec_file}: timm cannot build {name} with {kwargs}: "
                       f"{type(e).__name__}: {' '.join(str(e).split())[:100]}")


def _unmatched(weights: Path, name: str, kwargs: dict, odd: list) -> ConfigError:
    return ConfigError(f"{weights}: weights do not match {name} {kwargs} ({len(odd)} tensors missing, extra or "
                       f"of another shape, e.g. {odd[0] if odd else '?'}); give the model.json it was exported with")
