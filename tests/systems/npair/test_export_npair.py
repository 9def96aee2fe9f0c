"""SavedModel export of the N-pair localization model (Das et al.): Keras-equal scores, heat maps and
points from JPEG bytes and raw captions, clear errors, warm-up, saved_model_cli."""
import io
import json
import os
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tests.support.forked_modules import run_python
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError
from tf_twobranch.evaluation.pointing_game import heat_map_maximum
from tf_twobranch.systems.npair.export import export_npair_model
from tf_twobranch.export.serving import read_warmup_requests
from tf_twobranch.features.images import load_images_at_size, resize
from tf_twobranch.systems.npair.features import encode_token_lists
from tf_twobranch.features.scene_cnn import build_scene_cnn
from tf_twobranch.systems.npair.heat_map_volume import localization_volume
from tf_twobranch.systems.npair.model import NPairLocalizationConfig, build_npair_model

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
IA = tf.errors.InvalidArgumentError
# saved_model_cli with the tensorflow-text ops registered (the captions are tokenized in the graph).
SAVED_MODEL_CLI_TEXT = ["-m", "tf_twobranch.tools.saved_model_cli"]   # run_python's argv
SIZE = 32
VOCABULARY = ["<pad>", "<unk>", "<start>", "<end>", "dog", "cat", "red", "ball", "runs", "park", "a", "the"]
MAX_WORDS = 5
# Not the defaults: the export must score with the model's aggregator and normalisation.
CONFIG = NPairLocalizationConfig(vocabulary_size=len(VOCABULARY), map_channels=8, map_size=2, word_dim=6,
                                 embed_dim=8, max_tokens=MAX_WORDS + 2, aggregator="max_text",
                                 normalisation="map")
CAPTIONS = ["a red dog runs", "The CAT, chasing a ball!", "dog dog park park the"]


def _jpeg(seed: int, height: int = SIZE, width: int = SIZE) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _pixels(jpegs) -> np.ndarray:
    """The model's input images as `load_images_at_size` makes them: decoded by PIL, other sizes resized
    whole by PIL's bilinear resize (`features.images.resize`)."""
    out = []
    for data in jpegs:
        image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        out.append(resize(image, SIZE, SIZE).astype(np.float32))
    return np.stack(out)


def _keras_outputs(model, jpegs, captions) -> dict:
    """What the export must return, from the Keras model and the Python caption encoder."""
    encoded = encode_token_lists([tokenize_caption(c) for c in captions], VOCABULARY, MAX_WORDS)
    batch = {"backbone_map": model.backbone(_pixels(jpegs), training=False), "token_ids": encoded.token_ids,
             "token_mask": encoded.token_mask}
    score = model(batch, training=False).numpy()
    maps, tokens = model.normalised(model.image_maps(batch), model.token_vectors(encoded.token_ids),
                                    encoded.token_mask)
    heat_maps = np.transpose(localization_volume(maps, tokens).numpy(), [0, 3, 1, 2])
    heat_maps = np.where(encoded.token_mask[:, :, None, None], heat_maps, 0.0)
    # The export's in-graph points follow the pointing game's default rule (the arg-max cell's centre).
    points = np.array([[heat_map_maximum(m, SIZE, SIZE) if on else (0, 0) for m, on in zip(maps_of_caption, mask)]
                       for maps_of_caption, mask in zip(heat_maps, encoded.token_mask)])
    return {"score": score, "heat_maps": heat_maps, "token_mask": encoded.token_mask, "points": points}


def _call(loaded, jpegs, captions, signature="localize") -> dict:
    out = loaded.signatures[signature](image_jpeg=tf.constant(list(jpegs), tf.string),
                                       caption=tf.constant(list(captions), tf.string))
    return {k: v.numpy() for k, v in out.items()}


def _assert_equal_outputs(got, want):
    np.testing.assert_allclose(got["score"], want["score"], atol=1e-4)
    np.testing.assert_allclose(got["heat_maps"], want["heat_maps"], atol=1e-4)
    np.testing.assert_array_equal(got["token_mask"], want["token_mask"])
    np.testing.assert_array_equal(got["points"], want["points"])


