r"""Phrase localization with two-branch networks (TPAMI Table 1, §4).

    python -m experiments.phrase_localization \
        --flagfile=experiments/configs/table1_b5_nonlinear_augm_bidir_nbr_sampling.cfg
    python -m experiments.phrase_localization --rows=all      # every Table 1 row, then the table

With no --dataset_dir the embedded digit-scene dataset is generated (once)
and used, with its proposals.h5. For Flickr30K Entities pass --dataset_dir
(Sentences/, Annotations/, train/val/test.txt, images/), --proposals
(200 EdgeBoxes per image; HDF5 or a directory, see
tf_twobranch.data.formats.proposals) and --image_backbone=vgg16
--backbone_weights=<local file>.

Training follows §4.3: Adam 1e-3, batches of 100 ground-truth
region–phrase pairs (Algorithm 1), no dropout, branches 4096→1024→512;
``--epochs`` with the bi-directional terms (and neighbourhood sampling when
on), then ``--constraint_epochs`` more with λ3/λ4 switched on when
``--neighbourhood_constraints``; optionally ``--hard_negative_epochs`` of the
CVPR 2016 stage (≤ 50 mined hard negatives per unique phrase, λ3 = λ4 = 0).
The test split is scored with R@1/5/10 at IoU ≥ 0.5, the proposals' upper
bound and a per-type breakdown.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

import numpy as np
from absl import app, flags, logging

from experiments import common
from tf_twobranch import distribute, json_files
from tf_twobranch.baselines.cca import CCABaseline
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.data.corpus import split_fingerprint
from tf_twobranch.data.embedded import load_embedded_dataset
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.evaluation.phrase_localization import (evaluate_phrase_localization,
                                                         random_localization_metrics)
from tf_twobranch.export.localization import export_phrase_localization_run
from tf_twobranch.features.prepare_regions import (RegionFeatureSpec, phrase_localization_inputs,
                                                   prepare_phrase_localization)
from tf_twobranch.models.two_branch import TwoBranchConfig, build_model
from tf_twobranch.sampling import phrase_localization as sampling
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


def apply_embedded_profile(f) -> dict:
    return common.apply_embedded_profile(f, EMBEDDED_PROFILE)


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    # Data and features.
    common.define_data_flags(fv, dataset_help="Flickr30K Entities-style folder; empty: the "
                             "embedded dataset.", limit_images=True)
    flags.DEFINE_string("proposals", "", "Proposals file/folder (default <dataset_dir>/proposals.h5, "
                        "generated with the built-in generator when absent).", **d)
    flags.DEFINE_integer("max_proposals", 200, "Proposals ranked per image (the paper: 200 EdgeBoxes).",
                         lower_bound=1, **d)
    flags.DEFINE_bool("clip_proposals", False, "Clip proposals that stick out of their image (for "
                      "crops and IoU alike, count logged); default: such a file is refused as being "
                      "at the wrong scale.", **d)
    common.define_feature_flags(
        fv, text_encoders=["fisher_hglmm", "fisher_gmm", "mean_vector", "tfidf"],
        image_help="CNN for the single-crop region features.",
        text_help="Phrase representation (fitted on the training phrases).")
    # Model, Algorithm 1 and the loss.
    common.define_two_branch_flags(
        fv, hidden_dim=1024, dropout=0.0, top_k=30, text_anchor_weight=4.0,
        text_neighbour_weight=0.1, batch_size=100, epochs=8, learning_rate=1e-3,
        helps={"layout": "original: FC-BN-ReLU-FC (reference code; linear = FC-L2 as §4.2); "
                         "paper: FC-ReLU-FC-BN.",
               "top_k": "K violating triplets kept per positive pair.",
               "image_anchor_weight": "λ1: region-anchor term; 0 = single-directional.",
               "text_anchor_weight": "λ2: phrase-anchor (phrase-to-region) term.",
               "text_neighbour_weight": "λ4 (used only with --neighbourhood_constraints).",
               "batch_size": "Ground-truth region–phrase pairs per batch.",
               "epochs": "Epochs of the first stage.",
               "learning_rate": "Adam learning rate (§4.3)."})
    flags.DEFINE_integer("similarity_head_layers", 3, "FC layers after the element-wise product "
                         "(1: 512→1, 2: 512→512→1, 3: 512→512→256→1).", lower_bound=1, upper_bound=3, **d)
    flags.DEFINE_bool("augment_positives", True, "Positive region augmentation (IoU >= 0.7).", **d)
    flags.DEFINE_bool("neighbourhood_sampling", False, "Algorithm 1 step 3c.", **d)
    flags.DEFINE_bool("neighbourhood_constraints", False, "Switch on λ3/λ4 for the --constraint_epochs "
                      "stage (needs neighbourhood sampling).", **d)
    flags.DEFINE_float("image_neighbour_weight", 0.1, "λ3 (used only with --neighbourhood_constraints).",
                       lower_bound=0.0, **d)
    flags.DEFINE_integer("negatives_per_phrase", 0, "Cap on IoU<0.3 regions drawn per coreference chain "
                         "(0 = all, as the paper).", lower_bound=0, **d)
    flags.DEFINE_integer("max_positives_per_phrase", 0, "Similarity network: positives kept per pair "
                         "(0 = all).", lower_bound=0, **d)
    # Training stages.
    flags.DEFINE_integer("constraint_epochs", 2, "Further epochs with λ3/λ4 on (only with "
                         "--neighbourhood_constraints).", lower_bound=0, **d)
    flags.DEFINE_integer("hard_negative_epochs", 0, "CVPR 2016 stage: epochs after mining hard negatives "
                         "(bi-directional terms only).", lower_bound=0, **d)
    flags.DEFINE_integer("max_hard_negatives", 50, "Hard negatives kept per unique phrase.", lower_bound=1, **d)
    common.define_run_flags(
        fv, export_help="Write the end-to-end SavedModel (image bytes, proposals and phrases -> "
        "scores; signature score_proposals) to <run_dir>/export.",
        paper_results_help="The paper's R@1,R@5,R@10 for this row (fewer when the paper gives fewer).")


def feature_spec(f):
    max_images = {s: n for s, n in (("train", f.max_train_images), ("test", f.max_test_images)) if n}
    return RegionFeatureSpec(image_backbone=f.image_backbone, backbone_weights=f.backbone_weights or None,
                             scene_cnn_epochs=f.scene_cnn_epochs, proposals=f.proposals or None,
                             max_proposals=f.max_proposals, text_encoder=f.text_encoder,
                             word_vectors=f.word_vectors or None, word_dim=f.word_dim, pca_dim=f.pca_dim,
                             max_images=max_images or None, clip_proposals=f.clip_proposals,
                             seed=f.seed)


def dataset_layout(f, dataset_dir=None):
    """The dataset folder (`dataset_dir`, else --dataset_dir, else the embedded dataset with its
    proposals), resolved once with --images_dir and --proposals."""
    dataset_dir = dataset_dir or f.dataset_dir
    dataset_dir = pathlib.Path(dataset_dir) if dataset_dir else load_embedded_dataset()
    if not dataset_dir.is_dir():
        raise common.UserInputError(f"--dataset_dir={dataset_dir}: directory does not exist")
    return resolve_dataset(dataset_dir, images_dir=f.images_dir or None, proposals=f.proposals or None)


def load_data(f):
    """(the dataset layout, {"train": PhraseLocalizationData, "test": ...})."""
    layout = dataset_layout(f)
    cache = pathlib.Path(f.features_cache) if f.features_cache else layout.root / "features"
    return layout, prepare_phrase_localization(layout, cache, feature_spec(f), ("train", "test"))


def table_marks(f) -> dict:
    """The row's Table 1 checkmarks (None for columns that do not apply)."""
    emb = f.model == "embedding"
    if f.model == "cca":
        return {c: None for c in TABLE_COLUMNS}
    bidir = f.image_anchor_weight > 0
    return {"linear": f.branch == "linear", "non-linear": f.branch == "nonlinear",
            "single pos.": not f.augment_positives, "augm. pos.": f.augment_positives,
            "single-dir.": (not bidir) if emb else None, "bi-dir.": bidir if emb else None,
            "nbr. sampl.": f.neighbourhood_sampling if emb else None,
            "nbr. constr.": f.neighbourhood_constraints if emb else None}


