"""mpp.fileio: atomic writes that fail loudly and leave the old file, their temporary names, and
the digests of large files."""
from __future__ import annotations

import errno
import hashlib
import os
import types

import pytest

import mpp.fileio
from mpp.fileio import _tmp_name, atomic_path, file_sha256, save_figure, sweep_orphans, write_atomic


def test_a_failed_flush_of_the_content_fails_the_write_and_keeps_the_old_file(tmp_path, monkeypatch):
    """A file's fsync that fails (EIO) or a file that cannot be opened to flush it would have been
    renamed into place as if on the disk; a folder's, which some file systems refuse, is let be."""
    (tmp_path / "f").write_text("old")
    fsync, real_open, failing = os.fsync, os.open, []  # failing: "file" or "folder", what refuses

    def flush(fd):
        kind = "folder" if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")) else "file"
        if kind in failing:
            raise OSError(errno.EIO, f"Input/output error flushing a {kind}")
        fsync(fd)

    def open_(path, flags, *args):
        if "open" in failing and not os.path.isdir(path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "fsync", flush)
    monkeypatch.setattr(os, "open", open_)
    failing[:] = ["file"]
    with pytest.raises(OSError, match="flushing a file"):
        write_atomic(tmp_path / "f", "new")
    assert (tmp_path / "f").read_text() == "old" and os.listdir(tmp_path) == ["f"]
    failing[:] = ["open"]
    with pytest.raises(PermissionError):
        write_atomic(tmp_path / "f", "new")
    assert (tmp_path / "f").read_text() == "old" and os.listdir(tmp_path) == ["f"]
    failing[:] = ["folder"]
    write_atomic(tmp_path / "f", "new")  # the folder's flush refused: the file is still written
    assert (tmp_path / "f").read_text() == "new"


def test_writes_leave_no_file_descriptor_open():
    """A long run writes thousands of files (metrics, checkpoints): each flush closes what it opened."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        before = len(os.listdir("/proc/self/fd"))
        for i in range(50):
            write_atomic(os.path.join(d, f"f{i}"), "x")
        assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("free, full", [((1 << 20) - 1, True), (1 << 20, False), (None, False)])
def test_a_write_error_is_called_a_full_disk_only_under_a_mebibyte_free(tmp_path, monkeypatch, free, full):
    """Below 1 MiB free a writer's own error is the full disk; above it, or where the free space
    cannot be read (some network file systems), the writer's error stands."""
    def usage(p):
        if free is None:
            raise OSError(errno.ENOSYS, "no statvfs")
        return types.SimpleNamespace(free=free)  # shutil.disk_usage's field that is read
    monkeypatch.setattr(mpp.fileio.shutil, "disk_usage", usage)
    with pytest.raises(Exception) as e:
        with atomic_path(tmp_path / "f") as f:
            f.write_text("partial")
            raise RuntimeError("unexpected pos 576 vs 534")
    assert (isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC) == full
    assert full or isinstance(e.value, RuntimeError)


def test_text_is_written_as_utf8(tmp_path):
    write_atomic(tmp_path / "f", "é…ü")
    assert (tmp_path / "f").read_bytes() == "é…ü".encode("utf-8")


def test_the_digest_reads_the_whole_file(tmp_path):
    """A checkpoint or an encoder is gigabytes: the digest covers every block, not the first."""
    data = bytearray(os.urandom(3 << 20))
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    data[-1] ^= 1  # a flipped bit past the first MiB
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_a_saved_figure_is_closed(tmp_path):
    """pyplot keeps every figure it made until closed: a run drawing one per evaluation grew."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plt.figure()
    save_figure(fig, tmp_path / "f.png")
    assert not plt.fignum_exists(fig.number) and (tmp_path / "f.png").read_bytes().startswith(b"\x89PNG")


def test_a_name_near_the_limit_is_written_and_its_leftover_swept(tmp_path):
    """The temporary name adds some 40 to 100 bytes to the file's: a name a plain open() takes
    failed (ENAMETOOLONG). Cut, it stays within 255 bytes, apart from another such name's, and
    `sweep_orphans` still knows it."""
    name = "é" * 100 + "x" * 40 + ".json"  # 245 bytes
    write_atomic(tmp_path / name, "{}")
    assert os.listdir(tmp_path) == [name]
    tmp = _tmp_name(name)
    assert len(tmp.encode()) <= 255 and tmp != _tmp_name(name[:-6] + "y.json")
    assert mpp.fileio._TMP.fullmatch(tmp) and _tmp_name("f.json") == f".f.json.tmp{os.getpid()}.{mpp.fileio._WHERE}"


def test_the_temporary_names_tell_this_pid_namespace_and_boot(tmp_path):
    """Temporary files of dead processes are swept by pid only where the pids are this machine's
    own: another container (a PID namespace) or boot with the same host name has other pids."""
    if not os.path.exists("/proc/self/ns/pid"):
        pytest.skip("no /proc")
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip().replace("-", "")[:12]
    who = mpp.fileio._WHERE.split(".", 1)[0]
    assert who == f"{os.stat('/proc/self/ns/pid').st_ino:x}{boot}"
    (tmp_path / f".f.tmp999999999.0.{mpp.fileio._WHERE.split('.', 1)[1]}").write_text("x")  # another's pid 999999999
    sweep_orphans(tmp_path)
    assert len(os.listdir(tmp_path)) == 1
