"""A run directory holds one run: checks before any work, a lock, and the checkpoint to resume.

- `check_output_dir` (before any work, nothing written): OUTPUT_DIR is a directory or can be made
  one, and is writable.
- `lock` (main process, before anything is written): an exclusive POSIX lock (`lockf`) on
  OUTPUT_DIR/.lock, held until `unlock` or the process exits (the kernel drops it even after
  kill -9; unlike `flock`, the forked data workers do not inherit it, so workers that outlive a
  killed run for a few seconds do not keep its directory locked), so a second
  run in the same directory stops with one line naming the first one's pid instead of interleaving
  with it. `unlock` removes the file (and the directory when `lock` made it and it stayed empty),
  so a run that failed before writing leaves nothing behind. Since the file can be removed
  between another process's open and its lock, `lock` holds a lock only on the file that is still
  at OUTPUT_DIR/.lock, and otherwise tries again (else two runs could hold two files).
- `check_fresh`: `train.resume=none` refuses a directory that already holds a run (checkpoints,
  an encoder or metrics.json). It does not move the old run aside: the user says whether it goes.
- `check_unfinished`: `train.resume=auto` refuses a finished run whose checkpoints were deleted,
  which a fresh start would overwrite.
- `check_probe_dir`: a linear probe's OUTPUT_DIR holds no training run, nor a probe of other settings.
- `candidates`: `resume=auto`'s checkpoints newest first, and the `step_*` entries that cannot be
  one; `mpp.resume.resume` loads them in that order and skips and names the ones that do not load.
- `resume_command`: what a stopped run's line tells the user to run.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from pathlib import Path

from mpp.checkpoint import PREFIX, is_checkpoint, list_checkpoints
from mpp.config import UNREAD, ConfigError, changed_settings, said
from mpp.fileio import sweep_orphans

RUN_FILES = ("metrics.json", "encoder.safetensors")  # what a finished run leaves besides checkpoints
_held: dict[str, tuple] = {}  # OUTPUT_DIR -> (open lock file, whether lock() made the directory)


def check_output_dir(out: str | Path) -> None:
    """OUTPUT_DIR is usable: not a file, and it (or its nearest existing parent) is writable."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir '{out}' is a file, not a directory; choose another output_dir")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir '{out}' cannot be created: '{existing}' is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir '{out}' is not writable ('{existing}' is read-only to this user); "
                          "choose another output_dir")


def lock(out: str | Path) -> None:
    """Create OUTPUT_DIR and hold OUTPUT_DIR/.lock (with our pid in it) until `unlock` or exit."""
    out = Path(out)
    if str(out) in _held:
        return
    created = not out.exists()
    while True:
        out.mkdir(parents=True, exist_ok=True)
        try:
            f = open(out / ".lock", "a+")
        except FileNotFoundError:  # a run that made the directory removed it as it ended
            continue
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # POSIX lock: forked data workers do not inherit it
        except OSError as e:
            f.close()
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise ConfigError(f"output_dir '{out}' is in use by another run (pid {_holder(out)}); wait for it "
                              "to end or choose another output_dir") from None
        if _is_path_of(f, out / ".lock"):
            break
        f.close()  # we locked a file that `unlock` removed meanwhile (a newer one may be held): again
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _held[str(out)] = (f, created)
    for folder in [out, *(p for p in out.iterdir() if p.is_dir())]:  # profile/, figures/ too
        sweep_orphans(folder)  # of a run of this directory killed as it wrote: no live one writes here now


