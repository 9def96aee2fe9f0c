"""The dual-path system as the registry knows it (no TensorFlow at import)."""
from __future__ import annotations

import pathlib

from tf_twobranch.systems.registry import (LEADERBOARD_RETRIEVAL_FLAGS, LeaderboardLine, LeaderboardRun, Ordering,
                                           RunTask, Side, System, stage_file)

DUAL_PATH = RunTask("dual_path", "an instance-loss run (dual-path CNN, Zheng et al.)",
                    "experiments.dual_path", None)
CONFIG_FILE = "dual_path_config.json"


def load(run_dir: pathlib.Path, checkpoint: str):
    """``dual_path_config.json`` beside ``run_config.json`` in a stage folder; given the run folder
    itself, its last stage (``stage2``, else ``stage1``). Its split is rebuilt from the dataset."""
    from tf_twobranch.errors import UserInputError
    from tf_twobranch.json_files import read_json_object
    from tf_twobranch.run_loading import Run, config_folder, run_results, run_weights
    from tf_twobranch.systems.dual_path.model import DualPathConfig, load_dual_path_model
    from tf_twobranch.systems.dual_path.run_split import read_dual_path_split

    folder = config_folder(run_dir, DualPathConfig.FILE_NAME, (".", "stage2", "stage1"))
    if folder is None:
        raise UserInputError(f"{run_dir}: a dual-path run folder needs {DualPathConfig.FILE_NAME} "
                             "(in it, or in stage2/ or stage1/)")
    model = load_dual_path_model(folder / DualPathConfig.FILE_NAME, run_weights(folder, checkpoint))
    config_path = folder / "run_config.json"
    config = read_json_object(config_path, "run configuration") if config_path.exists() else {}
    results = run_results(run_dir, folder)
    record = (results or {}).get("evaluation")
    reader = None
    if isinstance(record, dict) and record.get("kind") == "dual_path":
        def reader(run):
            return read_dual_path_split(record, run.config.get("vocabulary"))
    return Run(folder, DualPathConfig.FAMILY, model, config, results, split_reader=reader)


def export(run, task: str):
    from tf_twobranch.systems.dual_path.export import run_export
    return run_export(run)


def gallery(model, split, image_ids, caption_ids):
    from tf_twobranch.systems.dual_path.export import dual_path_gallery
    return dual_path_gallery(model, split, image_ids, caption_ids)


def recognise(run_dir: pathlib.Path, results: dict, run_config: dict) -> tuple[str, str] | None:
    source = stage_file(run_dir, CONFIG_FILE)
    return None if source is None else (DUAL_PATH.name, source)


SYSTEM = System(
    name="dual_path", paper="Zheng, Zheng, Garrett, Yang, Xu, Shen: Dual-path convolutional image-text embeddings "
    "with instance loss (TOMM 2020)", model_family="dual_path", tasks=(DUAL_PATH,),
    load=load, export=export, gallery=gallery, recognise=recognise, leaderboard=(
        # The embedded profile's 100 + 20 epochs: at 60 + 15 Stage I had not converged.
        LeaderboardLine("dual_path", "Dual-path CNN, Stage II", "dual-path CNN (Zheng Table 1, ResNet-50 row)",
                        LeaderboardRun(DUAL_PATH.name, "dual_path_table1_resnet50_stage2", LEADERBOARD_RETRIEVAL_FLAGS,
                                       reference_seconds=2200),
                        no_grounding="global image and text vectors only: no regions, no heat maps",
                        position=4),),
    orderings=(Ordering("Stage II beats Stage I", "Zheng Table 1",
                        Side("Stage II", "dual_path"), Side("Stage I", "dual_path", "stage1_rsum")),),
    smoke_row=LeaderboardRun(DUAL_PATH.name, "dual_path_table1_resnet50_stage2", (
        "--max_train_images=24", "--max_test_images=10", "--stage1_epochs=1", "--stage2_epochs=1", "--text_width=2",
        "--text_blocks=1,1,1,1", "--hidden_dim=16", "--embed_dim=16", "--word_dim=8", "--batch_size=16",
        "--image_size=32", "--resize_to=36", "--word_init=random", "--run_eagerly", "--verbose=0", "--noexport")))
