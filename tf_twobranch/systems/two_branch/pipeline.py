"""Two-branch image-sentence retrieval (TPAMI Tables 2 and 3): the row recipe, its data
(features computed and cached, or precomputed files), its model configuration, training and
evaluation. `experiments.two_branch_retrieval` turns its flags into a `RetrievalRecipe`
and calls `run`; `experiments.two_branch_table` runs several through `tf_twobranch.table_runner`.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time

from absl import logging

from tf_twobranch import distribute, table_runner
from tf_twobranch.systems.two_branch.cca import CCABaseline
from tf_twobranch.data.formats import load_feature_matrix
from tf_twobranch.data.from_flags import cut_splits, dataset_from_flags
from tf_twobranch.data.retrieval_data import load_caption_splits, load_precomp_splits
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.evaluation.split import EvaluationSplit
from tf_twobranch.systems.two_branch.export import export_saved_model
from tf_twobranch.features import FEATURE_SEED
from tf_twobranch.features.prepare import (FeatureSpec, prepare_retrieval_features, prepare_text_features,
                                           serving_image_backbone, serving_text_encoder)
from tf_twobranch.systems.two_branch.losses import check_top_k_fits_batch
from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model
from tf_twobranch.run_records import is_chief, run_record, setup_training, train_config, write_results
from tf_twobranch.recipes import (RunRecipe, backbone_weights_field, caption_format_field,
                                  feature_dtype_field, flag, images_dir_field, max_images_field,
                                  paper_dataset_field, prepare_recipe, scene_cnn_epochs_field, word_vectors_field)
from tf_twobranch.run_loading import record_feature_split
from tf_twobranch.systems.two_branch import sampling
from tf_twobranch.tables import (format_retrieval_table, groups_by_test_split, is_smoke, paper_beside_record,
                                 paper_numbers, resolve_protocol, split_record, table_title)
from tf_twobranch.training import trainer


# Defaults used when no --dataset_dir is given (the embedded digit scenes),
# unless the flag is set explicitly. The embedded data is ~12x smaller than
# Flickr30K and has a 134-word vocabulary, so word vectors are smaller (their
# Fisher vector then needs no PCA) and each epoch has ~25 steps, not ~300.
# Its captions repeat across images ("A red one."), so the 10 most violating
# in-batch negatives are mostly identical captions of other images; K = 50
# (the CVPR 2016 value) lets the ranking loss see real negatives. Measured on
# the full model's row: K=10 / lr 1e-3: R@1 4.8 / 2.5; K=50 / lr 3e-4:
# 12.9 / 6.0 (CCA 9.8 / 5.0). See BUILD_NOTES.md. (PCA of the Fisher vectors
# to 512, their numerical rank, was measured 1.5x faster but 26 rsum worse on
# the neighbourhood-sampling rows; not used.) Hidden layers of 1024 instead of
# the paper's 2048 halve every row's training time (the README's first command
# has to fit in 10 minutes on a 2-core machine) at a cost within noise: row b5
# over seeds 0-2, rsum 141.5 +- 2.1 vs 144.5 +- 1.9, while the test set alone
# gives any rsum a bootstrap standard error of 4.7 (BUILD_NOTES "Main job time").
EMBEDDED_PROFILE = {"word_dim": 50, "learning_rate_scale": 3.0, "epochs": 10, "top_k": 50,
                    "hidden_dim": 1024}



# The fields the image–sentence and region–phrase recipes share, declared once: (default, help, bounds).
_SHARED_FIELDS = {
    "features_cache": ("", "Where computed features are cached (default <dataset_dir>/features).", {}),
    "word_dim": (300, "Size of word vectors trained on the captions.", {"lower_bound": 2}),
    "pca_dim": (6000, "PCA size of Fisher vectors larger than this.", {"lower_bound": 1}),
    "model": ("embedding", "Which model.", {"enum": ("embedding", "similarity", "cca")}),
    "branch": ("nonlinear", "Branch structure.", {"enum": ("nonlinear", "linear")}),
    "embed_dim": (512, "Embedding size.", {"lower_bound": 1}),
    "margin": (0.05, "Ranking margin m.", {"lower_bound": 0.0}),
    "cca_components": (512, "CCA dimensions (model=cca).", {"lower_bound": 1}),
}


def shared_field(name: str):
    """The recipe field `name` as both two-branch recipes declare it."""
    default, help_text, bounds = _SHARED_FIELDS[name]
    return flag(default, help_text, **bounds)


@dataclasses.dataclass
class RetrievalRecipe(RunRecipe):
    """One image-sentence retrieval row (fields: the flags of experiments.two_branch_retrieval)."""
    # --smoke: one epoch on a slice of the images, whose features (a scene CNN of one epoch) are
    # computed for the slice only.
    SMOKE_CAPS = {"epochs": 1, "max_train_images": 200, "max_test_images": 100, "scene_cnn_epochs": 1,
                  "batch_size": 100, "cca_components": 64}
    dataset_dir: str = flag('', "Dataset folder; empty: the embedded dataset.")
    caption_format: str = caption_format_field(("auto", "karpathy", "token", "coco", "precomp"))
    images_dir: str = images_dir_field()
    max_train_images: int = max_images_field("training")
    max_test_images: int = max_images_field("test")
    image_features_train: str = flag(
        '', "Precomputed train image features (.npy/.mat/.h5, (N, D), one row per image in caption "
        "order).")
    text_features_train: str = flag(
        '', "Precomputed train sentence features (.npy/.mat/.h5; column-major HDF5 accepted).")
    image_features_test: str = flag(
        '', "Precomputed test image features (.npy/.mat/.h5, (N, D), one row per image in caption order).")
    text_features_test: str = flag(
        '', "Precomputed test sentence features (.npy/.mat/.h5; column-major HDF5 accepted).")
    features_cache: str = shared_field("features_cache")
    image_backbone: str = flag(
        'scene_cnn', "CNN for image features.", enum=("scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152"))
    backbone_weights: str = backbone_weights_field()
    scene_cnn_epochs: int = scene_cnn_epochs_field()
    text_encoder: str = flag(
        'fisher_hglmm', "Sentence representation.",
        enum=("fisher_hglmm", "fisher_gmm", "mean_vector", "tfidf", "lstm"))
    word_vectors: str = word_vectors_field()
    word_dim: int = shared_field("word_dim")
    pca_dim: int = shared_field("pca_dim")
    feature_dtype: str = feature_dtype_field()
    ten_crop: bool = flag(True, "Average features over the paper's ten crops.")
    protocol: str = flag('full', "Test protocol.", enum=("full", "flickr30k_1k", "coco_1k", "coco_5k"))
    model: str = shared_field("model")
    branch: str = shared_field("branch")
    layout: str = flag(
        'original', "original: FC-BN-ReLU-Dropout-FC (reference code); paper: FC-ReLU-Dropout-FC-BN (TPAMI "
        "§3.2.1).", enum=("original", "paper"))
    hidden_dim: int = flag(2048, "First FC layer size of each branch.", lower_bound=1)
    embed_dim: int = shared_field("embed_dim")
    dropout: float = flag(0.5, "Dropout after the ReLU.", lower_bound=0.0, upper_bound=0.95)
    margin: float = shared_field("margin")
    top_k: int = flag(10, "K most violating in-batch negatives per anchor.", lower_bound=1)
    image_anchor_weight: float = flag(1.0, "λ1 (image target).", lower_bound=0.0)
    text_anchor_weight: float = flag(1.5, "λ2 (sentence target); 0 = single-directional.", lower_bound=0.0)
    text_neighbour_weight: float = flag(0.05, "λ4 (sentence neighbourhood constraint).", lower_bound=0.0)
    batch_size: int = flag(500, "Images per batch.", lower_bound=2)
    cca_components: int = shared_field("cca_components")
    epochs: int = flag(20, "Training epochs.", lower_bound=1)
    learning_rate: float = flag(0.0001, "Adam learning rate.", lower_bound=0.0)
    sample_size: int = flag(
        2, "Sentences per image in a batch; >= 2 is neighbourhood sampling.", lower_bound=1)
    unique_images: bool = flag(
        False, "Draw distinct images per batch instead of the original's shuffled-caption anchors.")
    lstm_units: int = flag(512, "LSTM size (text_encoder=lstm).", lower_bound=1)
    word_embedding_dim: int = flag(256, "Word embedding size (LSTM).", lower_bound=1)
    learning_rate_scale: float = flag(
        1.0, "Multiplies --learning_rate (the embedded dataset's profile uses 3: it has ~25 steps per "
        "epoch, not ~300).", lower_bound=0.0)
    lr_schedule: str = flag(
        'none', "none: as the reference code (its decay is never applied).", enum=("none", "exponential"))
    paper_dataset: str = paper_dataset_field("Flickr30K")

def dataset_layout(r):
    """The dataset folder (--dataset_dir, else the embedded dataset), checked and resolved once."""
    return dataset_from_flags(r.dataset_dir, with_proposals=False, caption_format=r.caption_format,
                              images_dir=r.images_dir)[1]


def prepare(r, typed: dict | None = None):
    """(the recipe with the embedded profile and --smoke applied, what they changed)."""
    return prepare_recipe(r, typed or {}, EMBEDDED_PROFILE)


def feature_spec(r) -> FeatureSpec:
    """How the row's computed features are made (and found in the cache)."""
    return FeatureSpec(image_backbone=r.image_backbone,
                       backbone_weights=r.backbone_weights or None, ten_crop=r.ten_crop,
                       text_encoder=r.text_encoder, word_vectors=r.word_vectors or None,
                       word_dim=r.word_dim, pca_dim=r.pca_dim,
                       scene_cnn_epochs=r.scene_cnn_epochs, seed=FEATURE_SEED,
                       feature_dtype=r.feature_dtype)


