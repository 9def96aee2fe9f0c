"""Row arrays on disk: memory-mapped reads, block-by-block writes, sharded caches.

Every feature cache of the package (image features, fragment features, the
N-pair backbone maps) is an array whose first axis is the item (image or
caption). At the papers' sizes these arrays are larger than the machine's
memory (Flickr30K VGG maps: 29,783 × 14 × 14 × 512 float32 = 12 GB; COCO
fragments 113,287 × 20 × 4096 = 37 GB), so nothing here ever holds a whole
array: reads memory-map, checks run block by block, writes go block by block
into a memory-mapped ``.npy`` that is renamed into place when complete, and a
cache built over a long time is written as ~1 GB shards that a restarted build
resumes from.

Storage dtype: float32 by default; ``float16`` halves disk and page-cache use
(the batch gather casts rows back to float32, so models never see half
precision unless asked to).

A sharded array is a folder::

    rows.json            {"shape": [N, ...], "dtype": "float16", "shards": [rows, ...]}  (written last)
    shard_00000.npy ...  consecutive blocks of rows

`open_rows` opens a ``.npy`` file or such a folder alike; both index like an
array (``a[i]``, ``a[indices]``, ``a[start:stop]``) and read only the rows
asked for.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import mmap
import os
import pathlib
from typing import Callable, Iterable, Sequence

import numpy as np

from tf_twobranch.errors import ConfigError, DataFormatError

__all__ = ["FEATURE_DTYPES", "storage_dtype", "open_rows", "ShardedRows", "RowWriter",
           "ShardedRowWriter", "check_finite_rows", "check_finite_once", "checked_once", "scan_record_path",
           "file_fingerprint", "read_rows", "gather_rows", "rows_in_blocks", "write_rows",
           "BLOCK_BYTES", "SHARD_BYTES"]

logger = logging.getLogger(__name__)

FEATURE_DTYPES = ("float32", "float16")
# Rows are checked, cast and copied in blocks of about this many bytes.
BLOCK_BYTES = 64 << 20
# A sharded cache starts a new shard after about this many bytes.
SHARD_BYTES = 1 << 30
_MANIFEST = "rows.json"


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype of a ``--feature_dtype`` value."""
    if name not in FEATURE_DTYPES:
        raise ConfigError(f"feature_dtype must be one of {FEATURE_DTYPES}, got {name!r}")
    return np.dtype(name)


def _row_bytes(array) -> int:
    return max(1, int(np.prod(array.shape[1:], dtype=np.int64)) * np.dtype(array.dtype).itemsize)


