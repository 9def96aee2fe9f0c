"""Two-branch phrase localization (TPAMI Table 1, §4): the row recipe, its data (region and
phrase features), Algorithm 1 training in its stages, the evaluation (R@K at IoU >= 0.5) and
the Table 1 layout. `experiments.two_branch_region_phrase` turns its flags into a
`LocalizationRecipe` and calls `run`; its `--rows` run several through `tf_twobranch.table_runner`.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from tf_twobranch import distribute, json_files, table_runner
from tf_twobranch.systems.two_branch.cca import CCABaseline
from tf_twobranch.data.corpus import split_fingerprint
from tf_twobranch.data.from_flags import dataset_from_flags
from tf_twobranch.data.phrases import phrase_fingerprint
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation.grounding import box_grounding, grounding_summary
from tf_twobranch.evaluation.phrase_localization import (phrase_localization_recall, random_localization_metrics,
                                                         score_phrases_with_model, top_proposal_boxes)
from tf_twobranch.evaluation.pointing_game import pointing_queries
from tf_twobranch.systems.two_branch.region_phrase_export import export_phrase_localization_run
from tf_twobranch.features import FEATURE_SEED
from tf_twobranch.features.prepare_regions import (RegionFeatureSpec, phrase_localization_inputs,
                                                   prepare_phrase_localization)
from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model
from tf_twobranch.systems.two_branch.pipeline import shared_field
from tf_twobranch.run_records import is_chief, run_record, setup_training, train_config, write_results
from tf_twobranch.recipes import (RunRecipe, backbone_weights_field, flag, images_dir_field, max_images_field,
                                  prepare_recipe, scene_cnn_epochs_field, word_vectors_field)
from tf_twobranch.systems.two_branch import region_phrase_sampling as sampling
from tf_twobranch.tables import SMOKE_LINE, is_smoke, localization_paper_beside, paper_numbers
from tf_twobranch.training import trainer
from tf_twobranch.vectors import l2_normalize_rows

SIMILARITY_HEADS = {1: (), 2: (512,), 3: (512, 256)}   # FC layers after the element-wise product
TABLE_COLUMNS = ("linear", "non-linear", "single pos.", "augm. pos.", "single-dir.", "bi-dir.",
                 "nbr. sampl.", "nbr. constr.")

# Defaults used when no --dataset_dir is given (the embedded digit scenes),
# unless the flag is set explicitly: smaller word vectors (134-word
# vocabulary; the Fisher vector then needs no PCA) and at most 20 negative
# regions drawn per coreference chain (the paper keeps all, ~200 per phrase,
# which makes a batch of 100 pairs ~20,000 regions on a CPU). Single-crop
# region features cost ~5 ms per region here, so the embedded run uses a
# slice (500 training / 200 test images, 100 proposals each: ~5 minutes of
# features) and a shortened 4 + 1 epoch schedule; pass the flags to override.
EMBEDDED_PROFILE = {"word_dim": 50, "negatives_per_phrase": 20, "max_train_images": 500,
                    "max_test_images": 200, "max_proposals": 100, "epochs": 4,
                    "constraint_epochs": 1}



@dataclasses.dataclass
class LocalizationRecipe(RunRecipe):
    """One phrase-localization row (fields: the flags of experiments.two_branch_region_phrase)."""
    # Where this experiment words a shared flag's help its own way.
    FLAG_HELP = {
        "export": "Write the end-to-end SavedModel (image bytes, proposals and phrases -> scores; signature "
                  "score_proposals) to <run_dir>/export.",
        "paper_results": "The paper's R@1,R@5,R@10 for this row (fewer when the paper gives fewer)."}
    # --smoke: one epoch per stage, a slice of images and proposals.
    SMOKE_CAPS = {"epochs": 1, "constraint_epochs": 1, "hard_negative_epochs": 1, "max_train_images": 40,
                  "max_test_images": 20, "max_proposals": 20, "scene_cnn_epochs": 1}

    dataset_dir: str = flag('', "Flickr30K Entities-style folder; empty: the embedded dataset.")
    images_dir: str = images_dir_field()
    max_train_images: int = max_images_field("training")
    max_test_images: int = max_images_field("test")
    proposals: str = flag(
        '', "Proposals file/folder (default <dataset_dir>/proposals.h5, generated with the built-in "
        "generator when absent).")
    max_proposals: int = flag(200, "Proposals ranked per image (the paper: 200 EdgeBoxes).", lower_bound=1)
    clip_proposals: bool = flag(
        False, "Clip proposals that stick out of their image (for crops and IoU alike, count logged); "
        "default: such a file is refused as being at the wrong scale.")
    features_cache: str = shared_field("features_cache")
    image_backbone: str = flag(
        'scene_cnn', "CNN for the single-crop region features.",
        enum=("scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152"))
    backbone_weights: str = backbone_weights_field()
    scene_cnn_epochs: int = scene_cnn_epochs_field()
    text_encoder: str = flag(
        'fisher_hglmm', "Phrase representation (fitted on the training phrases).",
        enum=("fisher_hglmm", "fisher_gmm", "mean_vector", "tfidf"))
    word_vectors: str = word_vectors_field()
    word_dim: int = shared_field("word_dim")
    pca_dim: int = shared_field("pca_dim")
    model: str = shared_field("model")
    branch: str = shared_field("branch")
    layout: str = flag(
        'original', "original: FC-BN-ReLU-FC (reference code; linear = FC-L2 as §4.2); paper: FC-ReLU-FC-BN.",
        enum=("original", "paper"))
    hidden_dim: int = flag(1024, "First FC layer size of each branch.", lower_bound=1)
    embed_dim: int = shared_field("embed_dim")
    dropout: float = flag(0.0, "Dropout after the ReLU.", lower_bound=0.0, upper_bound=0.95)
    margin: float = shared_field("margin")
    top_k: int = flag(30, "K violating triplets kept per positive pair.", lower_bound=1)
    image_anchor_weight: float = flag(1.0, "λ1: region-anchor term; 0 = single-directional.", lower_bound=0.0)
    text_anchor_weight: float = flag(4.0, "λ2: phrase-anchor (phrase-to-region) term.", lower_bound=0.0)
    text_neighbour_weight: float = flag(
        0.1, "λ4 (used only with --neighbourhood_constraints).", lower_bound=0.0)
    batch_size: int = flag(100, "Ground-truth region–phrase pairs per batch.", lower_bound=2)
    cca_components: int = shared_field("cca_components")
    epochs: int = flag(8, "Epochs of the first stage.", lower_bound=1)
    learning_rate: float = flag(0.001, "Adam learning rate (§4.3).", lower_bound=0.0)
    similarity_head_layers: int = flag(
        3, "FC layers after the element-wise product (1: 512→1, 2: 512→512→1, 3: 512→512→256→1).",
        lower_bound=1, upper_bound=3)
    augment_positives: bool = flag(True, "Positive region augmentation (IoU >= 0.7).")
    neighbourhood_sampling: bool = flag(False, "Algorithm 1 step 3c.")
    neighbourhood_constraints: bool = flag(
        False, "Switch on λ3/λ4 for the --constraint_epochs stage (needs neighbourhood sampling).")
    image_neighbour_weight: float = flag(
        0.1, "λ3 (used only with --neighbourhood_constraints).", lower_bound=0.0)
    negatives_per_phrase: int = flag(
        0, "Cap on IoU<0.3 regions drawn per coreference chain (0 = all, as the paper).", lower_bound=0)
    max_positives_per_phrase: int = flag(
        0, "Similarity network: positives kept per pair (0 = all).", lower_bound=0)
    constraint_epochs: int = flag(
        2, "Further epochs with λ3/λ4 on (only with --neighbourhood_constraints).", lower_bound=0)
    hard_negative_epochs: int = flag(
        0, "CVPR 2016 stage: epochs after mining hard negatives (bi-directional terms only).", lower_bound=0)
    max_hard_negatives: int = flag(50, "Hard negatives kept per unique phrase.", lower_bound=1)

def prepare(r, typed: dict | None = None):
    """(the recipe with the embedded profile and --smoke applied, what they changed)."""
    return prepare_recipe(r, typed or {}, EMBEDDED_PROFILE)


def feature_spec(r):
    max_images = {s: n for s, n in (("train", r.max_train_images), ("test", r.max_test_images)) if n}
    return RegionFeatureSpec(image_backbone=r.image_backbone, backbone_weights=r.backbone_weights or None,
                             scene_cnn_epochs=r.scene_cnn_epochs, proposals=r.proposals or None,
                             max_proposals=r.max_proposals, text_encoder=r.text_encoder,
                             word_vectors=r.word_vectors or None, word_dim=r.word_dim, pca_dim=r.pca_dim,
                             max_images=max_images or None, clip_proposals=r.clip_proposals,
                             seed=FEATURE_SEED)


def dataset_layout(r, dataset_dir=None):
    """The dataset folder (`dataset_dir`, else --dataset_dir, else the embedded dataset with its
    proposals), checked and resolved once with --images_dir and --proposals."""
    return dataset_from_flags(dataset_dir or r.dataset_dir, images_dir=r.images_dir,
                              proposals=r.proposals)[1]


def load_data(r):
    """(the dataset layout, {"train": PhraseLocalizationData, "test": ...})."""
    layout = dataset_layout(r)
    cache = pathlib.Path(r.features_cache) if r.features_cache else layout.root / "features"
    return layout, prepare_phrase_localization(layout, cache, feature_spec(r), ("train", "test"))


def table_marks(r) -> dict:
    """The row's Table 1 checkmarks (None for columns that do not apply)."""
    emb = r.model == "embedding"
    if r.model == "cca":
        return {c: None for c in TABLE_COLUMNS}
    bidir = r.image_anchor_weight > 0
    return {"linear": r.branch == "linear", "non-linear": r.branch == "nonlinear",
            "single pos.": not r.augment_positives, "augm. pos.": r.augment_positives,
            "single-dir.": (not bidir) if emb else None, "bi-dir.": bidir if emb else None,
            "nbr. sampl.": r.neighbourhood_sampling if emb else None,
            "nbr. constr.": r.neighbourhood_constraints if emb else None}


