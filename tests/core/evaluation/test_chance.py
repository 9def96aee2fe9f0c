"""Chance levels as expected values: random ranking (analytic) and the grounding baselines."""
import numpy as np
import pytest

from tf_twobranch.evaluation import chance, retrieval
from tf_twobranch.evaluation.pointing_game import PointingQuery, random_points, evaluate_points


def test_random_ranking_expectation_of_the_embedded_test_split():
    # 1,000 images x 5 captions: t2i R@K = K / N; i2t R@K = 1 - C(4995, K) / C(5000, K).
    m = chance.expected_random_metrics(chance.even_caption_counts(1000, 5000))
    assert m["t2i_r1"] == pytest.approx(0.1) and m["t2i_r10"] == pytest.approx(1.0)
    assert m["i2t_r5"] == pytest.approx(100 * (1 - np.prod([(4995 - j) / (5000 - j) for j in range(5)])))
    assert round(m["i2t_r5"], 1) == 0.5 and round(m["i2t_r10"], 1) == 1.0   # not one draw's 0.2 / 0.7
    assert m["t2i_medr"] == 500


def test_expectation_agrees_with_the_mean_of_many_random_draws():
    counts = np.array([5, 5, 4, 6, 5, 5, 5, 3, 5, 7, 5, 5])
    caption_image = np.repeat(np.arange(len(counts)), counts)
    draws = [retrieval.random_baseline_metrics(len(counts), caption_image, seed=s) for s in range(400)]
    expected = chance.expected_random_metrics(counts)
    for key in ("i2t_r1", "i2t_r5", "t2i_r1", "t2i_r5", "rsum"):
        values = [d[key] for d in draws]
        assert abs(np.mean(values) - expected[key]) <= 4 * np.std(values) / np.sqrt(len(values)) + 1e-9, key
    assert abs(np.median([d["t2i_medr"] for d in draws]) - expected["t2i_medr"]) <= 1
    # Fold protocols average their folds; first_caption keeps one caption per image.
    folds = chance.expected_random_metrics(np.full(250, 5), "folds_100")
    assert folds["t2i_r1"] == pytest.approx(1.0)
    assert chance.expected_random_metrics(np.full(10, 5), "first_caption")["i2t_r1"] == pytest.approx(10.0)


def _query(boxes, image_id="a", size=(10, 20)):
    return PointingQuery(image_id=image_id, sentence_index=0, phrase_index=0, caption_words=["x"], word_span=(0, 1),
                         phrase="x", boxes=np.asarray(boxes, np.float32), image_width=size[0], image_height=size[1])


def test_grounding_baselines():
    # 3 x 4 and an overlapping 2 x 2 inside a 10 x 20 image: 12 pixels of 200.
    q = _query([[0, 0, 2, 3], [1, 1, 2, 2]])
    assert chance.random_point_accuracy([q]) == pytest.approx(6.0)
    many = [q] * 4000
    drawn = evaluate_points(many, random_points(many, seed=0))["accuracy"]
    assert abs(drawn - 6.0) < 1.5
    centre = _query([[3, 8, 5, 10]])                        # holds the centre pixel (4, 9)
    assert chance.centre_point_accuracy([q, centre]) == 50.0
    proposals = {"a": np.array([[0, 0, 2, 3], [5, 5, 9, 9], [0, 0, 2, 2], [0, 0, 9, 19]], np.float32)}
    assert chance.random_box_r1([q], proposals) == pytest.approx(50.0)     # 2 of 4 reach IoU 0.5
    assert chance.random_box_r1([q], proposals, max_proposals=2) == pytest.approx(50.0)
    assert chance.random_box_r1([q], proposals, max_proposals=1) == pytest.approx(100.0)
