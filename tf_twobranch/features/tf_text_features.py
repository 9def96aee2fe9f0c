"""In-graph versions of the fitted sentence encoders of `text_features`.

Each layer reproduces one *fitted* numpy encoder inside a TensorFlow graph and
takes raw caption strings, so a SavedModel can serve text end to end:

1. tokenize with `tf_twobranch.data.tokenize.tf_tokenize` (the same tokens as
   the Python `tokenize_caption` the numpy encoders are fed with);
2. look words up in a `tf.lookup.StaticHashTable` (word -> row); unknown
   words are dropped, exactly as `WordVectors.lookup` drops them;
3. compute the encoder's features:

   * `TFFisherVectorLayer` -- `FisherVectorEncoder` (HGLMM or GMM
     posteriors, mean and scale/variance gradients, division by the number
     of known words, power and L2 normalisation, optional ICA before the
     mixture and PCA after it);
   * `TFMeanVectorLayer` -- `MeanWordVectorEncoder`;
   * `TFTfidfLayer` -- `TfidfEncoder` (stop words removed, raw or sublinear
     term counts times idf, L2-normalised rows).

Sentences without any known word (empty strings, punctuation only, all
words unknown) get exactly what the numpy encoders return for them: a zero
Fisher vector (after PCA: ``-pca_mean @ pca_components.T``, the projection
of that zero vector), a zero mean vector, a zero tf-idf row.

Mixture statistics are computed in float64 like the numpy reference; the
output is float32. Outputs agree with the numpy `transform` to ~1e-6.

Serialisation: the vocabulary (word list / dictionary) is part of the layer
config; every numeric array (word vectors, mixture, projections, idf) is a
non-trainable weight, so ``.keras`` files and SavedModels hold them.
"""
from __future__ import annotations

from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch.data.tokenize import tf_tokenize
from tf_twobranch.errors import ConfigError
from tf_twobranch.features.text_features import (
    FisherVectorEncoder, MeanWordVectorEncoder, TextEncoder, TfidfEncoder)

__all__ = ["TFFisherVectorLayer", "TFMeanVectorLayer", "TFTfidfLayer", "text_feature_layer_from_encoder"]


def _word_table(words: Sequence[str]) -> tf.lookup.StaticHashTable:
    """word -> row index; -1 for unknown words."""
    keys = tf.constant(list(words), dtype=tf.string) if len(words) else tf.zeros([0], tf.string)
    initializer = tf.lookup.KeyValueTensorInitializer(
        keys, tf.range(len(words), dtype=tf.int64), key_dtype=tf.string, value_dtype=tf.int64)
    return tf.lookup.StaticHashTable(initializer, default_value=-1)


def _known_words(layer, strings):
    """Row ids of the known words of every sentence and the sentence of each.

    Returns (ids (M,), sentence (M,), batch size) after dropping unknown words.
    """
    strings = tf.convert_to_tensor(strings, dtype=tf.string)
    if strings.shape.rank == 2 and strings.shape[-1] == 1:
        strings = tf.squeeze(strings, -1)
    tokens = tf_tokenize(strings)
    ids = layer._table.lookup(tokens.flat_values)
    sentence = tokens.value_rowids()
    known = ids >= 0
    return tf.boolean_mask(ids, known), tf.boolean_mask(sentence, known), tf.shape(strings, out_type=tf.int64)[0]


def _set(weight, value) -> None:
    weight.assign(np.asarray(value, dtype=weight.dtype).reshape(weight.shape))


class _WordTableLayer(keras.layers.Layer):
    """Common part: a vocabulary table built from the config's word list."""

    def __init__(self, words: Sequence[str], **kwargs):
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        self.words = [str(w) for w in words]
        self._table = _word_table(self.words)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.output_dim)

    def get_config(self):
        return {**super().get_config(), "words": list(self.words)}