def rows_in_blocks(array, block_bytes: int = BLOCK_BYTES) -> Iterable[tuple[int, int]]:
    """(start, stop) row ranges of about `block_bytes` each."""
    step = max(1, block_bytes // _row_bytes(array))
    for start in range(0, len(array), step):
        yield start, min(start + step, len(array))


class ShardedRows:
    """A read-only row array stored as consecutive ``.npy`` shards (memory-mapped)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = pathlib.Path(folder)
        manifest = self.folder / _MANIFEST
        try:
            meta = json.loads(manifest.read_text())
            self.shape = tuple(int(n) for n in meta["shape"])
            self.dtype = np.dtype(meta["dtype"])
            counts = [int(n) for n in meta["shards"]]
        except FileNotFoundError:
            raise DataFormatError(self.folder, f"no {_MANIFEST}: not a complete sharded array "
                                  "(an interrupted cache build resumes when run again)") from None
        except (ValueError, KeyError, TypeError) as err:
            raise DataFormatError(manifest, f"not a sharded-array manifest ({err})") from None
        if sum(counts) != self.shape[0]:
            raise DataFormatError(manifest, f"shards hold {sum(counts)} rows, shape says {self.shape[0]}")
        self._shards = []
        for k, count in enumerate(counts):
            path = self.folder / f"shard_{k:05d}.npy"
            shard = _load_npy(path)
            if shard.shape != (count,) + self.shape[1:] or shard.dtype != self.dtype:
                raise DataFormatError(path, f"shard is {shard.shape} {shard.dtype}, the manifest says "
                                      f"{(count,) + self.shape[1:]} {self.dtype}")
            self._shards.append(shard)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"row {index} out of range for {len(self)} rows")
            k = int(np.searchsorted(self._starts, i, side="right")) - 1
            return self._shards[k][i - self._starts[k]]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            parts = []
            for k, shard in enumerate(self._shards):
                lo, hi = max(start, self._starts[k]), min(stop, self._starts[k + 1])
                if lo < hi:
                    parts.append(shard[lo - self._starts[k]:hi - self._starts[k]])
            if not parts:
                return np.zeros((0,) + self.shape[1:], self.dtype)
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        index = np.asarray(index)
        if index.dtype == bool:
            index = np.flatnonzero(index)
        index = index.astype(np.int64).reshape(-1)
        if len(index) and (index.min() < -len(self) or index.max() >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        index = np.where(index < 0, index + len(self), index)
        out = np.empty((len(index),) + self.shape[1:], self.dtype)
        shard_of = np.searchsorted(self._starts, index, side="right") - 1
        for k in np.unique(shard_of):
            where = np.flatnonzero(shard_of == k)
            out[where] = self._shards[k][index[where] - self._starts[k]]
        return out

    def __array__(self, dtype=None, copy=None):
        whole = self[0:len(self)]
        return whole if dtype is None else whole.astype(dtype)


def _load_npy(path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise DataFormatError(path, "file does not exist") from None
    except (ValueError, OSError) as err:
        raise DataFormatError(path, f"cannot read the .npy file: it looks truncated or is not a NumPy "
                              f".npy file ({err})") from None


def open_rows(path: str | os.PathLike):
    """A memory-mapped ``.npy`` file, or a sharded-array folder (`ShardedRows`)."""
    path = pathlib.Path(path)
    if path.is_dir():
        return ShardedRows(path)
    if not path.exists():
        raise DataFormatError(path, "file does not exist")
    return _load_npy(path)


def _whole_map(array) -> tuple[str, int] | None:
    """(file, byte offset of row 0) when `array` is a whole C-contiguous memory-mapped ``.npy``
    (what `open_rows` / `RowWriter` give), else None (a view, an in-memory array, another map)."""
    if not isinstance(array, np.memmap) or not array.filename or not array.flags.c_contiguous:
        return None
    buffer = getattr(array, "_mmap", None)
    if buffer is None or buffer.closed:
        return None
    start = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY
    base = np.frombuffer(buffer, np.uint8).ctypes.data
    if array.ctypes.data != base + (array.offset - start):
        return None   # a view of the map: its `offset` is its parent's
    return array.filename, int(array.offset)


def read_rows(array, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a row array as a new in-memory array.

    A memory-mapped ``.npy`` (or a sharded folder of them) is read through
    the file, not through its mapping: the pages land in the page cache but
    are never mapped into this process, so a pass over a 40 GB file leaves
    the process's resident size (RSS) where it was. Other arrays are sliced.
    """
    if isinstance(array, ShardedRows):
        parts = [read_rows(shard, max(start, lo) - lo, min(stop, hi) - lo)
                 for shard, lo, hi in zip(array._shards, array._starts[:-1], array._starts[1:])
                 if max(start, lo) < min(stop, hi)]
        if not parts:
            return np.zeros((0,) + array.shape[1:], array.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    located = _whole_map(array)
    if located is None:
        return np.array(array[start:stop])
    start, stop = max(0, start), min(len(array), stop)
    out = np.empty((max(0, stop - start),) + array.shape[1:], array.dtype)
    if out.size == 0:
        return out
    view = memoryview(out).cast("B")
    with open(located[0], "rb", buffering=0) as f:
        done, offset = 0, located[1] + start * _row_bytes(array)
        while done < len(view):
            got = os.preadv(f.fileno(), [view[done:]], offset + done)
            if got <= 0:
                raise DataFormatError(located[0], "file is shorter than its .npy header says (truncated?)")
            done += got
    return out


def check_finite_rows(array, source, *, what: str = "rows", block_bytes: int = BLOCK_BYTES) -> None:
    """DataFormatError naming `source` and the first row with NaN/inf, checked block by block
    (a whole-array ``np.isfinite`` would allocate a temporary as large as the array; blocks are
    read through the file, `read_rows`, so the pass does not grow the process's RSS)."""
    if np.dtype(array.dtype).kind != "f":
        return
    bad_rows, first = 0, None
    for start, stop in rows_in_blocks(array, block_bytes):
        block = read_rows(array, start, stop)
        ok = np.isfinite(block).reshape(len(block), -1).all(axis=1)
        if not ok.all():
            bad_rows += int((~ok).sum())
            if first is None:
                first = start + int(np.flatnonzero(~ok)[0])
    if first is not None:
        raise DataFormatError(source, f"NaN/inf values in {bad_rows} {what}; the first is row {first}",
                              record=first)


# ---------------------------------------------------------------------------- scans recorded once

_RECORD_SUFFIX = ".checked.json"
_RECORD_VERSION = 1
_SAMPLE_BYTES, _SAMPLES = 1 << 16, 16


def _sample_digest(path: pathlib.Path, size: int, digest) -> None:
    with open(path, "rb") as f:
        for k in range(_SAMPLES + 1):
            f.seek(max(0, (size - _SAMPLE_BYTES) * k // _SAMPLES))
            digest.update(f.read(_SAMPLE_BYTES))


def file_fingerprint(path: str | os.PathLike) -> dict:
    """What identifies a feature file's contents cheaply: size, modification time and a hash of
    17 samples of 64 KB spread over it (the first and last included); for a sharded folder, those
    of its files. An edit that keeps size, time and the sampled bytes goes unnoticed."""
    path = pathlib.Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.endswith(_RECORD_SUFFIX)) \
        if path.is_dir() else [path]
    digest, stats = hashlib.sha1(), []
    for f in files:
        stat = f.stat()
        stats.append([f.name, stat.st_size, stat.st_mtime_ns])
        _sample_digest(f, stat.st_size, digest)
    return {"files": stats, "sample_sha1": digest.hexdigest()}


def scan_record_path(path: str | os.PathLike) -> pathlib.Path:
    """Where the record of `path`'s scans goes: ``<file>.checked.json`` beside it (in a sharded
    folder: ``<folder>/rows.checked.json``) when that folder is writable, else
    ``~/.cache/tf_twobranch/checked/<hash of the absolute path>.checked.json``."""
    path = pathlib.Path(path).absolute()
    beside = path / f"rows{_RECORD_SUFFIX}" if path.is_dir() else path.with_name(path.name + _RECORD_SUFFIX)
    if os.access(beside.parent, os.W_OK):
        return beside
    name = hashlib.sha1(str(path).encode()).hexdigest()[:16]
    return pathlib.Path.home() / ".cache" / "tf_twobranch" / "checked" / f"{name}{_RECORD_SUFFIX}"


def _read_record(record_path: pathlib.Path, source: pathlib.Path) -> dict:
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict) or record.get("version") != _RECORD_VERSION \
            or record.get("file") != str(source) or not isinstance(record.get("scans"), dict):
        return {}
    return record


def checked_once(path: str | os.PathLike, scan_name: str, scan: Callable[[], dict | None]) -> dict:
    """``scan()`` of the feature file (or sharded folder) `path`, run once per version of the file.

    `scan` reads the whole file and raises (DataFormatError) on bad data; what it returns (a
    JSON-able dict, e.g. a padding mask) is kept with the file's `file_fingerprint` in
    `scan_record_path(path)`. A later call whose file has the same fingerprint returns the kept
    result without reading the file: at COCO size a load no longer streams 37-45 GB through the
    page cache. A replaced or edited file is scanned again. A record that cannot be written (a
    read-only home) costs only the rescan next time.
    """
    source = pathlib.Path(path).absolute()
    record_path = scan_record_path(source)
    fingerprint = file_fingerprint(source)
    record = _read_record(record_path, source)
    if record.get("fingerprint") == fingerprint and scan_name in record["scans"]:
        return record["scans"][scan_name]
    result = scan() or {}
    if record.get("fingerprint") != fingerprint:
        record = {"version": _RECORD_VERSION, "file": str(source), "fingerprint": fingerprint, "scans": {}}
    record["scans"][scan_name] = result
    try:
        record_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_beside(record_path)
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, record_path)
    except OSError as err:
        logger.info("could not record the scan of %s in %s (%s); it is scanned again next time",
                     source, record_path, err)
    return result


def check_finite_once(path: str | os.PathLike, array, source=None, *, what: str = "rows") -> None:
    """`check_finite_rows` of the file `path` (memory-mapped as `array`), run once per version of
    the file (`checked_once`)."""
    def scan():
        check_finite_rows(array, source if source is not None else path, what=what)
        return {"finite": True}
    if np.dtype(array.dtype).kind == "f":
        checked_once(path, "finite", scan)


def pack_mask(mask: np.ndarray) -> dict:
    """A boolean array as a JSON-able dict (bits, base64) for a scan record."""
    mask = np.asarray(mask, bool)
    return {"shape": list(mask.shape), "bits": base64.b64encode(np.packbits(mask.reshape(-1))).decode("ascii")}


def unpack_mask(packed: dict) -> np.ndarray:
    shape = tuple(int(n) for n in packed["shape"])
    bits = np.frombuffer(base64.b64decode(packed["bits"]), np.uint8)
    return np.unpackbits(bits, count=int(np.prod(shape, dtype=np.int64))).astype(bool).reshape(shape)


def gather_rows(array, indices, dtype=np.float32) -> np.ndarray:
    """Rows `indices` of a (memory-mapped) array as a new `dtype` array: only those rows are read."""
    indices = np.asarray(indices, np.int64)
    rows = array[indices]
    return np.asarray(rows, dtype=dtype)


def temp_beside(path: str | os.PathLike) -> pathlib.Path:
    """This process's temporary name for `path` (``.tmp_<pid>_<name>``, beside it, same suffix).

    Per process, so that two runs building the same cache at once each write their own file and
    rename it into place (the last rename wins; the contents are equal). Temporary files of
    `path` left by a process that no longer runs (a killed build: up to a whole cache's size) are
    deleted here; those of a live process are its work in progress and are left alone.
    """
    path = pathlib.Path(path)
    prefix, suffix = ".tmp_", f"_{path.name}"
    for stale in path.parent.glob(f"{prefix}*{suffix}"):
        pid = stale.name[len(prefix):-len(suffix)]
        if pid.isdigit() and int(pid) != os.getpid() and not _process_runs(int(pid)):
            stale.unlink(missing_ok=True)
    return path.with_name(f"{prefix}{os.getpid()}{suffix}")


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's process
        return True
    return True


class RowWriter:
    """Writes an (N, ...) array into a ``.npy`` file block by block, renamed into place on `close`.

    Usage::

        with RowWriter(path, (n, 20, 4096), np.float16) as out:
            out[start:stop] = block     # any order; cast to the file's dtype
    """

    def __init__(self, path: str | os.PathLike, shape: Sequence[int], dtype=np.float32):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = temp_beside(self.path)
        self.array = np.lib.format.open_memmap(self._tmp, "w+", np.dtype(dtype), tuple(int(s) for s in shape))
        self._fd = os.open(self._tmp, os.O_WRONLY)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def shape(self) -> tuple:
        return self.array.shape

    def __setitem__(self, index, values):
        """Rows ``out[start:stop] = block`` go to the file with ``pwrite``, not through the map:
        written pages stay in the page cache, outside this process's RSS (a 13.6 GB cache of
        COCO sentence features written through the map counted all 13.6 GB as resident).
        Any other index is written through the map (`array`)."""
        if not (isinstance(index, slice) and index.step in (None, 1)):
            self.array[index] = values
            return
        start, stop, _ = index.indices(len(self.array))
        if stop <= start:
            return
        shape = (stop - start,) + self.array.shape[1:]
        block = np.ascontiguousarray(np.broadcast_to(np.asarray(values).astype(self.array.dtype, copy=False), shape))
        if block.size == 0:
            return
        view = memoryview(block).cast("B")
        offset = int(self.array.offset) + start * _row_bytes(self.array)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def close(self) -> pathlib.Path:
        self.array.flush()
        del self.array
        os.close(self._fd)
        self._fd = None
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if hasattr(self, "array"):
            del self.array
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.close()
        else:
            self.abort()


def write_rows(path, array, dtype=None, block_bytes: int = BLOCK_BYTES) -> pathlib.Path:
    """Copies a (memory-mapped) array into a ``.npy`` file block by block, cast to `dtype`."""
    dtype = np.dtype(dtype or array.dtype)
    with RowWriter(path, array.shape, dtype) as out:
        for start, stop in rows_in_blocks(array, block_bytes):
            out[start:stop] = np.asarray(array[start:stop])
    return pathlib.Path(path)


class ShardedRowWriter:
    """Appends rows to a sharded-array folder; an interrupted build resumes at `rows_done`.

    Each shard is written whole (`RowWriter`) before the next starts, so a
    crash loses at most the shard in progress; the manifest is written by
    `finish`, and only then does `open_rows` accept the folder.
    """

    def __init__(self, folder: str | os.PathLike, row_shape: Sequence[int], dtype=np.float32, *,
                 shard_bytes: int = SHARD_BYTES):
        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.row_shape = tuple(int(s) for s in row_shape)
        self.dtype = np.dtype(dtype)
        row_bytes = max(1, int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize)
        self.shard_rows = max(1, shard_bytes // row_bytes)
        self.counts: list[int] = []
        for k in range(1 << 20):
            path = self.folder / f"shard_{k:05d}.npy"
            if not path.exists():
                break
            shard = _load_npy(path)
            if shard.shape[1:] != self.row_shape or shard.dtype != self.dtype:
                raise DataFormatError(path, f"an earlier build wrote {shard.shape[1:]} {shard.dtype} rows; "
                                      f"this one writes {self.row_shape} {self.dtype}: remove the folder")
            self.counts.append(len(shard))
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0

    @property
    def rows_done(self) -> int:
        """Rows already on disk (a resumed build skips them)."""
        return sum(self.counts)

    def append(self, block) -> None:
        block = np.asarray(block)
        if block.shape[1:] != self.row_shape:
            raise ValueError(f"rows of shape {block.shape[1:]}, expected {self.row_shape}")
        self._pending.append(block.astype(self.dtype, copy=False))
        self._pending_rows += len(block)
        while self._pending_rows >= self.shard_rows:
            self._flush(self.shard_rows)

    def _flush(self, rows: int) -> None:
        path = self.folder / f"shard_{len(self.counts):05d}.npy"
        with RowWriter(path, (rows,) + self.row_shape, self.dtype) as out:
            filled = 0
            while filled < rows:
                head = self._pending[0]
                take = min(len(head), rows - filled)
                out[filled:filled + take] = head[:take]
                filled += take
                if take == len(head):
                    self._pending.pop(0)
                else:
                    self._pending[0] = head[take:]
        self._pending_rows -= rows
        self.counts.append(rows)

    def finish(self) -> ShardedRows:
        if self._pending_rows:
            self._flush(self._pending_rows)
        manifest = {"shape": [self.rows_done, *self.row_shape], "dtype": self.dtype.name, "shards": self.counts}
        tmp = temp_beside(self.folder / _MANIFEST)
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, self.folder / _MANIFEST)
        return ShardedRows(self.folder)
