r"""Semi-supervised phrase localization (Das et al.): Tables 1 and 2.

    python -m experiments.npair_localization --flagfile=experiments/configs/das_table2_npair_word.cfg
    python -m experiments.npair_localization --rows=all     # every row; prints Table 2 beside the paper

A caption–image retrieval model (spatial image map × per-token caption
vectors → localization volume → S_MaxImage) is trained on captions alone
with the N-pair loss (or the triplet loss); no box is used in training. Each
row then reports retrieval through the one evaluation core (Table 1: folds
of 100 images, `--protocol`) and the pointing game on the Flickr30K
Entities phrases of the evaluation split (Table 2), in word and phrase parse
modes. Baseline rows (`--row_kind`) point at a random pixel, at the image
centre, at the maximum of the backbone map's channel mean, or use the
untrained model.

Defaults where the paper is silent are the authors' code's (LocNet): SGD
lr 1e-3 × 0.1 every 10 epochs of 100 steps, momentum 0.9, weight decay
1e-7, triplet margin 0.1, LSTM 300 → 1024, 3×3 conv 512 → 1024 + BN + ReLU
on VGG-19 ``block5_conv4`` at 224², ``<start>``/``<end>`` tokens, 20 words.
Its defects are not reproduced by default (BUILD_NOTES.md): the score's
maximum over rows only (``--aggregator=max_rows_code``), the L2 norms
computed but not applied (``--normalisation=none``), the swapped x/y of its
hit test, I_r1 = C_r1.

Memory is bounded by a batch or a chunk, not by the dataset: the backbone maps
(and, with --train_backbone, the training images) are cached as memory-mapped
row arrays (--feature_dtype=float16 halves them), training batches read their
rows by index, and the evaluation split's projected maps and token vectors are
written chunk by chunk to a temporary folder of the run, once for every
protocol and the pointing game.

With no --dataset_dir the embedded digit scenes are used (their scene CNN
and Flickr30K Entities-format phrases and boxes) with the small profile below.
"""
from __future__ import annotations

import pathlib
import tempfile
import time

import keras
from absl import app, flags, logging

from experiments import common
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.data.embedded import load_embedded_dataset
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.evaluation import localization_maps, retrieval
from tf_twobranch.evaluation.localization_retrieval import evaluate_localization_retrieval
from tf_twobranch.evaluation.pointing_game import pointing_queries
from tf_twobranch.features.prepare_npair import (NPairInputSpec, backbone_maps, caption_inputs, load_backbone_maps,
                                                 phrase_parsed_captions, spatial_backbone, split_images)
from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.json_files import read_json_object
from tf_twobranch.losses.npair import DEFAULT_TEMPERATURE
from tf_twobranch.models.npair_localization import (NPairLocalizationConfig, build_npair_model,
                                                    load_npair_config, save_npair_config)
from tf_twobranch.sampling import npair_batches
from tf_twobranch.training import trainer

# The embedded scenes: 2,500 training images of 96² (the scene CNN's last
# conv map is 6×6×128), a ~130-word vocabulary. The profile keeps the
# paper's structure (batch 64 of distinct images, N-pair over the batch,
# S_MaxImage, SGD with momentum, lr × 0.1 steps) at a size this 2-core CPU
# trains in a few minutes per row (BUILD_NOTES.md).
EMBEDDED_PROFILE = {"word_dim": 64, "embed_dim": 256, "epochs": 6, "lr_decay_epochs": 4,
                    "learning_rate": 0.01}