@keras.saving.register_keras_serializable(package="tf_twobranch")
class TFMeanVectorLayer(_WordTableLayer):
    """Raw strings (B,) -> (B, D) mean of the known words' vectors (zeros if none)."""

    def __init__(self, words: Sequence[str], dim: int, **kwargs):
        super().__init__(words, **kwargs)
        self.dim = int(dim)
        self.output_dim = self.dim
        self.vectors = self.add_weight(shape=(len(self.words), self.dim), initializer="zeros",
                                       dtype="float32", trainable=False, name="word_vectors")

    @classmethod
    def from_encoder(cls, encoder: MeanWordVectorEncoder, **kwargs) -> "TFMeanVectorLayer":
        """The layer computing `encoder.transform` on raw strings."""
        if not isinstance(encoder, MeanWordVectorEncoder):
            raise ConfigError(f"TFMeanVectorLayer needs a MeanWordVectorEncoder, got {type(encoder).__name__}")
        layer = cls(encoder.word_vectors.words, encoder.word_vectors.dim, **kwargs)
        _set(layer.vectors, encoder.word_vectors.vectors)
        return layer

    def call(self, strings):
        ids, sentence, batch = _known_words(self, strings)
        x = tf.cast(tf.gather(tf.convert_to_tensor(self.vectors), ids), tf.float64)
        sums = tf.math.unsorted_segment_sum(x, sentence, batch)
        counts = tf.math.unsorted_segment_sum(tf.ones_like(sentence, tf.float64), sentence, batch)
        return tf.cast(sums / tf.maximum(counts, 1.0)[:, None], tf.float32)

    def get_config(self):
        return {**super().get_config(), "dim": self.dim}


@keras.saving.register_keras_serializable(package="tf_twobranch")
class TFTfidfLayer(_WordTableLayer):
    """Raw strings (B,) -> (B, V) tf-idf rows of a fitted `TfidfEncoder`.

    `words` is the encoder's dictionary in feature order; stop words are
    left out of the table, so they are dropped like the encoder's analyzer
    drops them.
    """

    def __init__(self, words: Sequence[str], stop_words: Sequence[str] = (), sublinear_tf: bool = False,
                 **kwargs):
        stop = frozenset(stop_words)
        self.stop_words = sorted(stop)
        self.dictionary = [str(w) for w in words]
        # Rows follow the dictionary; stop words get no row (always dropped).
        super().__init__([w for w in self.dictionary if w not in stop], **kwargs)
        self._columns = tf.constant([i for i, w in enumerate(self.dictionary) if w not in stop], tf.int64)
        self.sublinear_tf = bool(sublinear_tf)
        self.output_dim = len(self.dictionary)
        self.idf = self.add_weight(shape=(self.output_dim,), initializer="ones", dtype="float64",
                                   trainable=False, name="idf")

    @classmethod
    def from_encoder(cls, encoder: TfidfEncoder, **kwargs) -> "TFTfidfLayer":
        """The layer computing `encoder.transform` on raw strings."""
        if not isinstance(encoder, TfidfEncoder):
            raise ConfigError(f"TFTfidfLayer needs a TfidfEncoder, got {type(encoder).__name__}")
        layer = cls(encoder.vocabulary, sorted(encoder.stop_word_set()), encoder.sublinear_tf, **kwargs)
        _set(layer.idf, encoder._vectorizer.idf_)
        return layer

    def call(self, strings):
        rows, sentence, batch = _known_words(self, strings)
        columns = tf.gather(self._columns, rows)
        counts = tf.scatter_nd(tf.stack([sentence, columns], axis=1), tf.ones_like(columns, tf.float64),
                               tf.stack([batch, tf.constant(self.output_dim, tf.int64)]))
        if self.sublinear_tf:
            counts = tf.where(counts > 0, 1.0 + tf.math.log(tf.maximum(counts, 1.0)), counts)
        weighted = counts * tf.convert_to_tensor(self.idf)[None, :]
        norms = tf.norm(weighted, axis=1, keepdims=True)
        return tf.cast(tf.math.divide_no_nan(weighted, norms), tf.float32)

    def get_config(self):
        config = super().get_config()
        config.update(words=list(self.dictionary), stop_words=list(self.stop_words),
                      sublinear_tf=self.sublinear_tf)
        return config


