"""SavedModel export: towers and scoring, raw strings and JPEG bytes, validation, warm-up, saved_model_cli."""
import io
import json
import os
import pathlib
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tests.support.baselines import randomize_weights
from tf_twobranch.export import serving
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.systems.two_branch.export import export_saved_model
from tf_twobranch.features.image_features import extract_image_features
from tf_twobranch.features.text_features import TfidfEncoder
from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
SAVED_MODEL_CLI = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
# saved_model_cli with the tensorflow-text ops registered (graphs with string inputs).
SAVED_MODEL_CLI_TEXT = [sys.executable, "-m", "tf_twobranch.tools.saved_model_cli"]
IA = tf.errors.InvalidArgumentError
SIGNATURES = ["embed_images", "embed_texts", "score", "serving_default"]
# Raw-input exports keep feature-vector signatures for users with their own features.
RAW_SIGNATURES = SIGNATURES + ["embed_image_features", "embed_text_features", "score_features"]
CAPTIONS = ["a red seven on the left", "two blue threes above a green one", "a small yellow four",
            "the blue four on the right", "a red three and a green seven"]
IMAGE_SIZE = 12


def _cfg(**kw):
    base = dict(image_dim=6, text_dim=5, image_hidden=(8,), text_hidden=(8,), embed_dim=4,
                dropout=0.0)
    base.update(kw)
    return TwoBranchConfig(**base)


def _jpeg(seed, height=20, width=16):
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="JPEG")
    return out.getvalue()


def _run_commands(commands):
    """Runs the CLI commands (``python -m module args``) with one TensorFlow start-up for all of them."""
    from tests.support.forked_modules import run_modules
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return [tuple(r) for r in run_modules([c[2:] for c in commands], env=env)]


@pytest.fixture(scope="module")
def feature_export(tmp_path_factory):
    model = build_model(_cfg())
    return model, export_saved_model(model, tmp_path_factory.mktemp("features") / "export")


@pytest.fixture(scope="module")
def raw_input_export(tmp_path_factory):
    """A model on tf-idf features and CNN features, exported to take captions and JPEG bytes."""
    encoder = TfidfEncoder(max_features=20, stop_words=None).fit([tokenize_caption(c) for c in CAPTIONS])
    pixels = keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu")(keras.layers.Rescaling(1 / 255.0)(pixels))
    backbone = keras.Model(pixels, keras.layers.Dense(6)(keras.layers.GlobalAveragePooling2D()(x)))
    model = build_model(_cfg(text_dim=encoder.output_dim))
    path = export_saved_model(model, tmp_path_factory.mktemp("raw") / "export", text_encoder=encoder,
                              image_backbone=backbone)
    return model, encoder, backbone, path


def test_feature_towers_round_trip(feature_export):
    model, path = feature_export
    loaded = tf.saved_model.load(str(path))
    img = np.random.rand(3, 6).astype(np.float32)
    txt = np.random.rand(4, 5).astype(np.float32)
    np.testing.assert_allclose(loaded.signatures["embed_images"](image_features=img)["image_embedding"],
                               model.embed_images(img), atol=1e-6)
    scores = loaded.signatures["score"](image_features=img, text_features=txt)["scores"].numpy()
    np.testing.assert_allclose(scores, model.embed_images(img) @ model.embed_texts(txt).T, atol=1e-5)
    cfg = json.loads((path / "assets.extra" / "run_config.json").read_text())
    assert cfg["model"]["image_dim"] == 6
    assert cfg["serving"]["embed_texts_input"] == "text_features"
    with pytest.raises(IA, match="image_features contains NaN or inf values"):
        bad = img.copy(); bad[0, 0] = np.nan
        loaded.signatures["embed_images"](image_features=bad)


@pytest.mark.parametrize("inputs,message", [
    (dict(image_features=np.ones((0, 6), np.float32)), "image_features is empty"),
])
def test_bad_feature_requests(feature_export, inputs, message):
    loaded = tf.saved_model.load(str(feature_export[1]))
    with pytest.raises(IA, match=message):
        loaded.signatures["embed_images"](**inputs)


@pytest.mark.parametrize("inputs,message", [
    (dict(image_features=np.ones((2, 7), np.float32)), r"expected float32 of shape \(batch, 6\), got a float32 "
                                                       r"array of shape \(2, 7\)"),
    (dict(image_features=np.ones((6,), np.float32)), r"expected float32 of shape \(batch, 6\)"),
    (dict(image_features=np.array(["a"])), r"expected float32 of shape \(batch, 6\), got a <U1 array"),
    (dict(image_features=np.ones((2, 6))), r"expected float32 of shape \(batch, 6\), got a float64 array"),
])
def test_feature_sizes_are_declared(feature_export, inputs, message):
    """The signature declares (None, image_dim): a wrong shape or dtype is refused before the graph runs,
    naming the input and the expected shape."""
    loaded = tf.saved_model.load(str(feature_export[1]))
    spec = serving.signature_input_specs(loaded.signatures["embed_images"])["image_features"]
    assert spec.shape.as_list() == [None, 6]
    with pytest.raises(UserInputError, match=r"signature 'embed_images', input 'image_features': " + message):
        serving.call_signature(loaded, "embed_images", **inputs)


