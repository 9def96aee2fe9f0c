"""Retrieval signatures of the fragment (S_kl) and N-pair (S_MaxImage, ...) exports (issue 25 item 2):
queries as JPEG bytes (+ boxes) and parse triplets / raw captions, top-k equal to the evaluation core's
ranking of the same split, both directions."""
import io

import keras
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tests.support.baselines import randomize_weights
from tf_twobranch.systems.fragments.sentence_fragments import Triplet, encode_fragments
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.systems.npair import heat_maps as localization_maps
from tf_twobranch.systems.fragments.retrieval import fragment_score_fn
from tf_twobranch.systems.npair.retrieval import localization_score_fn
from tf_twobranch.evaluation.split import EvaluationSplit
from tf_twobranch.export import serving
from tf_twobranch.systems.fragments.export import FragmentServingModule, export_fragment_model, triplet_request
from tf_twobranch.systems.npair.export import export_npair_model
from tf_twobranch.export.retrieval_signatures import RetrievalGallery
from tf_twobranch.run_export import gallery_from_model
from tf_twobranch.systems.fragments.image_fragments import extract_fragment_features
from tf_twobranch.features.images import load_images_at_size
from tf_twobranch.systems.fragments.features import FragmentImages, fragment_cnn
from tf_twobranch.systems.npair.features import encode_token_lists
from tf_twobranch.features.scene_cnn import build_scene_cnn
from tf_twobranch.systems.fragments.model import FragmentEmbeddingConfig, build_fragment_model
from tf_twobranch.systems.npair.model import (NPairEvaluationSplit, NPairLocalizationConfig,
                                                    build_npair_model)

NUM_IMAGES, CAPTIONS_PER_IMAGE = 8, 2


def _jpegs(tmp_path, seed=0):
    """Random JPEGs of several sizes, written as files (the offline pipelines read files)."""
    rng = np.random.default_rng(seed)
    paths, data = [], []
    for i in range(NUM_IMAGES):
        height, width = int(rng.integers(30, 70)), int(rng.integers(30, 70))
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        paths.append(tmp_path / f"img{i}.jpg")
        paths[-1].write_bytes(buffer.getvalue())
        data.append(buffer.getvalue())
    return paths, data


def _served_ranks(loaded, caption_image, image_input, text_input):
    """(image→text, text→image) ranks of the first positive in the served order of the whole gallery."""
    num_captions = len(caption_image)
    index = serving.call_signature(loaded, "retrieve_captions", **image_input,
                                   k=np.int32(num_captions))["caption_index"].numpy()
    i2t = np.array([1 + np.flatnonzero(caption_image[index[i]] == i)[0] for i in range(NUM_IMAGES)])
    index = serving.call_signature(loaded, "retrieve_images", **text_input, k=np.int32(NUM_IMAGES))["image_index"]
    t2i = 1 + np.argmax(index.numpy() == caption_image[:, None], axis=1)
    return i2t, t2i


# ------------------------------------------------------------------ deep fragment embeddings

RELATIONS = ["nsubj", "amod", "prep"]
WORDS = ["dog", "cat", "red", "ball", "runs", "park", "small", "grass", "on", "big"]


def _fragment_model(image_dim):
    config = FragmentEmbeddingConfig(image_dim=image_dim, num_relations=len(RELATIONS), vocabulary_size=len(WORDS),
                                     word_dim=4, embed_dim=6, smoothing=2.0)
    rng = np.random.default_rng(1)
    model = build_fragment_model(config, rng.normal(size=(len(WORDS), 4)).astype(np.float32))
    model.image_projection.kernel.assign(rng.normal(size=(image_dim, 6)).astype(np.float32) * 0.3)
    # Positive biases on both sides: every pair scores above 0 under the ReLU, so no rank hides in a tie at 0.
    model.image_projection.bias.assign(np.full(6, 2.0, np.float32))
    encoder = model.sentence_encoder
    encoder.relation_bias.assign(np.abs(rng.normal(size=encoder.relation_bias.shape)).astype(np.float32) + 0.5)
    return model


