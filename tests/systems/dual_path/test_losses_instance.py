"""Instance loss and cosine ranking loss (Zheng et al. 2020) against numpy references."""
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.systems.dual_path import losses
from tests.support.keras_contract import assert_keras_loss_contract


def np_instance_loss(logits, labels):
    z = logits - logits.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -log_p[np.arange(len(labels)), labels]


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def np_ranking(img, txt, labels, *, gallery=None, extra=None, extra_labels=None, margin=1.0,
               negatives="in_batch"):
    """Loops over anchors and negatives, eq. 4 literally."""
    g_img, g_txt, g_lab = gallery if gallery is not None else (img, txt, labels)
    img, txt, g_img, g_txt = unit(img), unit(txt), unit(g_img), unit(g_txt)
    extra = unit(extra) if extra is not None else np.zeros((0, img.shape[1]))
    if extra_labels is None:
        extra_labels = np.full(len(extra), -1)
    image_mode = "mean" if negatives == "in_batch" else "max"
    text_mode = "max" if negatives == "hardest" else "mean"
    out = []
    for b in range(len(img)):
        pos = img[b] @ txt[b]
        hinges = [max(0.0, margin - (pos - img[b] @ t)) for t, lab in zip(g_txt, g_lab) if lab != labels[b]]
        hinges += [max(0.0, margin - (pos - img[b] @ t)) for t, lab in zip(extra, extra_labels)
                   if lab != labels[b]]
        image_term = (np.mean(hinges) if image_mode == "mean" else max(hinges)) if hinges else 0.0
        hinges = [max(0.0, margin - (pos - txt[b] @ i)) for i, lab in zip(g_img, g_lab) if lab != labels[b]]
        text_term = (np.mean(hinges) if text_mode == "mean" else max(hinges)) if hinges else 0.0
        out.append(image_term + text_term)
    return np.array(out)


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    img = rng.normal(size=(6, 5)).astype(np.float32)
    txt = (img + 0.8 * rng.normal(size=(6, 5))).astype(np.float32)
    labels = np.array([0, 1, 1, 2, 3, 3], np.int32)  # identities repeat (CUHK-PEDES)
    extra = rng.normal(size=(4, 5)).astype(np.float32)
    return img, txt, labels, extra


def test_instance_loss_matches_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 7)).astype(np.float32) * 3
    labels = np.array([0, 6, 3, 3, 1])
    got = losses.instance_loss(tf.constant(logits, tf.bfloat16), labels).numpy()
    assert got.shape == (5,) and got.dtype == np.float32
    np.testing.assert_allclose(got, np_instance_loss(logits.astype(tf.bfloat16.as_numpy_dtype)
                                                     .astype(np.float32), labels), rtol=1e-5)
    keras_loss = losses.InstanceLoss()
    np.testing.assert_allclose(keras_loss(labels, logits).numpy(),
                               np_instance_loss(logits, labels).mean(), rtol=1e-5)


@pytest.mark.parametrize("negatives", losses.RANKING_NEGATIVES)
@pytest.mark.parametrize("margin", [1.0, 0.2])
def test_cosine_ranking_matches_numpy(data, negatives, margin):
    img, txt, labels, extra = data
    got = losses.cosine_ranking_loss(img, txt, labels, labels, margin=margin, negatives=negatives,
                                     per_example=True).numpy()
    np.testing.assert_allclose(got, np_ranking(img, txt, labels, margin=margin, negatives=negatives),
                               rtol=1e-5, atol=1e-6)
    mean = losses.cosine_ranking_loss(img, txt, labels, labels, margin=margin, negatives=negatives)
    np.testing.assert_allclose(mean.numpy(), got.mean(), rtol=1e-6)


