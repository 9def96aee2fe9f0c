"""Tests for tf_twobranch.features.backbones (tiny input sizes, random weights)."""
import h5py
import keras
import numpy as np
import pytest

from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.features import backbones


def random_images(count=2, size=32, seed=0):
    return np.random.default_rng(seed).uniform(0, 255, (count, size, size, 3)).astype(np.float32)


def test_output_dims_and_names():
    assert backbones.backbone_output_dim("vgg19") == 4096
    assert backbones.backbone_output_dim("vgg16") == 4096
    assert backbones.backbone_output_dim("resnet50") == 2048
    assert backbones.backbone_output_dim("resnet152") == 2048
    assert backbones.imagenet_weights_filename("vgg19") == "vgg19_weights_tf_dim_ordering_tf_kernels.h5"
    with pytest.raises(ConfigError, match="unknown backbone"):
        backbones.backbone_output_dim("alexnet")
    with pytest.raises(ConfigError, match="unknown backbone"):
        backbones.build_backbone("alexnet")
    with pytest.raises(ConfigError, match="input_size"):
        backbones.build_backbone("resnet50", input_size=8)


def test_vgg19_fc7_with_random_weights_warns(caplog):
    with caplog.at_level("WARNING"):
        model = backbones.build_backbone("vgg19", input_size=32)
    assert "RANDOMLY INITIALISED" in caplog.text and "vgg19_weights_tf_dim_ordering_tf_kernels.h5" in caplog.text
    assert model.output_shape == (None, 4096)
    assert backbones.backbone_input_size(model) == 32
    assert backbones.backbone_output_dim(model) == 4096
    trunk = model.get_layer("vgg19_trunk")
    assert trunk.layers[-1].name == "fc2"  # fc7 in Caffe naming


def test_preprocessing_is_inside_the_model(random_resnet50):
    model = random_resnet50
    images = random_images()
    trunk = model.get_layer("resnet50_trunk")
    expected = trunk(keras.applications.resnet50.preprocess_input(images.copy()), training=False)
    np.testing.assert_allclose(model(images, training=False), expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def random_resnet50():
    keras.utils.set_random_seed(1)
    return backbones.build_backbone("resnet50", input_size=32)


def test_resnet50_weights_round_trip(tmp_path, random_resnet50):
    source = random_resnet50
    path = tmp_path / "resnet50_random.weights.h5"
    source.get_layer("resnet50_trunk").save_weights(path)
    keras.utils.set_random_seed(2)
    loaded = backbones.build_backbone("resnet50", input_size=32, weights_path=path)
    images = random_images()
    np.testing.assert_allclose(loaded(images, training=False), source(images, training=False), rtol=1e-5, atol=1e-5)


def test_legacy_h5_weights_like_the_imagenet_files(tmp_path):
    """The published ImageNet files use the legacy Keras 2 HDF5 layout."""
    from keras.src.legacy.saving import legacy_h5_format

    keras.utils.set_random_seed(3)
    network = keras.applications.VGG16(include_top=True, weights=None, input_shape=(32, 32, 3))
    path = tmp_path / "vgg16_weights_tf_dim_ordering_tf_kernels.h5"
    with h5py.File(path, "w") as handle:
        legacy_h5_format.save_weights_to_hdf5_group(handle, network)
    model = backbones.build_backbone("vgg16", input_size=32, weights_path=path)
    images = random_images()
    expected = keras.Model(network.input, network.get_layer("fc2").output)(
        keras.applications.vgg16.preprocess_input(images.copy()))
    np.testing.assert_allclose(model(images, training=False), expected, rtol=1e-4, atol=1e-4)


def test_mismatched_weights_file(tmp_path, random_resnet50):
    path = tmp_path / "resnet50.weights.h5"
    random_resnet50.get_layer("resnet50_trunk").save_weights(path)
    with pytest.raises(DataFormatError, match="resnet50.weights.h5.*do not match backbone 'vgg16'"):
        backbones.build_backbone("vgg16", input_size=32, weights_path=path)
    with pytest.raises(DataFormatError, match="does not exist"):
        backbones.build_backbone("resnet50", input_size=32, weights_path=tmp_path / "absent.h5")
    not_hdf5 = tmp_path / "garbage.h5"
    not_hdf5.write_bytes(b"not an hdf5 file")
    with pytest.raises(DataFormatError, match="garbage.h5"):
        backbones.build_backbone("resnet50", input_size=32, weights_path=not_hdf5)
    wrong_ext = tmp_path / "weights.bin"
    wrong_ext.write_bytes(b"x")
    with pytest.raises(DataFormatError, match=r"\.h5"):
        backbones.build_backbone("resnet50", input_size=32, weights_path=wrong_ext)


def test_scene_cnn_needs_a_model_file():
    with pytest.raises(ConfigError, match="scene_cnn"):
        backbones.build_backbone("scene_cnn")
    with pytest.raises(ConfigError, match="scene_cnn"):
        backbones.backbone_output_dim("scene_cnn")


@pytest.mark.slow
def test_resnet152_builds():
    model = backbones.build_backbone("resnet152", input_size=32)
    assert model(random_images(1), training=False).shape == (1, 2048)
