"""Sentence codes of the dual-path CNN (Zheng et al., §3.2 and §6.4).

A caption becomes the sequence of its words' dictionary indices ("code" T of
the paper, a one-hot n × d matrix stored as n indices):

* the dictionary holds the words of the *training* captions that also have a
  word2vec vector (d = 20,074 on Flickr30K); index 0 is padding and 1 is
  reserved for the unknown word, so rows of the embedding matrix and of
  `tf_twobranch.data.tokenize.build_vocabulary` line up;
* words outside the dictionary are REMOVED, at training and at test time
  (§6.4 "the missing words in the dictionary will also be removed in
  advance"), not mapped to ``<unk>``: a code never contains index 1;
* a code longer than the fixed input length (32; 56 on CUHK-PEDES) is either
  an error (default, so that a wrong ``max_len`` does not silently cut text)
  or clipped to its first ``max_len`` words (``long_captions="clip"``, what
  the paper does: "we clip the final several words").

`TokenCoder` does this inside the TensorFlow graph (tensorflow-text
tokenization, identical to the Python tokenizer), so an exported text tower
accepts raw strings; `encode_captions` is the Python equivalent used to
build and validate datasets.
"""
from __future__ import annotations

import collections
from typing import Iterable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch.data.tokenize import PAD_TOKEN, UNK_TOKEN, tf_tokenize, tokenize_caption
from tf_twobranch.errors import ConfigError, DataFormatError

__all__ = ["LONG_CAPTION_POLICIES", "build_text_vocabulary", "initial_word_matrix",
           "encode_captions", "check_caption_lengths", "TokenCoder"]

LONG_CAPTION_POLICIES = ("error", "clip")


def _check_vocabulary(vocabulary: Sequence[str]) -> list[str]:
    vocabulary = list(vocabulary)
    if len(vocabulary) < 2 or vocabulary[0] != PAD_TOKEN or vocabulary[1] != UNK_TOKEN:
        raise ConfigError(f"the vocabulary must start with {PAD_TOKEN!r}, {UNK_TOKEN!r} "
                          "(build it with tf_twobranch.data.text_codes.build_text_vocabulary)")
    if len(set(vocabulary)) != len(vocabulary):
        seen = set()
        duplicate = next(w for w in vocabulary if w in seen or seen.add(w))
        raise ConfigError(f"the vocabulary lists the word {duplicate!r} twice")
    return vocabulary


def build_text_vocabulary(token_lists: Iterable[Iterable[str]], word_vectors=None,
                          min_count: int = 1) -> list[str]:
    """The dictionary of the text CNN: ``["<pad>", "<unk>", words...]``.

    Args:
      token_lists: the tokenized TRAINING captions (`tokenize_caption`).
      word_vectors: a `tf_twobranch.data.formats.word_vectors.WordVectors` (or any
        container supporting ``word in word_vectors``); when given, words
        without a vector are dropped (§3.2: the dictionary is the training
        words that word2vec knows).
      min_count: keep words occurring at least this often in the captions.

    Words are ordered by decreasing count, ties alphabetically (deterministic).
    """
    if min_count < 1:
        raise ConfigError(f"min_count must be >= 1, got {min_count}")
    counts = collections.Counter()
    for tokens in token_lists:
        counts.update(tokens)
    for reserved in (PAD_TOKEN, UNK_TOKEN):
        counts.pop(reserved, None)
    words = [w for w, c in counts.items() if c >= min_count
             and (word_vectors is None or w in word_vectors)]
    words.sort(key=lambda w: (-counts[w], w))
    return [PAD_TOKEN, UNK_TOKEN] + words


def initial_word_matrix(vocabulary: Sequence[str], word_vectors=None, dim: int | None = None,
                        seed: int = 0) -> np.ndarray:
    """Initial (V, dim) float32 weights of the text CNN's first layer (the d × 300 matrix).

    Rows of words with a vector are copied from `word_vectors` (§6.4 word2vec
    initialisation); other rows (``<unk>``, words without a vector, or all
    words when `word_vectors` is None: the paper's random initialisation) are
    drawn from a normal distribution with the standard deviation of the
    given vectors (0.1 without vectors). The ``<pad>`` row is zero.

    Args:
      vocabulary: from `build_text_vocabulary`.
      word_vectors: `WordVectors` or None.
      dim: row dimension; defaults to the vectors' dimension, else 300.
      seed: seed of the random rows.
    """
    vocabulary = _check_vocabulary(vocabulary)
    if word_vectors is not None:
        vector_dim = int(word_vectors.dim)
        if dim is not None and dim != vector_dim:
            raise ConfigError(f"dim={dim} differs from the word vectors' dimension {vector_dim}")
        dim = vector_dim
    dim = 300 if dim is None else int(dim)
    if dim < 1:
        raise ConfigError(f"dim must be positive, got {dim}")
    scale = 0.1
    if word_vectors is not None and len(word_vectors) > 0:
        scale = float(np.std(word_vectors.vectors)) or 0.1
    rng = np.random.default_rng(seed)
    matrix = rng.normal(0.0, scale, size=(len(vocabulary), dim)).astype(np.float32)
    if word_vectors is not None:
        for row, word in enumerate(vocabulary[2:], start=2):
            if word in word_vectors:
                matrix[row] = word_vectors[word]
    matrix[0] = 0.0
    return matrix


