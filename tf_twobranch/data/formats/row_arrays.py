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

import json
import os
import pathlib
from typing import Iterable, Sequence

import numpy as np

from tf_twobranch.errors import ConfigError, DataFormatError

__all__ = ["FEATURE_DTYPES", "storage_dtype", "open_rows", "ShardedRows", "RowWriter",
           "ShardedRowWriter", "check_finite_rows", "gather_rows", "rows_in_blocks", "write_rows",
           "BLOCK_BYTES", "SHARD_BYTES"]

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


def check_finite_rows(array, source, *, what: str = "rows", block_bytes: int = BLOCK_BYTES) -> None:
    """DataFormatError naming `source` and the first row with NaN/inf, checked block by block
    (a whole-array ``np.isfinite`` would allocate a temporary as large as the array)."""
    if np.dtype(array.dtype).kind != "f":
        return
    bad_rows, first = 0, None
    for start, stop in rows_in_blocks(array, block_bytes):
        block = np.asarray(array[start:stop])
        ok = np.isfinite(block).reshape(len(block), -1).all(axis=1)
        if not ok.all():
            bad_rows += int((~ok).sum())
            if first is None:
                first = start + int(np.flatnonzero(~ok)[0])
    if first is not None:
        raise DataFormatError(source, f"NaN/inf values in {bad_rows} {what}; the first is row {first}",
                              record=first)


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

    def __setitem__(self, index, values):
        self.array[index] = values

    def close(self) -> pathlib.Path:
        self.array.flush()
        del self.array
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if hasattr(self, "array"):
            del self.array
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
