r"""Dual-path CNN with instance loss (Zheng et al.): Tables 1, 2, 5, 6, 7, 8.

    python -m experiments.instance_loss --flagfile=experiments/configs/zheng_table2_full_model.cfg

Trains from raw pixels and words: Stage I (instance loss only, image
backbone frozen) then Stage II (everything fine-tuned, ranking + instance
loss), each stage in its own run directory (``<run_dir>/stage1``,
``<run_dir>/stage2``) with checkpoints, backups and TensorBoard logs;
``--init_from`` starts a stage from another run's checkpoint.  Evaluates with
the shared retrieval core (cosine, image averaged with its flip), computes
the separability indicator S with its histogram PNG (Fig. 5), and exports
the image tower (JPEG bytes in) and the text tower (raw strings in).

With no --dataset_dir the embedded digit scenes are used (CUHK-PEDES layout
derived from them with --dataset_kind=pedes), with the small profile below.
"""
from __future__ import annotations

import pathlib
import time

import keras
import numpy as np
from absl import app, flags, logging

from experiments import common
from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.data import dual_path_data
from tf_twobranch.data.dual_path_data import check_num_classes
from tf_twobranch.data.embedded import load_embedded_dataset
from tf_twobranch.data.embedded_pedes import ANNOTATION_NAME, load_embedded_pedes
from tf_twobranch.data.formats.word_vectors import WordVectors, load_word_vectors, save_word_vectors
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.data.text_codes import initial_word_matrix
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.evaluation import retrieval, separability
from tf_twobranch.export.dual_path import export_dual_path
from tf_twobranch.features.images import load_images_at_size
from tf_twobranch.features.scene_cnn import save_scene_cnn, train_scene_cnn
from tf_twobranch.features.word_vectors import train_word_vectors
from tf_twobranch.models.dual_path import (DualPathConfig, DualPathModel, retrieval_metrics,
                                           save_dual_path_config)
from tf_twobranch.runs import dual_path_test_split, record_dual_path_split
from tf_twobranch.sampling import dual_path as dp
from tf_twobranch.training import trainer
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
#   a 130-word vocabulary), 512-d features, 500 training images (= classes);
# * Adam instead of SGD (SGD at 0.1 diverged, at 0.01 barely moved in the
#   epochs affordable here) and 200 + 40 epochs: an epoch has only 15 steps
#   (one caption per image), and the text CNN, trained from scratch, needs
#   thousands of steps (the paper runs Stage I for 240 epochs); dropout 0.25.
EMBEDDED_PROFILE = {"image_backbone": "scene_cnn", "image_size": 96, "resize_to": 104,
                    "text_width": 16, "hidden_dim": 512, "embed_dim": 512,
                    "max_train_images": 500, "stage1_epochs": 200, "stage2_epochs": 40,
                    "optimizer": "adam", "stage1_learning_rate": 0.002,
                    "stage2_learning_rate": 0.0005, "dropout": 0.25, "word_dim": 64}
