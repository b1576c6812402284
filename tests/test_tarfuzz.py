"""Any byte string given as a shard ends in bounded time and memory: it yields samples or is
skipped and counted. Random mutations of real shards (truncations, bit flips, malformed ustar, GNU
and PAX headers with valid checksums, huge and negative declared sizes, random bytes, gzip)."""
from __future__ import annotations

import gzip
import io
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from mpp.data.sources import read_shard
from shardutil import encode

SECONDS = 3.0  # per shard; a healthy read of these takes milliseconds


def _shard(fmt) -> bytes:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for j in range(6):
            name = f"{'long' * 30 if j == 2 else ''}k{j}"  # a long name: PAX path / GNU longname
            for ext, data in (("jpg", encode(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), "jpeg")),
                              ("cls", str(j % 3).encode())):
                info = tarfile.TarInfo(f"{name}.{ext}")
                info.size, info.mtime = len(data), 1.5e9 + 0.5  # float mtime: a PAX record
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _headers(raw: bytes) -> list[int]:
    """Offsets of the header blocks of a well-formed tar."""
    out, pos = [], 0
    while pos + 512 <= len(raw) and raw[pos:pos + 512].count(0) != 512:
        out.append(pos)
        size = int(raw[pos + 124:pos + 136].split(b"\0")[0].strip() or b"0", 8)
        pos += 512 + size + (-size % 512)
    return out


def _seal(block: bytearray) -> bytearray:
    """Recompute a header's checksum, so the mutation reaches the parser behind it."""
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return block


def _set_header(raw: bytes, pos: int, edit) -> bytes:
    block = bytearray(raw[pos:pos + 512])
    edit(block)
    return raw[:pos] + bytes(_seal(block)) + raw[pos + 512:]


def _pax_record(raw: bytes, pos: int, record: bytes) -> bytes:
    """Replace the PAX extended header at `pos` (a 'x' member) by one holding `record`."""
    size = int(raw[pos + 124:pos + 136].split(b"\0")[0].strip() or b"0", 8)
    end = pos + 512 + size + (-size % 512)
    body = record + b"\0" * (-len(record) % 512)
    block = bytearray(raw[pos:pos + 512])
    block[124:136] = b"%011o\0" % len(record)
    return raw[:pos] + bytes(_seal(block)) + body + raw[end:]


