"""Loss tests: the original implementation's `embedding_loss` semantics, recomputed
independently in numpy following the reference's boolean_mask / reshape / tile steps."""
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.losses import common
from tf_twobranch.systems.two_branch import losses, region_phrase_losses
from tests.support.keras_contract import assert_keras_loss_contract


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
    lp = keras.losses.deserialize(keras.losses.serialize(losses.LogisticPairLoss()))
    assert isinstance(lp, losses.LogisticPairLoss)


def test_loss_classes_are_keras_losses_without_own_call():
    """Only per-example losses have a Keras class, and Keras's `__call__` is never bypassed."""
    import importlib
    import pkgutil

    import keras
    classes = set()
    names = ["tf_twobranch.losses.common"] + [
        f"tf_twobranch.systems.{system}.{info.name}"
        for system in ("two_branch", "dual_path", "fragments", "npair")
        for info in pkgutil.iter_modules(importlib.import_module(f"tf_twobranch.systems.{system}").__path__)
        if "loss" in info.name or info.name == "heat_map_volume"]
    for name in names:
        module = importlib.import_module(name)
        classes |= {v for v in vars(module).values()
                    if isinstance(v, type) and issubclass(v, keras.losses.Loss)
                    and v.__module__ == module.__name__}
    assert {c.__name__ for c in classes} == {"LogisticPairLoss", "InstanceLoss", "CosineRankingLoss",
                                             "NPairLoss", "HardestNegativeTripletLoss"}
    assert all("__call__" not in vars(c) for c in classes)


def test_logistic_pair_loss_keras_contract(tmp_path):
    logits = np.array([2.0, -1.0, 0.5, -3.0, 1.2, -0.3, 0.0], np.float32)
    labels = np.array([1, 0, 0, 1, -1, 1, 0])
    per_pair = losses.logistic_pair_loss(logits, labels, per_example=True).numpy()
    z = np.where(labels > 0, 1.0, -1.0)
    np.testing.assert_allclose(per_pair, np.log1p(np.exp(-z * logits)), rtol=1e-6)
    assert_keras_loss_contract(losses.LogisticPairLoss(), labels, logits,
                               losses.logistic_pair_loss(logits, labels), per_pair, tmp_path)
    # logits of shape (pairs, 1), as a Dense(1) similarity head gives them
    assert_keras_loss_contract(losses.LogisticPairLoss(name="pairs"), labels, logits[:, None],
                               losses.logistic_pair_loss(logits, labels), per_pair, tmp_path)
    assert losses.LogisticPairLoss().name == "logistic_pair_loss"


# --- static-shape (XLA) formulation ---------------------------------------------------


def _random_labels(rng, num_texts, num_images, duplicates=True, extra=0.0):
    """One image per text, some images repeated in the batch, some texts with extra images."""
    labels = np.zeros((num_texts, num_images), bool)
    labels[np.arange(num_texts), rng.integers(0, num_images, num_texts)] = True
    if duplicates:  # image slots 0 and 1 hold the same image: texts of one match both
        both = labels[:, 0] | labels[:, 1]
        labels[both, 0] = labels[both, 1] = True
    labels |= rng.random(labels.shape) < extra
    return labels


@pytest.mark.parametrize("seed,num_texts,num_images,k,extra,weights", [
    (0, 30, 12, 5, 0.0, (1.0, 1.5, 0.0, 0.05)),
    (1, 24, 6, 10, 0.1, (1.0, 1.0, 0.3, 0.2)),     # k > negatives of some rows
    (2, 40, 30, 3, 0.3, (0.5, 2.0, 0.1, 0.0)),     # rows with > 8 positives: fallback branch
    (3, 9, 3, 2, 0.0, (1.0, 1.0, 1.0, 1.0)),
])
def test_static_ranking_loss_equals_dynamic(seed, num_texts, num_images, k, extra, weights):
    rng = np.random.default_rng(seed)
    im = tf.constant(_l2n(rng.normal(size=(num_images, 8))).astype(np.float32))
    sent = tf.constant(_l2n(rng.normal(size=(num_texts, 8))).astype(np.float32))
    labels = tf.constant(_random_labels(rng, num_texts, num_images, extra=extra))
    kw = dict(margin=0.3, top_k=k, image_anchor_weight=weights[0], text_anchor_weight=weights[1],
              image_neighbour_weight=weights[2], text_neighbour_weight=weights[3])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([im, sent])
        dynamic = losses.bidirectional_ranking_loss(im, sent, labels, **kw)
        static = losses.bidirectional_ranking_loss(im, sent, labels, static_shapes=True, **kw)
    assert float(dynamic) > 0
    np.testing.assert_allclose(float(static), float(dynamic), rtol=1e-6)
    for a, b in zip(tape.gradient(static, [im, sent]), tape.gradient(dynamic, [im, sent])):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)


