"""Real Flickr30K images (mixed sizes) through the default backbone of each experiment.

The scene CNN is trained on stacked images; real folders hold images of
different sizes, which `load_images_at_size` brings to one square size.  The
eight JPEGs of ``../shared/realdata/flickr30k/images`` (375x500, 500x333, ...)
go end to end, at tiny sizes, through:

(a) image-sentence retrieval: `prepare_retrieval_features` with the scene CNN,
    ten crops and Flickr30K Entities region supervision;
(b) phrase localization: `region_backbone` (scene CNN) and region features;
(c) the dual path (instance loss): the scene CNN pretraining of
    `tf_twobranch.systems.dual_path.pipeline.pretrained_scene_cnn` and the tf.data images.

The embedded data (square images of one size) must keep exactly its arrays.
"""
import pathlib
import shutil
import types

import numpy as np
import pytest
from PIL import Image

from tf_twobranch.errors import DataFormatError
from tf_twobranch.data.formats.images import image_file_shape, load_image
from tf_twobranch.features.images import DEFAULT_STACK_SIZE, load_images_at_size, resize

IMAGE_IDS = ["100652400", "1016887272", "101958970", "3359636318",
             "4945942737", "6338542128", "6959556104", "7162685234"]
TRAIN_IDS, TEST_IDS = IMAGE_IDS[:6], IMAGE_IDS[6:]


@pytest.fixture(scope="module")
def flickr_dir(realdata):
    folder = realdata / "flickr30k"
    missing = [i for i in IMAGE_IDS if not (folder / "images" / f"{i}.jpg").is_file()]
    if not (folder / "captions_multi30k.token").is_file() or missing:
        pytest.skip(f"real Flickr30K sample absent: needs {folder}/captions_multi30k.token and "
                    f"{folder}/images/<id>.jpg for {IMAGE_IDS} (only beside CI/dev clones)")
    return folder


@pytest.fixture(scope="module")
def real_paths(flickr_dir):
    return [flickr_dir / "images" / f"{i}.jpg" for i in IMAGE_IDS]


