"""The two-branch system as the registry knows it (no TensorFlow at import)."""
from __future__ import annotations

import pathlib

from tf_twobranch.systems.registry import (LEADERBOARD_REGION_FLAGS, LEADERBOARD_RETRIEVAL_FLAGS, LeaderboardLine,
                                           LeaderboardRun, LeaderboardSibling, Ordering, RunTask, Side, System)

RETRIEVAL = RunTask("two_branch_retrieval", "an image-sentence retrieval run (two-branch networks)",
                    "experiments.two_branch_retrieval", None, aliases=("image_sentence_retrieval",))
REGION_PHRASE = RunTask("two_branch_region_phrase", "a phrase-localization run (two-branch networks, Algorithm 1)",
                        "experiments.two_branch_region_phrase", "experiments.two_branch_draw",
                        aliases=("phrase_localization",))


def load(run_dir: pathlib.Path, checkpoint: str):
    """An image–sentence or region–phrase run: ``run_config.json`` with the model configuration,
    weights in ``checkpoints/<checkpoint>.weights.h5``."""
    from tf_twobranch.checkpoints import load_checkpoint
    from tf_twobranch.errors import UserInputError
    from tf_twobranch.run_loading import Run, run_results, run_weights
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, TwoBranchModel, build_model

    _refuse_a_cca_run(run_dir)
    config_path = run_dir / TwoBranchConfig.FILE_NAME
    if not config_path.exists():
        raise UserInputError(f"{run_dir}: a two-branch run folder needs {config_path.name}")
    config, extra = TwoBranchModel.load_config(config_path)
    model = build_model(config)
    load_checkpoint(model, run_weights(run_dir, checkpoint))
    region_phrase = extra.get("task") in REGION_PHRASE.names
    return Run(run_dir, TwoBranchConfig.FAMILY, model, {"model": config.to_dict(), **extra},
               run_results(run_dir, run_dir), split_reader=_no_retrieval_split if region_phrase else None)


def _no_retrieval_split(run):
    from tf_twobranch.errors import UserInputError
    raise UserInputError(
        f"{run.run_dir}: a phrase-localization run has no retrieval split; it is evaluated with "
        "tf_twobranch.evaluation.phrase_localization on its dataset's test phrases (results.json['inputs'] "
        "names the dataset)")


def _refuse_a_cca_run(run_dir: pathlib.Path) -> None:
    """A CCA baseline row (``--model=cca``) trains no network and keeps no model: it fits CCA in
    closed form and evaluates it in the same process. Said plainly, with what the folder does
    hold, instead of "needs run_config.json"."""
    from tf_twobranch.errors import UserInputError
    from tf_twobranch.json_files import read_json_object

    results = run_dir / "results.json"
    if not results.is_file():
        return
    record = read_json_object(results, "experiment results")
    flags = record.get("flags") if isinstance(record.get("flags"), dict) else {}
    if flags.get("model") != "cca" or (run_dir / "run_config.json").exists():
        return
    metrics = record.get("metrics")
    summary = ""
    if isinstance(metrics, dict):
        shown = [f"{k} {v:.1f}" for k, v in metrics.items() if isinstance(v, (int, float))][:4]
        summary = f" ({', '.join(shown)}{', ...' if len(metrics) > len(shown) else ''})" if shown else ""
    raise UserInputError(
        f"{run_dir}: a CCA baseline run (--model=cca): CCA is fitted in closed form and evaluated in "
        f"the same run, so the folder keeps its metrics in results.json{summary} but no model for "
        "load_run to load (read the metrics with tf_twobranch.runs.run_results(run_dir, run_dir)). "
        "A loadable, exportable model comes from the same row with --model=embedding or --model=similarity")


def export(run, task: str):
    if task == REGION_PHRASE.name:
        from tf_twobranch.systems.two_branch.region_phrase_export import region_phrase_run_export
        return region_phrase_run_export(run)
    from tf_twobranch.systems.two_branch.export import retrieval_run_export
    return retrieval_run_export(run)