def _model():
    _, extractor = build_scene_cnn(SIZE, 10, feature_dim=8, widths=(4, 4, 8, 8))
    backbone = keras.Model(extractor.input, extractor.get_layer("global_pool").input)
    rng = np.random.default_rng(0)
    model = build_npair_model(CONFIG, rng.normal(size=(len(VOCABULARY), 6)).astype(np.float32), backbone=backbone)
    # Non-trivial batch-norm statistics, so that serving in training mode would show.
    bn = model.projection.get_layer("projection_bn")
    bn.moving_mean.assign(rng.normal(size=8).astype(np.float32) * 0.1)
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, size=8).astype(np.float32))
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = _model()
    export_dir = export_npair_model(model, tmp_path_factory.mktemp("npair") / "export", vocabulary=VOCABULARY,
                                    run_config={"experiment": "test"})
    return model, export_dir, tf.saved_model.load(str(export_dir))


def test_outputs_equal_the_keras_model(exported):
    model, _, loaded = exported
    assert set(loaded.signatures) == {"localize", "serving_default"}
    # Image 1 is not the input size: it is resized whole.
    jpegs = [_jpeg(1), _jpeg(2, 20, 44), _jpeg(3)]
    want = _keras_outputs(model, jpegs, CAPTIONS)
    assert np.ptp(want["score"]) > 1e-4 and np.abs(want["heat_maps"]).max() > 1e-2   # not vacuous
    for signature in ("localize", "serving_default"):
        got = _call(loaded, jpegs, CAPTIONS, signature)
        assert got["heat_maps"].shape == (3, MAX_WORDS + 2, 2, 2) and got["points"].dtype == np.int32
        _assert_equal_outputs(got, want)
    # Written by hand: unknown words ("chasing") are dropped, the rest lower-cased; "" off the words.
    assert [[t.decode() for t in row] for row in got["tokens"]] == [
        ["", "a", "red", "dog", "runs", "", ""], ["", "the", "cat", "a", "ball", "", ""],
        ["", "dog", "dog", "park", "park", "the", ""]]
    # A word's point is the maximum of its own upsampled map: it moves with the word.
    assert len({tuple(p) for p in got["points"][want["token_mask"]]}) > 1


def test_points_follow_the_pointing_game_rule(exported):
    """Ties (a constant 2x2 map: the non-word positions) point at the first pixel, (0, 0)."""
    _, _, loaded = exported
    got = _call(loaded, [_jpeg(4)], ["cat"])
    np.testing.assert_array_equal(got["token_mask"][0], [False, True, False, False, False, False, False])
    np.testing.assert_array_equal(got["points"][0, [0, 2, 3, 4, 5, 6]], 0)
    np.testing.assert_array_equal(got["heat_maps"][0, [0, 2, 3, 4, 5, 6]], 0.0)
    assert got["points"][0, 1].tolist() == list(heat_map_maximum(got["heat_maps"][0, 1], SIZE, SIZE))


@pytest.mark.parametrize("rule", ["cell_centre", "argmax"])
def test_in_graph_points_equal_the_pointing_games_rule(rule):
    from tf_twobranch.systems.npair.export import heat_map_points

    rng = np.random.default_rng(5)
    maps = rng.normal(size=(2, 3, 6, 6)).astype(np.float32)
    maps[0, 1] = 0.0                         # a tie everywhere: the first cell / pixel
    maps[1, 2, 0, 5] = 9.0                   # the top-right edge cell (LocNet's rule: the edge pixel)
    mask = np.array([[True, True, False], [True, True, True]])
    got = heat_map_points(tf.constant(maps), tf.constant(mask), 96, rule).numpy()
    want = [[heat_map_maximum(m, 96, 96, rule) if on else (0, 0) for m, on in zip(b, mb)]
            for b, mb in zip(maps, mask)]
    np.testing.assert_array_equal(got, want)
    assert got[1, 2].tolist() == ([88, 8] if rule == "cell_centre" else [88, 0])


