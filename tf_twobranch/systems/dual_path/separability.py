"""Separability of positive and negative pairs (Zheng et al. eq. 10, Fig. 5).

P is the distribution of the cosine similarity of matching image–text pairs,
Q that of non-matching pairs; the indicator S = ∫₋₁¹ min(P(x), Q(x)) dx is
their overlap (0: perfectly separable, 1: identical).  Both are estimated as
normalised histograms on [-1, 1] over *every* pair of the similarity matrix
the retrieval core ranks.  The matrix is never held whole: caption blocks of
it are scored and binned one after another, so memory is bounded by a block
(~`block_elements` scores), not by images × captions — 5,000 images ×
25,000 captions need no more than the embeddings and one block.
"""
from __future__ import annotations

import dataclasses
import os

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from tf_twobranch.errors import UserInputError
from tf_twobranch.vectors import l2_normalize_rows

__all__ = ["PairHistograms", "pair_similarity_histograms", "separability_indicator",
           "plot_similarity_histograms", "DEFAULT_BINS"]

DEFAULT_BINS = 200
# 4M float32 scores (16 MB) and their int64 bin indices (32 MB) per block.
DEFAULT_BLOCK_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class PairHistograms:
    """Counts of positive and negative pair similarities in `bins` equal bins on [-1, 1]."""

    positive_counts: np.ndarray
    negative_counts: np.ndarray
    positive_sum: float
    negative_sum: float

    @property
    def bins(self) -> int:
        return len(self.positive_counts)

    @property
    def edges(self) -> np.ndarray:
        return np.linspace(-1.0, 1.0, self.bins + 1)

    @property
    def num_positives(self) -> int:
        return int(self.positive_counts.sum())

    @property
    def num_negatives(self) -> int:
        return int(self.negative_counts.sum())

    @property
    def mean_positive(self) -> float:
        return self.positive_sum / max(self.num_positives, 1)

    @property
    def mean_negative(self) -> float:
        return self.negative_sum / max(self.num_negatives, 1)

    def densities(self) -> tuple[np.ndarray, np.ndarray]:
        """P and Q as densities (each integrates to 1 over [-1, 1])."""
        width = 2.0 / self.bins
        return (self.positive_counts / (max(self.num_positives, 1) * width),
                self.negative_counts / (max(self.num_negatives, 1) * width))

    def separability(self) -> float:
        """S = ∫ min(P, Q) (eq. 10)."""
        if self.num_positives == 0 or self.num_negatives == 0:
            raise UserInputError("separability needs at least one positive and one negative pair")
        p, q = self.densities()
        return float(np.sum(np.minimum(p, q)) * (2.0 / self.bins))


def _bin_index(values: np.ndarray, bins: int) -> np.ndarray:
    """Bin of each value in `bins` equal bins on [-1, 1]; values outside are clipped in (1.0: last bin)."""
    index = np.floor((np.clip(values, -1.0, 1.0) + 1.0) * (bins / 2.0)).astype(np.int64)
    return np.minimum(index, bins - 1, out=index)


def _counts(values: np.ndarray, bins: int) -> np.ndarray:
    return np.bincount(_bin_index(np.ravel(values), bins), minlength=bins).astype(np.int64)


def pair_similarity_histograms(image_embeds, text_embeds, caption_image, *, bins: int = DEFAULT_BINS,
                               block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> PairHistograms:
    """Histograms of the cosine similarity of every positive and every negative pair.

    Positives: each caption with its own image; negatives: each caption with
    every other image (all of them, not a sample).  Scored in caption blocks of
    about `block_elements` similarities.
    """
    images = l2_normalize_rows(image_embeds, dtype=np.float32)
    texts = l2_normalize_rows(text_embeds, dtype=np.float32)
    caption_image = np.asarray(caption_image, np.int64)
    if images.ndim != 2 or texts.ndim != 2 or images.shape[1] != texts.shape[1]:
        raise UserInputError(f"separability needs (images, D) and (captions, D) embeddings, got "
                             f"{images.shape} and {texts.shape}")
    if caption_image.shape != (len(texts),):
        raise UserInputError(f"caption_image needs one image per caption ({len(texts)}), "
                             f"got shape {caption_image.shape}")
    if caption_image.size and (caption_image.min() < 0 or caption_image.max() >= len(images)):
        raise UserInputError("caption_image refers to images outside the gallery")
    positive_counts = np.zeros(bins, np.int64)
    all_counts = np.zeros(bins, np.int64)
    positive_sum = all_sum = 0.0
    step = max(1, block_elements // max(len(images), 1))
    for start in range(0, len(texts), step):
        stop = min(start + step, len(texts))
        block = texts[start:stop] @ images.T
        positives = block[np.arange(stop - start), caption_image[start:stop]]
        positive_counts += _counts(positives, bins)
        all_counts += _counts(block, bins)
        positive_sum += float(positives.sum(dtype=np.float64))
        all_sum += float(block.sum(dtype=np.float64))
    return PairHistograms(positive_counts, all_counts - positive_counts, positive_sum,
                          all_sum - positive_sum)


def separability_indicator(positives, negatives, bins: int = DEFAULT_BINS) -> float:
    """S = ∫ min(P, Q) over [-1, 1] from raw similarity values, P and Q as density histograms (eq. 10)."""
    positives, negatives = np.asarray(positives), np.asarray(negatives)
    return PairHistograms(_counts(positives, bins), _counts(negatives, bins),
                          float(positives.sum()), float(negatives.sum())).separability()


def plot_similarity_histograms(histograms: PairHistograms, path: str | os.PathLike, *,
                               title: str = "") -> float:
    """Writes the Fig. 5-style histogram of P and Q to a PNG; returns S."""
    matplotlib.use("Agg")  # PNG files only; pyplot resolves its backend at the first figure, not at import

    s = histograms.separability()
    p, q = histograms.densities()
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.stairs(q, histograms.edges, fill=True, alpha=0.55, color="tab:red",
              label=f"negative pairs Q (n={histograms.num_negatives:,})")
    ax.stairs(p, histograms.edges, fill=True, alpha=0.55, color="tab:green",
              label=f"positive pairs P (n={histograms.num_positives:,})")
    ax.set_xlim(-1, 1)
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("density")
    ax.set_title(f"{title}  S = {s:.4f}".strip())
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return s
