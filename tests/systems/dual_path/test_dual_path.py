"""Dual-path CNN (Zheng et al. 2020): text CNN layout, shared classifier, stages, save/load."""
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.systems.dual_path import losses
from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.systems.dual_path.model import (DualPathConfig, build_dual_path_model, build_text_cnn,
                                           load_dual_path_model,
                                           text_feature_length, text_receptive_field)

VOCAB, CLASSES, LEN = 50, 6, 12


@pytest.fixture(scope="module", autouse=True)
def _small_backbone(tmp_path_factory):
    """A small untrained scene CNN (conv + batch norm) as the image backbone of most tests:
    building and running ResNet-50 eagerly costs ~10 s a test here for nothing the tests
    check; the save/load round trip keeps the paper's ResNet-50."""
    global SMALL_BACKBONE
    from tf_twobranch.features.scene_cnn import build_scene_cnn, save_scene_cnn
    _, extractor = build_scene_cnn(32, 10, feature_dim=32, widths=(8, 8, 16, 16))
    SMALL_BACKBONE = tmp_path_factory.mktemp("backbone") / "scene_cnn.keras"
    save_scene_cnn(extractor, SMALL_BACKBONE)


SMALL_BACKBONE = None


def tiny(**kw):
    base = dict(vocabulary_size=VOCAB, num_classes=CLASSES, image_size=32, text_width=4,
                text_blocks=(1, 1, 1, 1), max_len=LEN, word_dim=16, hidden_dim=32, embed_dim=32,
                image_backbone="scene_cnn", image_weights=str(SMALL_BACKBONE))
    base.update(kw)
    return DualPathConfig(**base)


def tiny_batch(n=4, seed=0, negatives=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (n, LEN)).astype(np.int32)
    ids[:, 9:] = 0  # padding at the end
    batch = {"image": rng.uniform(0, 255, (n, 32, 32, 3)).astype(np.float32), "token_ids": ids,
             "label": (np.arange(n) % CLASSES).astype(np.int32)}
    if negatives:
        batch["negative_token_ids"] = rng.integers(1, VOCAB, (negatives, LEN)).astype(np.int32)
    return batch


def variables_numpy(layer):
    return [v.numpy().copy() for v in layer.weights]


# --- config ------------------------------------------------------------------

def test_config_round_trip_and_validation():
    cfg = tiny(text_layout="reference", ranking_negatives="reference", stage=2)
    assert DualPathConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    defaults = DualPathConfig(vocabulary_size=20074, num_classes=29783)
    assert (defaults.embed_dim, defaults.dropout, defaults.margin, defaults.max_len) == (2048, 0.75, 1.0, 32)
    assert defaults.stage_lambdas(1) == (0.0, 1.0, 1.0) and defaults.stage_lambdas(2) == (1.0, 1.0, 1.0)
    for bad in (dict(text_layout="fancy"), dict(image_backbone="alexnet"), dict(dropout=1.0),
                dict(ranking_negatives="semi"), dict(stage=3), dict(text_blocks=(1, 2)),
                dict(vocabulary_size=1), dict(num_classes=0)):
        with pytest.raises(ConfigError):
            tiny(**bad)
    with pytest.raises(ConfigError, match="unknown"):
        DualPathConfig.from_dict({**cfg.to_dict(), "lamda_rank": 1})
    with pytest.raises(ConfigError, match="lacks"):
        DualPathConfig.from_dict({"num_classes": 3})


# --- text CNN ------------------------------------------------------------------

def test_receptive_field_of_full_size_layouts():
    paper = DualPathConfig(vocabulary_size=10, num_classes=2)
    reference = DualPathConfig(vocabulary_size=10, num_classes=2, text_layout="reference")
    assert text_receptive_field(paper) == (53, 8, 0) and text_feature_length(paper) == 4
    assert text_receptive_field(reference) == (37, 4, -36) and text_feature_length(reference) == 8
    assert text_feature_length(DualPathConfig(vocabulary_size=10, num_classes=2, max_len=56)) == 7