def test_static_embedding_loss_matches_reference():
    rng = np.random.default_rng(5)
    im = _l2n(rng.normal(size=(10, 16))).astype(np.float32)
    sent = _l2n(rng.normal(size=(30, 16))).astype(np.float32)
    labels = np.repeat(np.eye(10, dtype=bool), 3, axis=0)
    expected = reference_embedding_loss(im.astype(np.float64), sent.astype(np.float64), labels,
                                        0.05, 5, 1.5, 0.05)
    got = losses.embedding_loss(im, sent, labels, num_neg_sample=5, static_shapes=True)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5, atol=1e-5)


def _phrase_batch(rng, num_phrases=14, num_regions=22, valid_phrases=11, crowded_phrase=False):
    chain = rng.integers(0, 5, num_phrases)
    valid = np.arange(num_phrases) < valid_phrases
    positive = (rng.random((num_phrases, num_regions)) < 0.15) & valid[:, None]
    positive[:, :3] |= (chain[:, None] == np.arange(3)[None, :]) & valid[:, None]  # chain boxes
    if crowded_phrase:
        positive[0, :12] = True    # more positive regions than the cap of 8
    negative = (rng.random((num_phrases, num_regions)) < 0.5) & ~positive & valid[:, None]
    same_chain = (chain[:, None] == chain[None, :]) & valid[:, None] & valid[None, :]
    phrase_negative = ~(chain[:, None] == chain[None, :]) & valid[:, None] & valid[None, :]
    pf = positive.astype(np.float32)
    targets = positive.any(axis=0)
    region_nbrs = ((pf.T @ pf) > 0) | np.diag(targets)
    return {"phrase_region_positive": positive, "phrase_region_negative": negative,
            "phrase_phrase_negative": phrase_negative, "phrase_neighbours": same_chain,
            "region_neighbours": region_nbrs}


@pytest.mark.parametrize("seed,crowded,k", [(0, False, 30), (1, True, 4), (2, False, 3)])
def test_static_phrase_localization_loss_equals_dynamic(seed, crowded, k):
    rng = np.random.default_rng(seed)
    batch = {key: tf.constant(v) for key, v in _phrase_batch(rng, crowded_phrase=crowded).items()}
    regions = tf.constant(_l2n(rng.normal(size=(22, 8))).astype(np.float32))
    phrases = tf.constant(_l2n(rng.normal(size=(14, 8))).astype(np.float32))
    kw = dict(margin=0.2, top_k=k, region_anchor_weight=1.0, phrase_anchor_weight=4.0,
              region_neighbour_weight=0.1, phrase_neighbour_weight=0.1)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([regions, phrases])
        dynamic = region_phrase_losses.phrase_localization_batch_loss(regions, phrases, batch, **kw)
        static = region_phrase_losses.phrase_localization_batch_loss(regions, phrases, batch, static_shapes=True,
                                                       **kw)
    assert float(dynamic) > 0
    np.testing.assert_allclose(float(static), float(dynamic), rtol=1e-6)
    for a, b in zip(tape.gradient(static, [regions, phrases]),
                    tape.gradient(dynamic, [regions, phrases])):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
    # each term on its own, including terms without anchor rows (value 0)
    for name in ("region_anchor_weight", "phrase_anchor_weight", "region_neighbour_weight",
                 "phrase_neighbour_weight"):
        only = {w: (1.0 if w == name else 0.0) for w in kw if w.endswith("_weight")}
        args = dict(kw, **only)
        d = region_phrase_losses.phrase_localization_batch_loss(regions, phrases, batch, **args)
        s = region_phrase_losses.phrase_localization_batch_loss(regions, phrases, batch, static_shapes=True, **args)
        np.testing.assert_allclose(float(s), float(d), rtol=1e-6, err_msg=name)
    empty = dict(batch, phrase_region_positive=tf.zeros_like(batch["phrase_region_positive"]))
    assert float(region_phrase_losses.phrase_localization_batch_loss(regions, phrases, empty, static_shapes=True,
                                                       **kw)) == 0.0


