"""The two-branch family's feature caches: fitted text encoders reused by fingerprint,
sentence features written block by block, row-major and memory-mapped."""
import logging

import numpy as np
import pytest

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats.word_vectors import WordVectors, save_word_vectors
from tf_twobranch.features import prepare
from tf_twobranch.features.text_features import FisherVectorEncoder, text_encoder_fingerprint

WORDS = ("a dog cat man woman runs sits jumps red blue green big small car road park ball tree "
         "house street water grass snow beach child girl boy bike horse bird").split()


def corpus(prefix, num_images, seed, captions_per_image=5):
    rng = np.random.default_rng(seed)
    captions = [" ".join(rng.choice(WORDS, size=rng.integers(3, 8)))
                for _ in range(num_images * captions_per_image)]
    return CaptionCorpus([f"{prefix}_{i}" for i in range(num_images)], captions,
                         np.repeat(np.arange(num_images), captions_per_image), f"{prefix}_caps.txt")


def spec(**kw):
    return prepare.FeatureSpec(text_encoder="fisher_hglmm", word_dim=4, fisher_components=2, pca_dim=6,
                               **kw)


@pytest.fixture
def fits(monkeypatch):
    """Counts the real fits of text encoders."""
    calls = []
    real = prepare.fit_text_encoder

    def counting(spec_, tokens):
        calls.append(len(tokens))
        return real(spec_, tokens)

    monkeypatch.setattr(prepare, "fit_text_encoder", counting)
    return calls


def test_second_run_reuses_the_fitted_encoder_and_a_changed_caption_refits(tmp_path, fits, caplog):
    train = corpus("train", 12, seed=0)
    first, _ = prepare.prepare_text_features({"train": train, "test": corpus("test", 4, seed=1)},
                                             tmp_path, spec())
    assert fits == [60]
    # Other test captions: new text features, same training captions: no refit.
    with caplog.at_level(logging.INFO):
        second, _ = prepare.prepare_text_features({"train": train, "test": corpus("test", 4, seed=2)},
                                                  tmp_path, spec())
    assert fits == [60]
    assert "reusing the fitted text encoder fisher_hglmm (fingerprint" in caplog.text
    np.testing.assert_array_equal(first["train"], second["train"])
    # One changed training caption: the fingerprint changes, the encoder is refitted.
    changed = corpus("train", 12, seed=0)
    changed.captions[7] = "a red ball in the snow"
    prepare.prepare_text_features({"train": changed, "test": corpus("test", 4, seed=2)}, tmp_path, spec())
    assert fits == [60, 60]
    # Other settings refit too.
    prepare.prepare_text_features({"train": train, "test": corpus("test", 4, seed=2)}, tmp_path,
                                  spec(seed=1))
    assert len(fits) == 3


def test_fingerprint_covers_captions_settings_and_the_word_vector_file(tmp_path):
    tokens = [["a", "dog"], ["a", "cat", "runs"]]
    base = text_encoder_fingerprint("fisher_hglmm", tokens, {"pca_dim": 6})
    assert base == text_encoder_fingerprint("fisher_hglmm", [list(t) for t in tokens], {"pca_dim": 6})
    assert base != text_encoder_fingerprint("fisher_hglmm", [["a", "dog"], ["a", "cat", "sits"]], {"pca_dim": 6})
    assert base != text_encoder_fingerprint("fisher_hglmm", [["a", "dogacat", "runs"]], {"pca_dim": 6})
    assert base != text_encoder_fingerprint("fisher_hglmm", tokens, {"pca_dim": 7})
    assert base != text_encoder_fingerprint("fisher_gmm", tokens, {"pca_dim": 6})
    path = tmp_path / "vectors.txt"
    save_word_vectors(path, WordVectors(["a", "dog"], np.ones((2, 3), np.float32)), binary=False)
    with_file = text_encoder_fingerprint("fisher_hglmm", tokens, {"pca_dim": 6}, word_vectors_file=path)
    assert with_file != base
    save_word_vectors(path, WordVectors(["a", "dog", "cat"], np.ones((3, 3), np.float32)), binary=False)
    assert with_file != text_encoder_fingerprint("fisher_hglmm", tokens, {"pca_dim": 6},
                                                 word_vectors_file=path)


def test_sentence_features_are_row_major_memory_maps_in_the_storage_dtype(tmp_path):
    splits = {"train": corpus("train", 12, seed=0), "test": corpus("test", 4, seed=1)}
    text, extras = prepare.prepare_text_features(splits, tmp_path, spec())
    assert isinstance(text["test"], np.memmap) and text["test"].dtype == np.float32
    assert text["test"].shape == (20, 6) and text["test"].flags.c_contiguous
    assert extras["feature_files"]["test"]["text"]["file"] == text["test"].filename
    half, _ = prepare.prepare_text_features(splits, tmp_path, spec(feature_dtype="float16"))
    assert half["test"].dtype == np.float16 and half["test"].filename != text["test"].filename
    np.testing.assert_array_equal(half["test"], text["test"].astype(np.float16))


def test_blocks_of_sentence_features_give_the_numbers_of_one_transform(tmp_path, monkeypatch):
    tokens = [c.split() for c in corpus("train", 40, seed=3).captions]
    vectors = WordVectors(WORDS, np.random.default_rng(0).normal(size=(len(WORDS), 4)).astype(np.float32))
    encoder = FisherVectorEncoder(vectors, num_components=2, pca_dim=6, batch_size=7).fit(tokens)
    whole = encoder.transform(tokens)
    monkeypatch.setattr(prepare, "BLOCK_BYTES", 100)  # blocks of a few rows, rounded to whole batches
    prepare.write_sentence_features(encoder, tokens, tmp_path / "t.npy", np.float32)
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), whole)
