"""N-pair phrase localization (Das et al.): a row's recipe, its data, its model and its evaluation.

`NPairRecipe` holds every flag of ``experiments/npair_localization.py``
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

import keras

from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.cli import split_paths
from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.from_flags import dataset_from_flags
from tf_twobranch.data.layout import DatasetLayout
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import UserInputError
from tf_twobranch.systems.npair import heat_maps as localization_maps
from tf_twobranch.evaluation.grounding import grounding_summary
from tf_twobranch.evaluation.pointing_game import DEFAULT_POINT_RULE, pointing_queries
from tf_twobranch.features import FEATURE_SEED
from tf_twobranch.systems.npair.features import (CaptionTokens, NPairInputSpec, NPairText, backbone_maps,
                                                 caption_inputs, encode_token_lists, load_backbone_maps,
                                                 spatial_backbone)
from tf_twobranch.json_files import read_json_object
from tf_twobranch.systems.npair.losses import DEFAULT_TEMPERATURE
from tf_twobranch.systems.npair.model import (NPairEvaluationSplit, NPairLocalizationConfig,
                                              NPairLocalizationModel, build_npair_model, headline_metrics)
from tf_twobranch.recipes import RunRecipe
from tf_twobranch.run_loading import Run, run_weights

__all__ = ["ROW_KINDS", "BASELINE_KINDS", "NPairRecipe", "NPairData", "dataset_layout", "reported_metric",
           "uncomputable_metric", "load_data", "features_cache", "build_config", "evaluation_queries",
           "evaluation_split", "baseline_pointing", "summary", "load_npair_run", "run_recipe"]

ROW_KINDS = ("model", "untrained", "random_point", "centre_point", "channel_mean")
BASELINE_KINDS = ("random_point", "centre_point", "channel_mean")


@dataclasses.dataclass
class NPairRecipe(RunRecipe):
    """One row of the N-pair experiment: every flag of ``experiments.npair_localization``, by name,
    with its default (the flags' help says what each means). List flags are tuples."""

    # Data.
    dataset_dir: str = ""
    caption_format: str = "auto"
    images_dir: str = ""
    max_train_images: int = 0
    max_test_images: int = 0
    eval_split: str = "test"
    protocol: str = "folds_100"
    retrieval_score_dtype: str = "float32"
    row_kind: str = "model"
    parse_mode: str = "word"
    train_parse_mode: str = "word"
    row_metric: str = "auto"
    pointing_counting: str = "phrase"
    point_rule: str = DEFAULT_POINT_RULE
    # Text.
    word_vectors: str = ""
    word_dim: int = 300
    max_words: int = 20
    train_word_vectors: bool = False
    # Image.
    features_cache: str = ""
    image_backbone: str = "scene_cnn"
    backbone_weights: str = ""
    scene_cnn_epochs: int = 12
    feature_dtype: str = "float32"
    backbone_maps: tuple[str, ...] = ()
    train_backbone: bool = False
    # Model and loss.
    embed_dim: int = 1024
    projection_kernel: int = 3
    projection: str = "conv"
    loss: str = "npair"
    aggregator: str = "max_image"
    token_average: str = "real"
    normalisation: str = "vector"
    temperature: float = DEFAULT_TEMPERATURE
    margin: float = 0.1
    # Training.
    epochs: int = 10
    steps_per_epoch: int = 100
    batch_size: int = 64
    learning_rate: float = 1e-3
    lr_decay_epochs: int = 10
    momentum: float = 0.9
    weight_decay: float = 1e-7
    paper_dataset: str = "Flickr30K"
    # Run: distribution, seed, output (common.define_run_flags), --smoke: inherited from RunRecipe.
    # The table runner (--rows).
    rows: tuple[str, ...] = ()
    runs_dir: str = ""
    resume: bool = True


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
    its parse mode (`models.npair_localization.headline_metrics`, what ``evaluate`` returns); and,
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


def run_recipe(run: Run) -> NPairRecipe:
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
