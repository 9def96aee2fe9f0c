import numpy as np
import pytest

from tf_twobranch.errors import ConfigError
from tf_twobranch.systems.two_branch import sampling as S


def _take(ds, n):
    return [{k: v.numpy() for k, v in b.items()} for b in ds.take(n)]


def test_batches_follow_original_layout():
    cap_img = np.repeat(np.arange(50), 5)
    ds = S.image_sentence_batches(cap_img, 50, batch_size=8, sample_size=2, seed=3)
    for b in _take(ds, 5):
        assert b["image_index"].shape == (8,)
        assert b["text_index"].shape == (16,)
        # two distinct captions per anchor, both of that image, adjacent & sorted
        ti = b["text_index"].reshape(8, 2)
        assert np.all(ti[:, 0] < ti[:, 1])
        assert np.all(cap_img[ti] == b["image_index"][:, None])
        expected = cap_img[b["text_index"]][:, None] == b["image_index"][None, :]
        np.testing.assert_array_equal(b["labels"], expected)
        assert b["labels"].sum(axis=0).min() >= 2  # neighbourhood sampling


def test_epoch_covers_each_caption_once_as_anchor():
    cap_img = np.repeat(np.arange(20), 5)
    ds = S.image_sentence_batches(cap_img, 20, batch_size=10, sample_size=1, seed=0)
    steps = S.steps_per_epoch(100, 20, 10)
    anchors = np.concatenate([b["text_index"] for b in _take(ds, steps)])
    assert sorted(anchors) == list(range(100))


def test_deterministic_under_seed():
    cap_img = np.repeat(np.arange(30), 5)
    a = _take(S.image_sentence_batches(cap_img, 30, batch_size=6, seed=1), 3)
    b = _take(S.image_sentence_batches(cap_img, 30, batch_size=6, seed=1), 3)
    c = _take(S.image_sentence_batches(cap_img, 30, batch_size=6, seed=2), 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["text_index"], y["text_index"])
    assert any(not np.array_equal(x["text_index"], z["text_index"]) for x, z in zip(a, c))


def test_unique_images_mode():
    cap_img = np.repeat(np.arange(30), 5)
    for b in _take(S.image_sentence_batches(cap_img, 30, batch_size=10, seed=0,
                                            unique_images=True), 3):
        assert len(set(b["image_index"])) == 10


def test_similarity_pairs_balanced():
    cap_img = np.repeat(np.arange(40), 5)
    for b in _take(S.similarity_pair_batches(cap_img, 40, batch_size=16, seed=0), 4):
        lab = b["labels"]
        assert lab[:16].all() and not lab[16:].any()
        same = cap_img[b["text_index"]] == b["image_index"]
        np.testing.assert_array_equal(same.astype(int), lab)


def test_attach_features_gathers_rows():
    cap_img = np.repeat(np.arange(10), 2)
    img = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    txt = np.arange(20 * 4, dtype=np.float32).reshape(20, 4)
    ds = S.attach_features(S.image_sentence_batches(cap_img, 10, batch_size=4), img, txt)
    b = {k: v.numpy() for k, v in next(iter(ds)).items()}
    np.testing.assert_array_equal(b["image"], img[b["image_index"]])
    np.testing.assert_array_equal(b["text"], txt[b["text_index"]])
    assert b["image"].shape == (4, 3) and b["text"].shape == (8, 4)


def test_bad_configuration():
    with pytest.raises(ConfigError, match="sample_size"):
        S.image_sentence_batches(np.repeat(np.arange(5), 2), 5, batch_size=2, sample_size=3)
    with pytest.raises(ConfigError, match="batch_size"):
        S.image_sentence_batches(np.repeat(np.arange(5), 2), 5, batch_size=50)