def _distributed(strategy, sampler, data):
    """Each replica embeds its block of every global Algorithm 1 batch."""
    return distribute.distributed_stream(
        strategy, sampler.dataset, lambda ds: sampling.attach_phrase_features(ds, data))


def build_config(r, image_dim: int, text_dim: int, constraints: bool = False):
    hidden = () if r.branch == "linear" else (r.hidden_dim,)
    return TwoBranchConfig(
        kind=r.model, image_dim=image_dim, text_dim=text_dim, image_hidden=hidden, text_hidden=hidden,
        embed_dim=r.embed_dim, layout=r.layout, dropout=r.dropout,
        similarity_head=SIMILARITY_HEADS[r.similarity_head_layers], margin=r.margin, top_k=r.top_k,
        image_anchor_weight=r.image_anchor_weight, text_anchor_weight=r.text_anchor_weight,
        image_neighbour_weight=r.image_neighbour_weight if constraints else 0.0,
        text_neighbour_weight=r.text_neighbour_weight if constraints else 0.0)


def check_flags(r) -> None:
    if r.model != "embedding":
        return
    if r.neighbourhood_constraints and not r.neighbourhood_sampling:
        raise UserInputError("--neighbourhood_constraints needs --neighbourhood_sampling (TPAMI §4.2)")
    if r.image_anchor_weight == 0 and r.text_anchor_weight == 0:
        raise UserInputError("--image_anchor_weight and --text_anchor_weight are both 0: no ranking loss")