def _compiles_with_gradient(loss_fn, *tensors, masks=None):
    """loss_fn(*variables, masks) and its gradient under XLA.

    The masks are arguments of the compiled function, as in training (as
    captured constants, grappler would fold the `tf.cond`s away).
    """
    variables = [tf.Variable(t) for t in tensors]

    @tf.function(jit_compile=True)
    def step(masks):
        with tf.GradientTape() as tape:
            loss = loss_fn(*variables, masks)
        return loss, tape.gradient(loss, variables)

    loss, grads = step(masks if masks is not None else {"none": tf.zeros([1], tf.bool)})
    assert np.isfinite(float(loss))
    assert all(g is not None and np.all(np.isfinite(g.numpy())) for g in grads)
    return float(loss)


def test_static_losses_compile_under_xla(monkeypatch):
    rng = np.random.default_rng(0)
    im = _l2n(rng.normal(size=(12, 8))).astype(np.float32)
    sent = _l2n(rng.normal(size=(30, 8))).astype(np.float32)
    labels = _random_labels(rng, 30, 12, extra=0.3)     # rows with > 8 positives
    kw = dict(margin=0.2, top_k=5, image_neighbour_weight=0.1)
    xla = _compiles_with_gradient(lambda i, s, m: losses.bidirectional_ranking_loss(
        i, s, m["labels"], static_shapes=True, **kw), im, sent, masks={"labels": labels})
    assert xla == pytest.approx(float(losses.bidirectional_ranking_loss(im, sent, labels, **kw)),
                                rel=1e-5)
    _compiles_with_gradient(lambda i, s, m: losses.embedding_loss(
        i, s, m["labels"], static_shapes=True), im, sent[:24],
        masks={"labels": np.repeat(np.eye(12, dtype=bool), 2, axis=0)})
    nbrs = (rng.random((30, 30)) < 0.2) | np.eye(30, dtype=bool)
    _compiles_with_gradient(lambda s, m: losses.neighbourhood_loss(
        s, m["nbrs"], margin=0.1, top_k=5), sent, masks={"nbrs": nbrs})

    # 80 regions, fallback budget lowered: caps 8 then 64 as in large batches
    monkeypatch.setattr(common, "FALLBACK_ELEMENTS", 1000)
    batch = _phrase_batch(rng, num_regions=80, crowded_phrase=True)
    regions = _l2n(rng.normal(size=(80, 8))).astype(np.float32)
    phrases = _l2n(rng.normal(size=(14, 8))).astype(np.float32)
    xla = _compiles_with_gradient(lambda r, p, m: region_phrase_losses.phrase_localization_batch_loss(
        r, p, m, top_k=6, static_shapes=True), regions, phrases, masks=batch)
    assert xla == pytest.approx(float(region_phrase_losses.phrase_localization_batch_loss(
        regions, phrases, batch, top_k=6)), rel=1e-5)

    logits = rng.normal(size=(16,)).astype(np.float32)
    pair = {"labels": rng.integers(0, 2, 16), "mask": np.arange(16) < 11}
    _compiles_with_gradient(lambda z, m: losses.logistic_pair_loss(z, m["labels"]), logits,
                            masks=pair)
    _compiles_with_gradient(lambda z, m: losses.masked_logistic_pair_loss(
        z, m["labels"], m["mask"]), logits, masks=pair)
