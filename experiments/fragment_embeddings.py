r"""Deep fragment embeddings (Karpathy, Joulin & Fei-Fei, NIPS 2014): Tables 2 and 3.

    python -m experiments.fragment_embeddings --flagfile=experiments/configs/karpathy_table2_fragment_global_mil.cfg
    python -m experiments.fragment_embeddings --rows=all          # every row, printed beside the paper

Image fragments (the whole image and its top 19 proposals through the CNN)
and sentence fragments (dependency triplets of the captions' CoNLL-U parses)
are embedded in one space; trained with C_F + β·C_G + α‖θ‖²; evaluated with
S_kl over every test image–sentence pair through the one evaluation core.

Schedule (§3.4): SGD with momentum 0.9, batches of 100 distinct images each
with one random sentence, `--epochs` 20. With `--mil` or `--fine_tune_cnn`
the run has two stages in ``<run_dir>/stage1`` and ``stage2``: the first
`--mil_start` epochs (paper: half; the authors' code: 0.75·epochs) with C_0
and the CNN frozen, the rest with MIL labels and (with `--fine_tune_cnn`)
the CNN's top layer trained. The learning rate drops ×0.1 for the last
`--lr_drop_epochs` epochs. `--init_from` starts from another run's weights.

With `--rows`, each row's flagfile (``karpathy_table{2,3}_*.cfg``) is run
with the other flags given here, and the tables are printed in the paper's
layout with the paper's numbers; the results go to `--out_json`.

With no --dataset_dir the embedded digit scenes are used (their
``captions.conllu`` parses, ``proposals.h5`` boxes and the scene CNN) with
the small profile below.
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
from tf_twobranch.data.embedded import load_embedded_dataset
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.data.sentence_fragments import caption_keys
from tf_twobranch.evaluation import retrieval
from tf_twobranch.evaluation.fragment_retrieval import evaluate_fragment_retrieval
from tf_twobranch.export.fragment_embedding import export_fragment_model
from tf_twobranch.features.prepare_fragments import (FragmentFeatureSpec, FragmentTextSpec,
                                                     image_fragment_inputs, sentence_fragment_inputs)
from tf_twobranch.json_files import read_json_object
from tf_twobranch.losses.fragment import GLOBAL_SCORES, MIL_ZERO_SCORES
from tf_twobranch.models.fragment_embedding import (FragmentEmbeddingConfig, build_fragment_model,
                                                    load_fragment_config, save_fragment_config)
from tf_twobranch.sampling import fragment_batches
from tf_twobranch.training import trainer

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
PAPER_LAYOUT = ("R@1", "R@5", "R@10", "Med r")


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    common.define_data_flags(fv, dataset_help="Dataset folder (Flickr8K: Flickr8k.token.txt and "
                             "Flickr_8k.*Images.txt; Flickr30K: a token file or Karpathy JSON with "
                             "split lists), with its images; empty: the embedded dataset.",
                             caption_formats=["auto", "karpathy", "token", "coco"], limit_images=True)
    flags.DEFINE_enum("eval_split", "test", ["val", "test"], "Split to evaluate on.", **d)
    flags.DEFINE_enum("protocol", "full", ["full", "first_caption"],
                      "full: every test sentence; first_caption: each image's first sentence only "
                      "(Hodosh et al.'s protocol, the paper's * rows).", **d)
    # Sentences.
    flags.DEFINE_enum("parser", "conllu", ["conllu", "spacy"],
                      "conllu: read the captions' dependency parses from --parses (or the dataset's "
                      "<captions>.conllu); spacy: parse them with --spacy_model (pip install -e \".[parse]\").",
                      **d)
    flags.DEFINE_string("parses", "", "CoNLL-U parses of the captions (`# sent_id = <image>#<k>`).", **d)
    flags.DEFINE_string("spacy_model", "en_core_web_sm", "Installed spaCy model name or local model "
                        "folder (--parser=spacy); nothing is downloaded.", **d)
    flags.DEFINE_enum("fragments", "dependency", ["dependency", "bow", "bigram"],
                      "Sentence fragments: dependency triplets, words (BOW) or bigrams.", **d)
    flags.DEFINE_bool("collapse_prepositions", False, "Fold prep(g, p) + pobj(p, o) into prep_<p>(g, o) "
                      "as CoreNLP's collapsed dependencies (the paper's parser) do.", **d)
    flags.DEFINE_float("min_relation_fraction", 0.01, "Relation types under this fraction of the "
                       "training fragments are dropped.", lower_bound=0.0, upper_bound=0.99, **d)
    common.define_word_vector_flags(fv, word_dim_help="Word vector size W_e (the paper: 200).", word_dim=200)
    # Images.
    flags.DEFINE_string("features_cache", "", "Where image fragments are cached (default "
                        "<dataset_dir>/features).", **d)
    flags.DEFINE_enum("image_backbone", "scene_cnn", ["scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152"],
                      "CNN of the image fragments (scene_cnn: trained on the training images).", **d)
    flags.DEFINE_string("backbone_weights", "", "Local ImageNet weights file of the backbone.", **d)
    flags.DEFINE_integer("scene_cnn_epochs", 12, "Epochs of the scene_cnn backbone.", lower_bound=1, **d)
    flags.DEFINE_string("proposals", "", "Ranked region proposals (HDF5 file or folder); default "
                        "<dataset_dir>/proposals.h5.", **d)
    flags.DEFINE_integer("detections", 19, "Top-ranked boxes per image (+ the whole image).",
                         lower_bound=0, **d)
    flags.DEFINE_list("fragment_features", [], "Precomputed fragment features per split, "
                      "split=path pairs of (images, 20, D) .npy/.h5 arrays in split order "
                      "(instead of the CNN).", **d)
    flags.DEFINE_enum("image_fragments", "all", ["all", "fullframe"],
                      "all: the whole image + detections; fullframe: the whole image only.", **d)
    common.define_feature_storage_flag(fv)
    # Model and objective.
    flags.DEFINE_enum("representation", "fragments", ["fragments", "devise"],
                      "fragments: the paper's model; devise: the DeViSE baseline (mean word vector, "
                      "mean CNN feature, global objective).", **d)
    flags.DEFINE_bool("random_ranking", False, "The Random Ranking row: random scores, no training.", **d)
    flags.DEFINE_integer("embed_dim", 1000, "h, the fragment embedding size.", lower_bound=1, **d)
    flags.DEFINE_bool("shared_relation_weights", False, "One W_R for every relation (the authors' "
                      "code) instead of one per relation type (the paper).", **d)
    flags.DEFINE_bool("fragment_objective", True, "Use the fragment alignment objective C_F.", **d)
    flags.DEFINE_bool("global_objective", True, "Use the global ranking objective C_G.", **d)
    flags.DEFINE_bool("class_balanced", False, "C_0 with positives weighted 1/#pos and negatives "
                      "1/#neg per sentence fragment (the authors' code).", **d)
    # β, α, Δ and the learning rate are cross-validated in the paper; the
    # defaults are the authors' code's (DriverSetParams.m: gscale 0.5, regC/2,
    # lr 1e-5), its gmargin 40 rescaled to the paper's normaliser (BUILD_NOTES).
    flags.DEFINE_float("global_weight", 0.5, "β.", lower_bound=0.0, **d)
    flags.DEFINE_float("weight_decay", 1e-10, "α of α‖θ‖².", lower_bound=0.0, **d)
    flags.DEFINE_float("global_margin", 2.5, "Δ of the global ranking objective (the code: 40 with "
                       "its normaliser, whose S is about 15× the paper's).", lower_bound=0.0, **d)
    flags.DEFINE_float("smoothing", 5.0, "n of S_kl (the code's smoothnum: 10).", lower_bound=0.0, **d)
    flags.DEFINE_enum("normaliser", "paper", ["paper", "code"],
                      "S_kl normaliser: 1/(|g_k|(|g_l|+n)) (paper) or 1/(|g_l|+n) (code).", **d)
    flags.DEFINE_enum("global_score", "sum_relu", list(GLOBAL_SCORES),
                      "S_kl's accumulation over an image's fragments, in training and evaluation: "
                      "sum_relu Σ max(0, vᵀs) (the paper; the code's thrglobalscore=1, maxaccum=0); "
                      "sum Σ vᵀs (thrglobalscore=0); max_relu: each sentence fragment's best "
                      "max(0, vᵀs) (maxaccum=1); max: its best vᵀs (the code's DriverSetParams.m "
                      "defaults, 'the CVPR implementation').", **d)
    flags.DEFINE_enum("mil_zero_score", "negative", list(MIL_ZERO_SCORES),
                      "MIL label of a positive-bag pair scoring exactly 0 (an all-zero ReLU sentence "
                      "fragment): negative (y = -1), or ignored (no weight in C_F: the code's sign(0) = 0).",
                      **d)
    flags.DEFINE_bool("decay_biases", False, "Include the biases in α‖θ‖² (the paper's θ and the "
                      "authors' code decay every parameter); default: kernels only.", **d)
    # Training.
    flags.DEFINE_integer("epochs", 20, "Epochs (an epoch: num_sentences / batch_size steps).",
                         lower_bound=1, **d)
    flags.DEFINE_integer("steps_per_epoch", 0, "Steps per epoch; 0: the paper's epoch (every training "
                         "sentence once, num_sentences / batch_size steps). A smaller value shortens a "
                         "trial or benchmark run at the real dataset size.", lower_bound=0, **d)
    flags.DEFINE_integer("batch_size", 100, "Distinct images per batch, one sentence each.",
                         lower_bound=2, **d)
    flags.DEFINE_float("learning_rate", 1e-5, "SGD learning rate (cross-validated in the paper; the code: 1e-5).",
                       lower_bound=0.0, **d)
    flags.DEFINE_float("momentum", 0.9, "SGD momentum.", lower_bound=0.0, upper_bound=1.0, **d)
    flags.DEFINE_integer("lr_drop_epochs", 2, "The last this many epochs run at 0.1× the rate.",
                         lower_bound=0, **d)
    flags.DEFINE_bool("mil", False, "Second stage with the MIL fragment objective (eq. 5).", **d)
    flags.DEFINE_bool("fine_tune_cnn", False, "Second stage also trains the CNN's top layer "
                      "(scene_cnn backbone).", **d)
    flags.DEFINE_float("cnn_learning_rate_scale", 1.0, "With --fine_tune_cnn: the CNN top layer's "
                       "learning rate relative to --learning_rate.", lower_bound=0.0, **d)
    flags.DEFINE_enum("mil_start", "paper", ["paper", "code"],
                      "When the second stage starts: half the epochs (paper: 10 of 20) or 0.75·epochs "
                      "(the authors' code).", **d)
    flags.DEFINE_string("init_from", "", "Run directory (or .weights.h5) whose weights start the run.", **d)
    flags.DEFINE_string("paper_dataset", "Flickr8K", "Dataset of the paper numbers.", **d)
    common.define_run_flags(fv, export_help="Export the model as a SavedModel.",
                            paper_results_help="Paper numbers: R@1,R@5,R@10,Med r of image annotation "
                            "then image search.")
    # The table runner.
    flags.DEFINE_list("rows", [], "Run these row flagfiles (names in experiments/configs or paths; "
                      "'all': every karpathy_table<N>_*.cfg of --table) and print the tables.", **d)
    flags.DEFINE_enum("table", "all", ["2", "3", "all"], "Rows of Table 2 (Flickr8K), Table 3 "
                      "(Flickr30K) or both (--rows=all).", **d)
    flags.DEFINE_string("runs_dir", "", "Parent folder of the rows' run folders (--rows; default runs/).", **d)


# ---------------------------------------------------------------------------- data


def _fragment_feature_files(values) -> dict | None:
    return common.split_paths("fragment_features", values) or None


def load_data(f):
    """(dataset folder, layout, caption splits, image fragments, sentence fragments) of a row."""
    if f.dataset_dir and not pathlib.Path(f.dataset_dir).is_dir():
        raise common.UserInputError(f"--dataset_dir={f.dataset_dir}: dataset folder does not exist")
    source = pathlib.Path(f.dataset_dir) if f.dataset_dir else load_embedded_dataset()
    layout = resolve_dataset(source, caption_format=f.caption_format, images_dir=f.images_dir or None,
                             proposals=f.proposals or None)
    corpora = load_caption_splits(layout)
    splits = {}
    for name in ("train", f.eval_split):
        limit = f.max_train_images if name == "train" else f.max_test_images
        corpus = corpora[name]
        splits[name] = corpus.subset(corpus.image_ids[:limit], source=corpus.source) if limit else corpus
    parses = None
    if f.parser == "spacy":
        from tf_twobranch.data import spacy_parses  # spaCy is an optional extra: imported only when asked for
        nlp = spacy_parses.load_spacy_model(f.spacy_model)
        cache = pathlib.Path(f.features_cache or source / "features")
        parses = cache / f"parses_spacy_{common.slug(f.spacy_model)}_{len(splits['train'].captions)}.conllu"
        if not parses.exists():
            trees = {}
            for corpus in splits.values():
                trees.update(spacy_parses.parse_captions(nlp, corpus.captions, caption_keys(corpus)))
            parses.parent.mkdir(parents=True, exist_ok=True)
            spacy_parses.write_caption_parses(parses, trees)
    text = sentence_fragment_inputs(layout, splits, FragmentTextSpec(
        fragments=f.fragments, collapse_prepositions=f.collapse_prepositions,
        min_relation_fraction=f.min_relation_fraction, parses=f.parses or None,
        word_vectors=f.word_vectors or None, word_dim=f.word_dim, seed=f.seed), parses=parses)
    images = image_fragment_inputs(layout, splits, f.features_cache or source / "features", FragmentFeatureSpec(
        image_backbone=f.image_backbone, backbone_weights=f.backbone_weights or None,
        scene_cnn_epochs=f.scene_cnn_epochs, proposals=f.proposals or None, detections=f.detections,
        fragment_features=_fragment_feature_files(f.fragment_features), seed=f.seed,
        feature_dtype=f.feature_dtype))
    if f.image_fragments == "fullframe":
        for split in images.values():
            split.mask = split.mask.copy()
            split.mask[:, 1:] = False
    return source, layout, splits, images, text


# ---------------------------------------------------------------------------- model


def build_config(f, images, text) -> FragmentEmbeddingConfig:
    train = images["train"]
    head = f.fine_tune_cnn and train.head is not None
    if f.fine_tune_cnn and train.head is None:
        raise common.UserInputError("--fine_tune_cnn trains the CNN's top layer on cached activations: it needs "
                                    "--image_backbone=scene_cnn (precomputed --fragment_features and the "
                                    "ImageNet backbones give final features only)")
    return FragmentEmbeddingConfig(
        image_dim=int(train.inputs.shape[2] if head else (train.head[0].shape[1] if train.head else
                                                             train.inputs.shape[2])),
        num_relations=max(1, len(text.relations)), vocabulary_size=len(text.word_vectors.words),
        word_dim=text.word_vectors.dim, embed_dim=f.embed_dim,
        shared_relation_weights=f.shared_relation_weights, global_weight=f.global_weight,
        weight_decay=f.weight_decay, global_margin=f.global_margin, smoothing=f.smoothing,
        normaliser=f.normaliser, class_balanced=f.class_balanced, mil_zero_score=f.mil_zero_score,
        global_score=f.global_score, decay_biases=f.decay_biases,
        use_fragment_objective=f.fragment_objective and f.representation != "devise",
        use_global_objective=f.global_objective or f.representation == "devise",
        representation=f.representation, image_head_dim=int(train.head[0].shape[1]) if head else 0,
        cnn_learning_rate_scale=f.cnn_learning_rate_scale)


def image_inputs(split, config: FragmentEmbeddingConfig):
    """The model's image input of a split: the CNN features, or the activations below its top layer.

    A row-indexable array as the cache holds it (memory-mapped, float32 or
    float16): the batches and `embed_split` read it a chunk at a time.
    """
    return split.inputs if config.image_head_dim else split.features()


def _stage_epochs(f) -> list[tuple[int, int, int]]:
    """(stage, first epoch, end epoch) of each stage."""
    if not (f.mil or f.fine_tune_cnn):
        return [(1, 0, f.epochs)]
    switch = f.epochs // 2 if f.mil_start == "paper" else int(round(0.75 * f.epochs))
    switch = min(max(switch, 1), f.epochs - 1) if f.epochs > 1 else 0
    return [(1, 0, switch), (2, switch, f.epochs)] if switch else [(2, 0, f.epochs)]


def _learning_rate(f, steps_per_epoch: int, first_epoch: int, end_epoch: int):
    """The stage's rate: × 0.1 from epoch `epochs - lr_drop_epochs` on (steps counted from the stage start)."""
    drop = f.epochs - f.lr_drop_epochs
    if f.lr_drop_epochs == 0 or drop >= end_epoch:
        return f.learning_rate
    if drop <= first_epoch:
        return 0.1 * f.learning_rate
    return keras.optimizers.schedules.PiecewiseConstantDecay(
        [(drop - first_epoch) * steps_per_epoch], [f.learning_rate, 0.1 * f.learning_rate])


