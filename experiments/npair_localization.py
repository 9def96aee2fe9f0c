r"""Semi-supervised phrase localization (Das et al.): Tables 1 and 2.

    python -m experiments.npair_localization --flagfile=experiments/configs/das_table2_npair_word.cfg
    python -m experiments.npair_localization --rows=all     # every row; prints Table 2 beside the paper

A caption–image retrieval model (spatial image map × per-token caption vectors → localization
volume → S_MaxImage) is trained on captions alone with the N-pair loss (or the triplet loss); no
box is used in training. Each row then reports retrieval through the one evaluation core (Table
1: folds of 100 images, `--protocol`) and the pointing game on the Flickr30K Entities phrases of
the evaluation split (Table 2), in word and phrase parse modes. Baseline rows (`--row_kind`) point at a random pixel, at the image
centre, at the maximum of the backbone map's channel mean, or use the untrained model.

Defaults where the paper is silent are the authors' code's (LocNet): SGD lr 1e-3 × 0.1 every
10 epochs of 100 steps, momentum 0.9, weight decay 1e-7, triplet margin 0.1, LSTM 300 → 1024,
3×3 conv 512 → 1024 + BN + ReLU on VGG-19 ``block5_conv4`` at 224², ``<start>``/``<end>``
tokens, 20 words. Its defects are not reproduced by default (BUILD_NOTES.md): the score's
maximum over rows only (``--aggregator=max_rows_code``), the L2 norms computed but not applied
(``--normalisation=none``), the swapped x/y of its hit test, I_r1 = C_r1.

Memory is bounded by a batch or a chunk: backbone maps (and training images
with --train_backbone) are memory-mapped, the evaluation goes chunk by chunk.
With no --dataset_dir the embedded digit scenes are used (profile below).

The flags become one typed recipe (`NPairRecipe` of `tf_twobranch.systems.npair.pipeline`),
stored in results.json; ``tf_twobranch.runs.load_run(run_dir)`` loads the row again
without flags. Tables and ``--rows`` (the one table runner): `experiments.npair_tables`.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

import keras
from absl import app, flags, logging

from experiments import common, npair_tables
from experiments.npair_tables import format_record
from tf_twobranch import table_runner
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.data.phrases import phrase_fingerprint
from tf_twobranch.evaluation import pointing_game, retrieval
from tf_twobranch.systems.npair import heat_maps as localization_maps, pipeline as npair, sampling as npair_batches
from tf_twobranch.systems.npair.features import phrase_parsed_captions, split_images
from tf_twobranch.systems.npair.losses import DEFAULT_TEMPERATURE
from tf_twobranch.systems.npair.model import build_npair_model
from tf_twobranch.systems.npair.pipeline import NPairRecipe
from tf_twobranch.training import trainer

# The embedded scenes (6×6×128 scene-CNN maps, ~130 words): the paper's structure at a few CPU minutes a
# row; the "centred" projection (S_MaxImage is blind to the translation a 3x3 one learns) and fine-tuned
# word vectors (the PPMI-SVD digit words are nearly one vector) make its maps localize (BUILD_NOTES.md).
EMBEDDED_PROFILE = {"word_dim": 64, "embed_dim": 256, "epochs": 6, "lr_decay_epochs": 4,
                    "learning_rate": 0.01, "projection": "centred", "train_word_vectors": True}


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    common.define_data_flags(fv, dataset_help="Dataset folder (Flickr30K with its Flickr30K Entities Sentences/ "
                             "and Annotations/, or COCO captions for retrieval only), with its images; empty: "
                             "the embedded dataset.",
                             caption_formats=["auto", "karpathy", "token", "coco"], limit_images=True)
    flags.DEFINE_enum("eval_split", "test", ["val", "test"], "Split to evaluate on.", **d)
    flags.DEFINE_enum("protocol", "folds_100", ["folds_100", "full", "coco_1k", "coco_5k"],
                      "Retrieval protocol: folds_100 (Table 1: galleries of 100 images, averaged), full, "
                      "coco_1k, coco_5k.", **d)
    flags.DEFINE_enum("retrieval_score_dtype", "float32", ["float32", "bfloat16"],
                      "Matmul dtype of the S_MaxImage retrieval scores. bfloat16 (aggregator max_image "
                      "only) is ~3.5x faster on CPUs with AMX or AVX-512 BF16 (COCO 5K: ~9 instead of "
                      "~33 min here) and moves rsum by about a point; the paper's figures are float32.",
                      **d)
    flags.DEFINE_enum("row_kind", "model", list(npair.ROW_KINDS),
                      "model: train and evaluate; untrained: the model without training; random_point, "
                      "centre_point, channel_mean: pointing baselines of Table 2.", **d)
    flags.DEFINE_enum("parse_mode", "word", list(localization_maps.PARSE_MODES),
                      "Pointing game heat map of a phrase: the mean of its words' maps (word) or the map "
                      "of one token from the mean of its word vectors (phrase).", **d)
    flags.DEFINE_enum("train_parse_mode", "word", list(localization_maps.PARSE_MODES),
                      "Training captions: word by word (the caption file), or phrase-parsed Flickr30K Entities "
                      "sentences with each annotated phrase one input, the mean of its word vectors (the "
                      "authors' code's parse_mode='phrase').", **d)
    flags.DEFINE_enum("row_metric", "auto", ["auto", "pointing", "retrieval"],
                      "What the row reports: pointing (Table 2: its pointing accuracy, which needs the Flickr30K "
                      "Entities Sentences/ and Annotations/; refused without them), retrieval (Table 1), or auto "
                      "(retrieval, and the pointing game when the folder has the Entities; the record says when "
                      "it has not).", **d)
    flags.DEFINE_enum("pointing_counting", "phrase", ["phrase", "per_box"],
                      "phrase: one trial per phrase, a hit inside any of its boxes (the paper); per_box: "
                      "one trial per ground-truth box (the authors' code).", **d)
    flags.DEFINE_enum("point_rule", pointing_game.DEFAULT_POINT_RULE, list(pointing_game.POINT_RULES),
                      "cell_centre: the centre of the map's arg-max cell (the paper); argmax: the first maximal "
                      "pixel of the upsampled map (the code). Rows record both.", **d)
    # Text.
    common.define_word_vector_flags(fv, word_dim_help="Word vector size (GloVe: 300).", word_dim=300)
    flags.DEFINE_integer("max_words", 20, "Words per caption (longer: not trained on, clipped in evaluation).",
                         lower_bound=1, **d)
    flags.DEFINE_bool("train_word_vectors", False, "Fine-tune the word vectors (the code: GloVe fixed).", **d)
    # Image.
    flags.DEFINE_string("features_cache", "", "Where backbone maps are cached (default <dataset_dir>/features).",
                        **d)
    flags.DEFINE_enum("image_backbone", "scene_cnn", ["scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152"],
                      "CNN of the spatial map (vgg19: block5_conv4; scene_cnn: trained on the training "
                      "images).", **d)
    flags.DEFINE_string("backbone_weights", "", "Local ImageNet weights file of the backbone.", **d)
    flags.DEFINE_integer("scene_cnn_epochs", 12, "Epochs of the scene_cnn backbone.", lower_bound=1, **d)
    common.define_feature_storage_flag(fv)
    flags.DEFINE_list("backbone_maps", [], "Precomputed backbone maps per split, split=path pairs "
                      "(train=maps.npy,test=...): (images, h, w, C) .npy or sharded row-array folders, one "
                      "row per image in split order, float32 or float16, memory-mapped (no backbone runs).",
                      **d)
    flags.DEFINE_bool("train_backbone", False, "Train the CNN end to end (the paper) instead of on its "
                      "cached maps.", **d)
    # Model and loss.
    flags.DEFINE_integer("embed_dim", 1024, "d: channels of the projected map and the LSTM size.",
                         lower_bound=1, **d)
    flags.DEFINE_integer("projection_kernel", 3, "Projection kernel size (the code: 3).", lower_bound=1, **d)
    flags.DEFINE_enum("projection", "conv", ["conv", "centred"],
                      "conv: a projection_kernel² convolution (the code; it can translate the map); centred: a "
                      "1x1 convolution of each cell beside its neighbourhood's mean (it cannot).", **d)
    flags.DEFINE_enum("loss", "npair", ["npair", "triplet"], "N-pair loss (eqs. 5-7) or triplet loss with "
                      "hardest in-batch negatives (eqs. 2-4).", **d)
    flags.DEFINE_enum("aggregator", "max_image", ["max_image", "max_text", "mean_all", "max_rows_code"],
                      "Score from the volume: max_image (eq. 1, S_MaxImage), the code's Max_Text and "
                      "Avg_Both, or its Max_Img as written (max over rows only).", **d)
    flags.DEFINE_enum("token_average", "real", ["real", "all"],
                      "Tokens averaged by the score: the caption's words, or all padded positions (the code).",
                      **d)
    flags.DEFINE_enum("normalisation", "vector", ["vector", "map", "none"],
                      "vector: each a_rc and s_t L2-normalised; map: the code's L2 norms applied (each map and "
                      "each caption matrix, all T positions padding included, to unit norm); none: the "
                      "code as run.", **d)
    flags.DEFINE_float("temperature", DEFAULT_TEMPERATURE, "Softmax temperature of the N-pair loss (eqs. "
                       "5-6 and LocNet: 1).", lower_bound=1e-6, **d)
    flags.DEFINE_float("margin", 0.1, "Triplet margin η (the code: 0.1).", lower_bound=0.0, **d)
    # Training.
    flags.DEFINE_integer("epochs", 10, "Epochs (the code: 10).", lower_bound=0, **d)
    flags.DEFINE_integer("steps_per_epoch", 100, "Steps per epoch (the code: 100).", lower_bound=1, **d)
    flags.DEFINE_integer("batch_size", 64, "Image–caption pairs per batch, distinct images.", lower_bound=2, **d)
    flags.DEFINE_float("learning_rate", 1e-3, "SGD learning rate (the code: 1e-3).", lower_bound=0.0, **d)
    flags.DEFINE_integer("lr_decay_epochs", 10, "The rate is multiplied by 0.1 every this many epochs.",
                         lower_bound=1, **d)
    flags.DEFINE_float("momentum", 0.9, "SGD momentum.", lower_bound=0.0, upper_bound=1.0, **d)
    flags.DEFINE_float("weight_decay", 1e-7, "SGD weight decay (the code: 1e-7).", lower_bound=0.0, **d)
    flags.DEFINE_string("paper_dataset", "Flickr30K", "Dataset of the paper numbers.", **d)
    common.define_run_flags(fv, export_help="Export the model as a SavedModel.",
                            paper_results_help="Paper numbers: the pointing accuracy (Table 2 rows), or "
                            "R@1,R@5,R@10 of image-to-caption then caption-to-image (Table 1 rows).")
    common.define_runner_flags(fv, rows_help="Row flagfiles to run ('all': every das_*.cfg); prints Tables 2 and 1.")
    common.define_smoke_flag(fv)


def recipe_from_flags(fv: flags.FlagValues) -> tuple[NPairRecipe, dict]:
    """The row's recipe from its parsed flags (the embedded profile's values where the user typed
    none and gave no --dataset_dir), and the flags the user typed (results.json "typed_flags")."""
    typed = common.typed_flags(fv)
    return common.prepare_recipe(NPairRecipe.from_flags(fv), typed, EMBEDDED_PROFILE, "npair_localization")[0], typed


def _train(recipe: NPairRecipe, typed: dict, data: npair.NPairData, model, config, strategy,
           run_dir: pathlib.Path) -> dict:
    """Trains the model on the row's training captions; returns the loss history."""
    steps, splits, text = recipe.steps_per_epoch, data.splits, data.text
    train = text.splits["train"]
    if recipe.train_backbone:
        image_inputs = split_images(data.layout, splits["train"], int(data.backbone.input.shape[1]),
                                    npair.features_cache(recipe, data.source))
        image_key = "image"
    else:
        image_inputs, image_key = data.maps["train"], "backbone_map"
    captions, token_key, caption_image = train.token_ids, "token_ids", splits["train"].caption_image
    if recipe.train_parse_mode == "phrase":
        if data.layout.entities_dir is None:
            raise common.UserInputError(f"{data.source}: --train_parse_mode=phrase needs the Flickr30K Entities "
                                        "Sentences/ and Annotations/ of the training images")
        train = phrase_parsed_captions(data.layout.entities_dir, splits["train"].image_ids, text.vocabulary,
                                       text.word_matrix, recipe.max_words)
        captions, token_key, caption_image = train.word_inputs, "word_inputs", train.caption_image
    with strategy.scope():
        schedule = keras.optimizers.schedules.ExponentialDecay(recipe.learning_rate, recipe.lr_decay_epochs * steps,
                                                               0.1, staircase=True)
        optimizer = keras.optimizers.SGD(schedule, momentum=recipe.momentum,
                                         weight_decay=recipe.weight_decay or None)
        model.compile(optimizer=optimizer, jit_compile=recipe.jit_compile, run_eagerly=recipe.run_eagerly)
    tcfg = common.train_config(recipe, epochs=recipe.epochs, learning_rate=recipe.learning_rate, optimizer="sgd")

    def dataset(start_step=0):
        return npair_batches.train_dataset(image_inputs, captions, train.token_mask, caption_image,
                                           train.trainable, batch_size=recipe.batch_size, seed=recipe.seed,
                                           start_step=start_step, image_key=image_key, token_key=token_key)

    trainer.prepare_run_dir(run_dir, {"model": config.to_dict(), "train": tcfg.__dict__, "typed_flags": typed,
                                      "recipe": recipe.to_dict(), "task": "npair_localization"})
    model.save_config(run_dir / config.FILE_NAME, vocabulary=text.vocabulary)
    trained = trainer.train(model, dataset, tcfg, run_dir, steps_per_epoch=steps, epochs=recipe.epochs)
    return {k: [float(x) for x in v] for k, v in trained.history.items()}


