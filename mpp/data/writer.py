"""Image folder or tar archive -> WebDataset shards `OUT/NNNNNN.tar` + `OUT/manifest.json`
(+ `OUT/labels.json` when labeled: each shard's [key, label] pairs, so that class-balanced subsets
are chosen without reading the shards). The manifest records each shard's size in bytes and the
label index's SHA-256, so a reader can tell when either changed after it was written.

Each sample holds `__key__` (from the file's relative path, unique and stable), the image bytes
exactly as in the source under the extension of their real format (`jpg`, `png`, `webp`, ...;
never re-encoded) and `cls` (the integer label) when labeled. Sample order is shuffled across
shards with a seed, so a shard is never one class.

Every file is checked before it is written: it must open as one of `FORMAT_EXT`'s formats, be at
most `max_pixels` large and decode completely. JPEGs are decoded at 1/8 scale (PIL `draft`),
which still reads the whole entropy-coded stream, so a truncated JPEG is caught at a fraction
of a full decode; other formats are fully decoded. Files that fail are reported (count and first
names, in the manifest and as a warning) and skipped, never written. Corruption that libjpeg
only warns about (garbled data of the right length) is not caught here; the reader's decoder
counts whatever still fails to decode.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import importlib.metadata
import io
import json
import logging
import lzma
import os
import random
import re
import shutil
import stat
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Iterator, Sequence

import webdataset as wds
from PIL import Image
from tqdm import tqdm

from mpp.config import DataConfig
from mpp.data.sources import META
from mpp.data.tarstream import BLOCK, MAX_MEMBER
from mpp.data.transforms import beyond_16_bits
from mpp.fileio import fsync, write_atomic

log = logging.getLogger(__name__)

# PIL format -> shard extension. Only these are accepted (and identified) as images.
FORMAT_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "TIFF": "tiff", "PPM": "ppm"}
MANIFEST = "manifest.json"
LABELS = "labels.json"  # per shard, the [key, label] of its samples: subsets read it, not the shards
SHARD_RE = re.compile(r"^\d{6}\.tar$")
SAMPLES_PER_SHARD = 2000
BYTES_PER_SHARD = 256 * 2**20
_MTIME = 0          # fixed member time: the same source and seed give byte-identical shards
_BLOCK, _RECORD = 512, 10240  # tar block and record sizes (tarfile pads archives to a record)

# A source entry: (path relative to the source root with '/' separators, reader of its bytes, label).
Item = tuple[str, Callable[[], bytes], "int | None"]


class ShardError(ValueError):
    """A bad source or output folder; the message says what to do."""


def probe_image(data: bytes, max_pixels: int = DataConfig.max_pixels) -> str:
    """The shard extension of an image's bytes; raises ValueError saying why they are not usable."""
    try:
        with Image.open(io.BytesIO(data), formats=list(FORMAT_EXT)) as im:
            fmt, (w, h) = im.format, im.size
            if w * h > max_pixels:
                raise ValueError(f"too large ({w}x{h} pixels, limit {max_pixels})")
            if im.mode == "F":  # the loader refuses it (decode._open_pil): no one reading as 8-bit pixels
                raise ValueError("floating-point pixels (PIL mode F); convert it to 8 or 16 bits")
            fmt = "JPEG" if fmt == "MPO" else fmt  # a phone's JPEG with a multi-picture segment: Pillow's JPEG opens it
            if fmt == "JPEG":
                im.draft(im.mode, (1, 1))  # 1/8-scale decode: still reads every byte
            im.load()
            if beyond_16_bits(im):  # as the loader refuses it
                raise ValueError("integer pixels beyond 16 bits (PIL mode I); convert it to 8 or 16 bits")
    except ValueError:
        raise
    except Exception as e:  # PIL raises many kinds for bad data
        reason = "not an image" if isinstance(e, Image.UnidentifiedImageError) else f"corrupt ({e})"
        raise ValueError(reason) from None
    return FORMAT_EXT[fmt]