@keras.saving.register_keras_serializable(package="tf_twobranch")
class TFFisherVectorLayer(_WordTableLayer):
    """Raw strings (B,) -> (B, output_dim) Fisher vectors of a fitted `FisherVectorEncoder`.

    Layout and formulas are those of `text_features.fisher_vectors`:
    [G_mu (K x D), G_scale (K x D)] per sentence, divided by the number of
    known words, signed square root, L2 normalisation, then PCA if the
    encoder has one.
    """

    def __init__(self, words: Sequence[str], word_dim: int, num_components: int, mixture: str = "hglmm",
                 use_ica: bool = False, pca_dim: int | None = None, **kwargs):
        super().__init__(words, **kwargs)
        if mixture not in ("gmm", "hglmm"):
            raise ConfigError(f"unknown mixture {mixture!r}; expected 'gmm' or 'hglmm'")
        self.word_dim, self.num_components, self.mixture = int(word_dim), int(num_components), mixture
        self.use_ica = bool(use_ica)
        self.pca_dim = None if pca_dim is None else int(pca_dim)
        self.fv_dim = 2 * self.num_components * self.word_dim
        self.output_dim = self.fv_dim if self.pca_dim is None else self.pca_dim
        k, d = self.num_components, self.word_dim

        def weight(name, shape, dtype="float64"):
            return self.add_weight(shape=shape, initializer="zeros", dtype=dtype, trainable=False, name=name)

        self.vectors = weight("word_vectors", (len(self.words), d), "float32")
        self.mixture_weights = weight("mixture_weights", (k,))
        self.means = weight("means", (k, d))
        self.scales = weight("scales", (k, d))
        if self.use_ica:
            self.ica_mean = weight("ica_mean", (d,))
            self.ica_unmixing = weight("ica_unmixing", (d, d))
        if self.pca_dim is not None:
            self.pca_mean = weight("pca_mean", (self.fv_dim,), "float32")
            self.pca_components = weight("pca_components", (self.pca_dim, self.fv_dim), "float32")

    @classmethod
    def from_encoder(cls, encoder: FisherVectorEncoder, **kwargs) -> "TFFisherVectorLayer":
        """The layer computing `encoder.transform` on raw strings (the encoder must be fitted)."""
        if not isinstance(encoder, FisherVectorEncoder):
            raise ConfigError(f"TFFisherVectorLayer needs a FisherVectorEncoder, got {type(encoder).__name__}")
        encoder.check_fitted(encoder.weights_ is not None)
        pca = encoder.pca_components_
        layer = cls(encoder.word_vectors.words, encoder.word_vectors.dim, encoder.num_components,
                    encoder.mixture, use_ica=encoder.ica_unmixing_ is not None,
                    pca_dim=None if pca is None else int(pca.shape[0]), **kwargs)
        _set(layer.vectors, encoder.word_vectors.vectors)
        _set(layer.mixture_weights, encoder.weights_)
        _set(layer.means, encoder.means_)
        _set(layer.scales, encoder.scales_)
        if layer.use_ica:
            _set(layer.ica_mean, encoder.ica_mean_)
            _set(layer.ica_unmixing, encoder.ica_unmixing_)
        if pca is not None:
            _set(layer.pca_mean, encoder.pca_mean_)
            _set(layer.pca_components, pca)
        return layer

    def _log_joint(self, x, weights, means, scales):
        """(M, K) log(w_k) + log p(x_i | component k)."""
        diff = x[:, None, :] - means[None]                                   # (M, K, D)
        if self.mixture == "hglmm":
            log_norm = tf.math.log(weights) - tf.reduce_sum(tf.math.log(2.0 * scales), axis=1)
            return log_norm[None] - tf.reduce_sum(tf.abs(diff) / scales[None], axis=2), diff
        log_norm = tf.math.log(weights) - 0.5 * tf.reduce_sum(tf.math.log(2.0 * np.pi * scales), axis=1)
        return log_norm[None] - 0.5 * tf.reduce_sum(diff * diff / scales[None], axis=2), diff

    def call(self, strings):
        ids, sentence, batch = _known_words(self, strings)
        x = tf.cast(tf.gather(tf.convert_to_tensor(self.vectors), ids), tf.float64)
        if self.use_ica:
            x = tf.matmul(x - tf.convert_to_tensor(self.ica_mean)[None], self.ica_unmixing, transpose_b=True)
        weights = tf.convert_to_tensor(self.mixture_weights)
        means, scales = tf.convert_to_tensor(self.means), tf.convert_to_tensor(self.scales)
        log_joint, diff = self._log_joint(x, weights, means, scales)
        resp = tf.nn.softmax(log_joint, axis=1)[:, :, None]                   # (M, K, 1)
        if self.mixture == "hglmm":
            inv_sqrt_w = tf.math.rsqrt(weights)[None, :, None]
            # The differences in float32, as `fisher_vectors` takes them: the
            # Laplacian M-step's medians are word vectors, so a word often sits on
            # a component's mean, where float64 differences give sign +-1 and
            # numpy's float32 ones 0 (seen: 0.18 apart after the power normalisation).
            diff32 = tf.cast(x, tf.float32)[:, None, :] - tf.cast(means, tf.float32)[None]
            scaled = tf.abs(diff32) * tf.cast(1.0 / scales, tf.float32)[None] - 1.0
            grad_mean = resp * tf.cast(tf.sign(diff32), tf.float64) * inv_sqrt_w
            grad_scale = resp * tf.cast(scaled, tf.float64) * inv_sqrt_w
        else:
            grad_mean = resp * diff / tf.sqrt(scales)[None] * tf.math.rsqrt(weights)[None, :, None]
            grad_scale = resp * (diff * diff / scales[None] - 1.0) * tf.math.rsqrt(2.0 * weights)[None, :, None]
        per_word = tf.reshape(tf.stack([grad_mean, grad_scale], axis=1), [-1, self.fv_dim])
        sums = tf.math.unsorted_segment_sum(per_word, sentence, batch)
        counts = tf.math.unsorted_segment_sum(tf.ones_like(sentence, tf.float64), sentence, batch)
        fv = sums / tf.maximum(counts, 1.0)[:, None]
        fv = tf.sign(fv) * tf.sqrt(tf.abs(fv))
        fv = tf.cast(tf.math.divide_no_nan(fv, tf.norm(fv, axis=1, keepdims=True)), tf.float32)
        if self.pca_dim is not None:
            fv = tf.matmul(fv - tf.convert_to_tensor(self.pca_mean)[None], self.pca_components, transpose_b=True)
        return fv

    def get_config(self):
        return {**super().get_config(), "word_dim": self.word_dim, "num_components": self.num_components,
                "mixture": self.mixture, "use_ica": self.use_ica, "pca_dim": self.pca_dim}


def text_feature_layer_from_encoder(encoder: TextEncoder, **kwargs) -> keras.layers.Layer:
    """The in-graph layer (raw strings -> features) of a fitted numpy encoder."""
    if isinstance(encoder, FisherVectorEncoder):
        return TFFisherVectorLayer.from_encoder(encoder, **kwargs)
    if isinstance(encoder, MeanWordVectorEncoder):
        return TFMeanVectorLayer.from_encoder(encoder, **kwargs)
    if isinstance(encoder, TfidfEncoder):
        return TFTfidfLayer.from_encoder(encoder, **kwargs)
    raise ConfigError(f"no in-graph version of text encoder {type(encoder).__name__}; expected a fitted "
                      "FisherVectorEncoder, MeanWordVectorEncoder or TfidfEncoder")
