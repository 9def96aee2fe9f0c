"""Region/phrase feature preparation for phrase localization."""
import h5py
import numpy as np
import pytest

from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.errors import DataFormatError
from tf_twobranch.features import prepare_regions as pr


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=40,
                                     splits=(20, 5, 15), num_proposals=10)


@pytest.fixture(scope="module")
def tiny_layout(tiny_dataset):
    return resolve_dataset(tiny_dataset)


def _spec(**kw):
    return pr.RegionFeatureSpec(scene_cnn_epochs=1, word_dim=8, fisher_components=2, max_proposals=10, **kw)


def test_missing_proposals_name_the_file_and_image(tiny_dataset, tiny_layout, tmp_path):
    test_ids = tiny_layout.split_ids("test")
    partial = tmp_path / "partial.h5"
    with h5py.File(tiny_dataset / "proposals.h5", "r") as src, h5py.File(partial, "w") as dst:
        for key in src:
            if key != test_ids[3]:
                dst.create_dataset(key, data=src[key][()])
    with pytest.raises(DataFormatError) as err:
        pr.read_split_proposals(partial, test_ids, 10)
    assert "partial.h5" in str(err.value) and test_ids[3] in str(err.value)
    with pytest.raises(DataFormatError, match=test_ids[3]):
        pr.prepare_phrase_localization(tiny_layout, tmp_path / "cache", _spec(proposals=str(partial)))


def test_half_open_conversion_stays_inside_the_image():
    boxes = np.array([[0, 0, 95, 95], [10, 20, 10, 20], [-3, 5, 120, 7]], np.float32)
    out = pr._half_open(boxes, 96, 96)
    assert out.tolist()[0] == [0, 0, 96, 96] and out.tolist()[1] == [10, 20, 11, 21]
    assert (out[:, 2] <= 96).all() and (out[:, 0] >= 0).all() and (out[:, 2] > out[:, 0]).all()


@pytest.mark.slow
def test_prepare_builds_cached_split_data(tiny_layout, tmp_path):
    spec = _spec(text_encoder="mean_vector")
    data = pr.prepare_phrase_localization(tiny_layout, tmp_path / "cache", spec)
    train, test = data["train"], data["test"]
    assert train.num_phrases > 0 and test.num_phrases > 0
    assert train.region_features.shape[1] == test.region_features.shape[1]
    assert (test.num_proposals <= 10).all()
    assert train.region_is_gt.sum() == train.num_chains
    assert np.isfinite(np.asarray(test.region_features)).all()
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.npy"))
    assert cached  # region features on disk
    again = pr.prepare_phrase_localization(tiny_layout, tmp_path / "cache", spec)["test"]
    np.testing.assert_array_equal(np.asarray(again.region_features), np.asarray(test.region_features))
    np.testing.assert_array_equal(again.phrase_features, test.phrase_features)


def test_split_ids_use_the_split_file_reader(tmp_path):
    with pytest.raises(DataFormatError, match="split file missing"):
        resolve_dataset(tmp_path).split_ids("test")
    (tmp_path / "test.txt").write_text("\n  \n")
    with pytest.raises(DataFormatError, match=r"test\.txt: split file .*lists no image ids"):
        resolve_dataset(tmp_path).split_ids("test")
    (tmp_path / "test.txt").write_text("11.jpg\n12\n13 14\n")
    with pytest.raises(DataFormatError, match=r"test\.txt, line 3: expected one image id per line"):
        resolve_dataset(tmp_path).split_ids("test")
    (tmp_path / "test.txt").write_text("11.jpg\n12\n13\n")
    assert resolve_dataset(tmp_path).split_ids("test")[:2] == ["11", "12"]


def test_unreadable_proposal_files_are_data_format_errors(tiny_dataset, tiny_layout, tmp_path):
    from tf_twobranch.data.formats.proposals import read_proposals, write_proposals

    test_ids = tiny_layout.split_ids("test")
    truncated = tmp_path / "truncated.h5"
    write_proposals(truncated, read_proposals(tiny_dataset / "proposals.h5", test_ids))
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    empty = tmp_path / "empty.h5"
    empty.write_bytes(b"")
    text = tmp_path / "text.h5"
    text.write_text("these are not proposals\n")
    for path in (truncated, empty, text):
        with pytest.raises(DataFormatError) as err:
            pr.read_split_proposals(path, test_ids, 10)
        assert err.value.path == str(path)
    with pytest.raises(DataFormatError, match="truncated.h5"):
        pr.prepare_phrase_localization(tiny_layout, tmp_path / "cache", _spec(proposals=str(truncated)))


