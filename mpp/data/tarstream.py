"""A fast, bounded reader of the regular-file members of a (plain, gzip, bzip2 or xz) tar stream.

Python's tarfile costs several times more per member than this (docs/benchmarks.md) and its stream
mode ends silently at a truncated header. This reader handles what shard writers produce (ustar +
PAX `path`/`size` records, GNU long names), verifies header checksums, and treats shards as
untrusted input: every member it reads is bounded in size, every header field is validated, and each
header block moves the stream forward, so any byte string ends in bounded time and memory. It raises
`TruncatedTar` when the stream ends early (a tar must end with its zero end-of-archive block) and
`CorruptTar` for anything malformed; both are `tarfile.ReadError`s.
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import tarfile
import zlib
from typing import BinaryIO, Callable, Iterator

BLOCK = 512
MAX_MEMBER = 256 << 20   # largest member read into memory (an image or a label); larger: CorruptTar
MAX_HEADER = 1 << 20     # largest PAX / GNU long-name header
SKIP_CHUNK = 1 << 20     # unselected members of unseekable streams are discarded in chunks of this
MAX_SIZE = 1 << 62       # a declared size past this is corrupt (no file holds it; a seek past it overflows)
MAX_INFLATE = 1000       # a compressed shard yields at most this many bytes a byte read, plus INFLATE_SLACK
INFLATE_SLACK = 16 << 20
READ_INFLATE = 10_000    # the members read (images, labels): at most this many bytes a byte read, plus READ_SLACK
READ_SLACK = MAX_MEMBER


class TruncatedTar(tarfile.ReadError):
    """The stream ended before the tar's end-of-archive block."""


class CorruptTar(tarfile.ReadError):
    """A header that is not a valid tar header, or a member over the size bounds."""