def mutations(raw: bytes, rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    heads = _headers(raw)
    pax = [p for p in heads if raw[p + 156:p + 157] == b"x"]
    out = [("random bytes", rng.randbytes(rng.randrange(1, 8192))), ("empty", b""),
           ("gzip truncated", gzip.compress(raw)[:len(raw) // 3]),
           ("gzip of zeros", gzip.compress(bytes(1 << 22)))]
    if pax:
        out += [("zero-length PAX record", _pax_record(raw, pax[0], b"0 path=x\n")),
                ("PAX record longer than header", _pax_record(raw, pax[0], b"99 path=x\n")),
                ("PAX record without length", _pax_record(raw, pax[0], b"path=x\n")),
                ("PAX record without '='", _pax_record(raw, pax[0], b"9 pathx\n")),
                ("negative PAX size", _pax_record(raw, pax[0], b"12 size=-5\n")),
                ("huge PAX size", _pax_record(raw, pax[0], b"22 size=999999999999\n"))]
    edits = [
        ("huge octal size", lambda b: b.__setitem__(slice(124, 136), b"77777777777\0")),
        ("huge base-256 size", lambda b: b.__setitem__(slice(124, 136), b"\x80" + b"\xff" * 11)),
        ("negative base-256 size", lambda b: b.__setitem__(slice(124, 136), b"\xff" * 12)),
        ("non-octal size", lambda b: b.__setitem__(slice(124, 136), b"9x9x9x9x9x9\0")),
        ("random kind", lambda b: b.__setitem__(156, rng.randrange(256))),
        ("GNU longname kind", lambda b: b.__setitem__(156, ord("L"))),
        ("PAX kind", lambda b: b.__setitem__(156, ord("x"))),
        ("random field", lambda b: b.__setitem__(slice(o := rng.randrange(0, 500), o + 12), rng.randbytes(12))),
    ]
    while len(out) < n:
        kind = rng.randrange(4)
        if kind == 0:
            out.append(("truncated", raw[:rng.randrange(len(raw))]))
        elif kind == 1:
            b = bytearray(raw)
            for _ in range(rng.randrange(1, 9)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            out.append(("bit flips", bytes(b)))
        else:
            name, edit = rng.choice(edits)
            mutated = _set_header(raw, rng.choice(heads), edit)
            out.append((f"{name} (gzip)" if kind == 3 else name, gzip.compress(mutated) if kind == 3 else mutated))
    return out


class _Timeout(BaseException):  # not swallowed by the reader's `except Exception`
    pass


def _alarm(*_):
    raise _Timeout


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_mutated_shards_end_in_bounded_time_and_memory(tmp_path, fmt):
    """In an interpreter of its own: tracemalloc counts every thread's allocations, and a thread an
    earlier test of the suite left running (a loader's, a writer's) once put 8 MB into one read's
    peak under torch 2.11."""
    code = (f"import sys, pathlib; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_tarfuzz; "
            f"test_tarfuzz.check_mutations(pathlib.Path({str(tmp_path)!r}), {fmt})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-3000:]


def check_mutations(tmp_path: Path, fmt: int) -> None:
    """300 mutations of a shard of `fmt` each end within SECONDS and hold less than 8 times the
    shard plus 4 MiB; together they give both corrupt and truncated shards."""
    raw = _shard(fmt)
    clean: dict = {}
    assert len(list(read_shard(_write(tmp_path / "clean.tar", raw), clean))) == 6 and not clean
    rng = random.Random(fmt)
    cases = mutations(raw, rng, 300)
    for i, (_, data) in enumerate(cases[:2]):  # warm up first-use imports on error paths (random, empty)
        list(read_shard(_write(tmp_path / f"w{i}.tar", data), {}))
    old = signal.signal(signal.SIGALRM, _alarm)
    tracemalloc.start()
    kinds: dict = {}
    try:
        for i, (what, data) in enumerate(cases):
            path = _write(tmp_path / f"m{i}.tar", data)
            skips: dict = {}
            tracemalloc.reset_peak()
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, SECONDS)
            try:
                samples = list(read_shard(path, skips))
            except _Timeout:
                raise AssertionError(f"mutation {i} ({what}) did not end within {SECONDS} s") from None
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < 8 * len(raw) + (4 << 20), f"mutation {i} ({what}) held {peak} bytes"
            assert time.perf_counter() - start < SECONDS
            assert len(samples) <= 8 and sum(skips.values()) <= 1, (what, skips)
            for k in skips:
                kinds[k] = kinds.get(k, 0) + 1
    finally:
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, old)
    assert kinds.get("corrupt_tar") and kinds.get("truncated_tar"), kinds


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_zero_length_pax_record_is_corrupt_not_a_hang(tmp_path):
    """The finding that hung a run: a PAX record of length 0."""
    raw = _shard(tarfile.PAX_FORMAT)
    pax = [p for p in _headers(raw) if raw[p + 156:p + 157] == b"x"][0]
    skips: dict = {}
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, SECONDS)
    try:
        samples = list(read_shard(_write(tmp_path / "z.tar", _pax_record(raw, pax, b"0 path=x\n")), skips))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert skips == {"corrupt_tar": 1} and len(samples) < 6


def test_random_bytes_shard_is_corrupt_not_truncated(tmp_path):
    skips: dict = {}
    assert list(read_shard(_write(tmp_path / "r.tar", random.Random(1).randbytes(4096)), skips)) == []
    assert skips == {"corrupt_tar": 1}


def test_oversized_member_is_refused_before_reading(tmp_path):
    from mpp.data.tarstream import CorruptTar, tar_files
    raw = _shard(tarfile.GNU_FORMAT)
    with pytest.raises(CorruptTar, match="limit 100"):
        list(tar_files(io.BytesIO(raw), max_member=100))
    assert len(list(tar_files(io.BytesIO(raw), select=lambda n: n.endswith(".cls"), max_member=100))) == 6


def _record(key: str, value: bytes) -> bytes:
    """One PAX record, its length field counting itself."""
    body = f" {key}=".encode() + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


@pytest.mark.parametrize("value", ["²".encode(), b"%d" % 2 ** 63], ids=["superscript", "2**63"])
def test_a_malformed_or_impossible_pax_size_is_a_corrupt_tar(tmp_path, value):
    """A size int() takes but no tar means ('²'), or one no file holds: read or skipped, corrupt,
    not an unreadable shard (a ValueError, or a seek's OverflowError)."""
    from mpp.data.tarstream import CorruptTar, tar_files
    raw = _shard(tarfile.PAX_FORMAT)
    bad = _pax_record(raw, [p for p in _headers(raw) if raw[p + 156:p + 157] == b"x"][0], _record("size", value))
    with pytest.raises(CorruptTar):
        list(tar_files(io.BytesIO(bad), select=lambda n: False))
    skips: dict = {}
    list(read_shard(_write(tmp_path / "s.tar", bad), skips))
    assert skips == {"corrupt_tar": 1}


def test_a_member_decoding_never_reads_is_skipped_unread_whatever_its_size(tmp_path):
    """A member no sample field uses (a video beside the image, say) past what a member read may
    hold cost the rest of its shard as corrupt_tar while every member was read; skipped unread, its
    sample keeps the name as an empty field and the shard reads on."""
    from mpp.data.tarstream import MAX_MEMBER
    big = tarfile.TarInfo("k0.mp4")
    big.size = MAX_MEMBER + 1
    path = tmp_path / "big.tar"
    with open(path, "wb") as f:
        f.write(big.tobuf(tarfile.USTAR_FORMAT))
        f.seek(big.size + (-big.size % 512), 1)  # a hole: the disk holds none of it
        f.write(_shard(tarfile.PAX_FORMAT))  # k0.jpg, k0.cls, ... k5.cls: the video joins sample k0
    skips: dict = {}
    samples = list(read_shard(str(path), skips))
    assert skips == {} and [s["__key__"] for s in samples] == [f"{'long' * 30 if j == 2 else ''}k{j}" for j in range(6)]
    assert samples[0]["mp4"] == b"" and samples[0]["jpg"][:2] == b"\xff\xd8" and samples[0]["cls"] == b"0"


def test_a_malformed_pax_record_is_a_corrupt_tar(tmp_path):
    """A PAX record without its length, without its closing newline, or without '=' is corrupt
    (counted as corrupt_tar), not read as a record (a name cut short by one byte, a key with an
    empty value) nor ended by a bare ValueError that counts the shard as unreadable."""
    from mpp.data.tarstream import CorruptTar, tar_files
    raw = _shard(tarfile.PAX_FORMAT)
    pax = [p for p in _headers(raw) if raw[p + 156:p + 157] == b"x"][0]
    for record in (b"path=x\n", b"11 path=abc", b"10 pathxy\n"):
        bad = _pax_record(raw, pax, record)
        with pytest.raises(CorruptTar, match="PAX header record"):
            list(tar_files(io.BytesIO(bad)))
        skips: dict = {}
        list(read_shard(_write(tmp_path / "p.tar", bad), skips))
        assert skips == {"corrupt_tar": 1}, record


def test_an_all_ones_base_256_size_is_a_corrupt_tar():
    """A base-256 size field of all 0xff bytes is -1, which no member holds: corrupt, where it
    read as an empty member and the stream went on from the wrong offset."""
    from mpp.data.tarstream import CorruptTar, tar_files
    raw = _shard(tarfile.GNU_FORMAT)
    for field in (b"\xff" * 12, b"\xff" * 11 + b"\xfe"):
        bad = _set_header(raw, _headers(raw)[1], lambda b: b.__setitem__(slice(124, 136), field))
        with pytest.raises(CorruptTar, match="negative"):
            list(tar_files(io.BytesIO(bad)))


def test_a_header_damaged_by_a_multiple_of_256_fails_its_checksum():
    """The checksum is compared modulo 65521, not 256: two name bytes each raised by 128 change the
    byte sum by exactly 256, and such a damaged header must still be refused, not read as valid."""
    from mpp.data.tarstream import CorruptTar, tar_files
    raw = bytearray(_shard(tarfile.GNU_FORMAT))
    pos = _headers(bytes(raw))[1]
    raw[pos] += 128  # the name's first two bytes ('k', '0'): still a name, under the same stored checksum
    raw[pos + 1] += 128
    with pytest.raises(CorruptTar, match="checksum"):
        list(tar_files(io.BytesIO(bytes(raw))))
    raw[pos + 1] -= 128  # a change of 128 alone: refused as before
    with pytest.raises(CorruptTar, match="checksum"):
        list(tar_files(io.BytesIO(bytes(raw))))


def test_an_extended_header_over_max_header_is_refused_and_one_at_it_read():
    """PAX and GNU long-name headers are held in memory whole, so one past MAX_HEADER bytes is
    corrupt (a shard could declare gigabytes of header); one of exactly MAX_HEADER bytes reads."""
    from mpp.data.tarstream import MAX_HEADER, CorruptTar, tar_files
    member = tarfile.TarInfo("k.cls")
    member.size = 1
    tail = member.tobuf(tarfile.USTAR_FORMAT) + b"1".ljust(512, b"\0") + bytes(1024)
    path = _record("path", b"big.cls")

    def extended(kind: bytes, body: bytes) -> bytes:
        info = tarfile.TarInfo("././@LongLink")
        info.type, info.size = kind, len(body)
        return info.tobuf(tarfile.USTAR_FORMAT) + body + bytes(-len(body) % 512)

    for size in (MAX_HEADER, MAX_HEADER + 1):
        comment = next(r for v in range(size - len(path) - 20, size) if len(r := _record("comment", b"c" * v))
                       == size - len(path))
        pax = extended(tarfile.XHDTYPE, path + comment)
        long = extended(tarfile.GNUTYPE_LONGNAME, b"n" * (size - 4) + b".cls")
        assert len(path + comment) == size
        if size == MAX_HEADER:
            assert list(tar_files(io.BytesIO(pax + tail))) == [("big.cls", b"1")]
            assert list(tar_files(io.BytesIO(long + tail))) == [("n" * (size - 4) + ".cls", b"1")]
        else:
            for bad in (pax, long):
                with pytest.raises(CorruptTar, match=f"limit {MAX_HEADER}"):
                    list(tar_files(io.BytesIO(bad + tail)))