class _CCAScorer:
    """Adapts a fitted CCA to the model interface of the phrase-localization evaluation."""
    similarity_head = None

    def __init__(self, cca):
        self.cca = cca

    def embed_images(self, x, batch_size=None):
        return self.cca.transform_images(np.asarray(x))

    def embed_texts(self, x, batch_size=None):
        return self.cca.transform_texts(np.asarray(x))


def _positive_pairs(data):
    """(region, phrase-feature row) of every ground-truth pair: CCA is trained on positives only."""
    return data.chain_gt_region[data.phrase_chain], data.phrase_feature_index


def _sampler(r, data, seed, hard_negatives=None):
    if r.model == "embedding":
        return sampling.PhraseTripletSampler(
            data, batch_size=min(r.batch_size, data.num_phrases), augment_positives=r.augment_positives,
            neighbourhood_sampling=r.neighbourhood_sampling,
            negatives_per_phrase=r.negatives_per_phrase or None, hard_negatives=hard_negatives,
            max_hard_negatives=r.max_hard_negatives, seed=seed)
    return sampling.PhrasePairSampler(data, batch_size=min(r.batch_size, data.num_phrases),
                                augment_positives=r.augment_positives,
                                max_positives_per_phrase=r.max_positives_per_phrase or None, seed=seed)


