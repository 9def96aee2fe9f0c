"""N-pair batches (Das et al. §4.1): distinct images, one trainable caption each, resumable."""
import numpy as np
import pytest

from tf_twobranch.errors import ConfigError
from tf_twobranch.systems.npair import sampling as npair_batches


def _data(num_images=12, per_image=5, seed=0):
    rng = np.random.default_rng(seed)
    caption_image = np.repeat(np.arange(num_images), per_image)
    rng.shuffle(caption_image)                      # captions need not be grouped by image
    n = len(caption_image)
    token_ids = np.stack([np.full(4, i, np.int32) for i in range(n)])     # row id in every position
    token_mask = np.ones((n, 4), bool)
    images = np.arange(num_images, dtype=np.float32)[:, None, None, None] * np.ones((1, 2, 2, 3), np.float32)
    return images, token_ids, token_mask, caption_image


def test_batches_never_hold_two_captions_of_one_image_and_pair_each_caption_with_its_image():
    images, ids, mask, caption_image = _data()
    trainable = np.ones(len(caption_image), bool)
    ds = npair_batches.train_dataset(images, ids, mask, caption_image, trainable, batch_size=8, seed=3)
    for batch in ds.take(30):
        image_rows = batch["backbone_map"].numpy()[:, 0, 0, 0].astype(int)
        caption_rows = batch["token_ids"].numpy()[:, 0]
        assert len(set(image_rows)) == 8                      # distinct images: one positive per row
        np.testing.assert_array_equal(caption_image[caption_rows], image_rows)


def test_only_trainable_captions_are_drawn_and_images_without_one_are_left_out():
    images, ids, mask, caption_image = _data(num_images=6, per_image=3)
    trainable = np.ones(len(caption_image), bool)
    trainable[caption_image == 2] = False                     # image 2: no usable caption
    trainable[np.flatnonzero(caption_image == 4)[:2]] = False  # image 4: one usable caption
    ds = npair_batches.train_dataset(images, ids, mask, caption_image, trainable, batch_size=5, seed=0)
    seen = set()
    for batch in ds.take(20):
        rows = batch["token_ids"].numpy()[:, 0]
        assert trainable[rows].all()
        seen.update(batch["backbone_map"].numpy()[:, 0, 0, 0].astype(int))
    assert 2 not in seen and seen == {0, 1, 3, 4, 5}
    with pytest.raises(ConfigError, match="exceeds the 5 training images"):
        npair_batches.train_dataset(images, ids, mask, caption_image, trainable, batch_size=6, seed=0)


def test_a_resumed_stream_repeats_the_same_batches():
    images, ids, mask, caption_image = _data()
    trainable = np.ones(len(caption_image), bool)
    full = [b["token_ids"].numpy() for b in npair_batches.train_dataset(
        images, ids, mask, caption_image, trainable, batch_size=4, seed=1).take(6)]
    resumed = [b["token_ids"].numpy() for b in npair_batches.train_dataset(
        images, ids, mask, caption_image, trainable, batch_size=4, seed=1, start_step=3).take(3)]
    for a, b in zip(full[3:], resumed):
        np.testing.assert_array_equal(a, b)
    rows_images, rows = npair_batches.batch_rows(caption_image, trainable, 4, 3, 1)
    np.testing.assert_array_equal(ids[rows.numpy(), 0], full[3][:, 0])
    np.testing.assert_array_equal(caption_image[rows.numpy()], rows_images.numpy())


def test_batches_read_in_parallel_are_the_stream_read_one_at_a_time(tmp_path):
    # The default reads several batches at once (an H100 waited 90 % of each step on one at a
    # time); each batch is a function of its step and the order is kept: the same stream.
    images, ids, mask, caption_image = _data(num_images=30)
    np.save(tmp_path / "maps.npy", images.astype(np.float16))
    maps = np.load(tmp_path / "maps.npy", mmap_mode="r")
    trainable = np.ones(len(caption_image), bool)
    streams = [list(npair_batches.train_dataset(maps, ids, mask, caption_image, trainable, batch_size=8, seed=2,
                                                parallel_batches=p).take(12).as_numpy_iterator())
               for p in (1, None, 4)]
    for serial, *parallel in zip(*streams):
        for other in parallel:
            for k in serial:
                assert other[k].dtype == serial[k].dtype
                np.testing.assert_array_equal(other[k], serial[k], err_msg=k)
