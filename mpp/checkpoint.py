"""Training checkpoints: written atomically, rotated, and found again by `resume=auto`.

`OUTPUT_DIR/checkpoints/step_NNNNNNN/` holds
  model.safetensors  the whole trained module (encoder and head), safetensors
  state.pt           optimizer and grad-scaler state, step, data position, counters, and the
                     scheduler's state for inspection: the learning rate is a function of the
                     step and the config, so resuming rebuilds the schedule from the (possibly
                     changed, e.g. longer) config and positions it at the step
  rng_R.pt           RNG states of rank R (python, numpy, torch CPU and CUDA; the MPP corruption
                     and drop path draw from torch's default generators)
  digests.json       the sha256 of each file above: neither safetensors nor torch's zip reader
                     checks its bytes, and a flipped bit would resume as other weights
The `.pt` files hold only tensors and plain Python values and are read with
`torch.load(weights_only=True)`, so loading a checkpoint never unpickles code; one whose files
do not match their digests, or whose weights or optimiser moments are not finite, is damaged. A directory gets its
`step_*` name by one rename after everything in it was written, so every `step_*` directory is
complete; a kill leaves at most a `.tmp_*` directory, removed by the next save (or warned of).
The output directory must be visible to all ranks (a shared file system on several nodes). (Accelerate's
`save_state` is not used: it writes in place, not atomically, and its RNG and custom-object files
need full unpickling to load.)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import random
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import gather_object
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from mpp.config import ConfigError
from mpp.fileio import atomic_path, file_sha256, fsync, write_atomic
from mpp.models import mismatched, nonfinite
from mpp.runtime import together

log = logging.getLogger(__name__)
PREFIX = "step_"
DIGESTS = "digests.json"  # file name -> sha256 of every other file of the checkpoint
# what a resumed run reads from state.pt, and its types (a checkpoint is untrusted input)
STATE_KEYS = {"step": int, "world_size": int, "nonfinite_steps": int, "elapsed": (int, float),
              "train_time": (int, float), "data_wait": (int, float), "last": dict}
# ... and those a checkpoint of an older version may lack
OPTIONAL_KEYS = {"bad_run": int, "overflow_run": int, "scaler_skips": int, "skipped": dict, "begun": dict,
                 "origin": dict, "images": int}


def _plain(x) -> bool:
    """Only what JSON holds (dicts with string keys, lists, numbers, strings): the figures a resumed
    run copies into its metrics and compares its inputs with."""
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(_plain(v) for v in x)
    return x is None or isinstance(x, (bool, int, float, str))


def _misstated(state: dict) -> list[str]:
    """The keys of a loaded state.pt that are missing, of the wrong type or out of range."""
    def fits(v, kind) -> bool:
        return isinstance(v, kind) and not isinstance(v, bool)
    bad = [k for k, kind in STATE_KEYS.items() if not fits(state.get(k), kind)]
    bad += [k for k, kind in OPTIONAL_KEYS.items() if k in state and not fits(state[k], kind)]
    bad += [k for k in ("last", "skipped", "begun", "origin") if k not in bad and k in state and not _plain(state[k])]
    bad += [k for k in ("step", "bad_run", "overflow_run", "scaler_skips", "images")
            if k not in bad and state.get(k, 0) < 0]
    if "world_size" not in bad and state["world_size"] < 1:  # else refused as another run's (ConfigError), no fallback
        bad.append("world_size")
    if "skipped" not in bad and not all(fits(n, int) and n >= 0 for n in state.get("skipped", {}).values()):
        bad.append("skipped")
    if "last" not in bad and not all(fits(v, (int, float)) for v in state["last"].values()):
        bad.append("last")  # the last log window's figures, which the finished run prints as numbers
    if not _sound_scaler(state.get("scaler", ())):
        bad.append("scaler")
    return bad


def _sound_scaler(s) -> bool:
    """A GradScaler's state (None: no scaler; {}: a disabled one) that fp16 training can go on
    from: a NaN or zero scale makes every step an overflow, and it never recovers."""
    def number(v, low: float, high: float = math.inf, kind=(int, float)) -> bool:
        return isinstance(v, kind) and not isinstance(v, bool) and low < v < high
    if s is None or s == {}:
        return True
    return (isinstance(s, dict) and set(s) == {"scale", "growth_factor", "backoff_factor", "growth_interval",
                                               "_growth_tracker"}
            and number(s["scale"], 0) and number(s["growth_factor"], 1) and number(s["backoff_factor"], 0, 1)
            and number(s["growth_interval"], 0, kind=int) and number(s["_growth_tracker"], -1, kind=int))


def rng_state() -> dict:
    """Every RNG this process draws from, as tensors and plain values."""
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = torch.from_numpy(np_state["state"]["key"].astype(np.int64))
    return {
        "python": random.getstate(),
        "numpy": np_state,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    np_state["state"]["key"] = np_state["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    cuda, gpus = state["cuda"], torch.cuda.device_count()
    if cuda and len(cuda) == gpus:
        torch.cuda.set_rng_state_all(cuda)
    elif gpus:  # none saved (CUDA unused then), or another node shape (torch would index past this node's
        # GPUs): seeded from this rank's restored CPU RNG, as every rank left at the run's seed would draw
        # the same corruption
        torch.cuda.manual_seed_all(int.from_bytes(hashlib.sha256(state["torch"].numpy().tobytes()).digest()[:8],
                                                  "little"))
    if cuda and len(cuda) != gpus:
        log.warning("warning: the checkpoint holds the CUDA RNG states of %d GPUs and this process sees %d: %s (a "
                    "run resumed on other hardware is not bit-exact anyway)", len(cuda), gpus,
                    "the CUDA RNG goes on from a seed of this rank's" if gpus else "they are not used")


def checkpoint_name(step: int) -> str:
    """The folder name of checkpoint `step` (`list_checkpoints` sorts them by step)."""
    return f"{PREFIX}{step:07d}"


def checkpoint_order(name: str) -> tuple[int, str]:
    """The sort key of a checkpoint folder's name, oldest first: by length, then name (zero-padded
    to 7 digits, past step 9,999,999 the names grow a digit, and 'step_10000000' < 'step_9999999'
    as text). Every comparison of checkpoints goes through it."""
    return len(name), name


def is_checkpoint(path: Path) -> bool:
    """A checkpoint folder: a directory named as `checkpoint_name` names one; a user's copy such
    as `step_0000004.bak` is not one (it would sort as the newest and be resumed from)."""
    step = path.name[len(PREFIX):]
    return path.is_dir() and step.isascii() and step.isdigit() and path.name == checkpoint_name(int(step))


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (`is_checkpoint`: a `step_*` file is not one)."""
    root = Path(root)
    return sorted((p for p in root.glob(PREFIX + "*") if is_checkpoint(p)), key=lambda p: checkpoint_order(p.name)) \
        if root.is_dir() else []


