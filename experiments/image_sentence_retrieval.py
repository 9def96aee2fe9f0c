r"""Image–sentence retrieval with two-branch networks (TPAMI Tables 2 and 3).

    python -m experiments.image_sentence_retrieval \
        --flagfile=experiments/configs/table2_b6_nonlinear_bidir_nbrsampling_constraints.cfg

With no --dataset_dir the embedded digit-scene dataset is generated (once)
and used. For Flickr30K pass --dataset_dir with results_20130124.token and
the Flickr30K Entities train/val/test.txt (or dataset_flickr30k.json) plus
either --images_dir and --backbone_weights (VGG-19) or precomputed
--image_features_{train,test} / --text_features_{train,test} files.
"""
from __future__ import annotations

import sys

from absl import app, flags

from experiments import common
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.systems.two_branch import pipeline
from tf_twobranch.systems.two_branch.pipeline import EMBEDDED_PROFILE, RetrievalRecipe, format_record  # noqa: F401
from tf_twobranch.table_runner import flagfile_of, next_command

# The embedded profile (EMBEDDED_PROFILE) and why: tf_twobranch/systems/two_branch/pipeline.py.


def apply_embedded_profile(f) -> dict:
    return common.apply_embedded_profile(f, EMBEDDED_PROFILE)


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    # Data and features.
    common.define_data_flags(fv, dataset_help="Dataset folder; empty: the embedded dataset.",
                             caption_formats=["auto", "karpathy", "token", "coco", "precomp"],
                             limit_images=True)
    for split in ("train", "test"):
        flags.DEFINE_string(f"image_features_{split}", "", f"Precomputed {split} image features "
                            "(.npy/.mat/.h5, (N, D), one row per image in caption order).", **d)
        flags.DEFINE_string(f"text_features_{split}", "", f"Precomputed {split} sentence "
                            "features (.npy/.mat/.h5; column-major HDF5 accepted).", **d)
    common.define_feature_flags(
        fv, text_encoders=["fisher_hglmm", "fisher_gmm", "mean_vector", "tfidf", "lstm"],
        image_help="CNN for image features.", text_help="Sentence representation.")
    common.define_feature_storage_flag(fv)
    flags.DEFINE_bool("ten_crop", True, "Average features over the paper's ten crops.", **d)
    flags.DEFINE_enum("protocol", "full", ["full", "flickr30k_1k", "coco_1k", "coco_5k"],
                      "Test protocol.", **d)
    # Model, loss and training.
    common.define_two_branch_flags(
        fv, hidden_dim=2048, dropout=0.5, top_k=10, text_anchor_weight=1.5,
        text_neighbour_weight=0.05, batch_size=500, epochs=20, learning_rate=1e-4,
        helps={"layout": "original: FC-BN-ReLU-Dropout-FC (reference code); "
                         "paper: FC-ReLU-Dropout-FC-BN (TPAMI §3.2.1).",
               "top_k": "K most violating in-batch negatives per anchor.",
               "image_anchor_weight": "λ1 (image target).",
               "text_anchor_weight": "λ2 (sentence target); 0 = single-directional.",
               "text_neighbour_weight": "λ4 (sentence neighbourhood constraint).",
               "batch_size": "Images per batch.", "epochs": "Training epochs.",
               "learning_rate": "Adam learning rate."})
    flags.DEFINE_integer("sample_size", 2, "Sentences per image in a batch; >= 2 is "
                         "neighbourhood sampling.", lower_bound=1, **d)
    flags.DEFINE_bool("unique_images", False, "Draw distinct images per batch instead of the "
                      "original's shuffled-caption anchors.", **d)
    flags.DEFINE_integer("lstm_units", 512, "LSTM size (text_encoder=lstm).", lower_bound=1, **d)
    flags.DEFINE_integer("word_embedding_dim", 256, "Word embedding size (LSTM).",
                         lower_bound=1, **d)
    flags.DEFINE_float("learning_rate_scale", 1.0, "Multiplies --learning_rate (the embedded "
                       "dataset's profile uses 3: it has ~25 steps per epoch, not ~300).",
                       lower_bound=0.0, **d)
    flags.DEFINE_enum("lr_schedule", "none", ["none", "exponential"],
                      "none: as the reference code (its decay is never applied).", **d)
    common.define_smoke_flag(fv)
    common.define_run_flags(
        fv, export_help="Write a SavedModel to <run_dir>/export.",
        paper_results_help="The paper's six numbers for this row (i2t R@1,5,10, t2i R@1,5,10).")
    flags.DEFINE_string("paper_dataset", "Flickr30K", "Dataset the paper numbers are for.", **d)


def recipe(f) -> RetrievalRecipe:
    """The row recipe of parsed flags (built once, in the entry point)."""
    return common.recipe_from_flags(RetrievalRecipe, f)


def load_data(f):
    """`pipeline.load_data` of parsed flags as they are (no profile: e.g. a run's recorded flags)."""
    return pipeline.load_data(recipe(f))


def run(f, flagfile: str | None = None) -> dict:
    """Runs one table row from parsed flags; returns the results record (also written as JSON)."""
    return pipeline.run(recipe(f), common.typed_flags(f), flagfile=flagfile)


def follow_up(record: dict) -> str:
    """What to run next on the row's run folder."""
    run_dir = record.get("run_dir", "")
    commands = []
    if record.get("export_dir"):
        commands.append(f"python -m tf_twobranch.tools.saved_model_cli show --dir {record['export_dir']} --all")
    return next_command(run_dir, *commands, load_run=record["flags"]["model"] != "cca")


def print_record(record: dict) -> None:
    print(format_record(record))
    if "sentence_retrieval" in record:
        s = record["sentence_retrieval"]
        print(f"sentence-to-sentence R@1/5/10: {s['s2s_r1']:.1f} / {s['s2s_r5']:.1f} / "
              f"{s['s2s_r10']:.1f}")
    if record.get("export_dir"):
        inputs = record.get("export_inputs")
        print(f"SavedModel: {record['export_dir']}"
              + (f" (takes {inputs['image']} and {inputs['text']})" if inputs else ""))
        for note in (inputs or {}).get("notes", []):
            print(f"  {note}")


def _main() -> None:
    record = run(flags.FLAGS, flagfile=flagfile_of(sys.argv))
    print_record(record)
    print(follow_up(record))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
