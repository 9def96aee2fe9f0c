"""The N-pair localization model (Das et al.): caption encoding, training, heat maps, save/load."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.errors import ConfigError
from tf_twobranch.systems.npair import heat_maps as localization_maps
from tf_twobranch.evaluation.pointing_game import PointingQuery
from tf_twobranch.features.backbones import build_spatial_backbone
from tf_twobranch.systems.npair.features import encode_token_lists
from tf_twobranch.systems.npair import heat_map_volume as volume
from tf_twobranch.systems.npair.model import (NPairLocalizationConfig, NPairLocalizationModel,
                                              build_npair_model)

VOCAB = ["<pad>", "<unk>", "<start>", "<end>", "a", "red", "seven", "blue", "two", "left"]


def tiny_config(**kw):
    base = dict(vocabulary_size=len(VOCAB), map_channels=5, map_size=3, word_dim=6, embed_dim=8,
                max_tokens=6, temperature=0.5)
    base.update(kw)
    return NPairLocalizationConfig(**base)


def tiny_batch(n=6, seed=0):
    rng = np.random.default_rng(seed)
    tokens = encode_token_lists([["a", "red", "seven"], ["two", "blue"], ["left"], ["a", "blue", "two"],
                                 ["red", "left"], ["seven", "two"]][:n], VOCAB, max_words=4)
    return {"backbone_map": rng.normal(size=(n, 3, 3, 5)).astype(np.float32),
            "token_ids": tokens.token_ids, "token_mask": tokens.token_mask}


def test_captions_are_start_words_end_padded_with_end_unknown_words_dropped():
    tokens = encode_token_lists([["a", "zebra", "red"], ["two", "blue", "red", "seven", "left"], ["zebra"]],
                                VOCAB, max_words=4)
    start, end = VOCAB.index("<start>"), VOCAB.index("<end>")
    np.testing.assert_array_equal(tokens.token_ids[0], [start, 4, 5, end, end, end])
    np.testing.assert_array_equal(tokens.token_mask[0], [0, 1, 1, 0, 0, 0])
    # Five known words: clipped to four for evaluation and left out of training.
    np.testing.assert_array_equal(tokens.token_ids[1], [start, 8, 7, 5, 6, end])
    np.testing.assert_array_equal(tokens.trainable, [True, False, False])   # no known word: not trainable


@pytest.mark.parametrize("loss,seed", [("npair", 0), ("npair", 1), ("triplet", 0)])
def test_training_reduces_the_loss_and_scores_follow_the_volume(loss, seed):
    keras.utils.set_random_seed(seed)
    model = build_npair_model(tiny_config(loss=loss))
    model.compile(keras.optimizers.Adam(0.01), run_eagerly=True)
    batch = tiny_batch()
    losses = [float(model.train_on_batch(batch, return_dict=True)["loss"]) for _ in range(15)]
    assert np.all(np.isfinite(losses)) and max(losses[-3:]) < 0.9 * losses[0], losses
    maps, tokens = model.encode(batch)
    want = volume.paired_localization_scores(maps, tokens, batch["token_mask"])
    np.testing.assert_allclose(model(batch).numpy(), want.numpy(), rtol=1e-5)
    # Vector normalisation: every score is a mean of cosines.
    assert np.all(np.abs(model(batch).numpy()) <= 1.0 + 1e-6)


def test_config_and_weights_round_trip(tmp_path):
    config = tiny_config(aggregator="max_text", normalisation="map")
    model = build_npair_model(config, np.random.default_rng(0).normal(size=(len(VOCAB), 6)))
    model.save_weights(tmp_path / "m.weights.h5")
    model.save_config(tmp_path / "config.json", vocabulary=VOCAB)
    loaded_config, extra = NPairLocalizationModel.load_config(tmp_path / "config.json")
    assert loaded_config == config and extra["vocabulary"] == VOCAB
    loaded = build_npair_model(loaded_config)
    loaded.load_weights(tmp_path / "m.weights.h5")
    batch = tiny_batch()
    np.testing.assert_allclose(loaded(batch).numpy(), model(batch).numpy(), rtol=1e-6)
    with pytest.raises(ConfigError, match="aggregator"):
        tiny_config(aggregator="max").validate()


def _query(words, span):
    return PointingQuery(image_id="im", sentence_index=0, phrase_index=0, caption_words=words, word_span=span,
                         phrase=" ".join(words[span[0]:span[1]]), boxes=np.array([[0, 0, 5, 5]], np.float32),
                         image_width=12, image_height=9)


def test_word_and_phrase_heat_maps():
    model = build_npair_model(tiny_config(), np.random.default_rng(1).normal(size=(len(VOCAB), 6)))
    maps = {"im": localization_maps.projected_maps(model, tiny_batch()["backbone_map"][:1])[0]}
    one_word = _query(["a", "red", "seven", "on", "the", "left"], (1, 2))
    phrase = _query(["a", "red", "seven", "on", "the", "left"], (0, 3))
    unknown = _query(["a", "zebra", "left"], (1, 2))
    word_maps = localization_maps.query_heat_maps(model, maps, [one_word, phrase, unknown], VOCAB, mode="word",
                                                  max_words=4)
    phrase_maps = localization_maps.query_heat_maps(model, maps, [one_word, phrase, unknown], VOCAB,
                                                    mode="phrase", max_words=4)
    # Word mode = the mean of the word maps of the caption "<start> a red seven left <end>".
    tokens = encode_token_lists([["a", "red", "seven", "left"]], VOCAB, max_words=4)
    a, s = model.normalised(maps["im"][None], model.token_vectors(tokens.token_ids), tokens.token_mask)
    all_maps = volume.localization_volume(a, s).numpy()[0]            # (h, w, T)
    np.testing.assert_allclose(word_maps[0], all_maps[..., 2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(word_maps[1], all_maps[..., 1:4].mean(axis=-1), rtol=1e-5, atol=1e-6)
    # A one-word phrase is the same token in both modes; a longer one is one averaged token.
    np.testing.assert_allclose(phrase_maps[0], word_maps[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(phrase_maps[1], word_maps[1])
    assert word_maps[2] is None and phrase_maps[2] is None
    result = localization_maps.pointing_results([one_word, phrase, unknown], word_maps)
    assert result["trials"] == 3 and result["queries_without_map"] == 1 and result["misses"] >= 1


def test_spatial_backbones(tmp_path):
    from tf_twobranch.features.scene_cnn import build_scene_cnn, save_scene_cnn
    _, extractor = build_scene_cnn(32, 10, feature_dim=8, widths=(4, 4, 8, 8))
    save_scene_cnn(extractor, tmp_path / "scene_cnn.keras")
    scene = build_spatial_backbone("scene_cnn", weights_path=tmp_path / "scene_cnn.keras")
    assert tuple(scene.output.shape[1:]) == (2, 2, 8)
    out = scene(tf.zeros((1, 32, 32, 3)))
    assert out.shape == (1, 2, 2, 8)


def test_backbone_trained_end_to_end_from_images_or_frozen(tmp_path):
    from tf_twobranch.features.scene_cnn import build_scene_cnn
    _, extractor = build_scene_cnn(32, 10, feature_dim=8, widths=(4, 4, 8, 5))
    batch = tiny_batch()
    images = np.random.default_rng(2).uniform(0, 255, (6, 32, 32, 3)).astype(np.float32)
    data = {"image": images, "token_ids": batch["token_ids"], "token_mask": batch["token_mask"]}
    for train_backbone in (True, False):
        backbone = keras.Model(extractor.input, extractor.get_layer("global_pool").input)
        model = build_npair_model(tiny_config(map_size=2, train_backbone=train_backbone), backbone=backbone)
        model.compile(keras.optimizers.SGD(0.05), run_eagerly=True)
        before = [w.numpy().copy() for w in backbone.weights]
        model.train_on_batch(data)
        changed = any(not np.array_equal(a, w.numpy()) for a, w in zip(before, backbone.weights))
        assert changed == train_backbone
    with pytest.raises(ConfigError, match="train_backbone needs the backbone"):
        build_npair_model(tiny_config(train_backbone=True))
