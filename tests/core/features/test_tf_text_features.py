"""In-graph text encoders reproduce the fitted numpy encoders on raw strings."""
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError
from tf_twobranch.features.text_features import (FisherVectorEncoder, MeanWordVectorEncoder, TfidfEncoder)
from tf_twobranch.features.tf_text_features import (TFFisherVectorLayer, TFMeanVectorLayer, TFTfidfLayer,
                                                    text_feature_layer_from_encoder)
from tf_twobranch.features.word_vectors import train_word_vectors

# Empty, punctuation-only and all-unknown sentences: numpy gives zero features
# (after PCA: the projection of the zero vector), and so must the layers.
HAND_MADE = [
    "A man in a red shirt rides a bike.",
    "",
    "   ",
    "?!... ,;",
    "zzqx blorfl wuggle",            # no known word
    "Two DOGS &amp; a cat's toy, dogs!",
    "dog",
    "the the the",                    # stop words only (tf-idf zero row)
    "caf\u00e9 na\u00efve \u2019s dog",
]


@pytest.fixture(scope="module")
def corpus(realdata):
    from tf_twobranch.data.formats import read_token_file

    captions = read_token_file(realdata / "flickr30k" / "captions_multi30k.token").captions
    return captions[:1500], captions[1500:1800]


@pytest.fixture(scope="module")
def word_vectors(corpus):
    train, _ = corpus
    return train_word_vectors([tokenize_caption(c) for c in train], dim=12, min_count=2, seed=0)


def _compare(encoder, layer, sentences):
    expected = encoder.transform([tokenize_caption(s) for s in sentences])
    got = layer(tf.constant(sentences)).numpy()
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    return expected, got


@pytest.mark.parametrize("mixture,pca_dim", [("hglmm", None), ("hglmm", 20), ("gmm", None), ("gmm", 16)])
def test_fisher_vector_layer_matches_numpy(corpus, word_vectors, mixture, pca_dim):
    train, test = corpus
    encoder = FisherVectorEncoder(word_vectors, num_components=3, mixture=mixture, pca_dim=pca_dim,
                                  max_iter=10, pca_max_sentences=400, seed=0)
    encoder.fit([tokenize_caption(c) for c in train[:600]])
    layer = text_feature_layer_from_encoder(encoder)
    assert isinstance(layer, TFFisherVectorLayer) and layer.output_dim == encoder.output_dim
    expected, _ = _compare(encoder, layer, test)
    assert np.abs(expected).max() > 0.01          # not a trivially-zero comparison
    hand, _ = _compare(encoder, layer, HAND_MADE)
    if pca_dim is None:
        assert np.all(hand[1:5] == 0)             # no known word -> zero Fisher vector
    else:
        np.testing.assert_allclose(hand[1], -encoder.pca_mean_ @ encoder.pca_components_.T, atol=1e-5)


def test_hglmm_layer_on_a_word_at_a_component_mean(corpus, word_vectors):
    """The Laplacian M-step's means are medians, i.e. word vectors: a word on a mean has sign 0 in numpy's
    float32 differences, and must have it in the layer too (float64 differences gave +-1: 0.18 apart)."""
    train, _ = corpus
    encoder = FisherVectorEncoder(word_vectors, num_components=2, mixture="hglmm", max_iter=5, seed=0)
    encoder.fit([tokenize_caption(c) for c in train[:400]])
    row = word_vectors.index["dog"]
    # A float64 mean that rounds to the float32 word vector (as a median of float64 data can).
    encoder.means_[0] = word_vectors.vectors[row].astype(np.float64) + 1e-12
    _compare(encoder, TFFisherVectorLayer.from_encoder(encoder), ["dog", "a dog runs", "dog dog"])


def test_fisher_vector_layer_with_ica(corpus, word_vectors):
    train, test = corpus
    encoder = FisherVectorEncoder(word_vectors, num_components=2, mixture="hglmm", ica=True, max_iter=5)
    encoder.fit([tokenize_caption(c) for c in train[:400]])
    layer = TFFisherVectorLayer.from_encoder(encoder)
    assert layer.use_ica
    _compare(encoder, layer, test[:100] + HAND_MADE)


def test_mean_vector_layer_matches_numpy(corpus, word_vectors):
    encoder = MeanWordVectorEncoder(word_vectors)
    layer = TFMeanVectorLayer.from_encoder(encoder)
    _compare(encoder, layer, corpus[1])
    hand, _ = _compare(encoder, layer, HAND_MADE)
    assert np.all(hand[1:5] == 0)


@pytest.mark.parametrize("sublinear", [False, True])
def test_tfidf_layer_matches_numpy(corpus, sublinear):
    train, test = corpus
    encoder = TfidfEncoder(max_features=500, sublinear_tf=sublinear).fit([tokenize_caption(c) for c in train])
    layer = TFTfidfLayer.from_encoder(encoder)
    _compare(encoder, layer, test)
    hand, _ = _compare(encoder, layer, HAND_MADE)
    assert np.all(hand[[1, 2, 3, 4, 7]] == 0)


def test_layer_survives_keras_round_trip(tmp_path, corpus, word_vectors):
    train, test = corpus
    encoder = FisherVectorEncoder(word_vectors, num_components=2, pca_dim=8, max_iter=3, pca_max_sentences=200)
    encoder.fit([tokenize_caption(c) for c in train[:300]])
    import keras

    keras_input = keras.Input(shape=(), dtype="string")
    model = keras.Model(keras_input, TFFisherVectorLayer.from_encoder(encoder)(keras_input))
    path = tmp_path / "fv.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    strings = tf.constant(test[:20])
    np.testing.assert_allclose(restored(strings).numpy(), encoder.transform([tokenize_caption(c) for c in test[:20]]),
                               atol=1e-4)


def test_unfitted_or_unknown_encoder_is_a_config_error(word_vectors):
    with pytest.raises(ConfigError, match="not fitted"):
        TFFisherVectorLayer.from_encoder(FisherVectorEncoder(word_vectors, num_components=2))
    with pytest.raises(ConfigError, match="no in-graph version"):
        text_feature_layer_from_encoder(object())
    with pytest.raises(ConfigError, match="needs a TfidfEncoder"):
        TFTfidfLayer.from_encoder(MeanWordVectorEncoder(word_vectors))
