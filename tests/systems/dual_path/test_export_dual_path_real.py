"""The dual-path export fed real Flickr30K JPEGs and raw captions equals the offline evaluation path.

Offline: `sampling.dual_path.test_datasets` (the experiment's test images, whole image resized to the
crop size, and left-aligned caption codes from `encode_captions`), then the model's
`retrieval_embeddings` (image averaged with its flip). Served: `embed_images` / `embed_texts` / `score`
of the SavedModel on the JPEG bytes and caption strings.
"""
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_text  # noqa: F401  tokenizer ops of the export

from tf_twobranch.systems.dual_path.data import DualPathData
from tf_twobranch.data.text_codes import encode_captions
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.export import serving
from tf_twobranch.systems.dual_path.export import export_dual_path
from tf_twobranch.features.scene_cnn import build_scene_cnn, save_scene_cnn
from tf_twobranch.systems.dual_path.model import DualPathConfig, build_dual_path_model
from tf_twobranch.systems.dual_path import sampling

IDS = ["100652400", "1016887272", "101958970", "4945942737"]
SIZE = 32


@pytest.fixture(scope="module")
def real(realdata):
    paths = [realdata / "flickr30k" / "images" / f"{i}.jpg" for i in IDS]
    wanted = {f"{i}.jpg#{k}": (n, k) for n, i in enumerate(IDS) for k in (0, 2)}
    found = {}
    with open(realdata / "flickr30k" / "captions_multi30k.token", encoding="utf-8") as lines:
        for line in lines:
            key, _, caption = line.rstrip("\n").partition("\t")
            if key in wanted:
                found[wanted[key]] = caption
    pairs = sorted(found)                                    # (image, k), images in order
    captions = [found[p] for p in pairs]
    caption_image = np.array([n for n, _ in pairs], np.int32)
    tokens = [tokenize_caption(c) for c in captions]
    # Two words left out of the dictionary: the export drops unknown words as encode_captions does.
    words = sorted({t for caption in tokens for t in caption} - {"man", "the"})
    return paths, captions, caption_image, ["<pad>", "<unk>", *words]


def test_real_jpegs_and_captions_equal_the_offline_pipeline(real, tmp_path):
    paths, captions, caption_image, vocabulary = real
    codes = encode_captions(captions, vocabulary)
    max_len = max(len(c) for c in codes) + 2
    _, extractor = build_scene_cnn(SIZE, 10, feature_dim=16, widths=(4, 4, 8, 8))
    save_scene_cnn(extractor, tmp_path / "scene_cnn.keras")
    model = build_dual_path_model(DualPathConfig(
        vocabulary_size=len(vocabulary), num_classes=len(IDS), image_size=SIZE, text_width=4,
        text_blocks=(1, 1, 1, 1), max_len=max_len, word_dim=8, hidden_dim=16, embed_dim=8,
        image_backbone="scene_cnn", image_weights=str(tmp_path / "scene_cnn.keras")))
    export_dir = export_dual_path(model, vocabulary, tmp_path / "export", resize_to=SIZE + 4)
    loaded = tf.saved_model.load(str(export_dir))

    data = DualPathData(image_paths=[str(p) for p in paths], captions=captions, caption_image=caption_image,
                        image_class=np.arange(len(IDS)), num_classes=len(IDS), vocabulary=vocabulary,
                        max_len=max_len, codes=codes, image_ids=IDS, class_names=IDS, split="test")
    test = sampling.test_datasets(data, batch_size=3, resize_to=SIZE + 4, crop_size=SIZE, flip_images=False)
    pixels = np.concatenate([b["image"].numpy() for b in test.images])
    rows = np.concatenate([b["token_ids"].numpy() for b in test.texts])
    images, texts = model.retrieval_embeddings({"image": pixels, "text": rows, "caption_image": caption_image})

    jpegs = [p.read_bytes() for p in paths]
    got_images = serving.call_signature(loaded, "embed_images", image_jpeg=jpegs)["image_embedding"].numpy()
    got_texts = serving.call_signature(loaded, "embed_texts", captions=captions)["text_embedding"].numpy()
    got_scores = serving.call_signature(loaded, "score", image_jpeg=jpegs, captions=captions)["scores"].numpy()
    scores = images @ texts.T
    assert np.ptp(scores) > 1e-3                                   # not vacuous
    np.testing.assert_allclose(got_images, images, atol=1e-4)
    np.testing.assert_allclose(got_texts, texts, atol=1e-4)
    np.testing.assert_allclose(got_scores, scores, atol=1e-4)
    serving.replay_warmup_file(export_dir)