def _set_loss(model, **weights) -> None:
    model.config = dataclasses.replace(model.config, **weights)
    model.train_function = None   # retrace: the loss weights are read when the step is traced


def train_model(r, data, run_dir: pathlib.Path, typed: dict | None = None) -> tuple[object, dict]:
    """Trains the embedding/similarity network on the training split; returns (model, info)."""
    config = build_config(r, data.region_features.shape[1], data.phrase_features.shape[1])
    tcfg = train_config(r, epochs=r.epochs, learning_rate=r.learning_rate)
    strategy = setup_training(r)
    with strategy.scope():
        model = build_model(config)
    run_config = {"model": config.to_dict(), "train": tcfg.__dict__,
                  **run_record(r, typed),
                  "task": "two_branch_region_phrase"}
    trainer.prepare_run_dir(run_dir, run_config)
    info = {"stages": []}
    sampler = _sampler(r, data, r.seed)
    steps = sampler.steps_per_epoch
    with strategy.scope():
        model.compile(optimizer=trainer.make_optimizer(tcfg, steps), jit_compile=r.jit_compile,
                          run_eagerly=r.run_eagerly)
    history = trainer.train(model, _distributed(strategy, sampler, data), tcfg, run_dir,
                            steps_per_epoch=steps)
    info["stages"].append({"name": "main", "epochs": r.epochs, "loss": history.history["loss"]})
    epoch = r.epochs
    if r.model == "embedding" and r.neighbourhood_constraints and r.constraint_epochs:
        _set_loss(model, image_neighbour_weight=r.image_neighbour_weight,
                  text_neighbour_weight=r.text_neighbour_weight)
        sampler = _sampler(r, data, r.seed + 1)
        history = trainer.train(model, _distributed(strategy, sampler, data), tcfg, run_dir,
                                steps_per_epoch=steps, initial_epoch=epoch, epochs=epoch + r.constraint_epochs)
        epoch += r.constraint_epochs
        info["stages"].append({"name": "neighbourhood_constraints", "epochs": r.constraint_epochs,
                               "loss": history.history["loss"]})
    if r.model == "embedding" and r.hard_negative_epochs:
        regions = l2_normalize_rows(model.embed_images(np.asarray(data.region_features)))
        phrases = l2_normalize_rows(model.embed_texts(np.asarray(data.phrase_features)))
        hard = sampling.mine_hard_negatives(data, regions, phrases, max_per_phrase=r.max_hard_negatives)
        _set_loss(model, image_neighbour_weight=0.0, text_neighbour_weight=0.0)
        sampler = _sampler(r, data, r.seed + 2, hard_negatives=hard)
        history = trainer.train(model, _distributed(strategy, sampler, data), tcfg, run_dir,
                                steps_per_epoch=steps, initial_epoch=epoch,
                                epochs=epoch + r.hard_negative_epochs)
        info["stages"].append({"name": "hard_negatives", "epochs": r.hard_negative_epochs,
                               "num_hard_negatives": int(len(hard.region_index)),
                               "loss": history.history["loss"]})
    info["final_loss"] = float(info["stages"][-1]["loss"][-1])
    info["steps_per_epoch"] = steps
    # The saved config is the one the final weights were trained with.
    run_config["model"] = model.config.to_dict()
    json_files.write_json(run_dir / "run_config.json", run_config)
    info["run_config"] = run_config
    return model, info