def _entity_boxes(height: int, width: int) -> dict[str, list[int]]:
    """Two 0-based inclusive boxes per image, in the file's pixel coordinates."""
    return {"1": [width // 8, height // 4, width // 2, height - 1 - height // 8],
            "2": [width // 2, height // 2, width - 1, height - 1]}


def _write_entities(root: pathlib.Path, image_id: str, height: int, width: int) -> None:
    (root / "Sentences").mkdir(exist_ok=True)
    (root / "Annotations").mkdir(exist_ok=True)
    (root / "Sentences" / f"{image_id}.txt").write_text(
        "[/EN#1/people A person] stands near [/EN#2/other a thing] .\n"
        "[/EN#2/other The thing] is beside [/EN#1/people the person] .\n", encoding="utf-8")
    objects = "".join(
        f"\t<object>\n\t\t<name>{chain}</name>\n\t\t<bndbox>\n\t\t\t<xmin>{x1 + 1}</xmin>\n"
        f"\t\t\t<ymin>{y1 + 1}</ymin>\n\t\t\t<xmax>{x2 + 1}</xmax>\n\t\t\t<ymax>{y2 + 1}</ymax>\n"
        "\t\t</bndbox>\n\t</object>\n"
        for chain, (x1, y1, x2, y2) in _entity_boxes(height, width).items())
    (root / "Annotations" / f"{image_id}.xml").write_text(
        f"<annotation>\n\t<filename>{image_id}.jpg</filename>\n\t<size>\n\t\t<width>{width}</width>\n"
        f"\t\t<height>{height}</height>\n\t\t<depth>3</depth>\n\t</size>\n{objects}</annotation>\n",
        encoding="utf-8")


@pytest.fixture(scope="module")
def dataset(flickr_dir, real_paths, tmp_path_factory):
    """A tiny Flickr30K folder: token file (2 real captions per image), splits, images, Entities."""
    root = tmp_path_factory.mktemp("flickr30k_real")
    (root / "images").mkdir()
    wanted = {f"{i}.jpg#{k}" for i in IMAGE_IDS for k in (0, 1)}
    lines = [line for line in (flickr_dir / "captions_multi30k.token").read_text(encoding="utf-8").splitlines()
             if line.split("\t", 1)[0] in wanted]
    assert len(lines) == 2 * len(IMAGE_IDS)
    (root / "results_20130124.token").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "train.txt").write_text("\n".join(TRAIN_IDS) + "\n", encoding="utf-8")
    (root / "test.txt").write_text("\n".join(TEST_IDS) + "\n", encoding="utf-8")
    for image_id, path in zip(IMAGE_IDS, real_paths):
        shutil.copyfile(path, root / "images" / f"{image_id}.jpg")
        _write_entities(root, image_id, *image_file_shape(path))
    return root


# --------------------------------------------------------------------------- the helper


def _write_images(folder: pathlib.Path, shapes, seed: int = 0) -> list[pathlib.Path]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, (height, width) in enumerate(shapes):
        path = folder / f"{n}.{'jpg' if n % 2 else 'png'}"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_equal_square_images_are_bit_identical_to_np_stack(tmp_path):
    paths = _write_images(tmp_path / "square", [(40, 40)] * 5)
    stacked = np.stack([load_image(p) for p in paths])
    loaded = load_images_at_size(paths)
    assert loaded.dtype == np.uint8 and loaded.shape == (5, 40, 40, 3)
    np.testing.assert_array_equal(loaded, stacked)
    np.testing.assert_array_equal(load_images_at_size(paths, 40), stacked)


def test_embedded_data_arrays_are_unchanged(tmp_path):
    from tf_twobranch.data.embedded import generate_embedded_dataset
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.data.retrieval_data import load_caption_splits
    root = generate_embedded_dataset(tmp_path / "scenes", num_images=12, splits=(6, 2, 4), num_proposals=5)
    layout = resolve_dataset(root)
    train = load_caption_splits(layout)["train"]
    paths = layout.image_paths(train.image_ids)
    stacked = np.stack([load_image(p) for p in paths])  # the former code
    loaded = load_images_at_size(paths)
    assert loaded.shape == stacked.shape and loaded.dtype == stacked.dtype == np.uint8
    assert loaded.tobytes() == stacked.tobytes()


def test_mixed_and_non_square_sizes_are_resized_whole(tmp_path, real_paths):
    images = load_images_at_size(real_paths)
    assert images.shape == (8, DEFAULT_STACK_SIZE, DEFAULT_STACK_SIZE, 3) and images.dtype == np.uint8
    for row, path in zip(images, real_paths):
        original = load_image(path)
        assert image_file_shape(path) == original.shape[:2]
        np.testing.assert_array_equal(row, resize(original, DEFAULT_STACK_SIZE, DEFAULT_STACK_SIZE))
    assert load_images_at_size(real_paths[:2], 33).shape == (2, 33, 33, 3)
    assert load_images_at_size(real_paths[:2], default_size=40).shape == (2, 40, 40, 3)
    # Equal-sized but not square: the default side, not an error.
    same = _write_images(tmp_path / "wide", [(30, 50)] * 3)
    assert load_images_at_size(same, default_size=24).shape == (3, 24, 24, 3)
    # Square but of different sizes.
    squares = _write_images(tmp_path / "squares", [(30, 30), (50, 50)])
    assert load_images_at_size(squares).shape == (2, DEFAULT_STACK_SIZE, DEFAULT_STACK_SIZE, 3)


def test_bad_file_is_named(tmp_path, real_paths):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not an image")
    with pytest.raises(DataFormatError, match="broken.jpg"):
        load_images_at_size([real_paths[0], bad])
    with pytest.raises(DataFormatError, match="absent.jpg"):
        load_images_at_size([tmp_path / "absent.jpg"], 32)


def test_entity_crops_come_from_the_original_images(dataset):
    from tf_twobranch.data.phrases import build_phrase_examples
    from tf_twobranch.features.scene_cnn import entity_region_crops, square_region_crop
    paths = [dataset / "images" / f"{i}.jpg" for i in TRAIN_IDS]
    images = load_images_at_size(paths)
    crops, tokens = entity_region_crops(dataset, TRAIN_IDS, images, image_paths=paths)
    boxes = list(dict.fromkeys((e.image_id, tuple(float(v) for v in e.gt_box))
                               for e in build_phrase_examples(dataset, TRAIN_IDS)))
    assert len(crops) == len(tokens) == len(boxes) == 2 * len(TRAIN_IDS)
    assert crops.shape[1:] == images.shape[1:] and crops.dtype == np.uint8
    for crop, (image_id, box) in zip(crops, boxes):
        original = load_image(dataset / "images" / f"{image_id}.jpg")
        np.testing.assert_array_equal(crop, square_region_crop(original, box, images.shape[1]))


# --------------------------------------------------------------------------- (a) retrieval


@pytest.mark.slow
def test_retrieval_features_with_scene_cnn_on_real_images(dataset, tmp_path, monkeypatch):
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.data.retrieval_data import load_caption_splits
    from tf_twobranch.features import prepare
    from tf_twobranch.features.prepare import FeatureSpec, prepare_retrieval_features
    trained = []
    original_train = prepare.train_scene_cnn

    def recording_train(images, tokens, **kwargs):
        trained.append((images.shape, None if kwargs.get("region_crops") is None else kwargs["region_crops"].shape))
        return original_train(images, tokens, **kwargs)

    monkeypatch.setattr(prepare, "train_scene_cnn", recording_train)  # the name prepare imported
    splits = load_caption_splits(dataset)
    spec = FeatureSpec(image_backbone="scene_cnn", scene_cnn_epochs=1, ten_crop=True,
                       text_encoder="mean_vector", word_dim=8)
    image_feats, text_feats, _ = prepare_retrieval_features(splits, resolve_dataset(dataset), tmp_path / "cache",
                                                            spec)
    size = DEFAULT_STACK_SIZE
    # Trained on the 6 training images resized to 96x96 plus their 12 Entities box crops.
    assert trained == [((6, size, size, 3), (12, size, size, 3))]
    assert image_feats["train"].shape == (6, 1024) and image_feats["test"].shape == (2, 1024)
    assert text_feats["train"].shape == (12, 8) and text_feats["test"].shape == (4, 8)
    for feats in image_feats.values():
        assert np.isfinite(feats).all() and np.ptp(feats, axis=0).max() > 0


# --------------------------------------------------------------------------- (b) phrase localization


@pytest.mark.slow
def test_region_backbone_scene_cnn_on_real_images(dataset, tmp_path):
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.features import prepare_regions as pr
    from tf_twobranch.features.backbones import backbone_input_size
    from tf_twobranch.features.image_features import extract_region_features
    spec = pr.RegionFeatureSpec(image_backbone="scene_cnn", scene_cnn_epochs=1, word_dim=8,
                                fisher_components=2, max_proposals=10)
    backbone = pr.region_backbone(resolve_dataset(dataset), tmp_path / "regions", spec)
    assert backbone_input_size(backbone) == DEFAULT_STACK_SIZE
    assert (tmp_path / "regions" / "scene_cnn.keras").is_file()
    path = dataset / "images" / f"{TEST_IDS[0]}.jpg"
    height, width = image_file_shape(path)
    boxes = np.array([[0, 0, width, height], [10, 20, width // 2, height // 3], [5, 5, 12, 40]])
    feats = extract_region_features(path, boxes, backbone)
    assert feats.shape == (3, int(backbone.output_shape[-1])) and np.isfinite(feats).all()
    again = pr.region_backbone(resolve_dataset(dataset), tmp_path / "regions", spec)  # cached
    np.testing.assert_allclose(extract_region_features(path, boxes, again), feats, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- (c) dual path


@pytest.mark.slow
def test_dual_path_scene_cnn_pretraining_on_real_images(dataset, tmp_path, monkeypatch):
    import tensorflow as tf

    from tf_twobranch.systems.dual_path import pipeline as dual_path
    from tf_twobranch.systems.dual_path.data import dual_path_data_from_retrieval
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.features.backbones import build_backbone
    from tf_twobranch.systems.dual_path import sampling as dp
    # The name the dual-path pipeline imported: the cache goes outside the package.
    monkeypatch.setattr(dual_path, "load_embedded_dataset", lambda *a, **k: tmp_path)
    train = dual_path_data_from_retrieval(resolve_dataset(dataset), split="train")
    flags_like = types.SimpleNamespace(dataset_kind="retrieval", seed=0, image_size=48)
    path = dual_path.pretrained_scene_cnn(flags_like, train)
    assert pathlib.Path(path).is_file() and pathlib.Path(path).is_relative_to(tmp_path)
    # The dual path model builds the backbone at --image_size and feeds it
    # the tf.data crops of the real JPEGs.
    backbone = build_backbone("scene_cnn", weights_path=path, input_size=48)
    crops = tf.stack([dp.train_image(tf.io.read_file(p), resize_to=56, crop_size=48, seed=tf.constant([0, n]))
                      for n, p in enumerate(train.image_paths)]
                     + [dp.test_image(tf.io.read_file(p), resize_to=56, crop_size=48) for p in train.image_paths])
    assert crops.shape == (12, 48, 48, 3)
    feats = np.asarray(backbone(crops, training=False))
    assert feats.shape == (12, 1024) and np.isfinite(feats).all()
