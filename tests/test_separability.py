import numpy as np
import pytest

from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import separability


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


def test_pair_similarities_split_positives_and_negatives(tmp_path):
    images = np.eye(3)
    texts = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]], float)
    pos, neg = separability.pair_similarities(images, texts, [0, 1, 2, 1])
    np.testing.assert_allclose(pos, [1, 1, 1, 0])
    assert len(neg) == 4 * 2 and neg.max() == 1.0  # caption 3 matches image 0, a negative
    sampled_pos, sampled_neg = separability.pair_similarities(images, texts, [0, 1, 2, 1],
                                                              max_negatives=5)
    assert len(sampled_neg) == 5
    s = separability.plot_similarity_histograms(pos, neg, tmp_path / "h.png", title="t")
    assert (tmp_path / "h.png").stat().st_size > 1000 and 0 <= s <= 1
    with pytest.raises(UserInputError, match="one image per caption"):
        separability.pair_similarities(images, texts, [0, 1])