PEDES_EMBEDDED_PROFILE = {**EMBEDDED_PROFILE, "max_len": 32}


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    # Data.
    flags.DEFINE_enum("dataset_kind", "retrieval", ["retrieval", "pedes"],
                      "retrieval: Flickr30K / MSCOCO / embedded scenes (one class per image); "
                      "pedes: CUHK-PEDES reid_raw.json (one class per identity, text->image).",
                      **d)
    common.define_data_flags(fv, dataset_help="Dataset folder (retrieval) or folder of "
                             "reid_raw.json (pedes); empty: the embedded dataset.",
                             caption_formats=["auto", "karpathy", "token", "coco"], limit_images=True)
    flags.DEFINE_enum("eval_split", "test", ["val", "test"], "Split to evaluate on.", **d)
    flags.DEFINE_enum("long_captions", "error", ["error", "clip"],
                      "Captions longer than --max_len: error, or clip the final words "
                      "(the paper).", **d)
    flags.DEFINE_integer("num_classes", 0, "Instance classes; 0 = from the data (a set value "
                         "must match the data).", lower_bound=0, **d)
    # Text.
    common.define_word_vector_flags(fv, word_dim_help="Word embedding size (the text CNN's "
                                    "first layer; vectors trained on the captions get this size).")
    flags.DEFINE_enum("word_init", "word2vec", ["word2vec", "random"],
                      "First text layer: word2vec-initialised or random (Table 5).", **d)
    flags.DEFINE_integer("max_len", 32, "Text input length (56 for CUHK-PEDES).",
                         lower_bound=1, **d)
    flags.DEFINE_enum("text_shift", "position_shift", ["position_shift", "left_align"],
                      "Training-time text placement (Table 6).", **d)
    flags.DEFINE_enum("test_text_shift", "left_align", ["left_align", "all_shifts"],
                      "Test-time text: left-aligned, or the reference's mean over all shifts.",
                      **d)
    # Model.
    flags.DEFINE_enum("image_backbone", "resnet50",
                      ["resnet50", "vgg19", "vgg16", "resnet152", "scene_cnn"],
                      "Image CNN (scene_cnn: the embedded data's pretrained stand-in).", **d)
    flags.DEFINE_string("image_weights", "", "Local ImageNet weights file of the backbone.", **d)
    flags.DEFINE_integer("image_size", 224, "Training crop size.", lower_bound=32, **d)
    flags.DEFINE_integer("resize_to", 256, "Shorter image side before cropping.",
                         lower_bound=32, **d)
    flags.DEFINE_enum("text_layout", "paper", ["paper", "reference"],
                      "Text CNN: paper (3-4-6-3, same padding) or reference (3-4-6-1, causal).",
                      **d)
    flags.DEFINE_enum("head_layout", "paper", ["paper", "reference"], "FC head layout.", **d)
    flags.DEFINE_list("text_blocks", [], "Blocks per text CNN stage (empty: the layout's, "
                      "3,4,6,3 / 3,4,6,1; 3,8,36,3 = ResNet-152-like, Table 3).", **d)
    flags.DEFINE_integer("text_width", 64, "Text CNN base width (64 = ResNet-50).",
                         lower_bound=1, **d)
    flags.DEFINE_integer("hidden_dim", 2048, "Hidden FC size of the heads.", lower_bound=1, **d)
    flags.DEFINE_integer("embed_dim", 2048, "Feature size f_img / f_text.", lower_bound=1, **d)
    flags.DEFINE_float("dropout", 0.75, "Dropout rate before W_share.", lower_bound=0.0,
                       upper_bound=0.99, **d)
    flags.DEFINE_float("margin", 1.0, "Ranking loss margin alpha.", lower_bound=0.0, **d)
    flags.DEFINE_enum("ranking_negatives", "in_batch", ["in_batch", "hardest", "reference"],
                      "Negatives of the ranking loss.", **d)
    flags.DEFINE_integer("num_negative_captions", 0, "Random negative captions per batch "
                         "(reference: 256 with ranking_negatives=reference).", lower_bound=0,
                         **d)
    # Training.
    flags.DEFINE_list("stages", ["1", "2"], "Stages to run, in order.", **d)
    flags.DEFINE_string("init_from", "", "Run directory (or .weights.h5) whose weights start "
                        "the first stage run here.", **d)
    flags.DEFINE_integer("batch_size", 32, "Images (each with one caption) per batch.",
                         lower_bound=2, **d)
    for stage, (epochs, lr, lambdas) in {1: (10, 0.001, "0,1,1"), 2: (10, 0.001, "1,1,1")}.items():
        flags.DEFINE_integer(f"stage{stage}_epochs", epochs, f"Epochs of Stage {stage}.",
                             lower_bound=1, **d)
        flags.DEFINE_float(f"stage{stage}_learning_rate", lr, f"SGD learning rate of Stage "
                           f"{stage}.", lower_bound=0.0, **d)
        flags.DEFINE_list(f"stage{stage}_lambdas", lambdas.split(","),
                          f"lambda_rank, lambda_image, lambda_text of Stage {stage}.", **d)
    flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"], "sgd: SGD with momentum (the "
                      "paper and the reference); adam: Adam (embedded profile).", **d)
    flags.DEFINE_float("momentum", 0.9, "SGD momentum.", lower_bound=0.0, upper_bound=1.0, **d)
    flags.DEFINE_bool("nesterov", False, "Nesterov momentum (the reference).", **d)
    flags.DEFINE_float("weight_decay", 0.0, "Weight decay (reference: 1e-4).", lower_bound=0.0,
                       **d)
    flags.DEFINE_enum("protocol", "full", ["full", "coco_1k", "coco_5k"],
                      "Evaluation protocol (retrieval datasets).", **d)
    flags.DEFINE_string("paper_dataset", "Flickr30K", "Dataset of the paper numbers.", **d)
    common.define_run_flags(fv, export_help="Export the image and text towers as a SavedModel.",
                            paper_results_help="Paper numbers: R@1,R@5,R@10 image query then "
                            "text query (pedes: text query only).")