def _is_path_of(f, path: Path) -> bool:
    """Whether the open file `f` is still the file at `path` (not unlinked or replaced)."""
    try:
        return os.path.samestat(os.fstat(f.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _holder(out: Path) -> str:
    try:
        return (out / ".lock").read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def unlock(out: str | Path) -> None:
    """Release and remove OUTPUT_DIR/.lock if this process holds it (the end of a train() call); a
    directory that `lock` made and that holds nothing else (the run failed first) is removed too."""
    out = Path(out)
    f, created = _held.pop(str(out), (None, False))
    if f is not None:
        (out / ".lock").unlink(missing_ok=True)  # before close: no one else can hold it meanwhile
        f.close()
        if created and not any(out.iterdir()):
            with contextlib.suppress(OSError):  # another run locked it meanwhile: its folder now
                out.rmdir()


def _run_files(out: Path) -> list[str]:
    """The files of RUN_FILES that OUTPUT_DIR `out` holds."""
    return [name for name in RUN_FILES if (out / name).exists()]


def check_fresh(out: str | Path) -> None:
    """`train.resume=none`: OUTPUT_DIR must not hold another run, whose checkpoints would mix with
    this one's (rotation keeps the highest step numbers; a later resume=auto would pick them)."""
    out = Path(out)
    found = [p.name for p in sorted((out / "checkpoints").glob(PREFIX + "*"))] if (out / "checkpoints").is_dir() else []
    if found := found + _run_files(out):
        raise ConfigError(f"train.resume=none but output_dir '{out}' holds an earlier run ({', '.join(found[-3:])}); "
                          "choose a new output_dir, delete the old run, or continue it with train.resume=auto")


def check_unfinished(out: str | Path) -> None:
    """`train.resume=auto` with no checkpoint to resume: OUTPUT_DIR must not hold a finished run's
    files (its checkpoints deleted to save space), which a fresh start would train anew and overwrite."""
    out = Path(out)
    if (found := _run_files(out)) and not list_checkpoints(out / "checkpoints"):
        raise ConfigError(f"output_dir '{out}' holds a finished run ({', '.join(found)}) but no checkpoint to resume "
                          "it, so starting would train it anew and overwrite it; choose a new output_dir, or delete "
                          "the old run's files")


def check_probe_dir(out: str | Path, cfg) -> None:
    """A linear probe's OUTPUT_DIR (it writes config.yaml and metrics.json there) must not hold a
    training run, whose files the probe would overwrite or stand beside as if they were its own,
    nor a finished probe of other settings or of settings unknown (`cfg`: the probe's config;
    settings it never reads aside); one of the same settings is probed again."""
    out = Path(out)
    try:
        kind = json.loads((out / "metrics.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None if (out / "metrics.json").exists() else "none"
    held = [name for name in ("encoder.safetensors", "checkpoints") if (out / name).exists()]
    held += ["metrics.json"] if kind not in ("linear_probe", "none") else []
    if held:
        raise ConfigError(f"output_dir '{out}' holds a training run ({', '.join(held)}), which the probe would "
                          "overwrite; give the probe an output_dir of its own (probe.encoder names the run to probe)")
    if kind != "linear_probe":
        return
    unread = tuple(f"{section}." for section in UNREAD["probe"]) + ("steps:", "epochs:")  # nothing to the probe
    if (changed := changed_settings(out / "config.yaml", cfg)) is None:
        raise ConfigError(f"output_dir '{out}' holds a finished probe (metrics.json) but no config.yaml this mpp can "
                          "read, so its settings are unknown; choose a new output_dir, or delete the old probe")
    if changed := [c for c in changed if not c.startswith(unread)]:
        raise ConfigError(f"output_dir '{out}' holds a finished probe of other settings ({said(changed)}); choose a "
                          "new output_dir, or delete the old probe")


def resume_command(resume: str) -> str:
    """The command that resumes a run stopped with checkpoints, started with train.resume=`resume`:
    `none` refuses a folder that holds a run, an explicit path one with newer checkpoints."""
    return "the same command" if resume == "auto" else "the same command with train.resume=auto"


def candidates(root: str | Path) -> tuple[list[Path], list[str]]:
    """`resume=auto` candidates newest first, and the `step_*` entries that cannot be one (why)."""
    root = Path(root)
    found = list_checkpoints(root)
    bad = [f"{p.name} ({'not a directory' if not p.is_dir() else 'not a checkpoint name such as step_0000001'})"
           for p in sorted(root.glob(PREFIX + "*")) if not is_checkpoint(p)] if root.is_dir() else []
    return found[::-1], bad
