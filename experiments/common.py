"""Shared helpers of the experiment entry points: flag definitions, flag parsing per row,
flags -> recipe. Everything that needs no flags lives in the library and is re-exported here:
tables and protocols (`tf_twobranch.tables`), training set-up and records
(`tf_twobranch.run_records`), the table runner and run-folder rule
(`tf_twobranch.table_runner`), recipes and --smoke (`tf_twobranch.recipes`).
"""
from __future__ import annotations

from typing import Callable, Sequence

from absl import flags

from tf_twobranch import cli, table_runner
from tf_twobranch.cli import split_paths  # noqa: F401 (re-exported)
from tf_twobranch.data.formats import row_arrays
from tf_twobranch.errors import UserInputError  # re-exported for the experiments
from tf_twobranch.evaluation import retrieval
from tf_twobranch.run_records import is_chief, setup_training, train_config  # noqa: F401
from tf_twobranch.run_records import run_record as flag_record  # noqa: F401
from tf_twobranch.run_records import write_results as write_json  # noqa: F401
from tf_twobranch.recipes import SMOKE_HELP, from_flags, prepare_recipe, smoke_overrides, typed_flags  # noqa: F401
from tf_twobranch.recipes import define_smoke_flag  # noqa: F401  (--smoke: one definition for every experiment)
from tf_twobranch.table_runner import resolve_config, slug  # noqa: F401
from tf_twobranch.tables import (CHANCE_ROW, format_cell, format_retrieval_table,  # noqa: F401
                                 SMOKE_LINE, groups_by_test_split, is_smoke, paper_beside, paper_beside_record,
                                 paper_numbers, resolve_protocol, split_record, table_title)

REPO_ROOT = table_runner.REPO_ROOT
CONFIG_DIR = table_runner.CONFIG_DIR


def parse_flagfile(define: Callable[[flags.FlagValues], None], flagfile: str,
                   overrides: Sequence[str] = ()) -> flags.FlagValues:
    """Parses one flagfile (plus overrides) into a fresh FlagValues.

    Lets one process run several table rows without the rows' flags leaking
    into each other. Unknown flags and out-of-range values raise
    UserInputError naming the flagfile and line, or the overrides, where the
    flag was written.
    """
    fv = flags.FlagValues()
    define(fv)
    arguments = [*cli.expand_flagfiles([f"--flagfile={flagfile}"]),
                 *cli.expand_flagfiles(overrides, origin="among the flags passed to every row")]
    try:
        leftover = fv(["row", *(a.text for a in arguments)])[1:]
    except flags.Error as e:
        raise UserInputError(f"{flagfile}: {cli.describe_flag_error(e, fv, arguments)}") from None
    if leftover:
        where = next(a.origin for a in arguments if a.text == leftover[0])
        raise UserInputError(f"{flagfile}: {leftover[0]!r} is not a flag ({where}); expected "
                             "--name=value")
    return fv


# ------------------------------------------------------------------ flags
# Each flag shared by several experiments is defined here, once; an
# experiment passes the defaults its paper uses (e.g. the phrase-localization
# branches are 1024 wide, the image-sentence ones 2048).


def define_data_flags(fv, *, dataset_help: str, caption_formats: Sequence[str] | None = None,
                      limit_images: bool = False) -> None:
    """--dataset_dir, --images_dir (+ --caption_format, --max_{train,test}_images)."""
    d = dict(flag_values=fv)
    flags.DEFINE_string("dataset_dir", "", dataset_help, **d)
    if caption_formats:
        flags.DEFINE_enum("caption_format", "auto", list(caption_formats),
                          "Caption file layout of --dataset_dir.", **d)
    flags.DEFINE_string("images_dir", "", "Images folder (default <dataset_dir>/images, "
                        "<dataset_dir>/flickr30k-images or <dataset_dir>).", **d)
    if limit_images:
        flags.DEFINE_integer("max_train_images", 0, "Use only the first N training images "
                             "(0 = all).", lower_bound=0, **d)
        flags.DEFINE_integer("max_test_images", 0, "Use only the first N test images (0 = all).",
                             lower_bound=0, **d)


