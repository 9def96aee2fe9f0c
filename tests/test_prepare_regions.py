"""Region/phrase feature preparation for phrase localization."""
import h5py
import numpy as np
import pytest

from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.errors import DataFormatError
from tf_twobranch.features import prepare_regions as pr


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=40,
                                     splits=(20, 5, 15), num_proposals=10)


def _spec(**kw):
    return pr.RegionFeatureSpec(scene_cnn_epochs=1, word_dim=8, fisher_components=2, max_proposals=10, **kw)


def test_missing_proposals_name_the_file_and_image(tiny_dataset, tmp_path):
    test_ids = pr.split_image_ids(tiny_dataset, "test")
    partial = tmp_path / "partial.h5"
    with h5py.File(tiny_dataset / "proposals.h5", "r") as src, h5py.File(partial, "w") as dst:
        for key in src:
            if key != test_ids[3]:
                dst.create_dataset(key, data=src[key][()])
    with pytest.raises(DataFormatError) as err:
        pr.read_split_proposals(partial, test_ids, 10)
    assert "partial.h5" in str(err.value) and test_ids[3] in str(err.value)
    with pytest.raises(DataFormatError, match=test_ids[3]):
        pr.prepare_phrase_localization(tiny_dataset, tmp_path / "cache", _spec(proposals=str(partial)))


def test_half_open_conversion_stays_inside_the_image():
    boxes = np.array([[0, 0, 95, 95], [10, 20, 10, 20], [-3, 5, 120, 7]], np.float32)
    out = pr._half_open(boxes, 96, 96)
    assert out.tolist()[0] == [0, 0, 96, 96] and out.tolist()[1] == [10, 20, 11, 21]
    assert (out[:, 2] <= 96).all() and (out[:, 0] >= 0).all() and (out[:, 2] > out[:, 0]).all()


@pytest.mark.slow
def test_prepare_builds_cached_split_data(tiny_dataset, tmp_path):
    spec = _spec(text_encoder="mean_vector")
    data = pr.prepare_phrase_localization(tiny_dataset, tmp_path / "cache", spec)
    train, test = data["train"], data["test"]
    assert train.num_phrases > 0 and test.num_phrases > 0
    assert train.region_features.shape[1] == test.region_features.shape[1]
    assert (test.num_proposals <= 10).all()
    assert train.region_is_gt.sum() == train.num_chains
    assert np.isfinite(np.asarray(test.region_features)).all()
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.npy"))
    assert cached  # region features on disk
    again = pr.prepare_phrase_localization(tiny_dataset, tmp_path / "cache", spec)["test"]
    np.testing.assert_array_equal(np.asarray(again.region_features), np.asarray(test.region_features))
    np.testing.assert_array_equal(again.phrase_features, test.phrase_features)
