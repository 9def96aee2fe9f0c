"""Every model family trains a step under ``--precision=mixed_bfloat16`` (issue 23 item 17).

The policy is set the way the experiments set it (`tf_twobranch.speed.set_precision`,
called by `experiments.common.setup_training`), before the model is built, and the
previous global policy is restored whatever the test does.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.speed import set_precision


@pytest.fixture
def mixed_bfloat16():
    previous = keras.mixed_precision.global_policy().name
    try:
        set_precision("mixed_bfloat16")
        keras.utils.set_random_seed(0)
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


@pytest.fixture
def float64():
    previous = keras.mixed_precision.global_policy().name
    try:
        keras.mixed_precision.set_global_policy("float64")
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _bfloat16_variables_compute(model):
    """The towers really compute in bfloat16 (the test would pass vacuously under float32)."""
    policies = {layer.dtype_policy.name for layer in model._flatten_layers() if hasattr(layer, "dtype_policy")}
    assert "mixed_bfloat16" in policies, policies


def _one_step(model, batch):
    logs = model.train_on_batch(batch, return_dict=True)
    assert logs and all(np.isfinite(float(v)) for v in logs.values()), logs
    return logs


@pytest.mark.parametrize("kind", ["embedding", "similarity"])
def test_two_branch_network_trains_under_mixed_bfloat16(mixed_bfloat16, kind):
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model
    from tf_twobranch.systems.two_branch import sampling
    rng = np.random.default_rng(0)
    images = rng.normal(size=(8, 12)).astype(np.float32)
    caption_image = np.repeat(np.arange(8), 2)
    texts = rng.normal(size=(16, 10)).astype(np.float32)
    model = build_model(TwoBranchConfig(kind=kind, image_dim=12, text_dim=10, image_hidden=(16,),
                                        text_hidden=(16,), embed_dim=8, top_k=2, dropout=0.0,
                                        similarity_head=(8,)))
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    _bfloat16_variables_compute(model)
    if kind == "embedding":
        batches = sampling.image_sentence_batches(caption_image, 8, batch_size=4, sample_size=2, seed=0)
    else:
        batches = sampling.similarity_pair_batches(caption_image, 8, batch_size=4, seed=0)
    batch = next(iter(sampling.attach_features(batches, images, texts)))
    _one_step(model, batch)


def test_dual_path_instance_loss_model_trains_under_mixed_bfloat16(mixed_bfloat16, tmp_path):
    from tf_twobranch.features.scene_cnn import build_scene_cnn, save_scene_cnn
    from tf_twobranch.systems.dual_path.model import DualPathConfig, build_dual_path_model
    # A small scene CNN instead of ResNet-50: the heads, text CNN and losses are the same.
    _, extractor = build_scene_cnn(32, 10, feature_dim=16, widths=(4, 4, 8, 8))
    save_scene_cnn(extractor, tmp_path / "scene_cnn.keras")
    vocabulary, length = 30, 8
    model = build_dual_path_model(DualPathConfig(
        vocabulary_size=vocabulary, num_classes=4, image_size=32, text_width=4, text_blocks=(1, 1, 1, 1),
        max_len=length, word_dim=8, hidden_dim=16, embed_dim=16, image_backbone="scene_cnn",
        image_weights=str(tmp_path / "scene_cnn.keras"), stage=2))
    model.compile(keras.optimizers.SGD(0.01))
    _bfloat16_variables_compute(model)
    rng = np.random.default_rng(0)
    batch = {"image": rng.uniform(0, 255, (4, 32, 32, 3)).astype(np.float32),
             "token_ids": rng.integers(1, vocabulary, (4, length)).astype(np.int32),
             "label": np.arange(4, dtype=np.int32),
             "negative_token_ids": rng.integers(1, vocabulary, (2, length)).astype(np.int32)}
    logs = _one_step(model, batch)
    assert "rank_loss" in logs       # stage 2: instance and ranking losses both ran


def _fragment_model(**config):
    from tf_twobranch.systems.fragments.model import FragmentEmbeddingConfig, build_fragment_model
    return build_fragment_model(FragmentEmbeddingConfig(image_dim=7, num_relations=3, vocabulary_size=11, word_dim=4,
                                                        embed_dim=5, global_margin=0.1, **config),
                                np.random.default_rng(0).normal(size=(11, 4)))


def _fragment_batch(rng, images=4, fragments=3, sentence_fragments=5):
    sentence_mask = np.ones((images, sentence_fragments), bool)
    sentence_mask[1, 3:] = False
    return {"image_fragments": rng.normal(size=(images, fragments, 7)).astype(np.float32),
            "image_mask": np.ones((images, fragments), bool),
            "relation": rng.integers(0, 3, (images, sentence_fragments)).astype(np.int32),
            "word1": rng.integers(0, 11, (images, sentence_fragments)).astype(np.int32),
            "word2": rng.integers(0, 11, (images, sentence_fragments)).astype(np.int32),
            "sentence_mask": sentence_mask}


@pytest.mark.parametrize("objectives", ["both", "fragment_only", "global_only"])
def test_fragment_model_trains_under_mixed_bfloat16(mixed_bfloat16, objectives):
    model = _fragment_model(use_fragment_objective=objectives != "global_only",
                            use_global_objective=objectives != "fragment_only", decay_biases=True)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    _bfloat16_variables_compute(model)
    batch = _fragment_batch(np.random.default_rng(0))
    model.mil.assign(True)
    logs = _one_step(model, batch)
    assert logs["loss"] > 0
    assert model(batch).dtype == tf.float32
    assert model.objective(batch)["loss"].dtype == tf.float32


@pytest.mark.parametrize("objectives", ["fragment_only", "global_only"])
def test_fragment_model_trains_under_float64_with_one_objective_off(float64, objectives):
    model = _fragment_model(use_fragment_objective=objectives != "global_only",
                            use_global_objective=objectives != "fragment_only")
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    _one_step(model, _fragment_batch(np.random.default_rng(0)))
    assert model.objective(_fragment_batch(np.random.default_rng(0)))["loss"].dtype == tf.float64


def test_npair_localization_model_trains_under_mixed_bfloat16(mixed_bfloat16):
    from tf_twobranch.systems.npair.features import encode_token_lists
    from tf_twobranch.systems.npair.model import NPairLocalizationConfig, build_npair_model
    vocabulary = ["<pad>", "<unk>", "<start>", "<end>", "a", "red", "seven", "blue"]
    model = build_npair_model(NPairLocalizationConfig(vocabulary_size=len(vocabulary), map_channels=5,
                                                      map_size=3, word_dim=6, embed_dim=8, max_tokens=6))
    model.compile(keras.optimizers.Adam(0.01))
    _bfloat16_variables_compute(model)
    tokens = encode_token_lists([["a", "red", "seven"], ["blue"], ["a", "blue"], ["seven", "red"]],
                                vocabulary, max_words=4)
    batch = {"backbone_map": np.random.default_rng(0).normal(size=(4, 3, 3, 5)).astype(np.float32),
             "token_ids": tokens.token_ids, "token_mask": tokens.token_mask}
    _one_step(model, batch)
