"""The N-pair (Das et al.) data path at scale: maps built batch by batch into resumable row arrays,
batches gathered by index, evaluation inputs written chunk by chunk; each result equal to the
whole-array computation it replaces."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.data.formats.row_arrays import ShardedRows, write_rows
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.systems.npair import heat_maps as localization_maps
from tf_twobranch.systems.npair import features as prepare_npair
from tf_twobranch.features.images import load_images_at_size
from tf_twobranch.systems.npair.model import NPairLocalizationConfig, build_npair_model
from tf_twobranch.systems.fragments import sampling as fragment_batches
from tf_twobranch.systems.npair import sampling as npair_batches


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=24,
                                     splits=(14, 5, 5), with_proposals=False)
    layout = resolve_dataset(root)
    corpora = load_caption_splits(layout)
    return layout, {"train": corpora["train"], "test": corpora["test"]}


def _backbone():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((96, 96, 3))
    x = keras.layers.AveragePooling2D(16)(inputs)
    return keras.Model(inputs, keras.layers.Conv2D(4, 1, activation="relu")(x))


def _whole_array_maps(layout, corpus, backbone, batch_size):
    """What the builder computed before: every image in RAM, the backbone over batches of it."""
    paths = layout.image_paths(corpus.image_ids, source=corpus.source)
    images = load_images_at_size(paths, 96)
    return np.concatenate([np.asarray(backbone(images[i:i + batch_size].astype(np.float32), training=False))
                           for i in range(0, len(images), batch_size)]).astype(np.float32)


def test_backbone_maps_resume_after_an_interruption_and_equal_an_uninterrupted_build(tiny_data, tmp_path,
                                                                                   monkeypatch):
    layout, splits = tiny_data
    backbone = _backbone()
    spec = prepare_npair.NPairInputSpec()
    row_bytes = 6 * 6 * 4 * 4
    # Shards of 3 rows, batches of 4: a resumed build starts inside a batch.
    options = dict(batch_size=4, shard_bytes=3 * row_bytes)
    whole = _whole_array_maps(layout, splits["train"], backbone, 4)

    calls = []
    real_loader = prepare_npair.load_images_at_size

    def failing_loader(paths, size):
        calls.append(len(paths))
        if len(calls) == 3:
            raise RuntimeError("interrupted")
        return real_loader(paths, size)

    monkeypatch.setattr(prepare_npair, "load_images_at_size", failing_loader)
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare_npair.backbone_maps(layout, splits, tmp_path / "cache", spec, backbone, **options)
    monkeypatch.setattr(prepare_npair, "load_images_at_size", real_loader)
    folder = next((tmp_path / "cache").glob("npair_maps_*/train_*"))
    assert sorted(p.name for p in folder.iterdir()) == ["shard_00000.npy", "shard_00001.npy"]   # 6 rows done

    loaded = []
    monkeypatch.setattr(prepare_npair, "load_images_at_size",
                        lambda paths, size: loaded.append(len(paths)) or real_loader(paths, size))
    resumed = prepare_npair.backbone_maps(layout, splits, tmp_path / "cache", spec, backbone, **options)
    assert loaded == [4, 4, 2, 4, 1]      # train resumed at row 4 (the batch holding row 6); test from row 0
    assert isinstance(resumed["train"], ShardedRows) and resumed["train"].dtype == np.float32
    np.testing.assert_array_equal(resumed["train"][:], whole)
    np.testing.assert_array_equal(resumed["test"][:], _whole_array_maps(layout, splits["test"], backbone, 4))
    fresh = prepare_npair.backbone_maps(layout, splits, tmp_path / "fresh", spec, backbone, **options)
    np.testing.assert_array_equal(fresh["train"][:], resumed["train"][:])
    # A finished cache is opened, not rebuilt; float16 storage is another cache.
    loaded.clear()
    prepare_npair.backbone_maps(layout, splits, tmp_path / "cache", spec, backbone, **options)
    assert loaded == []
    half = prepare_npair.backbone_maps(layout, splits, tmp_path / "cache",
                                       prepare_npair.NPairInputSpec(feature_dtype="float16"), backbone, **options)
    assert half["train"].dtype == np.float16 and half["train"].folder != resumed["train"].folder
    np.testing.assert_array_equal(half["train"][:], whole.astype(np.float16))


def test_training_images_are_cached_as_uint8_rows(tiny_data, tmp_path):
    layout, splits = tiny_data
    rows = prepare_npair.split_images(layout, splits["train"], 32, tmp_path, batch_size=5, shard_bytes=7 * 32 * 32 * 3)
    paths = layout.image_paths(splits["train"].image_ids, source=splits["train"].source)
    assert rows.dtype == np.uint8 and rows.shape == (14, 32, 32, 3)
    np.testing.assert_array_equal(rows[:], load_images_at_size(paths, 32))


class _RowsOnly:
    """An array that can only be read by rows: materialising it whole fails."""

    def __init__(self, array):
        self._array, self.shape, self.dtype, self.rows_read = array, array.shape, array.dtype, 0

    def __len__(self):
        return len(self._array)

    def __getitem__(self, index):
        rows = self._array[index]
        self.rows_read += len(np.atleast_1d(index))
        return rows

    def __array__(self, *args, **kwargs):
        raise AssertionError("the whole array was materialised")


def _old_batches(image_inputs, token_ids, token_mask, caption_image, trainable, batch_size, seed, steps,
                 token_dtype=np.int32):
    """The batches the whole-array version fed the model (constants of the drawable rows)."""
    images, rows, local = npair_batches.trainable_pairs(caption_image, trainable)
    order, starts, counts = (tf.constant(a) for a in fragment_batches.sentences_by_image(local, len(images)))
    images_t = tf.constant(np.asarray(image_inputs)[images])
    ids_t = tf.constant(np.asarray(token_ids)[rows].astype(token_dtype))
    mask_t = tf.constant(np.asarray(token_mask, bool)[rows])
    out = []
    for step in range(steps):
        chosen_images, chosen = fragment_batches.draw_distinct_images(order, starts, counts, len(images),
                                                                      batch_size, tf.constant(step, tf.int64), seed)
        out.append((tf.cast(tf.gather(images_t, chosen_images), tf.float32).numpy(),
                    tf.gather(ids_t, chosen).numpy(), tf.gather(mask_t, chosen).numpy()))
    return out


@pytest.mark.parametrize("kind", ["maps", "float16_maps", "uint8_images", "word_inputs"])
def test_batches_are_gathered_by_index_and_equal_the_whole_array_batches(kind, tmp_path):
    rng = np.random.default_rng(0)
    num_images, per_image = 30, 3
    caption_image = rng.permutation(np.repeat(np.arange(num_images), per_image))
    n = len(caption_image)
    trainable = rng.uniform(size=n) < 0.8
    mask = rng.uniform(size=(n, 5)) < 0.7
    if kind == "uint8_images":
        images = rng.integers(0, 256, (num_images, 4, 4, 3), dtype=np.uint8)
    else:
        images = rng.normal(size=(num_images, 2, 2, 3)).astype(np.float16 if kind == "float16_maps" else np.float32)
    on_disk = np.load(write_rows(tmp_path / "images.npy", images), mmap_mode="r")
    if kind == "word_inputs":
        tokens, key, dtype = rng.normal(size=(n, 5, 3)).astype(np.float32), "word_inputs", np.float32
    else:
        tokens, key, dtype = rng.integers(0, 50, (n, 5)).astype(np.int32), "token_ids", np.int32
    guarded = _RowsOnly(on_disk)
    image_key = "image" if kind == "uint8_images" else "backbone_map"
    ds = npair_batches.train_dataset(guarded, _RowsOnly(tokens), _RowsOnly(mask), caption_image, trainable,
                                     batch_size=8, seed=5, image_key=image_key, token_key=key)
    old = _old_batches(images, tokens, mask, caption_image, trainable, 8, 5, 4, dtype)
    for batch, (pixels, ids, token_mask) in zip(ds.take(4), old):
        assert batch[image_key].dtype == tf.float32 and batch[key].dtype == tf.as_dtype(dtype)
        np.testing.assert_array_equal(batch[image_key].numpy(), pixels)
        np.testing.assert_array_equal(batch[key].numpy(), ids)
        np.testing.assert_array_equal(batch["token_mask"].numpy(), token_mask)
    assert guarded.rows_read % 8 == 0 and guarded.rows_read <= 8 * 8    # batch by batch (a few prefetched)


def _model(normalisation):
    config = NPairLocalizationConfig(vocabulary_size=12, map_channels=5, map_size=3, word_dim=6, embed_dim=8,
                                     max_tokens=6, normalisation=normalisation)
    return build_npair_model(config, np.random.default_rng(1).normal(size=(12, 6)))


@pytest.mark.parametrize("normalisation", ["vector", "map"])
def test_evaluation_inputs_written_in_chunks_equal_the_whole_array_route(normalisation, tmp_path):
    model = _model(normalisation)
    rng = np.random.default_rng(2)
    backbone = rng.normal(size=(11, 3, 3, 5)).astype(np.float32)
    token_ids = rng.integers(4, 12, (13, 6)).astype(np.int32)
    mask = rng.uniform(size=(13, 6)) < 0.6
    mask[:, 1] = True
    stored = np.load(write_rows(tmp_path / "backbone.npy", backbone), mmap_mode="r")
    maps = localization_maps.evaluation_maps(model, stored, tmp_path / "eval", chunk=4)
    tokens = localization_maps.token_vector_rows(model, token_ids, mask, tmp_path / "eval" / "tokens.npy", chunk=5)
    assert isinstance(maps.normalised, np.memmap) and isinstance(tokens, np.memmap)
    # Before: the chunks concatenated, then maps and tokens normalised whole. The projected maps are
    # the same bits; TF's vectorised kernels round a value's normalisation by where it falls in the
    # tensor, so normalised rows may differ in the last bit (the whole-array values themselves changed
    # with the split's size).
    projected = localization_maps.projected_maps(model, backbone, chunk=4)
    vectors = np.concatenate([np.asarray(model.token_vectors(token_ids[i:i + 5])) for i in range(0, 13, 5)])
    whole_maps, whole_tokens = (np.asarray(x) for x in model.normalised(projected, vectors, mask))
    np.testing.assert_array_equal(maps.projected, projected)
    np.testing.assert_allclose(maps.normalised, whole_maps, rtol=5e-7, atol=1e-7)
    np.testing.assert_allclose(tokens, whole_tokens, rtol=5e-7, atol=1e-7)
    # A row's value depends on its chunk alone, not on the split's size.
    first = localization_maps.evaluation_maps(model, stored[:8], tmp_path / "first", chunk=4)
    np.testing.assert_array_equal(first.normalised, maps.normalised[:8])


def test_pointing_reads_maps_by_id_from_row_arrays(tmp_path):
    from tf_twobranch.evaluation.pointing_game import PointingQuery
    vocabulary = ["<pad>", "<unk>", "<start>", "<end>", "a", "red", "seven", "two", "left", "blue", "x", "y"]
    model = _model("vector")
    rng = np.random.default_rng(3)
    projected = np.load(write_rows(tmp_path / "p.npy", rng.normal(size=(3, 3, 3, 8)).astype(np.float32)),
                        mmap_mode="r")
    ids = ["a1", "b2", "c3"]
    queries = [PointingQuery(image_id=i, sentence_index=0, phrase_index=0, caption_words=["a", "red", "seven"],
                             word_span=(1, 3), phrase="red seven", boxes=np.array([[0, 0, 5, 5]], np.float32),
                             image_width=12, image_height=9) for i in ("c3", "a1")]
    lazy = localization_maps.RowsById(ids, projected)
    assert len(lazy) == 3 and list(lazy) == ids
    for mode in localization_maps.PARSE_MODES:
        got = localization_maps.query_heat_maps(model, lazy, queries, vocabulary, mode=mode, max_words=4)
        want = localization_maps.query_heat_maps(model, dict(zip(ids, np.asarray(projected))), queries,
                                                 vocabulary, mode=mode, max_words=4)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    channel_mean = localization_maps.channel_mean_heat_maps(lazy, queries)
    np.testing.assert_array_equal(channel_mean[0], np.asarray(projected[2], np.float64).mean(axis=-1))


def _old_phrase_inputs(entities_root, image_ids, vocabulary, word_matrix, max_words):
    """The whole (N, T, word_dim) array the phrase parse was built as before."""
    from tf_twobranch.data.formats.flickr30k_entities import read_entities_dataset
    index = {w: i for i, w in enumerate(vocabulary) if i >= 4}
    start, end = word_matrix[vocabulary.index("<start>")], word_matrix[vocabulary.index("<end>")]
    rows = []
    for image in read_entities_dataset(entities_root, list(image_ids)):
        for sentence in image.sentences:
            starts = {p.first_word_index: p.num_words for p in sentence.phrases}
            words = [w.lower() for w in sentence.words]
            items, i = [], 0
            while i < len(words):
                span = starts.get(i, 1)
                known = [index[w] for w in words[i:i + span] if w in index]
                if known:
                    items.append(word_matrix[known].mean(axis=0))
                i += span
            rows.append(items)
    inputs = np.repeat(np.repeat(end[None, None, :], max_words + 2, axis=1), len(rows), axis=0).astype(np.float32)
    inputs[:, 0] = start
    mask = np.zeros((len(rows), max_words + 2), bool)
    trainable = np.array([0 < len(items) <= max_words for items in rows])
    for r, items in enumerate(rows):
        items = items[:max_words]
        if items:
            inputs[r, 1:1 + len(items)] = np.stack(items)
            mask[r, 1:1 + len(items)] = True
    return inputs, mask, trainable


def test_phrase_parsed_inputs_are_built_per_row_with_the_whole_arrays_bits(tiny_data):
    layout, splits = tiny_data
    ids = splits["train"].image_ids
    vocabulary = ["<pad>", "<unk>", "<start>", "<end>"] + sorted(
        {w.lower() for c in splits["train"].captions for w in c.split()})
    word_matrix = np.random.default_rng(4).normal(size=(len(vocabulary), 7)).astype(np.float32)
    for max_words in (3, 20):                       # 3: long captions clipped, left out of training
        parsed = prepare_npair.phrase_parsed_captions(layout.entities_dir, ids, vocabulary, word_matrix, max_words)
        inputs, mask, trainable = _old_phrase_inputs(layout.entities_dir, ids, vocabulary, word_matrix, max_words)
        assert parsed.word_inputs.shape == inputs.shape and len(parsed.caption_image) == len(inputs)
        np.testing.assert_array_equal(parsed.token_mask, mask)
        picked = np.array([5, 0, len(inputs) - 1, 5])
        np.testing.assert_array_equal(parsed.word_inputs[picked], inputs[picked])
        np.testing.assert_array_equal(np.asarray(parsed.word_inputs), inputs)
        np.testing.assert_array_equal(parsed.trainable, trainable)
        assert trainable.all() == (max_words == 20)


def test_precomputed_backbone_maps_are_memory_mapped_and_checked(tmp_path):
    from tf_twobranch.errors import DataFormatError
    from tf_twobranch.systems.npair.features import load_backbone_maps

    maps = np.random.default_rng(0).random((6, 3, 3, 4)).astype(np.float16)
    np.save(tmp_path / "m.npy", maps)
    loaded = load_backbone_maps(tmp_path / "m.npy", expected_images=6)
    assert isinstance(loaded, np.memmap) and loaded.dtype == np.float16
    with pytest.raises(DataFormatError, match=r"m\.npy.*6 images of backbone maps, expected 7"):
        load_backbone_maps(tmp_path / "m.npy", expected_images=7)
    np.save(tmp_path / "flat.npy", maps.reshape(6, -1))
    with pytest.raises(DataFormatError, match=r"flat\.npy.*\(images, h, w, channels\)"):
        load_backbone_maps(tmp_path / "flat.npy")
    maps = maps.astype(np.float32)
    maps[4, 1, 1, 2] = np.nan
    np.save(tmp_path / "nan.npy", maps)
    with pytest.raises(DataFormatError, match=r"nan\.npy.*the first is row 4"):
        load_backbone_maps(tmp_path / "nan.npy")
    np.save(tmp_path / "f64.npy", maps.astype(np.float64))
    with pytest.raises(DataFormatError, match="float64"):
        load_backbone_maps(tmp_path / "f64.npy")


def test_split_paths_flag_names_the_flag():
    from experiments import common

    assert common.split_paths("backbone_maps", ["train=a.npy", "test=b"]) == {"train": "a.npy", "test": "b"}
    with pytest.raises(common.UserInputError, match="--backbone_maps takes split=path"):
        common.split_paths("backbone_maps", ["a.npy"])


def test_precomputed_maps_need_no_backbone_weights(tiny_data, tmp_path):
    # Issue 39: --backbone_maps with --image_backbone=vgg19 asked for --backbone_weights,
    # though with maps given no backbone runs.
    from tf_twobranch.errors import UserInputError
    from tf_twobranch.systems.npair import pipeline

    layout, splits = tiny_data
    files = {}
    for split, corpus in splits.items():
        files[split] = tmp_path / f"{split}_maps.npy"
        np.save(files[split], np.ones((corpus.num_images, 2, 2, 4), np.float32))
    recipe = pipeline.NPairRecipe(dataset_dir=str(layout.root), image_backbone="vgg19", export=False,
                                  backbone_maps=tuple(f"{s}={f}" for s, f in files.items()),
                                  features_cache=str(tmp_path / "cache"), word_dim=8)
    data = pipeline.load_data(recipe)
    assert data.backbone is None and data.maps["train"].shape == (splits["train"].num_images, 2, 2, 4)
    with pytest.raises(UserInputError, match="needs --backbone_weights"):
        pipeline.input_spec(pipeline.NPairRecipe(image_backbone="vgg19"))