def features_cache(r, layout) -> pathlib.Path:
    return pathlib.Path(r.features_cache) if r.features_cache else layout.root / "features"


def load_data(r):
    """The dataset layout, caption splits and model inputs (features or token ids) for train/test.

    A vsepp/SCAN precomp folder ({split}_caps.txt + {split}_ims.npy) supplies
    the image features (regions averaged); the text features are computed
    from its captions with --text_encoder, unless --text_features_{train,test}
    are given. --image_features_{train,test} override the precomp images.
    Features are memory-mapped, stored in --feature_dtype; computed ones
    (and the fitted text encoder) are cached in --features_cache.
    """
    layout = dataset_layout(r)
    dataset_dir = layout.root
    precomp = layout.caption_format == "precomp"
    given = {kind: [getattr(r, f"{kind}_features_{s}") for s in ("train", "test")]
             for kind in ("image", "text")}
    extras = {}
    spec = feature_spec(r)
    cache = features_cache(r, layout)
    # Where files that cannot be memory-mapped as they are get their row-major copy.
    converted = cache / "row_major"
    if precomp:
        for kind, paths in given.items():
            if any(paths) and not all(paths):
                raise UserInputError(f"give both --{kind}_features_train and "
                                            f"--{kind}_features_test, or neither")
        if all(given["image"]):
            splits = load_caption_splits(layout)
            splits = {s: splits[s] for s in ("train", "test")}
        else:
            splits, image = load_precomp_splits(layout, ("train", "test"), dtype=r.feature_dtype,
                                                cache_dir=converted)
            logging.info("precomp layout: image features from %s/{train,%s}_ims.npy "
                         "(regions averaged); --image_backbone is not used", dataset_dir,
                         layout.precomp_splits["test"])
    else:
        splits = load_caption_splits(layout)
        splits = {s: splits[s] for s in ("train", "test")}
        flat = given["image"] + given["text"]
        if any(flat) and not all(flat):
            raise UserInputError("give all four of --image_features_{train,test} and "
                                        "--text_features_{train,test}, or none")
    limits = {"max_train_images": r.max_train_images, "max_test_images": r.max_test_images}
    if any(limits.values()) and (all(given["image"]) or all(given["text"])):
        # The user's own feature files hold every image's row: a slice would misalign them.
        logging.warning("--max_train_images/--max_test_images are not applied: the feature files "
                        "given hold every image of their split")
    elif any(limits.values()):
        cut = cut_splits(splits, tuple(splits), **limits)
        if precomp:  # the precomp image rows follow the split's image order
            image = {s: image[s][:cut[s].num_images] for s in cut}
        splits = cut
        logging.info("using the first %s training and %s test images",
                     r.max_train_images or "all", r.max_test_images or "all")
    if all(given["image"]):
        image = {s: load_feature_matrix(getattr(r, f"image_features_{s}"), expected_rows=splits[s].num_images,
                                        dtype=r.feature_dtype, cache_dir=converted) for s in splits}
    if all(given["text"]):
        text = {s: load_feature_matrix(getattr(r, f"text_features_{s}"), expected_rows=splits[s].num_captions,
                                       dtype=r.feature_dtype, cache_dir=converted) for s in splits}
    elif precomp:
        # The precomp layout ships no sentence features: encode its captions
        # (the encoder is fitted on the training captions only), cached.
        text, extras = prepare_text_features(splits, cache, spec)
    else:
        image, text, extras = prepare_retrieval_features(splits, layout, cache, spec)
    for kind, paths in given.items():
        if all(paths):  # the user's own files, read unchanged: a run points at them
            for s in splits:
                extras.setdefault("feature_files", {}).setdefault(s, {})[kind] = {
                    "file": str(pathlib.Path(getattr(r, f"{kind}_features_{s}")).absolute()),
                    "key": None}
    return layout, splits, image, text, extras