def _lambdas(values, name) -> tuple[float, float, float]:
    try:
        out = tuple(float(v) for v in values)
    except ValueError:
        raise common.UserInputError(f"--{name} must be three numbers, got {values}") from None
    if len(out) != 3 or min(out) < 0:
        raise common.UserInputError(f"--{name} must be three non-negative numbers, got {values}")
    return out


def _stages(values) -> list[int]:
    stages = []
    for v in values:
        if v not in ("1", "2"):
            raise common.UserInputError(f"--stages must list 1 and/or 2, got {values}")
        stages.append(int(v))
    return stages


def check_dataset_dir(f) -> None:
    """A missing --dataset_dir is the first error reported, before word vectors or weights."""
    if not f.dataset_dir:
        return
    path = pathlib.Path(f.dataset_dir)
    if f.dataset_kind == "pedes":
        # CUHK-PEDES: the folder of reid_raw.json, or the json file itself.
        if not path.exists():
            raise common.UserInputError(f"--dataset_dir={path}: dataset folder does not exist")
    elif not path.is_dir():
        what = "is not a folder" if path.exists() else "dataset folder does not exist"
        raise common.UserInputError(f"--dataset_dir={path}: {what}")


def dataset_layout(f):
    """(the dataset as given, its layout): --dataset_dir or the embedded data, resolved once.

    CUHK-PEDES (--dataset_kind=pedes): --dataset_dir is the folder of
    reid_raw.json or the file itself.
    """
    if f.dataset_kind == "pedes":
        folder = pathlib.Path(f.dataset_dir) if f.dataset_dir else load_embedded_pedes()
        source = folder / ANNOTATION_NAME if folder.is_dir() else folder
        return source, resolve_dataset(source.parent, caption_format="cuhk_pedes", captions_path=source,
                                       images_dir=f.images_dir or None)
    source = pathlib.Path(f.dataset_dir) if f.dataset_dir else load_embedded_dataset(with_proposals=False)
    return source, resolve_dataset(source, caption_format=f.caption_format, images_dir=f.images_dir or None)


