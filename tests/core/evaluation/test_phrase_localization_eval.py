"""Phrase-localization R@K, upper bound and per-type breakdown."""
import time

import numpy as np
import pytest

from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import phrase_localization as ev
from tf_twobranch.vectors import l2_normalize_rows

# Hand-computed golden case: four phrases with different numbers of proposals.
SCORES = [
    [0.9, 0.8, 0.7, 0.1],            # best correct 0.8, one incorrect above -> rank 2
    [0.5, 0.4, 0.3],                 # nothing correct -> miss
    [0.1, 0.9, 0.3, 0.2, 0.95, 0.8],  # the only correct proposal is last of six -> rank 6
    [1.0, 0.2],                      # rank 1
]
IOUS = [
    [0.2, 0.6, 0.9, 0.0],
    [0.1, 0.2, 0.3],
    [0.5, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.7, 0.8],
]
TYPES = [["people"], ["people", "clothing"], ["animals"], ["clothing"]]


def padded(rows, fill):
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), fill, np.float64)
    valid = np.zeros(out.shape, bool)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
        valid[i, :len(r)] = True
    return out, valid


def test_golden_ranks_and_recall():
    np.testing.assert_array_equal(ev.phrase_localization_ranks(SCORES, IOUS), [2, 0, 6, 1])
    m = ev.phrase_localization_recall(SCORES, IOUS)
    assert m["r1"] == 25.0 and m["r5"] == 50.0 and m["r10"] == 75.0
    assert m["upper_bound"] == 75.0 and m["num_phrases"] == 4
    # padded matrix + mask: padding must never count (even with high fake scores/IoUs)
    scores, valid = padded(SCORES, 5.0)
    ious, _ = padded(IOUS, 0.9)
    assert ev.phrase_localization_recall(scores, ious, valid) == {k: v for k, v in m.items()}
    # IoU threshold is inclusive (0.5 counts as correct)
    np.testing.assert_array_equal(ev.phrase_localization_ranks(SCORES, IOUS, iou_threshold=0.51), [2, 0, 0, 1])


def test_per_type_breakdown():
    m = ev.phrase_localization_recall(SCORES, IOUS, phrase_types=TYPES)
    per_type = m["per_type"]
    assert set(per_type) == {"people", "clothing", "animals"}
    assert per_type["people"] == {"r1": 0.0, "r5": 50.0, "r10": 50.0, "upper_bound": 50.0, "num_phrases": 2}
    assert per_type["clothing"] == {"r1": 50.0, "r5": 50.0, "r10": 50.0, "upper_bound": 50.0, "num_phrases": 2}
    assert per_type["animals"] == {"r1": 0.0, "r5": 0.0, "r10": 100.0, "upper_bound": 100.0, "num_phrases": 1}
    with pytest.raises(UserInputError):
        ev.phrase_localization_recall(SCORES, IOUS, phrase_types=TYPES[:2])


def test_ties_count_against_the_phrase():
    ranks = ev.phrase_localization_ranks([[0.5, 0.5, 0.5]], [[0.0, 0.0, 0.6]])
    np.testing.assert_array_equal(ranks, [3])
    # Ties among correct proposals do not hurt; a tie with an incorrect one does.
    np.testing.assert_array_equal(
        ev.phrase_localization_ranks([[0.5, 0.5, 0.4], [0.9, 0.5, 0.5]],
                                     [[0.6, 0.7, 0.0], [0.0, 0.6, 0.0]]), [1, 3])


def test_equal_scores_localize_nothing():
    """A model that scores every proposal alike gets R@1 0, not the upper bound."""
    rng = np.random.default_rng(5)
    ious = rng.uniform(0, 1, size=(300, 50)) ** 2
    ious[:, 0] = 0.0                       # at least one wrong proposal per phrase
    valid = np.arange(50)[None, :] < rng.integers(10, 51, size=300)[:, None]
    m = ev.phrase_localization_recall(np.zeros((300, 50)), ious, valid)
    assert m["upper_bound"] > 50
    assert m["r1"] == 0.0 and m["r5"] == 0.0
    # Random scores: R@1 near the chance of picking a correct proposal.
    chance = np.mean([(ious[i, valid[i]] >= 0.5).mean() for i in range(300)]) * 100
    random = ev.phrase_localization_recall(rng.normal(size=(300, 50)), ious, valid)
    assert abs(random["r1"] - chance) < 8.0


