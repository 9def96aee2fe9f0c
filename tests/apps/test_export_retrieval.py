"""The retrieval signatures (issue 25 item 2): top-k of a served gallery equals the evaluation core's ranking."""
import numpy as np
import pytest
import tensorflow as tf

from tests.support.baselines import randomize_weights
from tf_twobranch.errors import ConfigError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.export import serving
from tf_twobranch.systems.two_branch.export import export_saved_model
from tf_twobranch.export.retrieval_signatures import RetrievalGallery
from tf_twobranch.run_export import gallery_from_model
from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model

NUM_IMAGES, CAPTIONS_PER_IMAGE, IMAGE_DIM, TEXT_DIM = 30, 5, 6, 5


def _split(seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(NUM_IMAGES, IMAGE_DIM)).astype(np.float32)
    caption_image = np.repeat(np.arange(NUM_IMAGES), CAPTIONS_PER_IMAGE)
    # Captions near their image's features, so the ranks spread over 1..N.
    texts = (images[caption_image, :TEXT_DIM] + rng.normal(size=(len(caption_image), TEXT_DIM))).astype(np.float32)
    return images, texts, caption_image


def _model(kind):
    model = build_model(TwoBranchConfig(kind=kind, image_dim=IMAGE_DIM, text_dim=TEXT_DIM, image_hidden=(8,),
                                        text_hidden=(8,), embed_dim=4, dropout=0.0))
    randomize_weights(model, seed=3)
    return model


def _core_ranks(model, images, texts, caption_image):
    image_embeds, text_embeds = model.embed_images(images), model.embed_texts(texts)
    if model.similarity_head is None:
        return retrieval.ranks_from_embeddings(image_embeds, text_embeds, caption_image)
    return retrieval.ranks_from_score_fn(model.score_fn(image_embeds, text_embeds), len(images), caption_image)


@pytest.fixture(scope="module", params=["embedding", "similarity"])
def exported(request, tmp_path_factory):
    images, texts, caption_image = _split()
    model = _model(request.param)
    gallery = gallery_from_model(model, {"image": images, "text": texts, "caption_image": caption_image},
                                 [f"img{i}" for i in range(NUM_IMAGES)], [f"cap{c}" for c in range(len(texts))])
    path = export_saved_model(model, tmp_path_factory.mktemp(request.param) / "export", gallery=gallery)
    return model, (images, texts, caption_image), tf.saved_model.load(str(path)), path


def test_retrieve_top_k_is_the_core_ranking_both_directions(exported):
    model, (images, texts, caption_image), loaded, _ = exported
    i2t_core, t2i_core = _core_ranks(model, images, texts, caption_image)
    out = serving.call_signature(loaded, "retrieve_captions", image_features=images, k=np.int32(len(texts)))
    index = out["caption_index"].numpy()
    # Rank of an image's best caption in the served order = the core's image→text rank.
    served_i2t = np.array([1 + np.flatnonzero(caption_image[index[i]] == i)[0] for i in range(NUM_IMAGES)])
    np.testing.assert_array_equal(served_i2t, i2t_core)
    out = serving.call_signature(loaded, "retrieve_images", text_features=texts, k=np.int32(NUM_IMAGES))
    served_t2i = 1 + np.argmax(out["image_index"].numpy() == caption_image[:, None], axis=1)
    np.testing.assert_array_equal(served_t2i, t2i_core)
    assert len(set(i2t_core.tolist())) > 3      # the ranks are spread, not all 1


def test_retrieve_k_per_request_ids_and_scores(exported):
    model, (images, texts, caption_image), loaded, _ = exported
    out = serving.call_signature(loaded, "retrieve_captions", image_features=images[:2], k=np.int32(3))
    assert out["caption_ids"].shape == (2, 3) and out["scores"].shape == (2, 3)
    ids = [b.decode() for b in out["caption_ids"].numpy()[0]]
    assert ids == [f"cap{c}" for c in out["caption_index"].numpy()[0]]
    scores = out["scores"].numpy()
    assert np.all(np.diff(scores, axis=1) <= 0)
    full = serving.call_signature(loaded, "score", image_features=images[:2], text_features=texts)["scores"].numpy()
    np.testing.assert_allclose(scores, -np.sort(-full, axis=1)[:, :3], rtol=1e-5, atol=1e-6)
    out = serving.call_signature(loaded, "retrieve_images", text_features=texts[:1], k=np.int32(1))
    assert out["image_ids"].shape == (1, 1)


def test_retrieve_refuses_k_outside_the_gallery(exported):
    _, (images, texts, _), loaded, _ = exported
    for k in (0, len(texts) + 1):
        with pytest.raises(tf.errors.InvalidArgumentError, match="k must lie in 1..caption gallery size"):
            serving.call_signature(loaded, "retrieve_captions", image_features=images[:1], k=np.int32(k))