def _initial_weights(model, path: str) -> str:
    p = pathlib.Path(path)
    candidates = [p] if p.suffix == ".h5" else [p / s / "checkpoints" / "latest.weights.h5"
                                                for s in ("stage2", "stage1", ".")]
    weights = next((c for c in candidates if c.is_file()), None)
    if weights is None:
        raise common.UserInputError(f"--init_from={path}: no checkpoint found (looked for "
                                    f"{', '.join(map(str, candidates))})")
    load_checkpoint(model, weights)
    return str(weights)


# ---------------------------------------------------------------------------- evaluation


def embed_split(model, image_inputs, image_mask: np.ndarray, fragments, chunk: int = 256):
    """Embedded fragments of a split: v (N, M', h), mask (N, M'), s (total, h), row_splits.

    `image_inputs` (N, M, D) is read `chunk` images at a time (a memory map
    of the raw features is never loaded whole: 5,000 × 20 × 4,096 floats are
    1.6 GB, their embeddings at h = 1,000 0.4 GB).
    """
    vs, vms = [], []
    for i in range(0, len(image_inputs), chunk):
        v, vm = model.embed_images(np.asarray(image_inputs[i:i + chunk], np.float32), image_mask[i:i + chunk])
        vs.append(np.asarray(v))
        vms.append(np.asarray(vm))
    if model.config.representation == "devise":
        padded = fragment_batches.padded_sentence_arrays(fragments.relation, fragments.word1, fragments.word2,
                                                         fragments.row_splits)
        s, sm = model.embed_sentences(padded["relation"], padded["word1"], padded["word2"],
                                      padded["sentence_mask"])
        keep = np.asarray(sm)[:, 0]
        row_splits = np.concatenate([[0], np.cumsum(keep)]).astype(np.int64)
        return np.concatenate(vs), np.concatenate(vms), np.asarray(s)[keep, 0], row_splits
    s = [np.asarray(model.embed_sentence_fragments(fragments.relation[i:i + 65536], fragments.word1[i:i + 65536],
                                                   fragments.word2[i:i + 65536]))
         for i in range(0, max(1, len(fragments.relation)), 65536)]
    return np.concatenate(vs), np.concatenate(vms), np.concatenate(s), fragments.row_splits


