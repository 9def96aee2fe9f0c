"""N-pair and hardest-negative triplet losses (Das et al. eqs. 2–7) against loop transcriptions."""
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.support.keras_contract import assert_keras_loss_contract
from tf_twobranch.systems.npair import losses
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.systems.npair import losses as npair
from tf_twobranch.systems.npair import heat_map_volume as lv

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


def np_npair(image_rows, text_rows, positive, temperature):
    """Eqs. 5–6 per row, written out: −log(e^{S+/τ} / (e^{S+/τ} + Σ_impostors e^{S/τ})).

    In logs, shifted by the row's largest logit, so that scores of ±1e4 neither
    overflow nor underflow: −(S+/τ − c) + log(e^{S+/τ − c} + Σ e^{S/τ − c}).
    """
    values = []
    for j in range(len(image_rows)):
        total = 0.0
        for row in (image_rows[j], text_rows[j]):
            logits = [float(s) / temperature for s in row]
            shift = max(logits)
            positive_term = math.exp(logits[positive[j]] - shift)
            impostor_terms = sum(math.exp(x - shift) for i, x in enumerate(logits) if i != positive[j])
            total += -(logits[positive[j]] - shift) + math.log(positive_term + impostor_terms)
        values.append(total)
    return np.array(values)


def np_triplet(image_rows, text_rows, positive, margin):
    """Eqs. 2–3 per row with the hardest impostor: max(0, S_imp − S_pos + η), both anchors."""
    values = []
    for j in range(len(image_rows)):
        total = 0.0
        for row in (image_rows[j], text_rows[j]):
            impostors = [float(s) for i, s in enumerate(row) if i != positive[j]]
            if impostors:
                total += max(0.0, max(impostors) - float(row[positive[j]]) + margin)
        values.append(total)
    return np.array(values)


def square_case(seed, n=5, scale=3.0):
    scores = (scale * np.random.default_rng(seed).normal(size=(n, n))).astype(np.float32)
    return scores, scores.T, np.arange(n)


def local_rows_case(seed, local=3, replicas=3, offset=2):
    """The rows of replica `offset` of a global (N, N) matrix: (B_l, N) views, shifted positives."""
    global_scores, _, _ = square_case(seed, n=local * replicas)
    rows = slice(offset * local, (offset + 1) * local)
    return global_scores[rows], global_scores.T[rows], np.arange(local) + offset * local


