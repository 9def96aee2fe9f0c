"""N-pair phrase localization (Das et al.): a row's recipe, its data, its model and its evaluation.

`NPairRecipe` holds every flag of ``experiments/npair.py``
(same names, same defaults), typed; the experiment builds it once from its
flags, stores it in results.json (``"recipe"``) and hands it to everything
below, which never reads a flag:

* `load_data(recipe)`: the dataset (``--dataset_dir`` or the embedded data),
  its train and evaluation splits, the captions' token ids and word vectors,
  the image backbone and its cached, memory-mapped backbone maps;
* `build_config(recipe, text, maps)`: the model configuration;
* `evaluation_split(recipe, data, vocabulary)`: the `NPairEvaluationSplit`
  that `NPairLocalizationModel.evaluate` scores (retrieval through the one
  evaluation core; the pointing game on the split's Flickr30K Entities phrases);
* `load_npair_run(run_dir, checkpoint)`: the `runs.Run` of a finished row,
  from its folder alone (`tf_twobranch.runs.load_run` calls it): the recipe
  from results.json, the backbone from the dataset's feature cache, the
  weights from the checkpoint; ``run.evaluation_split()`` rebuilds the
  test split, and ``run.model.evaluate(run.evaluation_split())`` equals
  ``run.results["metrics"]``.

The pointing baselines (``row_kind`` random_point, centre_point,
channel_mean) have no model: `load_npair_run` refuses them, naming
results.json, which holds their metrics.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time

import keras
from absl import logging

from tf_twobranch import table_runner
from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.cli import split_paths
from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.from_flags import dataset_from_flags
from tf_twobranch.data.layout import DatasetLayout
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import UserInputError
from tf_twobranch.systems.npair import heat_maps as localization_maps
from tf_twobranch.data.phrases import phrase_fingerprint
from tf_twobranch.evaluation import retrieval
from tf_twobranch.evaluation.grounding import grounding_summary
from tf_twobranch.evaluation.pointing_game import DEFAULT_POINT_RULE, pointing_queries
from tf_twobranch.features import FEATURE_SEED
from tf_twobranch.systems.npair import sampling as npair_batches
from tf_twobranch.systems.npair.features import (CaptionTokens, NPairInputSpec, NPairText, backbone_maps,
                                                 caption_inputs, encode_token_lists, load_backbone_maps,
                                                 phrase_parsed_captions, spatial_backbone, split_images)
from tf_twobranch.json_files import read_json_object
from tf_twobranch.systems.npair.losses import DEFAULT_TEMPERATURE
from tf_twobranch.systems.npair.model import (NPairEvaluationSplit, NPairLocalizationConfig,
                                              NPairLocalizationModel, build_npair_model, headline_metrics)
from tf_twobranch.recipes import (RunRecipe, backbone_weights_field, caption_format_field, eval_split_field,
                                  feature_dtype_field, flag, images_dir_field, max_images_field,
                                  momentum_field, paper_dataset_field, resume_field, runs_dir_field,
                                  scene_cnn_epochs_field, word_vectors_field)
from tf_twobranch.run_records import is_chief, setup_training, train_config, write_results as write_json
from tf_twobranch.tables import paper_numbers, resolve_protocol, split_record
from tf_twobranch.training import trainer
from tf_twobranch.run_loading import Run, run_weights

__all__ = ["ROW_KINDS", "BASELINE_KINDS", "NPairRecipe", "NPairData", "dataset_layout", "reported_metric",
           "uncomputable_metric", "load_data", "features_cache", "build_config", "evaluation_queries",
           "evaluation_split", "baseline_pointing", "summary", "load_npair_run", "recipe_of_run",
           "EMBEDDED_PROFILE", "train_model", "run"]

ROW_KINDS = ("model", "untrained", "random_point", "centre_point", "channel_mean")
BASELINE_KINDS = ("random_point", "centre_point", "channel_mean")


@dataclasses.dataclass
class NPairRecipe(RunRecipe):
    """One row of the N-pair experiment: every flag of ``experiments.npair``, by name,
    with its default (the flags' help says what each means). List flags are tuples."""
    # Where this experiment words a shared flag's help its own way.
    FLAG_HELP = {
        "export": "Export the model as a SavedModel.",
        "paper_results": "Paper numbers: the pointing accuracy (Table 2 rows), or R@1,R@5,R@10 of image-to-caption "
                         "then caption-to-image (Table 1 rows)."}
    # --smoke: one epoch of two steps, the batch capped with the images; 100 test images, one
    # gallery of Table 1's folds_100 protocol (fewer cannot be scored by it).
    SMOKE_CAPS = {"epochs": 1, "steps_per_epoch": 2, "max_train_images": 40, "max_test_images": 100,
                  "batch_size": 16, "scene_cnn_epochs": 1}


    # Data.
    dataset_dir: str = flag(
        "", "Dataset folder (Flickr30K with its Flickr30K Entities Sentences/ and Annotations/, or COCO "
        "captions for retrieval only), with its images; empty: the embedded dataset.")
    caption_format: str = caption_format_field()
    images_dir: str = images_dir_field()
    max_train_images: int = max_images_field("training")
    max_test_images: int = max_images_field("test")
    eval_split: str = eval_split_field()
    protocol: str = flag(
        "folds_100", "Retrieval protocol: folds_100 (Table 1: galleries of 100 images, averaged), full, coco_1k, "
        "coco_5k.", enum=("folds_100", "full", "coco_1k", "coco_5k"))
    retrieval_score_dtype: str = flag(
        "float32", "Matmul dtype of the S_MaxImage retrieval scores. bfloat16 (aggregator max_image only) is "
        "~3.5x faster on CPUs with AMX or AVX-512 BF16 (COCO 5K: ~9 instead of ~33 min here) and "
        "moves rsum by about a point; the paper's figures are float32.", enum=("float32", "bfloat16"))
    row_kind: str = flag(
        "model", "model: train and evaluate; untrained: the model without training; random_point, "
        "centre_point, channel_mean: pointing baselines of Table 2.",
        enum=("model", "untrained", "random_point", "centre_point", "channel_mean"))
    parse_mode: str = flag(
        "word", "Pointing game heat map of a phrase: the mean of its words' maps (word) or the map of one "
        "token from the mean of its word vectors (phrase).", enum=("word", "phrase"))
    train_parse_mode: str = flag(
        "word", "Training captions: word by word (the caption file), or phrase-parsed Flickr30K Entities "
        "sentences with each annotated phrase one input, the mean of its word vectors (the authors' "
        "code's parse_mode='phrase').", enum=("word", "phrase"))
    row_metric: str = flag(
        "auto", "What the row reports: pointing (Table 2: its pointing accuracy, which needs the Flickr30K "
        "Entities Sentences/ and Annotations/; refused without them), retrieval (Table 1), or auto "
        "(retrieval, and the pointing game when the folder has the Entities; the record says when it "
        "has not).", enum=("auto", "pointing", "retrieval"))
    pointing_counting: str = flag(
        "phrase", "phrase: one trial per phrase, a hit inside any of its boxes (the paper); per_box: one trial "
        "per ground-truth box (the authors' code).", enum=("phrase", "per_box"))
    point_rule: str = flag(
        DEFAULT_POINT_RULE, "cell_centre: the centre of the map's arg-max cell (the paper); argmax: the first maximal "
        "pixel of the upsampled map (the code). Rows record both.", enum=("cell_centre", "argmax"))
    # Text.
    word_vectors: str = word_vectors_field()
    word_dim: int = flag(300, "Word vector size (GloVe: 300).", lower_bound=2)
    max_words: int = flag(
        20, "Words per caption (longer: not trained on, clipped in evaluation).", lower_bound=1)
    train_word_vectors: bool = flag(False, "Fine-tune the word vectors (the code: GloVe fixed).")
    # Image.
    features_cache: str = flag("", "Where backbone maps are cached (default <dataset_dir>/features).")
    image_backbone: str = flag(
        "scene_cnn", "CNN of the spatial map (vgg19: block5_conv4; scene_cnn: trained on the training images).",
        enum=("scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152"))
    backbone_weights: str = backbone_weights_field()
    scene_cnn_epochs: int = scene_cnn_epochs_field()
    feature_dtype: str = feature_dtype_field()
    backbone_maps: tuple[str, ...] = flag(
        (), "Precomputed backbone maps per split, split=path pairs (train=maps.npy,test=...): (images, h, "
        "w, C) .npy or sharded row-array folders, one row per image in split order, float32 or "
        "float16, memory-mapped (no backbone runs).")
    train_backbone: bool = flag(False, "Train the CNN end to end (the paper) instead of on its cached maps.")
    # Model and loss.
    embed_dim: int = flag(1024, "d: channels of the projected map and the LSTM size.", lower_bound=1)
    projection_kernel: int = flag(3, "Projection kernel size (the code: 3).", lower_bound=1)
    projection: str = flag(
        "conv", "conv: a projection_kernel² convolution (the code; it can translate the map); centred: a 1x1 "
        "convolution of each cell beside its neighbourhood's mean (it cannot).", enum=("conv", "centred"))
    loss: str = flag(
        "npair", "N-pair loss (eqs. 5-7) or triplet loss with hardest in-batch negatives (eqs. 2-4).",
        enum=("npair", "triplet"))
    aggregator: str = flag(
        "max_image", "Score from the volume: max_image (eq. 1, S_MaxImage), the code's Max_Text and Avg_Both, or "
        "its Max_Img as written (max over rows only).",
        enum=("max_image", "max_text", "mean_all", "max_rows_code"))
    token_average: str = flag(
        "real", "Tokens averaged by the score: the caption's words, or all padded positions (the code).",
        enum=("real", "all"))
    normalisation: str = flag(
        "vector", "vector: each a_rc and s_t L2-normalised; map: the code's L2 norms applied (each map and each "
        "caption matrix, all T positions padding included, to unit norm); none: the code as run.",
        enum=("vector", "map", "none"))
    temperature: float = flag(
        DEFAULT_TEMPERATURE, "Softmax temperature of the N-pair loss (eqs. 5-6 and LocNet: 1).",
        lower_bound=1e-06)
    margin: float = flag(0.1, "Triplet margin η (the code: 0.1).", lower_bound=0.0)
    # Training.
    epochs: int = flag(10, "Epochs (the code: 10).", lower_bound=0)
    steps_per_epoch: int = flag(100, "Steps per epoch (the code: 100).", lower_bound=1)
    batch_size: int = flag(64, "Image–caption pairs per batch, distinct images.", lower_bound=2)
    learning_rate: float = flag(1e-3, "SGD learning rate (the code: 1e-3).", lower_bound=0.0)
    lr_decay_epochs: int = flag(10, "The rate is multiplied by 0.1 every this many epochs.", lower_bound=1)
    momentum: float = momentum_field()
    weight_decay: float = flag(1e-7, "SGD weight decay (the code: 1e-7).", lower_bound=0.0)
    paper_dataset: str = paper_dataset_field("Flickr30K")
    # Run: distribution, seed, output, --smoke: inherited from RunRecipe.
    # The table runner (--rows).
    rows: tuple[str, ...] = flag((), "Row flagfiles to run ('all': every npair_*.cfg); prints Tables 2 and 1.")
    runs_dir: str = runs_dir_field()
    resume: bool = resume_field()


# ---------------------------------------------------------------------------- data


@dataclasses.dataclass
class NPairData:
    """What `load_data` gives a row: split name -> corpus (train and the evaluation split), their
    token ids and word vectors (None when not asked for), the backbone (None with precomputed
    ``backbone_maps``) and split name -> (N, h, w, C) memory-mapped backbone maps."""
    source: pathlib.Path
    layout: DatasetLayout
    splits: dict[str, CaptionCorpus]
    text: NPairText | None
    backbone: keras.Model | None
    maps: dict


def dataset_layout(recipe: NPairRecipe) -> tuple[pathlib.Path, DatasetLayout]:
    """(dataset folder, its resolved layout) of a row: its dataset_dir, else the embedded data."""
    return dataset_from_flags(recipe.dataset_dir, caption_format=recipe.caption_format,
                              images_dir=recipe.images_dir)


def reported_metric(recipe: NPairRecipe) -> str:
    """The metric the row reports: "pointing", "retrieval" or "auto" (see --row_metric)."""
    return "pointing" if recipe.row_kind in BASELINE_KINDS else recipe.row_metric


def uncomputable_metric(recipe: NPairRecipe, layout, source) -> str | None:
    """Why the row's metric cannot be computed on this folder (None: it can), said before any
    feature is computed or any step trained."""
    if reported_metric(recipe) == "pointing" and layout.entities_dir is None:
        return (f"row {recipe.row_name or recipe.row_kind!r}: its metric, the pointing accuracy (Table 2), needs "
                f"the Flickr30K Entities Sentences/ and Annotations/ folders, which {source} does not have")
    return None


def input_spec(recipe: NPairRecipe) -> NPairInputSpec:
    spec = NPairInputSpec(image_backbone=recipe.image_backbone, backbone_weights=recipe.backbone_weights or None,
                          scene_cnn_epochs=recipe.scene_cnn_epochs, word_vectors=recipe.word_vectors or None,
                          word_dim=recipe.word_dim, max_words=recipe.max_words, seed=FEATURE_SEED,
                          feature_dtype=recipe.feature_dtype, precomputed_maps=bool(recipe.backbone_maps))
    spec.validate()
    return spec


def load_data(recipe: NPairRecipe, *, need_text: bool = True) -> NPairData:
    """The row's dataset, splits, caption inputs (`need_text`), backbone and backbone maps."""
    source, layout = dataset_layout(recipe)
    corpora = load_caption_splits(layout)
    splits = {}
    for name in ("train", recipe.eval_split):
        limit = recipe.max_train_images if name == "train" else recipe.max_test_images
        corpus = corpora[name]
        splits[name] = corpus.subset(corpus.image_ids[:limit], source=corpus.source) if limit else corpus
    spec = input_spec(recipe)
    cache = features_cache(recipe, source)
    text = caption_inputs(splits, spec) if need_text else None
    given = split_paths("backbone_maps", recipe.backbone_maps)
    if given:
        missing = sorted(set(splits) - set(given))
        if missing:
            raise UserInputError(f"--backbone_maps has no {', '.join(missing)} maps (give train=... and "
                                 f"{recipe.eval_split}=...)")
        if recipe.train_backbone or recipe.export:
            raise UserInputError("--backbone_maps gives maps without their backbone: --train_backbone and "
                                 "--export need the backbone (pass --noexport, or drop --backbone_maps)")
        maps = {name: load_backbone_maps(given[name], expected_images=len(corpus.image_ids))
                for name, corpus in splits.items()}
        return NPairData(source, layout, splits, text, None, maps)
    backbone = spatial_backbone(layout, splits["train"], cache, spec)
    maps = backbone_maps(layout, splits, cache, spec, backbone)
    return NPairData(source, layout, splits, text, backbone, maps)


def features_cache(recipe: NPairRecipe, source) -> pathlib.Path:
    return pathlib.Path(recipe.features_cache) if recipe.features_cache else pathlib.Path(source) / "features"


def build_config(recipe: NPairRecipe, text: NPairText, maps) -> NPairLocalizationConfig:
    shape = maps["train"].shape
    return NPairLocalizationConfig(
        vocabulary_size=len(text.vocabulary), map_channels=int(shape[3]), map_size=int(shape[1]),
        word_dim=int(text.word_matrix.shape[1]), embed_dim=recipe.embed_dim, max_tokens=text.max_tokens,
        projection_kernel=recipe.projection_kernel, projection=recipe.projection,
        loss=recipe.loss, aggregator=recipe.aggregator, token_average=recipe.token_average,
        normalisation=recipe.normalisation, temperature=recipe.temperature, margin=recipe.margin,
        train_word_vectors=recipe.train_word_vectors, train_backbone=recipe.train_backbone)


# ---------------------------------------------------------------------------- evaluation


def evaluation_queries(layout, corpus):
    """The pointing-game phrases of the split's images (None: the dataset has no Entities)."""
    if layout.entities_dir is None:
        return None
    return pointing_queries(layout.entities_dir, list(corpus.image_ids))


def evaluation_split(recipe: NPairRecipe, data: NPairData, vocabulary, *, tokens: CaptionTokens | None = None,
                     queries=None, protocol: str | None = None) -> NPairEvaluationSplit:
    """The row's evaluation split as the model's `evaluate` takes it. `tokens`: the split's token
    rows (default: its captions encoded with `vocabulary`, as `caption_inputs` encodes them);
    `queries`: its pointing phrases (default: read from the dataset's Entities)."""
    corpus = data.splits[recipe.eval_split]
    if tokens is None:
        tokens = encode_token_lists([tokenize_caption(c) for c in corpus.captions], list(vocabulary),
                                    recipe.max_words)
    if queries is None:
        queries = evaluation_queries(data.layout, corpus)
    return NPairEvaluationSplit(
        data.maps[recipe.eval_split], tokens.token_ids, corpus.caption_image, protocol=protocol or recipe.protocol,
        token_mask=tokens.token_mask, image_ids=list(corpus.image_ids), queries=queries,
        vocabulary=list(vocabulary), max_words=recipe.max_words, parse_mode=recipe.parse_mode,
        pointing_counting=recipe.pointing_counting, point_rule=recipe.point_rule, score_dtype=recipe.retrieval_score_dtype)


def baseline_pointing(recipe: NPairRecipe, data: NPairData, queries) -> dict:
    """Pointing-game results of a Table 2 baseline row (no model): a random pixel, the image centre,
    or the maximum of the backbone map's channel mean (the paper's "VGG baseline")."""
    if recipe.row_kind == "channel_mean":
        corpus = data.splits[recipe.eval_split]
        heat = localization_maps.channel_mean_heat_maps(
            localization_maps.RowsById(corpus.image_ids, data.maps[recipe.eval_split]), queries)
        return localization_maps.pointing_results(queries, heat, counting=recipe.pointing_counting,
                                                  point_rule=recipe.point_rule)
    return localization_maps.pointing_results(
        queries, points=localization_maps.baseline_points(queries, recipe.row_kind, recipe.seed),
        counting=recipe.pointing_counting)


def summary(record: dict, recipe: NPairRecipe) -> None:
    """The row's headline metrics (``record["metrics"]``): retrieval under its protocol, pointing in
    its parse mode (`systems.npair.model.headline_metrics`, what ``evaluate`` returns); and,
    where the pointing game was played, its grounding summary (``record["grounding"]``,
    `evaluation.grounding`: the phrases' fingerprint, the rule, the results)."""
    record["metrics"] = headline_metrics(record, recipe.protocol, recipe.parse_mode)
    pointing = record.get("pointing") or {}
    results = pointing.get(recipe.parse_mode, pointing.get("baseline"))
    if results and record.get("phrase_fingerprint"):
        rule = recipe.row_kind if recipe.row_kind in ("random_point", "centre_point") else "heat_map"
        record["grounding"] = grounding_summary(record["phrase_fingerprint"], record["num_pointing_queries"],
                                                results, rule=rule)


# ---------------------------------------------------------------------------- a finished run


def recipe_of_run(run: Run) -> NPairRecipe:
    """The recipe of a loaded N-pair run (from its results.json)."""
    return NPairRecipe.from_record(run.results or {})


def _weights(run_dir: pathlib.Path, checkpoint: str) -> pathlib.Path:
    # A model trained for no step (an untrained row, or --epochs=0) keeps untrained.weights.h5.
    untrained = run_dir / "untrained.weights.h5"
    if not (run_dir / "checkpoints" / f"{checkpoint}.weights.h5").exists() and untrained.exists():
        return untrained
    return run_weights(run_dir, checkpoint)


def load_npair_run(run_dir: pathlib.Path, checkpoint: str = "latest") -> Run:
    """The model of a finished N-pair row with its test split (see the module docstring).

    The backbone is rebuilt from the dataset's feature cache (as training built it) or, with
    precomputed ``backbone_maps``, the maps are read from the files the run names; its
    checkpoint then restores every weight (the backbone's too, frozen or fine-tuned)."""
    run_dir = pathlib.Path(run_dir)
    results_path = run_dir / "results.json"
    if not results_path.is_file():
        raise UserInputError(f"{run_dir}: an N-pair localization run needs its results.json (the row's recipe); "
                             "the run did not finish")
    results = read_json_object(results_path, "N-pair localization run record")
    recipe = NPairRecipe.from_record(results)
    if recipe.row_kind in BASELINE_KINDS:
        raise UserInputError(f"{run_dir}: a pointing-baseline row (row_kind={recipe.row_kind}) has no model to "
                             f"load; its metrics are in {results_path} ('metrics', 'pointing')")
    config_path = run_dir / NPairLocalizationConfig.FILE_NAME
    if not config_path.is_file():
        raise UserInputError(f"{run_dir}: an N-pair localization run needs {config_path.name}")
    config, extra = NPairLocalizationModel.load_config(config_path)
    vocabulary = extra.get("vocabulary")
    if not vocabulary:
        raise UserInputError(f"{config_path}: no 'vocabulary' in it")
    data = load_data(recipe, need_text=False)
    model = build_npair_model(config, backbone=data.backbone)
    load_checkpoint(model, _weights(run_dir, checkpoint))
    run_config_path = run_dir / "run_config.json"
    run_config = (read_json_object(run_config_path, "run configuration") if run_config_path.is_file()
                  else {"model": config.to_dict(), "task": results.get("task"), "recipe": recipe.to_dict()})
    run_config.setdefault("vocabulary", vocabulary)
    protocol = results.get("protocol") or recipe.protocol
    return Run(run_dir, NPairLocalizationConfig.FAMILY, model, run_config, results,
               split_reader=lambda run: evaluation_split(recipe, data, vocabulary, protocol=protocol))


# The embedded scenes (6×6×128 scene-CNN maps, ~130 words): the paper's structure at a few CPU minutes a
# row; the "centred" projection (S_MaxImage is blind to the translation a 3x3 one learns) and fine-tuned
# word vectors (the PPMI-SVD digit words are nearly one vector) make its maps localize (BUILD_NOTES.md).
EMBEDDED_PROFILE = {"word_dim": 64, "embed_dim": 256, "epochs": 6, "lr_decay_epochs": 4,
                    "learning_rate": 0.01, "projection": "centred", "train_word_vectors": True}


def train_model(recipe: NPairRecipe, typed: dict, data: NPairData, model, config, strategy,
           run_dir: pathlib.Path) -> dict:
    """Trains the model on the row's training captions; returns the loss history."""
    steps, splits, text = recipe.steps_per_epoch, data.splits, data.text
    train = text.splits["train"]
    if recipe.train_backbone:
        image_inputs = split_images(data.layout, splits["train"], int(data.backbone.input.shape[1]),
                                    features_cache(recipe, data.source))
        image_key = "image"
    else:
        image_inputs, image_key = data.maps["train"], "backbone_map"
    captions, token_key, caption_image = train.token_ids, "token_ids", splits["train"].caption_image
    if recipe.train_parse_mode == "phrase":
        if data.layout.entities_dir is None:
            raise UserInputError(f"{data.source}: --train_parse_mode=phrase needs the Flickr30K Entities "
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
    tcfg = train_config(recipe, epochs=recipe.epochs, learning_rate=recipe.learning_rate, optimizer="sgd")

    def dataset(start_step=0):
        return npair_batches.train_dataset(image_inputs, captions, train.token_mask, caption_image,
                                           train.trainable, batch_size=recipe.batch_size, seed=recipe.seed,
                                           start_step=start_step, image_key=image_key, token_key=token_key)

    trainer.prepare_run_dir(run_dir, {"model": config.to_dict(), "train": tcfg.__dict__, "typed_flags": typed,
                                      "recipe": recipe.to_dict(), "task": "npair"})
    model.save_config(run_dir / config.FILE_NAME, vocabulary=text.vocabulary)
    trained = trainer.train(model, dataset, tcfg, run_dir, steps_per_epoch=steps, epochs=recipe.epochs)
    return {k: [float(x) for x in v] for k, v in trained.history.items()}


def run(recipe: NPairRecipe, typed: dict | None = None, flagfile: str | None = None) -> dict:
    """Runs one row in `recipe.run_dir` (else ``runs/<flagfile stem>``); returns results.json's record."""
    start, typed, recipe = time.time(), typed or {}, dataclasses.replace(recipe)   # resolve_protocol may set it
    row_name = recipe.row_name or "npair"
    if recipe.retrieval_score_dtype != "float32" and recipe.aggregator != "max_image":
        # Said before training, not after it: the packed scorer is S_MaxImage's alone.
        raise UserInputError(f"--retrieval_score_dtype={recipe.retrieval_score_dtype} needs "
                                    f"--aggregator=max_image (got {recipe.aggregator})")
    run_dir = pathlib.Path(recipe.run_dir) if recipe.run_dir else table_runner.run_folder(None, flagfile, row_name)
    baseline = recipe.row_kind in BASELINE_KINDS
    source, layout = dataset_layout(recipe)
    reason = uncomputable_metric(recipe, layout, source)
    if reason:
        raise UserInputError(reason)
    data = load_data(recipe, need_text=not baseline)
    evaluation = data.splits[recipe.eval_split]
    # Checked before training; the pointing baselines have no retrieval.
    protocol = {"protocol": None} if baseline else resolve_protocol(
        recipe, evaluation.num_images, split=f"the {recipe.eval_split} split")
    queries = evaluation_queries(layout, evaluation)
    record = {"row": row_name, "system": "npair", "task": "npair", "row_kind": recipe.row_kind, "dataset": str(source),
              "typed_flags": typed, "recipe": recipe.to_dict(), "run_dir": str(run_dir),
              "paper": paper_numbers(recipe.paper_results), "paper_dataset": recipe.paper_dataset,
              "paper_protocol": recipe.paper_protocol, "row_metric": reported_metric(recipe),
              "num_train_images": data.splits["train"].num_images, "num_eval_images": evaluation.num_images,
              "num_eval_captions": evaluation.num_captions, **split_record(protocol, evaluation),
              "num_pointing_queries": None if queries is None else len(queries),
              "phrase_fingerprint": None if queries is None else phrase_fingerprint(queries)}
    if queries is None:
        record["pointing_not_computed"] = (f"{source} has no Flickr30K Entities Sentences/ and Annotations/ "
                                           "folders: retrieval only")
    if baseline:
        record["pointing"] = {"baseline": baseline_pointing(recipe, data, queries)}
        summary(record, recipe)
        record["seconds"] = time.time() - start
        write_json(recipe.out_json or run_dir / "results.json", record)
        return record

    text = data.text
    config = build_config(recipe, text, data.maps)
    strategy = setup_training(recipe)
    with strategy.scope():
        model = build_npair_model(config, text.word_matrix, backbone=data.backbone)
    record["history"] = {}
    if recipe.row_kind == "model" and recipe.epochs:
        record["history"] = train_model(recipe, typed, data, model, config, strategy, run_dir)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        model.save_config(run_dir / config.FILE_NAME, vocabulary=text.vocabulary)
        model.save_weights(run_dir / "untrained.weights.h5")
    protocols = list(dict.fromkeys([recipe.protocol] + (["folds_100"] if evaluation.num_images >= 100 else [])))
    # The model's evaluate: the split's maps and token vectors are written once to a temporary
    # folder of the run, chunk by chunk, and read by every protocol and the pointing game.
    split = evaluation_split(recipe, data, text.vocabulary, tokens=text.splits[recipe.eval_split],
                                   queries=queries)
    record.update(model.evaluation_results(split, protocols=protocols, work_dir=run_dir))
    # Per evaluated protocol: a row sharing this model under another protocol takes its own.
    record["random_baselines"] = {p: retrieval.random_baseline_metrics(
        evaluation.num_images, evaluation.caption_image, protocol=p, seed=recipe.seed) for p in protocols}
    record["random_baseline"] = record["random_baselines"][recipe.protocol]
    summary(record, recipe)
    logging.info("%s: %s", row_name, {k: round(v, 2) for k, v in record["metrics"].items()})
    if recipe.export and is_chief() and recipe.row_kind == "model":
        from tf_twobranch.systems.npair.export import export_npair_model
        record["export_dir"] = str(export_npair_model(
            model, run_dir / "export", vocabulary=text.vocabulary, point_rule=recipe.point_rule,
            run_config={"model": config.to_dict(), "typed_flags": typed, "recipe": recipe.to_dict()}))
    record["seconds"] = time.time() - start
    write_json(recipe.out_json or run_dir / "results.json", record)
    return record