def test_distance_cosine_and_logit_paths_agree():
    rng = np.random.default_rng(0)
    phrases = rng.normal(size=(50, 16))
    phrases /= np.linalg.norm(phrases, axis=1, keepdims=True)
    regions = rng.normal(size=(50, 30, 16))
    regions /= np.linalg.norm(regions, axis=2, keepdims=True)
    ious = rng.uniform(0, 1, size=(50, 30)) ** 3
    valid = np.arange(30)[None, :] < rng.integers(5, 31, size=50)[:, None]
    distance = np.linalg.norm(regions - phrases[:, None, :], axis=2)
    cosine = np.einsum("pd,pnd->pn", phrases, regions)
    logits = 3.0 * cosine - 1.0  # any increasing function of the score: same ranking
    by_distance = ev.phrase_localization_recall(-distance, ious, valid, ks=(1, 3, 10))
    assert ev.phrase_localization_recall(cosine, ious, valid, ks=(1, 3, 10)) == by_distance
    assert ev.phrase_localization_recall(logits, ious, valid, ks=(1, 3, 10)) == by_distance
    lists = [(-distance)[i, valid[i]] for i in range(50)]
    iou_lists = [ious[i, valid[i]] for i in range(50)]
    assert ev.phrase_localization_recall(lists, iou_lists, ks=(1, 3, 10)) == by_distance


def test_matches_a_sorting_reference():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, size=(40, 12)).astype(float)  # many ties
    ious = rng.uniform(0, 1, size=(40, 12))
    ranks = ev.phrase_localization_ranks(scores, ious)
    for i in range(40):
        correct = ious[i] >= 0.5
        if not correct.any():
            assert ranks[i] == 0
            continue
        # sort by descending score with incorrect proposals first among ties
        order = np.lexsort((correct, -scores[i]))
        assert ranks[i] == int(np.argmax(correct[order])) + 1


def test_input_errors():
    with pytest.raises(UserInputError):
        ev.phrase_localization_recall(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(UserInputError, match="NaN"):
        ev.phrase_localization_recall(np.array([[np.nan, 1.0]]), np.array([[1.0, 0.0]]))


def test_flickr30k_entities_scale_is_fast():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(14_500, 200)).astype(np.float32)
    ious = rng.uniform(0, 1, size=(14_500, 200)).astype(np.float32) ** 4
    valid = np.arange(200)[None, :] < rng.integers(150, 201, size=14_500)[:, None]
    types = [["people"] if i % 3 else ["people", "clothing"] for i in range(14_500)]
    start = time.perf_counter()
    metrics = ev.phrase_localization_recall(scores, ious, valid, phrase_types=types)
    elapsed = time.perf_counter() - start
    print(f"phrase localization evaluation, 14,500 phrases x 200 proposals: {elapsed:.3f} s")
    assert elapsed < 5.0
    assert 0 < metrics["r1"] <= metrics["r10"] <= metrics["upper_bound"] <= 100


def test_score_phrases_with_model_embedding_and_similarity():
    from tests.systems.two_branch.test_sampling_region_phrase import make_data
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model

    data = make_data(dim=6)
    table, valid = data.proposal_table()
    iou, _ = data.phrase_proposal_iou()
    for kind in ("embedding", "similarity"):
        model = build_model(TwoBranchConfig(kind=kind, image_dim=6, text_dim=4, image_hidden=(8,),
                                            text_hidden=(8,), embed_dim=5, similarity_head=(4,), dropout=0.0))
        scores, got_valid = ev.score_phrases_with_model(model, data, batch_size=4, pair_batch=10)
        np.testing.assert_array_equal(got_valid, valid)
        # An all-zero embedding (a region every ReLU of a random init switches off; the random
        # state, hence how often, depends on which tests ran before in the process) scores 0:
        # the package's one row normaliser keeps it zero instead of dividing by 0.
        region = l2_normalize_rows(model.embed_images(data.region_features))
        text = l2_normalize_rows(model.embed_texts(data.phrase_features))
        for p in range(data.num_phrases):
            cols = table[p, valid[p]]
            if kind == "embedding":
                expected = region[cols] @ text[data.phrase_feature_index[p]]
            else:
                joint = region[cols] * text[data.phrase_feature_index[p]]
                expected = model.similarity_head(joint, training=False).numpy()[:, 0]
            np.testing.assert_allclose(scores[p, valid[p]], expected, rtol=1e-4, atol=1e-5)
            assert np.all(np.isneginf(scores[p, ~valid[p]]))
        metrics = ev.evaluate_phrase_localization(model, data)
        assert metrics == ev.phrase_localization_recall(scores, iou, valid, phrase_types=data.phrase_types())
        assert metrics["upper_bound"] == 100.0
