"""Shared helpers of the experiment entry points: flag parsing per row, tables."""
from __future__ import annotations

import pathlib
from typing import Callable, Sequence

import keras
import numpy as np
from absl import flags, logging

from tf_twobranch import cli, distribute, json_files
from tf_twobranch.cli import split_paths  # noqa: F401 (re-exported)
from tf_twobranch.data.corpus import split_fingerprint
from tf_twobranch.data.formats import row_arrays
from tf_twobranch.errors import UserInputError  # re-exported for the experiments
from tf_twobranch.evaluation import retrieval
from tf_twobranch.pipelines.recipes import slug  # noqa: F401 (re-exported)
from tf_twobranch.speed import set_precision
from tf_twobranch.training import trainer

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"


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


def resolve_config(name: str) -> pathlib.Path:
    """A flagfile by path, or by bare name inside experiments/configs/."""
    p = pathlib.Path(name)
    if p.exists():
        return p
    candidate = CONFIG_DIR / (name if name.endswith(".cfg") else f"{name}.cfg")
    if candidate.exists():
        return candidate
    raise UserInputError(f"flagfile {name!r} not found (looked in {CONFIG_DIR})")


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
                      "Deterministic TF kernels and seeded RNGs (a resumed run then ends with "
                      "the weights of an uninterrupted one; slower on GPU).", **d)
    flags.DEFINE_bool("export", True, export_help, **d)
    define_output_flags(fv, paper_results_help=paper_results_help)


def typed_flags(f) -> dict:
    """The flags the user set (command line or flagfile), before any default profile is applied.

    Run records keep these apart from the effective values (``flags``):
    `apply_embedded_profile` and the experiments fill in values the user did
    not type.
    """
    return {name: f[name].value for name in f if f[name].present}


def flag_record(f, typed: dict | None = None) -> dict:
    """``{"typed_flags": what the user set, "flags": every effective value}`` for run records."""
    return {"typed_flags": typed_flags(f) if typed is None else typed,
            "flags": f.flag_values_dict()}


def setup_training(f):
    """Applies the shared run flags before a model is built; returns the strategy.

    Seeds every generator (`--seed`; with `--deterministic` also
    deterministic TF ops), sets the dtype policy (`--precision`) and creates
    the `tf.distribute` strategy (`--strategy`).
    """
    keras.utils.set_random_seed(f.seed)
    if f.deterministic:
        trainer.make_deterministic(f.seed)
    set_precision(f.precision)
    return distribute.get_strategy(f.strategy)


def train_config(f, *, epochs: int, learning_rate: float, seed: int | None = None, **overrides):
    """The trainer's configuration from the shared run flags (strategy, verbosity, backups, determinism)."""
    tcfg = trainer.TrainConfig(epochs=epochs, learning_rate=learning_rate,
                               seed=f.seed if seed is None else seed, strategy=f.strategy,
                               verbose=f.verbose, backup_every_steps=f.backup_every_steps,
                               deterministic=f.deterministic, **overrides)
    tcfg.validate()
    return tcfg


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


def row_overrides(f, define_flags: Callable[[flags.FlagValues], None], runner_flags) -> list[str]:
    """The row flags typed on a table runner's command line, as arguments for every row
    (flags of the runner itself, `runner_flags`, and flags rows do not define are left out)."""
    row_flags = flags.FlagValues()
    define_flags(row_flags)
    out = []
    for name, value in typed_flags(f).items():
        if name in runner_flags or name not in row_flags:
            continue
        if isinstance(value, bool):
            out.append(f"--{name}" if value else f"--no{name}")
        elif isinstance(value, list):
            out.append(f"--{name}={','.join(map(str, value))}")
        else:
            out.append(f"--{name}={value}")
    return out


def paper_numbers(text: str) -> list[float | None] | None:
    """--paper_results as numbers; "nan" marks a cell the paper does not report (None)."""
    if not text:
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise UserInputError(f"--paper_results must be comma-separated numbers, got {text!r}") from None
    return [None if np.isnan(v) else v for v in values]


# ------------------------------------------------------------------ protocols


def resolve_protocol(f, num_test_images: int, *, split: str = "the test split") -> dict:
    """Checks --protocol against the test split it is applied to; the record's entries naming it.

    A protocol that does not fit is refused (its name, the test-split size it
    needs and the size found), except on the embedded data (no --dataset_dir),
    whose 1,000-image test split is too small for the shipped COCO rows: there
    the split is scored under "full" (one gallery) and the record says so
    (`requested_protocol`, `protocol_note`); --protocol is set to "full".
    """
    reason = retrieval.protocol_mismatch(f.protocol, num_test_images, split=split)
    if reason is None:
        return {"protocol": f.protocol}
    if f.dataset_dir:
        retrieval.check_protocol(f.protocol, num_test_images, split=split)
    note = (f"embedded dataset: {reason}; scored under protocol full (one gallery of "
            f"{num_test_images} images) instead")
    logging.warning("%s", note)
    requested, f.protocol = f.protocol, "full"
    return {"protocol": "full", "requested_protocol": requested, "protocol_note": note}


