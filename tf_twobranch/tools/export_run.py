r"""Writes the serving SavedModel of any finished run folder, with a retrieval gallery.

  python -m tf_twobranch.tools.export_run --run_dir=runs/two_branch_table2_b6_nonlinear_bidir_nbr_constraints \
      --export_dir=/tmp/b6_export

  # a gallery of your own: a folder of JPEGs and a caption file
  python -m tf_twobranch.tools.export_run --run_dir=runs/dual_path_table1_flickr30k \
      --export_dir=/tmp/dp_export --gallery_images=photos/ --gallery_captions=captions.txt

Every family (two-branch image–sentence and phrase-localization rows, the dual path, deep
fragment embeddings, N-pair localization) is exported from its raw inputs where the run's
pieces are known (`tf_twobranch.run_export`): JPEG bytes and captions (fragment rows:
JPEG bytes + boxes, and parse triplets). The gallery (``retrieve_captions`` / ``retrieve_images``)
is the run's evaluated split (--gallery, default: that split), or a folder of JPEGs
(--gallery_images; ids: the file names without extension) and/or a caption file
(--gallery_captions: one caption per line, ids the line numbers, or the dataset's
``<image>.jpg#<k>\t<caption>`` token format; fragment rows: a CoNLL-U file of parses), which
replace that side of the split. See docs/SERVING.md, "Exporting a retrieval service from a run
folder".
"""
from __future__ import annotations

from absl import app, flags, logging

from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.errors import ConfigError

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("run_dir", None, "A finished run folder (any family; load_run reads it).", **d)
    flags.DEFINE_string("export_dir", None, "Output folder of the SavedModel (replaced if it exists).", **d)
    flags.DEFINE_enum("gallery", None, ["test", "val", "none"],
                      "Retrieval gallery from the run's evaluated split (it must be the split named), or none. "
                      "Default: that split, unless --gallery_images and --gallery_captions replace both sides.",
                      **d)
    flags.DEFINE_string("gallery_images", None, "Folder of JPEG files (*.jpg, *.jpeg): the gallery's images "
                        "(ids: file names without extension), embedded as the export embeds an image_jpeg query.",
                        **d)
    flags.DEFINE_string("gallery_captions", None, "Caption file: the gallery's captions, one per line (ids: line "
                        "numbers) or '<image>.jpg#<k><TAB><caption>' lines (ids <image>#<k>); fragment rows: a "
                        "CoNLL-U file of parsed captions.", **d)
    flags.DEFINE_integer("gallery_block", None, "Gallery items scored per step of a retrieval request (fragment "
                         "and N-pair exports; default: theirs).", **d)
    flags.DEFINE_string("checkpoint", "latest", "Checkpoint of the run to export (checkpoints/<name>.weights.h5).",
                        **d)


def run() -> None:
    """Validates the flags and writes the export."""
    if not FLAGS.run_dir:
        raise ConfigError("--run_dir is required (a finished run folder)")
    if not FLAGS.export_dir:
        raise ConfigError("--export_dir is required (where the SavedModel is written)")
    # TensorFlow is imported once the cheap checks have passed (and --help starts fast).
    import tensorflow_text  # noqa: F401  (tokenizer ops of the exports' in-graph text encoders)

    from tf_twobranch.run_export import export_run
    path = export_run(FLAGS.run_dir, FLAGS.export_dir, gallery=FLAGS.gallery, gallery_images=FLAGS.gallery_images,
                      gallery_captions=FLAGS.gallery_captions, gallery_block=FLAGS.gallery_block,
                      checkpoint=FLAGS.checkpoint)
    logging.info("Wrote %s", path)
    print(f"SavedModel: {path}")
    print(f"python -m tf_twobranch.tools.saved_model_cli show --dir {path} --all")


main = absl_main(run)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
