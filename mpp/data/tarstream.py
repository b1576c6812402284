"""A fast reader of the regular-file members of a (plain or gzip) tar stream.

Python's tarfile costs ~140 us per member (PAX parsing, full header decoding), more than decoding
a 32x32 JPEG, and its stream mode ends silently at a truncated header. This reader handles what
shard writers produce (ustar + PAX `path`/`size` records, GNU long names), verifies header
checksums, takes ~25 us per member, and raises `tarfile.ReadError` on any truncation (a tar must
end with its zero end-of-archive block).
"""
from __future__ import annotations

import gzip
import tarfile
import zlib
from typing import BinaryIO, Callable, Iterator

BLOCK = 512


def _number(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # GNU base-256 for values octal cannot hold
        return int.from_bytes(field[1:], "big", signed=field[:1] == b"\xff")
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> dict[str, str]:
    """PAX extended header records: 'LEN key=value\\n' ..."""
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        end = pos + int(data[pos:space])
        key, _, value = data[space + 1:end - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def _checksum_ok(header: bytes) -> bool:
    """The header's stored checksum equals the sum of its bytes with the checksum field counted as
    spaces, checked modulo 65521 via zlib's adler32 (whose low 16 bits are 1 + the byte sum mod
    65521): ~0.3 us instead of ~2.7 us for Python's sum() over 512 bytes. Any change of fewer than
    257 bytes is still caught."""
    stored = _number(header[148:156])
    return ((zlib.adler32(header) & 0xFFFF) - 1 - sum(header[148:156]) + 8 * 32 - stored) % 65521 == 0


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) < n:
        raise tarfile.ReadError("unexpected end of data: the tar is truncated")
    return data


def tar_files(f: BinaryIO, select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular file in the tar stream `f`, in archive order; with `select`,
    only of the names it accepts (the others' bytes are skipped: seeked over when `f` can seek)."""
    peek = getattr(f, "peek", None)
    if peek is not None and peek(2)[:2] == b"\x1f\x8b":
        f = gzip.GzipFile(fileobj=f)
    seekable = f.seekable() if hasattr(f, "seekable") else False
    pax: dict[str, str] = {}
    longname = None
    while True:
        header = _read(f, BLOCK)
        if header.count(0) == BLOCK:
            return  # end-of-archive block
        if not _checksum_ok(header):
            raise tarfile.ReadError("bad tar header checksum: the tar is corrupt")
        kind = header[156:157]
        size = int(pax["size"]) if "size" in pax else _number(header[124:136])
        padded = size + (-size % BLOCK)
        if kind in (b"x", b"L", b"g", b"K"):
            data = _read(f, padded)[:size]
            if kind == b"x":  # PAX header for the next member
                pax = _pax(data)
            elif kind == b"L":  # GNU long name for the next member
                longname = _text(data)
            continue  # g: global PAX header, K: GNU long link name
        name = pax.get("path") or longname or _text(header[0:100])
        if not (pax.get("path") or longname) and header[257:262] == b"ustar" and header[345] != 0:
            name = _text(header[345:500]) + "/" + name
        pax, longname = {}, None
        if kind in (b"0", b"\0", b"7") and (select is None or select(name)):
            data = _read(f, padded)
            yield name, data[:size] if padded != size else data
        elif padded and seekable:
            f.seek(padded, 1)
        else:
            _read(f, padded)
