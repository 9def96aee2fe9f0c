"""Dual-path CNN with instance loss (Zheng et al.): the row recipe, its data (the dual path's
splits, word vectors, the embedded data's scene-CNN stand-in), the model configuration, the two
training stages, the evaluation (retrieval + separability S with its histogram) and the table.
`experiments.dual_path` turns its flags into a `DualPathRecipe` and calls `run`.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time

import keras
import numpy as np
from absl import logging

from tf_twobranch import table_runner
from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.systems.dual_path import data as dual_path_data
from tf_twobranch.systems.dual_path.data import check_num_classes
from tf_twobranch.data.embedded import load_embedded_dataset
from tf_twobranch.data.embedded_pedes import ANNOTATION_NAME, load_embedded_pedes
from tf_twobranch.data.formats.word_vectors import WordVectors, load_word_vectors, save_word_vectors
from tf_twobranch.data.from_flags import dataset_folder, dataset_from_flags, split_limit
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.data.text_codes import initial_word_matrix
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.systems.dual_path import separability
from tf_twobranch.systems.dual_path.export import export_dual_path
from tf_twobranch.features import FEATURE_SEED
from tf_twobranch.features.images import load_images_at_size
from tf_twobranch.features.scene_cnn import save_scene_cnn, train_scene_cnn
from tf_twobranch.features.word_vectors import train_word_vectors
from tf_twobranch.figures.titles import dual_path_stage_title
from tf_twobranch.systems.dual_path.model import DualPathConfig, DualPathModel, retrieval_metrics
from tf_twobranch.run_records import is_chief, run_record, setup_training, train_config, write_results
from tf_twobranch.recipes import (RunRecipe, apply_profile, apply_smoke, caption_format_field,
                                  eval_split_field, flag, images_dir_field, max_images_field, momentum_field,
                                  paper_dataset_field, word_vectors_field)
from tf_twobranch.systems.dual_path.run_split import dual_path_test_split, record_dual_path_split
from tf_twobranch.systems.dual_path import sampling as dp
from tf_twobranch.tables import (CHANCE_ROW, format_cell, format_retrieval_table, is_smoke, paper_beside_record,
                                 paper_numbers, resolve_protocol, split_record, table_title)
from tf_twobranch.training import trainer
from tf_twobranch.training.in_place_sgd import InPlaceSGD
from tf_twobranch.vectors import l2_normalize_rows

# The embedded scenes are 96-pixel JPEGs with a ~130-word vocabulary and
# ambiguous captions. The profile keeps the paper's structure (pretrained
# image CNN + FC head, 3-4-6-3 text CNN, shared W_share, two stages) at a size
# a 2-core CPU trains in minutes:
# * image CNN: the scene CNN pretrained on the training images' caption words
#   (`pretrained_scene_cnn`), the stand-in for ImageNet weights — a frozen,
#   randomly initialised ResNet-50 left Stage I at chance (measured);
# * text CNN of width 16 (64 → 1024 channels instead of 256 → 2048), 64-d word
#   vectors (the PPMI-SVD stand-in for word2vec cannot have 300 dimensions on
#   a 130-word vocabulary), 512-d features;
# * every training image (2,500 = classes, as the paper takes every training
#   image of Flickr30K as a class and as the other systems train on all
#   2,500): an epoch is 78 steps. The profile had 500 images (15 steps an
#   epoch): at the leaderboard's 60 + 15 epochs (900 Stage I steps) the text
#   branch learnt next to nothing (training text accuracy 1 %, text instance
#   loss 5.36 against ln 500 = 6.21) and Stage I/II sat at rsum 7.5/8.7 on the
#   1,000 test images (chance 2.5); with all 2,500 images and the same 60
#   Stage I epochs (4,680 steps) Stage I reaches rsum 55.9 (BUILD_NOTES.md).
#   The cost: 5x the steps of an epoch;
# * Adam instead of SGD (SGD at 0.1 diverged, at 0.01 barely moved in the
#   epochs affordable here) and 100 + 20 epochs (7,800 + 1,560 steps; the text
#   CNN, trained from scratch, needs thousands of steps; the paper runs Stage I
#   for 240 epochs); dropout 0.25.
EMBEDDED_PROFILE = {"image_backbone": "scene_cnn", "image_size": 96, "resize_to": 104,
                    "text_width": 16, "hidden_dim": 512, "embed_dim": 512,
                    "max_train_images": 0, "stage1_epochs": 100, "stage2_epochs": 20,
                    "optimizer": "adam", "stage1_learning_rate": 0.002,
                    "stage2_learning_rate": 0.0005, "dropout": 0.25, "word_dim": 64}
# CUHK-PEDES layout (334 identities): its earlier profile, unchanged (500 images, 200 + 40 epochs).
PEDES_EMBEDDED_PROFILE = {**EMBEDDED_PROFILE, "max_train_images": 500, "stage1_epochs": 200,
                          "stage2_epochs": 40, "max_len": 32}



@dataclasses.dataclass
class DualPathRecipe(RunRecipe):
    """One dual-path row (fields: the flags of experiments.dual_path)."""
    # Where this experiment words a shared flag's help its own way.
    FLAG_HELP = {
        "export": "Export the image and text towers as a SavedModel.",
        "paper_results": "Paper numbers: R@1,R@5,R@10 image query then text query (pedes: text query only)."}
    # --smoke: one epoch per stage on 32 training images (= classes).
    SMOKE_CAPS = {"stage1_epochs": 1, "stage2_epochs": 1, "max_train_images": 32, "max_test_images": 50}

    dataset_kind: str = flag(
        'retrieval', "retrieval: Flickr30K / MSCOCO / embedded scenes (one class per image); pedes: CUHK-PEDES "
        "reid_raw.json (one class per identity, text->image).", enum=("retrieval", "pedes"))
    dataset_dir: str = flag(
        '', "Dataset folder (retrieval) or folder of reid_raw.json (pedes); empty: the embedded dataset.")
    caption_format: str = caption_format_field()
    images_dir: str = images_dir_field()
    max_train_images: int = max_images_field("training")
    max_test_images: int = max_images_field("test")
    eval_split: str = eval_split_field()
    long_captions: str = flag(
        'error', "Captions longer than --max_len: error, or clip the final words (the paper).",
        enum=("error", "clip"))
    num_classes: int = flag(
        0, "Instance classes; 0 = from the data (a set value must match the data).", lower_bound=0)
    word_vectors: str = word_vectors_field()
    word_dim: int = flag(
        300, "Word embedding size (the text CNN's first layer; vectors trained on the captions get this "
        "size).", lower_bound=2)
    word_init: str = flag(
        'word2vec', "First text layer: word2vec-initialised or random (Table 5).",
        enum=("word2vec", "random"))
    max_len: int = flag(32, "Text input length (56 for CUHK-PEDES).", lower_bound=1)
    text_shift: str = flag(
        'position_shift', "Training-time text placement (Table 6).", enum=("position_shift", "left_align"))
    test_text_shift: str = flag(
        'left_align', "Test-time text: left-aligned, or the reference's mean over all shifts.",
        enum=("left_align", "all_shifts"))
    image_backbone: str = flag(
        'resnet50', "Image CNN (scene_cnn: the embedded data's pretrained stand-in).",
        enum=("resnet50", "vgg19", "vgg16", "resnet152", "scene_cnn"))
    image_weights: str = flag('', "Local ImageNet weights file of the backbone.")
    image_size: int = flag(224, "Training crop size.", lower_bound=32)
    resize_to: int = flag(256, "Shorter image side before cropping.", lower_bound=32)
    text_layout: str = flag(
        'paper', "Text CNN: paper (3-4-6-3, same padding) or reference (3-4-6-1, causal).",
        enum=("paper", "reference"))
    head_layout: str = flag('paper', "FC head layout.", enum=("paper", "reference"))
    text_blocks: list = flag(
        default_factory=lambda: [], help="Blocks per text CNN stage (empty: the layout's, 3,4,6,3 / 3,4,6,1; 3,8,36,3 = "
        "ResNet-152-like, Table 3).")
    text_width: int = flag(64, "Text CNN base width (64 = ResNet-50).", lower_bound=1)
    hidden_dim: int = flag(2048, "Hidden FC size of the heads.", lower_bound=1)
    embed_dim: int = flag(2048, "Feature size f_img / f_text.", lower_bound=1)
    dropout: float = flag(0.75, "Dropout rate before W_share.", lower_bound=0.0, upper_bound=0.99)
    margin: float = flag(1.0, "Ranking loss margin alpha.", lower_bound=0.0)
    ranking_negatives: str = flag(
        'in_batch', "Negatives of the ranking loss.", enum=("in_batch", "hardest", "reference"))
    num_negative_captions: int = flag(
        0, "Random negative captions per batch (reference: 256 with ranking_negatives=reference).",
        lower_bound=0)
    stages: list = flag(default_factory=lambda: ['1', '2'], help="Stages to run, in order.")
    init_from: str = flag('', "Run directory (or .weights.h5) whose weights start the first stage run here.")
    batch_size: int = flag(32, "Images (each with one caption) per batch.", lower_bound=2)
    stage1_epochs: int = flag(10, "Epochs of Stage 1.", lower_bound=1)
    stage1_learning_rate: float = flag(0.001, "SGD learning rate of Stage 1.", lower_bound=0.0)
    stage1_lambdas: list = flag(
        default_factory=lambda: ['0', '1', '1'], help="lambda_rank, lambda_image, lambda_text of Stage 1.")
    stage2_epochs: int = flag(10, "Epochs of Stage 2.", lower_bound=1)
    stage2_learning_rate: float = flag(0.001, "SGD learning rate of Stage 2.", lower_bound=0.0)
    stage2_lambdas: list = flag(
        default_factory=lambda: ['1', '1', '1'], help="lambda_rank, lambda_image, lambda_text of Stage 2.")
    optimizer: str = flag(
        'sgd', "sgd: SGD with momentum (the paper and the reference); adam: Adam (embedded profile).",
        enum=("sgd", "adam"))
    momentum: float = momentum_field()
    nesterov: bool = flag(False, "Nesterov momentum (the reference).")
    weight_decay: float = flag(0.0, "Weight decay (reference: 1e-4).", lower_bound=0.0)
    protocol: str = flag(
        'full', "Evaluation protocol (retrieval datasets).", enum=("full", "coco_1k", "coco_5k"))
    paper_dataset: str = paper_dataset_field("Flickr30K")

def _lambdas(values, name) -> tuple[float, float, float]:
    try:
        out = tuple(float(v) for v in values)
    except ValueError:
        raise UserInputError(f"--{name} must be three numbers, got {values}") from None
    if len(out) != 3 or min(out) < 0:
        raise UserInputError(f"--{name} must be three non-negative numbers, got {values}")
    return out


def _stages(values) -> list[int]:
    stages = []
    for v in values:
        if v not in ("1", "2"):
            raise UserInputError(f"--stages must list 1 and/or 2, got {values}")
        stages.append(int(v))
    return stages


def check_dataset_dir(r) -> None:
    """A missing --dataset_dir is the first error reported, before word vectors or weights
    (CUHK-PEDES: the folder of reid_raw.json, or the json file itself)."""
    if r.dataset_dir:
        dataset_folder(r.dataset_dir, allow_file=r.dataset_kind == "pedes")


def dataset_layout(r):
    """(the dataset as given, its layout): --dataset_dir or the embedded data, resolved once.

    CUHK-PEDES (--dataset_kind=pedes): --dataset_dir is the folder of
    reid_raw.json or the file itself.
    """
    if r.dataset_kind == "pedes":
        folder = dataset_folder(r.dataset_dir, allow_file=True) if r.dataset_dir else load_embedded_pedes()
        source = folder / ANNOTATION_NAME if folder.is_dir() else folder
        return source, resolve_dataset(source.parent, caption_format="cuhk_pedes", captions_path=source,
                                       images_dir=r.images_dir or None)
    return dataset_from_flags(r.dataset_dir, with_proposals=False, caption_format=r.caption_format,
                              images_dir=r.images_dir)


def load_data(r, run_dir: pathlib.Path):
    """The dataset as given, its layout, the train and evaluation splits (DualPathData) and the
    word vectors used."""
    check_dataset_dir(r)
    source, layout = dataset_layout(r)

    def split(name, vocabulary=None, word_vectors=None):
        return dual_path_data.dual_path_data(
            layout, name, dataset_kind=r.dataset_kind, vocabulary=vocabulary,
            word_vectors=word_vectors, max_len=r.max_len, long_captions=r.long_captions,
            max_images=_limit(r, name))

    word_vectors = None
    if r.word_init == "word2vec":
        if r.word_vectors:
            word_vectors = r.word_vectors
        elif r.dataset_dir:
            raise UserInputError(
                "--word_init=word2vec needs --word_vectors=<local word2vec file> (e.g. "
                "GoogleNews-vectors-negative300.bin); nothing is downloaded. Pass "
                "--word_init=random to start the text CNN from random word vectors.")
        else:
            # The embedded data has no word2vec file: train the stand-in on the
            # training captions and save it in word2vec format, so the run uses
            # exactly the file-based path a user's GoogleNews file takes.
            first = split("train")
            tokens = [tokenize_caption(c) for c in first.captions]
            path = run_dir / "word_vectors.bin"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                vectors = train_word_vectors(tokens, dim=r.word_dim, seed=FEATURE_SEED)
                # PPMI-SVD rows (U·sqrt(S)) have norms spanning orders of
                # magnitude with word frequency, unlike word2vec's; unit rows
                # keep the directions (measured: rsum 23.5 → 24.5; random
                # init still does better here, 36.2 — BUILD_NOTES.md).
                vectors = WordVectors(vectors.words, l2_normalize_rows(vectors.vectors, epsilon=1e-8))
                save_word_vectors(path, vectors)
            logging.info("embedded data: word vectors trained on the training captions -> %s", path)
            word_vectors = str(path)
    train = split("train", word_vectors=word_vectors)
    evaluation = split(r.eval_split, vocabulary=train.vocabulary)
    return source, layout, train, evaluation, word_vectors


def _limit(r, split_name):
    return split_limit(split_name, r.max_train_images, r.max_test_images)


def pretrained_scene_cnn(r, train) -> str:
    """The embedded data's stand-in for an ImageNet backbone, trained once and cached.

    No ImageNet weights can be downloaded, and a frozen randomly initialised
    ResNet-50 gives Stage I nothing to build on (measured: retrieval at
    chance after Stage I). As ImageNet pretraining precedes the paper's Stage
    I, the scene CNN (`tf_twobranch.features.scene_cnn`) is pretrained on the
    training images' caption words (image tags) and saved as a local
    ``.keras`` file, then loaded like any local weights file; Stage I freezes
    it and Stage II fine-tunes it.
    """
    key = f"dual_path_scene_cnn_{r.dataset_kind}_seed{FEATURE_SEED}_{train.num_images}"
    path = load_embedded_dataset(with_proposals=False) / "features" / key / "scene_cnn.keras"
    if path.exists():
        return str(path)
    # Square images of one size (the embedded data, 96x96) are used as they
    # are; images of mixed sizes are resized to --image_size, the input side
    # the dual path model will build the backbone with.
    images = load_images_at_size(train.image_paths, default_size=r.image_size)
    tokens = [[] for _ in range(train.num_images)]
    for caption, image in zip(train.captions, train.caption_image):
        tokens[image].append(tokenize_caption(caption))
    logging.info("pretraining the scene CNN on %d training images (cached at %s)",
                 len(images), path)
    save_scene_cnn(train_scene_cnn(images, tokens, seed=FEATURE_SEED), path)
    return str(path)


def _word_matrix(train, word_vectors, dim, seed):
    if word_vectors is None:
        return None
    vectors = load_word_vectors(word_vectors, vocabulary=set(train.vocabulary))
    if vectors.dim != dim:
        raise UserInputError(f"{word_vectors}: word vectors have {vectors.dim} dimensions "
                                    f"but --word_dim={dim}")
    return initial_word_matrix(train.vocabulary, vectors, dim=dim, seed=seed)


def _text_blocks(values):
    if not values:
        return None
    try:
        blocks = tuple(int(v) for v in values)
    except ValueError:
        raise UserInputError(f"--text_blocks must be integers, got {values}") from None
    if min(blocks) < 1:
        raise UserInputError(f"--text_blocks must be positive, got {values}")
    return blocks


def build_config(r, train):
    num_classes = r.num_classes or train.num_classes
    check_num_classes(train, num_classes)
    return DualPathConfig(
        vocabulary_size=len(train.vocabulary), num_classes=num_classes,
        image_backbone=r.image_backbone, image_size=r.image_size,
        image_weights=r.image_weights or None, text_layout=r.text_layout,
        head_layout=r.head_layout, text_width=r.text_width, max_len=r.max_len,
        text_blocks=_text_blocks(r.text_blocks),
        word_dim=r.word_dim, hidden_dim=r.hidden_dim, embed_dim=r.embed_dim, dropout=r.dropout,
        margin=r.margin, ranking_negatives=r.ranking_negatives, stage=1)


def _initial_weights(model, path: str, num_classes: int) -> str:
    """Loads --init_from (a run/stage directory or a weights file) into `model`."""
    p = pathlib.Path(path)
    candidates = [p] if p.suffix == ".h5" else [
        p / "checkpoints" / "latest.weights.h5", p / "stage2" / "checkpoints" / "latest.weights.h5",
        p / "stage1" / "checkpoints" / "latest.weights.h5"]
    weights = next((c for c in candidates if c.is_file()), None)
    if weights is None:
        raise UserInputError(f"--init_from={path}: no checkpoint found (looked for "
                                    f"{', '.join(map(str, candidates))})")
    load_checkpoint(model, weights, expected=f"the same architecture and the same number of classes "
                                         f"({num_classes})")
    return str(weights)


def evaluate(r, model, split, evaluation, out_dir: pathlib.Path, title: str) -> dict:
    """Retrieval metrics (what `model.evaluate(split)` returns) + separability S and its histogram PNG."""
    image_embeds, text_embeds = model.retrieval_embeddings(split)
    metrics = retrieval_metrics(split, image_embeds, text_embeds)
    histograms = separability.pair_similarity_histograms(image_embeds, text_embeds, split.caption_image)
    png = out_dir / "similarity_histogram.png"
    metrics["separability_S"] = separability.plot_similarity_histograms(histograms, png, title=title)
    metrics["mean_positive_similarity"] = histograms.mean_positive
    metrics["mean_negative_similarity"] = histograms.mean_negative
    logging.info("%s: %s (histogram %s)", title, {k: round(v, 3) for k, v in metrics.items()}, png)
    metrics["random_baseline"] = _random_baseline(r, evaluation)
    return metrics


def _random_baseline(r, evaluation) -> dict:
    """Random embeddings ranked by the same core and protocol: the chance level."""
    if r.dataset_kind != "pedes":
        return retrieval.random_baseline_metrics(evaluation.num_images, evaluation.caption_image,
                                                 protocol=r.protocol, seed=r.seed)
    rng = np.random.default_rng(r.seed)
    images = rng.normal(size=(evaluation.num_images, 64)).astype(np.float32)
    texts = rng.normal(size=(evaluation.num_captions, 64)).astype(np.float32)
    ranks = retrieval.group_ranks(texts, images, evaluation.image_class[evaluation.caption_image],
                                  evaluation.image_class)
    return retrieval.metrics_from_ranks(ranks, prefix="t2i_")


def run(r: DualPathRecipe, typed: dict | None = None, flagfile: str | None = None) -> dict:
    """Runs one table row; returns the results record (also written as JSON).

    `typed`: the fields the user set (the embedded profile fills in only the others);
    `flagfile`: the row's flagfile, which names its run folder when `r.run_dir` is empty.
    """
    start = time.time()
    r = dataclasses.replace(r)
    check_dataset_dir(r)
    profile = PEDES_EMBEDDED_PROFILE if r.dataset_kind == "pedes" else EMBEDDED_PROFILE
    r, applied = apply_profile(r, typed or {}, profile)
    r, smoke = apply_smoke(r)
    if smoke:
        logging.info("--smoke: %s", smoke)
    if not r.dataset_dir and not r.image_weights and r.image_backbone != "scene_cnn":
        # A row names the paper's backbone; on the embedded data without a
        # local ImageNet file it would be a frozen random network.
        logging.warning("embedded dataset without --image_weights: using the pretrained scene "
                        "CNN stand-in instead of a randomly initialised %s", r.image_backbone)
        r.image_backbone = "scene_cnn"
        applied["image_backbone"] = "scene_cnn"
    if applied:
        logging.info("embedded dataset: using its profile defaults %s", applied)
    stages = _stages(r.stages)
    lambdas = {s: _lambdas(getattr(r, f"stage{s}_lambdas"), f"stage{s}_lambdas") for s in (1, 2)}
    row_name = r.row_name or "dual_path"
    run_dir = pathlib.Path(r.run_dir) if r.run_dir else table_runner.run_folder(None, flagfile, row_name)
    source, layout, train, evaluation, word_vectors = load_data(r, run_dir)
    check_num_classes(train, r.num_classes or train.num_classes)   # before any pretraining, not after it
    protocol = resolve_protocol(r, evaluation.num_images, split=f"the {r.eval_split} split")
    # How the evaluation split is made, recorded for load_run, which rebuilds it the same way.
    evaluation_record = record_dual_path_split(
        layout, split=r.eval_split, dataset_kind=r.dataset_kind, max_len=r.max_len,
        long_captions=r.long_captions, max_images=_limit(r, r.eval_split), resize_to=r.resize_to,
        crop_size=r.image_size, text_shift=r.test_text_shift, protocol=r.protocol)
    split = dual_path_test_split(evaluation_record, evaluation)
    if r.image_backbone == "scene_cnn" and not r.image_weights:
        if r.dataset_dir:
            raise UserInputError("--image_backbone=scene_cnn needs --image_weights=<a "
                                        ".keras file written by save_scene_cnn>")
        r.image_weights = pretrained_scene_cnn(r, train)
    config = build_config(r, train)
    matrix = _word_matrix(train, word_vectors, r.word_dim, r.seed)
    strategy = setup_training(r)
    with strategy.scope():
        model = DualPathModel(config, matrix).build_all()
    record = {"row": row_name, "system": "dual_path", "task": "dual_path", "dataset": str(source),
              "dataset_kind": r.dataset_kind, "run_dir": str(run_dir),
              **run_record(r, typed), "paper": paper_numbers(r.paper_results),
              "paper_dataset": r.paper_dataset, "paper_protocol": r.paper_protocol,
              **split_record(protocol, evaluation), "num_train_images": train.num_images,
              "num_classes": config.num_classes, "vocabulary_size": config.vocabulary_size,
              "num_eval_images": evaluation.num_images,
              "num_eval_captions": evaluation.num_captions, "stages": [],
              "evaluation": evaluation_record}
    if not r.image_weights:
        record["note"] = ("image backbone randomly initialised (no --image_weights): "
                          "not ImageNet features")
    if r.init_from:
        record["init_from"] = _initial_weights(model, r.init_from, config.num_classes)

    for stage in stages:
        stage_dir = run_dir / f"stage{stage}"
        config.lambda_rank, config.lambda_image, config.lambda_text = lambdas[stage]
        with strategy.scope():
            model.set_stage(stage)
            model.lambdas = lambdas[stage]
            lr = getattr(r, f"stage{stage}_learning_rate")
            if r.optimizer == "adam":
                optimizer = keras.optimizers.Adam(lr, weight_decay=r.weight_decay or None)
            else:
                # Keras' SGD values; its momentum update in place: W_share's temporaries
                # (one class per training image) would otherwise grow with the dataset
                optimizer = InPlaceSGD(lr, momentum=r.momentum, nesterov=r.nesterov,
                                       weight_decay=r.weight_decay or None)
            model.compile(optimizer=optimizer, jit_compile=r.jit_compile,
                          run_eagerly=r.run_eagerly)
        tcfg = train_config(r, epochs=getattr(r, f"stage{stage}_epochs"),
                                   learning_rate=getattr(r, f"stage{stage}_learning_rate"),
                                   seed=r.seed + stage, optimizer=r.optimizer)
        steps = dp.steps_per_epoch(train, r.batch_size)

        def dataset(start_step=0, stage=stage):
            # Each replica loads its rows of every global batch; a function of
            # the start step so a preempted run resumes mid-epoch.
            return dp.distributed_train_dataset(
                strategy, train, batch_size=r.batch_size, resize_to=r.resize_to,
                crop_size=r.image_size, seed=r.seed + stage, text_shift=r.text_shift,
                num_negative_captions=r.num_negative_captions, start_step=start_step)

        run_config = {"model": config.to_dict(), "train": tcfg.__dict__,
                      **run_record(r, typed), "stage": stage, "task": "dual_path",
                      "vocabulary": train.vocabulary}
        trainer.prepare_run_dir(stage_dir, run_config)
        model.save_config(stage_dir / config.FILE_NAME, vocabulary=train.vocabulary, stage=stage)
        stage_start = time.time()
        history = trainer.train(model, dataset, tcfg, stage_dir, steps_per_epoch=steps)
        title = dual_path_stage_title(row_name, stage, r.image_backbone, r.image_weights)
        metrics = evaluate(r, model, split, evaluation, stage_dir, title)
        record["stages"].append({
            "stage": stage, "epochs": tcfg.epochs, "lambdas": list(lambdas[stage]),
            "history": {k: [float(x) for x in v] for k, v in history.history.items()},
            "metrics": metrics, "seconds": time.time() - stage_start,
            "run_dir": str(stage_dir)})
    record["metrics"] = record["stages"][-1]["metrics"] if record["stages"] else {}
    if r.export and record["stages"] and is_chief():
        record["export_dir"] = str(export_dual_path(
            model, train.vocabulary, run_dir / "export", resize_to=r.resize_to,
            run_config={"model": config.to_dict(), **run_record(r, typed)}))
    record["seconds"] = time.time() - start
    write_results(r.out_json or run_dir / "results.json", record)
    return record


def format_record(record: dict) -> str:
    paper = paper_beside_record(record, num_test_images=record["num_eval_images"])
    smoke = is_smoke(record)
    if record["dataset_kind"] == "pedes":
        title = table_title(
            "Person search (text query)", protocol=record["protocol"], num_images=record["num_eval_images"],
            num_captions=record["num_eval_captions"], paper=record["paper"],
            paper_dataset=record["paper_dataset"], paper_protocol=record["paper_protocol"], smoke=smoke)
        names = [f"{record['row']} - Stage {st['stage']}" for st in record["stages"]]
        w = max([len(n) for n in names] + [len(CHANCE_ROW), 40])   # every row's cells in one column
        lines = [title, f"{'Method':{w}} |   R@1    R@5   R@10  med r |     S"]
        for name, st in zip(names, record["stages"]):
            m = st["metrics"]
            lines.append(f"{name:{w}} | "
                         f"{m['t2i_r1']:5.1f}  {m['t2i_r5']:5.1f}  {m['t2i_r10']:5.1f}  "
                         f"{m['t2i_medr']:5.0f} | {m['separability_S']:.3f}")
        if paper:
            lines.append(f"{'  (paper)':{w}} | " + "  ".join(format_cell(v, 5) for v in paper))
        if record["stages"]:
            c = record["stages"][-1]["metrics"]["random_baseline"]
            lines.append(f"{CHANCE_ROW:{w}} | {c['t2i_r1']:5.1f}  {c['t2i_r5']:5.1f}  "
                         f"{c['t2i_r10']:5.1f}  {c['t2i_medr']:5.0f} |")
        return "\n".join(lines)
    rows = [{"name": f"{record['row']} - Stage {st['stage']}", "metrics": st["metrics"],
             "paper": paper if i == len(record["stages"]) - 1 else None}
            for i, st in enumerate(record["stages"])]
    table = format_retrieval_table(
        table_title("Dual-path CNN", protocol=record["protocol"], num_images=record["num_eval_images"],
                           num_captions=record["num_eval_captions"], paper=record["paper"],
                           paper_dataset=record["paper_dataset"], paper_protocol=record["paper_protocol"],
                           smoke=smoke),
        rows, chance=record["stages"][-1]["metrics"]["random_baseline"] if record["stages"] else None)
    s_values = ", ".join(f"Stage {st['stage']}: S = {st['metrics']['separability_S']:.4f}"
                         for st in record["stages"])
    return f"{table}\nseparability (eq. 10): {s_values}"


