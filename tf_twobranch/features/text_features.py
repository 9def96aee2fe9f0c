"""Sentence encoders that turn tokenised captions into fixed-length features.

The text features of Wang et al. (CVPR 2016 §3.1; TPAMI 2018 §4.3/§5.3):

* `FisherVectorEncoder` -- Fisher vectors (FV) of a sentence's word vectors
  with respect to a diagonal mixture fitted on training words; with
  ``mixture="hglmm"`` the hybrid Gaussian-Laplacian mixture of Klein et al.
  (CVPR 2015), 30 components on 300-d word2vec -> 18000 dims, PCA to 6000.
* `MeanWordVectorEncoder` -- the mean of the word vectors (300 dims).
* `TfidfEncoder` -- tf-idf bag of words (3000 words on Flickr30K, stop words
  removed).

Every encoder has ``fit(token_lists)``, ``transform(token_lists) -> float32``,
``get_config()``, ``save(path)`` and ``load(path)``. Saved encoders are a
single ``.npz`` with a JSON config and plain arrays (no pickled objects), so
``load_text_encoder(path)`` can rebuild any of them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.cluster import KMeans
from sklearn.decomposition import PCA, FastICA
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, TfidfVectorizer
from sklearn.mixture import GaussianMixture

from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.data.formats.row_arrays import temp_beside
from tf_twobranch.data.formats.word_vectors import WordVectors

logger = logging.getLogger(__name__)

TokenLists = Sequence[Sequence[str]]

_FORMAT_VERSION = 1


# --------------------------------------------------------------------------
# Saving / loading helpers


def _save_npz(path: str | os.PathLike, config: dict, arrays: dict[str, np.ndarray]) -> None:
    path = os.fspath(path)
    payload = {"config_json": np.array(json.dumps({**config, "format_version": _FORMAT_VERSION}))}
    for key, value in arrays.items():
        payload[key] = np.asarray(value)
    # np.savez appends ".npz" to names without it; write through a handle so
    # the file lands exactly at `path`.
    with open(path, "wb") as out:
        np.savez(out, **payload)


def _load_npz(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataFormatError(path, "saved text encoder not found")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (ValueError, OSError) as err:
        raise DataFormatError(path, f"not a saved text encoder (.npz without pickled objects): {err}") from None
    if "config_json" not in arrays:
        raise DataFormatError(path, "missing the 'config_json' entry of a saved text encoder")
    try:
        config = json.loads(str(arrays.pop("config_json")))
    except json.JSONDecodeError as err:
        raise DataFormatError(path, f"'config_json' is not valid JSON: {err}", record="config_json") from None
    return config, arrays


def _require(path, arrays: dict, keys: Iterable[str]) -> None:
    for key in keys:
        if key not in arrays:
            raise DataFormatError(path, f"saved encoder lacks the array {key!r}", record=key)


def _word_vector_arrays(word_vectors: WordVectors) -> dict[str, np.ndarray]:
    return {"words": np.array(word_vectors.words, dtype=str), "vectors": word_vectors.vectors}


def _word_vectors_from(path, arrays) -> WordVectors:
    _require(path, arrays, ("words", "vectors"))
    return WordVectors([str(w) for w in arrays["words"]], arrays["vectors"])


def _check_token_lists(token_lists) -> list[list[str]]:
    if isinstance(token_lists, (str, bytes)):
        raise ConfigError("text encoders take a list of token lists, not a string")
    result = []
    for i, tokens in enumerate(token_lists):
        if isinstance(tokens, (str, bytes)):
            raise ConfigError(f"sentence {i} is a string; text encoders take token lists (tokenize first)")
        result.append(list(tokens))
    return result


class TextEncoder:
    """Base class: a sentence encoder with fit/transform and npz persistence."""

    name: str = ""

    def fit(self, token_lists: TokenLists) -> "TextEncoder":
        raise NotImplementedError

    def transform(self, token_lists: TokenLists) -> np.ndarray:
        raise NotImplementedError

    def fit_transform(self, token_lists: TokenLists) -> np.ndarray:
        """`fit` then `transform` on the same sentences."""
        return self.fit(token_lists).transform(token_lists)

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def output_dim(self) -> int:
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> None:
        raise NotImplementedError

    def check_fitted(self, fitted: bool) -> None:
        """ConfigError unless `fitted` (the in-graph layers check the encoder they convert too)."""
        if not fitted:
            raise ConfigError(f"{type(self).__name__} is not fitted yet; call fit(token_lists) first")


# --------------------------------------------------------------------------
# Mean word vector


class MeanWordVectorEncoder(TextEncoder):
    """Mean of the sentence's word vectors (zeros when no word is known)."""

    name = "mean_vector"

    def __init__(self, word_vectors: WordVectors):
        if not isinstance(word_vectors, WordVectors):
            raise ConfigError("MeanWordVectorEncoder needs a WordVectors instance")
        self.word_vectors = word_vectors

    def fit(self, token_lists: TokenLists) -> "MeanWordVectorEncoder":
        """Nothing to learn; returns self (kept for a uniform interface)."""
        return self

    @property
    def output_dim(self) -> int:
        return self.word_vectors.dim

    def transform(self, token_lists: TokenLists) -> np.ndarray:
        """(num_sentences, D) float32 means of the known words' vectors."""
        token_lists = _check_token_lists(token_lists)
        out = np.zeros((len(token_lists), self.output_dim), dtype=np.float32)
        for i, tokens in enumerate(token_lists):
            vectors = self.word_vectors.lookup(tokens)
            if len(vectors):
                out[i] = vectors.mean(axis=0)
        return out

    def get_config(self) -> dict[str, Any]:
        return {"encoder": self.name, "dim": self.output_dim, "num_words": len(self.word_vectors)}

    def save(self, path: str | os.PathLike) -> None:
        """Writes the encoder (with its word vectors) to one .npz file."""
        _save_npz(path, self.get_config(), _word_vector_arrays(self.word_vectors))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "MeanWordVectorEncoder":
        config, arrays = _load_npz(path)
        _check_kind(path, config, cls.name)
        return cls(_word_vectors_from(path, arrays))


