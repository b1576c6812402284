"""Atomic file writes: every file the framework writes goes through `atomic_path`.

A reader (a resumed run, `compare.py` which treats `metrics.json` as "stage finished", a person
copying results) never sees half a file: the content goes to a temporary name in the same
directory and is renamed over the target in one step. Files get mode 0666 minus the umask, like
`open(..., "w")` (safetensors' and `tempfile`'s 0600 otherwise). A write that fails on a (nearly)
full disk raises OSError(ENOSPC) whatever the writer raised, so the message can say so. The content
is flushed to the disk before the rename and the rename after it (`fsync`), so a power cut leaves
the old file or the new one, never an empty one. A write cut off by kill -9 leaves its temporary
file (named with the process, its PID namespace, the kernel's boot and the machine), which
`sweep_orphans` removes later."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterator

import psutil


def _pids() -> str:
    """Whose pids this process's are, in hex: its PID namespace (containers that share a host name
    each have their own) and the kernel's boot (machines that share a host name, or a namespace's
    number, each have their own)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:12]
    except OSError:
        return "0"
    return f"{ns:x}{boot}"


_WHERE = f"{_pids()}.{socket.gethostname()}"  # whose pids a temporary file's pid is
_TMP = re.compile(r"\..+\.tmp(\d+)\.([0-9a-f]+\..+)")  # `atomic_path`'s temporary names: .NAME.tmpPID.WHO.HOST


def _umask() -> int:
    """The process's umask, read where Linux shows it: setting it to read it (the fallback) leaves
    it 0 for a moment, when a file another thread creates (TensorBoard's) would be world-writable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without error, it becomes `path`
    (mode 0666 & ~umask); on error the temporary file is removed and `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(_tmp_name(path.name))
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    except Exception as e:
        if not (isinstance(e, OSError) and e.errno == errno.ENOSPC) and _nearly_full(path.parent):
            # writers report a full disk their own way (torch.save: "unexpected pos"); say what it is
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _tmp_name(name: str, most: int = 255) -> str:
    """`atomic_path`'s temporary name for `name`: .NAME.tmpPID.WHO.HOST, within the file system's
    `most` bytes a name (a NAME near it is cut, with a hash of the whole so two such stay apart)."""
    suffix = f".tmp{os.getpid()}.{_WHERE}"
    if len(f".{name}{suffix}".encode()) > most:
        keep = most - len(f".~12345678{suffix}".encode())
        name = name.encode()[:keep].decode(errors="ignore") + "~" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return f".{name}{suffix}"


def sweep_orphans(directory: str | Path) -> None:
    """Remove the temporary files that `atomic_path` left in `directory` when its process was
    killed mid-write (kill -9, the out-of-memory killer): each can be a whole encoder or feature
    array, and nothing else ever removes it. Only those of processes of this machine that no longer
    run (in this PID namespace, since this boot): a folder shared by several machines or containers
    holds the writes of the others too."""
    for f in Path(directory).glob(".*.tmp*"):
        m = _TMP.fullmatch(f.name)
        if m and m.group(2) == _WHERE and not psutil.pid_exists(int(m.group(1))):
            f.unlink(missing_ok=True)


def fsync(path: str | Path) -> None:
    """Flush a file's content, or a folder's entries (a rename in it), to the disk. Folders that
    cannot be opened or flushed (Windows, some network filesystems) are left to the OS."""
    is_dir = os.path.isdir(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if is_dir:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not is_dir:
            raise
    finally:
        os.close(fd)


def _nearly_full(directory: Path) -> bool:
    try:
        return shutil.disk_usage(directory).free < 1 << 20
    except OSError:
        return False


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in blocks (a checkpoint or an encoder can be gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (text or bytes) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def save_figure(fig, path: str | Path, **kw) -> None:
    """A matplotlib figure as a PNG, through `atomic_path`, then closed."""
    import matplotlib.pyplot as plt  # here: only what draws figures loads matplotlib
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", **kw)
    plt.close(fig)
