"""One row of the fifth system: train on a dataset folder's train split, evaluate on its test split.

    python -m tests.fifth_system.experiment --flagfile=tests/fifth_system/smoke.cfg   (from the repository root)

The leaderboard calls `define_flags` and `run` as it calls every experiment's.
"""
from __future__ import annotations

import pathlib

import keras
import numpy as np
import tensorflow as tf
from absl import flags

from tf_twobranch.data.from_flags import dataset_folder
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.data.text_codes import build_text_vocabulary, encode_captions
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.evaluation.split import EvaluationSplit
from tf_twobranch.features.images import load_images_at_size
from tf_twobranch.run_loading import record_feature_split
from tf_twobranch.run_records import write_results
from tf_twobranch.tables import split_record
from tf_twobranch.training import trainer

from tests.fifth_system.model import MeanVectorConfig, build_model

TASK = "mean_vectors"


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("dataset_dir", "", "Dataset folder; empty: the embedded data.", **d)
    flags.DEFINE_string("run_dir", "", "The run folder (required).", **d)
    flags.DEFINE_integer("seed", 0, "Seed of the weights and the batches.", **d)
    flags.DEFINE_integer("epochs", 4, "Training epochs.", lower_bound=1, **d)
    flags.DEFINE_integer("batch_size", 16, "Images per batch (one caption each).", lower_bound=2, **d)
    flags.DEFINE_float("learning_rate", 0.01, "Adam's learning rate.", **d)
    flags.DEFINE_integer("embed_dim", 16, "Joint-space size.", lower_bound=1, **d)
    flags.DEFINE_string("protocol", "full", "Evaluation protocol of the test split.", **d)
    flags.DEFINE_bool("export", True, "Also write the SavedModel to <run_dir>/export.", **d)
    flags.DEFINE_integer("verbose", 0, "Keras verbosity.", **d)


def token_rows(captions, vocabulary, max_len: int) -> np.ndarray:
    rows = np.zeros((len(captions), max_len), np.int32)
    for i, codes in enumerate(encode_captions(captions, vocabulary)):
        rows[i, :min(len(codes), max_len)] = codes[:max_len]
    return rows


def _batches(pixels, tokens, caption_image, batch_size: int, seed: int, start_step: int):
    """Step i's batch: `batch_size` distinct images of the epoch's permutation, one of each one's
    captions drawn at random; a function of the step, so a resumed run sees the same stream."""
    images = len(pixels)
    steps = images // batch_size
    by_image = [np.flatnonzero(caption_image == i) for i in range(images)]
    step = start_step
    while True:
        epoch, k = divmod(step, steps)
        picked = np.random.default_rng([seed, epoch]).permutation(images)[k * batch_size:(k + 1) * batch_size]
        draw = np.random.default_rng([seed, epoch, k])
        captions = [by_image[i][draw.integers(len(by_image[i]))] for i in picked]
        yield {"image": pixels[picked], "text": tokens[captions]}
        step += 1


def run(fv: flags.FlagValues) -> dict:
    if not fv.run_dir:
        raise flags.IllegalFlagValueError("--run_dir is required")
    run_dir = pathlib.Path(fv.run_dir)
    layout = resolve_dataset(dataset_folder(fv.dataset_dir or None, with_proposals=False))
    corpora = load_caption_splits(layout)
    train, test = corpora["train"], corpora["test"]
    vocabulary = build_text_vocabulary(tokenize_caption(c) for c in train.captions)
    config = MeanVectorConfig(vocabulary_size=len(vocabulary), embed_dim=fv.embed_dim)

    def inputs(corpus):
        pixels = load_images_at_size(layout.image_paths(corpus.image_ids), config.image_size)
        return pixels, token_rows(corpus.captions, vocabulary, config.max_len)

    (train_pixels, train_tokens), (test_pixels, test_tokens) = inputs(train), inputs(test)
    keras.utils.set_random_seed(fv.seed)
    model = build_model(config)
    steps = len(train_pixels) // fv.batch_size
    spec = {"image": tf.TensorSpec([fv.batch_size, config.image_size, config.image_size, 3], tf.uint8),
            "text": tf.TensorSpec([fv.batch_size, config.max_len], tf.int32)}

    def dataset(start_step=0):
        return tf.data.Dataset.from_generator(
            lambda: _batches(train_pixels, train_tokens, train.caption_image, fv.batch_size, fv.seed, start_step),
            output_signature=spec)

    tcfg = trainer.TrainConfig(epochs=fv.epochs, learning_rate=fv.learning_rate, seed=fv.seed, verbose=fv.verbose)
    trainer.prepare_run_dir(run_dir, {"model": config.to_dict(), "task": TASK, "flags": fv.flag_values_dict()})
    model.save_config(run_dir / config.FILE_NAME, vocabulary=vocabulary)
    history = trainer.train(model, dataset, tcfg, run_dir, steps_per_epoch=steps)
    split = EvaluationSplit(test_pixels, test_tokens, test.caption_image, protocol=fv.protocol)
    record = {"task": TASK, "system": "mean_vectors", "metrics": model.evaluate(split),
              **split_record({"protocol": fv.protocol}, test),
              "evaluation": record_feature_split(run_dir, split), "flags": fv.flag_values_dict(),
              "history": {k: [float(v) for v in vs] for k, vs in history.history.items()}}
    write_results(run_dir / "results.json", record)
    if fv.export:
        from tests.fifth_system.export import write_export
        write_export(model, run_dir / "export", vocabulary, record)
    return record