def build_config(r, image_dim: int, text_dim: int, extras: dict):
    hidden = () if r.branch == "linear" else (r.hidden_dim,)
    lstm = r.text_encoder == "lstm"
    if r.sample_size < 2 and r.text_neighbour_weight > 0:
        raise UserInputError(
            "--text_neighbour_weight > 0 needs neighbourhood sampling (--sample_size >= 2)")
    return TwoBranchConfig(
        kind=r.model, image_dim=image_dim, text_dim=text_dim if not lstm else 1,
        image_hidden=hidden, text_hidden=hidden if not lstm else ((1024,) if hidden else ()),
        embed_dim=r.embed_dim, layout=r.layout, dropout=r.dropout,
        text_encoder="lstm" if lstm else "features", vocabulary=extras.get("vocabulary"),
        word_dim=r.word_embedding_dim, lstm_units=r.lstm_units,
        margin=r.margin, top_k=r.top_k, image_anchor_weight=r.image_anchor_weight,
        text_anchor_weight=r.text_anchor_weight, image_neighbour_weight=0.0,
        text_neighbour_weight=r.text_neighbour_weight)


def serving_inputs(r, layout, splits) -> tuple[dict, list[str]]:
    """The `export_saved_model` arguments that make the row's export take JPEG bytes and caption
    strings (the backbone with the row's views, the fitted text encoder), and a note for each side
    that keeps feature inputs: features read from the user's files or the precomp layout (no
    backbone or encoder is known), or a randomly initialised ImageNet backbone."""
    spec = feature_spec(r)
    cache = features_cache(r, layout)
    precomp = layout.caption_format == "precomp"
    kwargs, notes = {}, []
    if r.image_features_train:
        notes.append("image side: features from --image_features_{train,test} (no backbone known): the "
                     "export takes image_features")
    elif precomp:
        notes.append("image side: the precomp layout's region features (no backbone known): the export "
                     "takes image_features")
    else:
        backbone, views, why = serving_image_backbone(spec, splits, cache)
        if backbone is None:
            notes.append(f"image side: {why}: the export takes image_features")
        else:
            kwargs.update(image_backbone=backbone, **views)
    if r.text_encoder != "lstm":
        if r.text_features_train:
            notes.append("text side: features from --text_features_{train,test} (no encoder known): the "
                         "export takes text_features")
        else:
            kwargs["text_encoder"] = serving_text_encoder(spec, splits["train"], cache)
    return kwargs, notes


