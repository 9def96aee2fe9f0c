"""Tests for tf_twobranch.features.images."""
import numpy as np
import pytest
from PIL import Image

from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.data.formats.images import load_image
from tf_twobranch.features import images
from tf_twobranch.image_decoding import tf_decode_image


def gradient_image(height=20, width=20):
    """R = column index, G = row index, B = constant."""
    rows, cols = np.mgrid[0:height, 0:width]
    return np.stack([cols, rows, np.full_like(rows, 7)], axis=-1).astype(np.uint8)


def test_ten_crops_geometry():
    image = gradient_image(20, 20)
    crops = images.ten_crops(image, crop_size=12, resize_to=20)  # no resize: exact pixels
    assert crops.shape == (10, 12, 12, 3) and crops.dtype == np.uint8
    expected_top_left = {"top_left": (0, 0), "top_right": (0, 8), "bottom_left": (8, 0),
                         "bottom_right": (8, 8), "center": (4, 4)}
    for index, name in enumerate(images.CROP_NAMES[:5]):
        top, left = expected_top_left[name]
        crop = crops[index]
        assert crop[0, 0, 0] == left and crop[0, 0, 1] == top, name
        assert crop[-1, -1, 0] == left + 11 and crop[-1, -1, 1] == top + 11, name
        mirror = crops[index + 5]
        np.testing.assert_array_equal(mirror, crop[:, ::-1])
        # Mirrored: first column holds the crop's rightmost column.
        assert mirror[0, 0, 0] == left + 11 and mirror[0, -1, 0] == left


def test_ten_crops_resizes_to_square_first():
    image = gradient_image(30, 45)
    crops = images.ten_crops(image, crop_size=16, resize_to=18)
    assert crops.shape == (10, 16, 16, 3)
    # After the resize the gradient spans 0..44 over 18 columns; the right crops see larger R.
    assert crops[1, :, :, 0].mean() > crops[0, :, :, 0].mean()
    assert crops[2, :, :, 1].mean() > crops[0, :, :, 1].mean()


def test_ten_crops_rejects_bad_sizes():
    with pytest.raises(ConfigError):
        images.ten_crops(gradient_image(), crop_size=30, resize_to=20)


def test_center_crop_and_resize_shorter_side():
    image = gradient_image(20, 30)
    crop = images.center_crop(image, 10)
    assert crop[0, 0, 0] == 10 and crop[0, 0, 1] == 5
    assert images.resize_shorter_side(image, 10).shape == (10, 15, 3)
    assert images.resize_shorter_side(gradient_image(30, 20), 10).shape == (15, 10, 3)
    with pytest.raises(ConfigError):
        images.center_crop(image, 25)


def test_load_image_converts_modes(tmp_path):
    gray = tmp_path / "gray.png"
    Image.fromarray(np.full((5, 6), 100, np.uint8), mode="L").save(gray)
    rgba = tmp_path / "rgba.png"
    Image.fromarray(np.full((4, 3, 4), 50, np.uint8), mode="RGBA").save(rgba)
    assert load_image(gray).shape == (5, 6, 3)
    loaded = load_image(rgba)
    assert loaded.shape == (4, 3, 3) and loaded.dtype == np.uint8 and loaded[0, 0, 0] == 50


def test_load_image_errors_name_the_file(tmp_path):
    with pytest.raises(DataFormatError, match="missing.jpg.*does not exist"):
        load_image(tmp_path / "missing.jpg")
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(DataFormatError, match="empty.jpg.*empty"):
        load_image(empty)
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"this is not a jpeg at all" * 10)
    with pytest.raises(DataFormatError, match="corrupt.jpg.*cannot decode"):
        load_image(corrupt)
    truncated = tmp_path / "truncated.jpg"
    Image.fromarray(gradient_image(64, 64)).save(tmp_path / "full.jpg")
    truncated.write_bytes((tmp_path / "full.jpg").read_bytes()[:200])
    with pytest.raises(DataFormatError, match="truncated.jpg"):
        load_image(truncated)


