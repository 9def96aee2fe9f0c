"""Loss tests: the original implementation's `embedding_loss` semantics, recomputed
independently in numpy following the reference's boolean_mask / reshape / tile steps."""
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch import losses


def _l2n(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _pdist_np(a, b):
    a2 = (a * a).sum(1)[:, None]
    b2 = (b * b).sum(1)[None, :]
    return np.sqrt(a2 - 2 * a @ b.T + b2 + 1e-4)


def _topk_mean(x, k):
    return np.sort(x, axis=1)[:, ::-1][:, :k].mean()


def reference_embedding_loss(im, sent, labels, margin, k, im_factor, sent_only_factor):
    """Step-by-step numpy transcription of the reference algorithm's semantics."""
    num_sent, num_img = labels.shape
    ratio = num_sent // num_img
    d = _pdist_np(sent, im)                                   # (num_sent, num_img)
    pos = d[labels].reshape(num_sent, 1)                      # row-major boolean mask
    neg = d[~labels].reshape(num_sent, -1)
    im_loss = _topk_mean(np.clip(margin + pos - neg, 0, 1e6), k)
    neg_t = d.T[~labels.T].reshape(num_img, -1)
    neg_t = np.tile(neg_t, (1, ratio)).reshape(num_sent, -1)
    sent_loss = _topk_mean(np.clip(margin + pos - neg_t, 0, 1e6), k)
    dss = _pdist_np(sent, sent)
    mask = np.tile(labels.T, (1, ratio)).reshape(num_sent, num_sent)
    pos_ss = dss[mask].reshape(-1, ratio).max(axis=1, keepdims=True)
    neg_ss = dss[~mask].reshape(num_sent, -1)
    sent_only = _topk_mean(np.clip(margin + pos_ss - neg_ss, 0, 1e6), k)
    return im_loss * im_factor + sent_loss + sent_only * sent_only_factor


@pytest.mark.parametrize("seed,num_img,ratio,k,margin,f1,f2", [
    (0, 20, 2, 10, 0.05, 1.5, 0.05),
    (1, 13, 5, 3, 0.2, 1.0, 0.0),
    (2, 30, 1, 10, 0.05, 0.0, 0.0),
    (3, 8, 3, 5, 0.5, 2.0, 0.2),
])
def test_embedding_loss_matches_reference(seed, num_img, ratio, k, margin, f1, f2):
    rng = np.random.default_rng(seed)
    im = _l2n(rng.normal(size=(num_img, 16))).astype(np.float32)
    sent = _l2n(rng.normal(size=(num_img * ratio, 16))).astype(np.float32)
    labels = np.repeat(np.eye(num_img, dtype=bool), ratio, axis=0)
    if ratio == 1:
        f2 = 0.0  # the reference's sentence-only term needs >= 1 non-self neighbour
    expected = reference_embedding_loss(im.astype(np.float64), sent.astype(np.float64),
                                        labels, margin, k, f1, f2)
    got = losses.embedding_loss(tf.constant(im), tf.constant(sent), tf.constant(labels),
                                margin=margin, num_neg_sample=k, im_loss_factor=f1,
                                sent_only_loss_factor=f2)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5, atol=1e-5)


def test_embedding_loss_defaults_are_reference_defaults():
    import inspect
    sig = inspect.signature(losses.embedding_loss)
    assert sig.parameters["margin"].default == 0.05
    assert sig.parameters["num_neg_sample"].default == 10
    assert sig.parameters["im_loss_factor"].default == 1.5
    assert sig.parameters["sent_only_loss_factor"].default == 0.05


def test_loss_is_zero_when_margin_satisfied():
    # Two orthogonal clusters: every positive distance ~0.1, negatives ~1.4.
    im = np.eye(4, dtype=np.float32)
    sent = np.repeat(im, 2, axis=0)
    labels = np.repeat(np.eye(4, dtype=bool), 2, axis=0)
    loss = losses.bidirectional_ranking_loss(im, sent, labels, margin=0.05, top_k=2)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)


def test_image_neighbour_term_uses_shared_texts():
    im = _l2n(np.random.default_rng(0).normal(size=(4, 8))).astype(np.float32)
    sent = im[[0, 1, 2, 3]]
    labels = np.eye(4, dtype=bool)
    labels[0, 1] = True  # text 0 describes images 0 and 1 -> they are neighbours
    only_nbr = losses.bidirectional_ranking_loss(
        im, sent, labels, margin=0.1, top_k=2, image_anchor_weight=0,
        text_anchor_weight=0, image_neighbour_weight=1.0, text_neighbour_weight=0)
    assert float(only_nbr) > 0.0


def test_gradients_are_finite_for_identical_embeddings():
    x = tf.Variable(np.tile(np.eye(1, 8, dtype=np.float32), (4, 1)))
    labels = np.repeat(np.eye(2, dtype=bool), 2, axis=0)
    with tf.GradientTape() as tape:
        loss = losses.embedding_loss(x[:2], x, labels, num_neg_sample=2)
    grad = tape.gradient(loss, x)
    assert np.all(np.isfinite(grad.numpy()))


def test_logistic_pair_loss_matches_formula():
    logits = np.array([2.0, -1.0, 0.5, -3.0], np.float32)
    labels = np.array([1, 0, 0, 1])
    z = np.where(labels > 0, 1.0, -1.0)
    expected = np.mean(np.log1p(np.exp(-z * logits)))
    assert float(losses.logistic_pair_loss(logits, labels)) == pytest.approx(expected, rel=1e-6)


def test_keras_loss_classes_serialize():
    import keras
    loss = losses.BidirectionalRankingLoss(margin=0.1, top_k=3, text_neighbour_weight=0.2)
    restored = keras.losses.deserialize(keras.losses.serialize(loss))
    assert restored.get_config() == loss.get_config()
    im = _l2n(np.random.default_rng(0).normal(size=(5, 8))).astype(np.float32)
    sent = _l2n(np.random.default_rng(1).normal(size=(10, 8))).astype(np.float32)
    labels = np.repeat(np.eye(5, dtype=bool), 2, axis=0)
    assert float(restored(labels, (im, sent))) == pytest.approx(float(loss(labels, (im, sent))))
    lp = keras.losses.deserialize(keras.losses.serialize(losses.LogisticPairLoss()))
    assert isinstance(lp, losses.LogisticPairLoss)
