"""Two-branch export from raw inputs (issue 25 item 1): real Flickr30K JPEGs and captions give the offline
pipeline's embeddings and scores, the warm-up file replays, bad elements are named, and the pipeline's
--export writes the raw-input export."""
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support.baselines import randomize_weights
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import UserInputError
from tf_twobranch.export import serving
from tf_twobranch.systems.two_branch.export import export_saved_model
from tf_twobranch.features.image_features import extract_image_features
from tf_twobranch.features.scene_cnn import build_scene_cnn
from tf_twobranch.features.text_features import FisherVectorEncoder, MeanWordVectorEncoder, TfidfEncoder
from tf_twobranch.features.word_vectors import train_word_vectors
from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model

IA = tf.errors.InvalidArgumentError
REAL_IMAGES = ["100652400", "1016887272", "101958970"]
RAW_SIGNATURES = {"embed_images", "embed_texts", "score", "serving_default", "embed_image_features",
                  "embed_text_features", "score_features"}


@pytest.fixture(scope="module")
def real(realdata):
    """Three real JPEGs (500x375 and others) and real captions: those of the images, and training captions."""
    from tf_twobranch.data.formats import read_token_file

    corpus = read_token_file(realdata / "flickr30k" / "captions_multi30k.token")
    index = {image_id: n for n, image_id in enumerate(corpus.image_ids)}
    captions = [c for i in REAL_IMAGES for c in np.asarray(corpus.captions, object)[corpus.caption_image == index[i]][:2]]
    paths = [realdata / "flickr30k" / "images" / f"{i}.jpg" for i in REAL_IMAGES]
    train = [tokenize_caption(c) for c in corpus.captions[:800]]
    return paths, list(captions), train


def _plain_cnn(size, dim):
    """A tiny CNN with the ImageNet backbones' contract (RGB 0..255 in, its own scaling)."""
    pixels = keras.Input((size, size, 3))
    x = keras.layers.Conv2D(4, 3, strides=2, activation="relu")(keras.layers.Rescaling(1 / 255.0)(pixels))
    return randomize_weights(keras.Model(pixels, keras.layers.Dense(dim)(keras.layers.GlobalMaxPooling2D()(x))),
                             seed=3)


