"""Text towers that learn from words: the LSTM branch (TPAMI §5.3).

Tokenization happens inside the graph (`tensorflow-text` ops in
`tf_twobranch.data.tokenize.tf_tokenize`), so the exported tower accepts raw
caption strings; training feeds the same layer with strings too, and the
Python tokenizer is only used to build the vocabulary.
"""
from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from tf_twobranch.data.tokenize import tf_tokenize
from tf_twobranch.errors import ConfigError
from tf_twobranch.systems.two_branch.branches import branch_layers

PAD, UNK = "<pad>", "<unk>"


@keras.saving.register_keras_serializable(package="tf_twobranch")
class CaptionTokenizer(keras.layers.Layer):
    """Raw strings (batch,) → int32 token ids (batch, max_len), 0-padded.

    Index 0 is padding and 1 the unknown word, as in
    `tf_twobranch.data.tokenize.build_vocabulary`. Longer captions are cut
    at `max_len` words.
    """

    def __init__(self, vocabulary: Sequence[str], max_len: int = 32, **kwargs):
        kwargs.pop("trainable", None)  # always frozen; get_config stores it
        super().__init__(trainable=False, **kwargs)
        vocabulary = list(vocabulary)
        if len(vocabulary) < 2 or vocabulary[0] != PAD or vocabulary[1] != UNK:
            raise ConfigError("vocabulary must start with '<pad>', '<unk>' "
                              "(build it with tf_twobranch.data.tokenize.build_vocabulary)")
        if max_len <= 0:
            raise ConfigError(f"max_len must be positive, got {max_len}")
        self.vocabulary = vocabulary
        self.max_len = int(max_len)
        self._table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(vocabulary[2:], tf.string),
                tf.range(2, len(vocabulary), dtype=tf.int64)),
            default_value=1)

    def call(self, strings):
        strings = tf.reshape(tf.convert_to_tensor(strings, tf.string), [-1])
        tokens = tf_tokenize(strings)
        ids = tf.ragged.map_flat_values(self._table.lookup, tokens)
        ids = ids[:, : self.max_len]
        return tf.cast(ids.to_tensor(default_value=0, shape=[None, self.max_len]), tf.int32)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.max_len)

    def get_config(self):
        return {**super().get_config(), "vocabulary": self.vocabulary,
                "max_len": self.max_len}


def build_lstm_text_tower(vocabulary_size: int, *, max_len: int = 32,
                          word_dim: int = 256, lstm_units: int = 512,
                          hidden_dims: Sequence[int] = (1024,), output_dim: int = 512,
                          layout: str = "original", dropout: float = 0.5,
                          name: str = "text") -> keras.Model:
    """Token ids (batch, max_len) → word embedding 256 → LSTM 512 → branch → L2.

    TPAMI §5.3: one-hot words projected to a 256-d embedding, an LSTM with
    512 hidden units whose output feeds the text branch (FC 1024 → 512),
    trained jointly with the ranking loss.
    """
    ids = keras.Input(shape=(max_len,), dtype="int32", name=f"{name}_token_ids")
    x = keras.layers.Embedding(vocabulary_size, word_dim, mask_zero=True,
                               name=f"{name}_word_embedding")(ids)
    x = keras.layers.LSTM(lstm_units, name=f"{name}_lstm")(x)
    out = branch_layers(x, hidden_dims=hidden_dims, output_dim=output_dim, layout=layout,
                        dropout=dropout, name=name)
    return keras.Model(ids, out, name=name)


def build_string_text_tower(token_tower: keras.Model, vocabulary: Sequence[str],
                            max_len: int) -> keras.Model:
    """Wraps a token-id tower so it accepts raw caption strings (for export)."""
    strings = keras.Input(shape=(), dtype="string", name="captions")
    ids = CaptionTokenizer(vocabulary, max_len, name="caption_tokenizer")(strings)
    return keras.Model(strings, token_tower(ids), name=f"{token_tower.name}_strings")