@pytest.fixture(scope="module", params=["embedding", "similarity"])
def random_weight_export(request, tmp_path_factory):
    model = randomize_weights(build_model(_cfg(kind=request.param, similarity_head=(8,))), seed=7)
    return model, export_saved_model(model, tmp_path_factory.mktemp(f"random_{request.param}") / "e")


def _keras_scores(model, image_embeds, text_embeds):
    """(num_images, num_texts) scores of the Keras model: dot product or similarity head."""
    return model.score_fn(image_embeds, text_embeds)(0, len(text_embeds))


def test_warmup_file_replays_on_the_loaded_model(random_weight_export):
    """Every warm-up request, replayed on the SavedModel, gives the Keras model's outputs."""
    model, path = random_weight_export
    requests = serving.read_warmup_requests(path)
    assert [name for name, _ in requests] == SIGNATURES
    loaded = tf.saved_model.load(str(path))
    for name, inputs in requests:
        outputs = {k: v.numpy() for k, v in
                   loaded.signatures[name](**{k: tf.constant(v) for k, v in inputs.items()}).items()}
        if name == "embed_images":
            want = {"image_embedding": model.embed_images(inputs["image_features"])}
        elif name == "embed_texts":
            want = {"text_embedding": model.embed_texts(inputs["text_features"])}
        else:  # score and serving_default
            want = {"scores": _keras_scores(model, model.embed_images(inputs["image_features"]),
                                            model.embed_texts(inputs["text_features"]))}
        assert outputs.keys() == want.keys(), name
        for key, value in want.items():
            # Not a vacuous comparison: the random weights move zero inputs off zero.
            assert np.abs(value).max() > 1e-3, (name, key, value)
            assert outputs[key].shape == value.shape, (name, key)
            np.testing.assert_allclose(outputs[key], value, atol=1e-5, rtol=1e-5,
                                       err_msg=f"{name}/{key}")


def test_raw_input_warmup_file_replays_like_keras(raw_input_export):
    """The JPEG + caption warm-up requests give the Keras backbone/encoder/tower outputs."""
    model, encoder, backbone, path = raw_input_export
    import tensorflow_text  # noqa: F401  (tokenizer ops of the in-graph text encoder)
    requests = serving.read_warmup_requests(path)
    assert [name for name, _ in requests] == RAW_SIGNATURES
    loaded = tf.saved_model.load(str(path))

    def images(inputs):
        return _keras_image_embeddings(model, backbone, [bytes(j) for j in inputs["image_jpeg"]])

    def texts(inputs):
        captions = [c.decode("utf-8") if isinstance(c, bytes) else str(c) for c in inputs["captions"]]
        return model.embed_texts(encoder.transform([tokenize_caption(c) for c in captions]))

    def image_features(inputs):
        return model.embed_images(inputs["image_features"])

    def text_features(inputs):
        return model.embed_texts(inputs["text_features"])

    for name, inputs in requests:
        outputs = {k: v.numpy() for k, v in
                   loaded.signatures[name](**{k: tf.constant(v) for k, v in inputs.items()}).items()}
        if name == "embed_images":
            want = {"image_embedding": images(inputs)}
        elif name == "embed_texts":
            want = {"text_embedding": texts(inputs)}
        elif name == "embed_image_features":
            want = {"image_embedding": image_features(inputs)}
        elif name == "embed_text_features":
            want = {"text_embedding": text_features(inputs)}
        elif name == "score_features":
            want = {"scores": image_features(inputs) @ text_features(inputs).T}
        else:
            want = {"scores": images(inputs) @ texts(inputs).T}
        assert outputs.keys() == want.keys(), name
        for key, value in want.items():
            assert outputs[key].shape == value.shape, (name, key)
            np.testing.assert_allclose(outputs[key], value, atol=1e-5, err_msg=f"{name}/{key}")


def test_similarity_network_scores(tmp_path):
    model = build_model(_cfg(kind="similarity", similarity_head=(8,)))
    loaded = tf.saved_model.load(str(export_saved_model(model, tmp_path / "e")))
    img = np.random.rand(2, 6).astype(np.float32)
    txt = np.random.rand(3, 5).astype(np.float32)
    scores = loaded.score(img, txt)["scores"].numpy()
    expected = model.score_fn(model.embed_images(img), model.embed_texts(txt))(0, 3)
    np.testing.assert_allclose(scores, expected, atol=1e-5)