# --------------------------------------------------------------------------
# tf-idf


class TfidfEncoder(TextEncoder):
    """tf-idf bag of words over the `max_features` most frequent training words.

    Input is already tokenised (lower-cased by `tokenize_caption`); English
    stop words (scikit-learn's list) are removed. Deviation from Wang et al.
    2016: they lemmatise with WordNet first; WordNet is not available
    offline here, so plural and singular forms stay separate words.

    Args:
      max_features: dictionary size (3000 for Flickr30K, 5600 for MSCOCO in the paper).
      stop_words: "english", None, or an explicit list of words to drop.
      sublinear_tf: use 1 + log(tf) instead of raw counts.
    """

    name = "tfidf"

    def __init__(self, max_features: int = 3000, stop_words: str | Sequence[str] | None = "english",
                 sublinear_tf: bool = False):
        if max_features is not None and int(max_features) <= 0:
            raise ConfigError(f"max_features must be positive, got {max_features}")
        if isinstance(stop_words, str) and stop_words != "english":
            raise ConfigError(f"stop_words must be 'english', None or a list of words, got {stop_words!r}")
        self.max_features = None if max_features is None else int(max_features)
        self.stop_words = stop_words
        self.sublinear_tf = bool(sublinear_tf)
        self._vectorizer = None

    def stop_word_set(self) -> frozenset[str]:
        """The stop words dropped before counting (also used by the in-graph layer)."""
        if self.stop_words is None:
            return frozenset()
        if isinstance(self.stop_words, str):
            return frozenset(ENGLISH_STOP_WORDS)
        return frozenset(self.stop_words)

    def _make_vectorizer(self, vocabulary=None):
        stop = self.stop_word_set()

        def analyzer(tokens):
            # sklearn ignores stop_words when the analyzer is a callable.
            return [t for t in tokens if t not in stop]

        return TfidfVectorizer(analyzer=analyzer, max_features=self.max_features, vocabulary=vocabulary,
                               sublinear_tf=self.sublinear_tf, dtype=np.float32)

    def fit(self, token_lists: TokenLists) -> "TfidfEncoder":
        """Chooses the dictionary and idf weights from training sentences."""
        token_lists = _check_token_lists(token_lists)
        vectorizer = self._make_vectorizer()
        try:
            vectorizer.fit(token_lists)
        except ValueError as err:  # e.g. only stop words
            raise ConfigError(f"cannot fit tf-idf: {err}") from None
        self._vectorizer = vectorizer
        return self

    @property
    def vocabulary(self) -> list[str]:
        """Dictionary words in feature order."""
        self.check_fitted(self._vectorizer is not None)
        return list(self._vectorizer.get_feature_names_out())

    @property
    def output_dim(self) -> int:
        self.check_fitted(self._vectorizer is not None)
        return len(self._vectorizer.vocabulary_)

    def transform(self, token_lists: TokenLists) -> np.ndarray:
        """(num_sentences, dictionary size) float32, L2-normalised rows."""
        self.check_fitted(self._vectorizer is not None)
        token_lists = _check_token_lists(token_lists)
        return self._vectorizer.transform(token_lists).toarray().astype(np.float32, copy=False)

    def get_config(self) -> dict[str, Any]:
        stop = self.stop_words if self.stop_words is None or isinstance(self.stop_words, str) else list(self.stop_words)
        config = {"encoder": self.name, "max_features": self.max_features, "stop_words": stop,
                  "sublinear_tf": self.sublinear_tf}
        if self._vectorizer is not None:
            config["dim"] = self.output_dim
        return config

    def save(self, path: str | os.PathLike) -> None:
        """Writes the dictionary and idf weights to one .npz file."""
        self.check_fitted(self._vectorizer is not None)
        _save_npz(path, self.get_config(),
                  {"vocabulary": np.array(self.vocabulary, dtype=str), "idf": self._vectorizer.idf_})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TfidfEncoder":
        config, arrays = _load_npz(path)
        _check_kind(path, config, cls.name)
        _require(path, arrays, ("vocabulary", "idf"))
        encoder = cls(max_features=config.get("max_features"), stop_words=config.get("stop_words"),
                      sublinear_tf=config.get("sublinear_tf", False))
        words = [str(w) for w in arrays["vocabulary"]]
        if len(words) != len(arrays["idf"]):
            raise DataFormatError(path, f"{len(words)} dictionary words but {len(arrays['idf'])} idf weights",
                                  record="idf")
        vectorizer = encoder._make_vectorizer(vocabulary={w: i for i, w in enumerate(words)})
        # As stored (float32 from fit): a reloaded encoder gives the fitted one's features bit for bit.
        vectorizer.idf_ = np.asarray(arrays["idf"])
        encoder._vectorizer = vectorizer
        return encoder


