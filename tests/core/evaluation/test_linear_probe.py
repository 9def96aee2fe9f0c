import numpy as np
import pytest

from tf_twobranch.data.phrases import PhraseExample
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation.linear_probe import (chance_accuracy, digit_class_of_phrases, digit_classes_named,
                                                  digit_object_boxes, linear_probe_accuracy)


def test_probe_is_at_chance_on_random_features_and_perfect_on_separable_ones():
    rng = np.random.default_rng(0)
    noise_train, noise_test = rng.normal(size=(400, 8)), rng.normal(size=(400, 8))
    labels_train, labels_test = rng.integers(0, 4, 400), rng.integers(0, 4, 400)
    assert abs(linear_probe_accuracy(noise_train, labels_train, noise_test, labels_test) - 0.25) < 0.08
    # Class k sits at 10 * e_k plus unit noise, on an arbitrary scale per dimension.
    scale = np.array([1e-3, 1.0, 1e3, 5.0, 1.0, 1.0, 1.0, 1.0])
    separable_train = (noise_train + 10 * np.eye(8)[labels_train]) * scale
    separable_test = (noise_test + 10 * np.eye(8)[labels_test]) * scale
    assert linear_probe_accuracy(separable_train, labels_train, separable_test, labels_test) >= 0.99
    assert chance_accuracy([0, 0, 1], [0, 1, 1, 1]) == 0.25


def test_probe_rejects_inputs_that_disagree():
    x = np.zeros((4, 3))
    with pytest.raises(UserInputError, match="one label per feature row"):
        linear_probe_accuracy(x, [0, 1, 0], x, [0, 1, 0, 1])
    with pytest.raises(UserInputError, match="differ in dimension"):
        linear_probe_accuracy(x, [0, 1, 0, 1], np.zeros((4, 2)), [0, 1, 0, 1])
    with pytest.raises(UserInputError, match="two classes"):
        linear_probe_accuracy(x, [1, 1, 1, 1], x, [0, 1, 0, 1])
    with pytest.raises(UserInputError, match="NaN or inf"):
        linear_probe_accuracy(np.full((4, 3), np.nan), [0, 1, 0, 1], x, [0, 1, 0, 1])


@pytest.mark.parametrize("phrase, classes", [
    ("a small red seven", {7}),
    ("Two red sevens", {7}),
    ("the two sevens in crimson", {7}),
    ("a pair of 3s", {3}),
    ("the number 4", {4}),
    ("One green digit eight", {8}),
    ("a two", {2}),
    ("the two in red", {2}),
    ("a tiny blue one", {1}),
    ("two digits in yellow", set()),
    ("Two yellow digits", set()),
    ("a mottled black background", set()),
    ("a seven next to a nine", {7, 9}),
])
def test_digit_classes_named(phrase, classes):
    assert digit_classes_named(phrase) == classes


def test_digit_class_of_phrases_needs_exactly_one_class():
    assert digit_class_of_phrases(["two yellow digits", "Two yellow fours", "the fours"]) == 4
    assert digit_class_of_phrases(["two yellow digits", "a yellow digit"]) is None
    assert digit_class_of_phrases(["a seven", "a nine"]) is None
    assert digit_class_of_phrases([]) is None


def _example(image_id, chain_id, phrase, boxes):
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    return PhraseExample(image_id=image_id, sentence_index=0, phrase_index=0, phrase=phrase, chain_id=chain_id,
                         phrase_types=["other"], gt_box=boxes[0], gt_boxes=boxes)


def test_digit_object_boxes_labels_each_object_of_a_chain_and_skips_unnamed_chains():
    examples = [
        _example("a", "1", "two yellow digits", [[0, 0, 4, 4], [10, 10, 14, 14]]),
        _example("a", "1", "two yellow fours", [[0, 0, 4, 4], [10, 10, 14, 14]]),
        _example("a", "2", "a green digit", [[20, 20, 30, 30]]),
        _example("b", "7", "a big 9", [[1, 2, 3, 4]]),
    ]
    boxes = digit_object_boxes(examples)
    assert boxes.image_ids == ["a", "a", "b"]
    np.testing.assert_array_equal(boxes.labels, [4, 4, 9])
    np.testing.assert_array_equal(boxes.boxes[1], [10, 10, 14, 14])
    assert boxes.skipped_chains == 1
    by_image = boxes.by_image()
    assert list(by_image) == ["a", "b"] and len(by_image["a"][0]) == 2
    empty = digit_object_boxes([])
    assert empty.boxes.shape == (0, 4) and empty.labels.shape == (0,)


def test_probe_benchmark_encodes_inclusive_boxes_like_image_fragments(tmp_path):
    import keras
    from PIL import Image

    from benchmarks.probe_scene_cnn import _box_features
    from tf_twobranch.evaluation.linear_probe import DigitBoxes
    from tf_twobranch.features.image_features import extract_region_features

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.png")

    class Layout:
        def image_paths(self, image_ids):
            return [tmp_path / f"{i}.png" for i in image_ids]

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    backbone = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(inputs)))
    # The whole image as an inclusive box must be accepted (half-open [0, 0, 10, 12]).
    boxes = DigitBoxes(["a", "a"], np.array([[0, 0, 9, 11], [2, 3, 5, 7]], np.float32), np.array([3, 5]), 0)
    features, labels = _box_features(Layout(), ["a"], boxes, backbone)
    expected = extract_region_features(pixels, [[0, 0, 10, 12], [2, 3, 6, 8]], backbone)
    np.testing.assert_allclose(features, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(labels, [3, 5])