def evaluate_test_phrases(scorer, test, layout) -> tuple[dict, dict]:
    """From one scoring of the test phrases' proposals: the row's metrics (R@K at IoU >= 0.5,
    `evaluation.phrase_localization`) and its grounding summary (`evaluation.grounding`: the
    pointing game of the top-ranked proposal's centre, box R@1, the phrases' fingerprint)."""
    scores, valid = score_phrases_with_model(scorer, test)
    iou, _ = test.phrase_proposal_iou()
    metrics = phrase_localization_recall(scores, iou, valid, phrase_types=test.phrase_types())
    # The same phrases, read by the pointing game's own reader (one rule for every localizer).
    queries = pointing_queries(layout.entities_dir, test.image_ids)
    keys = [[(p.image_id, p.sentence_index, p.phrase_index) for p in items] for items in (queries, test.examples)]
    if keys[0] != keys[1]:
        raise UserInputError(f"{layout.entities_dir}: the pointing game reads {len(queries)} phrases of the "
                             f"test images, the region data holds {test.num_phrases}: not the same phrases")
    pointing = box_grounding(queries, top_proposal_boxes(scores, valid, test))
    return metrics, grounding_summary(phrase_fingerprint(queries), len(queries), pointing, rule="top_proposal",
                                      box_metrics=metrics)


def _phrase_split_fingerprint(test) -> str:
    """`split_fingerprint` of the test images and their phrases (in example order)."""
    index = {image_id: i for i, image_id in enumerate(test.image_ids)}
    return split_fingerprint(test.image_ids, [e.phrase for e in test.examples],
                             [index[e.image_id] for e in test.examples])


def run(r: LocalizationRecipe, typed: dict | None = None, flagfile: str | None = None) -> dict:
    """Runs one Table 1 row; returns the results record (also written as JSON).

    `typed`: the fields the user set (the embedded profile fills in only the others);
    `flagfile`: the row's flagfile, which names its run folder when `r.run_dir` is empty.
    """
    start = time.time()
    r, _ = prepare(dataclasses.replace(r), typed)
    check_flags(r)
    row_name = r.row_name or "two_branch_region_phrase"
    run_dir = pathlib.Path(r.run_dir) if r.run_dir else table_runner.run_folder(None, flagfile, row_name)
    layout, data = load_data(r)
    train, test = data["train"], data["test"]
    record = {"row": row_name, "system": "two_branch", "task": "two_branch_region_phrase",
              "dataset_dir": str(layout.root), "run_dir": str(run_dir),
              **run_record(r, typed),
              "paper": paper_numbers(r.paper_results), "marks": table_marks(r),
              "num_train_phrases": train.num_phrases, "num_test_phrases": test.num_phrases,
              "num_test_images": len(test.image_ids),
              # No retrieval here: phrases are localized among their own image's proposals.
              "protocol": "phrase_localization", "test_split_fingerprint": _phrase_split_fingerprint(test),
              "proposals_per_image": float(np.mean(test.num_proposals)),
              "random_baseline": random_localization_metrics(test, seed=r.seed)}
    if r.model == "cca":
        regions, rows = _positive_pairs(train)
        cca = CCABaseline(n_components=min(r.cca_components, train.region_features.shape[1],
                                           train.phrase_features.shape[1]), seed=r.seed)
        cca.fit(np.asarray(train.region_features[regions]), np.asarray(train.phrase_features[rows]))
        record["metrics"], record["grounding"] = evaluate_test_phrases(_CCAScorer(cca), test, layout)
    else:
        model, info = train_model(r, train, run_dir, typed)
        record.update({k: v for k, v in info.items() if k != "run_config"})
        record["metrics"], record["grounding"] = evaluate_test_phrases(model, test, layout)
        # Everything experiments.two_branch_draw needs besides --run_dir.
        cache = pathlib.Path(r.features_cache) if r.features_cache else layout.root / "features"
        record["inputs"] = phrase_localization_inputs(layout, cache, feature_spec(r))
        if r.export and is_chief():
            # The end-to-end export (JPEG + proposals + phrases -> scores): what
            # two_branch_draw --saved_model and TF Serving take.
            record["export_dir"] = str(export_phrase_localization_run(
                model, record["inputs"], run_dir / "export",
                run_config={**info["run_config"], "inputs": record["inputs"]}))
    record["seconds"] = time.time() - start
    write_results(r.out_json or run_dir / "results.json", record)
    return record