# --------------------------------------------------------------------------
# Mixtures for Fisher vectors


def _floor_scale(scales: np.ndarray, floor: float) -> np.ndarray:
    return np.maximum(scales, floor)


def laplacian_log_joint(x: np.ndarray, weights: np.ndarray, means: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """log(w_k) + log Laplace(x | mu_k, b_k) for every point and component, shape (N, K).

    The Laplacian components are diagonal: a product over dimensions of
    exp(-|x_d - mu_kd| / b_kd) / (2 b_kd).
    """
    n, k = len(x), len(weights)
    out = np.empty((n, k), dtype=np.float64)
    log_norm = np.log(weights) - np.log(2.0 * scales).sum(axis=1)
    inv_scales = (1.0 / scales).astype(np.float32)
    x32 = np.asarray(x, dtype=np.float32)
    means32 = np.asarray(means, dtype=np.float32)
    buffer = np.empty_like(x32)
    for j in range(k):  # loop over components keeps memory at O(N*D); float32 for speed
        np.subtract(x32, means32[j], out=buffer)
        np.abs(buffer, out=buffer)
        out[:, j] = log_norm[j] - buffer @ inv_scales[j]
    return out


def gaussian_log_joint(x: np.ndarray, weights: np.ndarray, means: np.ndarray, variances: np.ndarray) -> np.ndarray:
    """log(w_k) + log N(x | mu_k, diag(var_k)) for every point and component, shape (N, K)."""
    precisions = 1.0 / variances
    log_norm = np.log(weights) - 0.5 * (np.log(2.0 * np.pi * variances).sum(axis=1))
    # (x - mu)^2 / var summed over d, expanded into matrix products.
    quad = (x**2) @ precisions.T - 2.0 * x @ (means * precisions).T + (means**2 * precisions).sum(axis=1)
    return log_norm - 0.5 * quad


def _posteriors(log_joint: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    top = log_joint.max(axis=1, keepdims=True)
    shifted = np.exp(log_joint - top)
    total = shifted.sum(axis=1, keepdims=True)
    return shifted / total, (np.log(total) + top).ravel()


def fit_hglmm(
    x: np.ndarray,
    num_components: int,
    *,
    max_iter: int = 30,
    tol: float = 1e-4,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[float]]:
    """Fits a hybrid Gaussian-Laplacian mixture model (Klein et al., CVPR 2015) by EM.

    Components are diagonal Laplacians with a per-dimension scale b. Klein et
    al.'s hybrid keeps the Laplacian likelihood in the E-step but replaces the
    Laplacian M-step for the means (a weighted median per component and
    dimension, which is expensive) by the Gaussian one (the weighted mean).
    Given the means, the scale update is the Laplacian maximum-likelihood one,
    b = sum_i g_ik |x_i - mu_k| / sum_i g_ik. [inferred: the exact update of
    b in Klein et al.'s code is not in the supplied papers.] Initialised from
    k-means.

    Args:
      x: (N, D) data.
      num_components: K.
      max_iter: cap on EM iterations.
      tol: stop when the mean log-likelihood improves by less than this.
      seed: seed of the k-means initialisation.
    Returns:
      weights (K,), means (K, D), scales b (K, D), and the mean log-likelihood
      after each iteration.
    """
    x = np.asarray(x, dtype=np.float64)
    n, d = x.shape
    if n < num_components:
        raise ConfigError(f"cannot fit {num_components} mixture components on {n} points")
    scale_floor = 1e-6 * float(np.mean(np.abs(x - x.mean(axis=0)))) + 1e-12
    labels = KMeans(n_clusters=num_components, n_init=1, max_iter=50, random_state=seed).fit_predict(x)
    resp = np.zeros((n, num_components))
    resp[np.arange(n), labels] = 1.0
    x32 = x.astype(np.float32)
    buffer = np.empty_like(x32)
    history: list[float] = []
    weights = means = scales = None
    for iteration in range(max_iter + 1):
        # M-step (the first one turns the k-means partition into parameters).
        mass = resp.sum(axis=0) + 1e-10
        weights = mass / n
        means = (resp.T @ x) / mass[:, None]
        scales = np.empty_like(means)
        for j in range(num_components):
            np.subtract(x32, means[j].astype(np.float32), out=buffer)
            np.abs(buffer, out=buffer)
            scales[j] = resp[:, j].astype(np.float32) @ buffer / mass[j]
        scales = _floor_scale(scales, scale_floor)
        weights = np.maximum(weights, 1e-10)
        weights /= weights.sum()
        # E-step.
        resp, log_likelihood = _posteriors(laplacian_log_joint(x, weights, means, scales))
        history.append(float(log_likelihood.mean()))
        if iteration > 0 and abs(history[-1] - history[-2]) < tol * max(1.0, abs(history[-2])):
            break
    return weights, means, scales, history


def fit_gmm(x: np.ndarray, num_components: int, *, max_iter: int = 100, seed: int = 0):
    """Diagonal GMM via sklearn; returns weights (K,), means (K, D), variances (K, D)."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) < num_components:
        raise ConfigError(f"cannot fit {num_components} mixture components on {len(x)} points")
    reg = 1e-3 * float(x.var(axis=0).mean()) + 1e-10  # relative, since vector scales vary
    gmm = GaussianMixture(n_components=num_components, covariance_type="diag", max_iter=max_iter,
                          reg_covar=reg, random_state=seed, init_params="kmeans")
    gmm.fit(x)
    return gmm.weights_, gmm.means_, gmm.covariances_


# --------------------------------------------------------------------------
# Fisher vectors


def fisher_vectors(
    word_vectors: np.ndarray,
    sentence_index: np.ndarray,
    num_sentences: int,
    mixture: str,
    weights: np.ndarray,
    means: np.ndarray,
    scales: np.ndarray,
    *,
    normalize: bool = True,
) -> np.ndarray:
    """Fisher vectors of sets of vectors, one set per sentence.

    For component k with posterior g_ik of word i in a sentence of N words:

    * Gaussian (scales = variances s^2), Perronnin et al. 2010:
      G_mu = sum_i g_ik (x_i - mu_k) / s_k / (N sqrt(w_k)),
      G_s  = sum_i g_ik ((x_i - mu_k)^2 / s_k^2 - 1) / (N sqrt(2 w_k)).
    * Laplacian (scales = b), Klein et al. 2015:
      G_mu = sum_i g_ik sign(x_i - mu_k) / (N sqrt(w_k)),
      G_b  = sum_i g_ik (|x_i - mu_k| / b_k - 1) / (N sqrt(w_k)),
      i.e. the log-likelihood gradients scaled by the inverse square root of
      the diagonal Fisher information (b^2 for both).

    Layout: [G_mu (K x D, component-major), G_scale (K x D)], 2*K*D values.
    With `normalize`, the power (signed square root) and L2 normalisations
    of the improved FV are applied. Sentences without words give zeros.

    Args:
      word_vectors: (M, D) vectors of all words of all sentences.
      sentence_index: (M,) sentence of each word, in [0, num_sentences).
      num_sentences: number of output rows.
      mixture: "gmm" or "hglmm".
    Returns:
      (num_sentences, 2*K*D) float32.
    """
    x = np.asarray(word_vectors, dtype=np.float64)
    k, d = means.shape
    out = np.zeros((num_sentences, 2, k, d), dtype=np.float64)
    if len(x) == 0:
        return out.reshape(num_sentences, -1).astype(np.float32)
    sentence_index = np.asarray(sentence_index, dtype=np.int64)
    words_per_sentence = np.bincount(sentence_index, minlength=num_sentences).astype(np.float64)
    if mixture == "gmm":
        resp, _ = _posteriors(gaussian_log_joint(x, weights, means, scales))
    elif mixture == "hglmm":
        resp, _ = _posteriors(laplacian_log_joint(x, weights, means, scales))
    else:
        raise ConfigError(f"unknown mixture {mixture!r}; expected 'gmm' or 'hglmm'")
    m = len(x)
    if mixture == "gmm":
        # Zeroth/first/second-order statistics per (sentence, component) from
        # one sparse (S*K x M) pooling product, then the closed forms.
        rows = (sentence_index[:, None] * k + np.arange(k)[None, :]).ravel()
        cols = np.repeat(np.arange(m), k)
        pooling = sp.csr_matrix((resp.ravel(), (rows, cols)), shape=(num_sentences * k, m))
        s0 = np.asarray(pooling.sum(axis=1)).reshape(num_sentences, k, 1)
        s1 = (pooling @ x).reshape(num_sentences, k, d)
        s2 = (pooling @ (x * x)).reshape(num_sentences, k, d)
        sigma = np.sqrt(scales)[None]
        mu = means[None]
        out[:, 0] = (s1 - mu * s0) / sigma / np.sqrt(weights)[None, :, None]
        second = (s2 - 2.0 * mu * s1 + mu * mu * s0) / scales[None] - s0
        out[:, 1] = second / np.sqrt(2.0 * weights)[None, :, None]
    else:
        x32 = x.astype(np.float32)
        diff = np.empty_like(x32)
        work = np.empty_like(x32)
        for j in range(k):
            # Per-sentence sums of g_ij * f(x_i) as one sparse (S x M) @ (M x D) product.
            pooling = sp.csr_matrix((resp[:, j].astype(np.float32), (sentence_index, np.arange(m))),
                                    shape=(num_sentences, m))
            np.subtract(x32, means[j].astype(np.float32), out=diff)
            np.sign(diff, out=work)
            out[:, 0, j] = pooling @ work / np.sqrt(weights[j])
            np.abs(diff, out=work)
            work *= (1.0 / scales[j]).astype(np.float32)
            work -= 1.0
            out[:, 1, j] = pooling @ work / np.sqrt(weights[j])
    out = out.reshape(num_sentences, -1)
    # In place from here on: a batch's float64 FVs (2000 x 18000 = 288 MB) are not copied four
    # times over (the same values as out = sign(out) * sqrt(|out|); out / norms).
    nonempty = words_per_sentence > 0
    np.divide(out, np.maximum(words_per_sentence, 1.0)[:, None], out=out, where=nonempty[:, None])
    if normalize:
        negative = np.signbit(out)
        np.abs(out, out=out)
        np.sqrt(out, out=out)
        np.negative(out, out=out, where=negative)
        del negative
        norms = np.empty((num_sentences, 1))
        for start in range(0, num_sentences, 256):   # np.linalg.norm's sum, without its full-size square
            block = out[start:start + 256]
            norms[start:start + 256, 0] = np.sqrt(np.add.reduce(block * block, axis=1))
        # A zero norm is an all-zero row: it stays zero.
        np.divide(out, norms, out=out, where=norms > 0)
    return out.astype(np.float32)


class FisherVectorEncoder(TextEncoder):
    """Fisher vector of the sentence's word vectors (Klein et al. 2015).

    Args:
      word_vectors: e.g. 300-d word2vec; unknown words are ignored.
      num_components: mixture size K (30 in the papers); output 2*K*D dims.
      mixture: "hglmm" (the papers' choice) or "gmm" (diagonal Gaussian).
      pca_dim: when set, PCA (fitted on training-sentence FVs) reduces the
        output to this size (the papers: 18000 -> 6000).
      seed: seed of every random choice (subsamples, k-means, PCA).
      max_fit_words: the mixture is fitted on the distinct training words
        that have vectors (each once: repeated stop words would otherwise
        become point-mass components), subsampled to at most this many.
      max_iter: EM iteration cap.
      ica: apply FastICA (as many components as dimensions) to the word
        vectors before the mixture, as Klein et al. and Wang et al. do; off by
        default because it is slow on 2 cores.
      pca_max_sentences: PCA is fitted on at most this many training
        sentences (18000-d FVs of 145K sentences would need 10 GB).
      batch_size: sentences encoded at a time (bounds peak memory).
    """

    name = "fisher"

    def __init__(self, word_vectors: WordVectors, num_components: int = 30, mixture: str = "hglmm",
                 pca_dim: int | None = None, seed: int = 0, *, max_fit_words: int = 100_000,
                 max_iter: int = 30, ica: bool = False, pca_max_sentences: int = 20_000,
                 batch_size: int = 2000):
        if not isinstance(word_vectors, WordVectors):
            raise ConfigError("FisherVectorEncoder needs a WordVectors instance")
        if mixture not in ("gmm", "hglmm"):
            raise ConfigError(f"unknown mixture {mixture!r}; expected 'gmm' or 'hglmm'")
        for label, value in (("num_components", num_components), ("max_fit_words", max_fit_words),
                             ("max_iter", max_iter), ("pca_max_sentences", pca_max_sentences),
                             ("batch_size", batch_size)):
            if int(value) <= 0:
                raise ConfigError(f"{label} must be positive, got {value}")
        if pca_dim is not None and int(pca_dim) <= 0:
            raise ConfigError(f"pca_dim must be positive or None, got {pca_dim}")
        self.word_vectors = word_vectors
        self.num_components = int(num_components)
        self.mixture = mixture
        self.pca_dim = None if pca_dim is None else int(pca_dim)
        self.seed = int(seed)
        self.max_fit_words = int(max_fit_words)
        self.max_iter = int(max_iter)
        self.ica = bool(ica)
        self.pca_max_sentences = int(pca_max_sentences)
        self.batch_size = int(batch_size)
        # Fitted state.
        self.weights_ = self.means_ = self.scales_ = None
        self.ica_mean_ = self.ica_unmixing_ = None
        self.pca_mean_ = self.pca_components_ = None
        self.log_likelihood_history_: list[float] = []

    @property
    def fv_dim(self) -> int:
        """2*K*D, the Fisher vector size before PCA."""
        return 2 * self.num_components * self.word_vectors.dim

    @property
    def output_dim(self) -> int:
        return self.pca_dim if self.pca_dim is not None else self.fv_dim

    def _project(self, x: np.ndarray) -> np.ndarray:
        if self.ica_unmixing_ is None:
            return x
        return (x - self.ica_mean_) @ self.ica_unmixing_.T

    def fit(self, token_lists: TokenLists) -> "FisherVectorEncoder":
        """Fits the mixture on training words, then (optionally) PCA on training FVs."""
        token_lists = _check_token_lists(token_lists)
        if self.pca_dim is not None:
            self._check_pca_dim(len(token_lists))
        rng = np.random.default_rng(self.seed)
        vocab = sorted({t for tokens in token_lists for t in tokens if t in self.word_vectors})
        if len(vocab) < self.num_components:
            raise ConfigError(
                f"only {len(vocab)} distinct training words have word vectors; "
                f"need at least num_components={self.num_components}"
            )
        if len(vocab) > self.max_fit_words:
            vocab = [vocab[i] for i in np.sort(rng.choice(len(vocab), self.max_fit_words, replace=False))]
        x = self.word_vectors.lookup(vocab).astype(np.float64)
        if self.ica:
            ica = FastICA(n_components=x.shape[1], whiten="unit-variance", random_state=self.seed, max_iter=200)
            ica.fit(x)
            self.ica_mean_, self.ica_unmixing_ = ica.mean_, ica.components_
            x = self._project(x)
        logger.info("Fitting a %d-component %s on %d words of dimension %d", self.num_components,
                    self.mixture, len(x), x.shape[1])
        if self.mixture == "hglmm":
            self.weights_, self.means_, self.scales_, self.log_likelihood_history_ = fit_hglmm(
                x, self.num_components, max_iter=self.max_iter, seed=self.seed)
        else:
            self.weights_, self.means_, self.scales_ = fit_gmm(x, self.num_components,
                                                              max_iter=max(self.max_iter, 100), seed=self.seed)
        self.pca_mean_ = self.pca_components_ = None
        if self.pca_dim is not None:
            self._fit_pca(token_lists, rng)
        return self

    def _check_pca_dim(self, num_sentences: int) -> None:
        """Refuses, before the slow fits, a PCA size that its training rows cannot give.

        The experiments take pca_dim from the flag --pca_dim; pca_max_sentences is
        no flag, so the message asks only for a smaller --pca_dim where it can.
        """
        if self.pca_dim > self.fv_dim:
            raise ConfigError(
                f"--pca_dim={self.pca_dim} is larger than the Fisher vector dimension {self.fv_dim} "
                f"(2 x {self.num_components} components x {self.word_vectors.dim}-d word vectors); "
                f"lower --pca_dim to at most {self.fv_dim}"
            )
        fitted_on = min(num_sentences, self.pca_max_sentences)
        if self.pca_dim > fitted_on:
            sample = ("" if num_sentences <= self.pca_max_sentences else
                      f" (a sample of {fitted_on} of the {num_sentences}: the encoder's pca_max_sentences)")
            raise ConfigError(
                f"--pca_dim={self.pca_dim} is larger than the {fitted_on} training sentences the PCA of "
                f"the Fisher vectors is fitted on{sample}; a PCA gives at most as many dimensions as "
                f"it has sentences: lower --pca_dim to at most {fitted_on} (the papers' 6000 needs "
                "at least 6000 training captions)"
            )

    def _fit_pca(self, token_lists: list[list[str]], rng: np.random.Generator) -> None:
        if len(token_lists) > self.pca_max_sentences:
            chosen = np.sort(rng.choice(len(token_lists), self.pca_max_sentences, replace=False))
            token_lists = [token_lists[i] for i in chosen]
        max_dim = min(len(token_lists), self.fv_dim)
        fvs = self._fisher_batches(token_lists)
        solver = "randomized" if self.pca_dim < 0.8 * max_dim else "full"
        # copy=False: the sample is centred in place (the same values as a centred copy), so the
        # fit holds one (pca_max_sentences x fv_dim) matrix, not two (2 x 1.44 GB at 20,000 x 18000).
        pca = PCA(n_components=self.pca_dim, svd_solver=solver, random_state=self.seed, copy=False)
        pca.fit(fvs)
        del fvs
        self.pca_mean_ = pca.mean_.astype(np.float32)
        self.pca_components_ = pca.components_.astype(np.float32)
        logger.info("PCA %d -> %d keeps %.1f%% of the variance", self.fv_dim, self.pca_dim,
                    100.0 * float(pca.explained_variance_ratio_.sum()))

    def _fisher_batch(self, token_lists: list[list[str]]) -> np.ndarray:
        rows, sentence_index = [], []
        for i, tokens in enumerate(token_lists):
            for t in tokens:
                row = self.word_vectors.index.get(t)
                if row is not None:
                    rows.append(row)
                    sentence_index.append(i)
        x = self._project(self.word_vectors.vectors[np.asarray(rows, dtype=np.int64)].astype(np.float64))
        return fisher_vectors(x, np.asarray(sentence_index, dtype=np.int64), len(token_lists), self.mixture,
                              self.weights_, self.means_, self.scales_)

    def _fisher_batches(self, token_lists: list[list[str]]) -> np.ndarray:
        out = np.empty((len(token_lists), self.fv_dim), dtype=np.float32)
        for start in range(0, len(token_lists), self.batch_size):
            out[start : start + self.batch_size] = self._fisher_batch(token_lists[start : start + self.batch_size])
        return out

    def transform(self, token_lists: TokenLists) -> np.ndarray:
        """(num_sentences, output_dim) float32 normalised FVs (PCA-projected if pca_dim)."""
        self.check_fitted(self.weights_ is not None)
        token_lists = _check_token_lists(token_lists)
        out = np.empty((len(token_lists), self.output_dim), dtype=np.float32)
        for start in range(0, len(token_lists), self.batch_size):
            fvs = self._fisher_batch(token_lists[start : start + self.batch_size])
            if self.pca_components_ is not None:
                fvs = (fvs - self.pca_mean_) @ self.pca_components_.T
            out[start : start + self.batch_size] = fvs
        return out

    def get_config(self) -> dict[str, Any]:
        return {"encoder": f"fisher_{self.mixture}", "num_components": self.num_components,
                "mixture": self.mixture, "pca_dim": self.pca_dim, "seed": self.seed,
                "max_fit_words": self.max_fit_words, "max_iter": self.max_iter, "ica": self.ica,
                "pca_max_sentences": self.pca_max_sentences, "batch_size": self.batch_size,
                "word_dim": self.word_vectors.dim, "dim": self.output_dim}

    def save(self, path: str | os.PathLike) -> None:
        """Writes mixture, ICA/PCA projections and word vectors to one .npz file."""
        self.check_fitted(self.weights_ is not None)
        arrays = {**_word_vector_arrays(self.word_vectors), "weights": self.weights_, "means": self.means_,
                  "scales": self.scales_}
        if self.ica_unmixing_ is not None:
            arrays.update(ica_mean=self.ica_mean_, ica_unmixing=self.ica_unmixing_)
        if self.pca_components_ is not None:
            arrays.update(pca_mean=self.pca_mean_, pca_components=self.pca_components_)
        _save_npz(path, self.get_config(), arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FisherVectorEncoder":
        config, arrays = _load_npz(path)
        if config.get("encoder") not in ("fisher_gmm", "fisher_hglmm"):
            raise DataFormatError(path, f"holds a {config.get('encoder')!r} encoder, not a Fisher vector encoder")
        _require(path, arrays, ("weights", "means", "scales"))
        keys = ("num_components", "mixture", "pca_dim", "seed", "max_fit_words", "max_iter", "ica",
                "pca_max_sentences", "batch_size")
        encoder = cls(_word_vectors_from(path, arrays), **{k: config[k] for k in keys if k in config})
        encoder.weights_, encoder.means_, encoder.scales_ = arrays["weights"], arrays["means"], arrays["scales"]
        if encoder.means_.shape != (encoder.num_components, encoder.word_vectors.dim):
            raise DataFormatError(path, f"mixture means have shape {encoder.means_.shape}, expected "
                                  f"({encoder.num_components}, {encoder.word_vectors.dim})", record="means")
        if "ica_unmixing" in arrays:
            encoder.ica_mean_, encoder.ica_unmixing_ = arrays["ica_mean"], arrays["ica_unmixing"]
        if encoder.pca_dim is not None:
            _require(path, arrays, ("pca_mean", "pca_components"))
            encoder.pca_mean_, encoder.pca_components_ = arrays["pca_mean"], arrays["pca_components"]
        return encoder


# --------------------------------------------------------------------------
# Registry


def _check_kind(path, config: dict, expected: str) -> None:
    if config.get("encoder") != expected:
        raise DataFormatError(path, f"holds a {config.get('encoder')!r} encoder, expected {expected!r}",
                              record="config_json")


TEXT_ENCODERS = ("fisher_hglmm", "fisher_gmm", "mean_vector", "tfidf")
_NEEDS_WORD_VECTORS = ("fisher_hglmm", "fisher_gmm", "mean_vector")


def encoder_needs_word_vectors(name: str) -> bool:
    """True when `build_text_encoder(name, ...)` requires `word_vectors`."""
    if name not in TEXT_ENCODERS:
        raise ConfigError(f"unknown text encoder {name!r}; choose one of {', '.join(TEXT_ENCODERS)}")
    return name in _NEEDS_WORD_VECTORS


def build_text_encoder(name: str, **kwargs) -> TextEncoder:
    """Creates an unfitted encoder by name.

    Names: "fisher_hglmm", "fisher_gmm" (FisherVectorEncoder; needs
    word_vectors=), "mean_vector" (MeanWordVectorEncoder; needs
    word_vectors=), "tfidf" (TfidfEncoder). Other keyword arguments go to
    the encoder's constructor.
    """
    if encoder_needs_word_vectors(name) and kwargs.get("word_vectors") is None:
        raise ConfigError(f"text encoder {name!r} needs word_vectors")
    try:
        if name == "tfidf":
            kwargs.pop("word_vectors", None)
            return TfidfEncoder(**kwargs)
        if name == "mean_vector":
            return MeanWordVectorEncoder(kwargs.pop("word_vectors"), **kwargs)
        return FisherVectorEncoder(mixture=name.split("_", 1)[1], **kwargs)
    except TypeError as err:
        raise ConfigError(f"bad arguments for text encoder {name!r}: {err}") from None


def load_text_encoder(path: str | os.PathLike) -> TextEncoder:
    """Loads any encoder written by an encoder's `save`."""
    config, _ = _load_npz(path)
    kind = config.get("encoder")
    if kind == "tfidf":
        return TfidfEncoder.load(path)
    if kind == "mean_vector":
        return MeanWordVectorEncoder.load(path)
    if kind in ("fisher_gmm", "fisher_hglmm"):
        return FisherVectorEncoder.load(path)
    raise DataFormatError(path, f"unknown encoder kind {kind!r} in config_json", record="config_json")


# --------------------------------------------------------------------------
# Fitted encoders cached by what they were fitted on

# Bump when a change of fitting code changes what a fit gives: older cached
# encoders then stop matching.
FIT_RECIPE = 1


def file_identity(path: str | os.PathLike) -> list:
    """(absolute path, size, modification time) of a file: cheap, and changes when it is replaced."""
    stat = os.stat(path)
    return [os.path.abspath(path), stat.st_size, stat.st_mtime_ns]


def text_encoder_fingerprint(name: str, train_token_lists: TokenLists, settings: dict, *,
                             word_vectors_file: str | os.PathLike | None = None) -> str:
    """A short hash of everything an encoder's fit depends on: its name and `settings`
    (JSON-able: components, PCA size, word dimension, seed...), the training sentences'
    tokens, and the identity of the word-vector file (`file_identity`) when one is read."""
    digest = hashlib.sha1()
    head = {"encoder": name, "settings": settings, "recipe": FIT_RECIPE,
            "word_vectors": file_identity(word_vectors_file) if word_vectors_file else None}
    digest.update(json.dumps(head, sort_keys=True).encode())
    for tokens in train_token_lists:
        digest.update("\x1f".join(tokens).encode())
        digest.update(b"\x1e")
    return digest.hexdigest()[:16]


def cached_text_encoder(cache_dir: str | os.PathLike, name: str, fingerprint: str,
                        fit: Callable[[], TextEncoder]) -> TextEncoder:
    """The encoder ``cache_dir/{name}_{fingerprint}.npz`` when it exists, else ``fit()`` saved there.

    Refitting Fisher vectors and PCA on a real-size training set takes minutes
    (130-170 s on Flickr30K captions); a run on the same captions, word vectors
    and settings (same `text_encoder_fingerprint`) loads the fitted one
    instead. A damaged cached file is refitted and replaced.
    """
    path = pathlib.Path(cache_dir) / f"{name}_{fingerprint}.npz"
    if path.is_file():
        try:
            encoder = load_text_encoder(path)
        except DataFormatError as err:
            logger.warning("refitting the text encoder: %s", err)
        else:
            logger.info("reusing the fitted text encoder %s (fingerprint %s) from %s", name,
                        fingerprint, path)
            return encoder
    encoder = fit()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(path)
    encoder.save(tmp)
    os.replace(tmp, path)  # a half-written file is never taken for a fitted encoder
    logger.info("fitted text encoder %s (fingerprint %s) saved to %s", name, fingerprint, path)
    return encoder