def encode_captions(captions: Iterable[str], vocabulary: Sequence[str]) -> list[np.ndarray]:
    """Python version of `TokenCoder`: int32 word indices per caption, unknown words removed."""
    vocabulary = _check_vocabulary(vocabulary)
    index = {w: i for i, w in enumerate(vocabulary) if i >= 2}
    return [np.asarray([index[t] for t in tokenize_caption(c) if t in index], dtype=np.int32)
            for c in captions]


def check_caption_lengths(codes: Sequence[np.ndarray], max_len: int, long_captions: str = "error",
                          *, source="", records: Sequence | None = None,
                          allow_empty: bool = False) -> list[np.ndarray]:
    """Validates caption codes against the fixed input length, applying the policy.

    Args:
      codes: word-index sequences (from `encode_captions`).
      max_len: the text CNN's input length (32; 56 for CUHK-PEDES).
      long_captions: "error" raises for a caption longer than `max_len`;
        "clip" keeps its first `max_len` words (the paper's choice).
      source: the caption file, named in errors.
      records: a description of each caption for error messages (e.g.
        "image 1000092795, caption 2"); defaults to "caption <index>".
      allow_empty: accept codes with no known word (they become all-padding
        inputs; for evaluation captions, which cannot be skipped). Otherwise
        an empty code raises: the caption has no dictionary word left.

    Returns:
      the codes, clipped where the policy says so.
    Raises:
      DataFormatError naming `source` and the record.
    """
    if long_captions not in LONG_CAPTION_POLICIES:
        raise ConfigError(f"long_captions must be one of {LONG_CAPTION_POLICIES}, got {long_captions!r}")
    if max_len < 1:
        raise ConfigError(f"max_len must be positive, got {max_len}")
    out = []
    for i, code in enumerate(codes):
        code = np.asarray(code, dtype=np.int32)
        record = records[i] if records is not None else f"caption {i}"
        if len(code) > max_len:
            if long_captions == "error":
                raise DataFormatError(
                    source or "(captions)",
                    f"caption has {len(code)} dictionary words, more than the text input length "
                    f"max_len={max_len}; raise max_len, or pass long_captions='clip' to cut the "
                    f"final words as the paper does", record=record)
            code = code[:max_len]
        elif len(code) == 0 and not allow_empty:
            raise DataFormatError(
                source or "(captions)",
                "caption has no word left after removing words outside the dictionary "
                "(words of the training captions with a word vector); it cannot be used for "
                "training", record=record)
        out.append(code)
    return out


@keras.saving.register_keras_serializable(package="tf_twobranch")
class TokenCoder(keras.layers.Layer):
    """Raw caption strings (batch,) → ragged int32 word indices (batch, None).

    Tokenizes in the graph (`tf_tokenize`, same tokens as `tokenize_caption`),
    looks words up in `vocabulary` and REMOVES words that are not in it (index
    1, ``<unk>``, is never produced). With `max_len`, codes are clipped to
    their first `max_len` words (the paper's rule; datasets validate lengths
    up front with `check_caption_lengths`). Feed the result to
    `tf_twobranch.systems.dual_path.sampling.position_shift` / `left_align`.
    Gives the same indices as `encode_captions`.
    """

    def __init__(self, vocabulary: Sequence[str], max_len: int | None = None, **kwargs):
        kwargs.pop("trainable", None)  # always frozen; get_config stores it
        super().__init__(trainable=False, **kwargs)
        self.vocabulary = _check_vocabulary(vocabulary)
        if max_len is not None and int(max_len) < 1:
            raise ConfigError(f"max_len must be positive, got {max_len}")
        self.max_len = None if max_len is None else int(max_len)
        # A vocabulary of only the reserved entries still needs one key.
        words = self.vocabulary[2:] or [PAD_TOKEN]
        values = tf.range(2, 2 + len(words), dtype=tf.int64) if self.vocabulary[2:] \
            else tf.constant([-1], tf.int64)
        self._table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(tf.constant(words, tf.string), values),
            default_value=-1)

    def call(self, strings):
        strings = tf.reshape(tf.convert_to_tensor(strings, tf.string), [-1])
        tokens = tf_tokenize(strings)
        ids = tf.ragged.map_flat_values(self._table.lookup, tokens)
        ids = tf.ragged.boolean_mask(ids, ids >= 0)
        if self.max_len is not None:
            ids = ids[:, : self.max_len]
        return tf.cast(ids, tf.int32)

    def get_config(self):
        return {**super().get_config(), "vocabulary": self.vocabulary, "max_len": self.max_len}
