"""Deep fragment embeddings (Karpathy, Joulin & Fei-Fei, NIPS 2014): a row from its recipe.

`FragmentRecipe` holds the values of every flag of
``python -m experiments.fragment_embeddings`` (same names, same defaults);
the experiment builds it once from its flags and stores it in
``results.json["recipe"]`` and each stage's ``run_config.json["recipe"]``.
From a recipe alone (no absl, no `experiments` import):

* `load_data(recipe)`: the caption splits, image fragments (the CNN features
  of the whole image and its top proposals, from the feature cache) and
  sentence fragments (dependency triplets) of the row;
* `build_config(recipe, images, text)`: its `FragmentEmbeddingConfig`;
* `stage_epochs`, `stage_learning_rate`, `initial_weights`: its schedule;
* `evaluation_split(recipe, data, config)`: the `EvaluationSplit` that
  `FragmentEmbeddingModel.evaluate` scores with S_kl;
* `grounding(recipe, data, model)`: the grounding of the split's Flickr30K Entities
  phrases through each phrase's best-aligned image fragment (`evaluation.grounding`);
* `load_fragment_run(run_dir, checkpoint)`: the loader `runs.load_run` uses
  for these runs; ``run.model.evaluate(run.evaluation_split())`` returns the
  metrics of ``run.results["metrics"]``. A stage folder (``<run>/stage1``)
  loads that stage's model, its results' metrics being the stage's.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import NamedTuple

import keras
import numpy as np

from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.data.from_flags import dataset_from_flags
from tf_twobranch.data.layout import DatasetLayout
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.systems.fragments.sentence_fragments import caption_keys
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation.grounding import fragment_grounding
from tf_twobranch.evaluation.pointing_game import pointing_queries
from tf_twobranch.evaluation.split import EvaluationSplit
from tf_twobranch.features import FEATURE_SEED
from tf_twobranch.systems.fragments.image_fragments import fragment_boxes
from tf_twobranch.features.backbones import build_backbone
from tf_twobranch.features.prepare import scene_cnn_path
from tf_twobranch.systems.fragments.features import (FragmentFeatureSpec, FragmentImages, FragmentText,
                                                     FragmentTextSpec, fragment_cnn, image_fragment_inputs,
                                                     sentence_fragment_inputs)
from tf_twobranch.features.scene_cnn import load_scene_cnn
from tf_twobranch.features.prepare_regions import read_split_proposals
from tf_twobranch.json_files import read_json_object
from tf_twobranch.systems.fragments.model import (FragmentEmbeddingConfig, FragmentEmbeddingModel,
                                                    build_fragment_model)
from tf_twobranch.cli import split_paths
from tf_twobranch.recipes import RunRecipe
from tf_twobranch.table_runner import slug
from tf_twobranch.run_loading import Run, config_folder, run_results, run_weights

__all__ = ["FragmentRecipe", "FragmentData", "load_data", "build_config", "image_inputs", "evaluation_split",
           "stage_epochs", "stage_learning_rate", "initial_weights", "load_fragment_run", "grounding",
           "serving_image_cnn"]


@dataclasses.dataclass
class FragmentRecipe(RunRecipe):
    """One row of Karpathy et al.'s tables: the experiment's flags (see their help there)."""

    # Data.
    dataset_dir: str = ""
    caption_format: str = "auto"
    images_dir: str = ""
    max_train_images: int = 0
    max_test_images: int = 0
    eval_split: str = "test"
    protocol: str = "full"
    # Sentences.
    parser: str = "conllu"
    parses: str = ""
    spacy_model: str = "en_core_web_sm"
    fragments: str = "dependency"
    collapse_prepositions: bool = False
    min_relation_fraction: float = 0.01
    word_vectors: str = ""
    word_dim: int = 200
    # Images.
    features_cache: str = ""
    image_backbone: str = "scene_cnn"
    backbone_weights: str = ""
    scene_cnn_epochs: int = 12
    proposals: str = ""
    detections: int = 19
    fragment_features: list = dataclasses.field(default_factory=list)
    image_fragments: str = "all"
    feature_dtype: str = "float32"
    # Model and objective.
    representation: str = "fragments"
    random_ranking: bool = False
    embed_dim: int = 1000
    shared_relation_weights: bool = False
    fragment_objective: bool = True
    global_objective: bool = True
    class_balanced: bool = False
    global_weight: float = 0.5
    weight_decay: float = 1e-10
    global_margin: float = 2.5
    smoothing: float = 5.0
    normaliser: str = "paper"
    global_score: str = "sum_relu"
    mil_zero_score: str = "negative"
    decay_biases: bool = False
    # Training.
    epochs: int = 20
    steps_per_epoch: int = 0
    batch_size: int = 100
    learning_rate: float = 1e-5
    momentum: float = 0.9
    lr_drop_epochs: int = 2
    mil: bool = False
    fine_tune_cnn: bool = False
    cnn_learning_rate_scale: float = 1.0
    mil_start: str = "paper"
    init_from: str = ""
    paper_dataset: str = "Flickr8K"
    # Run: distribution, seed, output (common.define_run_flags), --smoke: inherited from RunRecipe.
    # The table runner.
    rows: list = dataclasses.field(default_factory=list)
    runs_dir: str = ""
    resume: bool = True
    table: str = "all"


class FragmentData(NamedTuple):
    """A row's data: its dataset folder, layout, caption splits, image and sentence fragments."""
    source: pathlib.Path
    layout: DatasetLayout
    splits: dict
    images: dict[str, FragmentImages]
    text: FragmentText


