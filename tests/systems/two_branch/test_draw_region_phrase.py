"""Fig. 2-style pictures from a tiny exported region–phrase model on the embedded data."""
import numpy as np
import pytest
from PIL import Image

from experiments.two_branch_draw import draw_region_phrase, saved_model_scorer
from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.data.formats.splits import read_split_file
from tf_twobranch.errors import DataFormatError

CROP = 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "digits", num_images=40,
                                     splits=(20, 10, 10), num_proposals=20)


@pytest.fixture(scope="module")
def exported(dataset, tmp_path_factory):
    from tf_twobranch.data.formats import read_token_file
    from tf_twobranch.data.tokenize import tokenize_caption
    from tf_twobranch.systems.two_branch.region_phrase_export import export_region_phrase_model
    from tf_twobranch.data.formats.images import load_image
    from tf_twobranch.features.images import resize
    from tf_twobranch.features.scene_cnn import train_scene_cnn
    from tf_twobranch.features.text_features import MeanWordVectorEncoder
    from tf_twobranch.features.word_vectors import train_word_vectors
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model

    corpus = read_token_file(dataset / "results_20130124.token")
    train_ids = read_split_file(dataset / "train.txt")
    index = {image_id: i for i, image_id in enumerate(corpus.image_ids)}
    captions = [[tokenize_caption(corpus.captions[c]) for c in np.flatnonzero(corpus.caption_image == index[i])]
                for i in train_ids]
    images = np.stack([resize(load_image(dataset / "images" / f"{i}.jpg"), CROP, CROP) for i in train_ids])
    backbone = train_scene_cnn(images, captions, feature_dim=16, epochs=1, batch_size=8, vocab_size=30,
                               widths=(4, 8, 8, 8), convs_per_block=(1, 1, 1, 1), augment_max_scale=1.0)
    encoder = MeanWordVectorEncoder(train_word_vectors([t for c in captions for t in c], dim=8))
    model = build_model(TwoBranchConfig(image_dim=16, text_dim=8, image_hidden=(8,), text_hidden=(8,),
                                        embed_dim=6, dropout=0.0))
    return export_region_phrase_model(model, backbone, encoder, tmp_path_factory.mktemp("model") / "saved",
                                      crop_size=CROP)


def test_writes_one_png_per_image(dataset, exported, tmp_path):
    paths = draw_region_phrase(dataset, tmp_path / "fig2", saved_model_scorer(exported), num_images=2,
                              max_captions=3)
    test_ids = read_split_file(dataset / "test.txt")[:2]
    assert [p.name for p in paths] == [f"region_phrase_{i}.png" for i in test_ids]   # named by tool
    for path in paths:
        with Image.open(path) as picture:
            assert picture.format == "PNG"
            width, height = picture.size
            pixels = np.asarray(picture.convert("RGB"))
        assert 500 <= width <= 1200 and 300 <= height <= 2000
        assert pixels.std() > 20                         # not blank
        # The phrase colours appear (boxes and caption words), e.g. the first one, red #d62728.
        red = np.all(np.abs(pixels.astype(int) - [214, 39, 40]) < 30, axis=-1)
        assert red.sum() > 50


def test_explicit_ids_and_bad_inputs(dataset, exported, tmp_path):
    image_id = read_split_file(dataset / "test.txt")[3]
    paths = draw_region_phrase(dataset, tmp_path, saved_model_scorer(exported), image_ids=[image_id])
    assert [p.name for p in paths] == [f"region_phrase_{image_id}.png"]
    with pytest.raises(DataFormatError, match="saved_model.pb"):
        saved_model_scorer(tmp_path)
    with pytest.raises(DataFormatError):
        draw_region_phrase(dataset, tmp_path, saved_model_scorer(exported), image_ids=["123"])
