"""Image fragments (Karpathy et al. 2014 §3.2): whole image + top-ranked boxes, and precomputed arrays."""
import h5py
import keras
import numpy as np
import pytest
from PIL import Image

from tf_twobranch.errors import DataFormatError
from tf_twobranch.features.image_features import extract_region_features
from tf_twobranch.features.image_fragments import (extract_fragment_features, fragment_boxes,
                                                   load_fragment_features)


def _backbone():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(3, 3)(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


def test_fragment_boxes_put_the_whole_image_first():
    boxes = fragment_boxes(np.arange(100, dtype=np.float32).reshape(25, 4), 30, 40)
    assert boxes.shape == (20, 4) and boxes[0].tolist() == [0, 0, 39, 29]
    assert boxes[1].tolist() == [0, 1, 2, 3]      # the best-ranked proposal


def test_extract_fragment_features_masks_images_with_few_proposals(tmp_path):
    rng = np.random.default_rng(0)
    paths = {}
    for name, size in (("a", (30, 40)), ("b", (24, 24))):
        paths[name] = tmp_path / f"{name}.png"
        Image.fromarray(rng.integers(0, 255, size + (3,), dtype=np.uint8)).save(paths[name])
    proposals = {"a": np.tile(np.array([[2, 3, 20, 25]], np.float32), (25, 1)),
                 "b": np.array([[0, 0, 10, 10], [5, 5, 20, 20]], np.float32)}
    backbone = _backbone()
    features, mask = extract_fragment_features(paths, proposals, backbone)
    assert features.shape == (2, 20, 4) and mask.sum(axis=1).tolist() == [20, 3]
    assert np.all(features[1, 3:] == 0)
    whole = extract_region_features(np.asarray(Image.open(paths["b"])), np.array([[0, 0, 24, 24]]), backbone)
    np.testing.assert_allclose(features[1, 0], whole[0], rtol=1e-5)
    with pytest.raises(DataFormatError, match="no proposals for image c"):
        extract_fragment_features({**paths, "c": paths["a"]}, proposals, backbone)


def test_precomputed_fragment_features_and_their_errors(tmp_path):
    array = np.random.default_rng(1).normal(size=(3, 20, 5)).astype(np.float32)
    array[2, 10:] = 0
    np.save(tmp_path / "f.npy", array)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f["fragments"] = array
    for name in ("f.npy", "f.h5"):
        got, mask = load_fragment_features(tmp_path / name, expected_images=3)
        np.testing.assert_array_equal(got, array)
        assert mask.sum(axis=1).tolist() == [20, 20, 10]
    np.save(tmp_path / "flat.npy", array.reshape(3, -1))
    with pytest.raises(DataFormatError, match=r"flat.npy.*\(images, fragments, dim\)"):
        load_fragment_features(tmp_path / "flat.npy")
    with pytest.raises(DataFormatError, match="3 images of fragment features, expected 4"):
        load_fragment_features(tmp_path / "f.npy", expected_images=4)
    bad = array.copy()
    bad[1, 0, 0] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    with pytest.raises(DataFormatError, match="record 1"):
        load_fragment_features(tmp_path / "nan.npy")
    with pytest.raises(DataFormatError, match="does not exist"):
        load_fragment_features(tmp_path / "missing.npy")
