r"""Dual-path CNN with instance loss (Zheng et al.): Tables 1, 2, 5, 6, 7, 8.

    python -m experiments.instance_loss --flagfile=experiments/configs/zheng_table2_full_model.cfg

Trains from raw pixels and words: Stage I (instance loss only, image
backbone frozen) then Stage II (everything fine-tuned, ranking + instance
loss), each stage in its own run directory (``<run_dir>/stage1``,
``<run_dir>/stage2``) with checkpoints, backups and TensorBoard logs;
``--init_from`` starts a stage from another run's checkpoint.  Evaluates with
the shared retrieval core (cosine, image averaged with its flip), computes
the separability indicator S with its histogram PNG (Fig. 5), and exports
the image tower (JPEG bytes in) and the text tower (raw strings in).

With no --dataset_dir the embedded digit scenes are used (CUHK-PEDES layout
derived from them with --dataset_kind=pedes), with the small profile below.
"""
from __future__ import annotations

import sys

from absl import app, flags

from experiments import common
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.systems.dual_path import pipeline
from tf_twobranch.systems.dual_path.pipeline import (  # noqa: F401  (re-exported)
    EMBEDDED_PROFILE, PEDES_EMBEDDED_PROFILE, DualPathRecipe, format_record)
from tf_twobranch.table_runner import flagfile_of, next_command

# The embedded profile (EMBEDDED_PROFILE) and why: tf_twobranch/systems/dual_path/pipeline.py.


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    # Data.
    flags.DEFINE_enum("dataset_kind", "retrieval", ["retrieval", "pedes"],
                      "retrieval: Flickr30K / MSCOCO / embedded scenes (one class per image); "
                      "pedes: CUHK-PEDES reid_raw.json (one class per identity, text->image).",
                      **d)
    common.define_data_flags(fv, dataset_help="Dataset folder (retrieval) or folder of "
                             "reid_raw.json (pedes); empty: the embedded dataset.",
                             caption_formats=["auto", "karpathy", "token", "coco"], limit_images=True)
    flags.DEFINE_enum("eval_split", "test", ["val", "test"], "Split to evaluate on.", **d)
    flags.DEFINE_enum("long_captions", "error", ["error", "clip"],
                      "Captions longer than --max_len: error, or clip the final words "
                      "(the paper).", **d)
    flags.DEFINE_integer("num_classes", 0, "Instance classes; 0 = from the data (a set value "
                         "must match the data).", lower_bound=0, **d)
    # Text.
    common.define_word_vector_flags(fv, word_dim_help="Word embedding size (the text CNN's "
                                    "first layer; vectors trained on the captions get this size).")
    flags.DEFINE_enum("word_init", "word2vec", ["word2vec", "random"],
                      "First text layer: word2vec-initialised or random (Table 5).", **d)
    flags.DEFINE_integer("max_len", 32, "Text input length (56 for CUHK-PEDES).",
                         lower_bound=1, **d)
    flags.DEFINE_enum("text_shift", "position_shift", ["position_shift", "left_align"],
                      "Training-time text placement (Table 6).", **d)
    flags.DEFINE_enum("test_text_shift", "left_align", ["left_align", "all_shifts"],
                      "Test-time text: left-aligned, or the reference's mean over all shifts.",
                      **d)
    # Model.
    flags.DEFINE_enum("image_backbone", "resnet50",
                      ["resnet50", "vgg19", "vgg16", "resnet152", "scene_cnn"],
                      "Image CNN (scene_cnn: the embedded data's pretrained stand-in).", **d)
    flags.DEFINE_string("image_weights", "", "Local ImageNet weights file of the backbone.", **d)
    flags.DEFINE_integer("image_size", 224, "Training crop size.", lower_bound=32, **d)
    flags.DEFINE_integer("resize_to", 256, "Shorter image side before cropping.",
                         lower_bound=32, **d)
    flags.DEFINE_enum("text_layout", "paper", ["paper", "reference"],
                      "Text CNN: paper (3-4-6-3, same padding) or reference (3-4-6-1, causal).",
                      **d)
    flags.DEFINE_enum("head_layout", "paper", ["paper", "reference"], "FC head layout.", **d)
    flags.DEFINE_list("text_blocks", [], "Blocks per text CNN stage (empty: the layout's, "
                      "3,4,6,3 / 3,4,6,1; 3,8,36,3 = ResNet-152-like, Table 3).", **d)
    flags.DEFINE_integer("text_width", 64, "Text CNN base width (64 = ResNet-50).",
                         lower_bound=1, **d)
    flags.DEFINE_integer("hidden_dim", 2048, "Hidden FC size of the heads.", lower_bound=1, **d)
    flags.DEFINE_integer("embed_dim", 2048, "Feature size f_img / f_text.", lower_bound=1, **d)
    flags.DEFINE_float("dropout", 0.75, "Dropout rate before W_share.", lower_bound=0.0,
                       upper_bound=0.99, **d)
    flags.DEFINE_float("margin", 1.0, "Ranking loss margin alpha.", lower_bound=0.0, **d)
    flags.DEFINE_enum("ranking_negatives", "in_batch", ["in_batch", "hardest", "reference"],
                      "Negatives of the ranking loss.", **d)
    flags.DEFINE_integer("num_negative_captions", 0, "Random negative captions per batch "
                         "(reference: 256 with ranking_negatives=reference).", lower_bound=0,
                         **d)
    # Training.
    flags.DEFINE_list("stages", ["1", "2"], "Stages to run, in order.", **d)
    flags.DEFINE_string("init_from", "", "Run directory (or .weights.h5) whose weights start "
                        "the first stage run here.", **d)
    flags.DEFINE_integer("batch_size", 32, "Images (each with one caption) per batch.",
                         lower_bound=2, **d)
    for stage, (epochs, lr, lambdas) in {1: (10, 0.001, "0,1,1"), 2: (10, 0.001, "1,1,1")}.items():
        flags.DEFINE_integer(f"stage{stage}_epochs", epochs, f"Epochs of Stage {stage}.",
                             lower_bound=1, **d)
        flags.DEFINE_float(f"stage{stage}_learning_rate", lr, f"SGD learning rate of Stage "
                           f"{stage}.", lower_bound=0.0, **d)
        flags.DEFINE_list(f"stage{stage}_lambdas", lambdas.split(","),
                          f"lambda_rank, lambda_image, lambda_text of Stage {stage}.", **d)
    flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"], "sgd: SGD with momentum (the "
                      "paper and the reference); adam: Adam (embedded profile).", **d)
    flags.DEFINE_float("momentum", 0.9, "SGD momentum.", lower_bound=0.0, upper_bound=1.0, **d)
    flags.DEFINE_bool("nesterov", False, "Nesterov momentum (the reference).", **d)
    flags.DEFINE_float("weight_decay", 0.0, "Weight decay (reference: 1e-4).", lower_bound=0.0,
                       **d)
    flags.DEFINE_enum("protocol", "full", ["full", "coco_1k", "coco_5k"],
                      "Evaluation protocol (retrieval datasets).", **d)
    flags.DEFINE_string("paper_dataset", "Flickr30K", "Dataset of the paper numbers.", **d)
    common.define_smoke_flag(fv)
    common.define_run_flags(fv, export_help="Export the image and text towers as a SavedModel.",
                            paper_results_help="Paper numbers: R@1,R@5,R@10 image query then "
                            "text query (pedes: text query only).")