@pytest.mark.parametrize("jpegs,captions,message", [
    (["jpeg", b"GIF89a not a jpeg"], ["a dog", "a cat"],
     r"image_jpeg: cannot decode image; expected JPEG or PNG bytes .*first bad element index:\] \[1\]"),
    (["truncated", "jpeg"], ["a dog", "a cat"], r"image_jpeg: cannot decode image; the JPEG/PNG data is "
                                                  r"truncated or corrupt .*first bad element index:\] \[0\]"),
    (["jpeg", "jpeg"], ["a dog", "  "], r"caption must be non-empty strings; .* at index\] \[1\]"),
    (["jpeg", "jpeg"], ["zebra giraffe!", "a dog"],
     r"caption has no word of the vocabulary \(words outside it are dropped\); first such element index:\] "
     r"\[0\] \[caption:\] \[zebra giraffe!\]"),
    (["jpeg", "jpeg"], ["a dog"], r"image_jpeg and caption must have the same batch size .*got\] \[2\] "
                                  r"\[images and\] \[1\] \[captions\]"),
    ([], [], r"image_jpeg is empty"),
])
def test_bad_requests_fail_with_clear_messages(exported, jpegs, captions, message):
    _, _, loaded = exported
    stand_ins = {"jpeg": _jpeg(5), "truncated": _jpeg(5)[:80]}
    jpegs = [stand_ins.get(data, data) for data in jpegs]
    with pytest.raises(IA, match=message):
        _call(loaded, jpegs, captions)


def test_export_keeps_vocabulary_config_and_warmup(exported):
    model, export_dir, loaded = exported
    assert [w.decode() for w in loaded.vocabulary.numpy()] == VOCABULARY
    assert json.loads(loaded.config_json.numpy().decode()) == model.config.to_dict()
    run_config = json.loads((export_dir / "assets.extra" / "run_config.json").read_text())
    assert run_config["experiment"] == "test"
    assert run_config["npair_export"]["vocabulary"] == VOCABULARY
    assert (run_config["npair_export"]["image_size"], run_config["npair_export"]["max_words"]) == (SIZE, MAX_WORDS)
    requests = read_warmup_requests(export_dir)
    assert sorted(name for name, _ in requests) == ["localize", "serving_default"]
    for name, inputs in requests:
        jpegs, captions = list(inputs["image_jpeg"]), [c.decode() for c in inputs["caption"]]
        _assert_equal_outputs(_call(loaded, jpegs, captions, name), _keras_outputs(model, jpegs, captions))


def test_model_and_vocabulary_must_fit(exported, tmp_path):
    model, export_dir, _ = exported
    with pytest.raises(ConfigError, match="got 11 entries but the model's vocabulary_size is 12"):
        export_npair_model(model, tmp_path / "a", vocabulary=VOCABULARY[:-1])
    with pytest.raises(ConfigError, match=r"must start with \['<pad>', '<unk>', '<start>', '<end>'\]"):
        export_npair_model(model, tmp_path / "b", vocabulary=["<pad>", "<unk>", "dog", "<start>", "<end>",
                                                               *VOCABULARY[5:]])
    with pytest.raises(ConfigError, match=r"repeated: \['dog'\]"):
        export_npair_model(model, tmp_path / "c", vocabulary=VOCABULARY[:-1] + ["dog"])
    with pytest.raises(ConfigError, match="needs the model's backbone"):
        export_npair_model(build_npair_model(CONFIG), tmp_path / "d", vocabulary=VOCABULARY)
    with pytest.raises(FileExistsError):
        export_npair_model(model, export_dir, vocabulary=VOCABULARY, overwrite=False)


@pytest.mark.slow
def test_saved_model_cli_run(exported, tmp_path):
    """`saved_model_cli run` (the TF1-style loader, as TF Serving) returns the Keras scores."""
    model, export_dir, _ = exported
    jpegs = [_jpeg(6), _jpeg(7, 40, 24)]
    np.save(tmp_path / "jpegs.npy", np.array(jpegs, dtype=object))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [*SAVED_MODEL_CLI_TEXT, "run", "--dir", str(export_dir), "--tag_set", "serve",
               "--signature_def", "localize", "--inputs", f"image_jpeg={tmp_path / 'jpegs.npy'}",
               "--input_exprs", f"caption={CAPTIONS[:2]}", "--outdir", str(tmp_path / "out")]
    proc = run_python(command, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = _keras_outputs(model, jpegs, CAPTIONS[:2])
    np.testing.assert_allclose(np.load(tmp_path / "out" / "score.npy"), want["score"], atol=1e-4)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "points.npy"), want["points"])


