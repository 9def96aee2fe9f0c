"""Tests for tf_twobranch.features.word_vectors."""
import gzip

import numpy as np
import pytest

from tf_twobranch.errors import DataFormatError
from tf_twobranch.data.formats.word_vectors import WordVectors, load_word_vectors, save_word_vectors
from tf_twobranch.features.word_vectors import train_word_vectors


@pytest.fixture
def small_vectors():
    rng = np.random.default_rng(0)
    return WordVectors(["the", "dog", "café", "runs", "x"], rng.normal(size=(5, 4)).astype(np.float32))


def _write_glove(path, wv):
    with open(path, "w", encoding="utf-8") as out:
        for word, vector in zip(wv.words, wv.vectors):
            out.write(word + " " + " ".join(repr(float(v)) for v in vector) + "\n")


@pytest.mark.parametrize("binary", [True, False])
def test_word2vec_round_trip(tmp_path, small_vectors, binary):
    path = tmp_path / "vectors.bin"
    save_word_vectors(path, small_vectors, binary=binary)
    loaded = load_word_vectors(path)
    assert loaded.words == small_vectors.words
    np.testing.assert_array_equal(loaded.vectors, small_vectors.vectors)
    assert loaded.vectors.dtype == np.float32


def test_glove_round_trip(tmp_path, small_vectors):
    path = tmp_path / "glove.bin"  # misleading extension: detection uses the content
    _write_glove(path, small_vectors)
    loaded = load_word_vectors(path)
    assert loaded.words == small_vectors.words
    np.testing.assert_allclose(loaded.vectors, small_vectors.vectors, rtol=1e-6)


def test_format_detection_ignores_extension(tmp_path, small_vectors):
    binary_named_txt = tmp_path / "vectors.txt"
    save_word_vectors(binary_named_txt, small_vectors, binary=True)
    text_named_bin = tmp_path / "vectors.bin"
    save_word_vectors(text_named_bin, small_vectors, binary=False)
    for path in (binary_named_txt, text_named_bin):
        np.testing.assert_allclose(load_word_vectors(path).vectors, small_vectors.vectors, rtol=1e-6)


def test_gzip_and_restriction(tmp_path, small_vectors):
    plain = tmp_path / "v.bin"
    save_word_vectors(plain, small_vectors, binary=True)
    packed = tmp_path / "v.bin.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    restricted = load_word_vectors(packed, vocabulary={"dog", "runs", "unknown"})
    assert restricted.words == ["dog", "runs"]
    np.testing.assert_array_equal(restricted["runs"], small_vectors["runs"])
    assert load_word_vectors(plain, max_words=2).words == ["the", "dog"]


def test_lookup_drops_unknown(small_vectors):
    out = small_vectors.lookup(["dog", "zebra", "the"])
    assert out.shape == (2, 4)
    np.testing.assert_array_equal(out[0], small_vectors["dog"])
    assert "dog" in small_vectors and "zebra" not in small_vectors
    assert small_vectors.lookup(["zebra"]).shape == (0, 4)


def test_truncated_binary_file(tmp_path, small_vectors):
    path = tmp_path / "v.bin"
    save_word_vectors(path, small_vectors, binary=True)
    data = path.read_bytes()
    path.write_bytes(data[:-9])
    with pytest.raises(DataFormatError, match=r"v\.bin.*record 4.*truncated"):
        load_word_vectors(path)
    # Fewer records than the header announces.
    path.write_bytes(data.replace(b"5 4\n", b"7 4\n", 1))
    with pytest.raises(DataFormatError, match="record 5"):
        load_word_vectors(path)


def test_unknown_format(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("this is not a vector file\nat all\n")
    with pytest.raises(DataFormatError, match=r"notes\.txt, line 1: unknown word-vector format"):
        load_word_vectors(path)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataFormatError, match="empty"):
        load_word_vectors(empty)
    with pytest.raises(DataFormatError, match="not found"):
        load_word_vectors(tmp_path / "missing.bin")


def test_inconsistent_dimension(tmp_path):
    w2v = tmp_path / "w2v.txt"
    w2v.write_text("2 3\na 1 2 3\nb 1 2\n")
    with pytest.raises(DataFormatError, match="line 3: expected a word followed by 3 numbers"):
        load_word_vectors(w2v)
    glove = tmp_path / "glove.txt"
    glove.write_text("a 1 2 3\nb 1 2 3\nc 4 5\n")
    with pytest.raises(DataFormatError, match="line 3"):
        load_word_vectors(glove)
    bad_value = tmp_path / "bad.txt"
    bad_value.write_text("a 1 2 3\nb 1 oops 3\n")
    with pytest.raises(DataFormatError, match="line 2: non-numeric"):
        load_word_vectors(bad_value)


def test_train_word_vectors_cooccurrence():
    rng = np.random.default_rng(0)
    animals = ["dog", "cat", "barks", "meows", "pet", "fur"]
    vehicles = ["car", "truck", "road", "drives", "wheel", "engine"]
    sentences = []
    for _ in range(300):
        topic = animals if rng.random() < 0.5 else vehicles
        sentences.append(["the"] + list(rng.choice(topic, size=4)) + ["a"])
    wv = train_word_vectors(sentences, dim=8, window=3, seed=0)
    assert wv.dim == 8 and "dog" in wv

    def cos(a, b):
        u, v = wv[a], wv[b]
        return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))

    assert cos("dog", "cat") > cos("dog", "road") + 0.3
    assert cos("car", "engine") > cos("car", "fur") + 0.3
    # Deterministic given the seed.
    np.testing.assert_array_equal(train_word_vectors(sentences, dim=8, window=3, seed=0).vectors, wv.vectors)