def define_word_vector_flags(fv, *, word_dim_help: str, word_dim: int = 300) -> None:
    """--word_vectors (a local file; nothing is downloaded) and --word_dim."""
    d = dict(flag_values=fv)
    flags.DEFINE_string("word_vectors", "", "Local word2vec (binary/text, e.g. GoogleNews .bin) or "
                        "GloVe text file; empty: trained on the training captions.", **d)
    flags.DEFINE_integer("word_dim", word_dim, word_dim_help, lower_bound=2, **d)


def define_feature_storage_flag(fv) -> None:
    """How feature caches are stored on disk (memory-mapped; see data/formats/row_arrays.py)."""
    flags.DEFINE_enum("feature_dtype", "float32", list(row_arrays.FEATURE_DTYPES),
                      "Storage dtype of feature caches: float16 halves disk and RAM for large "
                      "datasets (rows are cast back to float32 in each batch).", flag_values=fv)


def define_feature_flags(fv, *, text_encoders: Sequence[str], image_help: str,
                         text_help: str) -> None:
    """How image/region and text features are computed (and cached) from the dataset."""
    d = dict(flag_values=fv)
    flags.DEFINE_string("features_cache", "", "Where computed features are cached "
                        "(default <dataset_dir>/features).", **d)
    flags.DEFINE_enum("image_backbone", "scene_cnn",
                      ["scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152"], image_help, **d)
    flags.DEFINE_string("backbone_weights", "", "Local ImageNet weights file of the backbone.", **d)
    flags.DEFINE_integer("scene_cnn_epochs", 12, "Epochs of the scene_cnn backbone trained on "
                         "the training images and captions.", lower_bound=1, **d)
    flags.DEFINE_enum("text_encoder", "fisher_hglmm", list(text_encoders), text_help, **d)
    define_word_vector_flags(fv, word_dim_help="Size of word vectors trained on the captions.")
    flags.DEFINE_integer("pca_dim", 6000, "PCA size of Fisher vectors larger than this.",
                         lower_bound=1, **d)


def define_two_branch_flags(fv, *, hidden_dim: int, dropout: float, top_k: int,
                            text_anchor_weight: float, text_neighbour_weight: float,
                            batch_size: int, epochs: int, learning_rate: float,
                            helps: dict[str, str]) -> None:
    """The two-branch network, its ranking loss and training length (TPAMI 2018 §3).

    `helps` gives the help of "layout", "image_anchor_weight",
    "text_anchor_weight", "text_neighbour_weight", "top_k", "batch_size",
    "epochs" and "learning_rate", whose meaning depends on the task.
    """
    d = dict(flag_values=fv)
    flags.DEFINE_enum("model", "embedding", ["embedding", "similarity", "cca"], "Which model.", **d)
    flags.DEFINE_enum("branch", "nonlinear", ["nonlinear", "linear"], "Branch structure.", **d)
    flags.DEFINE_enum("layout", "original", ["original", "paper"], helps["layout"], **d)
    flags.DEFINE_integer("hidden_dim", hidden_dim, "First FC layer size of each branch.",
                         lower_bound=1, **d)
    flags.DEFINE_integer("embed_dim", 512, "Embedding size.", lower_bound=1, **d)
    flags.DEFINE_float("dropout", dropout, "Dropout after the ReLU.", lower_bound=0.0,
                       upper_bound=0.95, **d)
    flags.DEFINE_float("margin", 0.05, "Ranking margin m.", lower_bound=0.0, **d)
    flags.DEFINE_integer("top_k", top_k, helps["top_k"], lower_bound=1, **d)
    flags.DEFINE_float("image_anchor_weight", 1.0, helps["image_anchor_weight"], lower_bound=0.0, **d)
    flags.DEFINE_float("text_anchor_weight", text_anchor_weight, helps["text_anchor_weight"],
                       lower_bound=0.0, **d)
    flags.DEFINE_float("text_neighbour_weight", text_neighbour_weight,
                       helps["text_neighbour_weight"], lower_bound=0.0, **d)
    flags.DEFINE_integer("batch_size", batch_size, helps["batch_size"], lower_bound=2, **d)
    flags.DEFINE_integer("cca_components", 512, "CCA dimensions (model=cca).", lower_bound=1, **d)
    flags.DEFINE_integer("epochs", epochs, helps["epochs"], lower_bound=1, **d)
    flags.DEFINE_float("learning_rate", learning_rate, helps["learning_rate"], lower_bound=0.0, **d)