def evaluate(model, image_inputs, image_mask, fragments, caption_image, protocol: str) -> dict:
    v, vm, s, row_splits = embed_split(model, image_inputs, image_mask, fragments)
    return evaluate_fragment_retrieval(v, vm, s, row_splits, caption_image, protocol,
                                       **model.config.score_options())


# ---------------------------------------------------------------------------- one row


def run(f) -> dict:
    """Runs one table row; returns the results record (also written as JSON)."""
    start = time.time()
    typed = common.typed_flags(f)
    applied = common.apply_embedded_profile(f, EMBEDDED_PROFILE)
    if applied:
        logging.info("embedded dataset: using its profile defaults %s", applied)
    row_name = f.row_name or "fragment_embeddings"
    run_dir = pathlib.Path(f.run_dir) if f.run_dir else common.REPO_ROOT / "runs" / common.slug(row_name)
    source, layout, splits, images, text = load_data(f)
    evaluation = splits[f.eval_split]
    protocol = common.resolve_protocol(f, evaluation.num_images, split=f"the {f.eval_split} split")
    record = {"row": row_name, "task": "fragment_embeddings", "dataset": str(source),
              **common.flag_record(f, typed),
              "paper": common.paper_numbers(f.paper_results), "paper_dataset": f.paper_dataset,
              "paper_protocol": f.paper_protocol, "num_train_images": splits["train"].num_images,
              "num_eval_images": evaluation.num_images, "num_eval_captions": evaluation.num_captions,
              **common.split_record(protocol, evaluation),
              "fragments": text.stats, "stages": []}
    random_metrics = retrieval.random_baseline_metrics(evaluation.num_images, evaluation.caption_image,
                                                       protocol=f.protocol, seed=f.seed)
    if f.random_ranking:
        record.update(metrics=random_metrics, random_baseline=random_metrics, seconds=time.time() - start)
        common.write_json(f.out_json or run_dir / "results.json", record)
        return record
    config = build_config(f, images, text)
    strategy = common.setup_training(f)
    with strategy.scope():
        model = build_fragment_model(config, text.word_vectors.vectors)
    if config.image_head_dim:
        kernel, bias = images["train"].head
        model.image_head.set_weights([kernel, bias])
    if f.init_from:
        record["init_from"] = _initial_weights(model, f.init_from)
    train_inputs = image_inputs(images["train"], config)
    sentences = fragment_batches.padded_sentence_arrays(
        text.splits["train"].relation, text.splits["train"].word1, text.splits["train"].word2,
        text.splits["train"].row_splits)
    steps = f.steps_per_epoch or fragment_batches.steps_per_epoch(splits["train"].num_captions, f.batch_size)
    for stage, first, end in _stage_epochs(f):
        stage_dir = run_dir / f"stage{stage}"
        with strategy.scope():
            model.mil.assign(f.mil and stage == 2)
            if model.image_head is not None:
                model.image_head.trainable = stage == 2
            optimizer = keras.optimizers.SGD(_learning_rate(f, steps, first, end), momentum=f.momentum)
            model.compile(optimizer=optimizer, jit_compile=f.jit_compile,
                          run_eagerly=f.run_eagerly)
        tcfg = common.train_config(f, epochs=end, learning_rate=f.learning_rate, seed=f.seed + stage,
                                   optimizer="sgd")

        def dataset(start_step=0, stage=stage):
            return fragment_batches.train_dataset(train_inputs, images["train"].mask, sentences,
                                                  splits["train"].caption_image, batch_size=f.batch_size,
                                                  seed=f.seed + stage, start_step=start_step)

        run_config = {"model": config.to_dict(), "train": tcfg.__dict__, **common.flag_record(f, typed),
                      "stage": stage, "task": "fragment_embeddings"}
        trainer.prepare_run_dir(stage_dir, run_config)
        save_fragment_config(stage_dir / "fragment_config.json", config, relations=text.relations,
                             words=text.word_vectors.words, stage=stage)
        stage_start = time.time()
        history = trainer.train(model, dataset, tcfg, stage_dir, steps_per_epoch=steps, initial_epoch=first,
                                epochs=end)
        metrics = evaluate(model, image_inputs(images[f.eval_split], config), images[f.eval_split].mask,
                           text.splits[f.eval_split], evaluation.caption_image, f.protocol)
        logging.info("%s - stage %d: %s", row_name, stage, {k: round(v, 2) for k, v in metrics.items()})
        record["stages"].append({"stage": stage, "epochs": [first, end], "mil": bool(model.mil.numpy()),
                                 "cnn_trained": bool(model.image_head is not None and stage == 2),
                                 "steps_per_epoch": steps, "optimizer_steps": int(model.optimizer.iterations.numpy()),
                                 "history": {k: [float(x) for x in v] for k, v in history.history.items()},
                                 "metrics": metrics, "seconds": time.time() - stage_start,
                                 "run_dir": str(stage_dir)})
    record["metrics"] = record["stages"][-1]["metrics"]
    record["random_baseline"] = random_metrics
    if f.export and config.representation == "fragments" and common.is_chief():
        record["export_dir"] = str(export_fragment_model(
            model, run_dir / "export", relations=text.relations, words=text.word_vectors.words,
            run_config={"model": config.to_dict(), **common.flag_record(f, typed)}))
    record["seconds"] = time.time() - start
    common.write_json(f.out_json or run_dir / "results.json", record)
    return record