def save_checkpoint(accelerator, root: str | Path, step: int, model: torch.nn.Module,
                    optimizer, scheduler, state: dict, keep: int = 2, superseded: list[Path] = ()) -> Path:
    """Write checkpoint `step` under `root` (all ranks call this) and keep the newest `keep`.

    `model` is the unwrapped module; `state` holds plain values (step, data position, counters).
    `superseded`: checkpoints a resume skipped as damaged; each older than `step` is removed first,
    so that it takes no place of the `keep`."""
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp_{checkpoint_name(step)}"

    def begin() -> None:
        sweep_unfinished(root)
        first = not root.is_dir()
        tmp.mkdir(parents=True)
        if first:  # the checkpoints folder's own entry on the disk too, or a power cut loses every checkpoint in it
            fsync(root.parent)
    what = f"save checkpoint {final.name}"  # the other ranks' line where one rank's step fails
    together(accelerator, begin, what)
    mine = []

    def write_rng() -> None:
        rng = tmp / f"rng_{accelerator.process_index}.pt"
        with atomic_path(rng) as f:
            torch.save(rng_state(), f)
        mine.append((rng.name, file_sha256(rng)))
    together(accelerator, write_rng, what, everyone=True)
    digests = gather_object(mine)  # every rank's, with the rest below

    def write() -> None:
        with atomic_path(tmp / "model.safetensors") as f:
            save_model(model, str(f))
        scaler = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
        with atomic_path(tmp / "state.pt") as f:
            torch.save({**state, "step": step, "world_size": accelerator.num_processes,
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "scaler": scaler}, f)
        named = digests + [(name, file_sha256(tmp / name)) for name in ("model.safetensors", "state.pt")]
        write_atomic(tmp / DIGESTS, json.dumps(dict(sorted(named)), indent=1) + "\n")
    together(accelerator, write, what)

    def publish() -> None:
        gone = None
        if final.is_dir():  # the same step saved before (a finished run saved again): replace it, moved
            gone = final.with_name(f".tmp_removed_{final.name}")  # aside first, so that a kill while it is
            final.rename(gone)  # deleted leaves no half checkpoint under a checkpoint's name
        elif final.exists():  # a stray file of a checkpoint's name
            final.unlink()
        tmp.rename(final)
        fsync(root)  # the rename on the disk, not only its files
        if gone is not None:
            shutil.rmtree(gone, ignore_errors=True)  # what is left, sweep_unfinished removes (or warns of)
        # the newest `keep` up to this step; later ones (ones resume=auto skipped as damaged) are
        # neither counted nor removed, so they never push out the checkpoint just written
        newest = checkpoint_order(final.name)
        for old in superseded:
            if checkpoint_order(old.name) < newest and is_checkpoint(old):
                _prune(old)
        for old in [c for c in list_checkpoints(root) if checkpoint_order(c.name) <= newest][:-keep]:
            _prune(old)
    together(accelerator, publish, what)
    return final