def _distributed(strategy, sampler, data):
    """Each replica embeds its block of every global Algorithm 1 batch."""
    return distribute.distributed_stream(
        strategy, sampler.dataset, lambda ds: sampling.attach_phrase_features(ds, data))


def build_config(f, image_dim: int, text_dim: int, constraints: bool = False):
    hidden = () if f.branch == "linear" else (f.hidden_dim,)
    return TwoBranchConfig(
        kind=f.model, image_dim=image_dim, text_dim=text_dim, image_hidden=hidden, text_hidden=hidden,
        embed_dim=f.embed_dim, layout=f.layout, dropout=f.dropout,
        similarity_head=SIMILARITY_HEADS[f.similarity_head_layers], margin=f.margin, top_k=f.top_k,
        image_anchor_weight=f.image_anchor_weight, text_anchor_weight=f.text_anchor_weight,
        image_neighbour_weight=f.image_neighbour_weight if constraints else 0.0,
        text_neighbour_weight=f.text_neighbour_weight if constraints else 0.0)


def check_flags(f) -> None:
    if f.model != "embedding":
        return
    if f.neighbourhood_constraints and not f.neighbourhood_sampling:
        raise common.UserInputError("--neighbourhood_constraints needs --neighbourhood_sampling (TPAMI §4.2)")
    if f.image_anchor_weight == 0 and f.text_anchor_weight == 0:
        raise common.UserInputError("--image_anchor_weight and --text_anchor_weight are both 0: no ranking loss")


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


