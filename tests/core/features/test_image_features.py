"""Tests for image/region feature extraction and the scene CNN."""
import keras
import numpy as np
import pytest
from PIL import Image

from tests.support.forked_modules import run_python
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.features import backbones, image_features, images, scene_cnn

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230), "yellow": (230, 220, 30)}


def colour_squares(count, size=32, seed=0):
    """Images with one coloured square on a noisy dark background, and captions naming its colour."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    pictures = rng.integers(0, 60, (count, size, size, 3)).astype(np.uint8)
    labels = rng.integers(0, len(names), count)
    captions = []
    for index, label in enumerate(labels):
        side = int(rng.integers(size // 4, size // 2))
        top, left = rng.integers(0, size - side, 2)
        pictures[index, top:top + side, left:left + side] = COLOURS[names[label]]
        colour = names[label]
        captions.append([["a", colour, "square"], ["the", colour, "box", "on", "dark", "noise"],
                         [colour, "square"], ["a", "small", colour, "block"], ["one", colour, "square"]])
    return pictures, captions, labels


class MeanColour(keras.layers.Layer):
    """A deterministic toy backbone: per-channel means and the pixel at (0, 0)."""

    def call(self, inputs):
        return keras.ops.concatenate([keras.ops.mean(inputs, axis=(1, 2)), inputs[:, 0, 0, :]], axis=-1)


def toy_backbone(size=16):
    inputs = keras.Input((size, size, 3))
    return keras.Model(inputs, MeanColour()(inputs), name="toy")


def write_jpegs(directory, count=3, size=(40, 30)):
    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        path = directory / f"{index}.png"
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_extract_image_features_ten_crop_average(tmp_path):
    paths = write_jpegs(tmp_path)
    backbone = toy_backbone(16)
    features = image_features.extract_image_features(paths, backbone, ten_crop=True, batch_size=2)
    assert features.shape == (3, 6) and features.dtype == np.float32
    crops = images.ten_crops(images.load_image(paths[1]), crop_size=16, resize_to=18)
    expected = np.asarray(backbone(crops.astype(np.float32))).mean(axis=0)
    np.testing.assert_allclose(features[1], expected, rtol=1e-5, atol=1e-4)
    whole = image_features.extract_image_features(paths, backbone, ten_crop=False)
    resized = images.resize(images.load_image(paths[2]), 16, 16).astype(np.float32)
    np.testing.assert_allclose(whole[2], np.asarray(backbone(resized[None]))[0], rtol=1e-5, atol=1e-4)
    # Crops larger than the backbone input are resized to it.
    bigger = image_features.extract_image_features(paths, backbone, crop_size=24, resize_to=28)
    assert bigger.shape == (3, 6)


def test_extract_image_features_reports_bad_files(tmp_path):
    paths = write_jpegs(tmp_path, count=1)
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 broken")
    with pytest.raises(DataFormatError, match="broken.jpg"):
        image_features.extract_image_features(paths + [tmp_path / "broken.jpg"], toy_backbone())
    with pytest.raises(DataFormatError, match="nothere.jpg"):
        image_features.extract_image_features([tmp_path / "nothere.jpg"], toy_backbone())


def test_batches_prepared_ahead_give_the_same_features_and_name_a_bad_file(tmp_path):
    """The next batch's views are decoded while the backbone runs on this one."""
    paths = write_jpegs(tmp_path)
    backbone = toy_backbone(16)
    one_at_a_time = image_features.extract_image_features(paths, backbone, batch_size=1)
    np.testing.assert_allclose(image_features.extract_image_features(paths, backbone, batch_size=2),
                               one_at_a_time, rtol=1e-6, atol=1e-6)
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 broken")
    with pytest.raises(DataFormatError, match="broken.jpg"):
        image_features.extract_image_features(paths + [tmp_path / "broken.jpg"], backbone, batch_size=1)


