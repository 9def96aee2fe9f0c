"""Image fragments of Karpathy et al. (NIPS 2014, §3.2): the whole image and its
top 19 detections, each encoded by a CNN.

No detector with weights is available offline, so the "detections" are the 19
highest-ranked boxes of a proposals file (`tf_twobranch.data.formats.proposals`:
boxes in rank order); users who ran RCNN elsewhere give the fragment features
directly as one ``(num_images, 20, D)`` array (`load_fragment_features`).
Fragment 0 is always the whole image, so the paper's "fullframe only"
ablation keeps fragment 0. Images with fewer proposals get a mask.

At Flickr30K and COCO size the (N, 20, D) arrays are tens of GB, so neither
function here holds one: the builder writes image by image into a resumable
sharded cache, and precomputed arrays are memory-mapped (`row_arrays`),
checked and masked block by block; only the (N, 20) mask is in RAM.
"""
from __future__ import annotations

import hashlib
import os
from typing import Mapping, Sequence

import h5py
import keras
import numpy as np

from tf_twobranch.data.formats.images import load_image
from tf_twobranch.data.formats.row_arrays import (FEATURE_DTYPES, RowWriter, ShardedRowWriter, checked_once,
                                                  open_rows, pack_mask, read_rows, rows_in_blocks, unpack_mask)
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.features.image_features import extract_region_features

__all__ = ["DETECTIONS", "fragment_boxes", "extract_fragment_features", "load_fragment_features"]

DETECTIONS = 19   # the paper's top-19 detections (+ the whole image = 20 fragments)


def fragment_boxes(proposals: np.ndarray, height: int, width: int,
                   detections: int = DETECTIONS) -> np.ndarray:
    """(1 + min(detections, N), 4) inclusive boxes: the whole image, then the top-ranked proposals."""
    proposals = np.asarray(proposals, np.float32).reshape(-1, 4)
    whole = np.array([[0, 0, width - 1, height - 1]], np.float32)
    return np.concatenate([whole, proposals[:detections]])


def extract_fragment_features(image_paths: Mapping[str, str | os.PathLike] | Sequence[str],
                              proposals: Mapping[str, np.ndarray], backbone: keras.Model, *,
                              image_ids: Sequence[str] | None = None, detections: int = DETECTIONS,
                              out: str | os.PathLike | None = None, dtype=np.float32):
    """CNN features of every image's fragments: ``(N, 1 + detections, D)`` and a bool (N, 1 + detections) mask.

    `image_paths` maps image id -> file (or is a list aligned with
    `image_ids`); `proposals` maps image id -> ranked inclusive boxes (N, 4).
    `out`: a folder the features are written to image by image as a sharded
    row array of `dtype` (`row_arrays.ShardedRowWriter`; returned
    memory-mapped): a build interrupted resumes after its last complete
    shard. Without `out` the array is returned in RAM (small sets only).
    """
    if image_ids is None:
        image_ids = list(image_paths)
    if not len(image_ids):
        raise ConfigError("no images to encode")
    paths = image_paths if isinstance(image_paths, Mapping) else dict(zip(image_ids, image_paths))
    slots = 1 + detections
    # The mask follows from the proposal counts alone, so a resumed build
    # need not encode the images it skips.
    mask = np.zeros((len(image_ids), slots), bool)
    for n, image_id in enumerate(image_ids):
        if image_id not in proposals:
            raise DataFormatError("proposals", f"no proposals for image {image_id}", record=image_id)
        mask[n, :len(fragment_boxes(proposals[image_id], 1, 1, detections))] = True
    dim = int(backbone.output_shape[-1])
    writer = ShardedRowWriter(out, (slots, dim), dtype) if out is not None else None
    features = None if writer else np.zeros((len(image_ids), slots, dim), np.float32)
    for n in range(writer.rows_done if writer else 0, len(image_ids)):
        image_id = image_ids[n]
        image = load_image(paths[image_id])
        boxes = fragment_boxes(proposals[image_id], image.shape[0], image.shape[1], detections)
        # extract_region_features crops half-open boxes; the package's boxes are inclusive.
        encoded = extract_region_features(image, boxes + np.array([0, 0, 1, 1], np.float32), backbone,
                                          source=str(paths[image_id]))
        if writer is None:
            features[n, :len(encoded)] = encoded
        else:
            row = np.zeros((1, slots, dim), np.float32)
            row[0, :len(encoded)] = encoded
            writer.append(row)
    return (features if writer is None else writer.finish()), mask


def _recorded_padding_mask(array, path: str) -> np.ndarray:
    """`_padding_mask` of the file `path`, computed once per version of the file and kept in a
    record beside it (`row_arrays.checked_once`): a later load reads neither the 37 GB of COCO
    fragments nor the page cache they would evict."""
    packed = checked_once(path, "fragment_padding_mask", lambda: pack_mask(_padding_mask(array, path)))
    mask = unpack_mask(packed)
    if mask.shape != tuple(array.shape[:2]):
        raise DataFormatError(path, f"its scan record holds a {mask.shape} mask for {tuple(array.shape[:2])} "
                              f"rows; delete {path}.checked.json")
    return mask


