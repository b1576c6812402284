"""What every tool shares: `one_line_errors`, which each tool's `main` runs under, turning bad input,
a diverged run and a full or read-only disk into one line on stderr and a non-zero exit (2 for a bad
argument or config, 130 for Ctrl-C, 143 for a run stopped by SIGTERM, 1 for the rest) instead of a
traceback; an `ArgumentParser` whose usage errors
are one such line too; and `--config FILE key=value ...` parsing."""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys

from mpp.config import TOOL_DEFAULTS, Config, ConfigError, check_tool, load_config, valid_keys
from mpp.launcher import die_with_launcher, launch_env


class UsageError(Exception):
    """A bad command-line argument that argparse does not check itself (exit 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the tools' conventions: the description shown as written, and a usage error as
    one `error: ...` line (exit 2) rather than the usage text followed by the error."""

    def __init__(self, description: str | None = None, **kwargs):
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str):
        _fail(f"{self.prog}: {message} (see --help)", 2)


def _at_least(text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        n = least - 1
    if n < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
    return n


def count(text: str) -> int:
    """argparse type of a count that must be >= 1 (a bad one is a usage error, exit 2)."""
    return _at_least(text, 1)


def whole(text: str) -> int:
    """argparse type of a count that may be 0 (a bad one is a usage error, exit 2)."""
    return _at_least(text, 0)


def seed(text: str) -> int:
    """argparse type of a seed: a whole number in numpy's range, 0..2**32 - 1, as the configs' seed."""
    n = _at_least(text, 0)
    if n >= 2**32:
        raise argparse.ArgumentTypeError(f"expected a seed in 0..{2**32 - 1}, got {text!r}")
    return n


def path(text: str) -> str:
    """argparse type of a path, which must not be empty: an empty one meant this folder (shards of
    the working directory, figures written into it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path; give a file or folder")
    return text


def parse_config_args(description: str, argv: list[str] | None = None, tool: str = "") -> Config:
    """Parse `--config FILE [key=value ...]` into a validated Config (raises ConfigError) for
    `tool` (pretrain | finetune | linear_probe): its own defaults (TOOL_DEFAULTS) go beneath the
    file, a config of another tool's objective is refused (the file's or the overrides'), and
    settings it never reads are warned of (`check_tool`)."""
    parser = ArgumentParser(
        description,
        epilog="overrides are dotted keys with YAML values, e.g. steps=200 mpp.ratio=0.4 data.train=out/manifest.json\n"
               "valid keys: " + ", ".join(valid_keys()),
    )
    parser.add_argument("--config", type=path, help="YAML config (see configs/); keys not given keep their defaults")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides, defaults=TOOL_DEFAULTS.get(tool, []))
    typed = "objective" in {o.split("=", 1)[0].strip() for o in args.overrides}
    unread = check_tool(cfg, tool, source=f"config file '{args.config}'" if args.config and not typed else "")
    if unread and launch_env()["RANK"] == 0:
        print(f"warning: {'; '.join(unread)}: those settings do nothing here", file=sys.stderr)
    return cfg


def train_tool(description: str, argv: list[str] | None, tool: str) -> None:
    """A training tool's work (pretrain | finetune): its config parsed, the run trained, the
    process group left as the run ends."""
    cfg = parse_config_args(description, argv, tool=tool)
    from mpp.runtime import leave_process_group  # after parsing: --help and a bad key answer without importing torch
    from mpp.train import train
    train(cfg)
    leave_process_group()


def _user_errors() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """The errors whose message is meant for the user, beyond a bad config or argument: a bad
    report input (exit 2), bad data, a diverged run (exit 1), a run stopped by SIGTERM after its
    checkpoint (exit 143, as a shell reports a process SIGTERM ended). Each is looked up only in a
    module already imported (an error of a module never imported was never raised), so that an
    error's one line never waits for torch to import."""
    def loaded(module: str, name: str) -> tuple[type, ...]:
        return (getattr(sys.modules[module], name),) if module in sys.modules else ()
    return (loaded("mpp.report", "ReportError"),
            (*loaded("mpp.data.decode", "DataError"), *loaded("mpp.data.writer", "ShardError"),
             *loaded("mpp.nonfinite", "NonFiniteError")),
            loaded("mpp.preemption", "Terminated"))


def os_message(e: OSError) -> str:
    """One line for a failed file operation, saying what to do about it."""
    if e.errno is None:  # raised by our code with its own message
        return str(e)
    where = f" '{e.filename}'" if e.filename else ""
    if e.errno == errno.ENOSPC:
        writing = f" (writing{where})" if where else ""  # an error of a stream, not of a named file
        return f"the disk is full{writing}; free space or choose an output_dir on another disk"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"no permission to write{where} ({e.strerror}); choose a writable output_dir"
    if e.errno in (errno.EEXIST, errno.ENOTDIR):  # a folder was wanted where a file is
        return f"{e.strerror}:{where}; a file is in the way of a folder there: give a folder's path"
    if e.errno == errno.EISDIR:
        return f"{e.strerror}:{where}; give a file's path, not a folder's"
    return f"{e.strerror or e}{':' + where if where else ''}"


# set for a comparison's stage: its Ctrl-C is quiet (exit 130 alone), the comparison's line naming the stage
QUIET_INTERRUPT = "MPP_COMPARISON_STAGE"
RESUMABLE = ("interrupted; run the same command again to resume from its last checkpoint (train.ckpt_every; Ctrl-C "
             "saves none, SIGTERM saves one first)")  # a training tool's Ctrl-C


@contextlib.contextmanager
def one_line_errors(extra: tuple[type, ...] = (), interrupted: str = "interrupted"):
    """Run a tool's body (as `with one_line_errors(): ...` or as `@one_line_errors()` on its
    `main`), a rank of a launcher dying with it (`mpp.launcher`): the user-facing errors
    (`_user_errors`, then `extra` and OSError, exit 1) end with one line `error: ...` on stderr,
    and Ctrl-C with `error: INTERRUPTED` (exit 130, as a shell's; in a comparison's stage,
    `QUIET_INTERRUPT` set, with no line), after the body's own cleanup (a run directory's lock is
    released; checkpoints are written atomically). Other exceptions (bugs) keep their traceback."""
    die_with_launcher()
    try:
        yield
    except KeyboardInterrupt:
        if os.environ.get(QUIET_INTERRUPT):  # the comparison says which stage stopped and how to resume
            raise SystemExit(130) from None
        _fail(interrupted, 130)
    except Exception as e:
        bad_args, bad_run, terminated = _user_errors()
        if isinstance(e, (ConfigError, UsageError, *bad_args)):
            _fail(str(e), 2)
        if isinstance(e, terminated):
            _fail(str(e), 128 + signal.SIGTERM)
        if isinstance(e, (*bad_run, *extra)):
            _fail(str(e), 1)
        if isinstance(e, OSError):
            _fail(os_message(e), 1)
        if out_of_memory(e):
            _fail(f"out of memory ({' '.join(str(e).split())[:160]}); lower the batch size, the image size or the "
                  "model", 1)
        raise


def out_of_memory(e: BaseException) -> bool:
    """A failed allocation: Python's, the GPU's (torch.OutOfMemoryError, named here so that tools
    which need no torch do not import it) or the CPU allocator's (a RuntimeError)."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def _fail(message: str, code: int) -> None:
    print("error: " + " ".join(message.split()), file=sys.stderr)
    raise SystemExit(code)