def _keras_image_embeddings(model, backbone, jpegs):
    """The offline path: PIL decode, `extract_image_features` (its default ten crops), the image tower."""
    images = [np.asarray(Image.open(io.BytesIO(j)).convert("RGB")) for j in jpegs]
    return model.embed_images(extract_image_features(images, backbone))


def test_captions_and_jpeg_inputs_match_keras(raw_input_export):
    model, encoder, backbone, path = raw_input_export
    import tensorflow_text  # noqa: F401  (tokenizer ops of the in-graph text encoder)
    loaded = tf.saved_model.load(str(path))
    jpegs = [_jpeg(0), _jpeg(1, 30, 40)]
    images = loaded.signatures["embed_images"](image_jpeg=tf.constant(jpegs))["image_embedding"].numpy()
    np.testing.assert_allclose(images, _keras_image_embeddings(model, backbone, jpegs), atol=1e-5)
    texts = loaded.signatures["embed_texts"](captions=tf.constant(CAPTIONS[:3]))["text_embedding"].numpy()
    want = model.embed_texts(encoder.transform([tokenize_caption(c) for c in CAPTIONS[:3]]))
    np.testing.assert_allclose(texts, want, atol=1e-5)
    scores = loaded.signatures["serving_default"](image_jpeg=tf.constant(jpegs),
                                                  captions=tf.constant(CAPTIONS[:3]))["scores"].numpy()
    np.testing.assert_allclose(scores, images @ texts.T, atol=1e-5)
    with pytest.raises(IA, match="image_jpeg: cannot decode image; expected JPEG or PNG bytes"):
        loaded.signatures["embed_images"](image_jpeg=tf.constant([jpegs[0], b"<html>not an image</html>"]))
    with pytest.raises(IA, match="captions must be non-empty strings"):
        loaded.signatures["embed_texts"](captions=tf.constant(["a dog", ""]))
    with pytest.raises(UserInputError, match=r"input 'captions': expected string of shape \(batch,\)"):
        serving.call_signature(loaded, "embed_texts", captions=[["a dog"]])
    assert [name for name, _ in serving.read_warmup_requests(path)] == RAW_SIGNATURES


def test_incompatible_encoder_or_backbone(tmp_path):
    encoder = TfidfEncoder(max_features=20, stop_words=None).fit([tokenize_caption(c) for c in CAPTIONS])
    with pytest.raises(ConfigError, match="text_dim"):
        export_saved_model(build_model(_cfg(text_dim=encoder.output_dim + 1)), tmp_path / "a",
                           text_encoder=encoder)
    backbone = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(3)])
    with pytest.raises(ConfigError, match="image_dim"):
        export_saved_model(build_model(_cfg()), tmp_path / "b", image_backbone=backbone)


@pytest.fixture(scope="module")
def lstm_export(tmp_path_factory):
    vocab = ["<pad>", "<unk>", "a", "red", "seven"]
    model = build_model(_cfg(text_encoder="lstm", vocabulary=vocab, max_len=4, word_dim=3,
                             lstm_units=4))
    return model, export_saved_model(model, tmp_path_factory.mktemp("lstm") / "export")


def test_lstm_tower_takes_raw_strings(lstm_export):
    model, path = lstm_export
    loaded = tf.saved_model.load(str(path))
    out = loaded.signatures["embed_texts"](captions=tf.constant(["a red seven", "A RED seven!"]))
    emb = out["text_embedding"].numpy()
    np.testing.assert_allclose(emb[0], emb[1], atol=1e-6)  # same tokens after normalisation
    np.testing.assert_allclose(emb, model.embed_texts(np.array([[2, 3, 4, 0]] * 2, np.int32)), atol=1e-5)
    with pytest.raises(IA, match="non-empty"):
        loaded.signatures["embed_texts"](captions=tf.constant(["a red seven", "  "]))