@pytest.mark.parametrize("negatives", losses.RANKING_NEGATIVES)
def test_extra_negative_texts(data, negatives):
    img, txt, labels, extra = data
    extra_labels = np.array([0, 5, 1, 7], np.int32)
    for lab in (None, extra_labels):
        got = losses.cosine_ranking_loss(img, txt, labels, labels, extra_negative_text_embeds=extra,
                                         extra_negative_text_labels=lab, negatives=negatives,
                                         per_example=True).numpy()
        want = np_ranking(img, txt, labels, extra=extra, extra_labels=lab, negatives=negatives)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_local_anchors_against_gathered_gallery(data):
    """The distribute contract: rows of a replica = the same rows of the full batch."""
    img, txt, labels, extra = data
    full = losses.cosine_ranking_loss(img, txt, labels, labels, per_example=True,
                                      negatives="reference", extra_negative_text_embeds=extra)
    for start, stop in ((0, 3), (3, 6)):
        part = losses.cosine_ranking_loss(
            img[start:stop], txt[start:stop], labels[start:stop], labels[start:stop],
            gallery_image_embeds=img, gallery_text_embeds=txt, gallery_image_labels=labels,
            gallery_text_labels=labels, extra_negative_text_embeds=extra, negatives="reference",
            per_example=True)
        np.testing.assert_allclose(part.numpy(), full.numpy()[start:stop], rtol=1e-6)


def test_anchor_without_negatives_contributes_zero():
    img = np.eye(3, dtype=np.float32)
    labels = np.zeros(3, np.int32)
    for negatives in losses.RANKING_NEGATIVES:
        got = losses.cosine_ranking_loss(img, img, labels, labels, negatives=negatives, per_example=True)
        np.testing.assert_array_equal(got.numpy(), 0.0)


def test_gradient_and_jit(data):
    img, txt, labels, extra = data
    img_v, txt_v = tf.Variable(img), tf.Variable(txt)

    def f(a, b):
        return losses.cosine_ranking_loss(a, b, labels, labels, negatives="hardest",
                                          extra_negative_text_embeds=extra)
    with tf.GradientTape() as tape:
        value = f(img_v, txt_v)
    grads = tape.gradient(value, [img_v, txt_v])
    assert all(np.all(np.isfinite(g.numpy())) and np.any(g.numpy() != 0) for g in grads)
    jitted = tf.function(f, jit_compile=True)(tf.constant(img), tf.constant(txt))
    np.testing.assert_allclose(jitted.numpy(), value.numpy(), rtol=1e-5)


def test_keras_wrappers_round_trip(data):
    img, txt, labels, _ = data
    loss = losses.CosineRankingLoss(margin=0.5, negatives="hardest")
    clone = losses.CosineRankingLoss.from_config(loss.get_config())
    assert (clone.margin, clone.negatives) == (0.5, "hardest")
    want = np_ranking(img, txt, labels, margin=0.5, negatives="hardest").mean()
    np.testing.assert_allclose(clone(labels, (img, txt)).numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(clone((labels, labels), (img, txt)).numpy(), want, rtol=1e-5)
    with pytest.raises(ValueError, match="negatives"):
        losses.CosineRankingLoss(negatives="semi-hard")


def test_instance_loss_keras_contract(tmp_path):
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(6, 7)).astype(np.float32) * 3
    labels = np.array([0, 6, 3, 3, 1, 5], np.int32)
    per_example = losses.instance_loss(logits, labels).numpy()
    np.testing.assert_allclose(per_example, np_instance_loss(logits, labels), rtol=1e-5)
    assert_keras_loss_contract(losses.InstanceLoss(), labels, logits, per_example.mean(),
                               per_example, tmp_path)
    assert losses.InstanceLoss().name == "instance_loss"


@pytest.mark.parametrize("negatives", losses.RANKING_NEGATIVES)
def test_cosine_ranking_loss_keras_contract(data, negatives, tmp_path):
    img, txt, labels, _ = data
    per_example = losses.cosine_ranking_loss(img, txt, labels, labels, margin=0.5,
                                             negatives=negatives, per_example=True).numpy()
    assert np.ptp(per_example) > 0  # rows differ: a wrong weighting would show
    expected = losses.cosine_ranking_loss(img, txt, labels, labels, margin=0.5, negatives=negatives)
    assert_keras_loss_contract(losses.CosineRankingLoss(margin=0.5, negatives=negatives), labels,
                               (img, txt), expected, per_example, tmp_path)
    assert_keras_loss_contract(losses.CosineRankingLoss(margin=0.5, negatives=negatives),
                               (labels, labels), (img, txt), expected, per_example, tmp_path)
    assert losses.CosineRankingLoss().name == "cosine_ranking_loss"
