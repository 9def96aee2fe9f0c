"""Image fragments (Karpathy et al. 2014 §3.2): whole image + top-ranked boxes, and precomputed arrays."""
import h5py
import keras
import numpy as np
import pytest
from PIL import Image

from tf_twobranch.errors import DataFormatError
from tf_twobranch.features.image_features import extract_region_features
from tf_twobranch.systems.fragments.image_fragments import (extract_fragment_features, fragment_boxes,
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
    paths, proposals = _two_images(tmp_path)
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


def _two_images(tmp_path):
    rng = np.random.default_rng(0)
    paths = {}
    for name, size in (("a", (30, 40)), ("b", (24, 24))):
        paths[name] = tmp_path / f"{name}.png"
        Image.fromarray(rng.integers(0, 255, size + (3,), dtype=np.uint8)).save(paths[name])
    proposals = {"a": np.tile(np.array([[2, 3, 20, 25]], np.float32), (25, 1)),
                 "b": np.array([[0, 0, 10, 10], [5, 5, 20, 20]], np.float32)}
    return paths, proposals


def test_the_builder_writes_a_sharded_cache_that_resumes_and_can_be_half(tmp_path):
    from tf_twobranch.data.formats.row_arrays import RowWriter, ShardedRows
    paths, proposals = _two_images(tmp_path)
    backbone = _backbone()
    in_ram, mask = extract_fragment_features(paths, proposals, backbone)
    written, written_mask = extract_fragment_features(paths, proposals, backbone, out=tmp_path / "cache")
    assert isinstance(written, ShardedRows)
    np.testing.assert_array_equal(written[0:2], in_ram)
    np.testing.assert_array_equal(written_mask, mask)
    half, _ = extract_fragment_features(paths, proposals, backbone, out=tmp_path / "half", dtype=np.float16)
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half[0:2], in_ram.astype(np.float16))
    # An interrupted build: image a's shard is complete, so a resumed build encodes image b only.
    with RowWriter(tmp_path / "resumed" / "shard_00000.npy", (1, 20, 4)) as shard:
        shard[:] = in_ram[:1]
    paths["a"].unlink()
    resumed, resumed_mask = extract_fragment_features(paths, proposals, backbone, out=tmp_path / "resumed")
    np.testing.assert_array_equal(resumed[0:2], in_ram)
    np.testing.assert_array_equal(resumed_mask, mask)


def test_precomputed_features_are_memory_mapped_or_converted_once_blockwise(tmp_path, monkeypatch):
    from tf_twobranch.data.formats import row_arrays
    rng = np.random.default_rng(2)
    array = rng.normal(size=(7, 20, 5))
    array[3, 4:] = 0
    array[5, 2] = 1e-50          # non-zero in float64, zero once float32: padding, as astype(float32) made it
    old_mask = np.abs(array.astype(np.float32)).sum(axis=2) > 0
    # Blocks of two images, so the check, the mask and the conversion each span several blocks.
    monkeypatch.setattr("tf_twobranch.systems.fragments.image_fragments.rows_in_blocks",
                        lambda a, block_bytes=None: row_arrays.rows_in_blocks(a, 2 * 20 * 5 * 8))
    for dtype in (np.float32, np.float16):
        np.save(tmp_path / f"{np.dtype(dtype).name}.npy", array.astype(dtype))
        got, mask = load_fragment_features(tmp_path / f"{np.dtype(dtype).name}.npy", expected_images=7)
        assert isinstance(got, np.memmap) and got.dtype == dtype      # no copy, half stays half
        np.testing.assert_array_equal(mask, np.abs(array.astype(dtype)).sum(axis=2) > 0)
    np.save(tmp_path / "f64.npy", array)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_dataset("fragments", data=array, chunks=(1, 20, 5))
    cache = tmp_path / "cache"
    for name in ("f64.npy", "f.h5"):
        got, mask = load_fragment_features(tmp_path / name, cache_dir=cache)
        assert isinstance(got, np.memmap) and got.dtype == np.float32
        np.testing.assert_array_equal(got, array.astype(np.float32))
        np.testing.assert_array_equal(mask, old_mask)
        again, _ = load_fragment_features(tmp_path / name, cache_dir=cache)
        assert again.filename == got.filename
    assert len(list(cache.glob("*.npy"))) == 2      # (beside them: their scan records, *.checked.json)
    half, _ = load_fragment_features(tmp_path / "float32.npy", cache_dir=cache, dtype="float16")
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, array.astype(np.float32).astype(np.float16))
    # NaN in an HDF5 file: the error names the file and the image row; no half-written cache is left.
    bad = array.copy()
    bad[5, 19, 4] = np.inf
    with h5py.File(tmp_path / "bad.h5", "w") as f:
        f["fragments"] = bad
    with pytest.raises(DataFormatError, match=r"bad\.h5, record 5: NaN or inf in the fragments of 1 image"):
        load_fragment_features(tmp_path / "bad.h5", cache_dir=tmp_path / "bad_cache")
    assert not any(p.is_file() for p in (tmp_path / "bad_cache").glob("*"))
    np.save(tmp_path / "text.npy", np.array([["a"] * 3] * 2 * 20).reshape(2, 20, 3))
    with pytest.raises(DataFormatError, match="must be numeric"):
        load_fragment_features(tmp_path / "text.npy")


def test_scene_cnn_features_are_written_once_block_by_block_per_mask(tmp_path):
    from tf_twobranch.systems.fragments.features import FragmentImages
    rng = np.random.default_rng(3)
    inputs = rng.normal(size=(5, 4, 6)).astype(np.float32)
    np.save(tmp_path / "inputs.npy", inputs)
    mask = rng.random((5, 4)) > 0.3
    head = (rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32))
    # The computation before the cache: one in-RAM array, masked rows zeroed.
    want = np.empty((5, 4, 3), np.float32)
    for i in range(0, 5, 2):
        want[i:i + 2] = inputs[i:i + 2] @ head[0] + head[1]
    want[~mask] = 0.0
    cached = FragmentImages(list("abcde"), np.load(tmp_path / "inputs.npy", mmap_mode="r"), mask, head,
                            tmp_path / "train")
    got = cached.features(chunk=2)
    assert isinstance(got, np.memmap)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(FragmentImages(list("abcde"), inputs, mask, head).features(chunk=2), want)
    assert cached.features().filename == got.filename            # read back, not computed again
    cached.mask = mask.copy()
    cached.mask[:, 1:] = False                                    # the fullframe ablation: its own file
    fullframe = cached.features(chunk=2)
    assert fullframe.filename != got.filename and not np.asarray(fullframe)[:, 1:].any()
    assert FragmentImages(list("abcde"), inputs, mask).features() is inputs     # no head: no copy
