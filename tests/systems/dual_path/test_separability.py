import numpy as np
import pytest

from tf_twobranch.errors import UserInputError
from tf_twobranch.systems.dual_path import separability


def test_identical_distributions_overlap_fully_and_disjoint_ones_not_at_all():
    rng = np.random.default_rng(0)
    x = rng.uniform(-0.5, 0.5, 200_000)
    assert separability.separability_indicator(x, x) == pytest.approx(1.0)
    assert separability.separability_indicator(np.full(10, 0.9), np.full(10, -0.9)) == 0.0


def test_half_overlapping_uniforms():
    # P = U(0, 1), Q = U(-0.5, 0.5): overlap on [0, 0.5] with density 1 -> S = 0.5.
    rng = np.random.default_rng(1)
    s = separability.separability_indicator(rng.uniform(0, 1, 400_000),
                                            rng.uniform(-0.5, 0.5, 400_000), bins=100)
    assert s == pytest.approx(0.5, abs=0.01)


def test_histograms_split_positives_and_negatives(tmp_path):
    images = np.eye(3)
    texts = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]], float)
    h = separability.pair_similarity_histograms(images, texts, [0, 1, 2, 1], bins=4)
    # Positives 1, 1, 1 and 0 (caption 3 is assigned image 1); caption 3 against image 0 is a negative of 1.
    np.testing.assert_array_equal(h.positive_counts, [0, 0, 1, 3])
    np.testing.assert_array_equal(h.negative_counts, [0, 0, 7, 1])
    assert h.mean_positive == pytest.approx(0.75) and h.mean_negative == pytest.approx(1 / 8)
    s = separability.plot_similarity_histograms(h, tmp_path / "h.png", title="t")
    assert (tmp_path / "h.png").stat().st_size > 1000 and s == pytest.approx(h.separability())
    with pytest.raises(UserInputError, match="one image per caption"):
        separability.pair_similarity_histograms(images, texts, [0, 1])


def test_blocked_histograms_equal_the_whole_matrix_over_every_pair():
    rng = np.random.default_rng(3)
    images, texts = rng.normal(size=(37, 8)), rng.normal(size=(181, 8))
    caption_image = rng.integers(0, 37, 181)
    whole = separability.pair_similarity_histograms(images, texts, caption_image, block_elements=10 ** 9)
    blocked = separability.pair_similarity_histograms(images, texts, caption_image, block_elements=50)
    np.testing.assert_array_equal(whole.positive_counts, blocked.positive_counts)
    np.testing.assert_array_equal(whole.negative_counts, blocked.negative_counts)
    assert whole.num_negatives == 181 * 36  # every negative pair, no sample
    # The dense reference: np.histogram of the full cosine matrix with its positives masked out.
    sims = (texts / np.linalg.norm(texts, axis=1, keepdims=True)) @ (
        images / np.linalg.norm(images, axis=1, keepdims=True)).T
    mask = np.ones_like(sims, bool)
    mask[np.arange(181), caption_image] = False
    p, edges = np.histogram(sims[~mask], np.linspace(-1, 1, 201), density=True)
    q, _ = np.histogram(sims[mask], edges, density=True)
    assert blocked.separability() == pytest.approx(float(np.sum(np.minimum(p, q)) * 0.01), abs=1e-6)
    assert blocked.mean_negative == pytest.approx(sims[mask].mean(), abs=1e-5)


def test_memory_is_bounded_by_a_block_not_by_the_pair_count():
    # 2,000 images x 20,000 captions = 40M pairs: the whole matrix in float32 is 160 MB, the
    # former 2M-pair sample gathered 2 x 2M x D float64 rows; a block is ~4M scores.
    import tracemalloc

    rng = np.random.default_rng(0)
    images = rng.normal(size=(2_000, 16)).astype(np.float32)
    texts = rng.normal(size=(20_000, 16)).astype(np.float32)
    caption_image = np.repeat(np.arange(2_000), 10)
    tracemalloc.start()
    h = separability.pair_similarity_histograms(images, texts, caption_image,
                                                block_elements=1 << 20)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert h.num_negatives == 20_000 * 1_999
    assert peak < 40e6, f"peak {peak / 1e6:.0f} MB grows with the pair count"