def _sampler(f, data, seed, hard_negatives=None):
    if f.model == "embedding":
        return sampling.PhraseTripletSampler(
            data, batch_size=min(f.batch_size, data.num_phrases), augment_positives=f.augment_positives,
            neighbourhood_sampling=f.neighbourhood_sampling,
            negatives_per_phrase=f.negatives_per_phrase or None, hard_negatives=hard_negatives,
            max_hard_negatives=f.max_hard_negatives, seed=seed)
    return sampling.PhrasePairSampler(data, batch_size=min(f.batch_size, data.num_phrases),
                                augment_positives=f.augment_positives,
                                max_positives_per_phrase=f.max_positives_per_phrase or None, seed=seed)


def _set_loss(model, **weights) -> None:
    model.config = dataclasses.replace(model.config, **weights)
    model.train_function = None   # retrace: the loss weights are read when the step is traced


def train_model(f, data, run_dir: pathlib.Path, typed: dict | None = None) -> tuple[object, dict]:
    """Trains the embedding/similarity network on the training split; returns (model, info)."""
    config = build_config(f, data.region_features.shape[1], data.phrase_features.shape[1])
    tcfg = common.train_config(f, epochs=f.epochs, learning_rate=f.learning_rate)
    strategy = common.setup_training(f)
    with strategy.scope():
        model = build_model(config)
    run_config = {"model": config.to_dict(), "train": tcfg.__dict__,
                  **common.flag_record(f, typed),
                  "task": "phrase_localization"}
    trainer.prepare_run_dir(run_dir, run_config)
    info = {"stages": []}
    sampler = _sampler(f, data, f.seed)
    steps = sampler.steps_per_epoch
    with strategy.scope():
        model.compile(optimizer=trainer.make_optimizer(tcfg, steps), jit_compile=f.jit_compile,
                          run_eagerly=f.run_eagerly)
    history = trainer.train(model, _distributed(strategy, sampler, data), tcfg, run_dir,
                            steps_per_epoch=steps)
    info["stages"].append({"name": "main", "epochs": f.epochs, "loss": history.history["loss"]})
    epoch = f.epochs
    if f.model == "embedding" and f.neighbourhood_constraints and f.constraint_epochs:
        _set_loss(model, image_neighbour_weight=f.image_neighbour_weight,
                  text_neighbour_weight=f.text_neighbour_weight)
        sampler = _sampler(f, data, f.seed + 1)
        history = trainer.train(model, _distributed(strategy, sampler, data), tcfg, run_dir,
                                steps_per_epoch=steps, initial_epoch=epoch, epochs=epoch + f.constraint_epochs)
        epoch += f.constraint_epochs
        info["stages"].append({"name": "neighbourhood_constraints", "epochs": f.constraint_epochs,
                               "loss": history.history["loss"]})
    if f.model == "embedding" and f.hard_negative_epochs:
        regions = l2_normalize_rows(model.embed_images(np.asarray(data.region_features)))
        phrases = l2_normalize_rows(model.embed_texts(np.asarray(data.phrase_features)))
        hard = sampling.mine_hard_negatives(data, regions, phrases, max_per_phrase=f.max_hard_negatives)
        _set_loss(model, image_neighbour_weight=0.0, text_neighbour_weight=0.0)
        sampler = _sampler(f, data, f.seed + 2, hard_negatives=hard)
        history = trainer.train(model, _distributed(strategy, sampler, data), tcfg, run_dir,
                                steps_per_epoch=steps, initial_epoch=epoch,
                                epochs=epoch + f.hard_negative_epochs)
        info["stages"].append({"name": "hard_negatives", "epochs": f.hard_negative_epochs,
                               "num_hard_negatives": int(len(hard.region_index)),
                               "loss": history.history["loss"]})
    info["final_loss"] = float(info["stages"][-1]["loss"][-1])
    info["steps_per_epoch"] = steps
    # The saved config is the one the final weights were trained with.
    run_config["model"] = model.config.to_dict()
    json_files.write_json(run_dir / "run_config.json", run_config)
    info["run_config"] = run_config
    return model, info


