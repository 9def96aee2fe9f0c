"""The fifth system as the registry knows it: `tf_twobranch.systems.register(SYSTEM)`."""
from __future__ import annotations

import pathlib

from tf_twobranch.systems.registry import (LEADERBOARD_RETRIEVAL_FLAGS, LeaderboardLine, LeaderboardRun, RunTask,
                                           System)

MEAN_VECTORS = RunTask("mean_vectors", "a mean-vector run (the fifth system, tests/fifth_system)",
                       "tests.fifth_system.experiment", None)
FLAGFILE = str(pathlib.Path(__file__).with_name("smoke.cfg"))


def load(run_dir: pathlib.Path, checkpoint: str):
    from tf_twobranch.checkpoints import load_checkpoint
    from tf_twobranch.run_loading import Run, run_results, run_weights

    from tests.fifth_system.model import MeanVectorConfig, MeanVectorModel, build_model

    config, extra = MeanVectorModel.load_config(run_dir / MeanVectorConfig.FILE_NAME)
    model = build_model(config)
    load_checkpoint(model, run_weights(run_dir, checkpoint))
    return Run(run_dir, MeanVectorConfig.FAMILY, model, {"model": config.to_dict(), **extra},
               run_results(run_dir, run_dir))


def export(run, task: str):
    from tests.fifth_system.export import run_export
    return run_export(run)


def gallery(model, split, image_ids, caption_ids):
    from tests.fifth_system.export import split_gallery
    return split_gallery(model, split, image_ids, caption_ids)


SYSTEM = System(
    name="mean_vectors", paper="(none: the fifth system of tests/fifth_system)", model_family="mean_vectors",
    tasks=(MEAN_VECTORS,), load=load, export=export, gallery=gallery,
    leaderboard=(LeaderboardLine("mean_vectors", "Mean word vectors (fifth system)", "tests/fifth_system",
                                 LeaderboardRun(MEAN_VECTORS.name, FLAGFILE, LEADERBOARD_RETRIEVAL_FLAGS),
                                 no_grounding="one vector per image: no regions, no heat maps"),),
    smoke_row=LeaderboardRun(MEAN_VECTORS.name, FLAGFILE, ("--noexport",)))