def load_row(run_dir):
    """A finished row again: (flags, caption splits, image fragments, sentence fragments, model).

    The row's recorded flags rebuild its data (the fragment features come
    from the cache) and the last stage's checkpoint fills the model.
    """
    run_dir = pathlib.Path(run_dir)
    record = read_json_object(run_dir / "results.json", "fragment-embedding run record")
    if not record.get("stages"):
        raise common.UserInputError(f"{run_dir}: the run has no trained stage (a random-ranking row?)")
    f = flags.FlagValues()
    define_flags(f)
    f(["row"])
    for name, value in record["flags"].items():
        if name in f:
            f[name].value = value
    _, _, splits, images, text = load_data(f)
    stage_dir = pathlib.Path(record["stages"][-1]["run_dir"])
    config, _ = load_fragment_config(stage_dir / "fragment_config.json")
    model = build_fragment_model(config, text.word_vectors.vectors)
    load_checkpoint(model, stage_dir / "checkpoints" / "latest.weights.h5")
    return f, splits, images, text, model


# ---------------------------------------------------------------------------- tables


def format_rows(title: str, rows: list[dict], chance: dict | None = None) -> str:
    """The paper's Table 2/3 layout: R@1, R@5, R@10, Med r of annotation and search, rsum.

    A row's "paper" (8 numbers; None for a cell the paper lacks) is printed
    below it; `chance` (the random baseline's metrics) ends the table.
    """
    rows = [*rows, {"name": common.CHANCE_ROW, "metrics": chance}] if chance else list(rows)
    width = max([len(r["name"]) for r in rows] + [30])
    head = "".join(f"{c:>7}" for c in PAPER_LAYOUT)
    lines = [title, f"{'':{width}} | {'Image Annotation':^28} | {'Image Search':^28} |",
             f"{'Model':{width}} | {head} | {head} |   rsum", "-" * (width + 72)]

    def cells(values):
        return "".join(common.format_cell(v, 7, 1 if i % 4 < 3 else 0) for i, v in enumerate(values))

    def line(name, values):
        recalls = values[:3] + values[4:7]
        rsum = None if any(v is None for v in recalls) else sum(recalls)
        return f"{name:{width}} | {cells(values[:4])} | {cells(values[4:8])} | {common.format_cell(rsum, 6)}"

    for r in rows:
        m = r["metrics"]
        lines.append(line(r["name"], [m["i2t_r1"], m["i2t_r5"], m["i2t_r10"], m["i2t_medr"],
                                      m["t2i_r1"], m["t2i_r5"], m["t2i_r10"], m["t2i_medr"]]))
        if r.get("paper") and len(r["paper"]) == 8:
            lines.append(line("  (paper)", list(r["paper"])))
    return "\n".join(lines)