def test_real_jpegs_and_captions_equal_the_offline_pipeline(realdata, tmp_path):
    """Real Flickr30K JPEGs and their raw captions: the export's pixels are `load_images_at_size`'s bit
    for bit, and its scores and heat maps equal the offline pipeline's (backbone maps of those pixels,
    `encode_token_lists`, the Keras model)."""
    from tf_twobranch.export import serving

    ids = ["100652400", "1016887272", "101958970", "4945942737"]
    paths = [realdata / "flickr30k" / "images" / f"{i}.jpg" for i in ids]
    wanted = {f"{i}.jpg#{k}" for i in ids for k in (0, 3)}
    captions = {}
    with open(realdata / "flickr30k" / "captions_multi30k.token", encoding="utf-8") as lines:
        for line in lines:
            key, _, caption = line.rstrip("\n").partition("\t")
            if key in wanted:
                captions[key] = caption
    pairs = [(n, captions[f"{i}.jpg#{k}"]) for k in (0, 3) for n, i in enumerate(ids)]
    tokens = [tokenize_caption(c) for _, c in pairs]
    words = sorted({t for caption in tokens for t in caption} - {"hat", "climbers"})   # two words dropped
    vocabulary = ["<pad>", "<unk>", "<start>", "<end>"] + words
    max_words = max(sum(t in words for t in caption) for caption in tokens)
    config = NPairLocalizationConfig(vocabulary_size=len(vocabulary), map_channels=8, map_size=2, word_dim=6,
                                     embed_dim=8, max_tokens=max_words + 2)
    _, extractor = build_scene_cnn(SIZE, 10, feature_dim=8, widths=(4, 4, 8, 8))
    backbone = keras.Model(extractor.input, extractor.get_layer("global_pool").input)
    rng = np.random.default_rng(1)
    model = build_npair_model(config, rng.normal(size=(len(vocabulary), 6)).astype(np.float32), backbone=backbone)
    export_dir = export_npair_model(model, tmp_path / "export", vocabulary=vocabulary)
    loaded = tf.saved_model.load(str(export_dir))

    jpegs = [paths[n].read_bytes() for n, _ in pairs]
    offline_pixels = load_images_at_size([paths[n] for n, _ in pairs], SIZE)
    served_pixels = serving.decode_jpeg_batch(tf.constant(jpegs), SIZE, "image_jpeg", pil_resize=True).numpy()
    np.testing.assert_array_equal(served_pixels, offline_pixels.astype(np.float32))
    encoded = encode_token_lists(tokens, vocabulary, max_words)
    batch = {"backbone_map": model.backbone(offline_pixels.astype(np.float32), training=False),
             "token_ids": encoded.token_ids, "token_mask": encoded.token_mask}
    score = model(batch, training=False).numpy()
    maps, vectors = model.normalised(model.image_maps(batch), model.token_vectors(encoded.token_ids),
                                     encoded.token_mask)
    heat_maps = np.where(encoded.token_mask[:, :, None, None],
                         np.transpose(localization_volume(maps, vectors).numpy(), [0, 3, 1, 2]), 0.0)
    got = serving.call_signature(loaded, "localize", image_jpeg=jpegs, caption=[c for _, c in pairs])
    assert np.ptp(score) > 1e-4                                        # not vacuous
    np.testing.assert_allclose(got["score"].numpy(), score, atol=1e-4)
    np.testing.assert_allclose(got["heat_maps"].numpy(), heat_maps, atol=1e-4)
    np.testing.assert_array_equal(got["token_mask"].numpy(), encoded.token_mask)
    serving.replay_warmup_file(export_dir)


def test_long_captions_are_clipped_by_the_evaluations_rule(exported):
    """One caption-length rule (`prepare_npair.kept_caption_words`): the export keeps the first max_words
    known words, as evaluation's `encode_token_lists` does, instead of refusing the caption (issue 39
    item 6: 13 of the first 100 embedded test captions were refused)."""
    from tf_twobranch.systems.npair.features import CAPTION_LENGTH_RULE
    model, export_dir, loaded = exported
    captions = ["the zebra cat runs a dog park ball", "a dog"]       # 7 known words (zebra unknown), 2
    jpegs = [_jpeg(8), _jpeg(9)]
    got = _call(loaded, jpegs, captions)
    assert [t.decode() for t in got["tokens"][0]] == ["", "the", "cat", "runs", "a", "dog", ""]
    _assert_equal_outputs(got, _keras_outputs(model, jpegs, captions))
    run_config = json.loads((export_dir / "assets.extra" / "run_config.json").read_text())
    assert run_config["npair_export"]["captions"] == CAPTION_LENGTH_RULE