def test_retrieval_warmup_replays(exported):
    *_, path = exported
    requests = serving.read_warmup_requests(path / "assets.extra" / "tf_serving_warmup_requests")
    assert {"retrieve_captions", "retrieve_images"} <= {name for name, _ in requests}
    serving.replay_warmup_file(path)


def test_gallery_is_checked():
    with pytest.raises(ConfigError, match="2 gallery image ids for 3 image embeddings"):
        RetrievalGallery(["a", "b"], np.zeros((3, 4)), ["c"], np.zeros((1, 4)))
    with pytest.raises(ConfigError, match="differ in size"):
        RetrievalGallery(["a"], np.zeros((1, 4)), ["c"], np.zeros((1, 5)))
    with pytest.raises(ConfigError, match="NaN or inf"):
        RetrievalGallery(["a"], np.full((1, 4), np.nan), ["c"], np.zeros((1, 4)))


# ------------------------------------------------------------------ the dual path: JPEG bytes and raw captions

WORDS = ["<pad>", "<unk>", "a", "red", "blue", "green", "seven", "three", "one", "two", "on", "the", "left",
         "right", "small", "big", "digit", "and"]


def test_dual_path_retrieve_is_the_core_ranking(tmp_path):
    """Queries are JPEG bytes and raw captions; the gallery holds the model's evaluation embeddings."""
    import io

    from PIL import Image

    from tf_twobranch.data.text_codes import encode_captions
    from tf_twobranch.systems.dual_path.export import export_dual_path
    from tf_twobranch.features.scene_cnn import build_scene_cnn, save_scene_cnn
    from tf_twobranch.systems.dual_path.model import DualPathConfig, build_dual_path_model

    _, extractor = build_scene_cnn(32, 10, feature_dim=32, widths=(8, 8, 16, 16))
    save_scene_cnn(extractor, tmp_path / "scene_cnn.keras")
    model = build_dual_path_model(DualPathConfig(
        vocabulary_size=len(WORDS), num_classes=4, image_size=32, text_width=4, text_blocks=(1, 1, 1, 1),
        max_len=12, word_dim=16, hidden_dim=32, embed_dim=32, image_backbone="scene_cnn",
        image_weights=str(tmp_path / "scene_cnn.keras")))
    randomize_weights(model, seed=5)
    rng = np.random.default_rng(0)
    jpegs = []
    for _ in range(8):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (40, 36, 3), dtype=np.uint8)).save(out, format="JPEG")
        jpegs.append(out.getvalue())
    captions = [" ".join(rng.choice(WORDS[2:], size=rng.integers(2, 7))) for _ in range(24)]
    caption_image = np.repeat(np.arange(8), 3)
    codes = np.zeros((len(captions), 12), np.int32)
    for i, c in enumerate(encode_captions(captions, WORDS)):
        codes[i, :len(c)] = c
    pixels = serving.decode_jpeg_batch(tf.constant(jpegs), 32, "image_jpeg").numpy()
    split = {"image": pixels, "text": codes, "caption_image": caption_image}
    gallery = gallery_from_model(model, split, [f"img{i}" for i in range(8)], [f"cap{c}" for c in range(24)])
    path = export_dual_path(model, WORDS, tmp_path / "export", gallery=gallery)
    loaded = tf.saved_model.load(str(path))
    i2t_core, t2i_core = retrieval.ranks_from_embeddings(*model.retrieval_embeddings(split), caption_image)
    index = serving.call_signature(loaded, "retrieve_captions", image_jpeg=jpegs, k=np.int32(24))["caption_index"]
    served_i2t = [1 + np.flatnonzero(caption_image[index.numpy()[i]] == i)[0] for i in range(8)]
    np.testing.assert_array_equal(served_i2t, i2t_core)
    index = serving.call_signature(loaded, "retrieve_images", captions=captions, k=np.int32(8))["image_index"]
    np.testing.assert_array_equal(1 + np.argmax(index.numpy() == caption_image[:, None], axis=1), t2i_core)
    serving.replay_warmup_file(path)


def test_a_warm_up_request_of_another_dtype_is_refused_before_it_is_written():
    # TF Serving feeds the warm-up file's tensors as written: an int64 k for the int32 input of
    # retrieve_captions fails the served model's warm-up, so the export refuses to write it.
    from tf_twobranch.errors import ConfigError
    from tf_twobranch.export.saved_model import warmup_jpeg

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="image_jpeg"),
                                  tf.TensorSpec([], tf.int32, name="k")])
    def retrieve(image_jpeg, k):
        return {"n": tf.size(image_jpeg) + k}

    request = {"image_jpeg": [warmup_jpeg(8, 8)]}
    assert serving.run_warmup_requests({"r": retrieve}, [("r", {**request, "k": np.int32(1)})])
    with pytest.raises(ConfigError, match="input 'k' is int64, the signature takes int32"):
        serving.run_warmup_requests({"r": retrieve}, [("r", {**request, "k": 1})])