def test_region_features_equal_features_of_the_cropped_image():
    keras.utils.set_random_seed(0)
    backbone = backbones.build_backbone("resnet50", input_size=32)
    image = np.random.default_rng(1).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    boxes = np.array([[0, 0, 70, 50], [10, 5, 40, 45], [3.5, 2.2, 20.1, 30.0]])
    features = image_features.extract_region_features(image, boxes, backbone, batch_size=2)
    assert features.shape == (3, 2048)
    manual = image_features.extract_image_features([image[5:45, 10:40]], backbone, ten_crop=False)
    np.testing.assert_allclose(features[1], manual[0], rtol=1e-4, atol=1e-4)
    fractional = image_features.extract_image_features([image[2:30, 3:21]], backbone, ten_crop=False)
    np.testing.assert_allclose(features[2], fractional[0], rtol=1e-4, atol=1e-4)
    assert image_features.extract_region_features(image, np.zeros((0, 4)), backbone).shape == (0, 2048)


def test_region_box_validation(tmp_path):
    image = np.zeros((20, 30, 3), np.uint8)
    backbone = toy_backbone()
    with pytest.raises(DataFormatError, match="outside the 30x20 image"):
        image_features.extract_region_features(image, [[0, 0, 31, 10]], backbone, source="img.jpg")
    with pytest.raises(DataFormatError, match="img.jpg, record 1: .*empty"):
        image_features.extract_region_features(image, [[0, 0, 5, 5], [5, 5, 5, 9]], backbone, source="img.jpg")
    with pytest.raises(DataFormatError, match="outside"):
        image_features.extract_region_features(image, [[-1, 0, 5, 5]], backbone)
    with pytest.raises(DataFormatError, match=r"shape \(R, 4\)"):
        image_features.extract_region_features(image, [[0, 0, 5]], backbone)
    with pytest.raises(ConfigError):
        image_features.extract_region_features(image, [[0, 0, 5, 5]], backbone, crop_size=99)


