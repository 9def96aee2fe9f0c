"""The N-pair localization system as the registry knows it (no TensorFlow at import)."""
from __future__ import annotations

import pathlib

from tf_twobranch.systems.registry import (LEADERBOARD_RETRIEVAL_FLAGS, LeaderboardLine, LeaderboardRun,
                                           LeaderboardSibling, Ordering, RunTask, Side, System, stage_file)

NPAIR = RunTask("npair", "an N-pair localization run (Das et al.)",
                "experiments.npair", "experiments.npair_draw", aliases=("npair_localization",))
CONFIG_FILE = "npair_config.json"


def load(run_dir: pathlib.Path, checkpoint: str):
    from tf_twobranch.systems.npair.pipeline import load_npair_run
    return load_npair_run(run_dir, checkpoint)


def export(run, task: str):
    from tf_twobranch.systems.npair.export import run_export
    return run_export(run)


def gallery(model, split, image_ids, caption_ids):
    from tf_twobranch.systems.npair.export import npair_gallery
    return npair_gallery(model, split, image_ids, caption_ids)


def recognise(run_dir: pathlib.Path, results: dict, run_config: dict) -> tuple[str, str] | None:
    """Its config file, or a pointing-baseline row's results (``row_kind``: no model)."""
    source = stage_file(run_dir, CONFIG_FILE)
    if source is None and "row_kind" in results:
        source = str(run_dir / "results.json")
    return None if source is None else (NPAIR.name, source)


SYSTEM = System(
    name="npair", paper="Das, Ghouse, Verma, Li: Semi supervised phrase localization in a bidirectional "
    "caption-image retrieval framework", model_family="npair", tasks=(NPAIR,),
    load=load, export=export, gallery=gallery, recognise=recognise, leaderboard=(
        LeaderboardLine("npair", "N-pair phrase localization (word mode)", "N-pair localization (Das Table 2)",
                        LeaderboardRun(NPAIR.name, "npair_table2_npair_word",
                                       (*LEADERBOARD_RETRIEVAL_FLAGS, "--row_metric=auto"),
                                       reference_seconds=150), position=6),),
    # The sibling rows are grounded on the same phrases as the line (the pointing game).
    orderings=(
        Ordering("N-pair beats triplet (pointing game)", "Das Table 2",
                 Side("N-pair", "npair", "pointing"), Side("triplet", "triplet", "pointing")),
        Ordering("N-pair beats the centre baseline (pointing game)", "Das Table 2",
                 Side("N-pair", "npair", "pointing"), Side("centre", "centre", "pointing")),
        Ordering("N-pair beats the backbone channel-mean baseline (pointing game)", "Das Table 2",
                 Side("N-pair", "npair", "pointing"), Side("channel mean", "channel_mean", "pointing"))),
    siblings=(
        LeaderboardSibling("triplet", LeaderboardRun(NPAIR.name, "npair_table2_triplet",
                                                     (*LEADERBOARD_RETRIEVAL_FLAGS, "--row_metric=auto"),
                                                     reference_seconds=150)),
        LeaderboardSibling("centre", LeaderboardRun(NPAIR.name, "npair_table2_centre", LEADERBOARD_RETRIEVAL_FLAGS,
                                                    reference_seconds=40)),
        LeaderboardSibling("channel_mean", LeaderboardRun(NPAIR.name, "npair_table2_vgg_channel_mean",
                                                          LEADERBOARD_RETRIEVAL_FLAGS, reference_seconds=60))),
    smoke_row=LeaderboardRun(NPAIR.name, "npair_table2_npair_word", (
        "--word_dim=8", "--embed_dim=8", "--epochs=1", "--steps_per_epoch=2", "--batch_size=16",
        "--scene_cnn_epochs=1", "--protocol=full", "--run_eagerly", "--verbose=0", "--noexport")))