def load_data(f, run_dir: pathlib.Path):
    """The dataset as given, its layout, the train and evaluation splits (DualPathData) and the
    word vectors used."""
    check_dataset_dir(f)
    source, layout = dataset_layout(f)

    def split(name, vocabulary=None, word_vectors=None):
        return dual_path_data.dual_path_data(
            layout, name, dataset_kind=f.dataset_kind, vocabulary=vocabulary,
            word_vectors=word_vectors, max_len=f.max_len, long_captions=f.long_captions,
            max_images=_limit(f, name))

    word_vectors = None
    if f.word_init == "word2vec":
        if f.word_vectors:
            word_vectors = f.word_vectors
        elif f.dataset_dir:
            raise common.UserInputError(
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
                vectors = train_word_vectors(tokens, dim=f.word_dim, seed=f.seed)
                # PPMI-SVD rows (U·sqrt(S)) have norms spanning orders of
                # magnitude with word frequency, unlike word2vec's; unit rows
                # keep the directions (measured: rsum 23.5 → 24.5; random
                # init still does better here, 36.2 — BUILD_NOTES.md).
                vectors = WordVectors(vectors.words, l2_normalize_rows(vectors.vectors, epsilon=1e-8))
                save_word_vectors(path, vectors)
            logging.info("embedded data: word vectors trained on the training captions -> %s", path)
            word_vectors = str(path)
    train = split("train", word_vectors=word_vectors)
    evaluation = split(f.eval_split, vocabulary=train.vocabulary)
    return source, layout, train, evaluation, word_vectors


def _limit(f, split_name):
    value = f.max_train_images if split_name == "train" else f.max_test_images
    return value or None


def pretrained_scene_cnn(f, train) -> str:
    """The embedded data's stand-in for an ImageNet backbone, trained once and cached.

    No ImageNet weights can be downloaded, and a frozen randomly initialised
    ResNet-50 gives Stage I nothing to build on (measured: retrieval at
    chance after Stage I). As ImageNet pretraining precedes the paper's Stage
    I, the scene CNN (`tf_twobranch.features.scene_cnn`) is pretrained on the
    training images' caption words (image tags) and saved as a local
    ``.keras`` file, then loaded like any local weights file; Stage I freezes
    it and Stage II fine-tunes it.
    """
    key = f"dual_path_scene_cnn_{f.dataset_kind}_seed{f.seed}_{train.num_images}"
    path = load_embedded_dataset(with_proposals=False) / "features" / key / "scene_cnn.keras"
    if path.exists():
        return str(path)
    # Square images of one size (the embedded data, 96x96) are used as they
    # are; images of mixed sizes are resized to --image_size, the input side
    # the dual path model will build the backbone with.
    images = load_images_at_size(train.image_paths, default_size=f.image_size)
    tokens = [[] for _ in range(train.num_images)]
    for caption, image in zip(train.captions, train.caption_image):
        tokens[image].append(tokenize_caption(caption))
    logging.info("pretraining the scene CNN on %d training images (cached at %s)",
                 len(images), path)
    save_scene_cnn(train_scene_cnn(images, tokens, seed=f.seed), path)
    return str(path)


def _word_matrix(train, word_vectors, dim, seed):
    if word_vectors is None:
        return None
    vectors = load_word_vectors(word_vectors, vocabulary=set(train.vocabulary))
    if vectors.dim != dim:
        raise common.UserInputError(f"{word_vectors}: word vectors have {vectors.dim} dimensions "
                                    f"but --word_dim={dim}")
    return initial_word_matrix(train.vocabulary, vectors, dim=dim, seed=seed)


def _text_blocks(values):
    if not values:
        return None
    try:
        blocks = tuple(int(v) for v in values)
    except ValueError:
        raise common.UserInputError(f"--text_blocks must be integers, got {values}") from None
    if min(blocks) < 1:
        raise common.UserInputError(f"--text_blocks must be positive, got {values}")
    return blocks


def build_config(f, train):
    num_classes = f.num_classes or train.num_classes
    check_num_classes(train, num_classes)
    return DualPathConfig(
        vocabulary_size=len(train.vocabulary), num_classes=num_classes,
        image_backbone=f.image_backbone, image_size=f.image_size,
        image_weights=f.image_weights or None, text_layout=f.text_layout,
        head_layout=f.head_layout, text_width=f.text_width, max_len=f.max_len,
        text_blocks=_text_blocks(f.text_blocks),
        word_dim=f.word_dim, hidden_dim=f.hidden_dim, embed_dim=f.embed_dim, dropout=f.dropout,
        margin=f.margin, ranking_negatives=f.ranking_negatives, stage=1)


def _initial_weights(model, path: str, num_classes: int) -> str:
    """Loads --init_from (a run/stage directory or a weights file) into `model`."""
    p = pathlib.Path(path)
    candidates = [p] if p.suffix == ".h5" else [
        p / "checkpoints" / "latest.weights.h5", p / "stage2" / "checkpoints" / "latest.weights.h5",
        p / "stage1" / "checkpoints" / "latest.weights.h5"]
    weights = next((c for c in candidates if c.is_file()), None)
    if weights is None:
        raise common.UserInputError(f"--init_from={path}: no checkpoint found (looked for "
                                    f"{', '.join(map(str, candidates))})")
    load_checkpoint(model, weights, expected=f"the same architecture and the same number of classes "
                                         f"({num_classes})")
    return str(weights)


def evaluate(f, model, split, evaluation, out_dir: pathlib.Path, title: str) -> dict:
    """Retrieval metrics (what `model.evaluate(split)` returns) + separability S and its histogram PNG."""
    image_embeds, text_embeds = model.retrieval_embeddings(split)
    metrics = retrieval_metrics(split, image_embeds, text_embeds)
    positives, negatives = separability.pair_similarities(image_embeds, text_embeds,
                                                          split.caption_image, seed=f.seed)
    png = out_dir / "similarity_histogram.png"
    metrics["separability_S"] = separability.plot_similarity_histograms(
        positives, negatives, png, title=title)
    metrics["mean_positive_similarity"] = float(positives.mean())
    metrics["mean_negative_similarity"] = float(negatives.mean())
    logging.info("%s: %s (histogram %s)", title, {k: round(v, 3) for k, v in metrics.items()}, png)
    metrics["random_baseline"] = _random_baseline(f, evaluation)
    return metrics


def _random_baseline(f, evaluation) -> dict:
    """Random embeddings ranked by the same core and protocol: the chance level."""
    if f.dataset_kind != "pedes":
        return retrieval.random_baseline_metrics(evaluation.num_images, evaluation.caption_image,
                                                 protocol=f.protocol, seed=f.seed)
    rng = np.random.default_rng(f.seed)
    images = rng.normal(size=(evaluation.num_images, 64)).astype(np.float32)
    texts = rng.normal(size=(evaluation.num_captions, 64)).astype(np.float32)
    ranks = retrieval.group_ranks(texts, images, evaluation.image_class[evaluation.caption_image],
                                  evaluation.image_class)
    return retrieval.metrics_from_ranks(ranks, prefix="t2i_")


def run(f) -> dict:
    """Runs one table row; returns the results record (also written as JSON)."""
    start = time.time()
    typed = common.typed_flags(f)  # before the profile and the backbone stand-in change values
    check_dataset_dir(f)
    profile = PEDES_EMBEDDED_PROFILE if f.dataset_kind == "pedes" else EMBEDDED_PROFILE
    applied = common.apply_embedded_profile(f, profile)
    if not f.dataset_dir and not f.image_weights and f.image_backbone != "scene_cnn":
        # A row names the paper's backbone; on the embedded data without a
        # local ImageNet file it would be a frozen random network.
        logging.warning("embedded dataset without --image_weights: using the pretrained scene "
                        "CNN stand-in instead of a randomly initialised %s", f.image_backbone)
        f.image_backbone = "scene_cnn"
        applied["image_backbone"] = "scene_cnn"
    if applied:
        logging.info("embedded dataset: using its profile defaults %s", applied)
    stages = _stages(f.stages)
    lambdas = {s: _lambdas(f[f"stage{s}_lambdas"].value, f"stage{s}_lambdas") for s in (1, 2)}
    row_name = f.row_name or "instance_loss"
    run_dir = pathlib.Path(f.run_dir) if f.run_dir else common.REPO_ROOT / "runs" / common.slug(row_name)
    source, layout, train, evaluation, word_vectors = load_data(f, run_dir)
    protocol = common.resolve_protocol(f, evaluation.num_images, split=f"the {f.eval_split} split")
    # How the evaluation split is made, recorded for load_run, which rebuilds it the same way.
    evaluation_record = record_dual_path_split(
        layout, split=f.eval_split, dataset_kind=f.dataset_kind, max_len=f.max_len,
        long_captions=f.long_captions, max_images=_limit(f, f.eval_split), resize_to=f.resize_to,
        crop_size=f.image_size, text_shift=f.test_text_shift, protocol=f.protocol)
    split = dual_path_test_split(evaluation_record, evaluation)
    if f.image_backbone == "scene_cnn" and not f.image_weights:
        if f.dataset_dir:
            raise common.UserInputError("--image_backbone=scene_cnn needs --image_weights=<a "
                                        ".keras file written by save_scene_cnn>")
        f.image_weights = pretrained_scene_cnn(f, train)
    config = build_config(f, train)
    matrix = _word_matrix(train, word_vectors, f.word_dim, f.seed)
    strategy = common.setup_training(f)
    with strategy.scope():
        model = DualPathModel(config, matrix).build_all()
    record = {"row": row_name, "task": "dual_path", "dataset": str(source), "dataset_kind": f.dataset_kind,
              **common.flag_record(f, typed), "paper": common.paper_numbers(f.paper_results),
              "paper_dataset": f.paper_dataset, "paper_protocol": f.paper_protocol,
              **common.split_record(protocol, evaluation), "num_train_images": train.num_images,
              "num_classes": config.num_classes, "vocabulary_size": config.vocabulary_size,
              "num_eval_images": evaluation.num_images,
              "num_eval_captions": evaluation.num_captions, "stages": [],
              "evaluation": evaluation_record}
    if not f.image_weights:
        record["note"] = ("image backbone randomly initialised (no --image_weights): "
                          "not ImageNet features")
    if f.init_from:
        record["init_from"] = _initial_weights(model, f.init_from, config.num_classes)

    for stage in stages:
        stage_dir = run_dir / f"stage{stage}"
        config.lambda_rank, config.lambda_image, config.lambda_text = lambdas[stage]
        with strategy.scope():
            model.set_stage(stage)
            model.lambdas = lambdas[stage]
            lr = f[f"stage{stage}_learning_rate"].value
            if f.optimizer == "adam":
                optimizer = keras.optimizers.Adam(lr, weight_decay=f.weight_decay or None)
            else:
                optimizer = keras.optimizers.SGD(lr, momentum=f.momentum, nesterov=f.nesterov,
                                                 weight_decay=f.weight_decay or None)
            model.compile(optimizer=optimizer, jit_compile=f.jit_compile,
                          run_eagerly=f.run_eagerly)
        tcfg = common.train_config(f, epochs=f[f"stage{stage}_epochs"].value,
                                   learning_rate=f[f"stage{stage}_learning_rate"].value,
                                   seed=f.seed + stage, optimizer=f.optimizer)
        steps = dp.steps_per_epoch(train, f.batch_size)

        def dataset(start_step=0, stage=stage):
            # Each replica loads its rows of every global batch; a function of
            # the start step so a preempted run resumes mid-epoch.
            return dp.distributed_train_dataset(
                strategy, train, batch_size=f.batch_size, resize_to=f.resize_to,
                crop_size=f.image_size, seed=f.seed + stage, text_shift=f.text_shift,
                num_negative_captions=f.num_negative_captions, start_step=start_step)

        run_config = {"model": config.to_dict(), "train": tcfg.__dict__,
                      **common.flag_record(f, typed), "stage": stage, "task": "dual_path",
                      "vocabulary": train.vocabulary}
        trainer.prepare_run_dir(stage_dir, run_config)
        save_dual_path_config(stage_dir / "dual_path_config.json", config,
                              vocabulary=train.vocabulary, stage=stage)
        stage_start = time.time()
        history = trainer.train(model, dataset, tcfg, stage_dir, steps_per_epoch=steps)
        metrics = evaluate(f, model, split, evaluation, stage_dir, f"{row_name} - Stage {stage}")
        record["stages"].append({
            "stage": stage, "epochs": tcfg.epochs, "lambdas": list(lambdas[stage]),
            "history": {k: [float(x) for x in v] for k, v in history.history.items()},
            "metrics": metrics, "seconds": time.time() - stage_start,
            "run_dir": str(stage_dir)})
    record["metrics"] = record["stages"][-1]["metrics"] if record["stages"] else {}
    if f.export and record["stages"] and common.is_chief():
        record["export_dir"] = str(export_dual_path(
            model, train.vocabulary, run_dir / "export", resize_to=f.resize_to,
            run_config={"model": config.to_dict(), **common.flag_record(f, typed)}))
    record["seconds"] = time.time() - start
    common.write_json(f.out_json or run_dir / "results.json", record)
    return record


def format_record(record: dict) -> str:
    paper = common.paper_beside(record["paper"], record["paper_protocol"], record["protocol"],
                                record["num_eval_images"])
    if record["dataset_kind"] == "pedes":
        title = common.table_title(
            "Person search (text query)", protocol=record["protocol"], num_images=record["num_eval_images"],
            num_captions=record["num_eval_captions"], paper=record["paper"],
            paper_dataset=record["paper_dataset"], paper_protocol=record["paper_protocol"])
        lines = [title, f"{'Method':40} |   R@1    R@5   R@10  med r |     S"]
        for st in record["stages"]:
            m = st["metrics"]
            lines.append(f"{record['row'] + ' - Stage ' + str(st['stage']):40} | "
                         f"{m['t2i_r1']:5.1f}  {m['t2i_r5']:5.1f}  {m['t2i_r10']:5.1f}  "
                         f"{m['t2i_medr']:5.0f} | {m['separability_S']:.3f}")
        if paper:
            lines.append(f"{'  (paper)':40} | " + "  ".join(common.format_cell(v, 5) for v in paper))
        if record["stages"]:
            c = record["stages"][-1]["metrics"]["random_baseline"]
            lines.append(f"{common.CHANCE_ROW:40} | {c['t2i_r1']:5.1f}  {c['t2i_r5']:5.1f}  "
                         f"{c['t2i_r10']:5.1f}  {c['t2i_medr']:5.0f} |")
        return "\n".join(lines)
    rows = [{"name": f"{record['row']} - Stage {st['stage']}", "metrics": st["metrics"],
             "paper": paper if i == len(record["stages"]) - 1 else None}
            for i, st in enumerate(record["stages"])]
    table = common.format_retrieval_table(
        common.table_title("Dual-path CNN", protocol=record["protocol"], num_images=record["num_eval_images"],
                           num_captions=record["num_eval_captions"], paper=record["paper"],
                           paper_dataset=record["paper_dataset"], paper_protocol=record["paper_protocol"]),
        rows, chance=record["stages"][-1]["metrics"]["random_baseline"] if record["stages"] else None)
    s_values = ", ".join(f"Stage {st['stage']}: S = {st['metrics']['separability_S']:.4f}"
                         for st in record["stages"])
    return f"{table}\nseparability (eq. 10): {s_values}"


def _main() -> None:
    record = run(flags.FLAGS)
    print(format_record(record))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