@pytest.mark.parametrize("layout,length", [("paper", 2), ("reference", 3)])
def test_text_cnn_shapes_and_receptive_field(layout, length):
    cfg = tiny(text_layout=layout, text_width=8)
    tower = build_text_cnn(cfg, np.random.default_rng(0).normal(size=(VOCAB, 16)) * 3)
    ids = np.random.default_rng(1).integers(1, VOCAB, (1, LEN)).astype(np.int32)
    assert tower(ids).shape == (1, 32)
    feature_map = keras.Model(tower.input, tower.get_layer("text_feature_map").output)
    base = feature_map(ids, training=False).numpy()[0]
    assert base.shape == (length, cfg.text_width * 32) and text_feature_length(cfg) == length
    size, jump, start = text_receptive_field(cfg)
    for p in range(LEN):
        changed_ids = ids.copy()
        changed_ids[0, p] = 1 + (ids[0, p] % (VOCAB - 1))
        diff = np.abs(feature_map(changed_ids, training=False).numpy()[0] - base).max(axis=1)
        expected = [start + j * jump <= p <= start + j * jump + size - 1 for j in range(length)]
        assert list(diff > 1e-6) == expected, (p, diff)


def test_layout_specific_layers():
    paper = build_text_cnn(tiny())
    reference = build_text_cnn(tiny(text_layout="reference", head_layout="reference"))
    assert isinstance(paper.get_layer("text_pool"), keras.layers.GlobalAveragePooling1D)
    assert isinstance(reference.get_layer("text_pool"), keras.layers.GlobalMaxPooling1D)
    assert "text_fc2" in [l.name for l in paper.layers]
    assert "text_fc2" not in [l.name for l in reference.layers]  # the reference has one FC
    assert reference.output_shape == (None, 32)
    assert paper.get_layer("text_stage3_block1_conv2").kernel.shape == (2, 8, 8)
    assert reference.get_layer("text_stage3_block1_conv2").kernel.shape == (2, 32, 32)  # wider first block


def test_padding_embeds_to_zero_and_word_vectors_are_used():
    cfg = tiny()
    vectors = np.random.default_rng(0).normal(size=(VOCAB, 16)).astype(np.float32)
    tower = build_text_cnn(cfg, vectors)
    embedding = tower.get_layer("word_embedding")
    np.testing.assert_array_equal(embedding.embeddings.numpy(), vectors)
    ids = np.array([[0, 3, 0, 7] + [0] * (LEN - 4)], np.int32)
    out = keras.Model(tower.input, embedding.output)(ids).numpy()[0]
    np.testing.assert_array_equal(out[[0, 2]], 0.0)
    np.testing.assert_allclose(out[[1, 3]], vectors[[3, 7]])
    with pytest.raises(ConfigError, match="word_vectors"):
        build_text_cnn(cfg, vectors[:, :5])
    random_tower = build_text_cnn(cfg)
    assert not np.allclose(random_tower.get_layer("word_embedding").embeddings.numpy(), vectors)


# --- the model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def fixed_model():
    """An untrained Stage II model shared by the tests that do not train it."""
    return build_dual_path_model(tiny(ranking_negatives="reference", dropout=0.0, stage=2))


def test_shared_classifier_gets_gradients_from_both_branches(fixed_model):
    model = fixed_model
    classifiers = [l for l in model._flatten_layers(include_self=False, recursive=True)
                   if isinstance(l, keras.layers.Dense) and l.units == CLASSES]
    assert len(classifiers) == 1 and classifiers[0] is model.classifier
    assert model.classifier.kernel.shape == (32, CLASSES)
    kernel_ids = [id(v) for v in model.trainable_variables if v is model.classifier.kernel]
    assert len(kernel_ids) == 1
    batch = tiny_batch()
    for term in ("image_instance_loss", "text_instance_loss"):
        with tf.GradientTape() as tape:
            value = model.objective(batch, training=False)[term]
        grad = tape.gradient(value, model.classifier.kernel)
        assert grad is not None and np.abs(grad.numpy()).max() > 0, term
    out = model(batch)
    np.testing.assert_allclose(out["image_logits"].numpy(),
                               model.classifier(out["image_features"]).numpy(), rtol=1e-5)