def test_region_features_of_a_real_jpeg(realdata):
    path = realdata / "flickr30k" / "images" / "4945942737.jpg"
    height, width = images.load_image(path).shape[:2]
    boxes = [[0, 0, width, height], [width // 4, height // 4, width // 2, height // 2]]
    features = image_features.extract_region_features(path, boxes, toy_backbone())
    assert features.shape == (2, 6) and np.all(np.isfinite(features))
    with pytest.raises(DataFormatError, match="4945942737.jpg"):
        image_features.extract_region_features(path, [[0, 0, width + 5, height]], toy_backbone())


def test_vocabulary_and_targets():
    captions = [[["a", "red", "square"], ["red", "box"]], [["a", "blue", "square"], ["blue", "one"]],
                [["green", "square"], ["a", "square", "2"]]]
    vocabulary = scene_cnn.build_caption_word_vocabulary(captions, vocab_size=10, min_images=1)
    # Digits written as numerals are content words too; stop words are not.
    assert vocabulary[0] == "square" and "a" not in vocabulary and "2" in vocabulary
    targets = scene_cnn.caption_word_targets(captions, vocabulary)
    assert targets[0, vocabulary.index("red")] == 1.0
    assert targets[0, vocabulary.index("box")] == 0.5
    assert targets[2, vocabulary.index("square")] == 1.0


def test_scene_cnn_learns_colour_words(tmp_path):
    from sklearn.linear_model import LogisticRegression

    pictures, captions, _ = colour_squares(240, seed=0)
    extractor = scene_cnn.train_scene_cnn(pictures, captions, feature_dim=64, epochs=6, batch_size=32,
                                          vocab_size=20, seed=0)
    assert set(COLOURS) <= set(extractor.vocabulary)
    assert extractor.output_shape == (None, 64)
    held_out, _, labels = colour_squares(200, seed=1)
    features = image_features.extract_image_features(list(held_out), extractor, ten_crop=False, batch_size=64)
    probe = LogisticRegression(max_iter=2000).fit(features[:100], labels[:100])
    accuracy = probe.score(features[100:], labels[100:])
    assert accuracy >= 0.9, accuracy
    # Ten-crop views of a small image use crops relative to its input size.
    ten = image_features.extract_image_features(list(held_out[:4]), extractor, ten_crop=True)
    assert ten.shape == (4, 64)

    path = tmp_path / "scene.keras"
    scene_cnn.save_scene_cnn(extractor, path)
    loaded = backbones.build_backbone("scene_cnn", weights_path=path)
    np.testing.assert_allclose(loaded(held_out[:5].astype(np.float32)), extractor(held_out[:5].astype(np.float32)),
                               rtol=1e-5, atol=1e-5)


def test_scene_cnn_errors(tmp_path):
    with pytest.raises(DataFormatError, match="does not exist"):
        scene_cnn.load_scene_cnn(tmp_path / "absent.keras")
    bad = tmp_path / "bad.keras"
    bad.write_bytes(b"not a zip")
    with pytest.raises(DataFormatError, match="bad.keras"):
        scene_cnn.load_scene_cnn(bad)
    with pytest.raises(ConfigError, match="uint8"):
        scene_cnn.train_scene_cnn(np.zeros((2, 32, 32, 3), np.float32), [[["a"]], [["b"]]])
    with pytest.raises(ConfigError, match="captions for 1"):
        scene_cnn.train_scene_cnn(np.zeros((2, 32, 32, 3), np.uint8), [[["a"]]])


def test_region_crops_keep_the_object():
    picture = np.zeros((40, 40, 3), np.uint8)
    picture[10:20, 24:30] = (200, 10, 10)  # box [24, 10, 29, 19], inclusive
    crop = scene_cnn.square_region_crop(picture, [24, 10, 29, 19], 16, margin=0.0)
    assert crop.shape == (16, 16, 3) and crop.dtype == np.uint8
    # A square around the 6x10 box: the object fills the middle columns, not the sides.
    assert crop[8, 8, 0] > 150 and crop[8, 0, 0] < 50
    # Near the border the square shifts inside the image instead of padding.
    corner = scene_cnn.square_region_crop(picture, [0, 0, 3, 3], 8)
    assert corner.shape == (8, 8, 3)
    # min_fraction bounds the zoom: 1.0 keeps the whole image.
    np.testing.assert_array_equal(scene_cnn.square_region_crop(picture, [24, 10, 29, 19], 40, min_fraction=1.0),
                                  picture)
    masked = scene_cnn.masked_region_image(picture + 30, [24, 10, 29, 19], 40, margin=0.0)
    assert masked[15, 26, 0] == 230 and np.all(masked[0, 0] == 30)
    with pytest.raises(ConfigError, match="x2 >= x1"):
        scene_cnn.square_region_crop(picture, [5, 5, 1, 9], 8)


def write_entities(root, image_ids):
    (root / "Sentences").mkdir(parents=True)
    (root / "Annotations").mkdir()
    for image_id in image_ids:
        (root / "Sentences" / f"{image_id}.txt").write_text(
            "[/EN#1/other A red square] is near [/EN#2/other a blue bar] .\n"
            "[/EN#1/other The square] is on [/EN#3/scene a dark background] .\n")
        (root / "Annotations" / f"{image_id}.xml").write_text(
            "<annotation><filename>{0}.jpg</filename><size><width>32</width><height>32</height>"
            "<depth>3</depth></size>"
            "<object><name>1</name><bndbox><xmin>3</xmin><ymin>4</ymin><xmax>12</xmax><ymax>13</ymax></bndbox></object>"
            "<object><name>2</name><bndbox><xmin>20</xmin><ymin>2</ymin><xmax>24</xmax><ymax>30</ymax></bndbox></object>"
            "<object><name>3</name><scene>1</scene><nobndbox>0</nobndbox></object>"
            "</annotation>".format(image_id))


def test_entity_region_crops_and_region_supervision(tmp_path):
    pictures, captions, _ = colour_squares(40, seed=2)
    ids = [str(1000 + i) for i in range(40)]
    assert scene_cnn.entity_region_crops(tmp_path, ids, pictures) is None  # no Annotations folder
    write_entities(tmp_path, ids)
    crops, token_lists = scene_cnn.entity_region_crops(tmp_path, ids[:3], pictures[:3])
    # One crop per distinct box; both phrases of chain 1 describe the first box; no crop for the scene.
    assert crops.shape == (6, 32, 32, 3) and crops.dtype == np.uint8
    assert sorted(map(tuple, token_lists[0])) == [("a", "red", "square"), ("the", "square")]
    assert token_lists[1] == [["a", "blue", "bar"]]
    with pytest.raises(ConfigError, match="one \\(S, S, 3\\) image per id"):
        scene_cnn.entity_region_crops(tmp_path, ids[:3], pictures[:2])

    crops, token_lists = scene_cnn.entity_region_crops(tmp_path, ids, pictures)
    extractor = scene_cnn.train_scene_cnn(pictures, captions, feature_dim=16, epochs=1, batch_size=32,
                                          widths=(8, 8, 8, 8), vocab_size=20, region_crops=crops,
                                          region_token_lists=token_lists, binary_targets=True, seed=0)
    # Phrase-only words join the vocabulary.
    assert {"bar", "red"} <= set(extractor.vocabulary) and extractor.output_shape == (None, 16)
    with pytest.raises(ConfigError, match="both region_crops and region_token_lists"):
        scene_cnn.train_scene_cnn(pictures, captions, region_crops=crops)
    with pytest.raises(ConfigError, match="region_crops must be uint8"):
        scene_cnn.train_scene_cnn(pictures, captions, region_crops=crops[:, :16, :16],
                                  region_token_lists=token_lists)
    with pytest.raises(ConfigError, match="phrases for 3"):
        scene_cnn.train_scene_cnn(pictures, captions, region_crops=crops, region_token_lists=token_lists[:3])


def run_cli(argv):
    from unittest import mock

    from absl import flags

    from tf_twobranch.tools import extract_image_features as cli

    # The tool defines its flags only when run as a script: parse them into a fresh
    # FlagValues and let run() read that one instead of the global FLAGS.
    fv = flags.FlagValues()
    cli.define_flags(fv)
    fv(["extract_image_features"] + argv)
    with mock.patch.object(cli, "FLAGS", fv):
        cli.run()


def test_cli_writes_features_in_split_order(tmp_path):
    import scipy.io

    from tf_twobranch.errors import UserInputError

    images_dir = tmp_path / "images"
    images_dir.mkdir()
    rng = np.random.default_rng(0)
    for image_id in ("11", "22", "33"):
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(images_dir / f"{image_id}.jpg")
    (tmp_path / "split.txt").write_text("33\n11\n")
    out = tmp_path / "feats.mat"
    run_cli([f"--images_dir={images_dir}", f"--image_ids={tmp_path / 'split.txt'}", "--backbone=resnet50",
             "--input_size=32", "--batch_size=1", f"--out={out}"])
    features = scipy.io.loadmat(out)["image_features"]
    assert features.shape == (2, 2048)
    (tmp_path / "bad_split.txt").write_text("11\n44\n")
    with pytest.raises(UserInputError, match="44.jpg.*does not exist"):
        run_cli([f"--images_dir={images_dir}", f"--image_ids={tmp_path / 'bad_split.txt'}",
                 f"--out={tmp_path / 'x.npy'}"])
    with pytest.raises(UserInputError, match="expected a file ending"):
        run_cli([f"--images_dir={images_dir}", f"--out={tmp_path / 'x.txt'}"])
    with pytest.raises(UserInputError, match="scene_cnn needs --weights"):
        run_cli([f"--images_dir={images_dir}", "--backbone=scene_cnn", f"--out={tmp_path / 'x.npy'}"])


def test_cli_user_error_is_one_line(tmp_path):

    result = run_python(
        ["-m", "tf_twobranch.tools.extract_image_features",
         f"--images_dir={tmp_path / 'nowhere'}", f"--out={tmp_path / 'f.npy'}"],
        timeout=120, cwd=__import__("pathlib").Path(__file__).parents[3],
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 2
    assert "error:" in result.stderr and "nowhere" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr

