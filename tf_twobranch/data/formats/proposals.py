"""Per-image region proposals on disk.

Boxes are float32 ``[x1, y1, x2, y2]`` in 0-based, inclusive pixel
coordinates of the original image (the convention of
:mod:`tf_twobranch.boxes`), ranked best first.

Two layouts are read and written:

1. **HDF5 file** (``*.h5`` / ``*.hdf5``, the preferred layout): one dataset per
   image, named by the image id (e.g. ``"4945942737"``), float32 shape
   ``(N, 4)``; optionally a dataset ``"<image id>_scores"`` of shape ``(N,)``
   with one score per box (higher = better).  The file attribute ``format``
   is ``"tf_twobranch.proposals"`` and ``box_convention`` describes the
   coordinates (both written by :func:`write_proposals`, not required when
   reading).

2. **Directory** with one file per image, as proposals are often shipped:

   * ``<image id>.npy``: a numpy array of shape ``(N, 4)``, or ``(N, 5)``
     whose last column is the score;
   * ``<image id>.txt`` or ``<image id>.csv``: one box per line,
     ``x1 y1 x2 y2 [score]`` separated by commas and/or whitespace; empty lines
     and lines starting with ``#`` are ignored.

   Only one file per image id may exist.

Reading checks every box (finite, non-negative, ``x2 >= x1`` and
``y2 >= y1``) and raises :class:`~tf_twobranch.errors.DataFormatError` naming
the file, the image id (and line for text files) when a box is invalid, when
images requested in ``image_ids`` have no proposals (one error naming the
first missing id and how many are missing), or when the file cannot be read
(empty, truncated, corrupt or not HDF5).  :func:`read_proposals` is the one
place that opens proposal files.  Whether boxes lie inside their images needs
the image sizes: :func:`fit_proposals_to_images` checks (or clips) that.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Mapping

import h5py
import numpy as np

from tf_twobranch.boxes import clip_boxes, validate_boxes
from tf_twobranch.data.formats._common import read_text
from tf_twobranch.errors import DataFormatError

FORMAT_NAME = "tf_twobranch.proposals"
BOX_CONVENTION = "x1,y1,x2,y2; 0-based inclusive pixel coordinates; best first"
SCORES_SUFFIX = "_scores"
HDF5_SUFFIXES = (".h5", ".hdf5")
DIRECTORY_SUFFIXES = (".npy", ".txt", ".csv")
_SEPARATORS = re.compile(r"[,\s]+")


def _is_hdf5_path(path: str) -> bool:
    return path.lower().endswith(HDF5_SUFFIXES)


def _check(boxes, scores, path, image_id, line=None):
    boxes = validate_boxes(boxes, path=path, record=image_id)
    if scores is not None:
        scores = np.asarray(scores, dtype=np.float32).reshape(-1)
        if scores.shape[0] != boxes.shape[0]:
            raise DataFormatError(path, f"{scores.shape[0]} scores for {boxes.shape[0]} boxes", record=image_id,
                                  line=line)
        if not np.isfinite(scores).all():
            raise DataFormatError(path, "scores contain NaN or infinity", record=image_id)
    return boxes, scores


# ---------------------------------------------------------------------------- reading


def _missing_error(path: str, missing: list[str], requested: int, expected: str) -> DataFormatError:
    """One error for all requested image ids without proposals (names the first and the count)."""
    return DataFormatError(path, f"no proposals for image {missing[0]} ({len(missing)} of the {requested} "
                                 f"requested image(s) have none; expected {expected} for every image id)",
                           record=missing[0])


# Raised by h5py when a (truncated or corrupt) file's metadata or data cannot be read.
_HDF5_READ_ERRORS = (OSError, RuntimeError, KeyError)


def _read_hdf5(path: str, image_ids):
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise DataFormatError(path, "proposal file is empty (0 bytes); expected an HDF5 file with one (N, 4) "
                                    "dataset per image id")
    try:
        handle = h5py.File(path, "r")
    except FileNotFoundError:
        raise DataFormatError(path, "proposal file not found") from None
    except OSError as error:
        raise DataFormatError(path, f"not a readable HDF5 file (truncated, corrupt or not HDF5): {error}") from None
    boxes_out, scores_out = {}, {}
    with handle:
        try:
            if image_ids is None:
                image_ids = [key for key in handle.keys() if not key.endswith(SCORES_SUFFIX)]
            missing = [image_id for image_id in image_ids if image_id not in handle]
        except _HDF5_READ_ERRORS as error:
            raise DataFormatError(path, f"cannot list the datasets of the HDF5 file (truncated or corrupt?): "
                                        f"{error}") from None
        if missing:
            raise _missing_error(path, missing, len(image_ids), "a dataset named by the image id, of shape (N, 4)")
        for image_id in image_ids:
            try:
                dataset = handle[image_id]
                if not isinstance(dataset, h5py.Dataset):
                    raise DataFormatError(path, f"{image_id!r} is a group, expected a (N, 4) dataset",
                                          record=image_id)
                boxes = dataset[()]
                scores_key = image_id + SCORES_SUFFIX
                scores = handle[scores_key][()] if scores_key in handle else None
            except _HDF5_READ_ERRORS as error:
                raise DataFormatError(path, f"cannot read the proposals of image {image_id} (truncated or corrupt "
                                            f"HDF5 file?): {error}", record=image_id) from None
            boxes = np.asarray(boxes)
            if boxes.dtype.kind not in "fiu":
                raise DataFormatError(path, f"dataset has dtype {boxes.dtype}, expected float boxes",
                                      record=image_id)
            boxes_out[image_id], scores_out[image_id] = _check(boxes, scores, path, image_id)
    return boxes_out, scores_out


def _box_problem(box) -> str | None:
    x1, y1, x2, y2 = box
    if not np.isfinite(box).all():
        return "contains NaN or infinity"
    if x2 < x1 or y2 < y1:
        return "has zero or negative area (expected x2 >= x1 and y2 >= y1)"
    if x1 < 0 or y1 < 0:
        return "has a negative coordinate (expected 0-based pixel coordinates)"
    return None


def _read_text_boxes(path: str, image_id: str):
    rows = []
    lines = read_text(path).split("\n")
    width = None
    for line_number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        fields = [field for field in _SEPARATORS.split(text) if field]
        if len(fields) not in (4, 5) or (width is not None and len(fields) != width):
            raise DataFormatError(path, f"expected 'x1 y1 x2 y2 [score]' (the same number of columns on every "
                                        f"line), got {line!r}", line=line_number, record=image_id)
        width = len(fields)
        try:
            row = [float(field) for field in fields]
        except ValueError:
            raise DataFormatError(path, f"non-numeric value in {line!r}", line=line_number,
                                  record=image_id) from None
        problem = _box_problem(row[:4])
        if problem:
            raise DataFormatError(path, f"box {text!r} {problem}", line=line_number, record=image_id)
        rows.append(row)
    if not rows:
        return np.zeros((0, 4), np.float32), None
    array = np.asarray(rows, dtype=np.float64)
    return array[:, :4], (array[:, 4] if array.shape[1] == 5 else None)


def _read_directory(path: str, image_ids):
    if not os.path.isdir(path):
        raise DataFormatError(path, "proposal path not found: expected an .h5/.hdf5 file or a directory of "
                                    "<image id>.npy/.txt/.csv files")
    by_id: dict[str, list[str]] = {}
    for name in sorted(os.listdir(path)):
        stem, suffix = os.path.splitext(name)
        if suffix.lower() in DIRECTORY_SUFFIXES:
            by_id.setdefault(stem, []).append(name)
    if image_ids is None:
        image_ids = list(by_id)
    missing = [image_id for image_id in image_ids if not by_id.get(image_id)]
    if missing:
        raise _missing_error(path, missing, len(image_ids), f"a file <image id>.npy, .txt or .csv (e.g. "
                                                            f"{missing[0]}.npy)")
    boxes_out, scores_out = {}, {}
    for image_id in image_ids:
        names = by_id[image_id]
        if len(names) > 1:
            raise DataFormatError(path, f"several proposal files for image {image_id}: {names}; keep one",
                                  record=image_id)
        file_path = os.path.join(path, names[0])
        if file_path.lower().endswith(".npy"):
            try:
                array = np.load(file_path, allow_pickle=False)
            except (ValueError, OSError) as error:
                raise DataFormatError(file_path, f"not a readable .npy array: {error}", record=image_id) from None
            if array.ndim != 2 or array.shape[1] not in (4, 5) or array.dtype.kind not in "fiu":
                raise DataFormatError(file_path, f"expected a numeric (N, 4) or (N, 5) array, got "
                                                 f"{array.dtype} {array.shape}", record=image_id)
            boxes, scores = array[:, :4], (array[:, 4] if array.shape[1] == 5 else None)
        else:
            boxes, scores = _read_text_boxes(file_path, image_id)
        boxes_out[image_id], scores_out[image_id] = _check(boxes, scores, file_path, image_id)
    return boxes_out, scores_out


def read_proposals(path, image_ids: Iterable[str] | None = None, *, return_scores: bool = False):
    """Reads proposals for ``image_ids`` (all images in the file when None).

    Returns ``{image id: float32 (N, 4)}``; with ``return_scores=True`` a pair
    ``(boxes, scores)`` where ``scores[image id]`` is float32 (N,) or None.
    """
    path = os.fspath(path)
    if image_ids is not None:
        image_ids = [str(i) for i in image_ids]
    # The only place that opens proposal files: callers go through this function.
    if _is_hdf5_path(path):
        boxes, scores = _read_hdf5(path, image_ids)
    else:
        boxes, scores = _read_directory(path, image_ids)
    return (boxes, scores) if return_scores else boxes


#: How far (in pixels) a box may extend past the last pixel row/column
#: (``x2 <= width - 1 + IMAGE_TOLERANCE``) and still be accepted (then clipped)
#: by :func:`fit_proposals_to_images` without ``clip=True``: this absorbs
#: rounding and the half-open / 1-based ``x2 = width`` of some proposal tools.
IMAGE_TOLERANCE = 1.0


def fit_proposals_to_images(path, proposals: Mapping[str, np.ndarray], image_sizes: Mapping[str, tuple[int, int]],
                            *, clip: bool = False, clip_flag: str = "--clip_proposals"):
    """Checks that proposals lie inside their images; returns ``(boxes clipped to the image, count clipped)``.

    ``image_sizes[image id]`` is ``(width, height)`` in pixels.  A box may
    extend up to :data:`IMAGE_TOLERANCE` pixel past the image (rounding,
    half-open or 1-based ``x2 = width``); such boxes are clipped to the
    image.  A box further outside raises a DataFormatError naming ``path``,
    the image id, the box (index and coordinates) and the image size, unless
    ``clip`` is true, in which case every box is clipped to the image
    (``x2 <= width - 1``, ``y2 <= height - 1``).  The returned boxes are
    what both the crops and the IoU with the ground truth must use.
    """
    path = os.fspath(path)
    out, clipped = {}, 0
    for image_id, boxes in proposals.items():
        width, height = image_sizes[image_id]
        if not clip:
            validate_boxes(boxes, width, height, path=path, record=image_id, tolerance=IMAGE_TOLERANCE,
                           hint="the proposals are probably at the wrong scale (e.g. computed on resized "
                                f"images) or belong to other images; pass {clip_flag} to clip every box "
                                "to its image instead")
        boxes = np.asarray(boxes, np.float32)
        fitted = clip_boxes(boxes, width, height)
        clipped += int(np.any(fitted != boxes, axis=1).sum())
        out[image_id] = fitted
    return out, clipped


# ---------------------------------------------------------------------------- writing


def write_proposals(path, proposals: Mapping[str, np.ndarray],
                    scores: Mapping[str, np.ndarray] | None = None, *, directory_format: str = "npy") -> None:
    """Writes ``{image id: (N, 4) boxes}`` (and optional ``{image id: (N,) scores}``).

    ``path`` ending in ``.h5``/``.hdf5`` gives one HDF5 file (replaced if it
    exists); any other path is a directory of ``<image id>.<directory_format>``
    files, ``directory_format`` being ``"npy"``, ``"txt"`` or ``"csv"``.
    """
    path = os.fspath(path)
    scores = scores or {}
    checked = {}
    for image_id, boxes in proposals.items():
        image_id = str(image_id)
        if not image_id or "/" in image_id or image_id.endswith(SCORES_SUFFIX):
            raise ValueError(f"image id {image_id!r} cannot name a proposal dataset")
        checked[image_id] = _check(boxes, scores.get(image_id), path, image_id)
    if _is_hdf5_path(path):
        with h5py.File(path, "w") as handle:
            handle.attrs["format"] = FORMAT_NAME
            handle.attrs["box_convention"] = BOX_CONVENTION
            for image_id, (boxes, image_scores) in checked.items():
                handle.create_dataset(image_id, data=boxes.astype(np.float32))
                if image_scores is not None:
                    handle.create_dataset(image_id + SCORES_SUFFIX, data=image_scores.astype(np.float32))
        return
    if directory_format not in ("npy", "txt", "csv"):
        raise ValueError(f"directory_format must be 'npy', 'txt' or 'csv', got {directory_format!r}")
    os.makedirs(path, exist_ok=True)
    for image_id, (boxes, image_scores) in checked.items():
        array = boxes if image_scores is None else np.concatenate([boxes, image_scores[:, None]], axis=1)
        file_path = os.path.join(path, f"{image_id}.{directory_format}")
        if directory_format == "npy":
            np.save(file_path, array.astype(np.float32))
        else:
            separator = "," if directory_format == "csv" else " "
            with open(file_path, "w", encoding="utf-8", newline="\n") as handle:
                for row in array:
                    handle.write(separator.join(repr(float(v)) for v in row.astype(np.float32)) + "\n")