def sample_keys(names: Sequence[str]) -> list[str]:
    """`__key__` per relative path: the path without its extension, dots in the file stem turned
    into '_' (webdataset splits a member name at the stem's first dot), an 'x' before a key that
    webdataset would read as metadata ('__background__/3'); clashes get '_2', '_3'..."""
    keys, seen = [], set()
    for name in names:
        folder, _, base = name.rpartition("/")
        stem = (base.rsplit(".", 1)[0] if "." in base[1:] else base).replace(".", "_") or "_"
        key = f"{folder}/{stem}" if folder else stem
        key = "x" + key if META.match(key) else key
        unique, n = key, 1
        while unique in seen:
            n += 1
            unique = f"{key}_{n}"
        seen.add(unique)
        keys.append(unique)
    return keys


def _tar_bytes(member_bytes: int) -> int:
    """Size of a finished tar file from its members' bytes (`_member_bytes`): end blocks, record padding."""
    size = member_bytes + 2 * _BLOCK
    return -(-size // _RECORD) * _RECORD


def _member_bytes(name: str, data: bytes) -> int:
    """A member's bytes in a shard: its header as tarfile writes it by default (PAX: a long or
    non-ASCII name takes an extended header) and its data padded to whole blocks."""
    return len(tarfile.TarInfo(name).tobuf(tarfile.DEFAULT_FORMAT)) + _padded(len(data))


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


NOT_A_FILE = "not a regular file (a FIFO, socket or device), which make_shards does not read"
STAGING = ".mpp-staging."  # the name of `_staged`'s folder starts so: no data set, nor a source's class


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an `out` that is a file, or a non-empty one unless `overwrite`."""
    if out.exists() and not out.is_dir():
        raise ShardError(f"output '{out}' is a file; give a folder for the shards")
    if not overwrite and out.is_dir() and any(not p.name.startswith(STAGING) for p in out.iterdir()):
        raise ShardError(f"output folder '{out}' is not empty; choose a new folder or overwrite it (--overwrite)")


def _data_files(folder: Path) -> list[str]:
    """The names of the data set's files in `folder`: shards, label index, then the manifest."""
    names = [p.name for p in folder.iterdir() if p.name in (MANIFEST, LABELS) or SHARD_RE.match(p.name)]
    return sorted(names, key=lambda name: name == MANIFEST)


def _replace(out: Path, new: Path, old: Path) -> None:
    """Move the data set in `new` into `out`, its old one's files into `old`. The old manifest goes
    first and the new one last, so `out` never holds a manifest that does not describe its shards,
    and other files in `out` stay; a failure moves everything back."""
    moves: list[tuple[Path, Path]] = []
    try:
        for src, dst in [*((out / n, old / n) for n in reversed(_data_files(out))),
                         *((new / n, out / n) for n in _data_files(new))]:
            os.rename(src, dst)
            moves.append((src, dst))
    except BaseException:
        for src, dst in reversed(moves):
            os.rename(dst, src)
        raise


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """Yield an empty folder to write a data set in; when the block ends without error, its
    files replace those of `out` (`_replace`). It lies in `out` (on its filesystem: a rename
    moves the files), which is made for it and removed again, with the folders made on the way,
    if the write fails; the staging folder is removed whatever happens, so a failure (no readable
    image, Ctrl-C, a full disk) leaves `out` as it was, and one left by a killed writer is removed
    by the next write to `out` and never counted as data."""
    made = [p for p in (out.absolute(), *out.absolute().parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(STAGING + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    work, done = Path(tempfile.mkdtemp(prefix=STAGING, dir=out)), False
    try:
        (work / "new").mkdir()
        yield work / "new"
        (work / "old").mkdir()
        _replace(out, work / "new", work / "old")
        fsync(out)
        done = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for folder in [] if done else made:  # deepest first; one that holds something else stays
            with contextlib.suppress(OSError):
                folder.rmdir()


def write_samples(items: Sequence[Item], out: str | Path, *, classes: list[str] | None, seed: int = 0,
                  samples_per_shard: int = SAMPLES_PER_SHARD, bytes_per_shard: int = BYTES_PER_SHARD,
                  max_pixels: int = DataConfig.max_pixels, made: dict | None = None,
                  overwrite: bool = False, progress: bool = True) -> dict:
    """Check, shuffle (seeded) and write `items` as shards in `out`; returns the manifest it writes.

    A shard holds at most `samples_per_shard` samples and its file at most `bytes_per_shard`
    bytes (unless one sample alone is bigger). `made` (source, options, ...) goes into the
    manifest with the seed, tool version and time. The manifest is written last (after
    labels.json), so a folder with a manifest is complete. The set is written in a temporary
    folder and replaces the shards, label index and manifest in `out` only when complete
    (`_staged`), so bad input, a failure or Ctrl-C leaves `out` as it was.
    """
    if samples_per_shard < 1 or bytes_per_shard < 1:
        raise ShardError("samples per shard and bytes per shard must be >= 1")
    out = Path(out)
    _check_out(out, overwrite)
    with _staged(out) as new:
        order = list(range(len(items)))
        random.Random(seed).shuffle(order)
        keys = sample_keys([name for name, _, _ in items])

        shards: list[dict] = []
        labels: list[list] = []  # per shard, [key, label] of each labeled sample
        skipped: list[str] = []
        formats: dict[str, int] = {}
        writer, count, payload = None, 0, 0
        with contextlib.ExitStack() as current:
            for i in tqdm(order, desc=f"writing {out}", unit="img", disable=not progress):
                name, read, label = items[i]
                try:
                    data = read()
                    ext = probe_image(data, max_pixels)  # names of any length: the shards are PAX tars
                except (OSError, ValueError) as e:
                    skipped.append(f"{name}: {e}")
                    continue
                sample = {"__key__": keys[i], ext: data}
                if label is not None:
                    sample["cls"] = str(label).encode()
                size = sum(_member_bytes(f"{keys[i]}.{k}", v) for k, v in sample.items() if k != "__key__")
                if writer is None or count >= samples_per_shard or (
                        count and _tar_bytes(payload + size) > bytes_per_shard):
                    current.close()  # the shard before, if any
                    shards.append({"name": f"{len(shards):06d}.tar", "num_samples": 0})
                    labels.append([])
                    # a file opened here: given its path, webdataset reads it as a URL ('pipe:' in a folder's
                    # name ran a shell command, 'v2:' had no handler)
                    file = current.enter_context(open(new / shards[-1]["name"], "wb"))
                    writer = wds.TarWriter(file, encoder=False, mtime=_MTIME)
                    current.callback(writer.close)  # first out: the tar's end, then the file
                    count = payload = 0
                writer.write(sample)
                if label is not None:
                    labels[-1].append([keys[i], label])
                count, payload = count + 1, payload + size
                shards[-1]["num_samples"] = count
                formats[ext] = formats.get(ext, 0) + 1
        for shard in shards:  # what the reader checks the shards against (sources.check_shard_sizes)
            shard["bytes"] = (new / shard["name"]).stat().st_size
            fsync(new / shard["name"])  # on the disk before the manifest that vouches for it

        report = {"count": len(skipped), "examples": skipped[:10]}
        if skipped:
            log.warning("skipped %d unreadable or non-image files, e.g. %s", len(skipped), "; ".join(skipped[:3]))
        if not shards:
            raise ShardError(f"no readable images to write ({len(skipped)} files skipped"
                             + (f", e.g. {skipped[0]})" if skipped else ")"))
        written = {label for shard in labels for _, label in shard}
        if classes and (empty := [c for i, c in enumerate(classes) if i not in written]):
            there = sum(x.split("/", 1)[0] in empty for x in skipped)
            log.warning("class folder(s) %s hold no readable image (%d files skipped there): each keeps its label, "
                        "with no samples", ", ".join(map(repr, empty[:5])), there)
        index = json.dumps(labels).encode()
        manifest = {
            "num_samples": sum(s["num_samples"] for s in shards),
            "shards": shards,
            "classes": classes,
            **({"labels": LABELS, "labels_sha256": hashlib.sha256(index).hexdigest()} if classes else {}),
            "formats": formats,
            "skipped": report,
            "made": {**(made or {}), "seed": seed, "samples_per_shard": samples_per_shard,
                     "bytes_per_shard": bytes_per_shard, "max_pixels": max_pixels,
                     "tool": f"mpp {importlib.metadata.version('mpp')}, "
                             f"webdataset {importlib.metadata.version('webdataset')}",
                     "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        }
        if classes:
            write_atomic(new / LABELS, index)
        write_atomic(new / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def _outside_class_folder() -> bytes:
    raise ValueError("outside any class folder")


def _class_folder(name: str) -> str | None:
    """The class of a file: its top folder, none for a file outside one or in a folder that is no
    class (a zip's __MACOSX, a hidden folder such as .ipynb_checkpoints), which, sorted first as a
    class, would shift every real class's label by one."""
    top = name.split("/", 1)[0] if "/" in name else None
    return None if top is None or _junk(top) else top


def _junk(folder: str) -> bool:
    """A folder that is no class: a zip's __MACOSX, a hidden one, a disk's lost+found."""
    return folder in ("__MACOSX", "lost+found") or folder.startswith(".")


def _label_items(names: list[str], readers: list[Callable[[], bytes]], folders: set[str], unlabeled: bool,
                 src: Path) -> tuple[list[Item], list[str] | None]:
    """Items labeled by their top folder (`_class_folder`; classes sorted by name give 0, 1, ...,
    as ImageFolder, empty top `folders` too: a test split's empty class would shift every later
    label); files outside any class folder become items that are reported and skipped."""
    if unlabeled:
        return [(n, r, None) for n, r in zip(names, readers)], None
    classes = sorted({c for n in names if (c := _class_folder(n))} | {f for f in folders if not _junk(f)})
    if not classes:
        raise ShardError(f"source '{src}' has no class sub-folders (__MACOSX and hidden folders are none); put "
                         "each class in its own folder or treat it as unlabeled (--unlabeled)")
    if len(classes) == 1:
        log.warning("source '%s' has one class folder, '%s': every image gets label 0 (a supervised run or a "
                    "fine-tune needs 2 or more); if the class folders lie one level down, give a source with them at "
                    "its top (that folder, or a tar packed from it)", src, classes[0])
    index = {c: i for i, c in enumerate(classes)}
    return [(n, r, index[c]) if (c := _class_folder(n)) else (n, _outside_class_folder, None)
            for n, r in zip(names, readers)], classes


def _image_name(name: str) -> bool:
    """Whether a file name has the extension of an image format the shards take."""
    return Image.registered_extensions().get(os.path.splitext(name)[1].lower()) in FORMAT_EXT


def _folder_entries(root: Path, unlabeled: bool) -> tuple[list[str], list[Callable[[], bytes]], set[str]]:
    """Every entry but folders (a dangling link, a FIFO too: their readers raise, so they are
    skipped and counted, not dropped unsaid), readers for them, and the top folders. Links to
    folders are followed, as links to files are (a subset's class folders are often links;
    Path.rglob skipped them and every later class's label moved down), but not back into a folder
    they lie in (a loop). A folder that cannot be listed is an error, its images would be lost,
    unless it lies in one that is no class (labeled: another user's .Trash-1000, a lost+found)."""
    names, above, tops = [], {str(root): {os.path.realpath(root)}}, set()

    def unlisted(e: OSError) -> None:
        top = Path(e.filename).relative_to(root).parts[:1]
        if unlabeled or not top or not _junk(top[0]):
            raise ShardError(f"cannot list folder '{e.filename}' ({e.strerror}): its images would be left out "
                             "and, were it a class, every later class's label would shift; make it readable "
                             "(chmod -R a+rX) or move it out of the source")
        log.warning("cannot list folder '%s' (%s), which is no class: left out", e.filename, e.strerror)
    for folder, dirs, files in os.walk(root, onerror=unlisted, followlinks=True):
        chain = above.pop(folder)
        real = {d: os.path.realpath(os.path.join(folder, d)) for d in dirs if not d.startswith(STAGING)}
        dirs[:] = [d for d, r in real.items() if r not in chain]
        above.update((os.path.join(folder, d), chain | {real[d]}) for d in dirs)
        rel = Path(folder).relative_to(root)
        names += [(rel / f).as_posix() for f in files if not f.startswith(STAGING)]
        if not rel.parts:  # the root
            tops = set(dirs)
    names.sort()
    return names, [functools.partial(_read_file, root / n) for n in names], tops


def _read_file(path: Path) -> bytes:
    """A file's bytes; one past `MAX_MEMBER` (what the loader reads of a member) is not read: the
    error skips and counts it, where written it would cost the reader the rest of its shard; nor is
    one that is no regular file (a FIFO would wait forever) or a dangling link (its stat raises)."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(NOT_A_FILE)
    if st.st_size > MAX_MEMBER:
        raise ValueError(_past_limit(st.st_size))
    return path.read_bytes()


def _past_limit(size: int) -> str:
    return f"{size} bytes, past the {MAX_MEMBER >> 20} MiB a shard member may hold"


def _tar_entries(tar: tarfile.TarFile) -> tuple[list[str], list[Callable[[], bytes]], set[str]]:
    """Member names (without a single common top folder of the files), readers for any order,
    seeking in a plain tar (`_random_access`), and the top folders. A member past `MAX_MEMBER` (the
    most the loader reads) or a sparse one (a 10 KB archive can declare any size) is never read,
    nor a link (not followed) or a device or FIFO, nor a member that a later one of the same path
    replaces (as extracting the tar would): their readers raise, and each is skipped and counted.
    The member written takes its path's key, as from a folder; one it replaces, the next ('_2')."""
    last = {_path(m): m for m in tar.getmembers()}  # archive order: the last of a path wins
    members = sorted((m for m in tar.getmembers() if not m.isdir()), key=lambda m: (_path(m), last[_path(m)] is not m))
    names = [_path(m) for m in members]
    # links, never written, decide nothing, nor a zip's '__MACOSX/' or a hidden folder (macOS archives hold both)
    files = [n for n, m in zip(names, members) if m.isfile() and not _junk(n.split("/", 1)[0])]
    tops = {n.split("/", 1)[0] for n in files if "/" in n}
    # 'train/CLASS/x.jpg': the folder is 'train/', whatever else lies in it beside the class
    # folders ('train/.DS_Store' is then a file outside any class folder), unless images do; a
    # file beside 'train/' (a README.txt) is outside any class folder and decides nothing
    if (len(tops) == 1 and any(n.count("/") >= 2 for n in files)
            and not any(n.count("/") == 1 and _image_name(n) for n in files)):
        top = f"{tops.pop()}/"
        names = [n.removeprefix(top) for n in names]
    else:
        top = ""
    folders = [d.removeprefix(top) for m in tar.getmembers() if m.isdir() and (d := _path(m)).startswith(top)]
    return names, [_reader(tar, m, last[_path(m)]) for m in members], {
        d.split("/", 1)[0] for d in folders if d not in ("", ".")}


def _path(m: tarfile.TarInfo) -> str:
    """A member's path as extracting the tar would write it ('./a/x.jpg', '/a/x.jpg': 'a/x.jpg')."""
    return os.path.normpath(m.name).lstrip("/")


def _reader(tar: tarfile.TarFile, m: tarfile.TarInfo, latest: tarfile.TarInfo) -> Callable[[], bytes]:
    """Member `m`'s bytes on call, or, for a member that is not written (`latest`: the last member
    of its path), a reader that raises why: the writer then skips and counts it."""
    if m.isdev():
        why = NOT_A_FILE
    elif not m.isfile():
        why = "a link, which make_shards does not follow; store the file"
    elif latest is not m:
        why = "replaced by a later member of the same path"
    elif m.issparse() or m.size > MAX_MEMBER:
        why = ("a sparse file, which make_shards does not read; store it without --sparse" if m.issparse()
               else _past_limit(m.size))  # a sparse file's size is any it declares, not what was stored
    else:
        return lambda: tar.extractfile(m).read()
    return functools.partial(_unread, why)


def _unread(why: str) -> bytes:
    raise ValueError(why)


def _random_access(tar: tarfile.TarFile, src: Path, out: Path, stack: contextlib.ExitStack) -> tarfile.TarFile:
    """`tar` for reading its members in any order, and whole: a compressed one is decompressed into a
    temporary file in `out`'s nearest existing folder first (its members in memory would hold the
    whole set; seeking in the compressed stream decompresses from the start for each). A plain tar
    must end with its end-of-archive block: one cut at a member's end reads as a smaller, complete
    set, and tarfile also stops without a word at a damaged header past the first."""
    if not isinstance(tar.fileobj, io.BufferedReader):
        where = next(p for p in (out.absolute(), *out.absolute().parents) if p.is_dir())
        tar.fileobj.seek(0)
        try:
            tmp = stack.enter_context(tempfile.TemporaryFile(dir=where))
        except OSError as e:
            raise ShardError(f"cannot decompress '{src}' into {where} ({e}); decompress it yourself and give the "
                             ".tar") from None
        while chunk := tar.fileobj.read(1 << 20):  # a damaged stream raises here: the caller says so
            try:
                tmp.write(chunk)
            except OSError as e:
                raise ShardError(f"no room to decompress '{src}' into {where} ({e}); free space there, or "
                                 "decompress it yourself and give the .tar") from None
        tmp.seek(0)
        tar = stack.enter_context(tarfile.open(fileobj=tmp, mode="r:"))
    tar.getmembers()
    tar.fileobj.seek(tar.offset)
    if tar.fileobj.read(BLOCK).count(0) != BLOCK:
        raise ShardError(f"tar archive '{src}' ends, or has a damaged header, at byte {tar.offset} before its "
                         "end-of-archive block: it was cut short (an interrupted copy or download) or is corrupt; "
                         "copy it again")
    return tar


def write_shards(src: str | Path, out: str | Path, *, unlabeled: bool = False,
                 samples_per_shard: int = SAMPLES_PER_SHARD, bytes_per_shard: int = BYTES_PER_SHARD,
                 seed: int = 0, overwrite: bool = False, progress: bool = True) -> dict:
    """Shard an image folder (one sub-folder per class) or a tar archive holding one; returns the
    manifest. `unlabeled`: every image file anywhere in the tree, no labels."""
    src = Path(src)
    made = {"source": str(src.resolve()), "unlabeled": unlabeled}
    kw = dict(seed=seed, samples_per_shard=samples_per_shard, bytes_per_shard=bytes_per_shard,
              made=made, overwrite=overwrite, progress=progress)
    if src.is_dir():
        if Path(out).resolve().is_relative_to(src.resolve()):  # its shards would be read as a class of images
            raise ShardError(f"output folder '{out}' lies inside the source folder '{src}', so a second run would "
                             "read its shards' folder as a class; write the shards outside the source")
        items, classes = _label_items(*_folder_entries(src, unlabeled), unlabeled, src)
        return write_samples(items, out, classes=classes, **kw)
    if src.is_file():
        _check_out(Path(out), overwrite)  # before any decompression
        try:
            tar = tarfile.open(src, "r:*")
        # ValueError: a size field past any offset; EOFError and the others: a cut or garbled compressed stream
        except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError, ValueError, OverflowError) as e:
            raise ShardError(f"source '{src}' is neither a folder nor a readable tar archive ({e})") from None
        with contextlib.ExitStack() as stack:
            stack.enter_context(tar)
            try:
                entries = _tar_entries(_random_access(tar, src, Path(out), stack))
            except ShardError:
                raise
            except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError, ValueError, OverflowError) as e:
                raise ShardError(f"tar archive '{src}' is damaged ({e}); re-create or re-download it") from None
            items, classes = _label_items(*entries, unlabeled, src)
            return write_samples(items, out, classes=classes, **kw)
    if src.exists():  # a pipe (<(tar c ...)), a device: read whole in any order, a tar must be a file
        raise ShardError(f"source '{src}' is neither a folder nor a regular file; give an image folder or a tar "
                         "archive saved to a file")
    raise ShardError(f"source '{src}' does not exist; give an image folder or a tar archive")
