"""Tests of the dual-path CNN's sentence codes (tf_twobranch.data.text_codes)."""
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.data.text_codes import (TokenCoder, build_text_vocabulary, check_caption_lengths,
                                          encode_captions, initial_word_matrix)
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.data.formats.word_vectors import WordVectors, load_word_vectors

CAPTIONS = [
    "A man's RED hat, and a dog!",
    "Two dogs &amp; a cat play in the snow.",
    "The boys' ball -- rock''n roll; café",
    "zebra QUUX xyzzy",
]


def _vectors(words, dim=4):
    rng = np.random.default_rng(0)
    return WordVectors(words, rng.normal(size=(len(words), dim)).astype(np.float32))


def test_vocabulary_keeps_training_words_with_vectors():
    tokens = [tokenize_caption(c) for c in CAPTIONS]
    plain = build_text_vocabulary(tokens)
    assert plain[:2] == ["<pad>", "<unk>"]
    assert "a" == plain[2]  # most frequent word first
    assert {"quux", "xyzzy", "café"} <= set(plain)
    vectors = _vectors(["a", "dog", "dogs", "snow", "cat", "zebra", "never_in_captions"])
    vocab = build_text_vocabulary(tokens, vectors)
    assert vocab == ["<pad>", "<unk>", "a", "cat", "dog", "dogs", "snow", "zebra"]
    assert build_text_vocabulary(tokens, min_count=2)[2:] == ["a", "the"]
    with pytest.raises(ConfigError):
        build_text_vocabulary(tokens, min_count=0)


def test_initial_word_matrix_rows():
    vectors = _vectors(["a", "dog", "cat"], dim=5)
    vocab = ["<pad>", "<unk>", "dog", "zebra", "a"]
    matrix = initial_word_matrix(vocab, vectors, seed=3)
    assert matrix.shape == (5, 5) and matrix.dtype == np.float32
    np.testing.assert_array_equal(matrix[0], 0)
    np.testing.assert_array_equal(matrix[2], vectors["dog"])
    np.testing.assert_array_equal(matrix[4], vectors["a"])
    assert np.all(matrix[1] != 0) and np.all(matrix[3] != 0)  # random rows
    np.testing.assert_array_equal(matrix, initial_word_matrix(vocab, vectors, seed=3))
    assert not np.array_equal(matrix[3], initial_word_matrix(vocab, vectors, seed=4)[3])
    random_init = initial_word_matrix(vocab, None, dim=7, seed=0)
    assert random_init.shape == (5, 7) and np.all(random_init[0] == 0)
    assert initial_word_matrix(vocab).shape == (5, 300)
    with pytest.raises(ConfigError, match="dimension"):
        initial_word_matrix(vocab, vectors, dim=300)
    with pytest.raises(ConfigError, match="<pad>"):
        initial_word_matrix(["dog"], vectors)


def test_encode_captions_removes_unknown_words():
    vocab = ["<pad>", "<unk>", "a", "dog", "man's", "red", "snow", "café", "boys", "rock", "n"]
    codes = encode_captions(CAPTIONS, vocab)
    assert codes[0].tolist() == [2, 4, 5, 2, 3]  # a man's red [hat] [and] a dog
    assert codes[1].tolist() == [2, 6]           # [two dogs] [&] a [cat ...] snow
    assert codes[2].tolist() == [8, 9, 10, 7]
    assert codes[3].tolist() == []
    assert all(c.dtype == np.int32 and 1 not in c for c in codes)


def test_token_coder_matches_python_and_serializes():
    tokens = [tokenize_caption(c) for c in CAPTIONS]
    vocab = build_text_vocabulary(tokens[:3])  # the last caption's words are unknown
    coder = TokenCoder(vocab)
    ids = coder(tf.constant(CAPTIONS))
    assert isinstance(ids, tf.RaggedTensor) and ids.dtype == tf.int32
    expected = encode_captions(CAPTIONS, vocab)
    assert ids.to_list() == [e.tolist() for e in expected]
    assert ids[3].shape[0] == 0
    clipped = TokenCoder(vocab, max_len=3)(tf.constant(CAPTIONS))
    assert [r for r in clipped.to_list()] == [e[:3].tolist() for e in expected]
    restored = TokenCoder.from_config(coder.get_config())
    assert restored(tf.constant(CAPTIONS)).to_list() == ids.to_list()
    # In a tf.data pipeline (graph mode) too.
    ds = tf.data.Dataset.from_tensor_slices(CAPTIONS).batch(4).map(coder)
    assert next(iter(ds)).to_list() == ids.to_list()
    with pytest.raises(ConfigError):
        TokenCoder(["dog", "cat"])


def test_long_caption_policy_names_file_and_record():
    codes = [np.arange(2, 7), np.arange(2, 12), np.arange(2, 4)]
    records = ["image 1000092795, caption 0", "image 1000092795, caption 1", "image 7, caption 0"]
    with pytest.raises(DataFormatError) as info:
        check_caption_lengths(codes, 8, "error", source="results_20130124.token", records=records)
    message = str(info.value)
    assert "results_20130124.token" in message and "image 1000092795, caption 1" in message
    assert "10" in message and "max_len=8" in message and "clip" in message
    clipped = check_caption_lengths(codes, 8, "clip", source="f", records=records)
    assert [len(c) for c in clipped] == [5, 8, 2]
    np.testing.assert_array_equal(clipped[1], np.arange(2, 10))  # the final words are cut
    with pytest.raises(ConfigError):
        check_caption_lengths(codes, 8, "truncate")


def test_empty_code_is_an_error_for_training():
    codes = [np.array([3, 4]), np.array([], np.int32)]
    with pytest.raises(DataFormatError, match="no word left"):
        check_caption_lengths(codes, 8, source="captions.json", records=["a", "image 9, caption 4"])
    assert len(check_caption_lengths(codes, 8, allow_empty=True)[1]) == 0


def test_unknown_word_vector_format_is_a_clear_error(tmp_path):
    path = tmp_path / "vectors.bin"
    path.write_bytes(b"\x00\x01garbage that is neither word2vec nor GloVe\n")
    with pytest.raises(DataFormatError, match="unknown word-vector format") as info:
        load_word_vectors(path)
    assert str(path) in str(info.value)
    with pytest.raises(DataFormatError, match="not found"):
        load_word_vectors(tmp_path / "missing.bin")


def test_vocabulary_from_a_word_vector_file(tmp_path):
    from tf_twobranch.data.formats.word_vectors import save_word_vectors

    vectors = _vectors(["a", "dog", "snow"], dim=3)
    path = tmp_path / "w2v.bin"
    save_word_vectors(path, vectors)
    tokens = [tokenize_caption(c) for c in CAPTIONS]
    loaded = load_word_vectors(path, vocabulary={t for ts in tokens for t in ts})
    vocab = build_text_vocabulary(tokens, loaded)
    assert vocab == ["<pad>", "<unk>", "a", "dog", "snow"]
    np.testing.assert_allclose(initial_word_matrix(vocab, loaded)[3], vectors["dog"])