def define_output_flags(fv, *, paper_results_help: str, row_name: str = "",
                        verbose: int = 1) -> None:
    """Where a row's results go and how it is named: --run_dir, --row_name, --paper_results, --out_json, --verbose."""
    d = dict(flag_values=fv)
    flags.DEFINE_integer("verbose", verbose, "Keras progress bar (0 = silent).", **d)
    flags.DEFINE_string("run_dir", "", "Run directory (default runs/<row_name>).", **d)
    flags.DEFINE_string("row_name", row_name, "Name of the table row.", **d)
    flags.DEFINE_string("paper_results", "", paper_results_help, **d)
    flags.DEFINE_enum("paper_protocol", "", ["", *retrieval.PROTOCOLS], "Protocol the paper's "
                      "retrieval numbers were measured under (each flagfile declares it); they are "
                      "printed only beside a result of the same protocol.", **d)
    flags.DEFINE_string("out_json", "", "Results JSON (default <run_dir>/results.json).", **d)


def define_run_flags(fv, *, export_help: str, paper_results_help: str) -> None:
    """Flags every training experiment shares: distribution, seed, output, table row."""
    d = dict(flag_values=fv)
    flags.DEFINE_enum("strategy", "default", ["default", "mirrored", "multi_worker", "tpu"],
                      "tf.distribute strategy.", **d)
    flags.DEFINE_enum("precision", "float32", ["float32", "mixed_bfloat16", "mixed_float16"],
                      "Compute precision of the towers (variables and losses stay float32); "
                      "mixed_bfloat16 on CPU/GPU, mixed_float16 on GPU only.", **d)
    flags.DEFINE_bool("jit_compile", False, "XLA-compile the whole training step.", **d)
    flags.DEFINE_bool("run_eagerly", False,
                      "Run the training step eagerly: for debugging, and for runs of a few "
                      "steps, where tracing a large graph costs more than the steps.", **d)
    flags.register_multi_flags_validator(
        ["jit_compile", "run_eagerly"], lambda v: not (v["jit_compile"] and v["run_eagerly"]),
        "--jit_compile and --run_eagerly exclude each other.", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Seed of every random choice.", **d)
    flags.DEFINE_integer("backup_every_steps", 0,
                         "Preemption backup every this many training steps within an epoch "
                         "(0 = at epoch ends only); a run restarted with the same command "
                         "resumes at the backed-up step.", **d)
    flags.DEFINE_bool("deterministic", False,
                      "Deterministic TF kernels, one op at a time and seeded RNGs (the same "
                      "command gives the same weights, and a resumed run ends with the weights "
                      "of an uninterrupted one; slower on GPU).", **d)
    flags.DEFINE_bool("export", True, export_help, **d)
    define_output_flags(fv, paper_results_help=paper_results_help)


def apply_embedded_profile(f, profile: dict) -> dict:
    """Sets a profile's values on flags the user did not set, when no --dataset_dir is given.

    The embedded digit scenes are much smaller than the papers' datasets;
    each experiment declares the defaults that suit them. Returns what was
    applied (the experiments log it).
    """
    applied = {}
    if f.dataset_dir:
        return applied
    for name, value in profile.items():
        if not f[name].present:
            f[name].value = value
            applied[name] = value
    return applied


def recipe_from_flags(cls, f):
    """The experiment's row recipe of parsed flags (`tf_twobranch.recipes.from_flags`)."""
    return from_flags(cls, f)


def runner_arguments(argv: Sequence[str], runner_flags) -> list[str]:
    """The flags of a table runner's command line (flagfiles expanded) that go to every row."""
    return table_runner.row_arguments([a.text for a in cli.expand_flagfiles(list(argv[1:]))],
                                      runner_flags)


def define_runner_flags(fv, *, rows_help: str, runs_dir: bool = True) -> None:
    """--rows, --runs_dir and --resume: the table runner's flags (tf_twobranch.table_runner)."""
    d = dict(flag_values=fv)
    flags.DEFINE_list("rows", [], rows_help, **d)
    if runs_dir:
        flags.DEFINE_string("runs_dir", "", "Parent folder of the rows' run folders, each named after "
                            "its flagfile (default runs/ in the repository).", **d)
    flags.DEFINE_bool("resume", True, "Reuse rows that finished earlier with the same arguments "
                      "(<run folder>/results.json and table_row.json); --noresume runs them again.", **d)