def sweep_unfinished(root: str | Path) -> None:
    """Remove what a kill left of a checkpoint's save or removal (`.tmp_*` folders, each as large as
    a checkpoint and never one to resume from): at every save, and when a run starts (one resumed
    when finished saves nothing). One that cannot be removed is warned of, never resumed from, and
    renamed aside (`.tmp_stale_*`, swept again at the next save) so that a save of its step can
    take its name."""
    for stale in Path(root).glob(".tmp_*"):
        try:
            shutil.rmtree(stale)
        except OSError as e:
            log.warning("warning: could not remove %s, what a cut-off save or removal left (%s: %s): delete it "
                        "by hand to free its space", stale, type(e).__name__, e)
            if stale.exists() and not stale.name.startswith(".tmp_stale_"):
                with contextlib.suppress(OSError):  # else the save of that step fails on its name, saying so
                    stale.rename(stale.with_name(f".tmp_stale_{uuid.uuid4().hex[:8]}_{stale.name[len('.tmp_'):]}"))


def _prune(checkpoint: Path) -> None:
    """Delete an older checkpoint once the new one is in place: renamed out of the checkpoints'
    names first, so that one cut off while it is deleted is no half checkpoint to resume from
    (`sweep_unfinished` removes the rest). A failure (a permission, a file held open on a network
    mount) is warned of, not raised: the new checkpoint is saved and the run can go on, where
    raising would stop it (and leave the other ranks waiting for this one)."""
    gone = checkpoint.with_name(f".tmp_removed_{checkpoint.name}")
    try:
        checkpoint.rename(gone)
        shutil.rmtree(gone)
    except OSError as e:
        log.warning("warning: could not remove the older checkpoint %s (%s: %s); the new one is saved and the run "
                    "goes on: delete it by hand to free its space", checkpoint if checkpoint.exists() else gone,
                    type(e).__name__, e)


def _check_optimizer_state(optimizer, saved) -> None:
    """Refuse (ValueError) a saved optimiser state whose per-parameter tensors do not have their
    parameter's shape (a scalar `step` aside): torch does not check, and the fused kernels index
    them by the parameter's size, reading and writing past a smaller tensor's end. torch gives
    `state[k]` to the parameter at the position of id k in the groups' lists, so those lists must
    number the parameters 0..n-1 in order (as `state_dict` writes them) for `state[i]` to be the
    state of parameter i."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    per_param = saved.get("state") if isinstance(saved, dict) else None
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(per_param, dict) or not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise ValueError("state.pt's optimizer state is malformed")
    if [i for g in groups for i in g["params"]] != list(range(len(params))):
        raise ValueError(f"state.pt's optimizer groups do not number its {len(params)} parameters 0..{len(params) - 1} "
                         "in order")
    for i, st in per_param.items():
        if not isinstance(i, int) or not 0 <= i < len(params) or not isinstance(st, dict):
            raise ValueError(f"state.pt's optimizer state names parameter {i!r} of {len(params)}")
        for k, v in st.items():  # torch's own optimisers keep only tensors there: a list crashed the first step
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                raise ValueError(f"state.pt's optimizer state {k} of parameter {i} is a {type(v).__name__}"
                                 f"{f' of {v.dtype}' if isinstance(v, torch.Tensor) else ''}, not a float tensor")
            if v.numel() != 1 if k == "step" else v.shape != params[i].shape:
                raise ValueError(f"state.pt's optimizer state {k} of parameter {i} has shape {tuple(v.shape)}, "
                                 f"its parameter {tuple(params[i].shape)}")
            if not torch.isfinite(v).all():  # the steps would go on NaN, each one skipped
                raise ValueError(f"state.pt's optimizer state {k} of parameter {i} is not finite")


def _check_same_optimizer(path: Path, optimizer, saved: dict) -> None:
    """A checkpoint of another optimiser (optim.name) or parameter grouping (optim.layer_decay) is
    sound but cannot continue this run: a ConfigError, not a damaged checkpoint to skip."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return  # malformed: `_check_optimizer_state` refuses it as damaged
    def kinds(gs: list[dict]) -> list[list[str]]:  # Adam-like or SGD-like, group by group
        return [sorted({"betas", "momentum"} & set(g)) for g in gs]
    if (then := kinds(groups)) != (kind := kinds(optimizer.param_groups)):
        raise ConfigError(f"checkpoint '{path}' holds the state of another optimiser or parameter grouping ("
                          f"{len(then)} groups, this run's {len(kind)}: optim.name, optim.layer_decay, or "
                          "optim.weight_decay between 0 and above it changed); "
                          f"resume with the optim settings it was trained with ({path.parent.parent / 'config.yaml'}), "
                          "or start this run afresh in an output_dir of its own")


