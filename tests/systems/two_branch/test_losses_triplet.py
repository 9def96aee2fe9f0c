"""Phrase-localization loss (TPAMI eq. 6 on Algorithm 1 batches) against numpy references."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.losses import common
from tf_twobranch.systems.two_branch import losses, region_phrase_losses
from tests.systems.two_branch.test_sampling_region_phrase import random_data
from tf_twobranch.systems.two_branch import region_phrase_sampling as pl


def unit(rng, n, d):
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def np_dist(a, b):
    sq = (a * a).sum(1)[:, None] - 2 * a @ b.T + (b * b).sum(1)[None, :]
    return np.sqrt(np.maximum(sq + common.DISTANCE_EPSILON, 0))


def np_top_k_rows(positive, rows, mask, margin, k):
    if len(rows) == 0:
        return 0.0
    hinge = np.clip(margin + positive - rows, 0, None) * mask
    k = min(k, rows.shape[1])
    top = -np.sort(-hinge, axis=1)[:, :k]
    return top.mean()


def np_loss(region, phrase, pos, neg, ppn, rnb, pnb, margin, k, w1, w2, w3, w4):
    d = np_dist(phrase, region)
    pairs = np.argwhere(pos)
    pd = d[pairs[:, 0], pairs[:, 1]][:, None]
    total = 0.0
    total += w2 * np_top_k_rows(pd, d[pairs[:, 0]], neg[pairs[:, 0]], margin, k)
    total += w1 * np_top_k_rows(pd, d.T[pairs[:, 1]], ppn[pairs[:, 0]] & ~pos.T[pairs[:, 1]], margin, k)
    for w, emb, nbrs, anchors in ((w3, region, rnb, pos.any(0)), (w4, phrase, pnb, pos.any(1))):
        dd = np_dist(emb, emb)
        idx = np.flatnonzero(anchors)
        rows = dd[idx]
        positive = np.where(nbrs[idx], rows, 0).max(1, keepdims=True) if len(idx) else rows
        total += w * np_top_k_rows(positive, rows, ~nbrs[idx] & anchors[None, :], margin, k)
    return total


def test_top_k_cap_keeps_only_the_k_largest_violations():
    rng = np.random.default_rng(0)
    phrase = unit(rng, 1, 8)
    # one positive region at distance ~0 and 40 negatives, all violating the margin
    region = np.repeat(phrase, 41, axis=0) + 0.01 * rng.normal(size=(41, 8)).astype(np.float32)
    region /= np.linalg.norm(region, axis=1, keepdims=True)
    pos = np.zeros((1, 41), bool)
    pos[0, 0] = True
    neg = ~pos
    ppn = np.zeros((1, 1), bool)
    margin = 0.5
    value = region_phrase_losses.phrase_localization_loss(
        region, phrase, pos, neg, ppn, margin=margin, top_k=30, region_anchor_weight=0.0,
        phrase_anchor_weight=1.0, region_neighbour_weight=0.0, phrase_neighbour_weight=0.0)
    d = np_dist(phrase, region)[0]
    hinge = np.clip(margin + d[0] - d[1:], 0, None)
    assert (hinge > 0).sum() == 40
    expected = np.sort(hinge)[-30:].mean()
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)
    assert abs(expected - hinge.mean()) > 1e-4  # the cap matters
    # K larger than the number of negatives: the row's mean is over K slots
    value = region_phrase_losses.phrase_localization_loss(
        region, phrase, pos, neg, ppn, margin=margin, top_k=41, region_anchor_weight=0.0,
        phrase_anchor_weight=1.0, region_neighbour_weight=0.0, phrase_neighbour_weight=0.0)
    np.testing.assert_allclose(float(value), hinge.sum() / 41, rtol=1e-5)


@pytest.mark.parametrize("neighbourhood", [False, True])
def test_matches_numpy_reference_on_sampled_batches(neighbourhood):
    data = random_data(num_images=8, seed=4)
    sampler = pl.PhraseTripletSampler(data, batch_size=5, neighbourhood_sampling=neighbourhood, seed=0)
    rng = np.random.default_rng(1)
    kwargs = dict(margin=0.3, top_k=3, region_anchor_weight=1.0, phrase_anchor_weight=4.0,
                  region_neighbour_weight=0.1 if neighbourhood else 0.0,
                  phrase_neighbour_weight=0.1 if neighbourhood else 0.0)
    for step in range(2):
        batch = sampler.batch(step)
        region = unit(rng, len(batch["region_index"]), 6)
        phrase = unit(rng, len(batch["phrase_index"]), 6)
        expected = np_loss(region, phrase, batch["phrase_region_positive"], batch["phrase_region_negative"],
                           batch["phrase_phrase_negative"], batch["region_neighbours"],
                           batch["phrase_neighbours"], kwargs["margin"], kwargs["top_k"],
                           kwargs["region_anchor_weight"], kwargs["phrase_anchor_weight"],
                           kwargs["region_neighbour_weight"], kwargs["phrase_neighbour_weight"])
        got = region_phrase_losses.phrase_localization_batch_loss(region, phrase, batch, **kwargs)
        np.testing.assert_allclose(float(got), expected, rtol=1e-5, atol=1e-6)
        assert expected > 0


def test_region_anchor_excludes_other_positives_and_same_chain():
    # two phrases of one chain, one of another; region 0 positive for phrases 0 and 1
    region = np.array([[1.0, 0.0]], np.float32)
    phrase = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
    pos = np.array([[True], [True], [False]])
    neg = np.zeros((3, 1), bool)
    ppn = np.array([[False, False, True], [False, False, True], [True, True, False]])
    value = region_phrase_losses.phrase_localization_loss(region, phrase, pos, neg, ppn, margin=0.1, top_k=5,
                                            region_anchor_weight=1.0, phrase_anchor_weight=0.0,
                                            region_neighbour_weight=0.0, phrase_neighbour_weight=0.0)
    d = np_dist(phrase, region)[:, 0]
    # rows (phrase 0, region 0) and (phrase 1, region 0); negative = phrase 2 only
    expected = (max(0.1 + d[0] - d[2], 0) + max(0.1 + d[1] - d[2], 0)) / (2 * 3)
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)


def test_no_positive_pairs_gives_zero_and_gradients_flow():
    region = tf.Variable(np.eye(3, dtype=np.float32))
    phrase = tf.Variable(np.eye(3, dtype=np.float32)[::-1].copy())
    empty = np.zeros((3, 3), bool)
    value = region_phrase_losses.phrase_localization_loss(region, phrase, empty, empty, empty, empty, empty)
    assert float(value) == 0.0
    pos = np.eye(3, dtype=bool)
    with tf.GradientTape() as tape:
        value = region_phrase_losses.phrase_localization_loss(region, phrase, pos, ~pos, ~pos, np.eye(3, dtype=bool),
                                                np.eye(3, dtype=bool), margin=0.5)
    grads = tape.gradient(value, [region, phrase])
    assert float(value) > 0 and all(np.isfinite(g.numpy()).all() for g in grads)


def test_graph_mode_with_padded_batches():
    data = random_data()
    sampler = pl.PhraseTripletSampler(data, batch_size=4, neighbourhood_sampling=True, seed=0)
    dataset = sampler.dataset().take(2)
    dim = 5

    @tf.function
    def step_loss(batch):
        region = tf.math.l2_normalize(tf.random.stateless_normal(
            [sampler.num_region_slots, dim], seed=[1, 2]), axis=1)
        phrase = tf.math.l2_normalize(tf.random.stateless_normal(
            [sampler.num_phrase_slots, dim], seed=[3, 4]), axis=1)
        return region_phrase_losses.phrase_localization_batch_loss(region, phrase, batch)

    values = [float(step_loss(b)) for b in dataset]
    assert all(np.isfinite(values)) and all(v > 0 for v in values)


def test_masked_logistic_pair_loss():
    logits = np.array([2.0, -1.0, 0.5, 100.0], np.float32)
    labels = np.array([1, 0, 1, 0])
    mask = np.array([True, True, True, False])
    z = np.array([1, -1, 1])
    expected = np.mean(np.log1p(np.exp(-z * logits[:3])))
    np.testing.assert_allclose(float(losses.masked_logistic_pair_loss(logits, labels, mask)), expected, rtol=1e-6)
    np.testing.assert_allclose(float(losses.masked_logistic_pair_loss(logits[:3], labels[:3], mask[:3])),
                               float(losses.logistic_pair_loss(logits[:3], labels[:3])), rtol=1e-6)
    assert float(losses.masked_logistic_pair_loss(logits, labels, np.zeros(4, bool))) == 0.0


def test_keras_train_step_on_algorithm_1_batches():
    """The padded batches drive a Keras fit loop (embedding and similarity networks)."""
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, TwoBranchModel

    class PhraseModel(TwoBranchModel):
        def compute_task_loss(self, batch, training):
            image = self.image_tower(batch["image"], training=training)
            text = self.text_tower(batch["text"], training=training)
            if self.similarity_head is None:
                return region_phrase_losses.phrase_localization_batch_loss(image, text, batch, top_k=5)
            logits = tf.squeeze(self.similarity_head(image * text, training=training), -1)
            return losses.masked_logistic_pair_loss(logits, batch["labels"], batch["pair_mask"])

    data = random_data()
    for kind, sampler in (("embedding", pl.PhraseTripletSampler(data, batch_size=4, neighbourhood_sampling=True)),
                          ("similarity", pl.PhrasePairSampler(data, batch_size=4))):
        config = TwoBranchConfig(kind=kind, image_dim=data.region_features.shape[1],
                                 text_dim=data.phrase_features.shape[1], image_hidden=(8,), text_hidden=(8,),
                                 embed_dim=4, similarity_head=(4,), dropout=0.0)
        model = PhraseModel(config).build_all()
        model.compile(optimizer=keras.optimizers.Adam(1e-3))
        history = model.fit(pl.attach_phrase_features(sampler.dataset(), data), steps_per_epoch=2, epochs=1,
                            shuffle=False, verbose=0)
        assert np.isfinite(history.history["loss"][0])