def run_cca(r, splits, image, text) -> dict:
    train = splits["train"]
    cca = CCABaseline(n_components=r.cca_components, seed=r.seed)
    cca.fit(image["train"][train.caption_image], text["train"])
    return retrieval.evaluate_protocol(cca.transform_images(image["test"]),
                                       cca.transform_texts(text["test"]),
                                       splits["test"].caption_image, r.protocol)


def run(r: RetrievalRecipe, typed: dict | None = None, flagfile: str | None = None) -> dict:
    """Runs one table row; returns the results record (also written as JSON).

    `typed`: the fields the user set (the embedded profile fills in only the others);
    `flagfile`: the row's flagfile, which names its run folder when `r.run_dir` is empty.
    """
    start = time.time()
    r, _ = prepare(dataclasses.replace(r), typed)
    if r.model == "embedding":  # before any data is read: a wrong pair fails in seconds
        check_top_k_fits_batch(r.top_k, r.batch_size, top_k_name="--top_k", batch_name="--batch_size")
    row_name = r.row_name or "image_sentence"
    run_dir = pathlib.Path(r.run_dir) if r.run_dir else table_runner.run_folder(None, flagfile, row_name)
    layout, splits, image, text, extras = load_data(r)
    dataset_dir = layout.root
    train, test = splits["train"], splits["test"]
    protocol = resolve_protocol(r, test.num_images)
    record = {"row": row_name, "system": "two_branch", "task": "two_branch_retrieval", "dataset_dir": str(dataset_dir),
              "run_dir": str(run_dir),
              **run_record(r, typed),
              "paper": paper_numbers(r.paper_results), "paper_dataset": r.paper_dataset,
              "paper_protocol": r.paper_protocol, "num_train_images": train.num_images,
              **split_record(protocol, test),
              "random_baseline": retrieval.random_baseline_metrics(
                  test.num_images, test.caption_image, protocol=r.protocol, seed=r.seed)}
    if r.model == "cca":
        record["metrics"] = run_cca(r, splits, image, text)
    else:
        config = build_config(r, image["train"].shape[1], text["train"].shape[1], extras)
        tcfg = train_config(r, epochs=r.epochs,
                                   learning_rate=r.learning_rate * r.learning_rate_scale,
                                   lr_schedule=r.lr_schedule)
        strategy = setup_training(r)
        with strategy.scope():
            model = build_model(config)
        if r.model == "embedding":
            def batches(start_step=0):
                return sampling.image_sentence_batches(
                    train.caption_image, train.num_images, batch_size=r.batch_size,
                    sample_size=r.sample_size, seed=r.seed, unique_images=r.unique_images,
                    start_step=start_step)
            steps = sampling.steps_per_epoch(train.num_captions, train.num_images, r.batch_size,
                                             r.unique_images)
        else:
            def batches(start_step=0):
                return sampling.similarity_pair_batches(
                    train.caption_image, train.num_images, batch_size=r.batch_size, seed=r.seed,
                    start_step=start_step)
            steps = train.num_captions // r.batch_size
        # Every replica embeds its block of each global batch (tf_twobranch.distribute);
        # a function of the start step, so a preempted run resumes mid-epoch cheaply.
        dataset = distribute.distributed_stream(
            strategy, batches,
            lambda ds: sampling.attach_features(ds, image["train"], text["train"]))
        run_config = {"model": config.to_dict(), "train": tcfg.__dict__,
                      **run_record(r, typed), "dataset_dir": str(dataset_dir)}
        trainer.prepare_run_dir(run_dir, run_config)
        with strategy.scope():
            model.compile(optimizer=trainer.make_optimizer(tcfg, steps), jit_compile=r.jit_compile,
                          run_eagerly=r.run_eagerly)
        history = trainer.train(model, dataset, tcfg, run_dir, steps_per_epoch=steps)
        if history.history.get("loss"):
            record["final_loss"] = float(history.history["loss"][-1])
        test_split = EvaluationSplit(image["test"], text["test"], test.caption_image,
                                     protocol=r.protocol)
        record["metrics"] = model.evaluate(test_split)
        # What load_run(run_dir).evaluation_split() gives back.
        record["evaluation"] = record_feature_split(run_dir, test_split,
                                                    extras.get("feature_files", {}).get("test"))
        if r.model == "embedding":
            record["sentence_retrieval"] = model.sentence_retrieval(text["test"],
                                                                    test.caption_image)
        if r.export and is_chief():
            # Raw inputs where the row's feature pieces are known (see serving_inputs).
            raw_inputs, notes = serving_inputs(r, layout, splits)
            for note in notes:
                logging.info("export: %s", note)
            record["export_dir"] = str(export_saved_model(
                model, run_dir / "export", **raw_inputs,
                run_config={**run_config, "serving": {"notes": notes}}))
            raw_text = "text_encoder" in raw_inputs or r.text_encoder == "lstm"
            record["export_inputs"] = {
                "image": "image_jpeg" if "image_backbone" in raw_inputs else "image_features",
                "text": "captions" if raw_text else "text_features", "notes": notes}
    record["seconds"] = time.time() - start
    write_results(r.out_json or run_dir / "results.json", record)
    return record