def _parses(seed=2):
    """Random parse triplets, some with a relation or word the model does not know (dropped)."""
    rng = np.random.default_rng(seed)
    relations, words = RELATIONS + ["det"], WORDS + ["zebra"]
    return [[Triplet(str(rng.choice(relations)), str(rng.choice(words)), str(rng.choice(words)))
             for _ in range(rng.integers(2, 6))] + [Triplet(RELATIONS[0], WORDS[c % len(WORDS)], WORDS[c // 3])]
            for c in range(NUM_IMAGES * CAPTIONS_PER_IMAGE)]


@pytest.fixture(scope="module")
def fragment_export(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fragment_retrieval")
    paths, jpegs = _jpegs(tmp_path)
    _, extractor = build_scene_cnn(48, 10, feature_dim=8, widths=(4, 4, 8, 8))
    randomize_weights(extractor, seed=4)
    cnn = fragment_cnn(extractor, "scene_cnn", fine_tuned=False)
    # Up to 3 boxes per image (inclusive pixels), as a detector would give them.
    rng = np.random.default_rng(3)
    ids = [f"img{i}" for i in range(NUM_IMAGES)]
    boxes, num_boxes, proposals = np.zeros((NUM_IMAGES, 3, 4), np.float32), np.zeros(NUM_IMAGES, np.int32), {}
    for i, path in enumerate(paths):
        width, height = Image.open(path).size
        num_boxes[i] = rng.integers(0, 4)
        for b in range(num_boxes[i]):
            x1, y1 = rng.integers(0, width - 8), rng.integers(0, height - 8)
            boxes[i, b] = [x1, y1, rng.integers(x1 + 4, width), rng.integers(y1 + 4, height)]
        proposals[ids[i]] = boxes[i, :num_boxes[i]]
    # The offline pipeline: the cache's inputs (the scene CNN below its top layer), then the folded top layer.
    from tf_twobranch.systems.fragments.features import _folded_top_layer, _scene_cnn_cut
    inputs, mask = extract_fragment_features(dict(zip(ids, paths)), proposals, _scene_cnn_cut(extractor),
                                             image_ids=ids, detections=3)
    features = FragmentImages(ids, inputs, mask, _folded_top_layer(extractor)).features()
    model = _fragment_model(int(features.shape[2]))
    parses = _parses()
    encoded = encode_fragments(parses, RELATIONS, {w: i for i, w in enumerate(WORDS)})
    caption_image = np.repeat(np.arange(NUM_IMAGES), CAPTIONS_PER_IMAGE)
    split = EvaluationSplit(image={"fragments": features, "mask": mask},
                            text={"relation": encoded.relation, "word1": encoded.word1, "word2": encoded.word2,
                                  "row_splits": encoded.row_splits}, caption_image=caption_image)
    gallery = gallery_from_model(model, split, ids, [f"cap{c}" for c in range(len(caption_image))])
    # Blocks of 3 items: three steps per request, the last one padded.
    path = export_fragment_model(model, tmp_path / "export", relations=RELATIONS, words=WORDS, image_cnn=cnn,
                                 gallery=gallery, gallery_block=3)
    image_input = {"image_jpeg": jpegs, "boxes": boxes, "num_boxes": num_boxes}
    return model, split, tf.saved_model.load(str(path)), path, image_input, triplet_request(parses), gallery


def test_fragment_retrieve_is_the_core_ranking(fragment_export):
    model, split, loaded, _, image_input, text_input, gallery = fragment_export
    v, vm, s, row_splits = model.embed_split(split.image["fragments"], split.image["mask"], split.text)
    score_fn = fragment_score_fn(v, vm, s, row_splits, **model.config.score_options())
    i2t_core, t2i_core = retrieval.ranks_from_score_fn(score_fn, NUM_IMAGES, split.caption_image)
    i2t, t2i = _served_ranks(loaded, split.caption_image, image_input, text_input)
    np.testing.assert_array_equal(i2t, i2t_core)
    np.testing.assert_array_equal(t2i, t2i_core)
    assert len(set(t2i_core.tolist())) > 3        # the ranks are spread, not all 1
    # The served scores are the core's S_kl, best first.
    core = score_fn(0, len(split.caption_image))
    out = serving.call_signature(loaded, "retrieve_captions", **image_input, k=np.int32(4))
    np.testing.assert_allclose(out["scores"].numpy(), -np.sort(-core, axis=1)[:, :4], rtol=1e-4, atol=1e-5)
    assert [b.decode() for b in out["caption_ids"].numpy()[0]] == [f"cap{c}" for c in out["caption_index"][0]]
    # Without the CNN the query is the cached features (and their mask): the same ranking.
    module = FragmentServingModule(model, RELATIONS, WORDS, gallery=gallery)
    index = module.retrieve_captions(tf.constant(np.asarray(split.image["fragments"], np.float32)),
                                     tf.constant(split.image["mask"]), tf.constant(len(split.caption_image)))
    i2t = [1 + np.flatnonzero(split.caption_image[index["caption_index"].numpy()[i]] == i)[0]
           for i in range(NUM_IMAGES)]
    np.testing.assert_array_equal(i2t, i2t_core)


def test_fragment_retrieval_refuses_bad_requests(fragment_export):
    _, _, loaded, path, image_input, text_input, _ = fragment_export
    with pytest.raises(tf.errors.InvalidArgumentError, match="k must lie in 1..image gallery size"):
        serving.call_signature(loaded, "retrieve_images", **text_input, k=np.int32(NUM_IMAGES + 1))
    unknown = triplet_request([[Triplet("det", "zebra", "dog")], [Triplet("nsubj", "dog", "runs")]])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"a sentence has no fragment the model knows.*\] \[0\]"):
        serving.call_signature(loaded, "retrieve_images", **unknown, k=np.int32(1))
    outside = dict(image_input, boxes=image_input["boxes"].copy(), num_boxes=np.full(NUM_IMAGES, 1, np.int32))
    outside["boxes"][2, 0] = [0, 0, 500, 10]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"a box is empty or outside its image.*\[2 0\]"):
        serving.call_signature(loaded, "retrieve_captions", **outside, k=np.int32(1))
    _replay_warmup_on(loaded, path)


def _replay_warmup_on(loaded, path):
    """What TF Serving does on load: every warm-up request, the retrieval ones included, runs."""
    assert {"retrieve_captions", "retrieve_images"} <= set(serving.replay_warmup_file(path, loaded))


# ------------------------------------------------------------------ N-pair localization

SIZE = 32
VOCABULARY = ["<pad>", "<unk>", "<start>", "<end>", "dog", "cat", "red", "ball", "runs", "park", "a", "the",
              "green", "on"]


def _npair_model(aggregator, normalisation):
    _, extractor = build_scene_cnn(SIZE, 10, feature_dim=8, widths=(4, 4, 8, 8))
    backbone = keras.Model(extractor.input, extractor.get_layer("global_pool").input)
    config = NPairLocalizationConfig(vocabulary_size=len(VOCABULARY), map_channels=8, map_size=2, word_dim=6,
                                     embed_dim=8, max_tokens=7, aggregator=aggregator, normalisation=normalisation)
    model = build_npair_model(config, backbone=backbone)
    randomize_weights(model, seed=6)
    return model


@pytest.mark.parametrize("aggregator,normalisation", [("max_image", "vector"),
                                                     pytest.param("max_text", "map", marks=pytest.mark.slow)])
def test_npair_retrieve_is_the_core_ranking(tmp_path, aggregator, normalisation):
    model = _npair_model(aggregator, normalisation)
    paths, jpegs = _jpegs(tmp_path, seed=7)
    rng = np.random.default_rng(8)
    captions = [" ".join(rng.choice(VOCABULARY[4:], size=rng.integers(1, 6))) for _ in
                range(NUM_IMAGES * CAPTIONS_PER_IMAGE)]
    tokens = encode_token_lists([tokenize_caption(c) for c in captions], VOCABULARY, 5)
    caption_image = np.repeat(np.arange(NUM_IMAGES), CAPTIONS_PER_IMAGE)
    # The offline pipeline: every image resized whole by PIL, then the backbone's maps.
    maps = model.backbone(load_images_at_size(paths, SIZE).astype(np.float32), training=False).numpy()
    split = NPairEvaluationSplit(image=maps, text=tokens.token_ids, caption_image=caption_image,
                                 token_mask=tokens.token_mask, vocabulary=VOCABULARY, max_words=5)
    gallery = gallery_from_model(model, split, [f"img{i}" for i in range(NUM_IMAGES)],
                                 [f"cap{c}" for c in range(len(captions))])
    path = export_npair_model(model, tmp_path / "export", vocabulary=VOCABULARY, gallery=gallery, gallery_block=5)
    loaded = tf.saved_model.load(str(path))
    # The core's scorer on the maps and token vectors `evaluate` computes.
    normalised = localization_maps.evaluation_maps(model, maps, tmp_path / "maps").normalised
    vectors = localization_maps.token_vector_rows(model, tokens.token_ids, tokens.token_mask, tmp_path / "t.npy")
    score_fn = localization_score_fn(normalised, vectors, tokens.token_mask, aggregator=aggregator,
                                     token_average=model.config.token_average)
    i2t_core, t2i_core = retrieval.ranks_from_score_fn(score_fn, NUM_IMAGES, caption_image)
    i2t, t2i = _served_ranks(loaded, caption_image, {"image_jpeg": jpegs}, {"caption": captions})
    np.testing.assert_array_equal(i2t, i2t_core)
    np.testing.assert_array_equal(t2i, t2i_core)
    assert len(set(t2i_core.tolist())) > 3
    out = serving.call_signature(loaded, "retrieve_images", caption=captions[:3], k=np.int32(2))
    core = score_fn(0, len(captions))[:, :3].T
    np.testing.assert_allclose(out["scores"].numpy(), -np.sort(-core, axis=1)[:, :2], rtol=1e-4, atol=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match="k must lie in 1..caption gallery size"):
        serving.call_signature(loaded, "retrieve_captions", image_jpeg=jpegs[:1], k=np.int32(0))
    _replay_warmup_on(loaded, path)


def test_galleries_are_checked():
    with pytest.raises(ConfigError, match=r"gallery caption mask must be \(rows, slots\)"):
        RetrievalGallery(["a"], np.zeros((1, 2, 4)), ["c"], np.zeros((1, 3, 4)), caption_mask=np.ones((1, 2), bool))
    with pytest.raises(ConfigError, match="NPairEvaluationSplit"):
        gallery_from_model(_npair_model("max_image", "vector"), {"image": np.zeros((1, 2, 2, 8)), "text": [[0]],
                                                                   "caption_image": [0]}, ["a"], ["c"])