def gallery(model, split, image_ids, caption_ids):
    from tf_twobranch.systems.two_branch.export import retrieval_gallery
    return retrieval_gallery(model, split, image_ids, caption_ids)


def recognise(run_dir: pathlib.Path, results: dict, run_config: dict) -> tuple[str, str] | None:
    """A folder written before the task was recorded: a model configuration in run_config.json."""
    if isinstance(run_config.get("model"), dict):
        return RETRIEVAL.name, str(run_dir / "run_config.json")
    return None


SYSTEM = System(
    name="two_branch", paper="Wang, Li, Huang, Lazebnik: Learning two-branch neural networks for image-text "
    "matching tasks (TPAMI 2018; CVPR 2016)", model_family="two_branch", tasks=(RETRIEVAL, REGION_PHRASE),
    load=load, export=export, gallery=gallery, recognise=recognise, leaderboard=(
        LeaderboardLine("cca", "CCA (FV HGLMM)", "two-branch baseline (TPAMI Tables 1-2)",
                        LeaderboardRun(RETRIEVAL.name, "two_branch_table2_a1_cca_fv_hglmm", LEADERBOARD_RETRIEVAL_FLAGS,
                                       reference_seconds=150),
                        LeaderboardRun(REGION_PHRASE.name, "two_branch_table1_a_cca", LEADERBOARD_REGION_FLAGS,
                                       reference_seconds=200), position=1),
        LeaderboardLine("embedding", "Two-branch embedding network (full model)", "two-branch (TPAMI Table 2 b6)",
                        LeaderboardRun(RETRIEVAL.name, "two_branch_table2_b6_nonlinear_bidir_nbr_constraints",
                                       LEADERBOARD_RETRIEVAL_FLAGS, reference_seconds=150),
                        LeaderboardRun(REGION_PHRASE.name,
                                       "two_branch_table1_b6_nonlinear_augm_pos_bidir_nbr_constraints",
                                       LEADERBOARD_REGION_FLAGS, reference_seconds=200), position=2),
        LeaderboardLine("similarity", "Two-branch similarity network", "two-branch (TPAMI Table 2 d)",
                        LeaderboardRun(RETRIEVAL.name, "two_branch_table2_d_similarity", LEADERBOARD_RETRIEVAL_FLAGS,
                                       reference_seconds=180),
                        LeaderboardRun(REGION_PHRASE.name, "two_branch_table1_c4_similarity_nonlinear_augm_pos",
                                       LEADERBOARD_REGION_FLAGS, reference_seconds=200), position=3)),
    orderings=(
        Ordering("neighbourhood constraints help", "TPAMI Table 2 (b5 < b6)",
                 Side("b6 full model", "embedding"), Side("b5 nbr. sampling", "b5")),
        Ordering("embedding network beats the similarity network", "TPAMI Table 2 (b6 > d)",
                 Side("embedding", "embedding"), Side("similarity", "similarity")),
        Ordering("embedding network beats CCA", "TPAMI Table 2 (b6 > a1)",
                 Side("embedding", "embedding"), Side("CCA", "cca")),
        Ordering("embedding network localizes phrases better than CCA", "TPAMI Table 1 (b6 > a)",
                 Side("embedding", "embedding", "box_r1"), Side("CCA", "cca", "box_r1")),
        Ordering("similarity network localizes phrases better than CCA", "TPAMI Table 1 (c4 > a)",
                 Side("similarity", "similarity", "box_r1"), Side("CCA", "cca", "box_r1"))),
    siblings=(LeaderboardSibling("b5", LeaderboardRun(
        RETRIEVAL.name, "two_branch_table2_b5_nonlinear_bidir_nbr_sampling", LEADERBOARD_RETRIEVAL_FLAGS,
        reference_seconds=150)),),
    smoke_row=LeaderboardRun(RETRIEVAL.name, "two_branch_table2_b6_nonlinear_bidir_nbr_constraints", (
        "--epochs=1", "--batch_size=20", "--hidden_dim=32", "--embed_dim=16", "--top_k=3", "--scene_cnn_epochs=1",
        "--word_dim=8", "--verbose=0", "--noexport")))
