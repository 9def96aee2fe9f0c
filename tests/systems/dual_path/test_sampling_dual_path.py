"""Tests of the dual-path CNN data (tf_twobranch.systems.dual_path.data) and input pipeline
(tf_twobranch.systems.dual_path.sampling)."""
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tf_twobranch.systems.dual_path import data as dpd
from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats import write_cuhk_pedes, write_split_file, write_token_file
from tf_twobranch.data.formats.cuhk_pedes import PedesSplit
from tf_twobranch.distribute import split_global_batch
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.systems.dual_path import sampling as dp

WORDS = "red blue green dog cat bird runs sits on a the grass".split()
RESIZE, CROP = 24, 20


def _make_dataset(root, num_images=10, captions_per_image=3, seed=0, long_caption=False):
    """A tiny Flickr30K-layout dataset: images/<id>.jpg, a token file, split lists."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    pairs = []
    ids = [str(1000 + i) for i in range(num_images)]
    for i, image_id in enumerate(ids):
        h, w = (30, 40) if i % 2 else (44, 26)
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
            root / "images" / f"{image_id}.jpg")
        for k in range(captions_per_image):
            n = int(rng.integers(2, 7))
            words = [WORDS[j] for j in rng.integers(0, len(WORDS), n)]
            if long_caption and i == 3 and k == 1:
                words = WORDS * 3
            pairs.append((image_id, " ".join(words).capitalize() + " ."))
    corpus = CaptionCorpus.from_pairs(pairs)
    write_token_file(root / "results_20130124.token", corpus)
    write_split_file(root / "train.txt", ids[: num_images - 4])
    write_split_file(root / "val.txt", ids[num_images - 4: num_images - 2])
    write_split_file(root / "test.txt", ids[num_images - 2:])
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _make_dataset(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_data(tiny):
    return dpd.dual_path_data_from_retrieval(resolve_dataset(tiny), split="train", max_len=12)


# ------------------------------------------------------------------ text placement

def test_position_shift_draws_every_offset_and_never_truncates():
    codes = tf.ragged.constant([[5, 6, 7], [9] * 8, [3], []], dtype=tf.int32)
    max_len = 8
    seen = [set() for _ in range(4)]
    for s in range(300):
        placed = dp.position_shift(codes, max_len, seed=tf.constant([s, 7])).numpy()
        assert placed.shape == (4, max_len) and placed.dtype == np.int32
        for row, code in enumerate(codes.to_list()):
            nonzero = np.flatnonzero(placed[row])
            assert placed[row][placed[row] != 0].tolist() == code  # nothing lost, order kept
            if code:
                assert nonzero[-1] - nonzero[0] == len(code) - 1  # contiguous
                seen[row].add(int(nonzero[0]))
    assert seen[0] == set(range(6))   # offsets 0..max_len-len
    assert seen[1] == {0}
    assert seen[2] == set(range(8))
    np.testing.assert_array_equal(dp.position_shift(codes, max_len, 4), dp.position_shift(codes, max_len, 4))
    dense = tf.constant([[5, 6, 0, 0], [7, 0, 0, 0]])
    placed = dp.position_shift(dense, 6, 1).numpy()
    assert sorted(placed[0][placed[0] > 0]) == [5, 6] and placed[1].sum() == 7
    with pytest.raises(tf.errors.InvalidArgumentError, match="longer than max_len"):
        dp.position_shift(tf.ragged.constant([[1] * 9]), 8, 0)


def test_left_align_and_all_shifts():
    codes = tf.ragged.constant([[5, 6, 7], [4]], dtype=tf.int32)
    np.testing.assert_array_equal(dp.left_align(codes, 5), [[5, 6, 7, 0, 0], [4, 0, 0, 0, 0]])
    shifts = dp.all_shifts(tf.constant([5, 6, 7]), 6).numpy()
    assert shifts.shape == (4, 6)  # max_len - len + 1
    for k, row in enumerate(shifts):
        expected = np.zeros(6, np.int32)
        expected[k:k + 3] = [5, 6, 7]
        np.testing.assert_array_equal(row, expected)
    assert dp.all_shifts(tf.constant([1] * 6), 6).shape == (1, 6)
    with pytest.raises(tf.errors.InvalidArgumentError):
        dp.all_shifts(tf.constant([1] * 7), 6)


# ------------------------------------------------------------------------ images

def _jpeg(h=30, w=40, seed=0):
    image = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    return tf.io.encode_jpeg(image).numpy()


def test_image_pipeline_shapes_flip_and_determinism():
    jpeg = _jpeg()
    a = dp.train_image(jpeg, resize_to=RESIZE, crop_size=CROP, seed=[1, 2])
    b = dp.train_image(jpeg, resize_to=RESIZE, crop_size=CROP, seed=[1, 2])
    assert a.shape == (CROP, CROP, 3) and a.dtype == tf.float32
    np.testing.assert_array_equal(a, b)
    assert 0 <= float(tf.reduce_min(a)) and float(tf.reduce_max(a)) <= 255
    variants = {dp.train_image(jpeg, resize_to=RESIZE, crop_size=CROP, seed=[s, 0]).numpy().tobytes()
                for s in range(12)}
    assert len(variants) > 2  # crops and flips vary with the seed
    full = dp.test_image(jpeg, RESIZE, CROP)
    centre = dp.test_image(jpeg, RESIZE, CROP, mode="center_crop")
    assert full.shape == centre.shape == (CROP, CROP, 3)
    np.testing.assert_array_equal(dp.flip(full), full.numpy()[:, ::-1])
    np.testing.assert_array_equal(dp.flip(full[None])[0], full.numpy()[:, ::-1])
    with pytest.raises(ConfigError):
        dp.test_image(jpeg, 10, 20)
    with pytest.raises(ConfigError):
        dp.test_image(jpeg, 24, 20, mode="ten_crop")


# ---------------------------------------------------------------------- datasets

def test_retrieval_data_one_class_per_training_image(tiny, tiny_data):
    data = tiny_data
    assert data.num_images == 6 and data.num_classes == 6 and data.num_captions == 18
    np.testing.assert_array_equal(data.image_class, np.arange(6))
    assert data.vocabulary[:2] == ["<pad>", "<unk>"] and set(data.vocabulary[2:]) <= set(WORDS)
    assert all(p.endswith(f"{i}.jpg") for p, i in zip(data.image_paths, data.image_ids))
    test = dpd.dual_path_data_from_retrieval(resolve_dataset(tiny), split="test", max_len=12)
    assert test.num_images == 2 and test.vocabulary == data.vocabulary
    dpd.check_num_classes(data, 6)
    with pytest.raises(ConfigError, match="num_classes=29783.*6 classes"):
        dpd.check_num_classes(data, 29783)


def test_long_caption_error_names_file_and_record(tmp_path):
    root = _make_dataset(tmp_path / "d", long_caption=True)
    with pytest.raises(DataFormatError) as info:
        dpd.dual_path_data_from_retrieval(resolve_dataset(root), max_len=12)
    message = str(info.value)
    assert "results_20130124.token" in message and "image 1003, caption 1" in message
    assert "36" in message and "max_len=12" in message and "long_captions='clip'" in message
    data = dpd.dual_path_data_from_retrieval(resolve_dataset(root), max_len=12, long_captions="clip")
    assert max(len(c) for c in data.codes) == 12


def test_missing_and_corrupt_images(tmp_path):
    root = _make_dataset(tmp_path / "missing")
    (root / "images" / "1002.jpg").unlink()
    with pytest.raises(DataFormatError, match="image 1002.*not found") as info:
        dpd.dual_path_data_from_retrieval(resolve_dataset(root))
    assert "results_20130124.token" in str(info.value)

    root = _make_dataset(tmp_path / "corrupt")
    (root / "images" / "1001.jpg").write_bytes(b"this is not a jpeg")
    with pytest.raises(DataFormatError, match="1001.jpg") as info:
        dpd.dual_path_data_from_retrieval(resolve_dataset(root), validate="header")
    assert "1001" in str(info.value)

    root = _make_dataset(tmp_path / "truncated")
    path = root / "images" / "1004.jpg"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # valid header, truncated data
    dpd.dual_path_data_from_retrieval(resolve_dataset(root), validate="header")  # header looks fine
    with pytest.raises(DataFormatError, match="1004.jpg.*cannot decode"):
        dpd.dual_path_data_from_retrieval(resolve_dataset(root), validate="full")
    with pytest.raises(DataFormatError, match="cannot decode"):
        dpd.dual_path_data_from_retrieval(resolve_dataset(root))  # small: auto decodes everything
    with pytest.raises(ConfigError):
        dpd.dual_path_data_from_retrieval(resolve_dataset(root), validate="sometimes")


def test_empty_training_caption_is_an_error(tmp_path):
    root = _make_dataset(tmp_path / "d")
    with pytest.raises(DataFormatError, match="no word left"):
        dpd.dual_path_data_from_retrieval(resolve_dataset(root), vocabulary=["<pad>", "<unk>", "zebra"])


def test_train_dataset_batches(tiny_data):
    train = dp.train_dataset(tiny_data, batch_size=4, resize_to=RESIZE, crop_size=CROP, seed=5,
                             num_negative_captions=6)
    assert train.steps_per_epoch == 1
    batches = list(train.dataset.take(3).as_numpy_iterator())
    batch = batches[0]
    assert batch["image"].shape == (4, CROP, CROP, 3) and batch["image"].dtype == np.float32
    assert batch["token_ids"].shape == (4, 12) and batch["token_ids"].dtype == np.int32
    assert batch["label"].shape == (4,) and batch["label"].dtype == np.int32
    assert batch["negative_token_ids"].shape == (6, 12)
    assert len(set(batch["label"].tolist())) == 4  # an epoch permutes the images
    for b in batches:
        # Every caption placed is one of its image's captions.
        for label, row in zip(b["label"], b["token_ids"]):
            own = {tuple(tiny_data.codes[i]) for i in np.flatnonzero(tiny_data.caption_image == label)}
            assert tuple(row[row > 0]) in own
        assert not set(b["negative_label"].tolist()) & set(b["label"].tolist())
    again = list(dp.train_dataset(tiny_data, batch_size=4, resize_to=RESIZE, crop_size=CROP, seed=5,
                                  num_negative_captions=6).dataset.take(3).as_numpy_iterator())
    for x, y in zip(batches, again):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    resumed = next(iter(dp.train_dataset(tiny_data, batch_size=4, resize_to=RESIZE, crop_size=CROP,
                                         seed=5, num_negative_captions=6, start_step=2).dataset))
    for key in batch:
        np.testing.assert_array_equal(resumed[key], batches[2][key])
    other = next(iter(dp.train_dataset(tiny_data, batch_size=4, resize_to=RESIZE, crop_size=CROP,
                                       seed=6).dataset))
    assert not np.array_equal(other["image"], batch["image"])
    assert "negative_token_ids" not in other
    with pytest.raises(ConfigError):
        dp.train_dataset(tiny_data, batch_size=7)
    with pytest.raises(ConfigError):
        dp.train_dataset(tiny_data, text_shift="random")


def test_row_augmentation_is_independent_of_the_replica_split(tiny_data):
    indices = dp.global_batch_indices(tiny_data, batch_size=4, seed=1, num_negative_captions=2)
    load = dp.batch_loader(tiny_data, resize_to=RESIZE, crop_size=CROP, seed=1)
    global_batch = indices(tf.constant(3, tf.int64))
    whole = load(global_batch)
    halves = [load(split_global_batch(global_batch, 2, r)) for r in range(2)]
    for key in ("image", "token_ids", "label"):
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), whole[key])
    np.testing.assert_array_equal(halves[1]["negative_token_ids"], whole["negative_token_ids"])


def test_training_shift_covers_every_offset(tiny_data):
    load = tf.function(dp.batch_loader(tiny_data, resize_to=RESIZE, crop_size=CROP, seed=0))
    caption = int(np.argmin([len(c) for c in tiny_data.codes]))
    length = len(tiny_data.codes[caption])
    image = int(tiny_data.caption_image[caption])
    offsets = set()
    for step in range(120):
        row = load({"step": tf.constant(step, tf.int64), "image_index": tf.constant([image], tf.int64),
                    "text_index": tf.constant([caption], tf.int64)})["token_ids"].numpy()[0]
        offsets.add(int(np.flatnonzero(row)[0]))
    assert offsets == set(range(12 - length + 1))
    aligned = dp.batch_loader(tiny_data, resize_to=RESIZE, crop_size=CROP, text_shift="left_align")
    row = aligned({"step": tf.constant(0, tf.int64), "image_index": tf.constant([image], tf.int64),
                   "text_index": tf.constant([caption], tf.int64)})["token_ids"].numpy()[0]
    np.testing.assert_array_equal(row[:length], tiny_data.codes[caption])


def test_test_datasets(tiny):
    data = dpd.dual_path_data_from_retrieval(resolve_dataset(tiny), split="val", max_len=12)
    test = dp.test_datasets(data, batch_size=3, resize_to=RESIZE, crop_size=CROP)
    # A whole evaluation pass is deleted like a training stream: no autotuning thread to wait for
    # (`distribute.without_autotuning`).
    assert test.images.options().autotune.enabled is False
    images = list(test.images.as_numpy_iterator())
    assert sum(len(b["image_index"]) for b in images) == data.num_images
    np.testing.assert_array_equal(images[0]["image_flipped"], images[0]["image"][:, :, ::-1])
    texts = list(test.texts.as_numpy_iterator())
    assert sum(len(b["token_ids"]) for b in texts) == data.num_captions
    shifted = dp.test_datasets(data, batch_size=5, resize_to=RESIZE, crop_size=CROP,
                               text_shift="all_shifts", flip_images=False)
    expected_rows = sum(12 - len(c) + 1 for c in data.codes)
    assert len(shifted.caption_of_row) == expected_rows
    rows = np.concatenate([b["token_ids"] for b in shifted.texts.as_numpy_iterator()])
    assert rows.shape == (expected_rows, 12)
    first = rows[shifted.caption_of_row == 0]
    np.testing.assert_array_equal(first, dp.all_shifts(data.codes[0], 12))
    assert "image_flipped" not in next(iter(shifted.images))


def _write_pedes(root):
    rng = np.random.default_rng(1)
    (root / "imgs" / "cam").mkdir(parents=True)
    splits = {}
    for split, identities in (("train", [11, 4, 11, 7, 4, 7]), ("test", [30, 30, 31])):
        pairs = []
        for i, identity in enumerate(identities):
            file_path = f"cam/{split}{i}.jpg"
            Image.fromarray(rng.integers(0, 255, (40, 20, 3), dtype=np.uint8)).save(root / "imgs" / file_path)
            pairs += [(file_path, f"A person {identity} in red {k} with a bag") for k in range(2)]
        splits[split] = PedesSplit(CaptionCorpus.from_pairs(pairs), identities)
    write_cuhk_pedes(root / "reid_raw.json", splits)
    return root / "reid_raw.json"


def test_pedes_data_one_class_per_identity(tmp_path):
    path = _write_pedes(tmp_path)
    data = dpd.dual_path_data_from_pedes(resolve_dataset(path.parent), split="train", max_len=56)
    assert data.num_classes == 3 and data.class_names == ["4", "7", "11"]
    np.testing.assert_array_equal(data.image_class, [2, 0, 2, 1, 0, 1])
    dpd.check_num_classes(data, 3)
    with pytest.raises(ConfigError, match="person identity"):
        dpd.check_num_classes(data, 6)
    # Captions are drawn from the identity (any image of the same person).
    batches = dp.train_dataset(data, batch_size=6, resize_to=RESIZE, crop_size=CROP, seed=0).dataset
    for batch in batches.take(3).as_numpy_iterator():
        for label, row in zip(batch["label"], batch["token_ids"]):
            own = {tuple(data.codes[i]) for i in np.flatnonzero(data.caption_class == label)}
            assert tuple(row[row > 0]) in own
    test = dpd.dual_path_data_from_pedes(resolve_dataset(path.parent), split="test")
    assert test.num_classes == 2 and test.vocabulary == data.vocabulary
    (tmp_path / "imgs" / "cam" / "train3.jpg").unlink()
    with pytest.raises(DataFormatError, match="reid_raw.json.*cam/train3.jpg"):
        dpd.dual_path_data_from_pedes(resolve_dataset(path.parent), split="train")


def test_real_flickr30k_slice(realdata, tmp_path):
    """The builder and pipeline on real Flickr30K captions and JPEGs (the 8 sample images)."""
    images_dir = realdata / "flickr30k" / "images"
    ids = sorted(p.stem for p in images_dir.glob("*.jpg"))
    write_split_file(tmp_path / "train.txt", ids[:6])
    write_split_file(tmp_path / "test.txt", ids[6:])
    data = dpd.dual_path_data_from_retrieval(
        resolve_dataset(tmp_path, captions_path=realdata / "flickr30k" / "captions_multi30k.token",
                        images_dir=images_dir), max_len=32, long_captions="clip")
    assert data.num_images == 6 and data.num_captions == 30
    assert all(len(c) > 0 for c in data.codes) and 1 not in np.concatenate(data.codes)
    batch = next(iter(dp.train_dataset(data, batch_size=3, resize_to=64, crop_size=56, seed=0,
                                       num_negative_captions=4).dataset))
    assert batch["image"].shape == (3, 56, 56, 3) and batch["token_ids"].shape == (3, 32)
    assert float(tf.reduce_max(batch["image"])) > 100  # real pixels, not blank


def test_real_vocabulary_with_word_vectors(realdata):
    from tf_twobranch.data.formats import read_token_file
    from tf_twobranch.data.text_codes import build_text_vocabulary
    from tf_twobranch.data.tokenize import tokenize_caption
    from tf_twobranch.data.formats.word_vectors import WordVectors

    corpus = read_token_file(realdata / "flickr30k" / "captions_multi30k.token")
    tokens = [tokenize_caption(c) for c in corpus.captions[:20000]]
    full = build_text_vocabulary(tokens)
    known = full[2:][::3]  # stand-in for word2vec's vocabulary
    vectors = WordVectors(known, np.zeros((len(known), 2), np.float32))
    restricted = build_text_vocabulary(tokens, vectors)
    assert len(full) > 4000
    assert set(restricted[2:]) == set(known)


def test_word_vector_file_restricts_the_dictionary(tiny, tmp_path):
    from tf_twobranch.data.formats.word_vectors import WordVectors, save_word_vectors

    known = ["red", "dog", "cat", "grass", "runs"]
    path = tmp_path / "vectors.txt"
    save_word_vectors(path, WordVectors(known, np.ones((5, 3), np.float32)), binary=False)
    data = dpd.dual_path_data_from_retrieval(resolve_dataset(tiny), word_vectors=path, max_len=12,
                                            validate="header")
    assert set(data.vocabulary[2:]) <= set(known)
    assert all(set(c.tolist()) <= set(range(2, len(data.vocabulary))) for c in data.codes)


def test_distributed_train_dataset_single_replica(tiny_data):
    strategy = tf.distribute.get_strategy()
    ds = dp.distributed_train_dataset(strategy, tiny_data, batch_size=4, resize_to=RESIZE,
                                      crop_size=CROP, seed=5)
    single = dp.train_dataset(tiny_data, batch_size=4, resize_to=RESIZE, crop_size=CROP, seed=5)
    a, b = next(iter(ds)), next(iter(single.dataset))
    for key in ("image", "token_ids", "label"):
        np.testing.assert_array_equal(a[key], b[key])