def run(f: flags.FlagValues, flagfile: str | None = None) -> dict:
    """Runs the row of parsed flags `f` (its recipe is built here, once); returns its results record."""
    return run_recipe(*recipe_from_flags(f), flagfile=flagfile)


def run_recipe(recipe: NPairRecipe, typed: dict | None = None, flagfile: str | None = None) -> dict:
    """Runs one row in `recipe.run_dir` (else ``runs/<flagfile stem>``); returns results.json's record."""
    start, typed, recipe = time.time(), typed or {}, dataclasses.replace(recipe)   # resolve_protocol may set it
    row_name = recipe.row_name or "npair_localization"
    if recipe.retrieval_score_dtype != "float32" and recipe.aggregator != "max_image":
        # Said before training, not after it: the packed scorer is S_MaxImage's alone.
        raise common.UserInputError(f"--retrieval_score_dtype={recipe.retrieval_score_dtype} needs "
                                    f"--aggregator=max_image (got {recipe.aggregator})")
    run_dir = pathlib.Path(recipe.run_dir) if recipe.run_dir else table_runner.run_folder(None, flagfile, row_name)
    baseline = recipe.row_kind in npair.BASELINE_KINDS
    source, layout = npair.dataset_layout(recipe)
    reason = npair.uncomputable_metric(recipe, layout, source)
    if reason:
        raise common.UserInputError(reason)
    data = npair.load_data(recipe, need_text=not baseline)
    evaluation = data.splits[recipe.eval_split]
    # Checked before training; the pointing baselines have no retrieval.
    protocol = {"protocol": None} if baseline else common.resolve_protocol(
        recipe, evaluation.num_images, split=f"the {recipe.eval_split} split")
    queries = npair.evaluation_queries(layout, evaluation)
    record = {"row": row_name, "task": "npair_localization", "row_kind": recipe.row_kind, "dataset": str(source),
              "typed_flags": typed, "recipe": recipe.to_dict(), "run_dir": str(run_dir),
              "paper": common.paper_numbers(recipe.paper_results), "paper_dataset": recipe.paper_dataset,
              "paper_protocol": recipe.paper_protocol, "row_metric": npair.reported_metric(recipe),
              "num_train_images": data.splits["train"].num_images, "num_eval_images": evaluation.num_images,
              "num_eval_captions": evaluation.num_captions, **common.split_record(protocol, evaluation),
              "num_pointing_queries": None if queries is None else len(queries),
              "phrase_fingerprint": None if queries is None else phrase_fingerprint(queries)}
    if queries is None:
        record["pointing_not_computed"] = (f"{source} has no Flickr30K Entities Sentences/ and Annotations/ "
                                           "folders: retrieval only")
    if baseline:
        record["pointing"] = {"baseline": npair.baseline_pointing(recipe, data, queries)}
        npair.summary(record, recipe)
        record["seconds"] = time.time() - start
        common.write_json(recipe.out_json or run_dir / "results.json", record)
        return record

    text = data.text
    config = npair.build_config(recipe, text, data.maps)
    strategy = common.setup_training(recipe)
    with strategy.scope():
        model = build_npair_model(config, text.word_matrix, backbone=data.backbone)
    record["history"] = {}
    if recipe.row_kind == "model" and recipe.epochs:
        record["history"] = _train(recipe, typed, data, model, config, strategy, run_dir)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        model.save_config(run_dir / config.FILE_NAME, vocabulary=text.vocabulary)
        model.save_weights(run_dir / "untrained.weights.h5")
    protocols = list(dict.fromkeys([recipe.protocol] + (["folds_100"] if evaluation.num_images >= 100 else [])))
    # The model's evaluate: the split's maps and token vectors are written once to a temporary
    # folder of the run, chunk by chunk, and read by every protocol and the pointing game.
    split = npair.evaluation_split(recipe, data, text.vocabulary, tokens=text.splits[recipe.eval_split],
                                   queries=queries)
    record.update(model.evaluation_results(split, protocols=protocols, work_dir=run_dir))
    # Per evaluated protocol: a row sharing this model under another protocol takes its own.
    record["random_baselines"] = {p: retrieval.random_baseline_metrics(
        evaluation.num_images, evaluation.caption_image, protocol=p, seed=recipe.seed) for p in protocols}
    record["random_baseline"] = record["random_baselines"][recipe.protocol]
    npair.summary(record, recipe)
    logging.info("%s: %s", row_name, {k: round(v, 2) for k, v in record["metrics"].items()})
    if recipe.export and common.is_chief() and recipe.row_kind == "model":
        from tf_twobranch.systems.npair.export import export_npair_model
        record["export_dir"] = str(export_npair_model(
            model, run_dir / "export", vocabulary=text.vocabulary, point_rule=recipe.point_rule,
            run_config={"model": config.to_dict(), "typed_flags": typed, "recipe": recipe.to_dict()}))
    record["seconds"] = time.time() - start
    common.write_json(recipe.out_json or run_dir / "results.json", record)
    return record


def run_rows(f: flags.FlagValues, argv) -> dict:
    """--rows through `npair_tables.run_rows`: the flags of `argv` not the runner's go to every row."""
    return npair_tables.run_rows(f, argv, define_flags, run)


def _main() -> None:
    f = flags.FLAGS
    if f.rows:
        run_rows(f, sys.argv)
        return
    record = run(f, flagfile=table_runner.flagfile_of(sys.argv))
    print(format_record(record))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")
    print(npair_tables.follow_up(record))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