ROW_KINDS = ("model", "untrained", "random_point", "centre_point", "channel_mean")
BASELINE_KINDS = ("random_point", "centre_point", "channel_mean")
TABLE2_PAPER = "Table 2 (Flickr30K Entities test, pointing accuracy %)"


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    common.define_data_flags(fv, dataset_help="Dataset folder (Flickr30K with its Flickr30K Entities "
                             "Sentences/ and Annotations/, or COCO captions for retrieval only), with its "
                             "images; empty: the embedded dataset.",
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
    flags.DEFINE_enum("row_kind", "model", list(ROW_KINDS),
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
    # Text.
    common.define_word_vector_flags(fv, word_dim_help="Word vector size (GloVe: 300).", word_dim=300)
    flags.DEFINE_integer("max_words", 20, "Words per caption (longer ones are not trained on and are "
                         "clipped for evaluation).", lower_bound=1, **d)
    flags.DEFINE_bool("train_word_vectors", False, "Fine-tune the word vectors (the code keeps GloVe fixed).",
                      **d)
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
    flags.DEFINE_float("temperature", DEFAULT_TEMPERATURE,
                       "Softmax temperature of the N-pair loss (eqs. 5-6 and LocNet: 1).",
                       lower_bound=1e-6, **d)
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
    flags.DEFINE_list("rows", [], "Run these row flagfiles (names in experiments/configs or paths; 'all': "
                      "every das_*.cfg) and print Tables 2 and 1.", **d)
    flags.DEFINE_string("runs_dir", "", "Parent folder of the rows' run folders (--rows; default runs/).", **d)


# ---------------------------------------------------------------------------- data


def dataset_layout(f):
    """(dataset folder, its resolved layout) of a row: --dataset_dir, else the embedded data."""
    if f.dataset_dir and not pathlib.Path(f.dataset_dir).is_dir():
        raise common.UserInputError(f"--dataset_dir={f.dataset_dir}: dataset folder does not exist")
    source = pathlib.Path(f.dataset_dir) if f.dataset_dir else load_embedded_dataset()
    return source, resolve_dataset(source, caption_format=f.caption_format, images_dir=f.images_dir or None)


def row_metric(f) -> str:
    """The metric the row reports: "pointing", "retrieval" or "auto" (see --row_metric)."""
    return "pointing" if f.row_kind in BASELINE_KINDS else f.row_metric


def uncomputable_metric(f, layout, source) -> str | None:
    """Why the row's metric cannot be computed on this folder (None: it can), said before any
    feature is computed or any step trained."""
    if row_metric(f) == "pointing" and layout.entities_dir is None:
        return (f"row {f.row_name or f.row_kind!r}: its metric, the pointing accuracy (Table 2), needs the "
                f"Flickr30K Entities Sentences/ and Annotations/ folders, which {source} does not have")
    return None


def load_data(f, *, need_text: bool = True):
    """(dataset folder, layout, splits, caption inputs, backbone, backbone maps) of a row."""
    source, layout = dataset_layout(f)
    corpora = load_caption_splits(layout)
    splits = {}
    for name in ("train", f.eval_split):
        limit = f.max_train_images if name == "train" else f.max_test_images
        corpus = corpora[name]
        splits[name] = corpus.subset(corpus.image_ids[:limit], source=corpus.source) if limit else corpus
    spec = NPairInputSpec(image_backbone=f.image_backbone, backbone_weights=f.backbone_weights or None,
                          scene_cnn_epochs=f.scene_cnn_epochs, word_vectors=f.word_vectors or None,
                          word_dim=f.word_dim, max_words=f.max_words, seed=f.seed, feature_dtype=f.feature_dtype)
    spec.validate()
    cache = features_cache(f, source)
    text = caption_inputs(splits, spec) if need_text else None
    given = common.split_paths("backbone_maps", f.backbone_maps)
    if given:
        missing = sorted(set(splits) - set(given))
        if missing:
            raise common.UserInputError(f"--backbone_maps has no {', '.join(missing)} maps (give train=... and "
                                        f"{f.eval_split}=...)")
        if f.train_backbone or f.export:
            raise common.UserInputError("--backbone_maps gives maps without their backbone: --train_backbone and "
                                        "--export need the backbone (pass --noexport, or drop --backbone_maps)")
        maps = {name: load_backbone_maps(given[name], expected_images=len(corpus.image_ids))
                for name, corpus in splits.items()}
        return source, layout, splits, text, None, maps
    backbone = spatial_backbone(layout, splits["train"], cache, spec)
    maps = backbone_maps(layout, splits, cache, spec, backbone)
    return source, layout, splits, text, backbone, maps


def features_cache(f, source) -> pathlib.Path:
    return pathlib.Path(f.features_cache) if f.features_cache else pathlib.Path(source) / "features"


def build_config(f, text, maps) -> NPairLocalizationConfig:
    shape = maps["train"].shape
    return NPairLocalizationConfig(
        vocabulary_size=len(text.vocabulary), map_channels=int(shape[3]), map_size=int(shape[1]),
        word_dim=int(text.word_matrix.shape[1]), embed_dim=f.embed_dim, max_tokens=text.max_tokens,
        loss=f.loss, aggregator=f.aggregator, token_average=f.token_average, normalisation=f.normalisation,
        temperature=f.temperature, margin=f.margin, train_word_vectors=f.train_word_vectors,
        train_backbone=f.train_backbone)


# ---------------------------------------------------------------------------- evaluation


def evaluate_retrieval(model, normalised_maps, tokens, caption_image, protocols, work_dir,
                       score_dtype: str = "float32") -> dict:
    """Per protocol: R@K, median/mean rank and rsum of S(I, T) over the split through the one
    evaluation core. `normalised_maps` are the split's maps as the score takes them
    (`EvaluationMaps.normalised`); the captions' token vectors are computed once, chunk by chunk,
    into `work_dir`, and every protocol scores the same memory-mapped rows."""
    vectors = localization_maps.token_vector_rows(model, tokens.token_ids, tokens.token_mask,
                                                  pathlib.Path(work_dir) / "token_vectors.npy")
    c = model.config
    return {p: evaluate_localization_retrieval(normalised_maps, vectors, tokens.token_mask, caption_image, p,
                                               aggregator=c.aggregator, token_average=c.token_average,
                                               score_dtype=score_dtype)
            for p in protocols}


def evaluation_queries(layout, corpus):
    if layout.entities_dir is None:
        return None
    return pointing_queries(layout.entities_dir, list(corpus.image_ids))


def evaluate_pointing(model, projected_maps, corpus, queries, vocabulary, max_words: int,
                      counting: str) -> dict:
    """Pointing-game results in both parse modes; `projected_maps` the split's a_{r,c}
    (`EvaluationMaps.projected`), read per query chunk."""
    by_image = localization_maps.RowsById(corpus.image_ids, projected_maps)
    return {mode: localization_maps.pointing_results(
        queries, localization_maps.query_heat_maps(model, by_image, queries, vocabulary, mode=mode,
                                                   max_words=max_words), counting=counting)
            for mode in localization_maps.PARSE_MODES}


def _summary(record, f) -> None:
    """The row's headline metrics: retrieval under its protocol, pointing in its parse mode."""
    metrics = dict(record.get("retrieval", {}).get(f.protocol, {}))
    pointing = record.get("pointing")
    if pointing:
        chosen = pointing.get(f.parse_mode, pointing.get("baseline"))
        metrics["pointing_accuracy"] = chosen["accuracy"]
    record["metrics"] = metrics


# ---------------------------------------------------------------------------- one row


def _learning_rate(f, steps: int):
    return keras.optimizers.schedules.ExponentialDecay(f.learning_rate, f.lr_decay_epochs * steps, 0.1,
                                                       staircase=True)


def run(f) -> dict:
    """Runs one row; returns the results record (also written as JSON)."""
    start = time.time()
    typed = common.typed_flags(f)
    applied = common.apply_embedded_profile(f, EMBEDDED_PROFILE)
    if applied:
        logging.info("embedded dataset: using its profile defaults %s", applied)
    row_name = f.row_name or "npair_localization"
    if f.retrieval_score_dtype != "float32" and f.aggregator != "max_image":
        # Said before training, not after it: the packed scorer is S_MaxImage's alone.
        raise common.UserInputError(f"--retrieval_score_dtype={f.retrieval_score_dtype} needs "
                                    f"--aggregator=max_image (got {f.aggregator})")
    run_dir = pathlib.Path(f.run_dir) if f.run_dir else common.REPO_ROOT / "runs" / common.slug(row_name)
    baseline = f.row_kind in BASELINE_KINDS
    source, layout = dataset_layout(f)
    reason = uncomputable_metric(f, layout, source)
    if reason:
        raise common.UserInputError(reason)
    source, layout, splits, text, backbone, maps = load_data(f, need_text=not baseline)
    evaluation = splits[f.eval_split]
    # Checked before training; the pointing baselines have no retrieval.
    protocol = {"protocol": None} if baseline else common.resolve_protocol(
        f, evaluation.num_images, split=f"the {f.eval_split} split")
    queries = evaluation_queries(layout, evaluation)
    record = {"row": row_name, "task": "npair_localization", "row_kind": f.row_kind, "dataset": str(source),
              **common.flag_record(f, typed),
              "paper": common.paper_numbers(f.paper_results), "paper_dataset": f.paper_dataset,
              "paper_protocol": f.paper_protocol, "row_metric": row_metric(f),
              "num_train_images": splits["train"].num_images, "num_eval_images": evaluation.num_images,
              "num_eval_captions": evaluation.num_captions, **common.split_record(protocol, evaluation),
              "num_pointing_queries": None if queries is None else len(queries)}
    if queries is None:
        record["pointing_not_computed"] = (f"{source} has no Flickr30K Entities Sentences/ and Annotations/ "
                                           "folders: retrieval only")
    if baseline:
        if f.row_kind == "channel_mean":
            heat = localization_maps.channel_mean_heat_maps(
                localization_maps.RowsById(evaluation.image_ids, maps[f.eval_split]), queries)
            result = localization_maps.pointing_results(queries, heat, counting=f.pointing_counting)
        else:
            result = localization_maps.pointing_results(
                queries, points=localization_maps.baseline_points(queries, f.row_kind, f.seed),
                counting=f.pointing_counting)
        record["pointing"] = {"baseline": result}
        _summary(record, f)
        record["seconds"] = time.time() - start
        common.write_json(f.out_json or run_dir / "results.json", record)
        return record

    config = build_config(f, text, maps)
    strategy = common.setup_training(f)
    with strategy.scope():
        model = build_npair_model(config, text.word_matrix, backbone=backbone)
    history = {}
    if f.row_kind == "model" and f.epochs:
        steps = f.steps_per_epoch
        train = text.splits["train"]
        if f.train_backbone:
            image_inputs = split_images(layout, splits["train"], int(backbone.input.shape[1]),
                                        features_cache(f, source))
            image_key = "image"
        else:
            image_inputs, image_key = maps["train"], "backbone_map"
        captions, token_key, caption_image = train.token_ids, "token_ids", splits["train"].caption_image
        if f.train_parse_mode == "phrase":
            if layout.entities_dir is None:
                raise common.UserInputError(f"{source}: --train_parse_mode=phrase needs the Flickr30K Entities "
                                            "Sentences/ and Annotations/ of the training images")
            train = phrase_parsed_captions(layout.entities_dir, splits["train"].image_ids, text.vocabulary,
                                           text.word_matrix, f.max_words)
            captions, token_key, caption_image = train.word_inputs, "word_inputs", train.caption_image
        with strategy.scope():
            optimizer = keras.optimizers.SGD(_learning_rate(f, steps), momentum=f.momentum,
                                             weight_decay=f.weight_decay or None)
            model.compile(optimizer=optimizer, jit_compile=f.jit_compile, run_eagerly=f.run_eagerly)
        tcfg = common.train_config(f, epochs=f.epochs, learning_rate=f.learning_rate, optimizer="sgd")

        def dataset(start_step=0):
            return npair_batches.train_dataset(image_inputs, captions, train.token_mask, caption_image,
                                               train.trainable, batch_size=f.batch_size, seed=f.seed,
                                               start_step=start_step, image_key=image_key, token_key=token_key)

        run_config = {"model": config.to_dict(), "train": tcfg.__dict__, **common.flag_record(f, typed),
                      "task": "npair_localization"}
        trainer.prepare_run_dir(run_dir, run_config)
        save_npair_config(run_dir / "npair_config.json", config, vocabulary=text.vocabulary)
        trained = trainer.train(model, dataset, tcfg, run_dir, steps_per_epoch=steps, epochs=f.epochs)
        history = {k: [float(x) for x in v] for k, v in trained.history.items()}
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_npair_config(run_dir / "npair_config.json", config, vocabulary=text.vocabulary)
        model.save_weights(run_dir / "untrained.weights.h5")
    record["history"] = history
    protocols = dict.fromkeys([f.protocol] + (["folds_100"] if evaluation.num_images >= 100 else []))
    # The split's maps and token vectors are written once to disk, chunk by chunk, and read by every
    # protocol and the pointing game; the folder goes when the evaluation is done.
    with tempfile.TemporaryDirectory(dir=run_dir, prefix=".evaluation_") as work_dir:
        image_maps = localization_maps.evaluation_maps(model, maps[f.eval_split], work_dir)
        record["retrieval"] = evaluate_retrieval(model, image_maps.normalised, text.splits[f.eval_split],
                                                 evaluation.caption_image, protocols, work_dir,
                                                 score_dtype=f.retrieval_score_dtype)
        if queries is not None:
            record["pointing"] = evaluate_pointing(model, image_maps.projected, evaluation, queries,
                                                   text.vocabulary, f.max_words, f.pointing_counting)
        del image_maps
    # Per evaluated protocol: a row sharing this model under another protocol takes its own.
    record["random_baselines"] = {p: retrieval.random_baseline_metrics(
        evaluation.num_images, evaluation.caption_image, protocol=p, seed=f.seed) for p in protocols}
    record["random_baseline"] = record["random_baselines"][f.protocol]
    _summary(record, f)
    logging.info("%s: %s", row_name, {k: round(v, 2) for k, v in record["metrics"].items()})
    if f.export and common.is_chief() and f.row_kind == "model":
        from tf_twobranch.export.npair_localization import export_npair_model
        record["export_dir"] = str(export_npair_model(
            model, run_dir / "export", vocabulary=text.vocabulary,
            run_config={"model": config.to_dict(), **common.flag_record(f, typed)}))
    record["seconds"] = time.time() - start
    common.write_json(f.out_json or run_dir / "results.json", record)
    return record


def load_row(run_dir):
    """A finished model row again: (flags, splits, caption inputs, backbone maps, model)."""
    run_dir = pathlib.Path(run_dir)
    record = read_json_object(run_dir / "results.json", "N-pair localization run record")
    f = flags.FlagValues()
    define_flags(f)
    f(["row"])
    for name, value in record["flags"].items():
        if name in f:
            f[name].value = value
    _, layout, splits, text, backbone, maps = load_data(f)
    config, _ = load_npair_config(run_dir / "npair_config.json")
    model = build_npair_model(config, text.word_matrix, backbone=backbone)
    weights = run_dir / "checkpoints" / "latest.weights.h5"
    load_checkpoint(model, weights if weights.exists() else run_dir / "untrained.weights.h5")
    return f, layout, splits, text, maps, model


# ---------------------------------------------------------------------------- tables


def _paper_pointing(row) -> str:
    paper = row.get("paper")
    return common.format_cell(paper[0], 7, 2) if paper and len(paper) == 1 else f"{'–':>7}"


def format_table2(rows: list[dict], dataset: str) -> str:
    """Table 2's layout: method, pointing accuracy here, the paper's; a row whose pointing
    accuracy could not be computed says why."""
    width = max([len(r["name"]) for r in rows] + [34])
    lines = [f"Das et al. Table 2 analogue: pointing accuracy (%) on {dataset} (paper: Flickr30K Entities test)",
             f"{'Method':{width}} | {'here':>7} | {'paper':>7} | trials",
             "-" * (width + 30)]
    for r in rows:
        pointing = r["metrics"].get("pointing_accuracy")
        trials = f"not computed: {r['not_computed']}" if r.get("not_computed") else r.get("trials")
        trials = "–" if trials is None else trials
        lines.append(f"{r['name']:{width}} | {common.format_cell(pointing, 7, 2)} | {_paper_pointing(r)} | {trials}")
    return "\n".join(lines)


def format_table1(rows: list[dict], dataset: str) -> str:
    """Table 1's layout: R@1/5/10 image-to-caption and caption-to-image, the paper's below when
    measured under the same protocol, chance last; one table per protocol and test split."""
    head = "".join(f"{c:>7}" for c in ("R@1", "R@5", "R@10"))
    tables = []
    for group in common.groups_by_test_split(rows):
        first = group[0]
        width = max([len(r["name"]) for r in group] + [len(common.CHANCE_ROW), 34])
        title = common.table_title(
            "Das et al. Table 1 analogue: retrieval", dataset=dataset, protocol=first["protocol"],
            num_images=first["num_eval_images"], num_captions=first["num_eval_captions"],
            paper=any(r.get("paper") for r in group), paper_dataset=first["paper_dataset"],
            paper_protocol=first["paper_protocol"])
        lines = [title, f"{'':{width}} | {'Image-to-Caption':^21} | {'Caption-to-Image':^21} |",
                 f"{'Model':{width}} | {head} | {head} |", "-" * (width + 50)]

        def line(name, values):
            return (f"{name:{width}} | " + "".join(common.format_cell(v, 7) for v in values[:3]) + " | "
                    + "".join(common.format_cell(v, 7) for v in values[3:6]) + " |")

        keys = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
        for r in group:
            m = r["metrics"]
            lines.append(line(r["name"], [m[k] for k in keys]))
            if "rsum_fold_std" in m:
                lines.append(line(f"  ± std over {m['num_folds']} folds", [m[f"{k}_fold_std"] for k in keys]))
            paper = common.paper_beside(r.get("paper"), r["paper_protocol"], r["protocol"], r["num_eval_images"])
            if paper and len(paper) == 6:
                lines.append(line(f"  (paper: {r['paper_dataset']})", paper))
        lines.append(line(common.CHANCE_ROW, [first["random_baseline"][k] for k in keys]))
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def table_row(record: dict, row) -> dict:
    """A row of the printed tables from a run record and the row's flags."""
    pointing = record.get("pointing") or {}
    chosen = pointing.get(row.parse_mode) or pointing.get("baseline") or {}
    return {"name": row.row_name or record["row"], "metrics": record["metrics"], "trials": chosen.get("trials"),
            "paper": common.paper_numbers(row.paper_results), "paper_dataset": row.paper_dataset,
            "paper_protocol": row.paper_protocol, "protocol": record["protocol"],
            "test_split_fingerprint": record["test_split_fingerprint"],
            "num_eval_images": record["num_eval_images"], "num_eval_captions": record["num_eval_captions"],
            "random_baseline": record.get("random_baseline"), "run_dir": row.run_dir,
            "seconds": record.get("seconds")}


def format_record(record: dict, row) -> str:
    """One row: its retrieval table (Table 1 layout, with chance) and its pointing accuracy
    (Table 2 layout), each beside the paper's number where it measures the same thing."""
    entry = table_row(record, row)
    parts = []
    if "retrieval" in record:
        paper = entry["paper"] if entry["paper"] and len(entry["paper"]) == 6 else None
        parts.append(format_table1([{**entry, "paper": paper}], record["dataset"]))
    if "pointing" in record:
        paper = entry["paper"] if entry["paper"] and len(entry["paper"]) == 1 else None
        parts.append(format_table2([{**entry, "paper": paper}], record["dataset"]))
    if record.get("pointing_not_computed"):
        parts.append(f"pointing game not computed: {record['pointing_not_computed']}")
    return "\n\n".join(parts)


# The rows in the order of the paper's Table 2, then Table 1.
ROW_ORDER = ("random", "centre", "vgg_channel_mean", "untrained", "npair_word", "npair_phrase", "triplet")
_RUNNER_FLAGS = {"rows", "runs_dir", "out_json", "run_dir", "row_name", "paper_results"}
# Flags that only choose what a trained model is evaluated on: rows differing only in them share one run.
_EVALUATION_ONLY = {"parse_mode", "protocol", "paper_dataset", "paper_protocol", "pointing_counting", "row_metric"}


def _row_configs(f) -> list[pathlib.Path]:
    if f.rows == ["all"]:
        def order(cfg):
            table, key = cfg.stem.split("_", 2)[1:]
            return (table != "table2", ROW_ORDER.index(key) if key in ROW_ORDER else len(ROW_ORDER), key)
        return sorted(common.CONFIG_DIR.glob("das_*.cfg"), key=order)
    return [common.resolve_config(name) for name in f.rows]


def _training_key(row) -> tuple:
    typed = common.typed_flags(row)
    return tuple(sorted((k, str(v)) for k, v in typed.items() if k not in _EVALUATION_ONLY | _RUNNER_FLAGS))


def run_rows(f) -> dict:
    """Runs the rows of `--rows` and prints Table 2 (pointing) and Table 1 (retrieval).

    Rows that differ only in what is evaluated (parse mode, protocol) share
    one trained model; a row whose run folder already holds results with the
    same flags is not run again, so an interrupted table resumes.
    """
    runs_dir = pathlib.Path(f.runs_dir) if f.runs_dir else common.REPO_ROOT / "runs"
    overrides = common.row_overrides(f, define_flags, _RUNNER_FLAGS)
    trained: dict = {}
    results = {}
    start = time.time()
    for cfg in _row_configs(f):
        row = common.parse_flagfile(define_flags, str(cfg), overrides)
        key = _training_key(row)
        row.run_dir = str(runs_dir / cfg.stem)
        source, layout = dataset_layout(row)
        reason = uncomputable_metric(row, layout, source)
        if reason:
            # The table says which row is missing and why; nothing is trained for it.
            print(f"--- {cfg.name}: not computed: {reason}", flush=True)
            results[cfg.stem] = {"name": row.row_name, "metrics": {}, "not_computed": reason,
                                 "paper": common.paper_numbers(row.paper_results),
                                 "paper_dataset": row.paper_dataset, "paper_protocol": row.paper_protocol,
                                 "run_dir": None}
            continue
        path = pathlib.Path(row.run_dir) / "results.json"
        previous = read_json_object(path, "N-pair run record") if path.is_file() else None
        if (previous and previous.get("typed_flags") == common.typed_flags(row)
                and "test_split_fingerprint" in previous):
            record = previous
            print(f"--- {cfg.name}: finished before ({row.run_dir})", flush=True)
        elif key in trained:
            record = dict(trained[key])
            record.update(row=row.row_name, paper=common.paper_numbers(row.paper_results),
                          paper_dataset=row.paper_dataset, paper_protocol=row.paper_protocol,
                          shared_with=trained[key]["row"])
            if row.protocol not in record["retrieval"]:
                raise common.UserInputError(f"{cfg.name}: protocol {row.protocol} was not evaluated by the "
                                            f"shared run {trained[key]['row']}")
            record.update(protocol=row.protocol, random_baseline=record["random_baselines"][row.protocol])
            _summary(record, row)
            print(f"--- {cfg.name}: {row.row_name}: the model of {trained[key]['row']}", flush=True)
        else:
            print(f"--- {cfg.name}: {row.row_name}", flush=True)
            record = run(row)
        if record.get("row_kind") in ("model", "untrained") and key not in trained:
            trained[key] = record
        results[cfg.stem] = table_row(record, row)
    dataset = str(load_embedded_dataset()) if not f.dataset_dir else f.dataset_dir
    out = {"rows": results, "seconds": time.time() - start}
    table2 = [r for stem, r in results.items() if stem.startswith("das_table2_")]
    table1 = [r for stem, r in results.items() if stem.startswith("das_table1_") and not r.get("not_computed")]
    if table2:
        out["table2"] = format_table2(table2, dataset)
        print(out["table2"])
    if table1:
        out["table1"] = format_table1(table1, dataset)
        print(out["table1"])
    common.write_json(f.out_json or runs_dir / "das_tables.json", out)
    return out


def _main() -> None:
    f = flags.FLAGS
    if f.rows:
        run_rows(f)
        return
    record = run(f)
    print(format_record(record, f))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