def _phrase_split_fingerprint(test) -> str:
    """`split_fingerprint` of the test images and their phrases (in example order)."""
    index = {image_id: i for i, image_id in enumerate(test.image_ids)}
    return split_fingerprint(test.image_ids, [e.phrase for e in test.examples],
                             [index[e.image_id] for e in test.examples])


def run(f) -> dict:
    """Runs one Table 1 row; returns the results record (also written as JSON)."""
    start = time.time()
    typed = common.typed_flags(f)  # before the embedded profile fills in defaults
    profile = apply_embedded_profile(f)
    if profile:
        logging.info("embedded dataset: using its profile defaults %s", profile)
    check_flags(f)
    row_name = f.row_name or "phrase_localization"
    run_dir = pathlib.Path(f.run_dir) if f.run_dir else common.REPO_ROOT / "runs" / common.slug(row_name)
    layout, data = load_data(f)
    train, test = data["train"], data["test"]
    record = {"row": row_name, "task": "phrase_localization", "dataset_dir": str(layout.root),
              **common.flag_record(f, typed),
              "paper": common.paper_numbers(f.paper_results), "marks": table_marks(f),
              "num_train_phrases": train.num_phrases, "num_test_phrases": test.num_phrases,
              "num_test_images": len(test.image_ids),
              # No retrieval here: phrases are localized among their own image's proposals.
              "protocol": "phrase_localization", "test_split_fingerprint": _phrase_split_fingerprint(test),
              "proposals_per_image": float(np.mean(test.num_proposals)),
              "random_baseline": random_localization_metrics(test, seed=f.seed)}
    if f.model == "cca":
        regions, rows = _positive_pairs(train)
        cca = CCABaseline(n_components=min(f.cca_components, train.region_features.shape[1],
                                           train.phrase_features.shape[1]), seed=f.seed)
        cca.fit(np.asarray(train.region_features[regions]), np.asarray(train.phrase_features[rows]))
        record["metrics"] = evaluate_phrase_localization(_CCAScorer(cca), test)
    else:
        model, info = train_model(f, train, run_dir, typed)
        record.update({k: v for k, v in info.items() if k != "run_config"})
        record["metrics"] = evaluate_phrase_localization(model, test)
        # Everything experiments.draw_localization needs besides --run_dir.
        cache = pathlib.Path(f.features_cache) if f.features_cache else layout.root / "features"
        record["inputs"] = phrase_localization_inputs(layout, cache, feature_spec(f))
        if f.export and common.is_chief():
            # The end-to-end export (JPEG + proposals + phrases -> scores): what
            # draw_localization --saved_model and TF Serving take.
            record["export_dir"] = str(export_phrase_localization_run(
                model, record["inputs"], run_dir / "export",
                run_config={**info["run_config"], "inputs": record["inputs"]}))
    record["seconds"] = time.time() - start
    common.write_json(f.out_json or run_dir / "results.json", record)
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