def recipe(f) -> DualPathRecipe:
    """The row recipe of parsed flags (built once, in the entry point)."""
    return common.recipe_from_flags(DualPathRecipe, f)


def check_dataset_dir(f) -> None:
    pipeline.check_dataset_dir(recipe(f))


def load_data(f, run_dir):
    """`pipeline.load_data` of parsed flags (the embedded profile is not applied)."""
    return pipeline.load_data(recipe(f), run_dir)


def pretrained_scene_cnn(f, train) -> str:
    """The embedded data's stand-in for an ImageNet backbone (`pipeline.pretrained_scene_cnn`)."""
    return pipeline.pretrained_scene_cnn(recipe(f), train)


def run(f, flagfile: str | None = None) -> dict:
    """Runs one row from parsed flags; returns the results record (also written as JSON)."""
    return pipeline.run(recipe(f), common.typed_flags(f), flagfile=flagfile)


def follow_up(record: dict) -> str:
    """What to run next on the row's run folder (load_run loads its last stage)."""
    commands = []
    if record.get("export_dir"):
        commands.append(f"python -m tf_twobranch.tools.saved_model_cli show --dir {record['export_dir']} --all")
    return next_command(record["run_dir"], *commands, load_run=bool(record["stages"]))


def _main() -> None:
    record = run(flags.FLAGS, flagfile=flagfile_of(sys.argv))
    print(format_record(record))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")
    print(follow_up(record))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