# ---------------------------------------------------------------------------- data


def load_data(recipe: FragmentRecipe) -> FragmentData:
    """The caption splits (train and the evaluated one), image fragments and sentence fragments of a row."""
    r = recipe
    source, layout = dataset_from_flags(r.dataset_dir, caption_format=r.caption_format,
                                        images_dir=r.images_dir, proposals=r.proposals)
    corpora = load_caption_splits(layout)
    splits = {}
    for name in ("train", r.eval_split):
        limit = r.max_train_images if name == "train" else r.max_test_images
        corpus = corpora[name]
        splits[name] = corpus.subset(corpus.image_ids[:limit], source=corpus.source) if limit else corpus
    parses = None
    if r.parser == "spacy":
        from tf_twobranch.data import spacy_parses  # spaCy is an optional extra: imported only when asked for
        nlp = spacy_parses.load_spacy_model(r.spacy_model)
        cache = pathlib.Path(r.features_cache or source / "features")
        parses = cache / f"parses_spacy_{slug(r.spacy_model)}_{len(splits['train'].captions)}.conllu"
        if not parses.exists():
            trees = {}
            for corpus in splits.values():
                trees.update(spacy_parses.parse_captions(nlp, corpus.captions, caption_keys(corpus)))
            parses.parent.mkdir(parents=True, exist_ok=True)
            spacy_parses.write_caption_parses(parses, trees)
    text = sentence_fragment_inputs(layout, splits, FragmentTextSpec(
        fragments=r.fragments, collapse_prepositions=r.collapse_prepositions,
        min_relation_fraction=r.min_relation_fraction, parses=r.parses or None,
        word_vectors=r.word_vectors or None, word_dim=r.word_dim, seed=FEATURE_SEED), parses=parses)
    images = image_fragment_inputs(layout, splits, r.features_cache or source / "features", FragmentFeatureSpec(
        image_backbone=r.image_backbone, backbone_weights=r.backbone_weights or None,
        scene_cnn_epochs=r.scene_cnn_epochs, proposals=r.proposals or None, detections=r.detections,
        fragment_features=split_paths("fragment_features", r.fragment_features) or None, seed=FEATURE_SEED,
        feature_dtype=r.feature_dtype))
    if r.image_fragments == "fullframe":
        for split in images.values():
            split.mask = split.mask.copy()
            split.mask[:, 1:] = False
    return FragmentData(source, layout, splits, images, text)


# ---------------------------------------------------------------------------- model


def build_config(recipe: FragmentRecipe, images, text) -> FragmentEmbeddingConfig:
    """The row's model configuration (sizes from its data: CNN features, relations, word vectors)."""
    r = recipe
    train = images["train"]
    head = r.fine_tune_cnn and train.head is not None
    if r.fine_tune_cnn and train.head is None:
        raise UserInputError("--fine_tune_cnn trains the CNN's top layer on cached activations: it needs "
                             "--image_backbone=scene_cnn (precomputed --fragment_features and the "
                             "ImageNet backbones give final features only)")
    return FragmentEmbeddingConfig(
        image_dim=int(train.inputs.shape[2] if head else (train.head[0].shape[1] if train.head else
                                                             train.inputs.shape[2])),
        num_relations=max(1, len(text.relations)), vocabulary_size=len(text.word_vectors.words),
        word_dim=text.word_vectors.dim, embed_dim=r.embed_dim,
        shared_relation_weights=r.shared_relation_weights, global_weight=r.global_weight,
        weight_decay=r.weight_decay, global_margin=r.global_margin, smoothing=r.smoothing,
        normaliser=r.normaliser, class_balanced=r.class_balanced, mil_zero_score=r.mil_zero_score,
        global_score=r.global_score, decay_biases=r.decay_biases,
        use_fragment_objective=r.fragment_objective and r.representation != "devise",
        use_global_objective=r.global_objective or r.representation == "devise",
        representation=r.representation, image_head_dim=int(train.head[0].shape[1]) if head else 0,
        cnn_learning_rate_scale=r.cnn_learning_rate_scale)