@pytest.mark.slow
def test_saved_model_cli_show_and_run(feature_export, raw_input_export, lstm_export, tmp_path):
    """saved_model_cli returns the Keras embeddings; bad requests fail with the in-graph messages."""
    model, feature_dir = feature_export
    raw_model, encoder, backbone, raw_dir = raw_input_export
    features = np.round(np.random.default_rng(0).random((2, 6)), 3)
    nan_features = features.copy(); nan_features[1, 3] = np.nan
    np.save(tmp_path / "nan.npy", nan_features.astype(np.float32))
    jpegs = [_jpeg(2), _jpeg(3, 24, 24)]
    np.save(tmp_path / "jpegs.npy", np.array(jpegs, dtype=object))

    def run(cli, directory, signature, *args, outdir=None):
        command = [*cli, "run", "--dir", str(directory), "--tag_set", "serve", "--signature_def", signature, *args]
        return command + (["--outdir", str(outdir)] if outdir else [])

    results = _run_commands([
        [*SAVED_MODEL_CLI, "show", "--dir", str(raw_dir), "--all"],
        run(SAVED_MODEL_CLI, feature_dir, "embed_images", "--input_exprs",
            f"image_features={features.tolist()}", outdir=tmp_path / "features"),
        run(SAVED_MODEL_CLI, feature_dir, "embed_images", "--inputs", f"image_features={tmp_path / 'nan.npy'}"),
        run(SAVED_MODEL_CLI_TEXT, raw_dir, "score", "--inputs", f"image_jpeg={tmp_path / 'jpegs.npy'}",
            "--input_exprs", f"captions={CAPTIONS[:3]}", outdir=tmp_path / "raw"),
        run(SAVED_MODEL_CLI_TEXT, raw_dir, "embed_texts", "--input_exprs", 'captions=["a dog", " "]'),
        run(SAVED_MODEL_CLI_TEXT, raw_dir, "embed_images", "--input_exprs", "image_jpeg=[b'GIF89a not a jpeg']"),
        run(SAVED_MODEL_CLI_TEXT, lstm_export[1], "embed_texts", "--input_exprs", 'captions=["a red seven", "seven"]',
            outdir=tmp_path / "lstm"),
    ])
    rc, show, err = results[0]
    assert rc == 0, err
    for name in SIGNATURES:
        assert f"signature_def['{name}']" in show
    for name in ("image_jpeg", "captions"):   # sizes declared (and checked in the graph too)
        assert f"inputs['{name}'] tensor_info:\n        dtype: DT_STRING\n        shape: (-1)" in show
    assert "inputs['image_features'] tensor_info:\n        dtype: DT_FLOAT\n        shape: (-1, 6)" in show
    assert "outputs['image_embedding'] tensor_info:\n        dtype: DT_FLOAT\n        shape: (-1, 4)" in show

    rc, _, err = results[1]
    assert rc == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "features" / "image_embedding.npy"),
                               model.embed_images(features.astype(np.float32)), atol=1e-5)
    rc, _, err = results[3]
    assert rc == 0, err
    texts = raw_model.embed_texts(encoder.transform([tokenize_caption(c) for c in CAPTIONS[:3]]))
    np.testing.assert_allclose(np.load(tmp_path / "raw" / "scores.npy"),
                               _keras_image_embeddings(raw_model, backbone, jpegs) @ texts.T, atol=1e-5)
    rc, _, err = results[6]
    assert rc == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "lstm" / "text_embedding.npy"),
                               lstm_export[0].embed_texts(np.array([[2, 3, 4, 0], [4, 0, 0, 0]], np.int32)),
                               atol=1e-5)
    for (rc, _, err), message in zip([results[2], results[4], results[5]], [
            "image_features contains NaN or inf values; first bad row:] [1]",
            "captions must be non-empty strings; got an empty or whitespace-only string at index] [1]",
            "image_jpeg: cannot decode image; expected JPEG or PNG bytes"]):
        assert rc != 0 and "InvalidArgumentError" in err and message in err, err[-2000:]


@pytest.mark.parametrize("features,message", [
    (np.zeros((6,), np.float32), r"image_features must have shape \(batch, 6\); got a tensor of rank\] \[1\] "
                                 r"\[and shape\] \[6\]"),
    (np.zeros((2, 5), np.float32), r"image_features must have shape \(batch, 6\); got shape\] \[2 5\]"),
])
def test_direct_calls_of_other_shapes_meet_the_graphs_checks(feature_export, features, message):
    """The signature declares (None, 6); a client feeding it directly (TF Serving, ``loaded.signatures``)
    is not held to that, and the graph's check names the shape (issue 39 item 6), not ``Invalid
    reduction dimension``."""
    _, path = feature_export
    loaded = tf.saved_model.load(str(path))
    with pytest.raises(IA, match=message):
        loaded.signatures["embed_images"](image_features=tf.constant(features))


def test_next_hints_name_the_saved_model_cli_wrapper():
    """The experiments' "Next:" lines name the package's wrapper: the stock ``saved_model_cli show``
    cannot load the tensorflow-text ops and prints "Concrete Functions: N/A" (issue 39)."""
    from experiments import two_branch_retrieval, dual_path

    hints = [two_branch_retrieval.follow_up({"run_dir": "runs/a", "export_dir": "runs/a/export",
                                                 "flags": {"model": "two_branch"}}),
             dual_path.follow_up({"run_dir": "runs/b", "export_dir": "runs/b/export", "stages": ["stage_1"]})]
    for hint, run in zip(hints, "ab"):
        assert f"python -m tf_twobranch.tools.saved_model_cli show --dir runs/{run}/export --all" in hint, hint
        assert "\nsaved_model_cli" not in hint and not hint.startswith("saved_model_cli"), hint