def split_record(protocol_entries: dict, corpus) -> dict:
    """`protocol`, `test_split_fingerprint` and the split's size, for a results record.

    `corpus`: the evaluated split, anything with `image_ids`, `captions` and
    `caption_image` (a `CaptionCorpus`, the dual path's data).
    Two results are comparable only when both agree: the same protocol on the
    same ordered images and captions.
    """
    fingerprint = split_fingerprint(corpus.image_ids, corpus.captions, corpus.caption_image)
    return {**protocol_entries, "test_split_fingerprint": fingerprint,
            "num_test_images": corpus.num_images, "num_test_captions": corpus.num_captions}


def paper_beside(paper, paper_protocol: str, protocol: str, num_test_images: int):
    """The paper's numbers if they were measured like this result, else None."""
    if paper and retrieval.protocols_agree(protocol, num_test_images, paper_protocol):
        return paper
    return None


def groups_by_test_split(records: list[dict]) -> list[list[dict]]:
    """Run records grouped by (protocol, test-split fingerprint), in first-seen order: rows are
    put in one table only when they were measured the same way on the same split."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault((record["protocol"], record["test_split_fingerprint"]), []).append(record)
    return list(groups.values())


def table_title(what: str, *, protocol: str, num_images: int, num_captions: int,
                paper=None, paper_dataset: str = "", paper_protocol: str = "",
                dataset: str = "") -> str:
    """A table's title: what it shows, its protocol and test-split size, and whose numbers
    the '(paper)' rows are (or why the paper's numbers are not shown)."""
    on = f" on {dataset}" if dataset else ""
    title = (f"{what}{on}; {retrieval.describe_protocol(protocol, num_images)}, "
             f"{num_captions} captions")
    if paper:
        source = f"{paper_dataset or 'the paper'}, protocol {paper_protocol or 'not declared'}"
        if paper_beside(paper, paper_protocol, protocol, num_images):
            title += f"; '(paper)' rows: {source}"
        else:
            title += f"; the paper's numbers ({source}) are not shown beside a {protocol} result"
    return title


def format_cell(value, width: int = 8, digits: int = 1) -> str:
    """One number of a table; a cell the paper does not report (None, NaN) prints as '–'."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return f"{'–':>{width}}"
    return f"{value:{width}.{digits}f}"


CHANCE_ROW = "chance (random embeddings, same protocol)"


def format_retrieval_table(title: str, rows: list[dict], ks=(1, 5, 10), chance: dict | None = None) -> str:
    """The paper's Table 2/3 layout: image-to-sentence and sentence-to-image R@K.

    Each row dict has "name", "metrics" (ours) and optionally "paper" (six
    numbers in the same order; None for a cell the paper lacks). A fold
    protocol's metrics get a '± std' line with the spread over its folds.
    `chance` (the random baseline's metrics) ends the table.
    """
    cols = [f"R@{k}" for k in ks]
    rows = [*rows, {"name": CHANCE_ROW, "metrics": chance}] if chance else list(rows)
    name_w = max([len(r["name"]) for r in rows] + [24])
    header = (f"{'':{name_w}} | {'Image-to-sentence':^{8 * len(ks)}} | "
              f"{'Sentence-to-image':^{8 * len(ks)}} |")
    sub = f"{'Method':{name_w}} | " + "".join(f"{c:>8}" for c in cols) + " | " + \
        "".join(f"{c:>8}" for c in cols) + " | " + f"{'rsum':>7}"
    lines = [title, "=" * len(sub), header, sub, "-" * len(sub)]

    def line(name, values, rsum):
        return (f"{name:{name_w}} | " + "".join(format_cell(v) for v in values[:len(ks)])
                + " | " + "".join(format_cell(v) for v in values[len(ks):2 * len(ks)])
                + f" | {format_cell(rsum, 7)}")

    for r in rows:
        m = r["metrics"]
        keys = [f"i2t_r{k}" for k in ks] + [f"t2i_r{k}" for k in ks]
        vals = [m[k] for k in keys]
        lines.append(line(r["name"], vals, m.get("rsum", sum(vals))))
        if "rsum_fold_std" in m:
            lines.append(line(f"  ± std over {m['num_folds']} folds",
                              [m[f"{k}_fold_std"] for k in keys], m["rsum_fold_std"]))
        if r.get("paper"):
            p = list(r["paper"][:2 * len(ks)])
            rsum = None if any(v is None for v in p) else sum(p)
            lines.append(line("  (paper)", p, rsum))
    lines.append("-" * len(sub))
    return "\n".join(lines)


def is_chief() -> bool:
    """True unless this process is a non-chief worker of a multi-worker run (TF_CONFIG)."""
    return distribute.is_chief()


def write_json(path, payload):
    # Under MultiWorkerMirroredStrategy every worker computes the same
    # results; only the chief writes them (the run dir is shared).
    if is_chief():
        json_files.write_json(path, payload)