@pytest.mark.parametrize("temperature", [1.0, 0.3, 4.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_npair_matches_loops(temperature, seed):
    scores, transposed, positive = square_case(seed)
    expected = np_npair(scores, transposed, positive, temperature)
    got = npair.npair_loss(scores, temperature=temperature, per_example=True).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(npair.npair_loss(scores, temperature=temperature)),
                               expected.mean(), rtol=1e-5, atol=1e-5)
    image_rows, text_rows, positive = local_rows_case(seed)
    got = npair.npair_loss(image_rows, text_rows, positive_index=positive, temperature=temperature,
                           per_example=True).numpy()
    np.testing.assert_allclose(got, np_npair(image_rows, text_rows, positive, temperature),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("margin", [0.0, 0.1, 2.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_triplet_matches_loops(margin, seed):
    scores, transposed, positive = square_case(seed, scale=0.5)
    expected = np_triplet(scores, transposed, positive, margin)
    got = npair.hardest_negative_triplet_loss(scores, margin=margin, per_example=True).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(npair.hardest_negative_triplet_loss(scores, margin=margin)),
                               expected.mean(), rtol=1e-5, atol=1e-5)
    image_rows, text_rows, positive = local_rows_case(seed)
    got = npair.hardest_negative_triplet_loss(image_rows, text_rows, positive_index=positive,
                                              margin=margin, per_example=True).numpy()
    np.testing.assert_allclose(got, np_triplet(image_rows, text_rows, positive, margin),
                               rtol=1e-5, atol=1e-5)


def test_hand_made_values():
    # Two pairs: N = 2, where the N-pair loss is a softplus of the score gap.
    scores = np.array([[2.0, 1.0], [0.5, 3.0]], np.float32)
    rows = npair.npair_loss(scores, temperature=1.0, per_example=True).numpy()
    softplus = lambda x: math.log1p(math.exp(x))  # noqa: E731
    np.testing.assert_allclose(rows, [softplus(1.0 - 2.0) + softplus(0.5 - 2.0),
                                      softplus(0.5 - 3.0) + softplus(1.0 - 3.0)], rtol=1e-6)
    triplet = npair.hardest_negative_triplet_loss(scores, margin=1.2, per_example=True).numpy()
    np.testing.assert_allclose(triplet, [0.2 + 0.0, 0.0 + 0.0], atol=1e-6)
    # One column: no impostor, no triplet.
    assert float(npair.hardest_negative_triplet_loss(np.ones((1, 1), np.float32))) == 0.0


@pytest.mark.parametrize("magnitude", [1e4, -1e4])
def test_stable_at_large_scores(magnitude):
    scores = np.array([[magnitude, -magnitude, 0.0],
                       [magnitude, magnitude, -magnitude],
                       [0.0, -magnitude, magnitude]], np.float32)
    got = npair.npair_loss(scores, temperature=1.0, per_example=True).numpy()
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, np_npair(scores, scores.T, np.arange(3), 1.0), rtol=1e-5, atol=1e-3)
    triplet = npair.hardest_negative_triplet_loss(scores, per_example=True).numpy()
    np.testing.assert_allclose(triplet, np_triplet(scores, scores.T, np.arange(3), 0.1), rtol=1e-5)
    with tf.GradientTape() as tape:
        s = tf.constant(scores)
        tape.watch(s)
        loss = npair.npair_loss(s) + npair.hardest_negative_triplet_loss(s)
    assert np.all(np.isfinite(tape.gradient(loss, s).numpy()))


def test_batch_loss_without_strategy_is_the_loss_of_the_score_matrix():
    rng = np.random.default_rng(0)
    maps = rng.normal(size=(4, 2, 3, 3)).astype(np.float32)
    tokens = rng.normal(size=(4, 5, 3)).astype(np.float32)
    mask = np.arange(5)[None, :] < np.array([5, 2, 1, 4])[:, None]
    for aggregator in lv.AGGREGATORS:
        scores = lv.pairwise_localization_scores(maps, tokens, mask, aggregator=aggregator).numpy()
        got = npair.localization_batch_loss(maps, tokens, mask, aggregator=aggregator,
                                            temperature=0.7)
        np.testing.assert_allclose(float(got), np_npair(scores, scores.T, np.arange(4), 0.7).mean(),
                                   rtol=1e-5)
        got = npair.localization_batch_loss(maps, tokens, mask, loss="triplet", aggregator=aggregator,
                                            margin=0.4)
        np.testing.assert_allclose(float(got), np_triplet(scores, scores.T, np.arange(4), 0.4).mean(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls, options, reference", [
    (npair.NPairLoss, {"temperature": 0.5}, lambda s: np_npair(s, s.T, np.arange(len(s)), 0.5)),
    (npair.HardestNegativeTripletLoss, {"margin": 0.3},
     lambda s: np_triplet(s, s.T, np.arange(len(s)), 0.3)),
])
def test_keras_loss_contract(cls, options, reference, tmp_path):
    scores, _, positive = square_case(2, n=4, scale=0.3)
    per_example = reference(scores)
    assert np.all(per_example > 0)           # the contract's weighting must see every row
    assert_keras_loss_contract(cls(**options), positive.astype(np.float32), scores,
                               per_example.mean(), per_example, tmp_path)


def test_exports_and_bad_arguments():
    assert losses.NPairLoss is npair.NPairLoss and losses.npair_loss is npair.npair_loss
    with pytest.raises(UserInputError, match="square"):
        npair.npair_loss(np.zeros((2, 3), np.float32))
    with pytest.raises(UserInputError, match="one shape"):
        npair.npair_loss(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))
    with pytest.raises(UserInputError, match="positive_index"):
        npair.npair_loss(np.zeros((2, 2), np.float32), positive_index=[0, 1, 1])
    with pytest.raises(ConfigError, match="temperature"):
        npair.npair_loss(np.zeros((2, 2), np.float32), temperature=0.0)
    with pytest.raises(ConfigError, match="margin"):
        npair.HardestNegativeTripletLoss(margin=-1.0)
    with pytest.raises(ConfigError, match="loss"):
        npair.localization_batch_loss(np.zeros((2, 1, 1, 2)), np.zeros((2, 1, 2)),
                                      np.ones((2, 1), bool), loss="softmax")


def test_two_replicas_equal_one_device():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "support" / "npair_two_replicas.py")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["num_replicas_in_sync"] == 2
    for loss in ("npair", "triplet"):
        values = out[loss]
        np.testing.assert_allclose(values["distributed"], values["single"], rtol=1e-5, atol=1e-5)
        assert values["map_gradient_max"] > 1e-3, loss          # the gradients compared are not zero
        assert values["map_gradient_max_diff"] < 1e-5, (loss, values)
        assert values["token_gradient_max_diff"] < 1e-5, (loss, values)
