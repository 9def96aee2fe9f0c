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
"""
from __future__ import annotations

import os

import h5py
import numpy as np

from tf_twobranch.data.formats._common import check_exists
from tf_twobranch.errors import ConfigError, DataFormatError

PREFERRED_KEYS = ("image_features", "text_features", "features")
_SUFFIXES = (".npy", ".npz", ".h5", ".hdf5", ".mat")
_LAYOUTS = ("auto", "rows", "columns")


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


def _read_stored(path: str, key: str | None) -> tuple[np.ndarray, str, bool]:
    """Returns (array as stored, key used, whether the file is HDF5)."""
    check_exists(path)
    suffix = _suffix(path)
    if suffix in (".h5", ".hdf5") or (suffix == ".mat" and _is_hdf5(path)):
        return (*_read_hdf5(path, key, "MATLAB v7.3 .mat" if suffix == ".mat" else "HDF5"), True)
    kind = {".npy": "NumPy .npy", ".npz": "NumPy .npz", ".mat": "MATLAB .mat"}[suffix]
    try:
        if suffix == ".npy":
            return np.load(path, allow_pickle=False), key or "(array)", False
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                chosen = _choose_key(path, list(archive.files), key)
                return archive[chosen], chosen, False
        # scipy only for .mat files: importing data.formats stays light.
        import scipy.io

        contents = scipy.io.loadmat(path)
        keys = [k for k in contents if not k.startswith("__")]
        chosen = _choose_key(path, keys, key)
        return contents[chosen], chosen, False
    except DataFormatError:
        raise
    except Exception as e:  # numpy/zipfile/scipy raise many types for damaged files
        raise DataFormatError(path, f"the file looks truncated or is not a valid {kind} file "
                              f"({type(e).__name__}: {e})") from e


def _is_hdf5(path: str) -> bool:
    try:
        return bool(h5py.is_hdf5(path))
    except Exception:
        return False


def _read_hdf5(path: str, key: str | None, kind: str) -> tuple[np.ndarray, str]:
    try:
        with h5py.File(path, "r") as handle:
            chosen = _choose_key(path, _hdf5_dataset_names(handle), key)
            return handle[chosen][()], chosen
    except DataFormatError:
        raise
    except Exception as e:
        raise DataFormatError(path, f"the file looks truncated or is not a valid {kind} file "
                              f"({type(e).__name__}: {e})") from e


def _finish(path: str, key: str, stored: np.ndarray, is_hdf5: bool, layout: str,
            expected_rows: int | None) -> np.ndarray:
    stored = np.asarray(stored)
    if stored.dtype.kind not in "iuf":
        raise DataFormatError(path, f"array has non-numeric dtype {stored.dtype}; expected "
                              "integers or floats", record=key)
    if stored.ndim != 2:
        raise DataFormatError(path, f"expected a 2-D (rows x dimensions) array, found shape "
                              f"{stored.shape}", record=key)
    transpose = layout == "columns" or (
        layout == "auto" and is_hdf5 and expected_rows is not None
        and stored.shape[1] == expected_rows != stored.shape[0])
    matrix = stored.T if transpose else stored
    if expected_rows is not None and matrix.shape[0] != expected_rows:
        raise DataFormatError(path, f"expected {expected_rows} rows, found shape {matrix.shape} "
                              f"(stored {stored.shape}, layout {layout!r})", record=key)
    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    finite = np.isfinite(matrix)
    if not finite.all():
        bad_rows = np.flatnonzero(~finite.all(axis=1))
        raise DataFormatError(path, f"{int((~finite).sum())} NaN/inf values in {bad_rows.size} "
                              f"rows; first bad row is {int(bad_rows[0])}", record=key)
    return matrix


def _check_layout(layout: str, allowed=_LAYOUTS) -> None:
    if layout not in allowed:
        raise ConfigError(f"layout must be one of {allowed}, got {layout!r}")


def load_feature_matrix(path: str | os.PathLike, key: str | None = None, *, layout: str = "auto",
                        expected_rows: int | None = None) -> np.ndarray:
    """Loads a 2-D feature matrix as float32 (N, D).

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
    Raises:
      DataFormatError: missing, truncated or corrupt file; unknown key; not
        2-D; non-numeric; NaN/inf (count and first bad row); row mismatch.
      ConfigError: unknown layout.
    """
    _check_layout(layout)
    path = os.fspath(path)
    stored, chosen, is_hdf5 = _read_stored(path, key)
    return _finish(path, chosen, stored, is_hdf5, layout, expected_rows)


def save_feature_matrix(path: str | os.PathLike, array: np.ndarray, key: str = "features", *,
                        layout: str = "rows") -> None:
    """Saves a 2-D (N, D) matrix to ``.npy``/``.npz``/``.h5``/``.hdf5``/``.mat`` (v5).

    layout="columns" stores the transpose (D, N), as MATLAB-written HDF5
    sentence features are; the dtype is kept.
    """
    _check_layout(layout, ("rows", "columns"))
    path = os.fspath(path)
    suffix = _suffix(path)
    array = np.asarray(array)
    if array.ndim != 2 or array.dtype.kind not in "iuf":
        raise DataFormatError(path, f"can only save a 2-D numeric array, got shape {array.shape} "
                              f"dtype {array.dtype}")
    stored = np.ascontiguousarray(array.T if layout == "columns" else array)
    if suffix == ".npy":
        np.save(path, stored)
    elif suffix == ".npz":
        with open(path, "wb") as f:  # a file object stops numpy from appending ".npz"
            np.savez(f, **{key: stored})
    elif suffix in (".h5", ".hdf5"):
        with h5py.File(path, "w") as handle:
            handle.create_dataset(key, data=stored)
    else:
        # scipy only for .mat files: importing data.formats stays light.
        import scipy.io

        scipy.io.savemat(path, {key: stored})


def load_paired_features(image_path: str | os.PathLike, text_path: str | os.PathLike, *,
                         num_captions: int | None = None, image_key: str | None = None,
                         text_key: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Loads image and sentence features and pairs them as the original code does.

    Sentences of one image are adjacent: with ratio = num_text // num_images,
    sentence i belongs to image i // ratio.  Text features stored column-wise
    in HDF5 / v7.3 files (MATLAB's (D, N)) are transposed: with
    `num_captions` that decides; without it, the one stored dimension that is
    a multiple of the number of images is taken as N.

    Returns:
      (image_feats (N_img, D_img), text_feats (N_txt, D_txt),
       caption_image int32 (N_txt,)), features as float32.
    Raises:
      DataFormatError naming both files when the number of sentence rows is
      not a positive multiple of the number of images, or differs from
      `num_captions`.
    """
    image_path, text_path = os.fspath(image_path), os.fspath(text_path)
    image_feats = load_feature_matrix(image_path, image_key, layout="rows")
    num_images = image_feats.shape[0]
    if num_images == 0:
        raise DataFormatError(image_path, "holds no image feature rows")
    stored, chosen, is_hdf5 = _read_stored(text_path, text_key)
    transpose = False
    if is_hdf5 and np.ndim(stored) == 2:
        rows, cols = np.shape(stored)
        if num_captions is not None:
            transpose = cols == num_captions != rows
        elif cols % num_images == 0 and rows % num_images != 0:
            transpose = True
        elif cols % num_images == 0 and rows % num_images == 0 and rows != cols:
            raise DataFormatError(text_path, f"cannot tell whether the stored {stored.shape} text "
                                  "features are (N, D) or MATLAB's column-major (D, N): both "
                                  f"sides are multiples of the {num_images} images in {image_path}; "
                                  "pass num_captions", record=chosen)
    text_feats = _finish(text_path, chosen, stored, is_hdf5, "columns" if transpose else "rows", None)
    if num_captions is not None and text_feats.shape[0] != num_captions:
        raise DataFormatError(text_path, f"expected {num_captions} sentence feature rows "
                              f"(num_captions) for the {num_images} images in {image_path}, "
                              f"found stored shape {np.shape(stored)}", record=chosen)
    num_text = text_feats.shape[0]
    if num_text == 0 or num_text % num_images:
        raise DataFormatError(text_path, f"has {num_text} sentence feature rows, which is not a "
                              f"positive multiple of the {num_images} image feature rows in "
                              f"{image_path}", record=chosen)
    ratio = num_text // num_images
    caption_image = (np.arange(num_text) // ratio).astype(np.int32)
    return image_feats, text_feats, caption_image