def format_record(record: dict) -> str:
    """One row beside the paper's numbers (when measured under the same protocol) and chance."""
    paper = common.paper_beside(record["paper"], record["paper_protocol"], record["protocol"],
                                record["num_eval_images"])
    title = common.table_title(record["row"], protocol=record["protocol"],
                               num_images=record["num_eval_images"], num_captions=record["num_eval_captions"],
                               paper=record["paper"], paper_dataset=record["paper_dataset"],
                               paper_protocol=record["paper_protocol"])
    return format_rows(title, [{"name": record["row"], "metrics": record["metrics"], "paper": paper}],
                       chance=record.get("random_baseline"))


# The rows in the order of the paper's tables.
ROW_ORDER = ("random_ranking", "devise", "fragment_objective", "global_objective", "fragment_global",
             "fullframe_only", "bow", "bigrams", "fragment_global_mil", "fine_tuned_cnn",
             "star_fragment_global_mil")


def _paper_order(cfg: pathlib.Path):
    key = cfg.stem.split("_", 2)[2]
    return (cfg.stem.split("_", 2)[1], ROW_ORDER.index(key) if key in ROW_ORDER else len(ROW_ORDER), key)


def _row_configs(f) -> list[pathlib.Path]:
    if f.rows == ["all"]:
        tables = ["2", "3"] if f.table == "all" else [f.table]
        return sorted((c for t in tables for c in common.CONFIG_DIR.glob(f"karpathy_table{t}_*.cfg")),
                      key=_paper_order)
    return [common.resolve_config(name) for name in f.rows]