def image_inputs(split: FragmentImages, config: FragmentEmbeddingConfig):
    """The model's image input of a split: the CNN features, or the activations below its top layer.

    A row-indexable array as the cache holds it (memory-mapped, float32 or
    float16): the batches and `FragmentEmbeddingModel.embed_split` read it a
    chunk at a time.
    """
    return split.inputs if config.image_head_dim else split.features()


def evaluation_split(recipe: FragmentRecipe, data: FragmentData, config: FragmentEmbeddingConfig
                     ) -> EvaluationSplit:
    """The row's evaluated split as `FragmentEmbeddingModel.evaluate` takes it.

    ``image``: {"fragments": (N, M, D) the model's image inputs (`image_inputs`),
    "mask": (N, M)}; ``text``: {"relation", "word1", "word2": (total,) ids,
    "row_splits": (captions + 1,)}: caption l owns fragments
    ``row_splits[l]:row_splits[l + 1]``.
    """
    images, fragments = data.images[recipe.eval_split], data.text.splits[recipe.eval_split]
    return EvaluationSplit(
        image={"fragments": image_inputs(images, config), "mask": images.mask},
        text={"relation": fragments.relation, "word1": fragments.word1, "word2": fragments.word2,
              "row_splits": fragments.row_splits},
        caption_image=data.splits[recipe.eval_split].caption_image, protocol=recipe.protocol)


def serving_image_cnn(recipe: FragmentRecipe, data: FragmentData, config: FragmentEmbeddingConfig):
    """``(cnn, None)``: the CNN from an image crop to the row's image inputs
    (`prepare_fragments.fragment_cnn` of the backbone that computed the cached fragments), for an
    export taking JPEG bytes and boxes; or ``(None, why)`` when it cannot be had.

    The scene CNN is only read where `cached_scene_cnn` kept it, never trained again: a new one
    would not give the cached features the row was trained and evaluated on.
    """
    r = recipe
    if r.fragment_features:
        return None, ("the row's image fragments are precomputed --fragment_features (no CNN known): the "
                      "export takes image_fragments")
    if r.image_backbone == "scene_cnn":
        cache = pathlib.Path(r.features_cache) if r.features_cache else data.source / "features"
        path = scene_cnn_path(data.splits["train"], cache, epochs=r.scene_cnn_epochs, seed=FEATURE_SEED)
        if not path.is_file():
            return None, (f"the scene CNN that computed the cached image fragments is missing ({path}): the "
                          "export takes image_fragments")
        backbone = load_scene_cnn(path)
    elif not r.backbone_weights:
        return None, (f"the {r.image_backbone} backbone has no --backbone_weights: the export takes "
                      "image_fragments")
    else:
        backbone = build_backbone(r.image_backbone, weights_path=r.backbone_weights)
    return fragment_cnn(backbone, r.image_backbone, fine_tuned=config.image_head_dim > 0), None


# ---------------------------------------------------------------------------- schedule


def stage_epochs(recipe: FragmentRecipe) -> list[tuple[int, int, int]]:
    """(stage, first epoch, end epoch) of each stage."""
    r = recipe
    if not (r.mil or r.fine_tune_cnn):
        return [(1, 0, r.epochs)]
    switch = r.epochs // 2 if r.mil_start == "paper" else int(round(0.75 * r.epochs))
    switch = min(max(switch, 1), r.epochs - 1) if r.epochs > 1 else 0
    return [(1, 0, switch), (2, switch, r.epochs)] if switch else [(2, 0, r.epochs)]


def stage_learning_rate(recipe: FragmentRecipe, steps_per_epoch: int, first_epoch: int, end_epoch: int):
    """The stage's rate: × 0.1 from epoch `epochs - lr_drop_epochs` on (steps counted from the stage start)."""
    r = recipe
    drop = r.epochs - r.lr_drop_epochs
    if r.lr_drop_epochs == 0 or drop >= end_epoch:
        return r.learning_rate
    if drop <= first_epoch:
        return 0.1 * r.learning_rate
    return keras.optimizers.schedules.PiecewiseConstantDecay(
        [(drop - first_epoch) * steps_per_epoch], [r.learning_rate, 0.1 * r.learning_rate])


