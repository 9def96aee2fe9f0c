"""Count-based word vectors (PPMI + SVD), trained on the captions when no
pretrained word2vec/GloVe file is given (files are read by
`tf_twobranch.data.formats.word_vectors`).
"""
from __future__ import annotations

import collections
import logging
from typing import Iterable, Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.decomposition import TruncatedSVD

from tf_twobranch.data.formats.word_vectors import WordVectors
from tf_twobranch.errors import ConfigError

__all__ = ["train_word_vectors"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# Training count-based vectors


def train_word_vectors(
    token_lists: Iterable[Sequence[str]],
    dim: int = 300,
    *,
    window: int = 5,
    min_count: int = 1,
    seed: int = 0,
    context_smoothing: float = 0.75,
) -> WordVectors:
    """Count-based word vectors: PPMI co-occurrence matrix + truncated SVD.

    This is the stand-in for word2vec when no pretrained file is given
    (Levy, Goldberg & Dagan 2015 show PPMI-SVD is competitive with skip-gram
    on similarity tasks). Co-occurrences are counted in a symmetric window of
    `window` words inside each sentence, weighted 1/distance as in word2vec's
    dynamic window; context probabilities are smoothed with exponent
    `context_smoothing`; the embedding is U·sqrt(S) of the SVD.

    Args:
      token_lists: the training sentences, already tokenised.
      dim: output dimension; clipped to (vocabulary size - 1) for tiny corpora.
      window: co-occurrence window radius.
      min_count: words seen fewer times are left out.
      seed: seed of the randomized SVD.
    """
    if dim <= 0 or window <= 0 or min_count <= 0:
        raise ConfigError(f"train_word_vectors needs positive dim, window and min_count; got {dim}, {window}, {min_count}")
    token_lists = [list(t) for t in token_lists]
    counts = collections.Counter(t for tokens in token_lists for t in tokens)
    vocab = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    if len(vocab) < 2:
        raise ConfigError(f"cannot train word vectors: only {len(vocab)} words occur at least {min_count} times")
    index = {w: i for i, w in enumerate(vocab)}
    ids_per_sentence = [[index[t] for t in tokens if t in index] for tokens in token_lists]
    lengths = np.fromiter((len(s) for s in ids_per_sentence), dtype=np.int64, count=len(ids_per_sentence))
    flat = np.fromiter((i for s in ids_per_sentence for i in s), dtype=np.int64, count=int(lengths.sum()))
    sentence_of = np.repeat(np.arange(len(lengths)), lengths)

    rows, cols, weights = [], [], []
    for offset in range(1, window + 1):
        if offset >= len(flat):
            break
        same = sentence_of[:-offset] == sentence_of[offset:]
        left, right = flat[:-offset][same], flat[offset:][same]
        w = np.full(len(left), 1.0 / offset)
        rows += [left, right]
        cols += [right, left]
        weights += [w, w]
    v = len(vocab)
    if not rows:
        raise ConfigError("cannot train word vectors: no two words co-occur in any sentence")
    cooc = sp.coo_matrix(
        (np.concatenate(weights), (np.concatenate(rows), np.concatenate(cols))), shape=(v, v)
    ).tocsr()
    cooc.sum_duplicates()

    total = cooc.sum()
    word_marginal = np.asarray(cooc.sum(axis=1)).ravel()
    context_mass = np.asarray(cooc.sum(axis=0)).ravel() ** context_smoothing
    context_prob = context_mass / context_mass.sum()
    word_prob = word_marginal / total
    coo = cooc.tocoo()
    pmi = np.log(coo.data / total) - np.log(word_prob[coo.row]) - np.log(context_prob[coo.col])
    keep = pmi > 0
    ppmi = sp.csr_matrix((pmi[keep], (coo.row[keep], coo.col[keep])), shape=(v, v))

    out_dim = min(dim, v - 1)
    if out_dim < dim:
        logger.warning("train_word_vectors: vocabulary has %d words; using dimension %d instead of %d", v, out_dim, dim)
    svd = TruncatedSVD(n_components=out_dim, algorithm="randomized", n_iter=5, random_state=seed)
    u_sigma = svd.fit_transform(ppmi)  # U * S
    singular = np.maximum(svd.singular_values_, 1e-12)
    vectors = u_sigma / np.sqrt(singular)  # U * sqrt(S)
    logger.info("Trained PPMI-SVD word vectors: %d words, dimension %d, %d sentences", v, out_dim, len(token_lists))
    return WordVectors(vocab, vectors.astype(np.float32))
