"""Image fragments of Karpathy et al. (NIPS 2014, §3.2): the whole image and its
top 19 detections, each encoded by a CNN.

No detector with weights is available offline, so the "detections" are the 19
highest-ranked boxes of a proposals file (`tf_twobranch.data.formats.proposals`:
boxes in rank order); users who ran RCNN elsewhere give the fragment features
directly as one ``(num_images, 20, D)`` array (`load_fragment_features`).
Fragment 0 is always the whole image, so the paper's "fullframe only"
ablation keeps fragment 0. Images with fewer proposals get a mask.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

import h5py
import keras
import numpy as np

from tf_twobranch.data.formats.images import load_image
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
                              image_ids: Sequence[str] | None = None,
                              detections: int = DETECTIONS) -> tuple[np.ndarray, np.ndarray]:
    """CNN features of every image's fragments: ``(N, 1 + detections, D)`` and a bool mask.

    `image_paths` maps image id -> file (or is a list aligned with
    `image_ids`); `proposals` maps image id -> ranked inclusive boxes (N, 4).
    """
    if image_ids is None:
        image_ids = list(image_paths)
    paths = image_paths if isinstance(image_paths, Mapping) else dict(zip(image_ids, image_paths))
    slots = 1 + detections
    features, mask = None, np.zeros((len(image_ids), slots), bool)
    for n, image_id in enumerate(image_ids):
        if image_id not in proposals:
            raise DataFormatError("proposals", f"no proposals for image {image_id}", record=image_id)
        image = load_image(paths[image_id])
        boxes = fragment_boxes(proposals[image_id], image.shape[0], image.shape[1], detections)
        # extract_region_features crops half-open boxes; the package's boxes are inclusive.
        encoded = extract_region_features(image, boxes + np.array([0, 0, 1, 1], np.float32), backbone,
                                          source=str(paths[image_id]))
        if features is None:
            features = np.zeros((len(image_ids), slots, encoded.shape[1]), np.float32)
        features[n, :len(encoded)] = encoded
        mask[n, :len(encoded)] = True
    if features is None:
        raise ConfigError("no images to encode")
    return features, mask


def load_fragment_features(path: str | os.PathLike, *, expected_images: int | None = None,
                           key: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Precomputed fragment features ``(N, F, D)`` from ``.npy`` or ``.h5`` (dataset `key`,
    default the only 3-D dataset), with a mask: an all-zero fragment row is padding.

    Raises DataFormatError naming the file for a missing file, a wrong number
    of dimensions, a row count other than `expected_images`, or NaN/inf.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataFormatError(path, "fragment feature file does not exist")
    if path.endswith(".npy"):
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as err:
            raise DataFormatError(path, f"cannot read the .npy file ({err})") from None
    elif path.endswith((".h5", ".hdf5")):
        try:
            with h5py.File(path, "r") as f:
                names = [k for k in f if isinstance(f[k], h5py.Dataset) and f[k].ndim == 3]
                if key is None and len(names) != 1:
                    raise DataFormatError(path, f"expected one 3-D dataset (images, fragments, dim), "
                                          f"found {names or 'none'}; pass key=")
                array = np.asarray(f[key or names[0]])
        except (OSError, KeyError) as err:
            raise DataFormatError(path, f"cannot read the HDF5 file ({err})") from None
    else:
        raise DataFormatError(path, "expected a .npy or .h5 file of shape (images, 20, dim)")
    if array.ndim != 3:
        raise DataFormatError(path, f"expected fragment features of shape (images, fragments, dim), "
                              f"got shape {array.shape}")
    if expected_images is not None and len(array) != expected_images:
        raise DataFormatError(path, f"{len(array)} images of fragment features, expected "
                              f"{expected_images} (one per image of the split, in split order)")
    if array.dtype.kind not in "iuf":
        raise DataFormatError(path, f"fragment features must be numeric, got dtype {array.dtype}")
    array = array.astype(np.float32)
    bad = ~np.isfinite(array).all(axis=(1, 2))
    if bad.any():
        raise DataFormatError(path, f"NaN or inf in the fragments of {int(bad.sum())} image(s)",
                              record=int(np.flatnonzero(bad)[0]))
    return array, np.abs(array).sum(axis=2) > 0
