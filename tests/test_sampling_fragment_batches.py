"""Training batches of the deep fragment embeddings: distinct images, one of their sentences, stateless draws."""
import numpy as np
import pytest

from tf_twobranch.errors import ConfigError
from tf_twobranch.sampling import fragment_batches as fb


def _data():
    caption_image = np.repeat(np.arange(12), 3)            # 12 images, 3 sentences each
    lengths = np.arange(36) % 4                             # some sentences have no fragment
    splits = np.concatenate([[0], np.cumsum(lengths)])
    total = splits[-1]
    ids = np.arange(total, dtype=np.int32)
    return caption_image, fb.padded_sentence_arrays(ids % 3, ids, ids + 1, splits), splits


def test_padded_sentence_arrays_keep_every_fragment_in_order():
    _, padded, splits = _data()
    assert padded["relation"].shape == (36, 3) and padded["sentence_mask"].sum() == splits[-1]
    np.testing.assert_array_equal(padded["word1"][padded["sentence_mask"]], np.arange(splits[-1]))
    assert not padded["sentence_mask"][0].any()


def test_batches_hold_distinct_images_each_with_one_of_its_sentences_and_are_reproducible():
    caption_image, padded, _ = _data()
    features = np.arange(12, dtype=np.float32)[:, None, None] * np.ones((1, 2, 3), np.float32)
    ds = fb.train_dataset(features, np.ones((12, 2), bool), padded, caption_image, batch_size=5, seed=3)
    batches = list(ds.take(20).as_numpy_iterator())
    for b in batches:
        images = b["image_fragments"][:, 0, 0].astype(int)
        assert len(set(images)) == 5
        for image, word1, mask in zip(images, b["word1"], b["sentence_mask"]):
            owners = {s for s in range(36) if caption_image[s] == image}
            matches = [s for s in owners if np.array_equal(padded["word1"][s], word1)
                       and np.array_equal(padded["sentence_mask"][s], mask)]
            assert matches
    seen = {int(i) for b in batches for i in b["image_fragments"][:, 0, 0]}
    assert seen == set(range(12))
    again = list(fb.train_dataset(features, np.ones((12, 2), bool), padded, caption_image, batch_size=5,
                                  seed=3, start_step=7).take(3).as_numpy_iterator())
    for a, b in zip(again, batches[7:10]):
        np.testing.assert_array_equal(a["word1"], b["word1"])
    assert fb.steps_per_epoch(36, 5) == 8


def test_impossible_batches_are_clear_errors():
    caption_image, padded, _ = _data()
    with pytest.raises(ConfigError, match="exceeds the 12 training images"):
        fb.train_dataset(np.zeros((12, 2, 3)), np.ones((12, 2), bool), padded, caption_image, batch_size=13, seed=0)
    with pytest.raises(ConfigError, match="have no sentence"):
        fb.train_dataset(np.zeros((13, 2, 3)), np.ones((13, 2), bool), padded, caption_image, batch_size=4, seed=0)
