"""ImageNet CNN backbones from `keras.applications`, loaded from local files.

Every backbone is returned as a `keras.Model` that takes float RGB images with
values in 0..255, shape (batch, input_size, input_size, 3), applies the
matching `keras.applications.<x>.preprocess_input` itself (for VGG and ResNet:
RGB→BGR and subtraction of the ImageNet channel means, the "mean intensity
subtracted from each colour channel" of the paper), and outputs one feature
vector per image:

=========  =======================  =====  ============================================
name       output                   dim    ImageNet weights file (Keras' standard name)
=========  =======================  =====  ============================================
vgg19      fc7 (Keras layer "fc2")  4096   vgg19_weights_tf_dim_ordering_tf_kernels.h5
vgg16      fc7 (Keras layer "fc2")  4096   vgg16_weights_tf_dim_ordering_tf_kernels.h5
resnet50   global average pool5     2048   resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5
resnet152  global average pool5     2048   resnet152_weights_tf_dim_ordering_tf_kernels_notop.h5
=========  =======================  =====  ============================================

Weights are never downloaded: the networks are built with ``weights=None`` and
then, when a local file is given, loaded from it (legacy Keras ``.h5`` files as
published with keras.applications, or Keras 3 ``.weights.h5`` files).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from typing import Callable

import h5py
import keras
from absl import logging

from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.features.scene_cnn import load_scene_cnn

__all__ = [
    "BACKBONE_NAMES",
    "ImageNetPreprocess",
    "build_backbone",
    "backbone_output_dim",
    "backbone_input_size",
    "imagenet_weights_filename",
]


@dataclasses.dataclass(frozen=True)
class _BackboneSpec:
    constructor: Callable[..., keras.Model]
    preprocess_module: str  # attribute of keras.applications
    include_top: bool
    feature_layer: str | None  # None: the (globally pooled) network output
    output_dim: int
    weights_filename: str
    fixed_input_size: int | None  # the fully-connected head fixes the input size of pretrained weights


_SPECS: dict[str, _BackboneSpec] = {
    "vgg19": _BackboneSpec(keras.applications.VGG19, "vgg19", True, "fc2", 4096,
                           "vgg19_weights_tf_dim_ordering_tf_kernels.h5", 224),
    "vgg16": _BackboneSpec(keras.applications.VGG16, "vgg16", True, "fc2", 4096,
                           "vgg16_weights_tf_dim_ordering_tf_kernels.h5", 224),
    "resnet50": _BackboneSpec(keras.applications.ResNet50, "resnet50", False, None, 2048,
                              "resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5", None),
    "resnet152": _BackboneSpec(keras.applications.ResNet152, "resnet", False, None, 2048,
                               "resnet152_weights_tf_dim_ordering_tf_kernels_notop.h5", None),
}

BACKBONE_NAMES: tuple[str, ...] = tuple(_SPECS) + ("scene_cnn",)


@keras.saving.register_keras_serializable(package="tf_twobranch")
class ImageNetPreprocess(keras.layers.Layer):
    """Applies `keras.applications.<module>.preprocess_input` to 0..255 RGB input."""

    def __init__(self, module: str, **kwargs):
        super().__init__(**kwargs)
        self.module = module
        self._preprocess = getattr(keras.applications, module).preprocess_input

    def call(self, inputs):
        return self._preprocess(keras.ops.cast(inputs, "float32"))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "module": self.module}


def _spec(name: str) -> _BackboneSpec:
    if name not in _SPECS:
        raise ConfigError(f"unknown backbone {name!r}; expected one of {', '.join(BACKBONE_NAMES)}")
    return _SPECS[name]


def imagenet_weights_filename(name: str) -> str:
    """The standard Keras file name of the ImageNet weights for backbone `name`."""
    return _spec(name).weights_filename


def backbone_output_dim(name_or_model: str | keras.Model) -> int:
    """Feature dimension of a backbone (by name, or of a built model)."""
    if isinstance(name_or_model, keras.Model):
        return int(name_or_model.output_shape[-1])
    if name_or_model == "scene_cnn":
        raise ConfigError("the scene_cnn feature dimension is chosen at training time "
                          "(feature_dim); pass the loaded model instead of its name")
    return _spec(name_or_model).output_dim


def backbone_input_size(model: keras.Model) -> int:
    """Side of the square images a backbone model expects."""
    shape = model.input_shape
    if shape[1] is None or shape[1] != shape[2]:
        raise ConfigError(f"backbone {model.name!r} does not have a fixed square input (input shape {shape})")
    return int(shape[1])


def _check_weights_file(weights_path: pathlib.Path, name: str) -> None:
    """Cheap checks done before the (slow) network construction."""
    spec = _SPECS[name]
    if not weights_path.is_file():
        raise DataFormatError(weights_path, f"weights file for backbone {name!r} does not exist; "
                              f"expected a local copy of {spec.weights_filename}")
    if not weights_path.name.endswith((".h5", ".hdf5")):
        raise DataFormatError(weights_path, "expected a Keras weights file ending in .h5, .hdf5 "
                              f"or .weights.h5 (e.g. {spec.weights_filename})")
    if not h5py.is_hdf5(weights_path):
        raise DataFormatError(weights_path, f"not an HDF5 file; expected Keras weights of {name} "
                              f"(e.g. {spec.weights_filename})")


def _load_weights(network: keras.Model, weights_path: pathlib.Path, name: str) -> None:
    spec = _SPECS[name]
    hint = f"expected the weights of {name} (e.g. {spec.weights_filename})"
    if spec.fixed_input_size is not None and network.input_shape[1] != spec.fixed_input_size:
        hint += (f"; ImageNet weights of {name} include fully-connected layers that need "
                 f"input_size={spec.fixed_input_size}")
    with warnings.catch_warnings(record=True) as caught:
        # Keras 3 only warns when parts of a .weights.h5 file have no
        # counterpart, leaving those layers random: treat that as a mismatch.
        warnings.simplefilter("always")
        try:
            network.load_weights(str(weights_path))
        except (ValueError, OSError, KeyError, TypeError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DataFormatError(weights_path, f"weights do not match backbone {name!r} "
                                  f"({first_line}); {hint}") from None
    problems = [str(w.message) for w in caught
                if issubclass(w.category, UserWarning) and "saving" in w.filename.replace("\\", "/")]
    if problems:
        first_line = problems[0].strip().splitlines()[0]
        raise DataFormatError(weights_path, f"weights do not match backbone {name!r} "
                              f"({first_line}); {hint}")


def build_backbone(name: str, *, weights_path: str | os.PathLike | None = None,
                   input_size: int | None = None) -> keras.Model:
    """Builds a feature-extracting backbone.

    Args:
      name: one of "vgg19", "vgg16" (fc7, 4096-d), "resnet50", "resnet152"
        (global-average-pooled, 2048-d), or "scene_cnn" (a model trained by
        `tf_twobranch.features.scene_cnn.train_scene_cnn`; `weights_path` is
        then its saved ``.keras`` file and is required).
      weights_path: local weights file (see the module docstring). Without it
        the network is randomly initialised and a warning is logged.
      input_size: side of the square input images; default 224 (VGG/ResNet).
        VGG's ImageNet weights only fit input_size=224; ResNets accept any
        size >= 32.

    Returns:
      A `keras.Model` mapping (batch, input_size, input_size, 3) float RGB in
      0..255 to (batch, dim) features.

    Raises:
      ConfigError: unknown name or invalid input size.
      DataFormatError: the weights file is missing or does not fit the network.
    """
    if name == "scene_cnn":
        if weights_path is None:
            raise ConfigError("backbone 'scene_cnn' needs the .keras file written by "
                              "train_scene_cnn/save_scene_cnn as its weights path")
        model = load_scene_cnn(weights_path)
        if input_size is not None and backbone_input_size(model) != input_size:
            raise ConfigError(f"scene_cnn in {weights_path} was trained on {backbone_input_size(model)}-pixel "
                              f"images, not input_size={input_size}")
        return model
    spec = _spec(name)
    if input_size is None:
        input_size = 224
    if not isinstance(input_size, int) or input_size < 32:
        raise ConfigError(f"input_size must be an integer >= 32 for {name}, got {input_size!r}")

    if weights_path is not None:
        weights_path = pathlib.Path(weights_path)
        _check_weights_file(weights_path, name)
    network = spec.constructor(include_top=spec.include_top, weights=None,
                               input_shape=(input_size, input_size, 3),
                               pooling=None if spec.include_top else "avg")
    if weights_path is not None:
        _load_weights(network, weights_path, name)
        logging.info("Loaded %s weights from %s", name, weights_path)
    else:
        logging.warning(
            "Backbone %s is RANDOMLY INITIALISED: its features are not ImageNet features. "
            "Pass the local ImageNet weights file %s (weights_path / --weights) to get them.",
            name, spec.weights_filename)

    features = network.get_layer(spec.feature_layer).output if spec.feature_layer else network.output
    trunk = keras.Model(network.input, features, name=f"{name}_trunk")
    images = keras.Input((input_size, input_size, 3), name="images")
    outputs = trunk(ImageNetPreprocess(spec.preprocess_module, name="preprocess")(images))
    return keras.Model(images, outputs, name=f"{name}_features")


# Last convolutional map of each backbone, for models that need locations
# (Das et al.: VGG-19 conv5_4, 14x14x512 at 224^2; the authors' ResNet-50
# variant stops after the third stage, 14x14x1024).
SPATIAL_LAYERS = {"vgg19": "block5_conv4", "vgg16": "block5_conv3",
                  "resnet50": "conv4_block6_out", "resnet152": "conv4_block36_out"}


def build_spatial_backbone(name: str, *, weights_path: str | os.PathLike | None = None,
                           input_size: int | None = None) -> keras.Model:
    """A backbone that outputs its last convolutional map, (batch, h, w, channels).

    Same names, weights files and preprocessing as `build_backbone`; for
    "scene_cnn" the map below its global pooling (the last conv block's ReLU).
    """
    if name == "scene_cnn":
        model = build_backbone(name, weights_path=weights_path, input_size=input_size)
        try:
            conv_map = model.get_layer("global_pool").input
        except ValueError:
            raise DataFormatError(weights_path, "this scene_cnn has no 'global_pool' layer; "
                                  "expected a model written by save_scene_cnn") from None
        return keras.Model(model.input, conv_map, name="scene_cnn_map")
    spec = _spec(name)
    pooled = build_backbone(name, weights_path=weights_path, input_size=input_size)
    trunk = pooled.get_layer(f"{name}_trunk")
    conv = keras.Model(trunk.input, trunk.get_layer(SPATIAL_LAYERS[name]).output, name=f"{name}_map_trunk")
    size = pooled.input.shape[1]
    images = keras.Input((size, size, 3), name="images")
    maps = conv(ImageNetPreprocess(spec.preprocess_module, name="preprocess")(images))
    return keras.Model(images, maps, name=f"{name}_map")
