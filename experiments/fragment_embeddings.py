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

With `--rows`, each row's flagfile (``karpathy_table{2,3}_*.cfg``) runs with the other flags
given here in ``runs/<flagfile stem>`` (as alone; a table resumes: `tf_twobranch.table_runner`),
and the tables are printed beside the paper's numbers; the results go to `--out_json`.

The flags become a `FragmentRecipe` once per row (`recipe_from_flags`); the
data, model configuration, schedule and evaluation are the library's
(`tf_twobranch.systems.fragments.pipeline`), the tables
`experiments.fragment_tables`. A finished row loads with
``tf_twobranch.runs.load_run(run_dir)`` (no absl): its
``model.evaluate(run.evaluation_split())`` gives its results.json metrics.

With no --dataset_dir the embedded digit scenes are used (their
``captions.conllu`` parses, ``proposals.h5`` boxes and the scene CNN) with
the small profile below.
"""
from __future__ import annotations

import pathlib
import sys
import time

import keras
from absl import app, flags, logging

from experiments import common, fragment_tables
from experiments.fragment_tables import format_record
from tf_twobranch import table_runner
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.evaluation import retrieval
from tf_twobranch.systems.fragments.export import export_fragment_model
from tf_twobranch.systems.fragments.losses import GLOBAL_SCORES, MIL_ZERO_SCORES
from tf_twobranch.systems.fragments.model import build_fragment_model
from tf_twobranch.systems.fragments import pipeline
from tf_twobranch.systems.fragments.pipeline import FragmentRecipe
from tf_twobranch.systems.fragments import sampling as fragment_batches
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
    common.define_runner_flags(fv, rows_help="Run these row flagfiles (names in experiments/configs or "
                               "paths; 'all': every karpathy_table<N>_*.cfg of --table) and print the tables.")
    flags.DEFINE_enum("table", "all", ["2", "3", "all"], "Rows of Table 2 (Flickr8K), Table 3 "
                      "(Flickr30K) or both (--rows=all).", **d)
    common.define_smoke_flag(fv)


def recipe_from_flags(f) -> tuple[FragmentRecipe, dict]:
    """The row's recipe (its flags' values, the embedded profile applied) and the flags the user typed."""
    typed = common.typed_flags(f)
    return common.prepare_recipe(FragmentRecipe.from_flags(f), typed, EMBEDDED_PROFILE, "fragment_embedding")[0], typed


def run(f, flagfile: str | None = None) -> dict:
    """Runs one table row of the flags `f` (its recipe is built here, once); returns its results record."""
    return run_recipe(*recipe_from_flags(f), flagfile=flagfile)


def run_recipe(r: FragmentRecipe, typed: dict | None = None, flagfile: str | None = None) -> dict:
    """Runs one table row (in `r.run_dir`, else ``runs/<flagfile stem>``); returns the results record."""
    start = time.time()
    row_name = r.row_name or "fragment_embeddings"
    run_dir = pathlib.Path(r.run_dir) if r.run_dir else table_runner.run_folder(None, flagfile, row_name)
    data = pipeline.load_data(r)
    splits, images, text = data.splits, data.images, data.text
    evaluation = splits[r.eval_split]
    protocol = common.resolve_protocol(r, evaluation.num_images, split=f"the {r.eval_split} split")
    saved = {"typed_flags": typed or {}, "recipe": r.to_dict()}     # the recipe after its protocol is resolved
    record = {"row": row_name, "task": "fragment_embeddings", "dataset": str(data.source), **saved,
              "run_dir": str(run_dir),
              "paper": common.paper_numbers(r.paper_results), "paper_dataset": r.paper_dataset,
              "paper_protocol": r.paper_protocol, "num_train_images": splits["train"].num_images,
              "num_eval_images": evaluation.num_images, "num_eval_captions": evaluation.num_captions,
              **common.split_record(protocol, evaluation),
              "fragments": text.stats, "stages": []}
    random_metrics = retrieval.random_baseline_metrics(evaluation.num_images, evaluation.caption_image,
                                                       protocol=r.protocol, seed=r.seed)
    if r.random_ranking:
        record.update(metrics=random_metrics, random_baseline=random_metrics, seconds=time.time() - start)
        common.write_json(r.out_json or run_dir / "results.json", record)
        return record
    config = pipeline.build_config(r, images, text)
    strategy = common.setup_training(r)
    with strategy.scope():
        model = build_fragment_model(config, text.word_vectors.vectors)
    if config.image_head_dim:
        kernel, bias = images["train"].head
        model.image_head.set_weights([kernel, bias])
    if r.init_from:
        record["init_from"] = pipeline.initial_weights(model, r.init_from)
    train_inputs = pipeline.image_inputs(images["train"], config)
    train_text = text.splits["train"]
    sentences = fragment_batches.padded_sentence_arrays(train_text.relation, train_text.word1, train_text.word2,
                                                        train_text.row_splits)
    steps = r.steps_per_epoch or fragment_batches.steps_per_epoch(splits["train"].num_captions, r.batch_size)
    for stage, first, end in pipeline.stage_epochs(r):
        stage_dir = run_dir / f"stage{stage}"
        with strategy.scope():
            model.mil.assign(r.mil and stage == 2)
            if model.image_head is not None:
                model.image_head.trainable = stage == 2
            optimizer = keras.optimizers.SGD(pipeline.stage_learning_rate(r, steps, first, end), momentum=r.momentum)
            model.compile(optimizer=optimizer, jit_compile=r.jit_compile, run_eagerly=r.run_eagerly)
        tcfg = common.train_config(r, epochs=end, learning_rate=r.learning_rate, seed=r.seed + stage,
                                   optimizer="sgd")

        def dataset(start_step=0, stage=stage):
            return fragment_batches.train_dataset(train_inputs, images["train"].mask, sentences,
                                                  splits["train"].caption_image, batch_size=r.batch_size,
                                                  seed=r.seed + stage, start_step=start_step)

        trainer.prepare_run_dir(stage_dir, {"model": config.to_dict(), "train": tcfg.__dict__, **saved,
                                            "stage": stage, "task": "fragment_embeddings"})
        model.save_config(stage_dir / config.FILE_NAME, relations=text.relations,
                          words=text.word_vectors.words, stage=stage)
        stage_start = time.time()
        history = trainer.train(model, dataset, tcfg, stage_dir, steps_per_epoch=steps, initial_epoch=first,
                                epochs=end)
        metrics = model.evaluate(pipeline.evaluation_split(r, data, config))
        logging.info("%s - stage %d: %s", row_name, stage, {k: round(v, 2) for k, v in metrics.items()})
        record["stages"].append({"stage": stage, "epochs": [first, end], "mil": bool(model.mil.numpy()),
                                 "cnn_trained": bool(model.image_head is not None and stage == 2),
                                 "steps_per_epoch": steps, "optimizer_steps": int(model.optimizer.iterations.numpy()),
                                 "history": {k: [float(x) for x in v] for k, v in history.history.items()},
                                 "metrics": metrics, "seconds": time.time() - stage_start,
                                 "run_dir": str(stage_dir)})
    record["metrics"] = record["stages"][-1]["metrics"]
    record["random_baseline"] = random_metrics
    record["grounding"] = pipeline.grounding(r, data, model)
    if r.export and config.representation == "fragments" and common.is_chief():
        # JPEG bytes + boxes in where the row's CNN is known (its feature inputs stay beside them).
        cnn, note = pipeline.serving_image_cnn(r, data, config)
        if note:
            logging.info("export: %s", note)
        record["export_dir"] = str(export_fragment_model(
            model, run_dir / "export", relations=text.relations, words=text.word_vectors.words, image_cnn=cnn,
            run_config={"model": config.to_dict(), **saved, "export_notes": [note] if note else []}))
    record["seconds"] = time.time() - start
    common.write_json(r.out_json or run_dir / "results.json", record)
    return record


def run_rows(f, argv) -> dict:
    """--rows through `fragment_tables.run_rows`: the flags of `argv` not the runner's go to every row."""
    return fragment_tables.run_rows(f, argv, define_flags, run)


def _main() -> None:
    f = flags.FLAGS
    if f.rows:
        run_rows(f, sys.argv)
        return
    record = run(f, flagfile=table_runner.flagfile_of(sys.argv))
    print(format_record(record))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")
    print(fragment_tables.follow_up(record))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
