"""Resume: which checkpoint a run continues from, and whether it may.

`resume` loads the newest checkpoint that loads on every rank (`train.resume=auto`) or the one
given, skipping and naming the damaged ones; a read error of the machine stops the run instead,
since skipping would train those steps again and remove the checkpoint. A resumed run must start
from the inputs its fresh start recorded (`check_origin`); settings changed since are named, and a
finished run is refused them (`check_changes`). mpp.train's `setup` calls them in that order.
"""
from __future__ import annotations

import errno
import json
import pickle
import sys
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from mpp import rundir
from mpp.checkpoint import checkpoint_name, checkpoint_order, list_checkpoints, load_checkpoint
from mpp.cli import out_of_memory
from mpp.config import Config, ConfigError, changed_settings, said


def resume(cfg: Config, accelerator: Accelerator, root: Path, task, optimizer) -> tuple[Path | None, dict, list]:
    """Load the checkpoint to continue from into `task` and `optimizer`: with resume=auto the newest
    in the main process's listing that loads on every rank (the others are skipped and named), a
    given directory, or none.
    Returns it, its saved state ({} when starting afresh) and the checkpoints that did not load."""
    if cfg.train.resume == "none":
        return None, {}, []
    if cfg.train.resume == "auto":  # the main process's listing for all: another node's may lag (NFS), and
        # ranks resuming from different steps would pair their gradients' all-reduces across steps
        order, skipped = broadcast_object_list([rundir.candidates(root)])[0]
    else:
        if not Path(cfg.train.resume, "state.pt").is_file():
            raise ConfigError(f"train.resume={cfg.train.resume!r} is not a checkpoint directory (no state.pt); give "
                              "OUTPUT_DIR/checkpoints/step_NNNNNNN, auto (the newest) or none")
        order, skipped = [Path(cfg.train.resume)], []
    damaged = []
    for path in order:
        fault = False  # the machine's, not the checkpoint's
        try:
            state, why = load_checkpoint(accelerator, path, task, optimizer), ""
        except ConfigError:
            raise
        except Exception as e:  # a checkpoint is untrusted input: corrupt, empty, crafted (never unpickled)
            why = ("holds objects other than tensors and plain values: refused, never unpickled"
                   if isinstance(e, pickle.UnpicklingError)
                   else f"{type(e).__name__}: {' '.join(str(e).split())[:100]}")
            # a read error (EIO, ESTALE, EACCES...) or no memory says nothing of the checkpoint: skipping it
            # would train its steps again and remove it at the next save
            fault = out_of_memory(e) or isinstance(e, OSError) and e.errno not in (
                None, errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
            state = {}
        told = gather_object([(fault, why)])
        if faults := [w for f, w in told if f]:
            raise OSError(f"reading checkpoint '{path}' failed ({faults[0]}), a fault of this machine or its file "
                          "system, not of the checkpoint: nothing was skipped or removed; fix it and run the same "
                          "command again")
        whys = [w for _, w in told if w]
        if not whys:
            if cfg.train.resume != "auto" and (newer := [
                    c.name for c in list_checkpoints(root)
                    if checkpoint_order(c.name) > checkpoint_order(checkpoint_name(state["step"]))]):
                raise ConfigError(f"train.resume={cfg.train.resume!r} (step {state['step']}) is older than "
                                  f"{', '.join(newer)} in {root}: going on here would mix two runs' checkpoints; "
                                  "resume into another output_dir, or delete those")
            if skipped:
                accelerator.print(f"warning: resume skipped checkpoints that do not load (and step_* entries that are "
                                  f"none): {'; '.join(skipped)}",
                                  file=sys.stderr)
            return path, state, damaged
        skipped.append(f"{path.name} ({whys[0]})")
        damaged.append(path)
    if order and cfg.train.resume != "auto":
        raise ConfigError(f"train.resume={cfg.train.resume!r} does not load ({whys[0]}); give a good checkpoint, "
                          "auto (the newest in output_dir) or none")
    if order:
        raise ConfigError(f"no checkpoint in '{root}' loads ({'; '.join(skipped)}); delete them to start afresh, "
                          "or give a good one as train.resume=PATH")
    if skipped:
        accelerator.print(f"warning: no checkpoint to resume from, starting afresh; skipped: {'; '.join(skipped)}",
                          file=sys.stderr)
    return None, {}, damaged


def check_origin(out: Path, then: dict, now: dict) -> None:
    """A resumed run must start from what its fresh start recorded (`Task.origin`); else its
    checkpoints would continue a run of other inputs under this one's name."""
    changed = [f"{k}: {v!r} then, {now.get(k)!r} now" for k, v in then.items() if now.get(k) != v]
    if changed:
        raise ConfigError(f"the checkpoints in {out} continue a run that started from other inputs "
                          f"({'; '.join(changed)}): give it back what it started from, or start again in another "
                          "output_dir")


def check_changes(out: Path, cfg: Config, accelerator: Accelerator, step: int, steps: int) -> None:
    """Name the settings that differ from the resumed run's config.yaml (`changed_settings`: not
    those of speed and logging alone); the run goes on with them (the optimiser's per-parameter
    state comes from the checkpoint at `step`, its settings and the schedule from the new config, of
    `steps`). A finished run, which would only export and evaluate again, is refused other settings
    but its length (a run stopped early is finished with steps set to its last checkpoint): its
    metrics.json would tell of settings that its weights and config.yaml do not, or, the output_dir
    mistaken, of a run that never trained. A run that finished (its metrics.json) is refused more
    steps than it finished with: a command run again without the steps it was given trained it on,
    its schedule begun anew, and rotated its last checkpoint out (the steps it was given resume
    from an older checkpoint, where the newest is damaged, as any run). The main process reads the
    files and says; every rank stops alike."""
    refused, finished = None, step == steps
    done = _finished_steps(out) if accelerator.is_main_process else None
    if done is not None and steps > done:
        refused = (f"output_dir '{out}' holds a run that finished at step {done}: {steps} steps would train it on, "
                   f"its learning-rate schedule begun anew; give steps={done} to export and evaluate it again, "
                   "or choose a new output_dir")
    elif accelerator.is_main_process and (out / "config.yaml").is_file():
        changed = changed_settings(out / "config.yaml", cfg)
        if changed is None:
            print(f"warning: {out / 'config.yaml'} cannot be read, so the settings changed since it cannot be named",
                  file=sys.stderr)
        elif finished and [c for c in changed if not c.startswith(("steps:", "epochs:"))]:
            refused = (f"output_dir '{out}' holds a finished run of other settings ({said(changed)}); give it its own "
                       "(its config.yaml) to export and evaluate it again, or choose a new output_dir")
        else:
            for c in changed:
                print(f"warning: resuming with {c}{_reordered(c)}", file=sys.stderr)
    if accelerator.num_processes > 1:
        refused = broadcast_object_list([refused])[0]
    if refused:
        raise ConfigError(refused)


def _finished_steps(out: Path) -> int | None:
    """The steps the run in `out` finished with (its metrics.json), None if it has not finished or
    the file does not say."""
    try:
        steps = json.loads((out / "metrics.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):  # none, unreadable, or not a mapping
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _reordered(change: str) -> str:
    """What a change of data.num_workers ('data.num_workers: 1 -> 2') does to a resumed epoch: the
    data order is the workers' split of the shards (at least one worker reads them, 0 too)."""
    if not change.startswith("data.num_workers:"):
        return ""
    then, now = (max(1, int(n)) for n in change.split(":")[1].split("->"))
    return "" if then == now else (" (the shards are split over the workers anew: the rest of this epoch trains "
                                   "some of its samples a second time and leaves as many out)")