_RUNNER_FLAGS = {"rows", "table", "runs_dir", "out_json", "run_dir", "row_name", "paper_results"}


def _finished(row) -> dict | None:
    """The results of a row already trained in its run folder with the same flags (a table resumes)."""
    path = pathlib.Path(row.run_dir) / "results.json"
    if not path.is_file():
        return None
    record = read_json_object(path, "fragment-embedding run record")
    same = record.get("typed_flags") == common.typed_flags(row)
    # Records written before protocols were checked and fingerprinted are run again.
    return record if same and "metrics" in record and "test_split_fingerprint" in record else None


def run_rows(f) -> dict:
    """Runs the rows of `--rows` and prints the tables.

    Each row runs once (a row shared by both tables is trained once); a row
    whose run folder already holds its results with the same flags is not
    trained again, so an interrupted table resumes.
    """
    configs = _row_configs(f)
    overrides = common.row_overrides(f, define_flags, _RUNNER_FLAGS)
    runs_dir = pathlib.Path(f.runs_dir) if f.runs_dir else common.REPO_ROOT / "runs"
    results, done = {}, {}
    for cfg in configs:
        row = common.parse_flagfile(define_flags, str(cfg), overrides)
        key = cfg.stem.split("_", 2)[2]          # the row without its table: shared by Tables 2 and 3
        row.run_dir = str(runs_dir / f"karpathy_{key}")
        if key not in done:
            done[key] = _finished(row) or None
            if done[key] is None:
                print(f"--- {cfg.name}: {row.row_name}", flush=True)
                done[key] = run(row)
            else:
                print(f"--- {cfg.name}: {row.row_name}: finished before, results of {row.run_dir}", flush=True)
        record = done[key]
        paper = common.paper_numbers(row.paper_results)
        results[cfg.stem] = {"name": row.row_name, "metrics": record["metrics"], "paper": paper,
                             "paper_dataset": row.paper_dataset, "paper_protocol": row.paper_protocol,
                             "paper_beside": common.paper_beside(paper, row.paper_protocol, record["protocol"],
                                                                  record["num_eval_images"]),
                             "protocol": record["protocol"],
                             "test_split_fingerprint": record["test_split_fingerprint"],
                             "num_eval_images": record["num_eval_images"],
                             "num_eval_captions": record["num_eval_captions"],
                             "random_baseline": record["random_baseline"],
                             "run_dir": row.run_dir, "seconds": record["seconds"]}
    out = {"rows": results}
    for table, dataset in (("2", "Flickr8K"), ("3", "Flickr30K")):
        rows = [r for stem, r in results.items() if stem.startswith(f"karpathy_table{table}_")]
        texts = []
        for group in common.groups_by_test_split(rows):
            first = group[0]
            title = common.table_title(
                f"Karpathy et al. Table {table} rows", dataset=done and next(iter(done.values()))["dataset"],
                protocol=first["protocol"], num_images=first["num_eval_images"],
                num_captions=first["num_eval_captions"], paper=any(r["paper"] for r in group),
                paper_dataset=dataset, paper_protocol=first["paper_protocol"])
            texts.append(format_rows(title, [{**r, "paper": r["paper_beside"]} for r in group],
                                     chance=first["random_baseline"]))
        if texts:
            text = "\n\n".join(texts)
            print(text)
            out[f"table{table}"] = text
    common.write_json(f.out_json or runs_dir / "karpathy_tables.json", out)
    return out


def _main() -> None:
    f = flags.FLAGS
    if f.rows:
        run_rows(f)
        return
    record = run(f)
    print(format_record(record))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