@pytest.mark.slow
def test_stage_one_freezes_backbone_and_stage_two_trains_it():
    model = build_dual_path_model(tiny(dropout=0.5))
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), run_eagerly=True)
    assert model.stage == 1 and model.lambdas == (0.0, 1.0, 1.0)
    backbone = model.image_backbone
    assert not backbone.trainable
    trainable_ids = {id(v) for v in model.trainable_variables}
    assert not any(id(v) in trainable_ids for v in backbone.weights)
    bb_before, text_before = variables_numpy(backbone), variables_numpy(model.text_tower)
    head_before = model.image_tower.get_layer("image_fc1").kernel.numpy().copy()
    for seed in range(2):
        model.train_on_batch(tiny_batch(seed=seed))
    for a, b in zip(bb_before, variables_numpy(backbone)):  # weights and BN moving statistics
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(text_before, variables_numpy(model.text_tower)))
    assert not np.array_equal(head_before, model.image_tower.get_layer("image_fc1").kernel.numpy())

    model.set_stage(2)
    assert backbone.trainable and model.lambdas == (1.0, 1.0, 1.0) and model.config.stage == 2
    assert len(model.trainable_variables) > len(trainable_ids)
    for seed in range(2):
        logs = model.train_on_batch(tiny_batch(seed=seed), return_dict=True)
    assert set(logs) >= {"loss", "rank_loss", "image_instance_loss", "text_instance_loss",
                         "image_accuracy", "text_accuracy"}
    after = {v.path: v.numpy() for v in backbone.weights}
    before = {v.path: a for v, a in zip(backbone.weights, bb_before)}
    moving = [p for p in after if "moving_mean" in p]
    kernels = [v.path for v in backbone.trainable_weights if "kernel" in v.path]
    assert moving and any(not np.array_equal(after[p], before[p]) for p in moving)
    assert any(not np.array_equal(after[p], before[p]) for p in kernels)


def test_losses_of_a_step_match_the_loss_functions(fixed_model):
    model = fixed_model
    batch = tiny_batch(negatives=3)
    terms = model.objective(batch, training=False)
    img = model.image_tower(batch["image"], training=False).numpy()
    txt = model.text_tower(np.concatenate([batch["token_ids"], batch["negative_token_ids"]]),
                           training=False).numpy()
    rank = losses.cosine_ranking_loss(img, txt[:4], batch["label"], batch["label"],
                                      extra_negative_text_embeds=txt[4:], negatives="reference")
    np.testing.assert_allclose(terms["rank_loss"].numpy(), rank.numpy(), rtol=1e-4)
    logits = model.classifier(txt[:4]).numpy()
    np.testing.assert_allclose(terms["text_instance_loss"].numpy(),
                               losses.instance_loss(logits, batch["label"]).numpy().mean(), rtol=1e-4)
    want = terms["rank_loss"] + terms["image_instance_loss"] + terms["text_instance_loss"]
    np.testing.assert_allclose(terms["loss"].numpy(), want.numpy(), rtol=1e-5)


def test_a_few_steps_reduce_the_loss_under_the_default_strategy():
    with tf.distribute.get_strategy().scope():
        model = build_dual_path_model(tiny(dropout=0.0))
        model.compile(keras.optimizers.Adam(3e-3), run_eagerly=True)
    batch = tiny_batch(n=6)
    history = []
    for _ in range(6):
        model.reset_metrics()
        history.append(float(model.train_on_batch(batch, return_dict=True)["loss"]))
    assert np.all(np.isfinite(history)) and history[-1] < history[0], history
    logs = model.evaluate(tf.data.Dataset.from_tensors(batch), verbose=0)  # Keras' loss evaluation
    assert set(logs) >= {"loss", "rank_loss", "image_accuracy", "text_accuracy"}


