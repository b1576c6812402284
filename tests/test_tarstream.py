"""mpp.data.tarstream reads what tarfile writes (ustar, GNU, PAX, gzip) and rejects truncation."""
from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from mpp.data.tarstream import tar_files

MEMBERS = [("a/short.jpg", b"x" * 700), ("d" * 60 + "/" + "n" * 80 + ".cls", b"3"),
           ("long" * 40 + ".png", b"y" * 1024), ("empty.txt", b""), ("ünï/cödé.jpg", b"z" * 5)]


def make_tar(fmt) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        dirinfo = tarfile.TarInfo("a")
        dirinfo.type = tarfile.DIRTYPE
        tar.addfile(dirinfo)
        for name, data in MEMBERS:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1.5e9 + 0.25  # float mtime: a PAX record
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_reads_like_tarfile(fmt):
    raw = make_tar(fmt)
    assert list(tar_files(io.BufferedReader(io.BytesIO(raw)))) == MEMBERS
    zipped = io.BufferedReader(io.BytesIO(gzip.compress(raw)))
    assert list(tar_files(zipped)) == MEMBERS


def test_ustar_prefix_names():
    buf = io.BytesIO()
    name = "p" * 120 + "/file.jpg"  # too long for the name field: split into prefix + name
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    assert list(tar_files(io.BytesIO(buf.getvalue()))) == [(name, b"abc")]


def test_truncation_and_corruption_raise():
    raw = make_tar(tarfile.PAX_FORMAT)
    for cut in (0, 100, 512, 1024, 1536, len(raw) // 2):
        with pytest.raises(tarfile.ReadError):
            list(tar_files(io.BytesIO(raw[:cut])))
    bad = bytearray(raw)
    bad[520] ^= 0xFF  # inside the second header
    with pytest.raises(tarfile.ReadError, match="checksum"):
        list(tar_files(io.BytesIO(bytes(bad))))


def test_select_skips_other_members():
    raw = make_tar(tarfile.PAX_FORMAT)
    for f in (io.BytesIO(raw), io.BufferedReader(io.BytesIO(gzip.compress(raw)))):
        assert list(tar_files(f, select=lambda n: n.endswith(".cls"))) == [MEMBERS[1]]
    with pytest.raises(tarfile.ReadError):  # truncation inside a skipped member is still caught
        list(tar_files(io.BytesIO(raw[:1700]), select=lambda n: False))
