"""Training batches of the deep fragment embeddings: distinct images, one of their sentences, stateless draws."""
import numpy as np
import pytest

from tf_twobranch.errors import ConfigError
from tf_twobranch.systems.fragments import sampling as fb


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


def _old_train_dataset(image_fragments, image_mask, sentences, caption_image, *, batch_size, seed, start_step=0):
    """The implementation before streaming (every array a graph constant): the reference batches."""
    import tensorflow as tf
    image_fragments = np.asarray(image_fragments, np.float32)
    num_images = len(image_fragments)
    order, starts, counts = (tf.constant(a) for a in fb.sentences_by_image(np.asarray(caption_image, np.int64),
                                                                           num_images))
    images_t, mask_t = tf.constant(image_fragments), tf.constant(np.asarray(image_mask, bool))
    sentence_t = {k: tf.constant(v) for k, v in sentences.items()}

    def batch(step):
        images, chosen = fb.draw_distinct_images(order, starts, counts, num_images, batch_size, step, seed)
        out = {"image_fragments": tf.gather(images_t, images), "image_mask": tf.gather(mask_t, images)}
        out.update({k: tf.gather(v, chosen) for k, v in sentence_t.items()})
        return out

    return tf.data.Dataset.counter(start=start_step, dtype=tf.int64).map(batch)


def _memmapped(tmp_path, name, array):
    np.save(tmp_path / name, array)
    return np.load(tmp_path / name, mmap_mode="r")


def test_batches_from_memory_maps_equal_the_in_graph_implementation_bit_for_bit(tmp_path):
    caption_image, padded, _ = _data()
    rng = np.random.default_rng(0)
    features = rng.normal(size=(12, 4, 3)).astype(np.float32)
    mask = rng.random((12, 4)) > 0.3
    mapped = {k: _memmapped(tmp_path, f"{k}.npy", v) for k, v in padded.items()}
    for stored in (features, features.astype(np.float16)):
        got = fb.train_dataset(_memmapped(tmp_path, "f.npy", stored), _memmapped(tmp_path, "m.npy", mask),
                               mapped, caption_image, batch_size=5, seed=3, start_step=4)
        want = _old_train_dataset(stored, mask, padded, caption_image, batch_size=5, seed=3, start_step=4)
        assert got.element_spec == want.element_spec
        for a, b in zip(got.take(6).as_numpy_iterator(), want.take(6).as_numpy_iterator()):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_the_pipeline_graph_holds_no_dataset_array():
    # At COCO size the fragments are tens of GB and the padded sentences hundreds of MB: as graph
    # constants they are copied several times and fail past 2 GB. Only the per-image index
    # arrays (a few bytes per image and sentence) may be constants.
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2

    caption_image = np.repeat(np.arange(300), 2)
    lengths = np.arange(600) % 40
    splits = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.arange(splits[-1], dtype=np.int32)
    padded = fb.padded_sentence_arrays(ids % 3, ids, ids + 1, splits)        # 600 x 39 ids: ~94 KB each
    features = np.ones((300, 20, 64), np.float32)                             # 1.5 MB
    ds = fb.train_dataset(features, np.ones((300, 20), bool), padded, caption_image, batch_size=5, seed=3)
    graph = graph_pb2.GraphDef.FromString(ds._as_serialized_graph(
        external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE).numpy())
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    largest = max(n.attr["value"].tensor.ByteSize() for n in nodes if n.op == "Const")
    assert largest < 8 * 1024, largest


def test_batches_read_in_parallel_are_the_stream_read_one_at_a_time(tmp_path):
    # The default reads several batches at once (an H100 waited 95 % of each step on one at a
    # time); each batch is a function of its step and the order is kept: the same stream.
    caption_image, padded, _ = _data()
    features = np.random.default_rng(1).normal(size=(12, 4, 3)).astype(np.float16)
    mask = np.ones((12, 4), bool)
    stored = _memmapped(tmp_path, "f.npy", features)
    streams = [list(fb.train_dataset(stored, mask, padded, caption_image, batch_size=5, seed=3,
                                     parallel_batches=p).take(10).as_numpy_iterator()) for p in (1, None, 3)]
    for serial, *parallel in zip(*streams):
        for other in parallel:
            for k in serial:
                assert other[k].dtype == serial[k].dtype
                np.testing.assert_array_equal(other[k], serial[k], err_msg=k)