def _read_digests(path: Path) -> dict | None:
    """The digests checkpoint `path` recorded; None for a checkpoint from before they were (read unchecked)."""
    if not (path / DIGESTS).is_file():
        return None
    recorded = json.loads((path / DIGESTS).read_text())
    if not isinstance(recorded, dict):
        raise ValueError(f"{DIGESTS} is not a mapping of file names to sha256 digests")
    return recorded


def _check_digests(path: Path, recorded: dict | None, names: tuple[str, ...]) -> None:
    """Refuse (ValueError: damaged) files of checkpoint `path` whose bytes are not those it wrote."""
    if recorded is None:  # a checkpoint from before digests were recorded
        return
    for name in names:
        if name not in recorded:
            raise ValueError(f"{DIGESTS} records no digest of {name}")
        if file_sha256(path / name) != recorded[name]:
            raise ValueError(f"{name} is not the file the checkpoint wrote (its sha256 differs from {DIGESTS}'s)")


def load_checkpoint(accelerator, path: str | Path, model: torch.nn.Module, optimizer) -> dict:
    """Restore a checkpoint written by `save_checkpoint` into `model` (unwrapped), optimizer,
    grad scaler and this rank's RNGs; returns the saved plain state (step, ...). Weights of other
    tensors (another model or objective) are a ConfigError naming the checkpoint and its config:
    resume=auto would find no better one in that run, whose checkpoints are sound."""
    path = Path(path)
    recorded = _read_digests(path)
    _check_digests(path, recorded, ("state.pt",))
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    if bad := _misstated(state):  # untrusted: a damaged or crafted state is refused like a corrupt file
        raise ValueError(f"state.pt lacks, mistypes or misstates {', '.join(bad)}")
    if state["world_size"] != accelerator.num_processes:  # said alike on every rank, before any rank's own file
        raise ConfigError(f"checkpoint '{path}' was written by {state['world_size']} processes, this run has "
                         f"{accelerator.num_processes}; resume with the same number of processes (the data "
                         "split and per-rank RNG depend on it) or start afresh in another output_dir")
    _check_digests(path, recorded, ("model.safetensors", f"rng_{accelerator.process_index}.pt"))
    try:
        load_model(model, str(path / "model.safetensors"))  # copied into the parameters on their device
    except RuntimeError:  # the file read, its tensors do not fit
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            odd = mismatched(model, {k: f.get_slice(k).get_shape() for k in f.keys()})
        if not odd:
            raise
        raise ConfigError(f"checkpoint '{path}' is of another model or objective than this run ({len(odd)} tensors "
                          f"missing, extra or of another shape, e.g. {odd[0]}); resume it with the settings it was "
                          f"trained with ({path.parent.parent / 'config.yaml'}), or start this run afresh "
                          "(train.resume=auto) in an output_dir of its own") from None
    if bad := nonfinite(model.state_dict()):  # every step from it would be skipped as non-finite
        raise ValueError(f"model.safetensors holds non-finite values ({', '.join(bad[:3])})")
    _check_same_optimizer(path, optimizer, state["optimizer"])
    _check_optimizer_state(optimizer, state["optimizer"])
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(state.pop("optimizer"))
    for group, mine in zip(optimizer.param_groups, settings):  # this run's optim.* (a change is warned of)
        group.update(mine)
    scaler = state.pop("scaler", None)
    if accelerator.scaler is not None and scaler is not None:
        accelerator.scaler.load_state_dict(scaler)
    set_rng_state(torch.load(path / f"rng_{accelerator.process_index}.pt", weights_only=True))
    return state