def test_save_load_round_trip_and_flip_average(tmp_path):
    cfg = tiny(text_layout="reference", image_backbone="resnet50", image_weights=None)
    model = build_dual_path_model(cfg)
    model.compile(keras.optimizers.SGD(0.01), run_eagerly=True)
    model.train_on_batch(tiny_batch())
    weights, config_path = tmp_path / "m.weights.h5", tmp_path / "config.json"
    model.save_weights(weights)
    model.save_config(config_path, epoch=1)
    loaded = load_dual_path_model(config_path, weights)
    assert loaded.config == cfg
    data = tiny_batch(n=5, seed=3)
    np.testing.assert_allclose(loaded.embed_texts(data["token_ids"]), model.embed_texts(data["token_ids"]),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loaded.image_tower(data["image"]).numpy(),
                               model.image_tower(data["image"]).numpy(), rtol=1e-4)
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    img = model.embed_images(data["image"])
    flipped = model.embed_images(data["image"][:, :, ::-1], flip_average=False)
    plain = model.embed_images(data["image"], flip_average=False)
    np.testing.assert_allclose(img, 0.5 * (plain + flipped), rtol=1e-4, atol=1e-6)

    with pytest.raises(UserInputError, match="outside"):
        model.embed_texts(np.full((1, LEN), VOCAB))
    with pytest.raises(DataFormatError):
        load_dual_path_model(tmp_path / "missing.json", weights)


def test_evaluate_calls_the_shared_core(fixed_model, monkeypatch):
    rng = np.random.default_rng(0)
    image_feats, text_feats = rng.normal(size=(5, 8)) * 1e3, rng.normal(size=(7, 8))
    monkeypatch.setattr(fixed_model, "embed_images", lambda *a, **k: image_feats)
    monkeypatch.setattr(fixed_model, "embed_texts", lambda *a, **k: text_feats)
    caption_image = np.array([0, 1, 2, 3, 4, 0, 2])
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    want = retrieval.evaluate_protocol(unit(image_feats), unit(text_feats), caption_image)
    data = tiny_batch(n=5)
    split = {"image": data["image"], "text": data["token_ids"], "caption_image": caption_image}
    assert fixed_model.evaluate(split) == pytest.approx(want)

    class Split:  # any object with the three attributes
        image, text = data["image"], data["token_ids"]
    Split.caption_image = caption_image
    assert fixed_model.evaluate(Split()) == pytest.approx(want)
    identity = np.array([0, 0, 1, 1, 2])
    t2i = fixed_model.evaluate_text_to_image(data["image"], np.zeros((7, LEN), np.int32),
                                             identity[caption_image], identity)
    ranks = retrieval.group_ranks(unit(text_feats), unit(image_feats), identity[caption_image], identity)
    assert t2i == pytest.approx(retrieval.metrics_from_ranks(ranks, prefix="t2i_"))
    with pytest.raises(UserInputError, match="needs"):
        fixed_model.evaluate({**split, "text": None})
    with pytest.raises(UserInputError, match="lacks"):
        fixed_model.evaluate({"image": data["image"], "token_ids": data["token_ids"],
                              "caption_image": caption_image})
    with pytest.raises(UserInputError, match="does not take"):   # refused, not ignored
        fixed_model.evaluate(split, normalise=False)


def test_mixed_bfloat16_step():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = build_dual_path_model(tiny(stage=2))
        model.compile(keras.optimizers.SGD(0.01), run_eagerly=True)
        out = model(tiny_batch())
        assert all(v.dtype == tf.float32 for v in out.values())
        logs = model.train_on_batch(tiny_batch(negatives=2), return_dict=True)
        assert np.isfinite(logs["loss"]) and np.isfinite(logs["rank_loss"])
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
def test_jit_compiled_fit():
    # The small backbone compiles under XLA many times faster than ResNet-50; the text
    # CNN, heads and losses are the same.
    model = build_dual_path_model(tiny())
    model.compile(keras.optimizers.SGD(0.01), jit_compile=True)
    ds = tf.data.Dataset.from_tensors(tiny_batch()).repeat(2)
    history = model.fit(ds, epochs=1, verbose=0, shuffle=False).history
    assert np.isfinite(history["loss"][-1])