def initial_weights(model, path: str) -> str:
    """Loads `--init_from` (a run folder's last stage, or a .weights.h5) into `model`; its path."""
    p = pathlib.Path(path)
    candidates = [p] if p.suffix == ".h5" else [p / s / "checkpoints" / "latest.weights.h5"
                                                for s in ("stage2", "stage1", ".")]
    weights = next((c for c in candidates if c.is_file()), None)
    if weights is None:
        raise UserInputError(f"--init_from={path}: no checkpoint found (looked for "
                             f"{', '.join(map(str, candidates))})")
    load_checkpoint(model, weights)
    return str(weights)


# ---------------------------------------------------------------------------- finished runs


def _stage_results(run_dir: pathlib.Path, folder: pathlib.Path, run_config: dict) -> dict | None:
    """results.json of the run; for a stage folder other than the last, with that stage's metrics."""
    record = run_results(run_dir, folder)
    if record is None and re.fullmatch(r"stage\d+", folder.name):
        record = run_results(folder.parent, folder.parent)
    if record is None or not record.get("stages"):
        return record
    stage = next((s for s in record["stages"] if s.get("stage") == run_config.get("stage")), None)
    return record if stage is None else {**record, "stage": stage["stage"], "metrics": stage["metrics"]}


def load_fragment_run(run_dir: pathlib.Path, checkpoint: str = "latest") -> Run:
    """A deep-fragment-embedding run (its system's `load`): the last stage's model, or the given stage folder's.

    Its `evaluation_split()` rebuilds the evaluated split from the recorded
    recipe (`load_data`: the cached fragment features, the parses and word
    vectors of the row); the model's frozen word vectors are in its checkpoint.
    """
    run_dir = pathlib.Path(run_dir)
    folder = config_folder(run_dir, FragmentEmbeddingConfig.FILE_NAME)
    if folder is None:
        raise UserInputError(f"{run_dir}: the run has no trained stage ({FragmentEmbeddingConfig.FILE_NAME} "
                             "in stage2/, stage1/ or the folder itself); a random-ranking row has no model")
    config, _ = FragmentEmbeddingModel.load_config(folder / FragmentEmbeddingConfig.FILE_NAME)
    model = build_fragment_model(config)
    load_checkpoint(model, run_weights(folder, checkpoint))
    run_config = read_json_object(folder / "run_config.json", "run configuration")
    return Run(folder, FragmentEmbeddingConfig.FAMILY, model, run_config,
               _stage_results(run_dir, folder, run_config), split_reader=_read_split)


def _read_split(run: Run) -> EvaluationSplit:
    recipe = FragmentRecipe.from_record(run.config, str(run.run_dir / "run_config.json"))
    return evaluation_split(recipe, load_data(recipe), run.model.config)


# ---------------------------------------------------------------------------- grounding


def grounding(recipe: FragmentRecipe, data: FragmentData, model) -> dict:
    """The row's grounding of the evaluated split's Flickr30K Entities phrases
    (`evaluation.grounding.fragment_grounding`: the centre of the best-aligned image fragment's
    box in the pointing game, box R@1 over the image-fragment boxes), or ``{"not_computed": why}``.

    The boxes are those the row's image fragments were cut from: the whole image, then the
    top `detections` boxes of the row's proposals file (`features.image_fragments.fragment_boxes`).
    """
    r = recipe
    if model.config.representation != "fragments":
        return {"not_computed": f"a {model.config.representation} row embeds whole images and sentences: "
                                "no image fragment to point with"}
    if data.layout.entities_dir is None:
        return {"not_computed": f"{data.source} has no Flickr30K Entities Sentences/ and Annotations/: "
                                "no phrases to ground"}
    if r.fragment_features:
        return {"not_computed": "the row's image fragments are precomputed --fragment_features, whose boxes "
                               "it does not know"}
    corpus, images, fragments = data.splits[r.eval_split], data.images[r.eval_split], data.text.splits[r.eval_split]
    queries = pointing_queries(data.layout.entities_dir, list(corpus.image_ids))
    if not queries:
        return {"not_computed": f"no phrase with a box among the {r.eval_split} split's images"}
    v, v_mask, s, row_splits = model.embed_split(image_inputs(images, model.config), images.mask, fragments)
    ids = sorted({q.image_id for q in queries})
    proposals = (read_split_proposals(pathlib.Path(r.proposals) if r.proposals else data.layout.proposals, ids,
                                      r.detections) if r.detections else {})
    size = {q.image_id: (q.image_height, q.image_width) for q in queries}
    boxes = {i: fragment_boxes(proposals.get(i, np.zeros((0, 4), np.float32)), *size[i], r.detections)
             for i in ids}
    return fragment_grounding(queries, image_ids=images.image_ids, caption_image=corpus.caption_image,
                              caption_words=fragments.words, image_fragments=v, image_mask=v_mask,
                              sentence_fragments=s, row_splits=row_splits, positions=fragments.positions,
                              image_boxes=boxes)