def format_record(record: dict) -> str:
    """The row beside the paper's numbers (when measured under the same protocol) and chance."""
    paper = paper_beside_record(record)
    title = table_title(
        "Image-sentence retrieval", protocol=record["protocol"], num_images=record["num_test_images"],
        num_captions=record["num_test_captions"], paper=record["paper"],
        paper_dataset=record["paper_dataset"], paper_protocol=record["paper_protocol"], smoke=is_smoke(record))
    table = format_retrieval_table(
        title, [{"name": record["row"], "metrics": record["metrics"], "paper": paper}],
        chance=record["random_baseline"])
    return table + (f"\nnote: {record['protocol_note']}" if record.get("protocol_note") else "")


# The rows the main job (`experiments.two_branch_table` without --rows) trains, each under ~1 minute on
# the embedded data.
MAIN_ROWS = ("_a1_", "_b2_", "_b4_", "_b5_", "_b6_", "_d_")
# Seconds of the main job's phases on the reference machine of `speed.estimate_on_this_machine`
# (BUILD_NOTES.md "Main job time", session 9, quiet cold run); "row": any row outside the six.
MAIN_JOB_SECONDS = {"dataset": 12, "features": 99, "_a1_": 2, "_b2_": 16, "_b4_": 32, "_b5_": 45, "_b6_": 55,
                    "_d_": 76, "row": 80}