def _table_row(record: dict) -> dict:
    return {"name": record["row"], "metrics": record["metrics"], "paper": record["paper"],
            "marks": record["marks"]}


def run_rows(configs, overrides=(), export_row: str = "b5", out_json=None) -> list[dict]:
    """Runs several flagfiles (each in its own FlagValues) and prints the Table 1 layout."""
    records, start = [], time.time()
    for cfg in configs:
        cfg = common.resolve_config(str(cfg))
        export = bool(export_row) and export_row in cfg.stem
        # A --run_dir given for all rows is their parent folder.
        parent = next((o.split("=", 1)[1] for o in overrides if o.startswith("--run_dir=")), None)
        row_overrides = [o for o in overrides if not o.startswith("--run_dir=")]
        run_dir = pathlib.Path(parent) / cfg.stem if parent else common.REPO_ROOT / "runs" / cfg.stem
        fv = common.parse_flagfile(define_flags, str(cfg),
                                   [*row_overrides, f"--export={str(export).lower()}", f"--run_dir={run_dir}"])
        print(f"\n=== {cfg.name}: {fv.row_name}", flush=True)
        record = run(fv)
        records.append(record)
        print(format_localization_table(cfg.stem, [_table_row(record)]), flush=True)
    first = records[0]
    print()
    print(format_localization_table(
        f"Table 1-style phrase localization on {first['dataset_dir']} ({first['num_test_phrases']} test "
        f"phrases, {first['proposals_per_image']:.0f} proposals per image); paper numbers: Flickr30K Entities",
        [_table_row(r) for r in records]))
    print(format_chance(first))
    out = out_json or common.REPO_ROOT / "runs" / "table1.json"
    common.write_json(out, {"rows": records, "seconds": time.time() - start})
    print(f"results: {out} ({time.time() - start:.0f} s)")
    return records


def _main() -> None:
    f = flags.FLAGS
    if f.rows:
        names = (sorted(common.CONFIG_DIR.glob("table1_*.cfg")) if f.rows == ["all"] else f.rows)
        overrides = [a for a in sys.argv[1:] if a.startswith("-")
                     and a.lstrip("-").split("=", 1)[0] not in ("rows", "flagfile")]
        run_rows(names, overrides)
        return
    record = run(f)
    print(format_localization_table(
        f"Phrase localization ({record['num_test_phrases']} test phrases); paper numbers: Flickr30K Entities",
        [_table_row(record)]))
    print(format_chance(record))
    print(format_per_type(record["metrics"]))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    flags.DEFINE_list("rows", [], "Run these Table 1 flagfiles (names in experiments/configs or paths; "
                      "'all' = every table1_*.cfg) and print the whole table; other flags go to every row.")
    app.run(main, flags_parser=parse_flags)
