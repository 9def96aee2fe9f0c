r"""Extracts whole-image CNN features for the images of a split.

Example (the paper's setting, §5.3: VGG-19 fc7 averaged over ten crops):

  python -m tf_twobranch.tools.extract_image_features \
      --images_dir=flickr30k-images --image_ids=test.txt --backbone=vgg19 \
      --weights=vgg19_weights_tf_dim_ordering_tf_kernels.h5 --ten_crop \
      --out=test_vgg19.mat

Rows of the output follow the order of --image_ids.  Without --weights a
VGG/ResNet backbone is randomly initialised (a warning says so); for
--backbone=scene_cnn, --weights is the .keras file saved by
`tf_twobranch.features.scene_cnn.save_scene_cnn`.
"""
from __future__ import annotations

import os
import pathlib

from absl import app, flags, logging

from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.data.formats.features import save_feature_matrix
from tf_twobranch.data.formats.splits import read_split_file
from tf_twobranch.errors import ConfigError, DataFormatError

FLAGS = flags.FLAGS

def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("images_dir", None, "Directory holding the images (<id><extension>).", **d)
    flags.DEFINE_string("image_ids", None, "Split file, one image id per line (extensions are stripped). "
                        "Default: every file with --image_extension in --images_dir, sorted by name.", **d)
    flags.DEFINE_string("image_extension", ".jpg", "Extension appended to each image id.", **d)
    flags.DEFINE_enum("backbone", "vgg19", ["vgg19", "vgg16", "resnet50", "resnet152", "scene_cnn"],
                      "CNN: vgg19/vgg16 give fc7 (4096-d), resnet50/resnet152 pooled 2048-d, scene_cnn a "
                      "model trained by tf_twobranch.features.scene_cnn.", **d)
    flags.DEFINE_string("weights", None, "Local weights file: the Keras ImageNet .h5 file for vgg/resnet "
                        "(e.g. vgg19_weights_tf_dim_ordering_tf_kernels.h5), or the saved scene_cnn .keras file.", **d)
    flags.DEFINE_integer("input_size", None, "Backbone input side (default 224; scene_cnn: its training size).", **d)
    flags.DEFINE_bool("ten_crop", True, "Average the ten crops (corners, centre, mirrors); otherwise encode the "
                      "whole image resized to the input size.", **d)
    flags.DEFINE_integer("crop_size", None, "Ten-crop side (default: the backbone input size).", **d)
    flags.DEFINE_integer("resize_to", None, "Side images are resized to before ten-cropping "
                         "(default crop_size*256/224).", **d)
    flags.DEFINE_integer("batch_size", 32, "Images per backbone call.", **d)
    flags.DEFINE_string("out", None, "Output file: .npy, .npz, .mat or .h5/.hdf5 (array key --out_key).", **d)
    flags.DEFINE_string("out_key", "image_features", "Array name inside .npz/.mat/.h5 outputs.", **d)


_OUTPUT_SUFFIXES = (".npy", ".npz", ".mat", ".h5", ".hdf5")


def _listed_images() -> list[pathlib.Path]:
    images_dir = pathlib.Path(FLAGS.images_dir)
    if not images_dir.is_dir():
        raise DataFormatError(images_dir, "images directory does not exist")
    extension = FLAGS.image_extension
    if extension and not extension.startswith("."):
        extension = "." + extension
    if FLAGS.image_ids is None:
        paths = sorted(p for p in images_dir.iterdir() if p.name.endswith(extension) and p.is_file())
        if not paths:
            raise DataFormatError(images_dir, f"no {extension} files in the images directory")
        return paths
    if not os.path.isfile(FLAGS.image_ids):
        raise DataFormatError(FLAGS.image_ids, "split file does not exist")
    ids = read_split_file(FLAGS.image_ids)
    if not ids:
        raise DataFormatError(FLAGS.image_ids, "split file lists no image ids")
    paths = [images_dir / f"{image_id}{extension}" for image_id in ids]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise DataFormatError(missing[0], f"image listed in {FLAGS.image_ids} does not exist "
                              f"({len(missing)} of {len(paths)} listed images are missing)")
    return paths


def run() -> None:
    """Validates the flags, extracts the features and writes them."""
    if not FLAGS.images_dir:
        raise ConfigError("--images_dir is required")
    if not FLAGS.out:
        raise ConfigError("--out is required (.npy, .npz, .mat or .h5)")
    if os.path.splitext(FLAGS.out)[1].lower() not in _OUTPUT_SUFFIXES:
        raise ConfigError(f"--out={FLAGS.out}: expected a file ending in {', '.join(_OUTPUT_SUFFIXES)}")
    if FLAGS.backbone == "scene_cnn" and not FLAGS.weights:
        raise ConfigError("--backbone=scene_cnn needs --weights=<model.keras> (saved by save_scene_cnn)")
    if FLAGS.batch_size < 1:
        raise ConfigError(f"--batch_size must be positive, got {FLAGS.batch_size}")
    paths = _listed_images()
    out_dir = os.path.dirname(os.path.abspath(FLAGS.out))
    if not os.path.isdir(out_dir):
        os.makedirs(out_dir, exist_ok=True)
    # Keras/TensorFlow are imported only once the cheap checks have passed (and --help starts fast).
    from tf_twobranch.features.backbones import build_backbone
    from tf_twobranch.features.image_features import extract_image_features
    backbone = build_backbone(FLAGS.backbone, weights_path=FLAGS.weights, input_size=FLAGS.input_size)
    features = extract_image_features(paths, backbone, ten_crop=FLAGS.ten_crop, crop_size=FLAGS.crop_size,
                                      resize_to=FLAGS.resize_to, batch_size=FLAGS.batch_size)
    save_feature_matrix(FLAGS.out, features, key=FLAGS.out_key)
    logging.info("Wrote %s features %s to %s", FLAGS.backbone, features.shape, FLAGS.out)


main = absl_main(run)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