# --------------------------------------------------------------------------- table


def format_localization_table(title: str, rows: list[dict], ks=(1, 5, 10)) -> str:
    """TPAMI Table 1 layout: checkmark columns, our R@K and the paper's R@K."""
    name_w = max([len(r["name"]) for r in rows] + [20])
    mark_w = [max(len(c), 3) for c in TABLE_COLUMNS]
    head = (f"{'Method':{name_w}} | " + " ".join(f"{c:^{w}}" for c, w in zip(TABLE_COLUMNS, mark_w))
            + " | " + "".join(f"{'R@' + str(k):>7}" for k in ks) + " |" + "".join(
                f"{'paper R@' + str(k):>11}" for k in ks))
    lines = [title, "=" * len(head), head, "-" * len(head)]
    for r in rows:
        marks = r.get("marks") or {}
        cells = []
        for c, w in zip(TABLE_COLUMNS, mark_w):
            v = marks.get(c)
            cells.append(f"{('√' if v else '-') if v is not None else '':^{w}}")
        m = r["metrics"]
        paper = list(r.get("paper") or [])
        paper += [None] * (len(ks) - len(paper))
        lines.append(f"{r['name']:{name_w}} | " + " ".join(cells) + " | "
                     + "".join(f"{m[f'r{k}']:7.2f}" for k in ks) + " |"
                     + "".join(f"{p:11.2f}" if p is not None else f"{'-':>11}" for p in paper[:len(ks)]))
    lines.append("-" * len(head))
    if any(r.get("smoke") for r in rows):
        lines.append(SMOKE_LINE)
    if rows:
        ub = rows[0]["metrics"].get("upper_bound")
        lines.append(f"Upper bound (a proposal with IoU >= 0.5 exists): {ub:.2f} "
                     f"(paper, 200 EdgeBoxes: R@200 = 84.58)")
    return "\n".join(lines)


def format_per_type(metrics: dict) -> str:
    per = metrics.get("per_type") or {}
    lines = ["Per phrase type R@1 / R@5 / R@10 (phrases):"]
    for t, m in per.items():
        lines.append(f"  {t:12s} {m['r1']:6.2f} {m['r5']:6.2f} {m['r10']:6.2f}  ({m['num_phrases']})")
    return "\n".join(lines)


def format_chance(record: dict) -> str:
    m = record["random_baseline"]
    return (f"chance (random proposal scores): R@1 {m['r1']:.2f}  R@5 {m['r5']:.2f}  "
            f"R@10 {m['r10']:.2f}  (upper bound {m['upper_bound']:.2f})")


def table_row(record: dict) -> dict:
    return {"name": record["row"], "metrics": record["metrics"], "paper": localization_paper_beside(record),
            "marks": record["marks"], "smoke": is_smoke(record)}


_table_row = table_row