def main_job_seconds(configs, dataset_ready: bool, features_ready: bool) -> float:
    """The expected wall time of the rows `configs` on this machine (embedded data)."""
    from tf_twobranch.speed import estimate_on_this_machine

    total = ((0 if dataset_ready else MAIN_JOB_SECONDS["dataset"])
             + (0 if features_ready else MAIN_JOB_SECONDS["features"]))
    total += sum(MAIN_JOB_SECONDS[next((k for k in MAIN_ROWS if k in cfg.stem), "row")] for cfg in configs)
    return estimate_on_this_machine(total)


def format_table(records: list[dict], table: str) -> str:
    """The rows' table, one per protocol and test split (rows are compared only on the same
    split): each row beside the paper's numbers measured under its protocol, then chance."""
    tables = []
    for group in groups_by_test_split(records):
        first = group[0]
        title = table_title(
            f"Table {table}-style bi-directional retrieval", dataset=first["dataset_dir"],
            protocol=first["protocol"], num_images=first["num_test_images"],
            num_captions=first["num_test_captions"], paper=any(r["paper"] for r in group),
            paper_dataset=first["paper_dataset"], paper_protocol=first["paper_protocol"],
            smoke=any(is_smoke(r) for r in group))
        rows = [{"name": r["row"], "metrics": r["metrics"], "paper": paper_beside_record(r)} for r in group]
        notes = sorted({r["protocol_note"] for r in group if r.get("protocol_note")})
        tables.append("\n".join([format_retrieval_table(title, rows, chance=first["random_baseline"]),
                                  *(f"note: {n}" for n in notes)]))
    return "\n\n".join(tables)
