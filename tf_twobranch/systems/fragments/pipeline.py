"""Deep fragment embeddings (Karpathy, Joulin & Fei-Fei, NIPS 2014): a row from its recipe.

`FragmentRecipe` holds the values of every flag of
``python -m experiments.fragments`` (same names, same defaults);
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
import time
from typing import NamedTuple

import keras
import numpy as np
from absl import logging

from tf_twobranch import table_runner
from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.data.from_flags import dataset_from_flags
from tf_twobranch.data.layout import DatasetLayout
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.systems.fragments.sentence_fragments import caption_keys
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import retrieval
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
from tf_twobranch.recipes import (RunRecipe, backbone_weights_field, caption_format_field, eval_split_field,
                                  feature_dtype_field, flag, images_dir_field, max_images_field,
                                  momentum_field, paper_dataset_field, resume_field, runs_dir_field,
                                  scene_cnn_epochs_field, word_vectors_field)
from tf_twobranch.run_records import is_chief, setup_training, train_config, write_results as write_json
from tf_twobranch.systems.fragments import sampling as fragment_batches
from tf_twobranch.systems.fragments.export import export_fragment_model
from tf_twobranch.tables import paper_numbers, resolve_protocol, split_record
from tf_twobranch.training import trainer
from tf_twobranch.table_runner import slug
from tf_twobranch.run_loading import Run, config_folder, run_results, run_weights

__all__ = ["FragmentRecipe", "FragmentData", "load_data", "build_config", "image_inputs", "evaluation_split",
           "stage_epochs", "stage_learning_rate", "initial_weights", "load_fragment_run", "grounding",
           "serving_image_cnn", "EMBEDDED_PROFILE", "run"]


@dataclasses.dataclass
class FragmentRecipe(RunRecipe):
    """One row of Karpathy et al.'s tables: the experiment's flags (see their help there)."""
    # Where this experiment words a shared flag's help its own way.
    FLAG_HELP = {
        "export": "Export the model as a SavedModel.",
        "paper_results": "Paper numbers: R@1,R@5,R@10,Med r of image annotation then image search."}
    # --smoke: one epoch of two steps; the batch is capped with the images (a batch holds distinct
    # images: 100 of 40 cannot be drawn).
    SMOKE_CAPS = {"epochs": 1, "steps_per_epoch": 2, "max_train_images": 40, "max_test_images": 20,
                  "batch_size": 16, "scene_cnn_epochs": 1}


    # Data.
    dataset_dir: str = flag(
        "", "Dataset folder (Flickr8K: Flickr8k.token.txt and Flickr_8k.*Images.txt; Flickr30K: a token "
        "file or Karpathy JSON with split lists), with its images; empty: the embedded dataset.")
    caption_format: str = caption_format_field()
    images_dir: str = images_dir_field()
    max_train_images: int = max_images_field("training")
    max_test_images: int = max_images_field("test")
    eval_split: str = eval_split_field()
    protocol: str = flag(
        "full", "full: every test sentence; first_caption: each image's first sentence only (Hodosh et al.'s "
        "protocol, the paper's * rows).", enum=("full", "first_caption"))
    # Sentences.
    parser: str = flag(
        "conllu", "conllu: read the captions' dependency parses from --parses (or the dataset's "
        '<captions>.conllu); spacy: parse them with --spacy_model (pip install -e ".[parse]").',
        enum=("conllu", "spacy"))
    parses: str = flag("", "CoNLL-U parses of the captions (`# sent_id = <image>#<k>`).")
    spacy_model: str = flag(
        "en_core_web_sm", "Installed spaCy model name or local model folder (--parser=spacy); nothing is downloaded.")
    fragments: str = flag(
        "dependency", "Sentence fragments: dependency triplets, words (BOW) or bigrams.",
        enum=("dependency", "bow", "bigram"))
    collapse_prepositions: bool = flag(
        False, "Fold prep(g, p) + pobj(p, o) into prep_<p>(g, o) as CoreNLP's collapsed dependencies (the "
        "paper's parser) do.")
    min_relation_fraction: float = flag(
        0.01, "Relation types under this fraction of the training fragments are dropped.",
        lower_bound=0.0, upper_bound=0.99)
    word_vectors: str = word_vectors_field()
    word_dim: int = flag(200, "Word vector size W_e (the paper: 200).", lower_bound=2)
    # Images.
    features_cache: str = flag("", "Where image fragments are cached (default <dataset_dir>/features).")
    image_backbone: str = flag(
        "scene_cnn", "CNN of the image fragments (scene_cnn: trained on the training images).",
        enum=("scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152"))
    backbone_weights: str = backbone_weights_field()
    scene_cnn_epochs: int = scene_cnn_epochs_field()
    proposals: str = flag(
        "", "Ranked region proposals (HDF5 file or folder); default <dataset_dir>/proposals.h5.")
    detections: int = flag(19, "Top-ranked boxes per image (+ the whole image).", lower_bound=0)
    fragment_features: list = flag(
        default_factory=list, help="Precomputed fragment features per split, split=path pairs of (images, 20, D) .npy/.h5 arrays "
        "in split order (instead of the CNN).")
    image_fragments: str = flag(
        "all", "all: the whole image + detections; fullframe: the whole image only.",
        enum=("all", "fullframe"))
    feature_dtype: str = feature_dtype_field()
    # Model and objective.
    representation: str = flag(
        "fragments", "fragments: the paper's model; devise: the DeViSE baseline (mean word vector, mean CNN "
        "feature, global objective).", enum=("fragments", "devise"))
    random_ranking: bool = flag(False, "The Random Ranking row: random scores, no training.")
    embed_dim: int = flag(1000, "h, the fragment embedding size.", lower_bound=1)
    shared_relation_weights: bool = flag(
        False, "One W_R for every relation (the authors' code) instead of one per relation type (the paper).")
    fragment_objective: bool = flag(True, "Use the fragment alignment objective C_F.")
    global_objective: bool = flag(True, "Use the global ranking objective C_G.")
    class_balanced: bool = flag(
        False, "C_0 with positives weighted 1/#pos and negatives 1/#neg per sentence fragment (the authors' "
        "code).")
    global_weight: float = flag(0.5, "β.", lower_bound=0.0)
    weight_decay: float = flag(1e-10, "α of α‖θ‖².", lower_bound=0.0)
    global_margin: float = flag(
        2.5, "Δ of the global ranking objective (the code: 40 with its normaliser, whose S is about 15× "
        "the paper's).", lower_bound=0.0)
    smoothing: float = flag(5.0, "n of S_kl (the code's smoothnum: 10).", lower_bound=0.0)
    normaliser: str = flag(
        "paper", "S_kl normaliser: 1/(|g_k|(|g_l|+n)) (paper) or 1/(|g_l|+n) (code).", enum=("paper", "code"))
    global_score: str = flag(
        "sum_relu", "S_kl's accumulation over an image's fragments, in training and evaluation: sum_relu Σ max(0, "
        "vᵀs) (the paper; the code's thrglobalscore=1, maxaccum=0); sum Σ vᵀs (thrglobalscore=0); "
        "max_relu: each sentence fragment's best max(0, vᵀs) (maxaccum=1); max: its best vᵀs (the "
        "code's DriverSetParams.m defaults, 'the CVPR implementation').",
        enum=("sum_relu", "sum", "max_relu", "max"))
    mil_zero_score: str = flag(
        "negative", "MIL label of a positive-bag pair scoring exactly 0 (an all-zero ReLU sentence fragment): "
        "negative (y = -1), or ignored (no weight in C_F: the code's sign(0) = 0).",
        enum=("negative", "ignored"))
    decay_biases: bool = flag(
        False, "Include the biases in α‖θ‖² (the paper's θ and the authors' code decay every parameter); "
        "default: kernels only.")
    # Training.
    epochs: int = flag(20, "Epochs (an epoch: num_sentences / batch_size steps).", lower_bound=1)
    steps_per_epoch: int = flag(
        0, "Steps per epoch; 0: the paper's epoch (every training sentence once, num_sentences / "
        "batch_size steps). A smaller value shortens a trial or benchmark run at the real dataset "
        "size.", lower_bound=0)
    batch_size: int = flag(100, "Distinct images per batch, one sentence each.", lower_bound=2)
    learning_rate: float = flag(
        1e-5, "SGD learning rate (cross-validated in the paper; the code: 1e-5).", lower_bound=0.0)
    momentum: float = momentum_field()
    lr_drop_epochs: int = flag(2, "The last this many epochs run at 0.1× the rate.", lower_bound=0)
    mil: bool = flag(False, "Second stage with the MIL fragment objective (eq. 5).")
    fine_tune_cnn: bool = flag(False, "Second stage also trains the CNN's top layer (scene_cnn backbone).")
    cnn_learning_rate_scale: float = flag(
        1.0, "With --fine_tune_cnn: the CNN top layer's learning rate relative to --learning_rate.",
        lower_bound=0.0)
    mil_start: str = flag(
        "paper", "When the second stage starts: half the epochs (paper: 10 of 20) or 0.75·epochs (the authors' "
        "code).", enum=("paper", "code"))
    init_from: str = flag("", "Run directory (or .weights.h5) whose weights start the run.")
    paper_dataset: str = paper_dataset_field("Flickr8K")
    # Run: distribution, seed, output, --smoke: inherited from RunRecipe.
    # The table runner.
    rows: list = flag(
        default_factory=list, help="Run these row flagfiles (names in experiments/configs or paths; 'all': every "
        "fragments_table<N>_*.cfg of --table) and print the tables.")
    runs_dir: str = runs_dir_field()
    resume: bool = resume_field()
    table: str = flag(
        "all", "Rows of Table 2 (Flickr8K), Table 3 (Flickr30K) or both (--rows=all).",
        enum=("2", "3", "all"))


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


# The embedded scenes have a ~130-word vocabulary (the PPMI-SVD word vectors
# can have at most that many dimensions) and 2,500 training images. The
# profile keeps the paper's structure (20 fragments per image, per-relation
# W_R, S_kl, SGD with momentum 0.9, 100 distinct images per batch, two
# stages, lr × 0.1 at the end) at a size a 2-core CPU trains in about four
# minutes per row: 64-d word vectors, h = 256, 4 epochs of 125 steps (the
# second stage from epoch 2, the last epoch at 0.1×). The authors' code's
# class-balanced C_0 with lr 1e-4: with the paper's plain C_0 (a sum over
# ~2M fragment pairs per batch, 99 % negative) training diverged at lr 1e-5
# and collapsed at 1e-6 (every fragment score negative, all S_kl equal:
# C_G at its collapse value); BUILD_NOTES.md. The CNN's top layer is
# fine-tuned at 0.01× the rate: at 1× it diverged (rsum 1.6, below chance).
EMBEDDED_PROFILE = {"word_dim": 64, "embed_dim": 256, "epochs": 4, "lr_drop_epochs": 1,
                    "learning_rate": 1e-4, "class_balanced": True, "cnn_learning_rate_scale": 0.01}


def run(r: FragmentRecipe, typed: dict | None = None, flagfile: str | None = None) -> dict:
    """Runs one table row (in `r.run_dir`, else ``runs/<flagfile stem>``); returns the results record."""
    start = time.time()
    row_name = r.row_name or "fragments"
    run_dir = pathlib.Path(r.run_dir) if r.run_dir else table_runner.run_folder(None, flagfile, row_name)
    data = load_data(r)
    splits, images, text = data.splits, data.images, data.text
    evaluation = splits[r.eval_split]
    protocol = resolve_protocol(r, evaluation.num_images, split=f"the {r.eval_split} split")
    saved = {"typed_flags": typed or {}, "recipe": r.to_dict()}     # the recipe after its protocol is resolved
    record = {"row": row_name, "system": "fragments", "task": "fragments", "dataset": str(data.source), **saved,
              "run_dir": str(run_dir),
              "paper": paper_numbers(r.paper_results), "paper_dataset": r.paper_dataset,
              "paper_protocol": r.paper_protocol, "num_train_images": splits["train"].num_images,
              "num_eval_images": evaluation.num_images, "num_eval_captions": evaluation.num_captions,
              **split_record(protocol, evaluation),
              "fragments": text.stats, "stages": []}
    random_metrics = retrieval.random_baseline_metrics(evaluation.num_images, evaluation.caption_image,
                                                       protocol=r.protocol, seed=r.seed)
    if r.random_ranking:
        record.update(metrics=random_metrics, random_baseline=random_metrics, seconds=time.time() - start)
        write_json(r.out_json or run_dir / "results.json", record)
        return record
    config = build_config(r, images, text)
    strategy = setup_training(r)
    with strategy.scope():
        model = build_fragment_model(config, text.word_vectors.vectors)
    if config.image_head_dim:
        kernel, bias = images["train"].head
        model.image_head.set_weights([kernel, bias])
    if r.init_from:
        record["init_from"] = initial_weights(model, r.init_from)
    train_inputs = image_inputs(images["train"], config)
    train_text = text.splits["train"]
    sentences = fragment_batches.padded_sentence_arrays(train_text.relation, train_text.word1, train_text.word2,
                                                        train_text.row_splits)
    steps = r.steps_per_epoch or fragment_batches.steps_per_epoch(splits["train"].num_captions, r.batch_size)
    for stage, first, end in stage_epochs(r):
        stage_dir = run_dir / f"stage{stage}"
        with strategy.scope():
            model.mil.assign(r.mil and stage == 2)
            if model.image_head is not None:
                model.image_head.trainable = stage == 2
            optimizer = keras.optimizers.SGD(stage_learning_rate(r, steps, first, end), momentum=r.momentum)
            model.compile(optimizer=optimizer, jit_compile=r.jit_compile, run_eagerly=r.run_eagerly)
        tcfg = train_config(r, epochs=end, learning_rate=r.learning_rate, seed=r.seed + stage,
                                   optimizer="sgd")

        def dataset(start_step=0, stage=stage):
            return fragment_batches.train_dataset(train_inputs, images["train"].mask, sentences,
                                                  splits["train"].caption_image, batch_size=r.batch_size,
                                                  seed=r.seed + stage, start_step=start_step)

        trainer.prepare_run_dir(stage_dir, {"model": config.to_dict(), "train": tcfg.__dict__, **saved,
                                            "stage": stage, "task": "fragments"})
        model.save_config(stage_dir / config.FILE_NAME, relations=text.relations,
                          words=text.word_vectors.words, stage=stage)
        stage_start = time.time()
        history = trainer.train(model, dataset, tcfg, stage_dir, steps_per_epoch=steps, initial_epoch=first,
                                epochs=end)
        metrics = model.evaluate(evaluation_split(r, data, config))
        logging.info("%s - stage %d: %s", row_name, stage, {k: round(v, 2) for k, v in metrics.items()})
        record["stages"].append({"stage": stage, "epochs": [first, end], "mil": bool(model.mil.numpy()),
                                 "cnn_trained": bool(model.image_head is not None and stage == 2),
                                 "steps_per_epoch": steps, "optimizer_steps": int(model.optimizer.iterations.numpy()),
                                 "history": {k: [float(x) for x in v] for k, v in history.history.items()},
                                 "metrics": metrics, "seconds": time.time() - stage_start,
                                 "run_dir": str(stage_dir)})
    record["metrics"] = record["stages"][-1]["metrics"]
    record["random_baseline"] = random_metrics
    record["grounding"] = grounding(r, data, model)
    if r.export and config.representation == "fragments" and is_chief():
        # JPEG bytes + boxes in where the row's CNN is known (its feature inputs stay beside them).
        cnn, note = serving_image_cnn(r, data, config)
        if note:
            logging.info("export: %s", note)
        record["export_dir"] = str(export_fragment_model(
            model, run_dir / "export", relations=text.relations, words=text.word_vectors.words, image_cnn=cnn,
            run_config={"model": config.to_dict(), **saved, "export_notes": [note] if note else []}))
    record["seconds"] = time.time() - start
    write_json(r.out_json or run_dir / "results.json", record)
    return record