def _padding_mask(array, source, converted=None) -> np.ndarray:
    """The (N, F) mask of `array` (an all-zero fragment row is padding), checking every value is
    finite; one pass, block by block. With `converted` (a writable array of `array`'s shape) each
    block is also cast into it, and the mask and the check are those of the cast values."""
    mask = np.zeros(array.shape[:2], bool)
    first_bad, bad = None, 0
    for start, stop in rows_in_blocks(array):
        block = read_rows(array, start, stop)   # through the file: the pass leaves RSS as it was
        if converted is not None:
            block = block.astype(converted.dtype)
            converted[start:stop] = block
        # |x| summed in float64 cannot overflow, so a non-finite sum is a NaN or inf value, and
        # (a sum of non-negative terms) it is > 0 exactly when some value of the row is non-zero.
        sums = np.abs(block).sum(axis=2, dtype=np.float64)
        finite = np.isfinite(sums).all(axis=1)
        if not finite.all():
            bad += int((~finite).sum())
            first_bad = start + int(np.flatnonzero(~finite)[0]) if first_bad is None else first_bad
        mask[start:stop] = sums > 0
    if first_bad is not None:
        raise DataFormatError(source, f"NaN or inf in the fragments of {bad} image(s)", record=first_bad)
    return mask


def _stored_dtype(stored: np.dtype, wanted: np.dtype | None) -> np.dtype:
    """The dtype the features are used in: float16 and float32 files as they are (float32 ones
    halved when float16 is asked for), any other numeric dtype converted (to float32 by default)."""
    if stored == np.float16 or (stored == np.float32 and wanted != np.float16):
        return stored
    return wanted if wanted is not None else np.dtype(np.float32)


def _converted_copy(source: str, dataset, target: np.dtype, cache_dir, key: str | None):
    """`dataset` cast to `target` block by block: a ``.npy`` cache in `cache_dir` (named by the
    source file's path, size, time and the dtype, so a replaced file is converted again), or an
    array in RAM without `cache_dir`. Returns (array, mask)."""
    if cache_dir is None:
        converted = np.empty(dataset.shape, target)
        return converted, _padding_mask(dataset, source, converted)
    info = os.stat(source)
    name = hashlib.sha1(repr((os.path.realpath(source), info.st_size, info.st_mtime_ns, key,
                              target.name)).encode()).hexdigest()[:10]
    path = os.path.join(os.fspath(cache_dir), f"fragment_features_{target.name}_{name}.npy")
    if os.path.isfile(path):
        converted = open_rows(path)
        return converted, _recorded_padding_mask(converted, path)
    with RowWriter(path, dataset.shape, target) as out:
        mask = _padding_mask(dataset, source, out)
    checked_once(path, "fragment_padding_mask", lambda: pack_mask(mask))   # the pass just made
    return open_rows(path), mask


def load_fragment_features(path: str | os.PathLike, *, expected_images: int | None = None,
                           key: str | None = None, cache_dir: str | os.PathLike | None = None,
                           dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """Precomputed fragment features ``(N, F, D)`` from ``.npy`` or ``.h5`` (dataset `key`,
    default the only 3-D dataset) or a sharded row-array folder, with a mask: an all-zero
    fragment row is padding.

    float32 and float16 ``.npy`` files are memory-mapped as they are. Other
    dtypes (and float32 when `dtype` is float16) and HDF5 files are converted
    once, block by block, into a ``.npy`` in `cache_dir` (without one: into
    RAM, for small sets). The finiteness check and the mask are one pass over
    the rows, block by block.

    Raises DataFormatError naming the file for a missing file, a wrong number
    of dimensions, a row count other than `expected_images`, or NaN/inf (naming the image row).
    """
    path = os.fspath(path)
    wanted = None if dtype is None else np.dtype(dtype)
    if wanted is not None and wanted.name not in FEATURE_DTYPES:
        raise ConfigError(f"fragment features are stored as one of {FEATURE_DTYPES}, got {wanted}")
    if os.path.isdir(path):
        return _checked_rows(path, open_rows(path), expected_images, wanted, cache_dir, key)
    if not os.path.isfile(path):
        raise DataFormatError(path, "fragment feature file does not exist")
    if path.endswith(".npy"):
        return _checked_rows(path, open_rows(path), expected_images, wanted, cache_dir, key)
    if path.endswith((".h5", ".hdf5")):
        try:
            with h5py.File(path, "r") as f:
                names = [k for k in f if isinstance(f[k], h5py.Dataset) and f[k].ndim == 3]
                if key is None and len(names) != 1:
                    raise DataFormatError(path, f"expected one 3-D dataset (images, fragments, dim), "
                                          f"found {names or 'none'}; pass key=")
                dataset = f[key or names[0]]
                _check_shape(path, dataset, expected_images)
                # HDF5 reads rows only in increasing order: converted once, row-major, for the batch gather.
                return _converted_copy(path, dataset, _stored_dtype(dataset.dtype, wanted), cache_dir,
                                       key or names[0])
        except (OSError, KeyError) as err:
            raise DataFormatError(path, f"cannot read the HDF5 file ({err})") from None
    raise DataFormatError(path, "expected a .npy or .h5 file of shape (images, 20, dim)")


def _check_shape(path: str, array, expected_images: int | None) -> None:
    if array.ndim != 3:
        raise DataFormatError(path, f"expected fragment features of shape (images, fragments, dim), "
                              f"got shape {array.shape}")
    if expected_images is not None and len(array) != expected_images:
        raise DataFormatError(path, f"{len(array)} images of fragment features, expected "
                              f"{expected_images} (one per image of the split, in split order)")
    if np.dtype(array.dtype).kind not in "iuf":
        raise DataFormatError(path, f"fragment features must be numeric, got dtype {array.dtype}")


def _checked_rows(path: str, array, expected_images, wanted, cache_dir, key):
    _check_shape(path, array, expected_images)
    target = _stored_dtype(np.dtype(array.dtype), wanted)
    if target == array.dtype:
        return array, _recorded_padding_mask(array, path)
    return _converted_copy(path, array, target, cache_dir, key)
