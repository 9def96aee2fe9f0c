"""The deep-fragment-embedding system as the registry knows it (no TensorFlow at import)."""
from __future__ import annotations

import pathlib

from tf_twobranch.systems.registry import (LEADERBOARD_RETRIEVAL_FLAGS, LeaderboardLine, LeaderboardRun,
                                           LeaderboardSibling, Ordering, RunTask, Side, System, stage_file)

FRAGMENTS = RunTask("fragments", "a deep-fragment-embedding run (Karpathy et al.)",
                    "experiments.fragments", "experiments.fragments_draw", aliases=("fragment_embeddings",))
CONFIG_FILE = "fragment_config.json"


def load(run_dir: pathlib.Path, checkpoint: str):
    from tf_twobranch.systems.fragments.pipeline import load_fragment_run
    return load_fragment_run(run_dir, checkpoint)


def export(run, task: str):
    from tf_twobranch.systems.fragments.export import run_export
    return run_export(run)


def gallery(model, split, image_ids, caption_ids):
    from tf_twobranch.systems.fragments.export import fragment_gallery
    return fragment_gallery(model, split, image_ids, caption_ids)


def recognise(run_dir: pathlib.Path, results: dict, run_config: dict) -> tuple[str, str] | None:
    source = stage_file(run_dir, CONFIG_FILE)
    return None if source is None else (FRAGMENTS.name, source)


SYSTEM = System(
    name="fragments", paper="Karpathy, Joulin, Fei-Fei: Deep fragment embeddings for bidirectional image sentence "
    "mapping (NIPS 2014)", model_family="fragments", tasks=(FRAGMENTS,),
    load=load, export=export, gallery=gallery, recognise=recognise, leaderboard=(
        LeaderboardLine("random", "Random ranking", "fragment embeddings (Karpathy Table 3)",
                        LeaderboardRun(FRAGMENTS.name, "fragments_table3_random_ranking", LEADERBOARD_RETRIEVAL_FLAGS,
                                       reference_seconds=60),
                        no_grounding="random scores rank captions only (no boxes, no heat maps)", position=0),
        LeaderboardLine("fragments", "Deep fragment embeddings (\u2020 + MIL)", "fragment embeddings (Karpathy Table 3)",
                        LeaderboardRun(FRAGMENTS.name, "fragments_table3_fragment_global_mil",
                                       LEADERBOARD_RETRIEVAL_FLAGS, reference_seconds=350), position=5)),
    orderings=(Ordering("MIL helps", "Karpathy Table 3 (\u2020 + MIL > \u2020)",
                        Side("\u2020 + MIL", "fragments"), Side("\u2020 fragment + global", "fragment_global")),),
    siblings=(LeaderboardSibling("fragment_global", LeaderboardRun(FRAGMENTS.name, "fragments_table3_fragment_global",
                                                                   LEADERBOARD_RETRIEVAL_FLAGS,
                                                                   reference_seconds=300)),),
    smoke_row=LeaderboardRun(FRAGMENTS.name, "fragments_table2_fragment_global", (
        "--word_dim=8", "--embed_dim=16", "--epochs=1", "--batch_size=20", "--scene_cnn_epochs=1", "--verbose=0",
        "--learning_rate=0.001", "--detections=3", "--global_score=sum", "--noexport")))