def test_load_real_jpegs(realdata):
    paths = sorted((realdata / "flickr30k" / "images").glob("*.jpg"))
    assert len(paths) == 8
    for path in paths:
        image = load_image(path)
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        assert min(image.shape[:2]) >= 100
        assert images.ten_crops(image, 32, 40).shape == (10, 32, 32, 3)


def test_tf_decode_and_ten_crops(tmp_path):
    import tensorflow as tf

    image = gradient_image(20, 20)
    Image.fromarray(image).save(tmp_path / "g.png")
    decoded = tf_decode_image(tf.constant((tmp_path / "g.png").read_bytes()))
    np.testing.assert_array_equal(decoded.numpy(), image)
    crops = images.tf_ten_crops(decoded, crop_size=12, resize_to=20).numpy()
    np.testing.assert_allclose(crops, images.ten_crops(image, 12, 20).astype(np.float32), atol=1e-3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="bad.jpg: cannot decode"):
        tf_decode_image(tf.constant(b"garbage bytes"), name="bad.jpg")


# Sizes that exercise every branch of PIL's resampling: shrinking (the filter
# widened, antialiasing), enlarging, one side kept, odd ratios, one-pixel sides,
# and both pass orders (Pillow 13 starts with the vertical pass when the height
# shrinks by more than twice the width's pixels).
PIL_RESIZE_CASES = [((20, 20), (12, 12)), ((37, 53), (256, 256)), ((375, 500), (110, 110)),
                    ((96, 96), (96, 40)), ((5, 3), (17, 29)), ((1, 9), (4, 1)), ((64, 48), (63, 49)),
                    ((333, 201), (224, 224)), ((107, 44), (9, 13)), ((105, 65), (68, 97)),
                    ((65, 54), (22, 27)), ((36, 85), (7, 34))]


@pytest.mark.parametrize("size, target", PIL_RESIZE_CASES)
def test_tf_pil_resize_is_bit_exact_to_pil(size, target):
    rng = np.random.default_rng(sum(size) + sum(target))
    image = rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)
    expected = images.resize(image, *target)
    np.testing.assert_array_equal(images.tf_pil_resize(image, *target).numpy(), expected)


def test_tf_pil_resize_on_real_jpegs_and_in_a_graph(realdata):
    import tensorflow as tf

    @tf.function(input_signature=[tf.TensorSpec([], tf.string), tf.TensorSpec([2], tf.int32)])
    def decode_and_resize(jpeg, size):
        return images.tf_pil_resize(tf_decode_image(jpeg), size[0], size[1])

    paths = sorted((realdata / "flickr30k").rglob("*.jpg"))[:3]
    assert paths, "no Flickr30K JPEGs in the real-data samples"
    for path in paths:
        image = images.load_image(path)
        for target in ((256, 256), (96, 96), (image.shape[0], 224)):
            served = decode_and_resize(tf.constant(path.read_bytes()), tf.constant(target)).numpy()
            np.testing.assert_array_equal(served, images.resize(image, *target), err_msg=f"{path.name} {target}")
        crops = images.tf_ten_crops(tf_decode_image(tf.constant(path.read_bytes())), 224, 256).numpy()
        np.testing.assert_array_equal(crops, images.ten_crops(image, 224, 256).astype(np.float32))


def test_tf_pil_resize_takes_uint8_only():
    with pytest.raises(ConfigError, match="uint8"):
        images.tf_pil_resize(np.zeros((4, 4, 3), np.float32), 2, 2)


def test_tf_pil_resize_random_size_sweep():
    rng = np.random.default_rng(13)
    for _ in range(60):
        height, width, new_height, new_width = (int(v) for v in rng.integers(1, 70, size=4))
        image = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        np.testing.assert_array_equal(images.tf_pil_resize(image, new_height, new_width).numpy(),
                                      images.resize(image, new_height, new_width),
                                      err_msg=f"{height}x{width} -> {new_height}x{new_width}")
