"""A process dies with the one that started it (Linux): a rank with its torchrun / accelerate
launch, a comparison's stage with the comparison (`follow_parent`). Torch-free, so
that the tools ask for it before their heavy imports: the kernel's request covers only the parent
alive when it is made, and a launcher killed during a rank's seconds of start-up would otherwise
leave that rank orphaned (training on, holding the run directory, or joining the next launcher on the port)."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

from mpp.config import ConfigError


def follow_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; elsewhere nothing)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


LAUNCHERS = {"torchrun", "accelerate", "accelerate-launch", "torch.distributed.run", "torch.distributed.launch",
             "accelerate.commands.launch"}  # commands, and modules run with python -m
INIT_CMDLINE = "/proc/1/cmdline"


def _init_is_launcher() -> bool:
    """Whether pid 1 is itself a launcher (torchrun as a container's entrypoint): its ranks are then
    init's children from the start. Unreadable counts as yes: a rank is not stopped on a guess."""
    try:
        with open(INIT_CMDLINE, "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return True
    return any(os.path.basename(a.decode(errors="replace")) in LAUNCHERS for a in args)


def die_with_launcher() -> None:
    """Under a torch elastic launcher: ask the kernel to kill this process when its parent dies
    (PR_SET_PDEATHSIG), and exit now if the parent has already died (the process then belongs to
    init, pid 1, unless init is the launcher). `mpp.cli.one_line_errors` (every tool) and
    `mpp.train.setup` call it."""
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
        follow_parent()
        if os.getppid() == 1 and not _init_is_launcher():
            raise SystemExit("error: this rank's launcher (torchrun / accelerate launch) exited while it "
                             "started; start the job again")


LAUNCH_VARS = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1}  # name: value where unset


def launch_env() -> dict[str, int]:
    """The launcher's variables (torchrun's, accelerate launch's: LAUNCH_VARS and MASTER_PORT, None
    where unset) as whole numbers, checked before torch or Accelerate read them: a mistyped or
    stray one gave their traceback (int('abc') in torch's rendezvous), and a WORLD_SIZE above 1
    left from another launch, without MASTER_ADDR, Accelerate's. ConfigError in one line instead."""
    fix = "the launcher sets it (torchrun): unset it to run one process, or launch with torchrun"
    got: dict = {}
    for name, unset in [*LAUNCH_VARS.items(), ("MASTER_PORT", None)]:
        text = os.environ.get(name)
        try:
            got[name] = unset if text is None else int(text)
        except ValueError:
            raise ConfigError(f"environment variable {name}={text!r} is not a whole number; {fix}") from None
    world, rank, port = got["WORLD_SIZE"], got["RANK"], got["MASTER_PORT"]
    bad = [f"{name}={got[name]}" for name, ok in (
        ("WORLD_SIZE", world >= 1), ("RANK", rank >= 0 and ("WORLD_SIZE" not in os.environ or rank < world)),
        ("LOCAL_RANK", got["LOCAL_RANK"] >= 0), ("LOCAL_WORLD_SIZE", got["LOCAL_WORLD_SIZE"] >= 1),
        ("MASTER_PORT", port is None or 1 <= port <= 65535)) if not ok]
    if bad:
        raise ConfigError(f"environment variable {bad[0]} is out of range (WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE, "
                          f"LOCAL_RANK >= 0, LOCAL_WORLD_SIZE >= 1, MASTER_PORT in 1..65535); {fix}")
    if world > 1 and not os.environ.get("MASTER_ADDR"):
        raise ConfigError(f"environment variable WORLD_SIZE={world} asks for {world} processes, but MASTER_ADDR, where "
                          "they meet, is unset: a variable left from another launch? Unset WORLD_SIZE to run one "
                          "process, or launch with torchrun")
    return got