def _proposals_with_one_box_outside(tiny_dataset, tmp_path):
    from tf_twobranch.data.formats.proposals import read_proposals, write_proposals

    test_ids = resolve_dataset(tiny_dataset).split_ids("test")[:3]
    boxes = read_proposals(tiny_dataset / "proposals.h5")
    boxes[test_ids[1]] = boxes[test_ids[1]].copy()
    boxes[test_ids[1]][2] = [10, 20, 900, 40]  # the images are 96 x 96
    path = tmp_path / "scaled.h5"
    write_proposals(path, boxes)
    return path, test_ids


def test_proposals_outside_the_image_are_refused(tiny_dataset, tiny_layout, tmp_path):
    path, test_ids = _proposals_with_one_box_outside(tiny_dataset, tmp_path)
    spec = _spec(proposals=str(path), max_images={"test": 3})
    with pytest.raises(DataFormatError) as err:
        pr.split_region_features(tiny_layout, "test", tmp_path / "cache", spec)
    message = str(err.value)
    assert err.value.path == str(path) and err.value.record == test_ids[1]
    for part in ("box 2 [10, 20, 900, 40]", "96 x 96", "wrong scale", "--clip_proposals"):
        assert part in message
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.npy"))


def test_clip_proposals_clips_crops_and_iou_boxes_alike(tiny_dataset, tiny_layout, tmp_path, monkeypatch):
    from tf_twobranch.data.phrase_localization_data import build_phrase_localization_data

    path, test_ids = _proposals_with_one_box_outside(tiny_dataset, tmp_path)
    crops = {}

    class Backbone:
        output_shape = (None, 3)

    def fake_extract(image, boxes, backbone, batch_size, source):
        crops[source] = np.asarray(boxes)
        return np.zeros((len(boxes), 3), np.float32)

    monkeypatch.setattr(pr, "region_backbone", lambda *args: Backbone())
    monkeypatch.setattr(pr, "extract_region_features", fake_extract)  # the name prepare_regions imported
    spec = _spec(proposals=str(path), max_images={"test": 3}, clip_proposals=True)
    regions = pr.split_region_features(tiny_layout, "test", tmp_path / "cache", spec)
    clipped = regions["proposals"][test_ids[1]]
    np.testing.assert_array_equal(clipped[2], [10, 20, 95, 40])
    assert (regions["proposals_path"] == str(path)) and len(crops) == 3
    for image_id in test_ids:
        boxes = regions["proposals"][image_id]
        crop = crops[f"{path} (image {image_id})"][:len(boxes)]
        np.testing.assert_array_equal(crop, pr._half_open(boxes, 96, 96))
        np.testing.assert_array_equal(crop[:, :2], boxes[:, :2])
        np.testing.assert_array_equal(crop[:, 2:] - 1, boxes[:, 2:])
    examples = [e for e in regions["examples"] if e.image_id in test_ids]
    data = build_phrase_localization_data(examples, regions["proposals"], regions["proposal_features"],
                                          regions["gt_region_features"], np.zeros((len(examples), 2)))
    image = data.image_ids.index(test_ids[1])
    lo = data.image_region_offsets[image]
    np.testing.assert_array_equal(data.region_boxes[lo + 2], [10, 20, 95, 40])
    # A cache hit (sizes from the cache index, no image read) clips the same way.
    again = pr.split_region_features(tiny_layout, "test", tmp_path / "cache", spec)
    np.testing.assert_array_equal(again["proposals"][test_ids[1]], clipped)
    with pytest.raises(DataFormatError, match="--clip_proposals"):
        pr.split_region_features(tiny_layout, "test", tmp_path / "cache",
                                 _spec(proposals=str(path), max_images={"test": 3}))
