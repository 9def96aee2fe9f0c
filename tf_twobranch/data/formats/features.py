"""Precomputed feature matrices (image CNN features, sentence features).

The two-branch network's released data stores image features in a MATLAB
``.mat`` file under ``image_features`` with shape (N, D), and sentence
features in an HDF5 file under ``text_features`` written by MATLAB, i.e.
column-major: h5py sees (D, N) and the original loader transposes it.
Sentences of one image are adjacent, so sentence i belongs to image
``i // (num_sentences // num_images)``.

Supported files: ``.npy``, ``.npz``, ``.h5``/``.hdf5``, ``.mat`` v5 (scipy)
and ``.mat`` v7.3 (HDF5, read with h5py).  Every problem is reported as a
DataFormatError naming the file (and the key).

Memory (Flickr30K / COCO text features are 0.7–14 GB): what is returned is
a read-only memory map wherever the file allows one, and nothing is ever
held whole on the way:

* a row-major ``.npy`` already in the wanted dtype is memory-mapped as it is;
* any other ``.npy`` (another dtype, Fortran order, ``layout="columns"``)
  and every HDF5 / v7.3 file (MATLAB's column-major (D, N) included) is
  converted once, block by block, into a row-major ``.npy`` in a conversion
  cache (`conversion_cache_dir`), keyed by the source's path, size and
  modification time, and that file is memory-mapped;
* ``.npz`` and ``.mat`` v5 cannot be memory-mapped: they are loaded, so
  memory is bounded by the file itself (plus a float32 copy when the file
  holds another dtype).

NaN/inf checks and conversions run in blocks of ``row_arrays.BLOCK_BYTES``.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib

import h5py
import numpy as np

from tf_twobranch.data.formats._common import check_exists
from tf_twobranch.data.formats.row_arrays import (BLOCK_BYTES, RowWriter, check_finite_rows, checked_once,
                                                  open_rows, read_rows,
                                                  rows_in_blocks, storage_dtype)
from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError

PREFERRED_KEYS = ("image_features", "text_features", "features")
_SUFFIXES = (".npy", ".npz", ".h5", ".hdf5", ".mat")
_LAYOUTS = ("auto", "rows", "columns")
# Dtypes returned as stored (a row-major .npy of these is memory-mapped, not converted).
_KEPT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
# Conversions of files that cannot be memory-mapped as they are go here unless a folder is given.
CONVERSION_DIR_NAME = ".row_major"


def _suffix(path: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _SUFFIXES:
        raise DataFormatError(path, f"unsupported feature file type {suffix or '(none)'!r}; "
                              f"expected one of {', '.join(_SUFFIXES)}")
    return suffix


def _choose_key(path: str, keys: list[str], key: str | None) -> str:
    if key is not None:
        if key not in keys:
            raise DataFormatError(path, f"no array named {key!r}; the file holds {keys}", record=key)
        return key
    if len(keys) == 1:
        return keys[0]
    preferred = [k for k in PREFERRED_KEYS if k in keys]
    if len(preferred) == 1:
        return preferred[0]
    if not keys:
        raise DataFormatError(path, "the file holds no arrays")
    raise DataFormatError(path, f"the file holds several arrays {keys}; pass key= to choose one")


def _hdf5_dataset_names(handle) -> list[str]:
    names: list[str] = []

    def visit(name, obj):
        # MATLAB v7.3 keeps cell/struct internals under "#refs#"/"#subsystem#".
        if isinstance(obj, h5py.Dataset) and not any(p.startswith("#") for p in name.split("/")):
            names.append(name)

    handle.visititems(visit)
    return names


def _damaged(path: str, kind: str, error: Exception) -> DataFormatError:
    return DataFormatError(path, f"the file looks truncated or is not a valid {kind} file "
                           f"({type(error).__name__}: {error})")


def _is_hdf5(path: str) -> bool:
    try:
        return bool(h5py.is_hdf5(path))
    except Exception:
        return False


@contextlib.contextmanager
def _opened(path: str, key: str | None):
    """Yields (array as stored, key used, whether the file is HDF5), reading no values yet.

    The array is a memory map (``.npy``), an open h5py dataset (HDF5 / v7.3;
    valid inside the ``with``), or an in-memory array (``.npz``, ``.mat`` v5).
    """
    check_exists(path)
    suffix = _suffix(path)
    if suffix in (".h5", ".hdf5") or (suffix == ".mat" and _is_hdf5(path)):
        kind = "MATLAB v7.3 .mat" if suffix == ".mat" else "HDF5"
        try:
            handle = h5py.File(path, "r")
        except Exception as e:
            raise _damaged(path, kind, e) from e
        with handle:
            try:
                chosen = _choose_key(path, _hdf5_dataset_names(handle), key)
                dataset = handle[chosen]
            except DataFormatError:
                raise
            except Exception as e:
                raise _damaged(path, kind, e) from e
            yield dataset, chosen, True
        return
    kind = {".npy": "NumPy .npy", ".npz": "NumPy .npz", ".mat": "MATLAB .mat"}[suffix]
    try:
        if suffix == ".npy":
            try:
                stored = np.load(path, mmap_mode="r", allow_pickle=False)
            except ValueError:
                # Not mappable (empty, object dtype, truncated): a plain load
                # reports what is wrong (and is bounded by the file).
                stored = np.load(path, allow_pickle=False)
            chosen = key or "(array)"
        elif suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                chosen = _choose_key(path, list(archive.files), key)
                stored = archive[chosen]
        else:
            # scipy only for .mat files: importing data.formats stays light.
            import scipy.io

            contents = scipy.io.loadmat(path)
            chosen = _choose_key(path, [k for k in contents if not k.startswith("__")], key)
            stored = contents[chosen]
    except DataFormatError:
        raise
    except Exception as e:  # numpy/zipfile/scipy raise many types for damaged files
        raise _damaged(path, kind, e) from e
    yield stored, chosen, False


def conversion_cache_dir(source: str | os.PathLike) -> pathlib.Path:
    """Where a row-major copy of `source` goes when no folder is given:
    ``<its folder>/.row_major`` when that folder is writable, else
    ``~/.cache/tf_twobranch/row_major``."""
    folder = pathlib.Path(source).absolute().parent
    if os.access(folder, os.W_OK):
        return folder / CONVERSION_DIR_NAME
    return pathlib.Path.home() / ".cache" / "tf_twobranch" / "row_major"


def conversion_path(source: str | os.PathLike, what: str, dtype: np.dtype, cache_dir=None) -> pathlib.Path:
    """The ``.npy`` that holds `source` converted (`what`: which array and how) to `dtype`.

    Keyed by the source's absolute path, size and modification time: a
    replaced or edited source gets a new conversion (a stale one stays in
    place, unused).  Folder: `cache_dir`, default `conversion_cache_dir`.
    """
    source = os.fspath(source)
    stat = os.stat(source)
    identity = "\0".join(map(str, (os.path.abspath(source), stat.st_size, stat.st_mtime_ns, what,
                                   np.dtype(dtype).name)))
    digest = hashlib.sha1(identity.encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "_-." else "_" for c in what)
    folder = pathlib.Path(cache_dir) if cache_dir is not None else conversion_cache_dir(source)
    return folder / f"{pathlib.Path(source).name}.{safe}.{digest}.npy"


def returned_dtype(stored_dtype, dtype: str | None = None) -> np.dtype:
    """The dtype a feature reader returns: `dtype` (a ``--feature_dtype`` value) when given,
    else the stored one when it is float32 or float16 (used as it is), else float32."""
    if dtype is not None:
        return storage_dtype(dtype)
    stored_dtype = np.dtype(stored_dtype)
    return stored_dtype if stored_dtype in _KEPT_DTYPES else np.dtype(np.float32)


def _check_finite(path: str, key: str, matrix) -> None:
    """DataFormatError naming the file, key, the count of NaN/inf values and rows and the first bad row."""
    try:
        check_finite_rows(matrix, path, block_bytes=BLOCK_BYTES)
    except DataFormatError:
        # Only on the error path: a second pass for the full count.
        values = rows = 0
        first = None
        for start, stop in rows_in_blocks(matrix, BLOCK_BYTES):
            bad = ~np.isfinite(read_rows(matrix, start, stop))
            bad_rows = np.flatnonzero(bad.any(axis=1))
            values += int(bad.sum())
            rows += bad_rows.size
            if first is None and bad_rows.size:
                first = start + int(bad_rows[0])
        raise DataFormatError(path, f"{values} NaN/inf values in {rows} rows; first bad row is "
                              f"{first}", record=key) from None


def _block_rows(stored, transpose: bool, dim: int) -> int:
    """Source rows per conversion block: about BLOCK_BYTES (read as up to 8-byte values), a whole
    number of HDF5 chunks along the row axis so that each chunk is decompressed once."""
    step = max(1, BLOCK_BYTES // (dim * 8))
    chunks = getattr(stored, "chunks", None)
    if chunks:
        along = chunks[1] if transpose else chunks[0]
        step = max(along, step // along * along)
    return step


def _convert(path: str, key: str, stored, transpose: bool, want: np.dtype, cache_dir) -> np.ndarray:
    """`stored` as a row-major `want` ``.npy`` in the conversion cache, written block by block and
    checked for NaN/inf before it is renamed into place; returns its memory map."""
    rows, dim = stored.shape[::-1] if transpose else stored.shape
    target = conversion_path(path, f"{key}.T" if transpose else key, want, cache_dir)
    if target.exists():
        cached = open_rows(target)
        if cached.shape == (rows, dim) and cached.dtype == want:
            return cached
    step = _block_rows(stored, transpose, dim)
    kind = "HDF5" if isinstance(stored, h5py.Dataset) else "NumPy .npy"
    try:
        writer = RowWriter(target, (rows, dim), want)
    except OSError as e:
        raise UserInputError(f"{path}: cannot write its row-major copy to {target} ({e}); pass a "
                             "writable cache_dir (--features_cache)") from None
    with writer as out:
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            try:
                block = stored[:, start:stop].T if transpose else stored[start:stop]
            except Exception as e:  # h5py/numpy errors of a damaged file
                raise _damaged(path, kind, e) from e
            out[start:stop] = block  # cast as astype would (float64 overflow -> inf, caught below)
        _check_finite(path, key, out.array)
    return open_rows(target)


def _finish(path: str, key: str, stored, is_hdf5: bool, layout: str, expected_rows: int | None,
            dtype, cache_dir, check_finite: bool) -> np.ndarray:
    stored_dtype = np.dtype(stored.dtype)
    if stored_dtype.kind not in "iuf":
        raise DataFormatError(path, f"array has non-numeric dtype {stored_dtype}; expected "
                              "integers or floats", record=key)
    if len(stored.shape) != 2:
        raise DataFormatError(path, f"expected a 2-D (rows x dimensions) array, found shape "
                              f"{tuple(stored.shape)}", record=key)
    transpose = layout == "columns" or (
        layout == "auto" and is_hdf5 and expected_rows is not None
        and stored.shape[1] == expected_rows != stored.shape[0])
    shape = tuple(stored.shape[::-1] if transpose else stored.shape)
    if expected_rows is not None and shape[0] != expected_rows:
        raise DataFormatError(path, f"expected {expected_rows} rows, found shape {shape} "
                              f"(stored {tuple(stored.shape)}, layout {layout!r})", record=key)
    want = returned_dtype(stored_dtype, dtype)
    if isinstance(stored, np.memmap) or is_hdf5:
        if (isinstance(stored, np.memmap) and not transpose and stored_dtype == want
                and stored.flags.c_contiguous):
            matrix = stored  # the file itself, no copy
        else:
            return _convert(path, key, stored, transpose, want, cache_dir)
    else:  # .npz / .mat v5 / a .npy numpy could not map: already in memory
        matrix = np.ascontiguousarray(stored.T if transpose else stored, dtype=want)
    if check_finite:
        # Once per version of the file (a record beside it): at COCO size every load
        # otherwise streamed the whole file through the page cache again.
        checked_once(path, f"finite:{key}:{want.name}:{'T' if transpose else 'rows'}",
                     lambda: _check_finite(path, key, matrix) or {"finite": True})
    return matrix


def _check_layout(layout: str, allowed=_LAYOUTS) -> None:
    if layout not in allowed:
        raise ConfigError(f"layout must be one of {allowed}, got {layout!r}")


def load_feature_matrix(path: str | os.PathLike, key: str | None = None, *, layout: str = "auto",
                        expected_rows: int | None = None, dtype: str | None = None,
                        cache_dir: str | os.PathLike | None = None,
                        check_finite: bool = True) -> np.ndarray:
    """Loads a 2-D feature matrix (N, D), memory-mapped where the file allows (module docstring).

    Args:
      path: ``.npy``, ``.npz``, ``.h5``/``.hdf5`` or ``.mat`` (v5 or v7.3).
      key: array name (ignored for ``.npy``).  None: the only array in the
        file, else the one of 'image_features'/'text_features'/'features'
        present; otherwise an error listing the keys.
      layout: "rows" (use as stored), "columns" (stored (D, N): transpose),
        or "auto": for HDF5 / v7.3 datasets, transpose when
        ``expected_rows`` is given and ``shape[1] == expected_rows !=
        shape[0]``; rows otherwise.
      expected_rows: required number of rows N.
      dtype: None: float32 and float16 files keep their dtype, others become
        float32; "float32" / "float16" (``--feature_dtype``): that dtype.
      cache_dir: where a file that cannot be memory-mapped as it is gets its
        row-major copy (default `conversion_cache_dir(path)`).
      check_finite: False skips the NaN/inf pass over a file memory-mapped
        as it is (for caches the package checked when writing them).
    Returns:
      A C-contiguous (N, D) array: a read-only memory map for ``.npy``,
      HDF5 and v7.3 files; in memory for ``.npz`` and ``.mat`` v5.
    Raises:
      DataFormatError: missing, truncated or corrupt file; unknown key; not
        2-D; non-numeric; NaN/inf (count and first bad row); row mismatch.
      ConfigError: unknown layout or dtype.
    """
    _check_layout(layout)
    path = os.fspath(path)
    with _opened(path, key) as (stored, chosen, is_hdf5):
        return _finish(path, chosen, stored, is_hdf5, layout, expected_rows, dtype, cache_dir,
                       check_finite)


def save_feature_matrix(path: str | os.PathLike, array: np.ndarray, key: str = "features", *,
                        layout: str = "rows") -> None:
    """Saves a 2-D (N, D) matrix to ``.npy``/``.npz``/``.h5``/``.hdf5``/``.mat`` (v5).

    layout="columns" stores the transpose (D, N), as MATLAB-written HDF5
    sentence features are; the dtype is kept.  ``.npy`` and HDF5 files are
    written block by block (a memory-mapped `array` is never read whole);
    ``.npz`` and ``.mat`` hold the whole array in memory.
    """
    _check_layout(layout, ("rows", "columns"))
    path = os.fspath(path)
    suffix = _suffix(path)
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        array = np.asarray(array)
    if len(array.shape) != 2 or np.dtype(array.dtype).kind not in "iuf":
        raise DataFormatError(path, f"can only save a 2-D numeric array, got shape {array.shape} "
                              f"dtype {array.dtype}")
    columns = layout == "columns"
    stored_shape = tuple(array.shape[::-1] if columns else array.shape)
    if suffix in (".npy", ".h5", ".hdf5"):
        with contextlib.ExitStack() as stack:
            if suffix == ".npy":
                out = stack.enter_context(RowWriter(path, stored_shape, array.dtype))
            else:
                out = stack.enter_context(h5py.File(path, "w")).create_dataset(
                    key, shape=stored_shape, dtype=array.dtype)
            for start, stop in rows_in_blocks(array, BLOCK_BYTES):
                block = np.asarray(array[start:stop])
                if columns:
                    out[:, start:stop] = block.T
                else:
                    out[start:stop] = block
        return
    stored = np.ascontiguousarray(np.asarray(array).T if columns else array)
    if suffix == ".npz":
        with open(path, "wb") as f:  # a file object stops numpy from appending ".npz"
            np.savez(f, **{key: stored})
    else:
        # scipy only for .mat files: importing data.formats stays light.
        import scipy.io

        scipy.io.savemat(path, {key: stored})


def load_paired_features(image_path: str | os.PathLike, text_path: str | os.PathLike, *,
                         num_captions: int | None = None, image_key: str | None = None,
                         text_key: str | None = None, dtype: str | None = None,
                         cache_dir: str | os.PathLike | None = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Loads image and sentence features and pairs them as the original code does.

    Sentences of one image are adjacent: with ratio = num_text // num_images,
    sentence i belongs to image i // ratio.  Text features stored column-wise
    in HDF5 / v7.3 files (MATLAB's (D, N)) are transposed: with
    `num_captions` that decides; without it, the one stored dimension that is
    a multiple of the number of images is taken as N.  Both matrices are
    read as `load_feature_matrix` reads them (`dtype`, `cache_dir`: see
    there): memory-mapped, a column-major file converted once block by block.

    Returns:
      (image_feats (N_img, D_img), text_feats (N_txt, D_txt),
       caption_image int32 (N_txt,)).
    Raises:
      DataFormatError naming both files when the number of sentence rows is
      not a positive multiple of the number of images, or differs from
      `num_captions`.
    """
    image_path, text_path = os.fspath(image_path), os.fspath(text_path)
    image_feats = load_feature_matrix(image_path, image_key, layout="rows", dtype=dtype,
                                      cache_dir=cache_dir)
    num_images = image_feats.shape[0]
    if num_images == 0:
        raise DataFormatError(image_path, "holds no image feature rows")
    with _opened(text_path, text_key) as (stored, chosen, is_hdf5):
        stored_shape = tuple(stored.shape)
        transpose = False
        if is_hdf5 and len(stored_shape) == 2:
            rows, cols = stored_shape
            if num_captions is not None:
                transpose = cols == num_captions != rows
            elif cols % num_images == 0 and rows % num_images != 0:
                transpose = True
            elif cols % num_images == 0 and rows % num_images == 0 and rows != cols:
                raise DataFormatError(text_path, f"cannot tell whether the stored {stored_shape} "
                                      "text features are (N, D) or MATLAB's column-major (D, N): "
                                      f"both sides are multiples of the {num_images} images in "
                                      f"{image_path}; pass num_captions", record=chosen)
        text_feats = _finish(text_path, chosen, stored, is_hdf5, "columns" if transpose else "rows",
                             None, dtype, cache_dir, True)
    if num_captions is not None and text_feats.shape[0] != num_captions:
        raise DataFormatError(text_path, f"expected {num_captions} sentence feature rows "
                              f"(num_captions) for the {num_images} images in {image_path}, "
                              f"found stored shape {stored_shape}", record=chosen)
    num_text = text_feats.shape[0]
    if num_text == 0 or num_text % num_images:
        raise DataFormatError(text_path, f"has {num_text} sentence feature rows, which is not a "
                              f"positive multiple of the {num_images} image feature rows in "
                              f"{image_path}", record=chosen)
    ratio = num_text // num_images
    caption_image = (np.arange(num_text) // ratio).astype(np.int32)
    return image_feats, text_feats, caption_image