# (backbone, views as prepare.image_view_options gives them, text encoder, model kind)
CASES = {
    # The main job's row: the scene CNN's ten 7/8 crops resized back to its input, Fisher HGLMM + PCA.
    "scene_cnn_ten_crop_fisher": ("scene_cnn", dict(ten_crop=True, crop_size=28, resize_to=32), "fisher", "embedding"),
    # An ImageNet-style backbone: ten crops of the input size out of 256/224 of it; mean vectors.
    "plain_ten_crop_mean": ("plain", dict(ten_crop=True, crop_size=None, resize_to=None), "mean", "similarity"),
    # --noten_crop: the whole image resized to the backbone input; tf-idf.
    "plain_whole_tfidf": ("plain", dict(ten_crop=False, crop_size=None, resize_to=None), "tfidf", "embedding"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def real_export(request, real, tmp_path_factory):
    backbone_kind, views, text_kind, kind = CASES[request.param]
    paths, captions, train = real
    if backbone_kind == "scene_cnn":
        _, backbone = build_scene_cnn(32, 10, feature_dim=8, widths=(4, 4, 8, 8))
        randomize_weights(backbone, seed=2)
    else:
        backbone = _plain_cnn(24, 8)
    if text_kind == "tfidf":
        encoder = TfidfEncoder(max_features=60).fit(train)
    else:
        vectors = train_word_vectors(train, dim=6, min_count=2, seed=0)
        encoder = (MeanWordVectorEncoder(vectors) if text_kind == "mean" else
                   FisherVectorEncoder(vectors, num_components=2, mixture="hglmm", pca_dim=10, max_iter=5,
                                       pca_max_sentences=400, seed=0).fit(train))
    model = randomize_weights(build_model(TwoBranchConfig(
        kind=kind, image_dim=8, text_dim=encoder.output_dim, image_hidden=(8,), text_hidden=(8,), embed_dim=4,
        dropout=0.0, similarity_head=(6,))), seed=5)
    path = export_saved_model(model, tmp_path_factory.mktemp(request.param) / "export", text_encoder=encoder,
                              image_backbone=backbone, **views)
    import tensorflow_text  # noqa: F401  (tokenizer ops of the in-graph text encoder)
    return model, backbone, views, encoder, path


def test_real_jpegs_and_captions_equal_the_offline_pipeline(real, real_export):
    """extract_image_features (same backbone and views) + the numpy encoder + the Keras towers = the export."""
    paths, captions, _ = real
    model, backbone, views, encoder, path = real_export
    loaded = tf.saved_model.load(str(path))
    assert RAW_SIGNATURES <= set(loaded.signatures)
    image_features = extract_image_features(paths, backbone, **views)
    text_features = encoder.transform([tokenize_caption(c) for c in captions])
    images_offline = np.asarray(model.embed_images(image_features))
    texts_offline = np.asarray(model.embed_texts(text_features))
    scores_offline = model.score_fn(images_offline, texts_offline)(0, len(captions))
    assert np.ptp(scores_offline) > 1e-3                                   # not a vacuous comparison

    jpegs = [p.read_bytes() for p in paths]
    images = serving.call_signature(loaded, "embed_images", image_jpeg=jpegs)["image_embedding"].numpy()
    np.testing.assert_allclose(images, images_offline, atol=1e-4)
    texts = serving.call_signature(loaded, "embed_texts", captions=captions)["text_embedding"].numpy()
    np.testing.assert_allclose(texts, texts_offline, atol=1e-4)
    for name in ("score", "serving_default"):
        scores = serving.call_signature(loaded, name, image_jpeg=jpegs, captions=captions)["scores"].numpy()
        np.testing.assert_allclose(scores, scores_offline, atol=1e-4)
    # Users with their own features: the feature signatures are the towers alone.
    scores = serving.call_signature(loaded, "score_features", image_features=image_features,
                                    text_features=text_features.astype(np.float32))["scores"].numpy()
    np.testing.assert_allclose(scores, scores_offline, atol=1e-4)

    config = json.loads((path / "assets.extra" / "run_config.json").read_text())["serving"]
    assert (config["embed_images_input"], config["embed_texts_input"]) == ("image_jpeg", "captions")
    assert config["image_views"]["ten_crop"] == views["ten_crop"]
    assert config["text_encoder"] == {FisherVectorEncoder: "TFFisherVectorLayer", TfidfEncoder: "TFTfidfLayer",
                                      MeanWordVectorEncoder: "TFMeanVectorLayer"}[type(encoder)]


def test_warmup_file_replays(real_export):
    path = real_export[-1]
    assert {name for name, _ in serving.read_warmup_requests(path)} == RAW_SIGNATURES
    serving.replay_warmup_file(path)


def test_signatures_declare_their_sizes(real_export):
    model, *_, path = real_export
    loaded = tf.saved_model.load(str(path))
    shapes = {name: {k: spec.shape.as_list() for k, spec in
                     serving.signature_input_specs(loaded.signatures[name]).items()} for name in RAW_SIGNATURES}
    assert shapes["score"] == {"image_jpeg": [None], "captions": [None]}
    assert shapes["score_features"] == {"image_features": [None, 8], "text_features": [None, model.config.text_dim]}


def test_bad_elements_are_named(real, real_export):
    """A non-JPEG element and an empty caption in a mixed batch: InvalidArgument naming the input and index."""
    paths, captions, _ = real
    loaded = tf.saved_model.load(str(real_export[-1]))
    jpegs = [p.read_bytes() for p in paths]
    with pytest.raises(IA, match=r"image_jpeg: cannot decode image; expected JPEG or PNG bytes .*first bad element "
                                 r"index:\] \[2\]"):
        serving.call_signature(loaded, "embed_images", image_jpeg=jpegs[:2] + [b"GIF89a not a jpeg"])
    with pytest.raises(IA, match=r"image_jpeg: cannot decode image; the JPEG/PNG data is truncated or corrupt.*"
                                 r"first bad element index:\] \[1\]"):
        serving.call_signature(loaded, "embed_images", image_jpeg=[jpegs[0], jpegs[1][:300], jpegs[2]])
    with pytest.raises(IA, match=r"captions must be non-empty strings; got an empty or whitespace-only string at "
                                 r"index\] \[1\]"):
        serving.call_signature(loaded, "score", image_jpeg=jpegs, captions=[captions[0], " ", captions[1]])
    with pytest.raises(UserInputError, match=r"input 'image_jpeg': expected string of shape \(batch,\), got a "
                                             r"uint8 array .*\(pixels\?\)"):
        serving.call_signature(loaded, "embed_images", image_jpeg=np.zeros((1, 8, 8, 3), np.uint8))


# ------------------------------------------------------------------ the pipeline's --export, end to end

def test_pipeline_export_takes_jpeg_bytes_and_captions(tmp_path_factory):
    """The main job's row (b6: scene CNN ten crops, Fisher HGLMM) on a tiny generated dataset: --export writes
    the raw-input export, its metadata names the raw inputs, and the test split's JPEG files and captions give
    the embeddings of the cached features the row was evaluated on."""
    from tensorflow.python.tools import saved_model_utils

    from tests.support.serving_exports import tiny_b6_run
    from tf_twobranch.data.retrieval_data import load_caption_splits
    from tf_twobranch.runs import load_run

    dataset, run_dir = tiny_b6_run(tmp_path_factory)     # trained with --export (shared with the run tool's tests)
    record = json.loads((run_dir / "results.json").read_text())
    export_dir = run_dir / "export"
    assert record["export_dir"] == str(export_dir)
    assert record["export_inputs"] == {"image": "image_jpeg", "text": "captions", "notes": []}
    serving_block = json.loads((export_dir / "assets.extra" / "run_config.json").read_text())["serving"]
    assert serving_block["embed_images_input"] == "image_jpeg" and serving_block["embed_texts_input"] == "captions"
    assert serving_block["text_encoder"] == "TFFisherVectorLayer"
    size = serving_block["image_views"]["input_size"]
    assert serving_block["image_views"] == {"input_size": size, "ten_crop": True, "crop_size": size * 7 // 8,
                                            "resize_to": size}
    # What `saved_model_cli show` prints: the SignatureDefs' input names, dtypes and shapes.
    signatures = saved_model_utils.get_meta_graph_def(str(export_dir), "serve").signature_def
    inputs = {name: {k: (tf.as_dtype(v.dtype).name, [d.size for d in v.tensor_shape.dim])
                     for k, v in signatures[name].inputs.items()} for name in ("serving_default", "score_features")}
    image_dim = serving_block["image_features_dim"]
    assert inputs == {"serving_default": {"image_jpeg": ("string", [-1]), "captions": ("string", [-1])},
                      "score_features": {"image_features": ("float32", [-1, image_dim]),
                                         "text_features": ("float32", [-1, serving_block["text_features_dim"]])}}

    run = load_run(run_dir)
    split = run.evaluation_split()
    test = load_caption_splits(dataset)["test"]
    jpegs = [(dataset / "images" / f"{i}.jpg").read_bytes() for i in test.image_ids]
    import tensorflow_text  # noqa: F401  (tokenizer ops of the in-graph text encoder)
    loaded = tf.saved_model.load(str(export_dir))
    images = serving.call_signature(loaded, "embed_images", image_jpeg=jpegs)["image_embedding"].numpy()
    np.testing.assert_allclose(images, run.model.embed_images(np.asarray(split.image, np.float32)), atol=1e-4)
    texts = serving.call_signature(loaded, "embed_texts", captions=list(test.captions))["text_embedding"].numpy()
    np.testing.assert_allclose(texts, run.model.embed_texts(np.asarray(split.text, np.float32)), atol=1e-4)
    serving.replay_warmup_file(export_dir)


def test_rows_on_user_features_keep_feature_inputs_and_say_why(tmp_path):
    """Precomputed feature files (no backbone or encoder known), the precomp layout's region features and a
    randomly initialised ImageNet backbone leave that side on feature inputs, with a note for the log and record."""
    import types

    from tf_twobranch.systems.two_branch.pipeline import RetrievalRecipe, serving_inputs

    layout = types.SimpleNamespace(caption_format="karpathy", root=tmp_path)
    given = RetrievalRecipe(image_features_train="i.npy", image_features_test="j.npy", text_features_train="t.npy",
                            text_features_test="u.npy")
    kwargs, notes = serving_inputs(given, layout, splits={})
    assert kwargs == {}
    assert len(notes) == 2 and "--image_features_{train,test}" in notes[0] and "--text_features" in notes[1]
    assert all("the export takes" in note for note in notes)
    lstm = RetrievalRecipe(text_encoder="lstm", image_backbone="vgg19")
    kwargs, notes = serving_inputs(lstm, layout, splits={"train": None})
    assert kwargs == {} and notes == ["image side: the vgg19 backbone was randomly initialised (no "
                                      "--backbone_weights), so a rebuilt one would not give the row's features: "
                                      "the export takes image_features"]
    precomp = types.SimpleNamespace(caption_format="precomp", root=tmp_path)
    _, notes = serving_inputs(RetrievalRecipe(text_encoder="lstm"), precomp, splits={})
    assert notes == ["image side: the precomp layout's region features (no backbone known): the export takes "
                     "image_features"]