def _number(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # GNU base-256 for values octal cannot hold
        value = int.from_bytes(field[1:], "big", signed=field[:1] == b"\xff")
    else:
        try:
            value = int(field.split(b"\0", 1)[0].strip() or b"0", 8)
        except ValueError:
            raise CorruptTar(f"tar header number field {field!r} is not octal") from None
    if value < 0:
        raise CorruptTar(f"tar header number field is negative ({value})")
    return value


def _pax_size(value: str) -> int:
    """A PAX `size` record: decimal digits only (int() would take '²' or ' -5 ')."""
    if not (value.isascii() and value.isdigit()):
        raise CorruptTar(f"PAX size record {value!r} is not a decimal number")
    return int(value)


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> dict[str, str]:
    """PAX extended header records: 'LEN key=value\\n' ..., LEN counting the whole record."""
    out, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        if not digits.isdigit():
            raise CorruptTar("PAX header record without a length")
        end = pos + int(digits)
        if end <= space + 1 or end > len(data) or data[end - 1:end] != b"\n":
            raise CorruptTar(f"PAX header record of length {int(digits)} does not fit its header")
        key, eq, value = data[space + 1:end - 1].partition(b"=")
        if not eq:
            raise CorruptTar("PAX header record without '='")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    if "size" in out and not out["size"].isdigit():
        raise CorruptTar(f"PAX size {out['size']!r} is not a whole number")
    return out


def _checksum_ok(header: bytes) -> bool:
    """The header's stored checksum equals the sum of its bytes with the checksum field counted as
    spaces, checked modulo 65521 via zlib's adler32 (whose low 16 bits are 1 + the byte sum mod
    65521), far cheaper than Python's sum(); any change of fewer than 257 bytes is still caught."""
    stored = _number(header[148:156])
    return ((zlib.adler32(header) & 0xFFFF) - 1 - sum(header[148:156]) + 8 * 32 - stored) % 65521 == 0


def _read(f: BinaryIO, n: int) -> bytes:
    """Exactly n bytes; large reads go in chunks, so a header that declares more than the stream
    holds costs memory for what is there, not for what it declares."""
    data = f.read(n) if n <= SKIP_CHUNK else _read_chunks(f, n)
    if len(data) < n:
        raise TruncatedTar("unexpected end of data: the tar is truncated")
    return data


def _read_chunks(f: BinaryIO, n: int) -> bytes:
    parts, left = [], n
    while left > 0:
        part = f.read(min(left, SKIP_CHUNK))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _skip(f: BinaryIO, n: int, seekable: bool) -> None:
    """Move past n bytes without holding them: seek where possible, else read in bounded chunks."""
    if seekable:
        f.seek(n, 1)
        return
    while n > 0:
        n -= len(_read(f, min(n, SKIP_CHUNK)))


class _Prefixed:
    """A stream whose first bytes were already read (`head`), read from its start again."""

    def __init__(self, head: bytes, f: BinaryIO):
        self.head, self.f = head, f

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            out, self.head = self.head + self.f.read(), b""
            return out
        out, self.head = self.head[:n], self.head[n:]
        return out + self.f.read(n - len(out)) if len(out) < n else out

    def seekable(self) -> bool:
        return False


def _decompressed(f: BinaryIO) -> BinaryIO:
    """`f`, or its decompressed stream where it starts as gzip, bzip2 or xz does (.tar.gz, .tar.bz2,
    .tar.xz shards, all of which webdataset's reader takes), from any source: webdataset's pipe and
    HTTP streams cannot peek, so their first bytes are read and put back."""
    if hasattr(f, "peek"):
        head = f.peek(10)[:10]
    else:
        head = f.read(10)
        f = _Prefixed(head, f)
    raw = _Counted(f)
    kind = compression(head)
    if kind == "gzip":
        return _Inflated(gzip.GzipFile(fileobj=raw), raw)
    if kind == "bzip2":
        return _Inflated(_Bzip2(raw), raw)
    if kind == "xz":
        return _Inflated(lzma.LZMAFile(raw), raw)
    return f


def compression(head: bytes) -> str | None:
    """'gzip', 'bzip2' or 'xz' where a stream's first 10 bytes are that compressor's, else None."""
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    # bzip2's magic and its first block's: a plain tar's first member may be named 'BZh...'
    if head[:3] == b"BZh" and head[3:4] in b"123456789" and head[4:10] == b"1AY&SY":
        return "bzip2"
    return "xz" if head.startswith(b"\xfd7zXZ\x00") else None


class _Counted:
    """A stream that counts the bytes read from it."""

    def __init__(self, f: BinaryIO):
        self.f, self.n = f, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.n += len(data)
        return data


class _Inflated:
    """A decompressed stream in which all but the members read (headers, extended headers, skipped
    members) comes to at most MAX_INFLATE bytes a compressed byte (plus INFLATE_SLACK): a few KB of
    bzip2 can declare and hold terabytes of zeros, or of headers, which reading past would
    decompress for hours; past the bound it is CorruptTar. The members read (`payload`) have a bound
    of their own, READ_INFLATE bytes a compressed byte plus READ_SLACK (one largest member): a shard
    of highly redundant images reads, while one of hundreds of members named as images, each 256 MiB
    of zeros in a few hundred bytes, ends after the first. Unseekable, so a skip reads (and counts)
    what a seek would have decompressed anyway."""

    def __init__(self, f, raw: _Counted):
        self.f, self.raw, self.counted, self.payloads = f, raw, 0, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.counted += len(data)
        if self.counted > MAX_INFLATE * self.raw.n + INFLATE_SLACK:
            raise CorruptTar(f"the shard's headers and skipped members decompress to more than {MAX_INFLATE} times "
                             f"its size (a compression bomb: {self.counted} bytes from {self.raw.n})")
        return data

    def payload(self, n: int) -> bytes:
        """n bytes of a member that is read, counted apart."""
        data = _read(self.f, n)
        self.payloads += len(data)
        if self.payloads > READ_INFLATE * self.raw.n + READ_SLACK:
            raise CorruptTar(f"the shard's members decompress to more than {READ_INFLATE} times its size "
                             f"(a compression bomb: {self.payloads} bytes from {self.raw.n})")
        return data

    def seekable(self) -> bool:
        return False


class _Bzip2:
    """A bzip2 stream whose damaged data raise CorruptTar, as damaged gzip and xz data count (bz2
    raises a bare OSError, which a failed read of the shard's source raises too)."""

    def __init__(self, f: BinaryIO):
        self.f = bz2.BZ2File(f)

    def read(self, n: int = -1) -> bytes:
        return self._call(self.f.read, n)

    @staticmethod
    def _call(fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            if e.args == ("Invalid data stream",):
                raise CorruptTar("bzip2 data are damaged: the shard is corrupt") from e
            raise


def tar_files(f: BinaryIO, select: Callable[[str], bool] | None = None, max_member: int = MAX_MEMBER,
              unread: bool = False) -> Iterator[tuple[str, bytes | None]]:
    """(name, bytes) of each regular file in the tar stream `f`, in archive order; with `select`,
    only of the names it accepts (the others are skipped without being held in memory, whatever
    their size; with `unread`, yielded as (name, None), so that a caller still sees every name).
    A member larger than `max_member` bytes that would be read raises CorruptTar."""
    f = _decompressed(f)
    seekable = f.seekable() if hasattr(f, "seekable") else False
    pax: dict[str, str] = {}
    longname = None
    while True:
        header = _read(f, BLOCK)
        if header.count(0) == BLOCK:
            return  # end-of-archive block
        if not _checksum_ok(header):
            raise CorruptTar("bad tar header checksum: the tar is corrupt")
        kind = header[156:157]
        size = _pax_size(pax["size"]) if "size" in pax else _number(header[124:136])
        if size > MAX_SIZE:  # skipping it would overflow a seek, not end as a truncated tar
            raise CorruptTar(f"tar header declares {size} bytes, more than any file holds")
        padded = size + (-size % BLOCK)
        if kind in (b"x", b"L", b"g", b"K"):
            if size > MAX_HEADER:
                raise CorruptTar(f"tar extended header of {size} bytes (limit {MAX_HEADER})")
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
            if size > max_member:
                raise CorruptTar(f"tar member '{name}' declares {size} bytes (limit {max_member})")
            data = f.payload(padded) if isinstance(f, _Inflated) else _read(f, padded)
            yield name, data[:size] if padded != size else data
            continue
        if padded:
            _skip(f, padded, seekable)
        if unread and kind in (b"0", b"\0", b"7"):
            yield name, None
