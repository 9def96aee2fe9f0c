"""Separability of positive and negative pairs (Zheng et al. eq. 10, Fig. 5).

P is the distribution of the cosine similarity of matching image–text pairs,
Q that of non-matching pairs; the indicator S = ∫₋₁¹ min(P(x), Q(x)) dx is
their overlap (0: perfectly separable, 1: identical).  Both are estimated as
normalised histograms on [-1, 1] from one similarity matrix, the same one
the retrieval core ranks.
"""
from __future__ import annotations

import os

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from tf_twobranch.errors import UserInputError
from tf_twobranch.vectors import l2_normalize_rows

__all__ = ["pair_similarities", "separability_indicator", "plot_similarity_histograms"]

DEFAULT_BINS = 200


def pair_similarities(image_embeds, text_embeds, caption_image, *, max_negatives: int = 2_000_000,
                      seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Cosine similarities of positive pairs and of (a sample of) negative pairs.

    Positives: every caption with its own image.  Negatives: every other
    (caption, image) pair, or a uniform sample of `max_negatives` of them.
    """
    images, texts = l2_normalize_rows(image_embeds, dtype=np.float64), l2_normalize_rows(text_embeds, dtype=np.float64)
    caption_image = np.asarray(caption_image, np.int64)
    if caption_image.shape != (len(texts),):
        raise UserInputError(f"caption_image needs one image per caption ({len(texts)}), "
                             f"got shape {caption_image.shape}")
    if caption_image.size and (caption_image.min() < 0 or caption_image.max() >= len(images)):
        raise UserInputError("caption_image refers to images outside the gallery")
    positives = np.einsum("ij,ij->i", texts, images[caption_image])
    total_negatives = len(texts) * (len(images) - 1)
    if total_negatives <= max_negatives:
        sims = texts @ images.T
        mask = np.ones_like(sims, bool)
        mask[np.arange(len(texts)), caption_image] = False
        negatives = sims[mask]
    else:
        rng = np.random.default_rng(seed)
        rows = rng.integers(0, len(texts), max_negatives)
        shift = rng.integers(1, len(images), max_negatives)  # never the caption's own image
        cols = (caption_image[rows] + shift) % len(images)
        negatives = np.einsum("ij,ij->i", texts[rows], images[cols])
    return positives.astype(np.float32), negatives.astype(np.float32)


def separability_indicator(positives, negatives, bins: int = DEFAULT_BINS) -> float:
    """S = ∫ min(P, Q) over [-1, 1], P and Q as density histograms (eq. 10)."""
    positives, negatives = np.asarray(positives), np.asarray(negatives)
    if positives.size == 0 or negatives.size == 0:
        raise UserInputError("separability needs at least one positive and one negative pair")
    edges = np.linspace(-1.0, 1.0, bins + 1)
    p, _ = np.histogram(np.clip(positives, -1, 1), edges, density=True)
    q, _ = np.histogram(np.clip(negatives, -1, 1), edges, density=True)
    return float(np.sum(np.minimum(p, q) * np.diff(edges)))


def plot_similarity_histograms(positives, negatives, path: str | os.PathLike, *,
                               title: str = "", bins: int = DEFAULT_BINS) -> float:
    """Writes the Fig. 5-style histogram of P and Q to a PNG; returns S."""
    matplotlib.use("Agg")  # PNG files only; pyplot resolves its backend at the first figure, not at import

    s = separability_indicator(positives, negatives, bins)
    edges = np.linspace(-1.0, 1.0, bins + 1)
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.hist(np.clip(negatives, -1, 1), edges, density=True, alpha=0.55, color="tab:red",
            label=f"negative pairs Q (n={len(negatives)})")
    ax.hist(np.clip(positives, -1, 1), edges, density=True, alpha=0.55, color="tab:green",
            label=f"positive pairs P (n={len(positives)})")
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("density")
    ax.set_title(f"{title}  S = {s:.4f}".strip())
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return s
